"""Block-drafter training (:mod:`specjax.drafters.block_net`): the anchors of a batch, the per-slot
cross-entropy and greedy agreement, the jitted training step and the held-out evaluation (chain α
per draft position).

Labels. Block slot i (1..γ) of anchor a predicts the token at position a + i; its target is the
target's next-token distribution stored at position a + i − 1 (:func:`specjax.train.data.generate_data`
stores, at every position t, the distribution of the token at t + 1), restricted to the
sub-vocabulary and renormalized as the EAGLE losses do; its greedy label is the target's argmax
there. The context of anchor a is the target's fused features at the window's positions < a.
"""

from __future__ import annotations

import numpy as np

from specjax.runtime.stats import ratio

ANCHOR_STREAM = 0xB10C  # the anchors' random stream, next to window_order's (seed, epoch) ones


def slot_weights(gamma: int, decay: float) -> np.ndarray:
    """``[γ]`` float32 loss weights ``w_i = exp(−(i − 1)/decay)`` (DFlash's position decay; normalized
    by the loss)."""
    return np.exp(-np.arange(gamma, dtype=np.float64) / float(decay)).astype(np.float32)


def train_anchors(seed: int, step: int, mask: np.ndarray, gamma: int, n_anchors: int):
    """The anchors of training step ``step``: per window (row of ``mask [B, W]``, 1 at its valid
    positions 0..n−1) up to ``n_anchors`` distinct positions a with 1 <= a and a + γ − 1 <= n − 1,
    drawn without replacement from a generator seeded by ``(seed, step)`` (exact resume), sorted.

    Returns ``(anchors [B, A] int32, valid [B, A, γ] float32)``: a window with fewer candidates
    gets them all, the rest padded with position 1 and ``valid`` 0."""
    rng = np.random.default_rng([seed, step, ANCHOR_STREAM])
    b = mask.shape[0]
    anchors = np.ones((b, n_anchors), np.int32)
    valid = np.zeros((b, n_anchors, gamma), np.float32)
    for j in range(b):
        cands = np.arange(1, int(mask[j].sum()) - gamma + 1)
        if len(cands) == 0:
            continue
        pick = np.sort(rng.choice(cands, size=min(n_anchors, len(cands)), replace=False))
        anchors[j, : len(pick)] = pick
        valid[j, : len(pick)] = 1.0
    return anchors, valid


def eval_anchors(resp: np.ndarray, gamma: int, n_anchors: int):
    """Every held-out anchor of each window: positions a >= 1 whose slot-1 label is a response
    position (``resp [B, W]``: the positions predicting a generated token), i.e. the anchor is the
    prompt's last token or a generated one, as in the decode loop. Slot i is valid where position
    a + i − 1 still is a response position.

    Returns ``(anchors [B, n_anchors] int32, valid [B, n_anchors, γ] float32)`` (padded with 1 / 0).

    Raises:
      ValueError: a window with more than ``n_anchors`` anchors (see :func:`count_eval_anchors`)."""
    b, w = resp.shape
    anchors = np.ones((b, n_anchors), np.int32)
    valid = np.zeros((b, n_anchors, gamma), np.float32)
    for j in range(b):
        pos = np.flatnonzero(resp[j, 1:]) + 1
        if len(pos) > n_anchors:
            raise ValueError(f"window {j} has {len(pos)} anchors, more than {n_anchors}")
        anchors[j, : len(pos)] = pos
        lab = pos[:, None] + np.arange(gamma)[None]  # [n, γ] label positions a + i − 1
        valid[j, : len(pos)] = (lab < w) & (resp[j, np.minimum(lab, w - 1)] > 0)
    return anchors, valid


def count_eval_anchors(resp: np.ndarray) -> int:
    """The most anchors :func:`eval_anchors` gives one row of ``resp [B, W]`` (>= 1)."""
    return max(1, int(resp[:, 1:].sum(axis=1).max())) if len(resp) else 1


def block_batch(bt: dict, anchors: np.ndarray, valid: np.ndarray) -> dict:
    """The arrays of a block-drafter batch from :func:`specjax.train.batches.build_batch`'s ``bt``:
    ``feats [B, W, len·D]`` float32 (the target's fused features AT each position, ``bt["th"]``),
    ``tokens [B, W]`` int32, ``tp``/``ti`` ``[B, W, k]`` (top-k probabilities / sub-vocab positions,
    −1 outside), ``am [B, W]`` int32 (argmax as sub-vocab position, −1 outside), ``anchors [B, A]``
    int32, ``valid [B, A, γ]`` float32."""
    return {"feats": bt["th"], "tokens": bt["tokens"], "tp": bt["tp"], "ti": bt["ti"], "am": bt["am"],
            "anchors": anchors, "valid": valid}


def block_terms(cfg, params: dict, batch: dict, gamma: int):
    """Per anchor and slot the cross-entropy of q_i (softmax over the sub-vocabulary) against the
    target's top-k at position a + i − 1 (inside the sub-vocabulary, renormalized; 0 where none of
    it is) and the greedy hit (argmax q_i == the target's argmax there): ``(ce, hit)``, each
    ``[B, A, γ]`` float32. ``params``: ``{"train", "frozen"}``; ``batch``: :func:`block_batch` (JAX)."""
    import jax
    import jax.numpy as jnp

    from specjax.drafters import block_net
    from specjax.drafters.eagle_net import sub_logits

    anchors = batch["anchors"]
    b, a = anchors.shape
    w = batch["tokens"].shape[1]
    f = block_net.train_forward(cfg, params, batch["feats"], batch["tokens"], anchors, gamma)  # [B, A, γ, D]
    lab = jnp.minimum(anchors[:, :, None] + jnp.arange(gamma, dtype=jnp.int32), w - 1).reshape(b, a * gamma)
    rows = jnp.arange(b)[:, None]
    ti = batch["ti"][rows, lab].reshape(b, a, gamma, -1)
    tp = batch["tp"][rows, lab].reshape(b, a, gamma, -1)
    am = batch["am"][rows, lab].reshape(b, a, gamma)
    logq = jax.nn.log_softmax(sub_logits(params, f), axis=-1)  # [B, A, γ, |S|]
    ok = ti >= 0
    pp = jnp.where(ok, tp, 0.0)
    pp = pp / jnp.maximum(pp.sum(-1, keepdims=True), 1e-9)
    lq = jnp.take_along_axis(logq, jnp.maximum(ti, 0), axis=-1)
    ce = -jnp.sum(jnp.where(ok, pp * lq, 0.0), axis=-1)
    hit = (jnp.argmax(logq, axis=-1) == am).astype(jnp.float32)
    return ce, hit


def make_block_step(cfg, opt, gamma: int, weights: np.ndarray):
    """The jitted training step ``step(tp, opt_state, frozen, batch) -> (tp, opt_state, loss, acc)``
    (the contract of :func:`specjax.train.loop.train`): one optimizer update on a :func:`block_batch`.
    ``loss`` (float32) = Σ valid·w_i·ce / Σ valid·w_i (``weights``: :func:`slot_weights`); ``acc`` the
    slot-1 greedy agreement of the batch."""
    import jax
    import jax.numpy as jnp
    import optax

    w = jnp.asarray(weights, jnp.float32)

    def loss_fn(tp, frozen, batch):
        ce, hit = block_terms(cfg, {"train": tp, "frozen": frozen}, batch, gamma)
        m = batch["valid"] * w
        v1 = batch["valid"][..., 0]
        return jnp.sum(ce * m) / jnp.maximum(jnp.sum(m), 1e-9), jnp.sum(hit[..., 0] * v1) / jnp.maximum(v1.sum(), 1.0)

    @jax.jit
    def step(tp, opt_state, frozen, batch):
        (loss, acc), g = jax.value_and_grad(loss_fn, has_aux=True)(tp, frozen, batch)
        upd, opt_state = opt.update(g, opt_state, tp)
        return optax.apply_updates(tp, upd), opt_state, loss, acc

    return step


def make_block_eval(cfg, gamma: int):
    """The jitted ``ev(tp, frozen, batch) -> (ce [B, A, γ], hit [B, A, γ])`` of :func:`block_terms`."""
    import jax

    return jax.jit(lambda tp, frozen, batch: block_terms(cfg, {"train": tp, "frozen": frozen}, batch, gamma))


def window_stats(ce: np.ndarray, hit: np.ndarray, valid: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The sums an evaluation pools, for one window's ``[A, γ]`` arrays: a float64 vector of
    ``4·γ + 2``: per slot the hits and valid slots (agreement), the anchors whose first i slots all
    agree and those whose first i − 1 do (chain α; both among the anchors whose slot i is valid),
    then the weighted cross-entropy and its weight."""
    pre = np.cumprod(hit, axis=-1)
    prev = np.concatenate([np.ones_like(pre[:, :1]), pre[:, :-1]], axis=-1)
    per_slot = [(hit * valid).sum(0), valid.sum(0), (pre * valid).sum(0), (prev * valid).sum(0)]
    return np.concatenate(per_slot + [[(ce * valid * weights).sum(), (valid * weights).sum()]]).astype(np.float64)


def summarize(v: np.ndarray, gamma: int) -> dict:
    """An evaluation result from pooled :func:`window_stats`: ``alpha`` (slot 1), ``alpha_by_position``
    (chain α_i: of the anchors whose first i − 1 drafts agree with the target's greedy tokens, the
    fraction whose i-th does too), ``agreement_by_slot`` (each slot alone), ``accepted_per_round``
    (Σ_i Π_{j<=i} α_j, greedy drafts accepted per round), ``loss`` (held-out weighted cross-entropy)
    and ``positions`` (anchors); an α nothing scored is ``None`` (no data), and with no anchor at all
    (no held-out sequence) so are the loss and ``accepted_per_round``."""
    st = v[: 4 * gamma].reshape(4, gamma)
    alpha = st[2] / np.maximum(st[3], 1)  # 0 where unscored: no anchor's earlier drafts all agreed
    by_pos = [ratio(a, n) for a, n in zip(st[2].tolist(), st[3].tolist())]
    return {"alpha": by_pos[0], "alpha_by_position": by_pos,
            "agreement_by_slot": [ratio(a, n) for a, n in zip(st[0].tolist(), st[1].tolist())],
            "accepted_per_round": float(np.cumprod(alpha).sum()) if st[3][0] else None,
            "loss": ratio(float(v[-2]), float(v[-1])), "positions": int(st[1][0])}


def eval_batches(seqs, data, eval_idx, sub_pos, window: int, d: int, batch_size: int, gamma: int) -> list:
    """The held-out batches (built once per run): the last ``window`` positions of each eval
    sequence (:func:`specjax.train.batches.make_windows` with ``eval_only_response``), ``batch_size``
    windows per batch (the last one padded with copies), every response anchor
    (:func:`eval_anchors`; one anchor count for all, so one compilation). Returns
    ``[(block_batch NumPy arrays, categories of its real rows)]``; ``d``: the stored feature width."""
    from specjax.train.batches import build_batch, make_windows

    wins = [(eval_idx[i], st) for i, st in make_windows([seqs[i] for i in eval_idx], window, eval_only_response=True)]
    chunks = [wins[lo: lo + batch_size] for lo in range(0, len(wins), batch_size)]
    built = [build_batch(seqs, data, c + [c[-1]] * (batch_size - len(c)), sub_pos, window, d) for c in chunks]
    n_anchors = max([count_eval_anchors(bt["resp"]) for bt in built] or [1])
    out = []
    for c, bt in zip(chunks, built):
        anchors, valid = eval_anchors(bt["resp"], gamma, n_anchors)
        out.append((block_batch(bt, anchors, valid), [seqs[i]["category"] for i, _ in c]))
    return out


def evaluate_block(ev, tp, frozen, batches: list, gamma: int, weights: np.ndarray) -> dict:
    """Held-out evaluation of a block drafter on :func:`eval_batches`, pooled and per category:
    :func:`summarize`'s keys plus ``by_category`` (``{category: the same}``). ``ev``:
    :func:`make_block_eval`. No eval sequence: every figure is ``None`` (no data)."""
    import jax.numpy as jnp

    tot = np.zeros(4 * gamma + 2)
    by: dict = {}
    for bt, cats in batches:
        ce, hit = (np.asarray(x, np.float64) for x in ev(tp, frozen, {k: jnp.asarray(v) for k, v in bt.items()}))
        for j, cat in enumerate(cats):
            v = window_stats(ce[j], hit[j], bt["valid"][j].astype(np.float64), weights)
            tot += v
            by[cat] = by.get(cat, 0.0) + v
    res = summarize(tot, gamma)
    res["by_category"] = {c: summarize(v, gamma) for c, v in sorted(by.items())}
    return res
