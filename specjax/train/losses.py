"""Distillation losses (pure JAX functions of the drafter parameters and a batch from
:func:`specjax.train.batches.build_batch`): feature regression + cross-entropy against the
target's top-k, for the teacher-forced pass and the unrolled pass, and the copy-term variant."""

from __future__ import annotations


def loss_parts(cfg, params, batch, ce_weight, full_head=False, full_ce=True, second_pass=True):
    """Per-position loss of the first pass (true features) and of the unrolled second
    pass (own features), and greedy hits: ``(l1, l2, hit1, hit2)``, each [B, W] float32
    (``l2``/``hit2`` zeros without ``second_pass``). Loss = smooth-L1(f, h) (mean over the
    hidden size) + ``ce_weight`` × cross-entropy.

    ``full_ce``: soft labels (the target's top-k inside the sub-vocabulary, renormalized)
    against log q over the whole sub-vocabulary; otherwise a ranking loss among the top-k
    candidates only (k head rows per position; the feature regression keeps f near h for
    all other tokens). With ``full_head`` the hits use the argmax over the whole
    sub-vocabulary (evaluation), else the best of the top-k. A drafter with a copy term
    (``cfg.copy_ngram``) uses :func:`copy_terms`.

    ``cfg``: the :class:`specjax.drafters.eagle.EagleConfig`; ``params``: ``{"train", "frozen"}``;
    ``batch``: the arrays of :func:`specjax.train.batches.build_batch` (as JAX arrays)."""
    import jax
    import jax.numpy as jnp

    from specjax.drafters import eagle

    b, w = batch["tokens"].shape
    pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    cache = eagle.new_cache(cfg, b, w)
    f, _ = eagle.forward(cfg, params, batch["feats"], batch["tokens"], pos, cache)
    if second_pass:  # pass 2: the drafter's own features as inputs (what drafts 2..γ see)
        feats2 = jnp.concatenate([batch["feats"][:, :1], f[:, :-1]], axis=1)
        f2, _ = eagle.forward(cfg, params, feats2, batch["tokens"], pos, cache)
    head = params["frozen"]["head"]
    ti = batch["ti"]
    valid = ti >= 0
    pp = jnp.where(valid, batch["tp"], 0.0)
    pp = pp / jnp.maximum(pp.sum(-1, keepdims=True), 1e-9)
    hk = jnp.take(head, jnp.maximum(ti, 0), axis=0)  # [B, W, k, D]

    def terms(f):
        diff = f - batch["th"]
        ad = jnp.abs(diff)
        sl1 = jnp.mean(jnp.where(ad < 1.0, 0.5 * diff * diff, ad - 0.5), axis=-1)
        if cfg.copy_ngram:
            ce, hit = copy_terms(params, f, batch)
            return sl1 + ce_weight * ce, hit
        if full_ce:  # soft labels (target top-k inside S) against log q over the whole sub-vocabulary
            full = jax.nn.log_softmax(eagle.sub_logits(params, f), axis=-1)
            lq = jnp.take_along_axis(full, jnp.maximum(ti, 0), axis=-1)
            ce = -jnp.sum(jnp.where(valid, pp * lq, 0.0), axis=-1)
            lk = jnp.where(valid, lq, -1e30)
        else:  # ranking among the target's top-k candidates only (k head rows per position)
            lk = jnp.einsum("bwd,bwkd->bwk", f, hk)
            lk = jnp.where(valid, lk, -1e30)
            logq = jax.nn.log_softmax(lk, axis=-1)
            ce = -jnp.sum(jnp.where(valid, pp * logq, 0.0), axis=-1)
        if full_head:
            pred = jnp.argmax(eagle.sub_logits(params, f), axis=-1)
        else:
            pred = jnp.take_along_axis(ti, jnp.argmax(lk, axis=-1)[..., None], axis=-1)[..., 0]
        hit = (pred == batch["am"]).astype(jnp.float32)
        return sl1 + ce_weight * ce, hit

    l1, hit1 = terms(f)
    if not second_pass:
        return l1, jnp.zeros_like(l1), hit1, jnp.zeros_like(hit1)
    l2, hit2 = terms(f2)
    return l1, l2, hit1, hit2


def ttt_loss_parts(cfg, params, batch, steps: int, full_head=False):
    """Per-step cross-entropy and greedy hits of a fused-feature drafter unrolled ``steps`` times
    (training-time test, :func:`specjax.drafters.eagle.ttt_forward`): ``(ce [K, B, W], hit [K, B, W],
    valid [K, B, W])``. Step k at position s is the (k+1)-th draft of a round (its target: the
    target's distribution there); ``valid`` drops the first k positions of each window, whose
    unrolled inputs start from the window's zero feature. No feature regression: the drafter's
    own features need not equal any target layer (EAGLE-3 drops that loss). Cross-entropy as
    :func:`loss_parts` with ``full_ce`` (or :func:`copy_terms` with a copy term)."""
    import jax.numpy as jnp

    from specjax.drafters import eagle

    feats = eagle.input_features(cfg, params, batch["feats"])
    outs = eagle.ttt_forward(cfg, params, feats, batch["tokens"], steps)
    ces, hits, valids = [], [], []
    w = batch["tokens"].shape[1]
    for k, f in enumerate(outs):
        ce, hit = _ce_hit(cfg, params, f, batch, full_head)
        ces.append(ce)
        hits.append(hit)
        valids.append(jnp.broadcast_to((jnp.arange(w) >= k).astype(jnp.float32), ce.shape))
    return jnp.stack(ces), jnp.stack(hits), jnp.stack(valids)


def _ce_hit(cfg, params, f, batch, full_head):
    """Soft-label cross-entropy of q over the sub-vocabulary (copy term included) against the
    target's top-k, and the greedy hit (argmax over the sub-vocabulary, or the top-k with
    ``full_head`` False): ``(ce [B, W], hit [B, W])``."""
    import jax
    import jax.numpy as jnp

    from specjax.drafters import eagle

    if cfg.copy_ngram:
        return copy_terms(params, f, batch)
    ti = batch["ti"]
    valid = ti >= 0
    pp = jnp.where(valid, batch["tp"], 0.0)
    pp = pp / jnp.maximum(pp.sum(-1, keepdims=True), 1e-9)
    full = jax.nn.log_softmax(eagle.sub_logits(params, f), axis=-1)
    lq = jnp.take_along_axis(full, jnp.maximum(ti, 0), axis=-1)
    ce = -jnp.sum(jnp.where(valid, pp * lq, 0.0), axis=-1)
    if full_head:
        pred = jnp.argmax(full, axis=-1)
    else:
        pred = jnp.take_along_axis(ti, jnp.argmax(jnp.where(valid, lq, -1e30), axis=-1)[..., None], axis=-1)[..., 0]
    return ce, (pred == batch["am"]).astype(jnp.float32)


def copy_terms(params, f, batch):
    """Cross-entropy and greedy hits of a drafter with a copy term: q over the
    sub-vocabulary plus the copy candidate (:func:`specjax.drafters.eagle.copy_logit`),
    against the target's top-k probabilities on the tokens q can give (inside S, or the
    candidate). ``f [B, W, D]``; returns ``(ce [B, W], hit [B, W])``."""
    import jax
    import jax.numpy as jnp

    from specjax.drafters import eagle

    sl = eagle.sub_logits(params, f)  # [B, W, S]
    cand, cn, cpos = batch["cand"], batch["cand_n"], batch["cand_pos"]
    has = cn > 0
    lc = eagle.copy_logit(params, f, cand, cn)  # -inf where no candidate
    in_s = jax.nn.one_hot(cpos, sl.shape[-1], dtype=bool) & has[..., None]  # cpos = -1 -> all False
    sl = jnp.where(in_s, lc[..., None], sl)
    extra = jnp.where(has & (cpos < 0), lc, -jnp.inf)
    logz = jnp.logaddexp(jax.nn.logsumexp(sl, axis=-1), extra)
    ti, tk = batch["ti"], batch["tk"]
    is_c = has[..., None] & (tk == cand[..., None])
    ok = (ti >= 0) | is_c
    lq = jnp.where(is_c, lc[..., None], jnp.take_along_axis(sl, jnp.maximum(ti, 0), axis=-1)) - logz[..., None]
    pp = jnp.where(ok, batch["tp"], 0.0)
    pp = pp / jnp.maximum(pp.sum(-1, keepdims=True), 1e-9)
    ce = -jnp.sum(jnp.where(ok, pp * lq, 0.0), axis=-1)
    best = jnp.argmax(sl, axis=-1)
    pred = jnp.where(has & (lc > jnp.max(sl, axis=-1)), cand, params["frozen"]["sub_ids"][best])
    return ce, (pred == batch["amt"]).astype(jnp.float32)

