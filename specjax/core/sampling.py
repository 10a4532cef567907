"""Logits → processed probabilities, and sampling from them.

The SAME :func:`process_logits` makes the target's ``p`` and the drafter's ``q``
(docs/design.md, "q is what was sampled from"), so speculative sampling reproduces
exactly the distribution this module defines.

The sampling settings are declared once, in :class:`Sampling` (each field's default, range
and help); :class:`SamplingParams` carries them to the device as *traced* per-row arrays, not
static configuration: a new temperature or penalty does not recompile anything.

Order of processing (transformers' order, documented in the README): the logit bias, the
repetition penalty, the frequency and presence penalties and the ``min_tokens`` EOS mask act on
the raw logits (:func:`penalize`, which needs the token history); then temperature, top-k,
top-p and min-p (:func:`process_logits`).

No full sort of the vocabulary is done (a 9 × 49,152 sort measured 89 ms on the
2-core CPU). The top-k / top-p thresholds are found exactly by a bisection over
the float32 bit patterns of the probabilities: for non-negative IEEE floats the
int32 view is monotone, so 31 halvings of ``[0, bits(+inf)]``, each a masked
count (top-k) or masked sum (top-p) over the last axis, land on the exact
threshold value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.core import settings as knobs_mod
from specjax.core.settings import SettingError, is_int, is_number, knob

__all__ = ["process_logits", "sample", "Sampling", "SamplingParams", "penalize", "LOGIT_BIAS_SLOTS"]

# int32 view of float32 +inf: every finite non-negative float32 has bits < this.
_BITS_INF = 0x7F800000
# 31 halvings take an interval of width 0x7F800001 < 2**31 down to width 1.
_BISECT_STEPS = 31


def _kth_largest_bits(bits: jax.Array, k: jax.Array) -> jax.Array:
    """Largest t with ``#{i : bits_i >= t} >= k``: the bits of the k-th largest value.

    bits: int32 [..., V] (views of non-negative float32); k: int32 [...] in [1, V].
    Returns int32 [...].
    """
    lo = jnp.zeros(k.shape, jnp.int32)  # count(bits >= 0) = V >= k: always "ok"
    hi = jnp.full(k.shape, _BITS_INF + 1, jnp.int32)  # count(bits >= hi) = 0 < k

    def body(_, carry):
        lo, hi = carry
        mid = lo + (hi - lo) // 2
        count = jnp.sum(bits >= mid[..., None], axis=-1, dtype=jnp.int32)
        ok = count >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = lax.fori_loop(0, _BISECT_STEPS, body, (lo, hi))
    return lo


def _top_p_bits(bits: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """Largest t with ``sum(weights_i for bits_i >= t) >= target`` (float32 sums).

    bits: int32 [..., V]; weights: float32 [..., V] >= 0; target: float32 [...]
    with ``target <= sum(weights)``. Returns int32 [...] (0 if only t = 0 works).
    """
    lo = jnp.zeros(target.shape, jnp.int32)
    hi = jnp.full(target.shape, _BITS_INF + 1, jnp.int32)

    def body(_, carry):
        lo, hi = carry
        mid = lo + (hi - lo) // 2
        mass = jnp.sum(jnp.where(bits >= mid[..., None], weights, 0.0), axis=-1)
        ok = mass >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = lax.fori_loop(0, _BISECT_STEPS, body, (lo, hi))
    return lo


def _filter_top_k_top_p(s, top_k, top_p, min_p, use_k, use_p, use_m):
    """``s [..., V]`` probabilities restricted to the top-k set, then the top-p set inside it,
    then the min-p set, renormalized (see :func:`process_logits`; rows with
    ``use_k``/``use_p``/``use_m`` false are kept)."""
    vocab = s.shape[-1]
    bits = lax.bitcast_convert_type(s, jnp.int32)  # monotone: s >= 0

    def top_k_keep(_):
        k = jnp.where(use_k, top_k, vocab)
        return bits >= _kth_largest_bits(bits, k)[..., None]

    keep = lax.cond(jnp.any(use_k), top_k_keep, lambda _: jnp.ones(s.shape, bool), None)

    def top_p_keep(keep):
        w = jnp.where(keep, s, 0.0)
        total = jnp.sum(w, axis=-1)
        target = jnp.where(use_p, top_p * total, total)
        tau = _top_p_bits(bits, w, jnp.minimum(target, total))
        return keep & ((bits >= tau[..., None]) | ~use_p[..., None])

    keep = lax.cond(jnp.any(use_p), top_p_keep, lambda keep: keep, keep)
    # min-p: the most likely token is always kept, so the threshold on the kept set's
    # renormalized probabilities is the same threshold on s
    s_max = jnp.max(s, axis=-1, keepdims=True)
    keep = keep & ((s >= min_p[..., None] * s_max) | ~use_m[..., None])
    w = jnp.where(keep, s, 0.0)
    return w / jnp.sum(w, axis=-1, keepdims=True)


def process_logits(
    logits: jax.Array,
    temperature: Any,
    top_k: Any,
    top_p: Any,
    min_p: Any = 0.0,
) -> jax.Array:
    """Turn logits into the sampling distribution (temperature, top-k, top-p, min-p, greedy).

    Args:
      logits: float [..., V], any float dtype; computed in float32.
      temperature: float, broadcastable to ``logits.shape[:-1]`` (per-row, traced).
        ``0`` means greedy. Must be ``>= 0`` (not checked here: traced; see
        :meth:`SamplingParams.create`).
      top_k: int, broadcastable to ``logits.shape[:-1]``. ``<= 0`` means off;
        ``>= V`` keeps everything.
      top_p: float, broadcastable to ``logits.shape[:-1]``, valid range (0, 1].
        ``>= 1`` means off.
      min_p: float, broadcastable to ``logits.shape[:-1]``, valid range [0, 1].
        ``<= 0`` means off.

    Returns:
      float32 [..., V] probabilities summing to 1 over the last axis.

    The exact distribution, per row, with z = float32(logits):

    * **greedy** (temperature == 0): one-hot at ``argmax z``, the LOWEST index on
      ties. top_k / top_p are ignored.
    * otherwise ``s = exp((z - max z) / T) / sum(...)`` (= softmax(z / T)), then

      - **top-k** (0 < k): ``tau_k`` = the k-th largest value of ``s`` counted
        with multiplicity, ``K = {i : s_i >= tau_k}``. Ties at the threshold are
        ALL kept, so ``|K| >= k`` (``> k`` only when ``s`` has equal values at
        the k-th place). ``k >= V`` keeps every token. Off: ``K`` = all tokens.
      - **top-p** (top_p < 1), applied after top-k: with ``M = sum_{i in K} s_i``,
        ``tau_p`` = the largest value such that
        ``sum_{i in K, s_i >= tau_p} s_i >= top_p * M``, and
        ``P = {i in K : s_i >= tau_p}`` — the smallest set of the form
        ``{s >= t}`` inside ``K`` whose mass is at least ``top_p`` of the
        renormalized top-k distribution (ties at the threshold all kept; masses
        are float32 sums). Off: ``P = K``.
      - **min-p** (min_p > 0), applied after top-p (transformers' ``MinPLogitsWarper``):
        ``M = {i in P : s_i >= min_p * max_j s_j}`` (the most likely token is in P, so this is
        the rule on P's renormalized probabilities). Off: ``M = P``.
      - result ``s_i * [i in M] / sum_{j in M} s_j``.

    Thresholds are exact float32 values found by bisection over the int32 bit
    patterns of ``s`` (31 masked counts/sums over V each), not by sorting; the
    whole filter is skipped with ``lax.cond`` when no row uses top-k or top-p
    (call it on the whole batch: under ``vmap`` the condition becomes per-row
    and both branches run). Tokens whose ``s`` underflows to 0 stay at 0
    whether "kept" or not.
    """
    z = jnp.asarray(logits).astype(jnp.float32)
    batch_shape, vocab = z.shape[:-1], z.shape[-1]
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), batch_shape)
    top_k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), batch_shape)
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), batch_shape)
    min_p = jnp.broadcast_to(jnp.asarray(min_p, jnp.float32), batch_shape)

    greedy = temperature <= 0.0
    safe_t = jnp.where(greedy, 1.0, temperature)
    z_max = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp((z - z_max) / safe_t[..., None])  # in [0, 1], the max is 1
    s = e / jnp.sum(e, axis=-1, keepdims=True)

    use_k = (top_k > 0) & (top_k < vocab) & ~greedy
    use_p = (top_p < 1.0) & ~greedy
    use_m = (min_p > 0.0) & ~greedy

    s = lax.cond(jnp.any(use_k | use_p | use_m),
                 lambda s: _filter_top_k_top_p(s, top_k, top_p, min_p, use_k, use_p, use_m), lambda s: s, s)
    one_hot = jax.nn.one_hot(jnp.argmax(z, axis=-1), vocab, dtype=jnp.float32)
    return jnp.where(greedy[..., None], one_hot, s)


_CDF_BLOCK = 256  # two-level inverse CDF: a 49,152-wide cumsum costs ~5 ms on CPU


def _positive(probs: jax.Array) -> jax.Array:
    """``probs > 0`` decided on the bit pattern, so that float32 subnormals count.

    XLA on CPU flushes subnormals to zero in arithmetic and comparisons; the
    int32 view is positive exactly for +subnormal, +normal and +inf values
    (-0.0 and negatives have the sign bit set).
    """
    return lax.bitcast_convert_type(probs.astype(jnp.float32), jnp.int32) > 0


def _pick(probs: jax.Array, positive: jax.Array, target: jax.Array) -> jax.Array:
    """First index with positive mass whose cumulative sum exceeds ``target``.

    probs: float32 [..., W] >= 0; positive: bool [..., W]; target: float32
    [...]. Returns int32 [...]. Never an index where ``positive`` is False:
    candidates are masked by it, and if rounding leaves no candidate the last
    positive index is used (W - 1 if there is none).
    """
    width = probs.shape[-1]
    hit = positive & (jnp.cumsum(probs, axis=-1) > target[..., None])
    first_hit = jnp.argmax(hit, axis=-1)  # argmax of bool = first True
    last_positive = width - 1 - jnp.argmax(positive[..., ::-1], axis=-1)
    return jnp.where(jnp.any(hit, axis=-1), first_hit, last_positive).astype(jnp.int32)


def inverse_cdf(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF draw: the first index whose cumulative mass exceeds ``u * total``.

    probs: float [..., V] >= 0 with a positive total; u: float [...] in [0, 1).
    Returns int32 [...] in [0, V); an index with probability exactly 0 is never
    returned (subnormal probabilities, which XLA CPU flushes to 0 in sums,
    count as non-zero here but are drawn only if nothing else is positive).
    An all-zero row returns V - 1.
    For V > 2 * 256 the search is two-level (block sums, then inside the chosen
    block) — the same draw up to float32 rounding, ~20× faster on CPU than one
    cumulative sum over 49,152 entries.
    """
    probs = probs.astype(jnp.float32)
    u = u.astype(jnp.float32)
    vocab = probs.shape[-1]
    positive = _positive(probs)
    if vocab <= 2 * _CDF_BLOCK:
        return _pick(probs, positive, u * jnp.sum(probs, axis=-1))
    n_blocks = -(-vocab // _CDF_BLOCK)
    pad = [(0, 0)] * (probs.ndim - 1) + [(0, n_blocks * _CDF_BLOCK - vocab)]
    split = lambda a: a.reshape(a.shape[:-1] + (n_blocks, _CDF_BLOCK))
    blocks = split(jnp.pad(probs, pad))
    block_pos = split(jnp.pad(positive, pad))  # padding is never positive
    block_mass = jnp.sum(blocks, axis=-1)  # [..., n_blocks]
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    target = u * block_cdf[..., -1]
    b = _pick(block_mass, jnp.any(block_pos, axis=-1), target)
    before = jnp.where(
        b > 0, jnp.take_along_axis(block_cdf, jnp.maximum(b - 1, 0)[..., None], -1)[..., 0], 0.0
    )
    take = lambda a: jnp.take_along_axis(a, b[..., None, None], axis=-2)[..., 0, :]
    inner = _pick(take(blocks), take(block_pos), target - before)
    return jnp.minimum(b * _CDF_BLOCK + inner, vocab - 1)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Draw one id per row from ``probs`` (inverse CDF with one uniform per row).

    Args:
      key: a PRNG key (raw uint32 [2] or typed); the draw is a deterministic
        function of ``key`` and ``probs``.
      probs: float [..., V], non-negative, positive total (need not be exactly
        normalized: ``u`` is scaled by the row total).

    Returns:
      int32 [...] ids. ``P(id = i) = probs_i / sum(probs)`` up to float32
      rounding of the cumulative sum; an id with probability exactly 0 is never
      returned.
    """
    probs = jnp.asarray(probs)
    u = jax.random.uniform(key, probs.shape[:-1], jnp.float32)
    return inverse_cdf(probs, u)


LOGIT_BIAS_SLOTS = 300  # ids one row's logit bias may name (OpenAI's limit); a fixed shape: one program
_INT32_MAX = int(np.iinfo(np.int32).max)


def _bias_ok(v) -> bool:
    return len(v) <= LOGIT_BIAS_SLOTS and all(
        is_int(i) and 0 <= i <= _INT32_MAX and is_number(b) and -100 <= b <= 100 for i, b in v)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: THE declaration of every sampling setting (frozen, hashable).

    Each field declares its default, its valid range and its one-line help
    (:func:`specjax.core.settings.knob`); the CLI flags, the pair-config keys, the Python
    keywords, the per-row device arrays (:class:`SamplingParams`), the ``--gamma auto``
    measurement cache key and the bench JSON are derived from these fields.

    Order of processing: ``logit_bias`` → ``repetition_penalty`` → ``frequency_penalty`` and
    ``presence_penalty`` → ``min_tokens`` (:func:`penalize`, on the raw logits) → temperature →
    top-k → top-p → min-p (:func:`process_logits`). The repetition penalty counts the prompt and
    the output (as transformers does); presence and frequency count the output only (as OpenAI
    does). Under speculation the target's p at a draft position is penalized with the committed
    text plus the round's earlier drafts (a tree node: its path), exactly as autoregressive
    decoding would have seen it.

    Raises:
      SettingError (a ValueError): a field out of its range, naming the field and the range.
    """

    temperature: float = knob(0.0, kind=float, check=lambda v: v >= 0, expect="a finite number >= 0 (0 = greedy)",
                              help="0 = greedy (default)")
    top_k: int = knob(0, kind=int, check=lambda v: 0 <= v <= _INT32_MAX, expect="an integer >= 0 (0 = off)",
                      help="keep the k most likely tokens (0 = off)")
    top_p: float = knob(1.0, kind=float, check=lambda v: 0 < v <= 1, expect="a finite number in (0, 1] (1 = off)",
                        help="nucleus sampling mass in (0, 1] (1 = off)")
    min_p: float = knob(0.0, kind=float, check=lambda v: 0 <= v <= 1, expect="a finite number in [0, 1] (0 = off)",
                        help="drop tokens less likely than P × the most likely one (after top-p; 0 = off)")
    repetition_penalty: float = knob(
        1.0, kind=float, check=lambda v: v > 0, expect="a finite number > 0 (1 = off)",
        help="CTRL/transformers rule: divide positive logits and multiply negative ones by R for every token "
             "already in the prompt or the output (1 = off)")
    presence_penalty: float = knob(
        0.0, kind=float, check=lambda v: -2 <= v <= 2, expect="a finite number in [-2, 2] (0 = off)",
        help="OpenAI rule: subtract P from the logit of every token generated at least once (0 = off)")
    frequency_penalty: float = knob(
        0.0, kind=float, check=lambda v: -2 <= v <= 2, expect="a finite number in [-2, 2] (0 = off)",
        help="OpenAI rule: subtract F × (times generated) from each token's logit (0 = off)")
    min_tokens: int = knob(0, kind=int, check=lambda v: 0 <= v <= _INT32_MAX, expect="an integer >= 0 (0 = off)",
                           help="EOS and stop ids cannot end a row before N new tokens (0 = off)")
    logit_bias: tuple = knob(
        (), kind=tuple, check=_bias_ok, flag=False, device=False,
        expect=f"a map of at most {LOGIT_BIAS_SLOTS} token ids (integers >= 0) to biases in [-100, 100]",
        help="added to the raw logits of the named ids (Python: a dict {id: bias}; config: a table)")

    def __post_init__(self):
        bias = self.logit_bias
        if isinstance(bias, dict):
            try:
                bias = tuple(sorted((int(k) if isinstance(k, str) and k.strip().isdigit() else k, v)
                                    for k, v in bias.items()))
            except TypeError:
                raise SettingError("logit_bias", f"logit_bias must be {_bias_expect()}, got {self.logit_bias!r}") from None
            object.__setattr__(self, "logit_bias", bias)
        elif isinstance(bias, (list, tuple)) and all(isinstance(x, (list, tuple)) and len(x) == 2 for x in bias):
            object.__setattr__(self, "logit_bias", tuple((k, v) for k, v in bias))
        knobs_mod.validate(self)


def _bias_expect() -> str:
    return dict((n, k) for n, k, _ in knobs_mod.knobs(Sampling))["logit_bias"].expect


def _row_values(name: str, k, value, batch: int) -> np.ndarray:
    """One value per row of a device knob, validated against its declared range."""
    try:
        arr = np.broadcast_to(np.asarray(value), (batch,))
    except ValueError:
        raise SettingError(name, f"{name} must be a scalar or have shape ({batch},) (one value per row), got shape "
                                 f"{np.shape(value)}") from None
    for v in arr.tolist():
        if not (knobs_mod.of_kind(k.kind, v) and k.check(v)):
            raise SettingError(name, f"{name} must be {k.expect}, got {value!r}")
    return arr.astype(np.float64)


@jax.tree_util.register_pytree_node_class
class SamplingParams:
    """Per-row sampling settings on the device: a pytree of traced arrays (no recompiles).

    One float32/int32 ``[B]`` array per device field of :class:`Sampling` (the declaration:
    ``temperature``, ``top_k``, ``top_p``, ``min_p``, the penalties, ``min_tokens``; read them as
    attributes), plus the logit bias as ``bias_ids`` int32 ``[B, LOGIT_BIAS_SLOTS]`` (−1 unused)
    and ``bias_values`` float32 ``[B, LOGIT_BIAS_SLOTS]``.

    Build with :meth:`create` (keywords: scalars or one value per row) or :meth:`from_rows`
    (one :class:`Sampling` per row), which validate. See :func:`penalize` and
    :func:`process_logits` for the exact distribution.
    """

    def __init__(self, rows: dict):
        self.rows = dict(rows)

    def tree_flatten(self):
        names = tuple(sorted(self.rows))
        return tuple(self.rows[n] for n in names), names

    @classmethod
    def tree_unflatten(cls, names, children):
        return cls(dict(zip(names, children)))

    def __getattr__(self, name):
        rows = self.__dict__.get("rows")
        if rows is not None and name in rows:
            return rows[name]
        raise AttributeError(name)

    def __repr__(self):
        return f"SamplingParams({', '.join(sorted(self.rows))})"

    @classmethod
    def create(cls, batch: int, temperature: Any = 0.0, top_k: Any = 0, top_p: Any = 1.0,
               **fields) -> "SamplingParams":
        """Validated per-row settings: each :class:`Sampling` field as a scalar or a length-``batch``
        sequence (``logit_bias``: one map ``{id: bias}`` for every row, or a list of one dict per row).

        Raises:
          SettingError (a ValueError) naming the field and its valid range; an unknown field name.
        """
        if isinstance(batch, bool) or int(batch) != batch or batch < 1:
            raise ValueError(f"batch must be a positive integer, got {batch!r}")
        batch = int(batch)
        given = dict(temperature=temperature, top_k=top_k, top_p=top_p, **fields)
        declared = {n: (k, d) for n, k, d in knobs_mod.knobs(Sampling)}
        unknown = sorted(set(given) - set(declared))
        if unknown:
            raise TypeError(f"unknown sampling setting(s) {unknown}; declared: {sorted(declared)}")
        rows = {}
        for name, (k, default) in declared.items():
            if not k.device:
                continue
            vals = _row_values(name, k, given.get(name, default), batch)
            rows[name] = jnp.asarray(vals, k.dtype)
        bias = given.get("logit_bias", ())
        per_row = isinstance(bias, list) and bool(bias) and all(isinstance(m, dict) for m in bias)
        if per_row and len(bias) != batch:
            raise SettingError("logit_bias", f"logit_bias as a list needs one map per row ({batch}), got {len(bias)}")
        maps = bias if per_row else [bias] * batch
        ids = np.full((batch, LOGIT_BIAS_SLOTS), -1, np.int32)
        vals = np.zeros((batch, LOGIT_BIAS_SLOTS), np.float32)
        for r, m in enumerate(maps):
            pairs = Sampling(logit_bias=m).logit_bias  # validates
            for j, (i, v) in enumerate(pairs):
                ids[r, j], vals[r, j] = i, v
        rows["bias_ids"] = jnp.asarray(ids)
        rows["bias_values"] = jnp.asarray(vals)
        return cls(rows)

    @classmethod
    def from_rows(cls, settings) -> "SamplingParams":
        """Per-row settings from one :class:`Sampling` per row (a mixed batch runs one program)."""
        settings = list(settings)
        names = [n for n, _, _ in knobs_mod.knobs(Sampling)]
        cols = {n: [getattr(s, n) for s in settings] for n in names}
        cols["logit_bias"] = [dict(s.logit_bias) for s in settings]
        return cls.create(len(settings), **cols)

    @property
    def batch(self) -> int:
        return self.temperature.shape[0]

    def with_vocab(self, vocab: int) -> "SamplingParams":
        """Check the logit-bias ids against the vocabulary. Raises SettingError naming the id."""
        ids = np.asarray(self.bias_ids)
        if ids.size and int(ids.max()) >= vocab:
            raise SettingError("logit_bias", f"logit_bias names token id {int(ids.max())}, outside the vocabulary "
                                             f"[0, {vocab}); use ids below {vocab}")
        return self

    def process(self, logits: jax.Array) -> jax.Array:
        """:func:`process_logits` with row b's settings on ``logits[b, ...]``.

        logits: float [B, ..., V] → float32 [B, ..., V].
        """
        extra = (1,) * (jnp.ndim(logits) - 2)
        r = lambda a: a.reshape(a.shape + extra)  # noqa: E731
        return process_logits(logits, r(self.temperature), r(self.top_k), r(self.top_p), r(self.min_p))


def penalize(logits: jax.Array, sp: SamplingParams, seen: jax.Array, counts: jax.Array, drafts: jax.Array,
             sees: jax.Array, new_before: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """The logit bias, the penalties and the ``min_tokens`` mask on the target's raw logits of one
    call, each position with ITS token history (committed text + the drafts on its path).

    Args (B batch, T positions of the call, S draft tokens of the call, V vocabulary, E stop ids):
      logits: float [B, T, V] raw logits at the call's positions (any float dtype; float32 out).
      sp: the rows' :class:`SamplingParams`.
      seen: bool [B, V], ids present in the prompt or the committed output (repetition penalty).
      counts: int32 [B, V], occurrences of each id in the committed output (presence, frequency).
      drafts: int32 [B, S], the call's draft tokens (−1: none).
      sees: bool [B, T, S], whether position t's history includes draft s (a chain: s < t; a tree:
        s on the path root → t's node, the node included).
      new_before: int32 [B, T], new tokens committed before the token position t predicts,
        counting the drafts on its path (``min_tokens``).
      stop_ids: int32 [B, E], the ids that end a row (−1 unused), masked while
        ``new_before < min_tokens``.

    Returns float32 [B, T, V]. With h = the position's history (counts c_i over the output,
    present_i over prompt + output), per token i, in this order:
      z_i += bias_i; if present_i: z_i = z_i / R if z_i > 0 else z_i · R (CTRL, Keskar et al. 2019;
      transformers' ``RepetitionPenaltyLogitsProcessor``); z_i -= F · c_i + P · [c_i > 0] (OpenAI's
      frequency and presence penalties); z_stop = −inf while new_before < min_tokens. All of it is
      skipped (one ``lax.cond``) when no row of the batch uses any part, so plain batches cost nothing.
    Draft counts are exact integers (0/1 products summed in float32).
    """
    z = jnp.asarray(logits).astype(jnp.float32)
    b, t, vocab = z.shape
    rows = jnp.arange(b)[:, None]

    rep, pres, freq = sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty
    early = new_before < sp.min_tokens[:, None]  # [B, T]

    def apply(z):  # every part; a row that does not use a part is left unchanged by it
        ids = jnp.where(sp.bias_ids >= 0, sp.bias_ids, vocab)
        bias = jnp.zeros((b, vocab), jnp.float32).at[rows, ids].add(sp.bias_values, mode="drop")
        z = z + bias[:, None, :]
        onehot = jax.nn.one_hot(drafts, vocab, dtype=jnp.float32)  # −1 → a zero row
        extra = jnp.einsum("bts,bsv->btv", sees.astype(jnp.float32), onehot, precision=lax.Precision.HIGHEST)
        count = counts[:, None, :].astype(jnp.float32) + extra  # [B, T, V]
        present = seen[:, None, :] | (extra > 0)
        r = rep[:, None, None]
        z = jnp.where(present, jnp.where(z > 0, z / r, z * r), z)
        z = z - freq[:, None, None] * count - pres[:, None, None] * (count > 0).astype(jnp.float32)
        stop = jnp.where(stop_ids >= 0, stop_ids, vocab)  # [B, E]
        is_stop = jnp.zeros((b, vocab), bool).at[rows, stop].set(True, mode="drop")
        return jnp.where(early[:, :, None] & is_stop[:, None, :], -jnp.inf, z)

    used = jnp.any(sp.bias_ids >= 0) | jnp.any((rep != 1.0) | (pres != 0.0) | (freq != 0.0)) | jnp.any(early)
    return lax.cond(used, apply, lambda z: z, z)  # one branch: no copies of z when nothing is used
