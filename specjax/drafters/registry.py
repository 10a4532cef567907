"""The drafter kinds, declared once: how a ``--draft`` value names each, its cheap pre-load check,
how it loads, the :class:`~specjax.core.drafting.Drafter` class it gives (whose declarations —
trees, feature layers, cost shape — are the kind's) and its training entry for ``specjax distill``.

A ``--draft`` value is ``none`` (no drafter) or belongs to the first kind of :data:`KINDS` whose
``matches`` accepts it:

- ``ngram``: ``ngram`` or ``ngram:N``, prompt lookup (:class:`~specjax.drafters.ngram.NgramDrafter`);
- ``default``: the EAGLE-3 drafter shipped for the default model (:mod:`specjax.io.shipped`);
- ``shipped``: ``shipped:NAME``, any drafter shipped under ``models/`` (:func:`shipped_names`; e.g.
  ``shipped:smollm2-135m-instruct-block``, the block drafter for the default model);
- ``block``: a block (DFlash-style parallel) drafter directory (``block_drafter.json``,
  :class:`~specjax.drafters.block.BlockDrafter`): one drafter pass per round;
- ``eagle``: a drafter directory written by ``specjax distill`` (``drafter.json``);
- ``eagle3-head``: a published EAGLE-3 head directory (``config.json`` naming ``LlamaForCausalLMEagle3``;
  EAGLE authors / SpecForge / AngelSlim layout, :mod:`specjax.drafters.eagle3_head`);
- ``model``: a draft-model checkpoint (a directory with ``config.json``, a ``.gguf`` file) or a hub
  id — it takes every path or hub id the kinds before it did not (keep it last).

A new kind adds its module(s) under ``specjax/drafters/`` and one :class:`DrafterKind` here;
the CLI, :mod:`specjax.api`, the loop and measurement ask the registry and the drafter.
Loading the ``default``, ``shipped`` and ``model`` kinds needs :mod:`specjax.io` (a later layer): their
``load`` is ``None`` here and :func:`specjax.api.load_drafter` supplies it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from specjax.core.drafting import MAX_NGRAM, Drafter
from specjax.drafters import block, eagle
from specjax.drafters.block import BlockDrafter
from specjax.drafters.eagle import EagleDrafter
from specjax.drafters.eagle3_head import Eagle3HeadDrafter
from specjax.drafters.eagle3_head_files import check_head_dir, is_head_dir, load_head
from specjax.drafters.model import ModelDrafter
from specjax.drafters.ngram import NgramDrafter

DRAFT_CHOICES = "none, ngram[:N], default, shipped:NAME, or a drafter PATH_OR_ID"
SHIPPED_PREFIX = "shipped:"


@dataclasses.dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter a ``--draft`` value can name.

    name: the kind's name (``specjax distill --arch NAME`` for a trainable kind).
    what: how messages name a drafter of this kind (``"a draft model"``).
    drafter: the :class:`~specjax.core.drafting.Drafter` subclass it loads; its class-level
      declarations are the kind's (:attr:`proposes_trees`).
    matches: ``matches(spec) -> bool``, cheap (the string, or a file that marks a directory);
      kinds are tried in :data:`KINDS` order.
    check: ``check(spec)``, the pre-load check (nothing is loaded); raises ValueError.
    load: ``load(spec, target, dtype) -> drafter``; ``None``: loaded by :func:`specjax.api.load_drafter`
      (the loading needs :mod:`specjax.io`).
    marker: the JSON file that marks a drafter directory of this kind (``None``: not a directory);
      :func:`specjax.api.check_draft_spec` checks a directory's JSON and weights files.
    weights: the weights file a directory of this kind must hold (``None``: none named), checked
      before the target loads (:func:`specjax.api.check_drafter_files`).
    trainer: ``"module:function"`` of its ``specjax distill --arch NAME`` training entry (called
      with the parsed arguments), or ``None`` (not trainable).
    """

    name: str
    what: str
    drafter: type
    matches: Callable[[str], bool]
    check: Callable[[str], None]
    load: Callable[[str, Any, str], Drafter] | None = None
    marker: str | None = None
    trainer: str | None = None
    weights: str | None = None

    @property
    def proposes_trees(self) -> bool:
        """Whether its drafters propose trees of any top-k (else trees of top-k 1 only: their chain)."""
        return bool(self.drafter.proposes_trees)


# --------------------------------------------------------------------------- ngram
def _is_ngram(spec: str) -> bool:
    return spec == "ngram" or spec.startswith("ngram:")


def _ngram_size(spec: str) -> str:
    return spec.split(":", 1)[1] if ":" in spec else "3"


def _check_ngram(spec: str) -> None:
    n = _ngram_size(spec)
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"--draft {spec!r}: the n-gram size must be an integer >= 1, e.g. ngram:3")
    if int(n) > MAX_NGRAM:
        raise ValueError(f"--draft {spec!r}: the n-gram size must be <= {MAX_NGRAM}; use ngram:{MAX_NGRAM} or "
                         "less (e.g. ngram:3, the default)")


def _load_ngram(spec: str, target, dtype: str) -> NgramDrafter:
    return NgramDrafter(max_ngram=int(_ngram_size(spec)))


# --------------------------------------------------------------------------- eagle (a distilled drafter directory)
def _has_file(spec: str, name: str) -> bool:
    return os.path.isfile(os.path.join(os.path.expanduser(spec), name))


def _load_eagle(spec: str, target, dtype: str) -> EagleDrafter:
    path = os.path.expanduser(spec)
    return eagle.load_drafter(path, target, dtype=dtype, name=os.path.basename(os.path.normpath(path)))


def _load_block(spec: str, target, dtype: str) -> BlockDrafter:
    path = os.path.expanduser(spec)
    return block.load_drafter(path, target, dtype=dtype, name=os.path.basename(os.path.normpath(path)))


def _load_head(spec: str, target, dtype: str) -> Eagle3HeadDrafter:
    return load_head(os.path.expanduser(spec), target, dtype=dtype)


def _check_head(spec: str) -> None:
    check_head_dir(spec)


# --------------------------------------------------------------------------- shipped:NAME
def shipped_names() -> list[str]:
    """The drafters shipped inside the package (``models/``, installed as ``specjax.shipped_models``):
    the directories holding an EAGLE (``drafter.json``) or block (:data:`block.MARKER`) drafter, sorted."""
    from importlib import resources

    root = resources.files("specjax.shipped_models")
    if not root.is_dir():
        return []
    return sorted(c.name for c in root.iterdir()
                  if (c / "drafter.json").is_file() or (c / block.MARKER).is_file())


def _check_shipped(spec: str) -> None:
    name = spec[len(SHIPPED_PREFIX):]
    names = shipped_names()
    if name not in names:
        raise ValueError(f"--draft {spec}: no shipped drafter {name!r}; shipped: "
                         f"{', '.join(SHIPPED_PREFIX + n for n in names) or 'none (reinstall specjax)'}")


# --------------------------------------------------------------------------- model (a draft-model checkpoint or hub id)
def _is_model(spec: str) -> bool:
    """Any path or hub id (the kinds before it took theirs): the checks name what is wrong."""
    path = os.path.expanduser(spec)
    return os.path.exists(path) or spec.endswith(".gguf") or spec.startswith((".", "/", "~")) or "/" in spec


def _check_model(spec: str) -> None:
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, KINDS["model"].marker)):
            markers = [KINDS["model"]] + [k for k in KINDS.values() if k.marker and k.name != "model"]
            raise ValueError(f"--draft {spec!r}: the directory has no "
                             f"{' or '.join(f'{k.marker} ({k.what})' for k in markers)}; use {DRAFT_CHOICES}")
        return
    if os.path.exists(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"--draft {spec!r}: not a .gguf file or a checkpoint directory; use {DRAFT_CHOICES}")
        return
    if spec.endswith(".gguf") or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise ValueError(f"--draft {spec!r}: no such file or directory; use {DRAFT_CHOICES}")


def _no_check(spec: str) -> None:
    return None


# --------------------------------------------------------------------------- the kinds (recognition order)
KINDS: dict[str, DrafterKind] = {k.name: k for k in (
    DrafterKind("ngram", "n-gram prompt lookup", NgramDrafter, _is_ngram, _check_ngram, load=_load_ngram),
    DrafterKind("default", "the shipped drafter", EagleDrafter, lambda s: s == "default", _no_check),
    # shipped EAGLE and block drafters both propose trees of any top-k (the one class-level declaration read)
    DrafterKind("shipped", "a shipped drafter", BlockDrafter, lambda s: s.startswith(SHIPPED_PREFIX), _check_shipped),
    DrafterKind("block", "a block drafter from specjax distill", BlockDrafter,
                lambda s: _has_file(s, block.MARKER), _no_check, load=_load_block, marker=block.MARKER,
                trainer="specjax.train.block_distill:run", weights="model.safetensors"),
    DrafterKind("eagle", "a drafter from specjax distill", EagleDrafter, lambda s: _has_file(s, "drafter.json"),
                _no_check, load=_load_eagle, marker="drafter.json", trainer="specjax.train.distill:run",
                weights="model.safetensors"),
    DrafterKind("eagle3-head", "a published EAGLE-3 head", Eagle3HeadDrafter, is_head_dir, _check_head,
                load=_load_head),  # before model: a head's directory has a config.json too
    DrafterKind("model", "a draft model", ModelDrafter, _is_model, _check_model, marker="config.json"),  # keep last
)}


def find_kind(spec) -> DrafterKind | None:
    """The kind of a ``--draft`` value, or ``None`` (no drafter, not a string, or no kind takes it).
    Reads no weights."""
    if not isinstance(spec, str) or spec == "none":
        return None
    return next((k for k in KINDS.values() if k.matches(spec)), None)


def kind_of(spec) -> DrafterKind | None:
    """The kind of a ``--draft`` value (``None`` for ``None`` / ``"none"``: no drafter), without its
    pre-load check.

    Raises:
      ValueError: not a string, or a value no kind takes (names the accepted values).
    """
    if spec is None or spec == "none":
        return None
    if not isinstance(spec, str):
        raise ValueError(f"--draft must be a string ({DRAFT_CHOICES}), got {spec!r}")
    kind = find_kind(spec)
    if kind is None:
        raise ValueError(f"unknown --draft value {spec!r}; use {DRAFT_CHOICES}")
    return kind


def check_spec(spec) -> DrafterKind | None:
    """:func:`kind_of` and the kind's pre-load check (its files' JSON and weights are checked by
    :func:`specjax.api.check_draft_spec`). Raises ValueError."""
    kind = kind_of(spec)
    if kind is not None:
        kind.check(spec)
    return kind


def proposes_trees(spec) -> bool:
    """Whether the drafter of a ``--draft`` value proposes trees of any top-k (its kind's
    :class:`~specjax.core.drafting.Drafter` class says); ``False`` for no drafter or an unknown value."""
    kind = find_kind(spec)
    return kind is not None and kind.proposes_trees


def kind_words(spec) -> str:
    """How messages name the drafter of a ``--draft`` value: its kind's ``what`` (an unknown value:
    the ``model`` kind's, the kind that takes paths and hub ids)."""
    return (find_kind(spec) or KINDS["model"]).what


def marker_files() -> tuple[str, ...]:
    """The JSON files that mark a drafter directory, one per directory kind (in :data:`KINDS` order)."""
    return tuple(k.marker for k in KINDS.values() if k.marker)


def trainable_kinds() -> list[str]:
    """The kinds ``specjax distill --arch`` can train (those with a training entry)."""
    return [k.name for k in KINDS.values() if k.trainer]


def trainer_of(name: str) -> str:
    """The training entry (``"module:function"``) of the kind ``name``.

    Raises:
      ValueError: an unknown kind or a kind without a training entry (names the trainable kinds).
    """
    kind = KINDS.get(name)
    why = "unknown drafter kind" if kind is None else f"drafter kind {name!r} has no training entry"
    if kind is None or kind.trainer is None:
        raise ValueError(f"--arch {name}: {why}; trainable kinds: {', '.join(trainable_kinds())}")
    return kind.trainer
