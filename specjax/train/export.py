"""Writing a distilled drafter: ``OUT/drafter`` (safetensors + ``drafter.json``), loadable
with :func:`specjax.drafters.eagle.load_drafter`."""

from __future__ import annotations

import os
import shutil


def export_drafter(out: str, cfg, params: dict, sub_ids, target, extra: dict, save=None) -> str:
    """Write the drafter (``cfg``: its :class:`~specjax.drafters.eagle.EagleConfig`; ``params``:
    its trainable parameters; ``sub_ids``: its sub-vocabulary, int32) for ``target`` to
    ``out/drafter``, replacing an older one only once the new one is complete (written to
    ``out/drafter.tmp`` and renamed). ``extra``: JSON-ready training facts stored in
    ``drafter.json``. ``save``: the kind's writer ``save(path, cfg, params, sub_ids, target, extra=)``
    (default :func:`specjax.drafters.eagle.save_drafter`). Returns the directory."""
    if save is None:
        from specjax.drafters.eagle import save_drafter as save

    dd = os.path.join(out, "drafter")
    shutil.rmtree(dd + ".tmp", ignore_errors=True)
    save(dd + ".tmp", cfg, params, sub_ids, target, extra=extra)
    if os.path.exists(dd):
        shutil.rmtree(dd)
    os.replace(dd + ".tmp", dd)
    return dd
