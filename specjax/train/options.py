"""The options of ``specjax distill``: the settings a run records in ``run.json``, their
validation, and checks of the output directory and of ``--bench-gammas``."""

from __future__ import annotations

import os

from specjax.train.common import DistillError
from specjax.train.records import read_records, read_split

# the options a run records in DIR/run.json (a --resume continues with the recorded values)
RUN_KEYS = ("model", "prompts", "split", "steps", "seed", "batch_size", "lr", "eval_every", "data", "sub_vocab",
            "intermediate", "window", "max_new_tokens", "gen_batch", "topk", "ce_weight", "unroll_weight",
            "warmup", "checkpoint_every", "chat", "weight_decay", "max_prompt_tokens", "onpolicy_after", "gamma",
            "data_dir", "ce", "samples_per_prompt", "data_temperature", "copy_ngram", "init_from", "self_prompts",
            "train_only", "feature_layers", "ttt_steps", "text_corpus", "text_tokens", "text_window", "data_ids")
# what a block-drafter run (--arch block, :mod:`specjax.train.block_distill`) records besides RUN_KEYS
BLOCK_KEYS = ("arch", "block_size", "layers", "anchors", "position_decay", "anchor_feature")
# settings added after runs were recorded: a resumed run whose run.json lacks one gets this value (what
# such a run did), not the resuming command line's
ADDED_KEYS = {"data_ids": None, "anchor_feature": False}
# the options only the EAGLE trainer reads, with their defaults (the CLI's defaults: specjax.cli.distill);
# a block run given another value refuses it rather than ignore it
EAGLE_ONLY_DEFAULTS = {"onpolicy_after": 0, "gamma": 4, "ttt_steps": 3, "ce_weight": 1.0, "ce": "full",
                       "unroll_weight": 0.5}


# (option, smallest allowed value, what it means) for distill's numeric options
_MIN = [("steps", 0, "training steps; 0 = only generate the data set"), ("batch_size", 1, "windows per step"),
        ("warmup", 0, "warm-up steps"),
        ("eval_every", 0, "steps between evaluations, 0 = off"), ("checkpoint_every", 1, "steps between checkpoints"),
        ("onpolicy_after", 0, "steps"), ("gamma", 1, "draft tokens per round"), ("sub_vocab", 1, "head rows"),
        ("intermediate", 1, "MLP width"), ("copy_ngram", 0, "0 = none"), ("self_prompts", 0, "prompts"),
        ("window", 2, "positions per window"), ("max_new_tokens", 1, "tokens"), ("max_prompt_tokens", 1, "tokens"),
        ("gen_batch", 1, "prompts per batch"), ("samples_per_prompt", 1, "continuations"),
        ("topk", 1, "probabilities per position"), ("ttt_steps", 1, "unrolled training steps"),
        ("text_tokens", 1, "tokens"), ("text_window", 8, "tokens per window"), ("bench_per_category", 0, "0 = all"), ("bench_limit", 0, "0 = all")]
_NONNEG_FLOATS = [("lr", False), ("weight_decay", True), ("data_temperature", True), ("ce_weight", True),
                  ("unroll_weight", True), ("time_budget", True)]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_args(s, export_only: bool = False) -> None:
    """Validate distill's options before anything is written or loaded.

    Raises:
      DistillError: a numeric option out of range, a conflicting combination, or a missing file.
    """
    import math

    for name, lo, what in _MIN:
        v = getattr(s, name, None)
        if v is None or (name == "steps" and export_only):
            continue
        if v < lo:
            raise DistillError(f"{_flag(name)} must be an integer >= {lo} ({what}), got {v}")
    for name, zero_ok in _NONNEG_FLOATS:
        v = getattr(s, name, None)
        if v is not None and not (math.isfinite(v) and (v >= 0 if zero_ok else v > 0)):
            raise DistillError(f"{_flag(name)} must be a finite number {'>= 0' if zero_ok else '> 0'}, got {v}")
    seed = getattr(s, "seed", 0)
    if not 0 <= seed < 2**64:
        raise DistillError(f"--seed must be in [0, 2**64), got {seed}")
    if getattr(s, "arch", None) == "block":
        check_block_args(s)
    if getattr(s, "copy_ngram", 0) and s.data != "target":
        raise DistillError("--copy-ngram trains on target data only (--data target): on-policy generation has no "
                           "copy term yet")
    if getattr(s, "copy_ngram", 0) and s.ce != "full":
        raise DistillError("--copy-ngram needs --ce full (the copy term competes with the whole sub-vocabulary)")
    fl = getattr(s, "feature_layers", None)
    if fl is not None and fl != "eagle3":
        try:
            ok = len([int(x) for x in str(fl).split(",")]) > 0
        except ValueError:
            ok = False
        if not ok:
            raise DistillError(f"--feature-layers must be comma-separated block indices (e.g. 1,14,27) or eagle3, "
                               f"got {fl!r}")
    if fl is not None and getattr(s, "ce", "full") != "full":
        raise DistillError("--feature-layers trains with --ce full (training-time test's cross-entropy is over the "
                           "whole sub-vocabulary)")
    for path in getattr(s, "text_corpus", None) or []:
        if not os.path.exists(path):
            raise DistillError(f"--text-corpus {path}: no such file or directory")
    if fl is not None and getattr(s, "data", "target") != "target":
        raise DistillError("--feature-layers trains on target data only (--data target)")
    if getattr(s, "init_from", None):
        _check_init_features(s.init_from, fl)
    if getattr(s, "train_only", None) == "copy" and not (s.copy_ngram and s.init_from):
        raise DistillError("--train-only copy fits the copy term of a trained drafter: give --copy-ngram N and "
                           "--init-from DRAFTER_DIR")
    if getattr(s, "data", "target") in ("drafter", "both") and not 0 < s.onpolicy_after < s.steps:
        raise DistillError(f"--data {s.data} needs 0 < --onpolicy-after < --steps (steps trained on target data "
                           "before the drafter generates its own)")
    given = [s.data_dir] if isinstance(getattr(s, "data_dir", None), str) else list(getattr(s, "data_dir", None) or [])
    for x in given:
        if not os.path.isdir(os.path.abspath(x)):
            raise DistillError(f"--data-dir {x}: no data set there (a run's DIR/data)")
    for x in getattr(s, "data_ids", None) or []:
        if not os.path.isfile(x):
            raise DistillError(f"--data-ids {x}: no such file (a token-id file: specjax distill --export-ids)")
    if getattr(s, "init_from", None):
        _check_init_files(s.init_from)
    if s.prompts is None:
        raise DistillError("--prompts FILE is required (JSONL: Spec-Bench 'turns', 'prompt' or 'ids')")
    records = read_records(s.prompts)
    if s.split:
        split = read_split(s.split)
        ids = {r["question_id"] for r in records}
        if not ids & set(x for x in split["train"] + split["eval"] if isinstance(x, (int, str))):
            raise DistillError(f"--split {s.split}: none of its question ids is in {s.prompts}")


def check_block_args(s) -> None:
    """The options of a block-drafter run (``--arch block``): ``--block-size``, ``--layers``,
    ``--anchors`` (integers >= 1), ``--position-decay`` (> 0), a block shorter than ``--window``,
    and no EAGLE-only option (copy term, ``--train-only``, on-policy data); ``--init-from`` must be a
    block drafter directory. Nothing is read but ``--init-from``'s marker file.

    Raises:
      DistillError: one line naming the option and the fix.
    """
    import math

    from specjax.drafters.block import MARKER

    for name, what in (("block_size", "draft tokens per block, the γ trained"), ("layers", "drafter layers"),
                       ("anchors", "blocks per window per step")):
        v = getattr(s, name, None)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise DistillError(f"{_flag(name)} must be an integer >= 1 ({what}), got {v}")
    pd = getattr(s, "position_decay", None)
    if pd is not None and not (isinstance(pd, (int, float)) and math.isfinite(pd) and pd > 0):  # None: the default
        raise DistillError(f"--position-decay must be a finite number > 0 (decay length of the per-slot loss "
                           f"weights; default --block-size / 2), got {pd}")
    if s.window is not None and s.block_size >= s.window:
        raise DistillError(f"--block-size {s.block_size} must be smaller than --window {s.window} (an anchor needs "
                           "context before it and a label per slot after it): lower --block-size or raise --window")
    for name, bad, fix in (("copy_ngram", bool(getattr(s, "copy_ngram", 0)), "drop --copy-ngram"),
                           ("train_only", getattr(s, "train_only", None) is not None, "drop --train-only"),
                           ("data", getattr(s, "data", "target") != "target", "use --data target")):
        if bad:
            raise DistillError(f"{_flag(name)} is an EAGLE-drafter option; --arch block trains on target data "
                               f"only, without a copy term: {fix}")
    for name, default in EAGLE_ONLY_DEFAULTS.items():
        if getattr(s, name, default) != default:
            hint = " (a block drafter trains --block-size draft tokens)" if name == "gamma" else ""
            raise DistillError(f"{_flag(name)} is an EAGLE-drafter option, ignored by --arch block{hint}: drop it")
    init = getattr(s, "init_from", None)
    if init and not os.path.isfile(os.path.join(os.path.expanduser(init), MARKER)):
        raise DistillError(f"--init-from {init}: not a block drafter (no {MARKER}); give the DIR/drafter of a "
                           "specjax distill --arch block run")


def not_started(out: str) -> bool:
    """A run directory holding only ``run.json``: the settings were written, then the run
    failed or was stopped before making anything (e.g. during the model load)."""
    return os.path.isdir(out) and os.listdir(out) == ["run.json"]


def parse_gammas(text: str) -> list[int]:
    """``--bench-gammas``: comma-separated draft lengths, e.g. ``"2,3,4"`` -> ``[2, 3, 4]``.

    Raises:
      DistillError: not comma-separated integers, or one below 1.
    """
    try:
        gammas = [int(g) for g in str(text).split(",")]
    except ValueError:
        gammas = []
    if not gammas or min(gammas) < 1:
        raise DistillError(f"--bench-gammas must be comma-separated integers >= 1, e.g. 2,3,4; got {text!r}")
    return gammas


def check_out_dir(out: str) -> None:
    """Fail before any work when the run directory cannot be created or written.

    Raises:
      DistillError: naming ``--out`` and why it cannot be written.
    """
    from specjax.eval.bench import check_writable

    try:
        check_writable(os.path.join(out, "run.json"))
    except ValueError as e:
        raise DistillError(str(e).replace(f"--out {os.path.join(out, 'run.json')}", f"--out {out}")) from None


def _check_init_files(init_from: str) -> None:
    """``--init-from``: a directory whose files are whole (:func:`specjax.api.check_drafter_files`:
    its weights file there and complete, its JSON valid; headers only), before any data is made.

    Raises:
      DistillError: naming ``--init-from``, the file and the fix."""
    from specjax.api import check_drafter_files

    path = os.path.expanduser(init_from)
    if not os.path.isdir(path):
        raise DistillError(f"--init-from {init_from}: no such drafter directory")
    try:
        check_drafter_files(path)
    except ValueError as e:
        raise DistillError(f"--init-from {init_from}: {e}") from None


def _check_init_features(init_from: str, feature_layers) -> None:
    """``--init-from`` keeps the drafter's inputs: a fused-feature drafter (EAGLE-3 style) needs
    ``--feature-layers`` naming the same blocks, a plain one none (checked from its drafter.json,
    before the target is loaded; ``eagle3`` is compared after loading, in distill)."""
    import json

    path = os.path.join(os.path.expanduser(init_from), "drafter.json")
    try:
        with open(path) as f:
            saved = (json.load(f).get("config") or {}).get("feature_layers") or []
    except (OSError, ValueError):
        return  # missing or unreadable: reported where the drafter is loaded
    if saved and feature_layers is None:
        raise DistillError(f"--init-from {init_from}: that drafter reads target blocks {','.join(map(str, saved))}; "
                           f"pass --feature-layers {','.join(map(str, saved))}")
    if not saved and feature_layers is not None:
        raise DistillError(f"--init-from {init_from}: that drafter reads the last hidden state only; drop "
                           "--feature-layers (or train a fused-feature drafter from scratch)")
    if saved and feature_layers != "eagle3" and [int(x) for x in str(feature_layers).split(",")] != list(saved):
        raise DistillError(f"--init-from {init_from}: that drafter reads target blocks {','.join(map(str, saved))}, "
                           f"not {feature_layers}; pass --feature-layers {','.join(map(str, saved))}")
