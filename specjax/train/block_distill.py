"""``specjax distill --arch block``: train a block (DFlash-style parallel) drafter
(:mod:`specjax.drafters.block`, network :mod:`specjax.drafters.block_net`) to match a target.
One drafter pass drafts a whole block of γ tokens from the target's fused features.

The pipeline is :mod:`specjax.train.distill`'s, reused (everything under ``--out DIR``):

1. **data** (``DIR/data``, or ``--data-dir``, ``--self-prompts``, ``--text-corpus``): the target's
   continuations of the training prompts with, at every position, its fused features
   (``--feature-layers``, default ``eagle3``; float16), top-k next-token probabilities and argmax.
2. **sub-vocabulary**: the ``--sub-vocab`` most frequent training tokens (or ``--init-from``'s).
3. **training** (optax AdamW, warmup + cosine, clipping: :func:`specjax.train.loop.make_optimizer`) on
   windows of ``--window`` positions (:func:`~specjax.train.batches.window_order`): per window
   ``--anchors`` anchors a drawn from (seed, step), 1 <= a, a + γ − 1 <= the window's last position;
   each anchor's block ``[x_a, mask × γ]`` sees the fused features at positions < a
   (:func:`specjax.drafters.block_net.train_forward`). Slot i's loss: cross-entropy of q_i against
   the target's top-k at a + i − 1 inside the sub-vocabulary, weighted w_i = exp(−(i−1)/τ)
   (``--position-decay`` τ, default γ/2), normalized (:mod:`specjax.train.block_losses`).
   Every ``--eval-every`` steps: held-out per-slot greedy agreement and chain α per draft position
   (``history.json``, the log).
4. **checkpoints**: orbax in ``DIR/ckpt``; ``--resume`` continues exactly (the windows and anchors
   of step s depend only on (seed, s)); ``--time-budget`` stops with a checkpoint.
5. **export**: ``DIR/drafter`` (``model.safetensors`` + ``block_drafter.json`` with the run's
   settings, data and held-out α), for ``--draft DIR/drafter`` (:func:`specjax.drafters.block.load_drafter`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import numpy as np

from specjax.train.batches import build_batch, make_windows, sub_positions, window_order
from specjax.train.block_losses import (block_batch, eval_batches, evaluate_block, make_block_eval, make_block_step,
                                        slot_weights, train_anchors)
from specjax.train.common import DistillError, log
from specjax.train.data import choose_sub_vocab
from specjax.train.export import export_drafter
# the run's shared steps (run directory, loading, data, split): specjax.train.distill's
from specjax.train.distill import load_run, make_data, open_run, DistillRun, split_indices
from specjax.train.loop import TrainState, format_alphas, format_figure, make_optimizer, open_checkpoints, record_eval, \
    restore_latest, train
from specjax.train.options import BLOCK_KEYS, RUN_KEYS

__all__ = ["run"]

DEFAULTS = {"block_size": 8, "layers": 2, "anchors": 16, "anchor_feature": False}  # those of the distill parser (a bare Namespace gets them)


def run(args) -> dict:
    """Train a block drafter for ``args.model`` into ``args.out`` (data, training, checkpoints,
    export; module docstring), or continue the run there with ``args.resume``. The contract of
    :func:`specjax.train.distill.run`: returns ``{"out", "final" (the last evaluation, {} without
    one), "train_s" (training seconds this session), "step"}``.

    Raises:
      DistillError: a bad option (one line naming it, before anything is loaded or written), the
        run directories distill refuses, a run of another ``--arch``, data of another feature width,
        ``--export-only`` without a checkpoint.
      ValueError: unreadable prompts.
    """
    import math

    a = _settings(args)
    tb = getattr(a, "time_budget", 0.0) or 0.0
    if not (math.isfinite(tb) and tb >= 0):
        raise DistillError(f"--time-budget must be a number of seconds >= 0 (0 = no limit), got {tb}")
    r = load_run(open_run(a, keys=RUN_KEYS + BLOCK_KEYS), a)
    seqs, data = make_data(r)
    train_idx, eval_idx = split_indices(seqs, r.ev_ids)
    init, sub_ids = _sub_vocabulary(r.s, r.target, seqs, train_idx)
    sub_pos = sub_positions(sub_ids, r.target.config.vocab_size)
    cov = float(np.mean([sub_pos[t] >= 0 for i in eval_idx for t in seqs[i]["ids"][seqs[i]["prompt_len"]:]] or [1.0]))
    n_tok = int(sum(len(seqs[i]["ids"]) for i in train_idx))
    log(f"{len(train_idx)} train / {len(eval_idx)} eval sequences; {n_tok} train tokens; sub-vocab {len(sub_ids)} "
        f"covers {cov:.3f} of eval response tokens")
    cfg, state, train_s = _train(r, a, (seqs, data), (train_idx, eval_idx), sub_ids, sub_pos, init)
    s, final = r.s, state.history[-1] if state.history else {}
    dd = _export(r.out, cfg, state.params, sub_ids, r.target, extra={
        "arch": "block", "steps": state.step, "steps_planned": s.steps, "seed": s.seed, "settings": vars(s),
        "data": {"train_sequences": len(train_idx), "eval_sequences": len(eval_idx), "train_tokens": n_tok,
                 "sub_vocab_coverage": cov}, "eval": final, "init_from": s.init_from})
    stopped = state.step < s.steps
    log(f"{'stopped (time budget)' if stopped else 'done'}: {state.step} of {s.steps} steps ({train_s:.0f}s this "
        f"session), held-out α by draft position {format_alphas(final)}; block drafter in {dd}"
        + (f"; continue with: specjax distill --arch block --out {r.out} --resume [--time-budget SECONDS]"
           if stopped else ""))
    return {"out": r.out, "final": final, "train_s": train_s, "step": state.step}


def _settings(args) -> argparse.Namespace:
    """A copy of ``args`` for a block run: ``arch`` ``"block"``, fused features (``--feature-layers``
    default ``eagle3``), the block flags' defaults, ``--position-decay`` default ``--block-size / 2``."""
    a = argparse.Namespace(**vars(args))
    a.arch = "block"
    if getattr(a, "feature_layers", None) is None:
        a.feature_layers = "eagle3"
    for k, v in DEFAULTS.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if getattr(a, "position_decay", None) is None:
        a.position_decay = a.block_size / 2 if isinstance(a.block_size, int) and a.block_size >= 1 else None
    return a


def _sub_vocabulary(s, target, seqs, train_idx):
    """``(init drafter or None, sub-vocabulary ids)``: a warm start (``--init-from``, a block
    drafter) keeps its weights, sub-vocabulary, layers and MLP width (``s.layers``/``s.intermediate``
    are set to them); otherwise the most frequent training tokens."""
    from specjax.drafters import block

    if not s.init_from:
        return None, choose_sub_vocab([seqs[i] for i in train_idx], target.config.vocab_size, s.sub_vocab)
    init = block.load_drafter(os.path.expanduser(s.init_from), target)
    s.layers, s.intermediate = init.config.num_layers, init.config.layer.intermediate_size
    sub_ids = np.asarray(init.params["frozen"]["sub_ids"])
    log(f"starting from the block drafter in {s.init_from} (its sub-vocabulary of {len(sub_ids)}, {s.layers} "
        f"layers, MLP width {s.intermediate})")
    return init, sub_ids


def _init_drafter(s, target, sub_ids, init):
    """``(BlockConfig, frozen params, trainable params)``: fresh (seeded by ``--seed``) or ``init``'s.

    Raises:
      DistillError: ``init`` reads other target blocks than ``--feature-layers``."""
    from specjax.drafters import block_net
    from specjax.drafters.eagle_params import frozen_params

    cfg = block_net.BlockConfig.for_target(target.config, s.layers, s.block_size, len(sub_ids), s.intermediate,
                                           feature_layers=s.feature_layers, anchor_feature=bool(s.anchor_feature))
    if init is not None:  # its layer shapes (heads included) as they are; the block size trained and an added
        # anchor feature (a zero anchor_proj: the same drafter at step 0) may change
        cfg = dataclasses.replace(init.config, block_size=s.block_size, feature_layers=cfg.feature_layers,
                                  anchor_feature=bool(s.anchor_feature) or init.config.anchor_feature)
        if init.config.anchor_feature and not s.anchor_feature:
            log(f"--init-from {s.init_from}: that drafter reads the anchor feature; it keeps it (--anchor-feature)")
            s.anchor_feature = True
    frozen = frozen_params(target, sub_ids)
    if init is None:
        return cfg, frozen, block_net.init_params(cfg, s.seed, target.params["final_norm"][...])
    if tuple(init.config.feature_layers) != tuple(cfg.feature_layers):
        raise DistillError(f"--init-from {s.init_from}: that drafter reads target blocks "
                           f"{','.join(map(str, init.config.feature_layers))}; --feature-layers {s.feature_layers} "
                           f"gives {','.join(map(str, cfg.feature_layers))}: pass --feature-layers "
                           f"{','.join(map(str, init.config.feature_layers))}")
    return cfg, frozen, block_net.with_anchor_proj(cfg, init.params["train"])


def _train(r: DistillRun, args, ds, split_idx, sub_ids, sub_pos, init):
    """Set up the optimizer and checkpoints (restoring the latest), then train (or, with
    ``--export-only``, only restore). ``ds``: ``(seqs, data)``; ``split_idx``: ``(train indices,
    eval indices)``. Returns ``(BlockConfig, TrainState, training seconds this session)``."""
    s, out = r.s, r.out
    (seqs, data), (train_idx, eval_idx) = ds, split_idx
    cfg, frozen, tp = _init_drafter(s, r.target, sub_ids, init)
    width = data["hidden"].shape[1]
    if width != cfg.feature_size:
        raise DistillError(f"the data set holds target features of width {width}, but this drafter reads "
                           f"{cfg.feature_size} (--feature-layers {s.feature_layers}): use data made with the same "
                           "--feature-layers")
    opt = make_optimizer(s.steps, s.lr, s.warmup, s.weight_decay)
    state = TrainState(tp, opt.init(tp))
    gamma, weights = s.block_size, slot_weights(s.block_size, s.position_decay)
    step_fn = make_block_step(cfg, opt, gamma, weights)
    ckdir = os.path.join(out, "ckpt")
    mngr = open_checkpoints(ckdir)
    latest = restore_latest(mngr, ckdir, state, os.path.join(out, "history.json"))
    windows = [(train_idx[i], st) for i, st in make_windows([seqs[i] for i in train_idx], s.window)]
    if not windows:
        raise DistillError("no training sequence: the split's train ids have no data (check --split / --prompts)")

    def batch_for(step):  # depends only on (seed, step): exact resume
        bt = build_batch(seqs, data, [windows[i] for i in window_order(s.seed, step, s.batch_size, len(windows))],
                         sub_pos, s.window, cfg.feature_size)
        return block_batch(bt, *train_anchors(s.seed, step, bt["mask"], gamma, s.anchors))

    ev, held_out = make_block_eval(cfg, gamma), None

    def eval_at(step):
        nonlocal held_out
        if held_out is None:
            held_out = eval_batches(seqs, data, eval_idx, sub_pos, s.window, cfg.feature_size, s.batch_size, gamma)
        res = record_eval(out, state, step, evaluate_block(ev, state.params, frozen, held_out, gamma, weights))
        log(f"step {step}: held-out loss {format_figure(res['loss'])}, agreement by slot "
            f"{' / '.join(format_figure(x) for x in res['agreement_by_slot'])}, "
            f"{format_figure(res['accepted_per_round'], 2)} greedy drafts accepted per round ({res['positions']} anchors"
            f"{'' if res['positions'] else ': no held-out data'})")
        return res

    if getattr(args, "export_only", False):  # write DIR/drafter from the latest checkpoint, no training
        if latest is None:
            raise DistillError(f"{out}: no complete checkpoint to export")
        s.steps = state.step
    if state.step == 0 and s.eval_every and s.steps > 0:
        log(f"step 0: α by draft position {format_alphas(eval_at(0))}")
    train_s = train(state, mngr, steps=s.steps, step_fn=step_fn, frozen=frozen, batch_for=batch_for,
                    eval_at=eval_at, eval_every=s.eval_every, checkpoint_every=s.checkpoint_every,
                    time_budget=getattr(args, "time_budget", 0.0) or 0.0,
                    tokens_per_step=s.batch_size * s.anchors * gamma)
    return cfg, state, train_s


def _export(out: str, cfg, params: dict, sub_ids, target, extra: dict) -> str:
    """Write the block drafter to ``out/drafter`` (:func:`specjax.train.export.export_drafter` with
    :func:`specjax.drafters.block.save_drafter`). Returns the directory."""
    from specjax.drafters import block

    return export_drafter(out, cfg, params, sub_ids, target, extra, save=block.save_drafter)
