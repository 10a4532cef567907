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
BLOCK_DRAFTER = "smollm2-135m-instruct-block"  # the block (DFlash-style) drafter: --draft shipped:<this>


def shipped_drafter_path(name: str = DEFAULT_DRAFTER):
    """The ``importlib.resources`` Traversable of a shipped drafter directory (an EAGLE drafter's
    ``drafter.json`` or a block drafter's ``block_drafter.json`` in it).

    Raises:
      CheckpointError: no such shipped drafter (names the ones that exist).
    """
    from specjax.drafters.registry import shipped_names

    if name not in shipped_names():
        raise CheckpointError(f"no shipped drafter {name!r} (shipped: {', '.join(shipped_names()) or 'none'}); "
                              "reinstall specjax, or train one with `specjax distill`")
    return resources.files("specjax.shipped_models") / name


def load_shipped_drafter(name: str, target, dtype: str = "float32"):
    """The shipped drafter ``name`` (a directory under ``models/``: ``--draft shipped:NAME``) bound
    to ``target``, EAGLE or block by its marker file; ``dtype`` as :func:`load_default_drafter`.

    Raises:
      CheckpointError: no such shipped drafter, or the target is not the model it was trained for.
    """
    from specjax.drafters import block, eagle

    p = shipped_drafter_path(name)
    if (p / block.MARKER).is_file():
        return block.load_drafter(p, target, dtype=dtype, name=f"shipped:{name}")
    return eagle.load_drafter(p, target, dtype=dtype, name="default" if name == DEFAULT_DRAFTER else f"shipped:{name}")


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
