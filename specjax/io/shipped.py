"""Drafters shipped inside the package (``models/`` in the repository, installed as
``specjax.shipped_models``).

``--draft default`` loads :data:`DEFAULT_DRAFTER`, the EAGLE-3-style feature drafter (fused
low/mid/high target features, training-time test) trained with ``specjax distill`` for the
default target (SmolLM2-135M-Instruct). Only the drafter's own weights are stored; the frozen
parts (token embedding, the sub-vocabulary rows of the tied LM head) are gathered from the
target at load time, after checking that the target is the one the drafter was trained for
(fingerprint of its config, a few weight tensors and its tokenizer).
"""

from __future__ import annotations

from importlib import resources

from specjax.models.config import CheckpointError

DEFAULT_DRAFTER = "smollm2-135m-instruct-eagle3"


def shipped_drafter_path(name: str = DEFAULT_DRAFTER):
    """The ``importlib.resources`` Traversable of a shipped drafter directory.

    Raises:
      CheckpointError: no such shipped drafter (names the ones that exist).
    """
    root = resources.files("specjax.shipped_models")
    p = root / name
    if not (p / "drafter.json").is_file():
        names = sorted(c.name for c in root.iterdir() if (c / "drafter.json").is_file()) if root.is_dir() else []
        raise CheckpointError(f"no shipped drafter {name!r} (shipped: {', '.join(names) or 'none'}); "
                              "reinstall specjax, or train one with `specjax distill`")
    return p


def load_default_drafter(target, dtype: str = "float32"):
    """The shipped drafter for the default model, bound to ``target``.

    Args:
      target: the loaded target (must be SmolLM2-135M-Instruct: same config, weights and tokenizer).
      dtype: ``"float32"``, ``"bfloat16"`` (weights rounded to bfloat16, computed in float32)
        or ``"int8"`` (:func:`specjax.drafters.eagle.quantize_params`).

    Raises:
      CheckpointError: the target is not the model the drafter was trained for.
    """
    from specjax.drafters import eagle

    return eagle.load_drafter(shipped_drafter_path(), target, dtype=dtype, name="default")
