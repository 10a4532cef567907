"""A finished decode on the host (part of :mod:`specjax.runtime.decoder`, which re-exports it):
:class:`GenerationResult`, and the one definition of the reported per-row statistics
(:func:`row_stats`), finish reasons and log-probabilities from a final
:class:`~specjax.runtime.loop.DecodeState` (:func:`host_result`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import numpy as np

from specjax.runtime.loop import DecodeState
from specjax.runtime.stats import ratio, tau, tokens_per_second


@dataclasses.dataclass(frozen=True, eq=False)
class RowStats(Mapping):
    """The statistics of one decoded row (``GenerationResult.stats[i]``), typed; also a read-only
    mapping by field name (``stats["new_tokens"]``, ``dict(stats)``: the documented JSON field
    names), equal to a dict of the same items.

    Counters count only the row's emitted tokens (:func:`row_stats`, the one definition):
    ``new_tokens``; ``target_calls`` (after prefill); ``draft_calls``; ``drafted_tokens``
    (offered); ``accepted_tokens``; ``checked_tokens`` (accepted + the rejected one per round);
    ``mean_accepted_tokens`` τ = new tokens ÷ target calls (Spec-Bench's τ; ``None`` for a row
    with no target call: no data, :mod:`specjax.runtime.stats`' one convention); ``acceptance_rate`` = accepted ÷ checked (``None`` without a drafter or when
    nothing was checked); ``accept_hist`` rounds by accepted drafts (index n = n accepted);
    ``finish_reason`` ``"eos"``, ``"stop"`` or ``"length"``."""

    new_tokens: int
    target_calls: int
    draft_calls: int
    drafted_tokens: int
    accepted_tokens: int
    checked_tokens: int
    mean_accepted_tokens: float | None
    acceptance_rate: float | None
    accept_hist: list
    finish_reason: str

    def __getitem__(self, name: str):
        if name in _STAT_KEYS:
            return getattr(self, name)
        raise KeyError(name)

    def __iter__(self):
        return iter(_STAT_KEYS)

    def __len__(self) -> int:
        return len(_STAT_KEYS)

    def __repr__(self) -> str:
        return "RowStats(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in _STAT_KEYS) + ")"


@dataclasses.dataclass
class GenerationResult:
    """Output of :func:`~specjax.runtime.decoder.generate` for a batch.

    tokens: per row, the new token ids (EOS / a stop token included when it ended the row;
      for a stop string, up to the token that completed it).
    stats: per row, a :class:`RowStats` (typed fields, also read as a mapping by name):
      ``new_tokens``, ``target_calls``, ``draft_calls``, ``drafted_tokens``, ``accepted_tokens``,
      ``checked_tokens``, ``mean_accepted_tokens`` (new tokens ÷ target calls, Spec-Bench's τ;
      ``None`` without a target call),
      ``acceptance_rate`` (accepted ÷ checked draft tokens; ``None`` without a drafter or when
      no draft token was checked), ``accept_hist``, ``finish_reason`` (``eos``, ``stop`` or
      ``length``). Every counter counts only the emitted tokens.
    compile_s, prefill_s, decode_s: seconds (compile excluded from the other two;
      0 when the programs were already compiled).
    logprobs: per row and emitted token ``{"id", "logprob", "top": [(id, logprob), ...]}``
      (see :class:`~specjax.runtime.loop.Logprobs`), or ``None`` when not requested.
    """

    tokens: list[list[int]]
    stats: list[RowStats]
    compile_s: float
    prefill_s: float
    decode_s: float
    logprobs: list[list[dict]] | None = None

    @property
    def tokens_per_s(self) -> float | None:
        """All rows' new tokens ÷ decode seconds (``None`` without decode time: no data;
        :func:`specjax.runtime.stats.tokens_per_second`)."""
        return tokens_per_second(sum(len(t) for t in self.tokens), self.decode_s)


def row_stats(info: np.ndarray, rounds: np.ndarray, keep: int, speculative: bool) -> dict:
    """The counters of one row from its per-token record (:class:`DecodeState` ``emit_info``
    and ``emit_round`` over the row's new tokens), counting only its first ``keep`` tokens.

    A round cut short by ``keep`` (a stop string) counts the draft tokens it emitted as
    offered, checked and accepted, and nothing after them. This is the one definition of the
    reported statistics; the loop's on-device :class:`~specjax.runtime.loop.Stats` equal it for ``keep = len(info)``.
    Returns ``new_tokens, target_calls, draft_calls, drafted_tokens, accepted_tokens,
    checked_tokens, accept_hist`` (a list indexed by accepted drafts per round)."""
    if keep <= 0:
        return dict(new_tokens=0, target_calls=0, draft_calls=0, drafted_tokens=0, accepted_tokens=0,
                    checked_tokens=0, accept_hist=[])
    info = np.asarray(info[:keep], np.int64)
    r = np.asarray(rounds[:keep])
    starts = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
    acc = np.add.reduceat(info & 1, starts)
    rej = (info[starts] >> 1) & 1
    drafted = info[starts] >> 3
    drafter_ran = ((info[starts] >> 2) & 1) == 0  # not a plain round
    if keep < len(rounds) and rounds[keep] == r[-1]:  # the last kept round was cut short
        rej[-1], drafted[-1] = 0, acc[-1]
    calls = len(starts)
    return dict(new_tokens=int(keep), target_calls=calls, draft_calls=int(drafter_ran.sum()) if speculative else 0,
                drafted_tokens=int(drafted.sum()), accepted_tokens=int(acc.sum()),
                checked_tokens=int(acc.sum() + rej.sum()), accept_hist=np.bincount(acc).tolist())


_STAT_KEYS = ("new_tokens", "target_calls", "draft_calls", "drafted_tokens", "accepted_tokens", "checked_tokens",
              "mean_accepted_tokens", "acceptance_rate", "accept_hist", "finish_reason")


def host_result(st: DecodeState, compile_s, prefill_s, decode_s, cuts=None, model_eos=None) -> GenerationResult:
    """Host results of a finished (or round-limited) state. ``cuts``: ``{row: k}`` rows ended by
    a stop string after k new tokens. ``model_eos``: the EOS ids the row was decoded with (other
    ids that ended a row are stop token ids: ``finish_reason`` ``"stop"``; ``None``: every id
    is an EOS)."""
    cuts = cuts or {}
    toks = np.asarray(st.tokens)
    plen = np.asarray(st.prompt_lengths)
    lengths = np.asarray(st.lengths)
    eos = np.asarray(st.eos)
    info, rounds = np.asarray(st.emit_info), np.asarray(st.emit_round)
    hist_width = int(np.shape(st.stats.accept_hist)[1])
    speculative = hist_width > 1
    model_eos = None if model_eos is None else {int(e) for e in model_eos}
    lp = None if st.logprobs is None else jax.tree_util.tree_map(np.asarray, st.logprobs)
    out_tokens, out_stats, out_lp = [], [], []
    for i in range(toks.shape[0]):
        p, end = int(plen[i]), int(lengths[i])
        keep = min(cuts.get(i, end - p), end - p)
        new = toks[i, p: p + keep].tolist()
        out_tokens.append(new)
        s = row_stats(info[i, p: end], rounds[i, p: end], keep, speculative)
        hist = np.zeros(hist_width, np.int64)
        hist[: len(s["accept_hist"])] = s["accept_hist"]
        stops = set(eos[i].tolist()) - {-1}
        if i in cuts and keep == cuts[i]:
            reason = "stop"
        elif new and new[-1] in stops:
            reason = "eos" if model_eos is None or new[-1] in model_eos else "stop"
        else:
            reason = "length"
        s.update(accept_hist=hist.tolist(), mean_accepted_tokens=tau(len(new), s["target_calls"]),
                 acceptance_rate=ratio(s["accepted_tokens"], s["checked_tokens"]) if speculative else None,
                 finish_reason=reason)
        out_stats.append(RowStats(**{k: s[k] for k in _STAT_KEYS}))
        if lp is not None:
            sl = slice(p, p + keep)
            out_lp.append([{"id": t, "logprob": float(a),
                            "top": [(int(j), float(v)) for j, v in zip(ids, vals) if np.isfinite(v)]}
                           for t, a, ids, vals in zip(new, lp.token[i, sl], lp.top_ids[i, sl], lp.top_logprobs[i, sl])])
    return GenerationResult(out_tokens, out_stats, compile_s, prefill_s, decode_s, out_lp if lp is not None else None)
