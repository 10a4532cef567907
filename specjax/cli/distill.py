"""``specjax distill``: train a drafter (:mod:`specjax.train.distill`) from the command line."""

from __future__ import annotations

import argparse
import importlib

from specjax.drafters import registry
from specjax.train.benchmark import bench
from specjax.train.common import DistillError
from specjax.train.options import EAGLE_ONLY_DEFAULTS


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", default=None, help="run directory (refused if it exists, unless --resume); required "
                                                  "except with --export-ids")
    p.add_argument("--arch", default="eagle", metavar="KIND",
                   help="the drafter kind to train (specjax.drafters.registry; trainable: "
                        f"{', '.join(registry.trainable_kinds())}). eagle: an EAGLE-style feature drafter, written "
                        "as DIR/drafter (drafter.json + weights) for --draft DIR/drafter; block: a DFlash-style "
                        "parallel drafter (one pass drafts a block, see the block drafter options), written as "
                        "DIR/drafter (block_drafter.json + weights). A --resume needs the run's --arch")
    p.add_argument("--prompts", default=None, help="JSONL prompts (Spec-Bench 'turns', 'prompt' or 'ids')")
    p.add_argument("--split", default=None, help="JSON {'train': [question ids], 'eval': [...]}")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="windows per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--data", default="target", choices=["target", "drafter", "both"])
    p.add_argument("--data-dir", default=None, nargs="+", metavar="DIR",
                   help="reuse the data set(s) of other runs (their DIR/data; several are merged, shared greedy "
                        "continuations kept once) instead of generating one")
    p.add_argument("--data-ids", default=None, nargs="+", metavar="FILE",
                   help="reuse stored token-id files (--export-ids; e.g. data/smollm2-135m-instruct/*.npz): the "
                        "target's features and top-k are recomputed by teacher forcing (prefill passes, no "
                        "decoding) into DIR/data_ids; with --data-dir or alone, nothing is generated anew")
    p.add_argument("--export-ids", default=None, metavar="FILE",
                   help="instead of training: write the token ids of the --data-dir data sets (prompts and the "
                        "target's continuations, merged as for training) to FILE, compressed (uint16 for a "
                        "vocabulary of <= 65,536), for --data-ids; no --out needed")
    p.add_argument("--onpolicy-after", type=int, default=EAGLE_ONLY_DEFAULTS["onpolicy_after"])
    p.add_argument("--gamma", type=int, default=EAGLE_ONLY_DEFAULTS["gamma"],
                   help="the draft depth γ (drafts per round) the drafter is trained for (a block drafter trains "
                        "--block-size instead); recorded in DIR/run.json. The eagle kind's training does not depend "
                        "on it: how far it looks ahead is set by its unrolled pass (--unroll-weight) or, with "
                        "--feature-layers, --ttt-steps")
    _add_drafter_args(p)
    _add_data_args(p)
    _add_block_args(p)
    p.add_argument("--no-chat", dest="chat", action="store_false", help="prompts without the chat template")
    p.add_argument("--export-only", action="store_true",
                   help="with --resume: write DIR/drafter from the latest checkpoint (a run stopped early)")
    p.add_argument("--bench", default=None, metavar="DRAFTER_DIR",
                   help="instead of training: benchmark a distilled drafter ('default' = the shipped one) on the "
                        "--split eval prompts vs autoregressive, ngram and the truncated target; results in --out")
    p.add_argument("--bench-gammas", default="2,3,4,5")
    p.add_argument("--bench-per-category", type=int, default=0, help="limit eval prompts per category (0 = all)")
    p.add_argument("--bench-limit", type=int, default=0, help="at most N eval prompts (0 = all)")


def _add_drafter_args(p: argparse.ArgumentParser) -> None:
    """``distill``'s drafter flags: its size, copy term, self-prompts, starting weights, EAGLE-3 features."""
    p.add_argument("--sub-vocab", type=int, default=8192, help="head rows: most frequent target tokens")
    p.add_argument("--intermediate", type=int, default=1024, help="drafter MLP width")
    p.add_argument("--copy-ngram", type=int, default=0, metavar="N",
                   help="add a learned copy term over the prompt-lookup candidate (n-grams up to N; 0 = none)")
    p.add_argument("--self-prompts", type=int, default=0, metavar="N",
                   help="also train on N prompts written by the target itself (Magpie) and its greedy answers")
    p.add_argument("--train-only", default=None, choices=["copy"],
                   help="'copy': fit only the copy term of the --init-from drafter (on the self-prompt sequences "
                        "when --self-prompts is given: text the drafter has not memorized)")
    p.add_argument("--init-from", default=None, metavar="DRAFTER_DIR",
                   help="start from a saved drafter's weights and sub-vocabulary (e.g. models/...; new copy-term "
                        "parameters start at zero)")
    p.add_argument("--feature-layers", default=None, metavar="I,J,K",
                   help="EAGLE-3 fused features: the target blocks (0-based) whose outputs the drafter reads, e.g. "
                        "1,14,27; 'eagle3' = blocks 1, L/2-1 and L-3 of an L-block target; default: the final "
                        "hidden state (EAGLE-1/2)")
    p.add_argument("--ttt-steps", type=int, default=EAGLE_ONLY_DEFAULTS["ttt_steps"], metavar="K",
                   help="with --feature-layers: training-time test, the drafter unrolled K steps on its own "
                        "features with the loss on each (EAGLE-3)")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """``distill``'s data and loss flags: teacher-forced text, time budget, windows, continuations, losses."""
    p.add_argument("--text-corpus", default=None, nargs="+", metavar="PATH",
                   help="also teacher-force the target on the text files under these paths (documentation, "
                        "READMEs, licences, source code): prefill passes only")
    p.add_argument("--text-tokens", type=int, default=1_000_000, help="tokens taken from --text-corpus")
    p.add_argument("--text-window", type=int, default=512, help="tokens per teacher-forced window")
    p.add_argument("--time-budget", type=float, default=0.0, metavar="SECONDS",
                   help="stop training after this many seconds of the training loop (data generation is not "
                        "counted; a checkpoint is written; continue with --resume; 0 = no limit)")
    p.add_argument("--window", type=int, default=192, help="positions per training window")
    p.add_argument("--max-new-tokens", type=int, default=96, help="target continuation length")
    p.add_argument("--max-prompt-tokens", type=int, default=96, help="keep the last N prompt tokens")
    p.add_argument("--gen-batch", type=int, default=16)
    p.add_argument("--samples-per-prompt", type=int, default=1,
                   help="continuations per training prompt: 1 greedy + N-1 sampled at --data-temperature")
    p.add_argument("--data-temperature", type=float, default=0.8,
                   help="temperature of the extra sampled continuations (the stored targets stay temperature 1)")
    p.add_argument("--topk", type=int, default=16, help="target probabilities stored per position")
    p.add_argument("--ce-weight", type=float, default=EAGLE_ONLY_DEFAULTS["ce_weight"],
                   help="cross-entropy weight next to the feature regression (EAGLE-1/2 drafters; fused-feature "
                        "drafters have no feature regression)")
    p.add_argument("--ce", default=EAGLE_ONLY_DEFAULTS["ce"], choices=["full", "topk"],
                   help="cross-entropy over the whole sub-vocabulary, or only among the target's top-k")
    p.add_argument("--unroll-weight", type=float, default=EAGLE_ONLY_DEFAULTS["unroll_weight"],
                   help="loss weight of the unrolled pass (own features); with --feature-layers, of each "
                        "training-time-test step after the first")


def _add_block_args(p: argparse.ArgumentParser) -> None:
    """``distill``'s block-drafter flags (``--arch block``, :mod:`specjax.train.block_distill`)."""
    g = p.add_argument_group("block drafter (--arch block; it reads fused features: --feature-layers, default "
                             "eagle3)")
    g.add_argument("--block-size", type=int, default=8, metavar="N",
                   help="draft tokens per block, the largest γ the drafter is trained for (a round may draft fewer)")
    g.add_argument("--layers", type=int, default=2, help="drafter layers (Llama blocks of the target's width)")
    g.add_argument("--anchors", type=int, default=16,
                   help="blocks trained per window and step: anchor positions drawn at random from (seed, step)")
    g.add_argument("--position-decay", type=float, default=None, metavar="TAU",
                   help="loss weight of block slot i: exp(-(i-1)/TAU), normalized (later drafts count less, as "
                        "DFlash); default: --block-size / 2")
    g.add_argument("--anchor-feature", action="store_true",
                   help="the anchor's input also reads the target's features at the position before it (a "
                        "trained projection, zero at the start: an --init-from drafter without it starts "
                        "unchanged), as an EAGLE-3 drafter's first draft does; off: the published DFlash layout")


def trainer(arch: str):
    """The training entry of the drafter kind ``arch`` (``specjax distill --arch``): its
    registry entry's ``"module:function"``, imported.

    Raises:
      ValueError: an unknown kind or one without a training entry (one line naming the trainable kinds).
    """
    module, _, name = registry.trainer_of(arch).partition(":")
    return getattr(importlib.import_module(module), name)


def export_ids(args) -> int:
    """``--export-ids FILE``: the token ids of the ``--data-dir`` data sets written to FILE (checked
    before the target is loaded: the file's folder, the data sets, the model that made them)."""
    import json
    import os

    from specjax.io.loading import load_model
    from specjax.train.common import log
    from specjax.train.token_ids import check_export_path, export_token_ids, part_sequences

    if not args.data_dir:
        raise DistillError("--export-ids FILE writes the token ids of data sets: give them with --data-dir DIR "
                           "[DIR ...] (a run's DIR/data, DIR/data_self)")
    for flag, given in (("--out", args.out), ("--data-ids", args.data_ids), ("--resume", args.resume),
                        ("--bench", args.bench), ("--export-only", args.export_only)):
        if given:
            raise DistillError(f"--export-ids only writes the token ids of --data-dir data sets; {flag} does not go "
                               "with it (run that separately)")
    check_export_path(args.export_ids)

    def same(a, b):  # model names or paths
        norm = lambda x: os.path.abspath(x) if x and os.path.exists(x) else x  # noqa: E731
        return norm(a) == norm(b)

    for d in args.data_dir:
        part_sequences(d)
        run_file = os.path.join(os.path.dirname(os.path.abspath(d)), "run.json")
        if os.path.isfile(run_file):
            with open(run_file) as f:
                made_by = json.load(f).get("model")
            if not same(made_by, args.model):
                raise DistillError(f"--data-dir {d} was made by --model {made_by or 'default'}, not "
                                   f"{args.model or 'default'}: give --model {made_by or 'default'}")
    target = load_model(args.model or "default", dtype="float32")
    note = "specjax distill" + (f" --model {args.model}" if args.model else "") + \
        f" --export-ids {args.export_ids} --data-dir {' '.join(args.data_dir)}"
    meta = export_token_ids(args.export_ids, list(args.data_dir), target, note=note)
    log(f"wrote {args.export_ids}: {meta['sequences']} sequences, {meta['tokens']} tokens")
    return 0


def cmd_distill(args) -> int:
    if args.export_ids:
        return export_ids(args)
    if not args.out:
        raise DistillError("--out DIR is required: the run directory (data, checkpoints, the drafter)")
    if getattr(args, "anchor_feature", False) and args.arch != "block":
        raise DistillError("--anchor-feature is a block-drafter option: add --arch block (or drop it)")
    train = trainer(args.arch)
    if args.bench:
        if not (args.prompts and args.split):
            raise DistillError("--bench needs --prompts and --split (the evaluation question ids)")
        bench(args)
        return 0
    train(args)
    return 0


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("distill", help="train a drafter for a target (optax + orbax, resumable)")
    add_args(p)
    p.set_defaults(func=cmd_distill)
