"""The training loop of a distillation: optimizer, jitted training and evaluation steps,
greedy α on the held-out sequences, orbax checkpoints with exact resume, and the loop."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections import defaultdict

import numpy as np

from specjax.core import env
from specjax.runtime.stats import ratio
from specjax.train.batches import build_batch, make_windows
from specjax.train.common import log
from specjax.train.losses import loss_parts, ttt_loss_parts

EVAL_POSITIONS = 4  # draft positions whose teacher-forced α an evaluation reports (fused-feature drafters)


@dataclasses.dataclass
class TrainState:
    """What a checkpoint holds, and the α history: ``params`` (the drafter's trainable
    parameters, a dict of arrays), ``opt_state`` (optax), ``step`` (steps done) and
    ``history`` (one :func:`evaluate` result per evaluation, each with its ``step``)."""

    params: dict
    opt_state: object
    step: int = 0
    history: list = dataclasses.field(default_factory=list)


def make_train_step(cfg, opt, ce_weight, unroll_weight, full_ce=True, ttt_steps=3):
    """The jitted training step ``step(tp, opt_state, frozen, batch) -> (tp, opt_state, loss, acc)``:
    one optimizer update of the trainable parameters ``tp`` on a batch of
    :func:`specjax.train.batches.build_batch` (JAX arrays). ``loss`` (float32 scalar) is the
    masked mean of the first-pass loss + ``unroll_weight`` × the unrolled-pass loss
    (:func:`specjax.train.losses.loss_parts`); ``acc`` the first-pass greedy hit rate. For a
    fused-feature drafter (``cfg.feature_layers``) the loss is training-time test instead
    (:func:`specjax.train.losses.ttt_loss_parts`): the weighted mean of the per-step
    cross-entropies, weights ``1, unroll_weight, ...`` over ``ttt_steps`` steps."""
    import jax
    import jax.numpy as jnp
    import optax

    def ttt_loss_fn(tp, frozen, batch):  # fused features: training-time test, step weights 1, u, u, ...
        ce, hit, valid = ttt_loss_parts(cfg, {"train": tp, "frozen": frozen}, batch, ttt_steps)
        m = batch["mask"][None] * valid
        wts = jnp.asarray([1.0] + [unroll_weight] * (ttt_steps - 1), jnp.float32)
        per_step = jnp.sum(ce * m, axis=(1, 2)) / jnp.maximum(jnp.sum(m, axis=(1, 2)), 1.0)
        return jnp.sum(wts * per_step) / jnp.sum(wts), jnp.sum(hit[0] * m[0]) / jnp.maximum(m[0].sum(), 1.0)

    def loss_fn(tp, frozen, batch):
        if cfg.feature_layers:
            return ttt_loss_fn(tp, frozen, batch)
        params = {"train": tp, "frozen": frozen}
        l1, l2, hit1, _ = loss_parts(cfg, params, batch, ce_weight, full_ce=full_ce,
                                     second_pass=unroll_weight > 0)
        m = batch["mask"]
        den = jnp.maximum(m.sum(), 1.0)
        loss = (jnp.sum(l1 * m) + unroll_weight * jnp.sum(l2 * m)) / den
        return loss, jnp.sum(hit1 * m) / den

    @jax.jit
    def step(tp, opt_state, frozen, batch):
        (loss, acc), g = jax.value_and_grad(loss_fn, has_aux=True)(tp, frozen, batch)
        upd, opt_state = opt.update(g, opt_state, tp)
        tp = optax.apply_updates(tp, upd)
        return tp, opt_state, loss, acc

    return step


def make_eval_fn(cfg):
    """The jitted evaluation ``ev(tp, frozen, batch) -> (hits [K, B], positions [K, B])``: greedy
    hits per draft position summed over each window's response positions (float32). K = 2 for
    EAGLE-1/2 drafters (first draft on true features, a second on its own features over the
    whole window); for fused-feature drafters K = :data:`EVAL_POSITIONS` steps of
    training-time test (:func:`specjax.train.losses.ttt_loss_parts`): position k is the (k)-th
    draft of a round given the earlier ones were right (the per-position α of the decode loop)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def ev(tp, frozen, batch):
        params = {"train": tp, "frozen": frozen}
        m = batch["resp"]
        if cfg.feature_layers:
            _, hit, valid = ttt_loss_parts(cfg, params, batch, EVAL_POSITIONS, full_head=True)
            mm = m[None] * valid
            return jnp.sum(hit * mm, axis=2), jnp.sum(mm, axis=2)
        _, _, hit1, hit2 = loss_parts(cfg, params, batch, 0.0, full_head=True)
        return jnp.stack([jnp.sum(hit1 * m, axis=1), jnp.sum(hit2 * m, axis=1)]), jnp.stack([jnp.sum(m, axis=1)] * 2)

    return ev


COPY_BIAS_LR_MULT = 100.0  # the copy term's per-n biases need logit-sized moves (a few units) in few steps


def make_optimizer(steps, lr, warmup, weight_decay, freeze_base=False):
    """AdamW with linear warmup and cosine decay, global-norm clipping at 1. The copy
    term's biases ``copy_b`` (if any) use ``COPY_BIAS_LR_MULT`` × the learning rate and no
    weight decay: each is one scalar that must move by several logits. ``freeze_base``:
    only ``copy_w``/``copy_b`` change."""
    import jax
    import optax

    warmup = max(1, min(warmup, steps // 5 or 1))

    def sched(peak):
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(steps, warmup + 1), end_value=peak * 0.05)

    def label(k):
        if k == "copy_b":
            return "bias"
        return "frozen" if freeze_base and k != "copy_w" else "base"

    labels = lambda tp: {k: jax.tree_util.tree_map(lambda _: label(k), v) for k, v in tp.items()}
    inner = optax.multi_transform({"base": optax.adamw(sched(lr), weight_decay=weight_decay),
                                   "bias": optax.adam(sched(lr * COPY_BIAS_LR_MULT)),
                                   "frozen": optax.set_to_zero()}, labels)
    return optax.chain(optax.clip_by_global_norm(1.0), inner)


# --------------------------------------------------------------------------- evaluation
def evaluate(ev, tp, frozen, seqs, data, eval_idx, sub_pos, window, d, batch_size, copy_ngram=0):
    """Greedy α of the first draft (true features) and of a second draft (own features),
    over the response positions of the eval sequences (the last ``window`` positions of
    each), pooled and per category: ``{"alpha", "alpha2", "alpha_by_position", "positions",
    "by_category": {category: {the same}}}``; ``alpha_by_position`` has one α per draft position
    of :func:`make_eval_fn` (2, or :data:`EVAL_POSITIONS` for fused-feature drafters). A position
    nothing scored (no eval sequence) has α ``None`` (no data). ``ev``: :func:`make_eval_fn`; the batches are
    :func:`specjax.train.batches.build_batch` of ``batch_size`` windows."""
    import jax.numpy as jnp

    wins = make_windows([seqs[i] for i in eval_idx], window, eval_only_response=True)
    wins = [(eval_idx[i], st) for i, st in wins]
    by = defaultdict(lambda: 0.0)
    tot = np.zeros((2, 2))  # [hits, positions] × draft positions (widened by the first batch)
    for lo in range(0, len(wins), batch_size):
        chunk = wins[lo: lo + batch_size]
        pad = chunk + [chunk[-1]] * (batch_size - len(chunk))
        bt = build_batch(seqs, data, pad, sub_pos, window, d, copy_ngram=copy_ngram)
        hits, n = (np.asarray(x, np.float64) for x in ev(tp, frozen, {k: jnp.asarray(v) for k, v in bt.items()}))
        for j, (i, _) in enumerate(chunk):
            v = np.stack([hits[:, j], n[:, j]])  # [2, K]
            by[seqs[i]["category"]] = by[seqs[i]["category"]] + v
            tot = (tot if tot.shape == v.shape else np.zeros_like(v)) + v

    def summary(v):
        a = [ratio(h, n) for h, n in zip(v[0].tolist(), v[1].tolist())]
        return {"alpha": a[0], "alpha2": a[1], "alpha_by_position": a, "positions": int(v[1][0])}

    res = summary(tot)
    res["by_category"] = {c: summary(v) for c, v in sorted(by.items())}
    return res



def latest_complete_step(mngr, ckdir: str) -> int | None:
    """The newest step orbax lists whose directory is finalized. Orbax writes a step into
    ``<step>.orbax-checkpoint-tmp-*`` and renames it when complete (such temporaries are
    never listed); as a second guard a step directory without orbax's
    ``_CHECKPOINT_METADATA`` file (written when a save completes) is skipped too.
    ``None`` when there is no complete step."""
    for step in sorted(mngr.all_steps(), reverse=True):
        if os.path.isfile(os.path.join(ckdir, str(step), "_CHECKPOINT_METADATA")):
            return step
        log(f"skipping incomplete checkpoint directory {os.path.join(ckdir, str(step))}")
    return None




def open_checkpoints(ckdir: str):
    """An orbax ``CheckpointManager`` on ``ckdir`` (created if missing): synchronous saves,
    the newest 3 steps kept."""
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(ckdir, options=ocp.CheckpointManagerOptions(
        max_to_keep=3, save_interval_steps=1, enable_async_checkpointing=False, create=True))


def restore_latest(mngr, ckdir: str, state: TrainState, history_file: str) -> int | None:
    """Load the newest complete checkpoint into ``state`` (parameters, optimizer state,
    step; ``state`` gives the tree structure) and the α history up to its step from
    ``history_file``. Returns the restored step, ``None`` (state unchanged) without one.

    Raises:
      DistillError: the checkpoint's tree does not match ``state`` (another parameter layout).
    """
    import orbax.checkpoint as ocp

    latest = latest_complete_step(mngr, ckdir)
    if latest is None:
        return None
    from specjax.train.common import DistillError

    tmpl = {"params": state.params, "opt_state": state.opt_state, "step": np.asarray(0, np.int64)}
    try:
        restored = mngr.restore(latest, args=ocp.args.StandardRestore(tmpl))
    except (ValueError, KeyError, TypeError) as e:  # another tree: e.g. a run of a specjax before the fused layout
        raise DistillError(
            f"the checkpoint at step {latest} in {ckdir} does not match this drafter's parameters "
            f"({type(e).__name__}: {' '.join(str(e).split())[:160]}); it was written by another specjax version or "
            "drafter configuration: resume it with that version, or start a new run in another --out directory"
        ) from e
    state.params, state.opt_state = restored["params"], restored["opt_state"]
    state.step = int(restored["step"])
    if os.path.exists(history_file):
        with open(history_file) as f:
            state.history = [h for h in json.load(f) if h["step"] <= state.step]
    log(f"restored checkpoint at step {state.step}")
    return latest


def save_checkpoint(mngr, state: TrainState) -> None:
    """Save ``state`` as checkpoint ``state.step`` and wait until it is complete."""
    import orbax.checkpoint as ocp

    mngr.save(state.step, args=ocp.args.StandardSave({"params": state.params, "opt_state": state.opt_state,
                                                      "step": np.asarray(state.step, np.int64)}))
    mngr.wait_until_finished()


def record_eval(out: str, state: TrainState, step: int, result: dict) -> dict:
    """Append an :func:`evaluate` result (stamped with ``step``) to ``state.history`` and
    rewrite ``out/history.json`` atomically. Returns ``result``."""
    result["step"] = step
    state.history.append(result)
    with open(os.path.join(out, "history.json.tmp"), "w") as f:
        json.dump(state.history, f, indent=1)
    os.replace(os.path.join(out, "history.json.tmp"), os.path.join(out, "history.json"))
    return result


def format_alphas(result: dict) -> str:
    """``"0.512 / 0.401 / ..."``: an :func:`evaluate` result's α per draft position (``"n/a"`` without one)."""
    a = result.get("alpha_by_position") or ([result["alpha"], result["alpha2"]] if "alpha" in result else [])
    return " / ".join(format_figure(x) for x in a) if a else "n/a"


def format_figure(x: float | None, digits: int = 3) -> str:
    """A held-out figure for the log; ``"–"`` for no data (``None``: nothing was scored)."""
    return "–" if x is None else f"{x:.{digits}f}"


PROGRESS_EVERY_S = 60.0  # seconds between plain progress lines in the log


def _hms(seconds: float) -> str:
    """``H:MM:SS`` (hours unbounded)."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def train(state: TrainState, mngr, *, steps: int, step_fn, frozen, batch_for, eval_at, eval_every: int,
          checkpoint_every: int, onpolicy_after: int | None = None, add_onpolicy=None, time_budget: float = 0.0,
          tokens_per_step: int = 0) -> float:
    """Train from ``state.step`` to ``steps`` (``state`` updated in place); returns the
    seconds spent (this session). Step s uses ``batch_for(s)`` (NumPy arrays); every
    ``eval_every`` steps and at the end ``eval_at(step)`` (an :func:`evaluate` result) runs;
    a checkpoint is saved every ``checkpoint_every`` steps, at the end and at
    ``onpolicy_after``, after which ``add_onpolicy(params)`` adds the on-policy data.
    ``mngr`` is closed at the end. A progress bar on stderr (a TTY only; never with
    ``SPECJAX_NO_PROGRESS=1``) and, every :data:`PROGRESS_EVERY_S` seconds, a log line with the
    step, loss, tokens/s and ETA; each evaluation logs α per draft position. ``time_budget``
    (seconds, 0 = none): stop after the first step past it, with a checkpoint (``--resume``
    continues exactly: the batch of step s depends only on (seed, s))."""
    import jax.numpy as jnp
    from tqdm import tqdm

    alpha = state.history[-1]["alpha"] if state.history else None  # no evaluation yet: no data
    bar = tqdm(range(state.step, steps), initial=state.step, total=steps, desc="distill", file=sys.stderr,
               disable=True if env.get("SPECJAX_NO_PROGRESS") else None,  # None: only on a TTY
               mininterval=2.0)
    t0 = last = time.time()
    first = state.step
    for step in bar:
        b = {k: jnp.asarray(v) for k, v in batch_for(step).items()}
        state.params, state.opt_state, loss, acc = step_fn(state.params, state.opt_state, frozen, b)
        done = state.step = step + 1
        now = time.time()
        out_of_time = bool(time_budget) and now - t0 >= time_budget and done < steps
        if now - last >= PROGRESS_EVERY_S:
            last = now
            rate = (now - t0) / (done - first)
            log(f"step {done}/{steps}: loss {float(loss):.3f}, first-draft accuracy {float(acc):.2f}, "
                f"{rate:.2f} s/step" + (f" ({tokens_per_step / rate:.0f} tokens/s)" if tokens_per_step else "")
                + f", ETA {_hms(rate * (steps - done))}")
        if eval_every and (done % eval_every == 0 or done == steps):
            r = eval_at(done)
            alpha = r["alpha"]
            log(f"step {done}: held-out α by draft position {format_alphas(r)}")
        if done % checkpoint_every == 0 or done == steps or done == onpolicy_after or out_of_time:
            save_checkpoint(mngr, state)
        if out_of_time:
            log(f"time budget of {time_budget:.0f}s reached at step {done} of {steps}; checkpoint written")
            break
        if done == onpolicy_after:
            add_onpolicy(state.params)
        bar.set_postfix(loss=f"{float(loss):.3f}", acc=f"{float(acc):.2f}", alpha="–" if alpha is None else f"{alpha:.3f}")
    bar.close()
    mngr.wait_until_finished()
    mngr.close()
    return time.time() - t0
