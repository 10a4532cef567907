"""One statistics type for decoding runs: :class:`RunStats`, summed over rows, batches,
prompts or categories with ``+`` (a merge), and the derived figures defined once.

Definitions (Leviathan et al. 2023 §3; Spec-Bench, Xia et al. 2024):

* ``mean_accepted_tokens`` τ = new tokens ÷ target calls (the bonus/residual token included);
* ``acceptance_rate`` = accepted ÷ checked draft tokens (``None`` when no draft token was
  checked: autoregressive decoding has no acceptance rate, nor has a run with nothing drafted);
* ``tokens_per_s`` = new tokens ÷ decode seconds (prefill and compile excluded).

"No data" has one convention everywhere (Python and JSON): ``None`` (JSON ``null``), never
``0.0`` or NaN — τ without a target call, an acceptance rate with nothing checked, tokens/s
without decode time, a speedup without its baseline. :func:`ratio` and :func:`difference` are the
one division and subtraction that follow it; :func:`tau` and :func:`tokens_per_second` are the one
τ and tokens/s formula (:class:`RunStats`, a row's and a batch's figures in
:mod:`specjax.runtime.results`, a prompt's in :mod:`specjax.eval.bench` all call them).

Per-row counters come from :func:`specjax.runtime.decoder.row_stats` (they count only
emitted tokens); this module only adds them up. It lives in the runtime layer so that every
layer above it (``specjax.api`` included) can use it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping

def ratio(a, b) -> float | None:
    """``a ÷ b`` as a float, or ``None`` (no data) when either is ``None`` or not finite, or ``b`` is 0."""
    if a is None or b is None or not b or not math.isfinite(a) or not math.isfinite(b):
        return None
    return float(a) / float(b)


def difference(a, b) -> float | None:
    """``a − b`` as a float, or ``None`` (no data) when either is ``None`` or not finite."""
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b):
        return None
    return float(a) - float(b)


def tau(new_tokens, target_calls) -> float | None:
    """τ (``mean_accepted_tokens``): new tokens ÷ target calls, the bonus/residual token of each
    call included; ``None`` without a target call (no data)."""
    return ratio(new_tokens, target_calls)


def tokens_per_second(new_tokens, decode_s) -> float | None:
    """``tokens_per_s``: new tokens ÷ decode seconds (prefill and compile excluded); ``None``
    without decode time (``decode_s`` None, 0 or not finite: no data)."""
    return ratio(new_tokens, decode_s) if decode_s is not None and decode_s > 0 else None


COUNTERS = ("new_tokens", "target_calls", "draft_calls", "drafted_tokens", "accepted_tokens", "checked_tokens")


@dataclasses.dataclass(frozen=True)
class RunStats:
    """Counters (ints), seconds and the acceptance histogram of one or more decoded rows.

    accept_hist: rounds by number of accepted draft tokens (index n = n accepted), of any
      length (histograms of different γ merge by zero-padding).
    decode_s / prefill_s: seconds; rows of one batch share their batch's seconds, so add a
      batch's seconds once (:meth:`from_batch`), not once per row.
    rows: decoded rows (prompts) counted.
    """

    new_tokens: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    checked_tokens: int = 0
    accept_hist: tuple[int, ...] = ()
    decode_s: float = 0.0
    prefill_s: float = 0.0
    rows: int = 0

    @classmethod
    def from_row(cls, stats: Mapping) -> "RunStats":
        """One row's counters (a ``GenerationResult.stats`` dict; seconds are not taken)."""
        return cls(**{k: int(stats.get(k) or 0) for k in COUNTERS},
                   accept_hist=tuple(int(x) for x in stats.get("accept_hist") or ()), rows=1)

    @classmethod
    def from_batch(cls, row_stats: Iterable[Mapping], decode_s: float = 0.0, prefill_s: float = 0.0) -> "RunStats":
        """The rows of one decoded batch plus the batch's seconds (counted once)."""
        total = sum((cls.from_row(s) for s in row_stats), cls())
        return dataclasses.replace(total, decode_s=float(decode_s), prefill_s=float(prefill_s))

    def __add__(self, other: "RunStats") -> "RunStats":
        if not isinstance(other, RunStats):
            return NotImplemented
        a, b = list(self.accept_hist), list(other.accept_hist)
        n = max(len(a), len(b))
        hist = tuple(x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b))))
        return RunStats(**{k: getattr(self, k) + getattr(other, k) for k in COUNTERS}, accept_hist=hist,
                        decode_s=self.decode_s + other.decode_s, prefill_s=self.prefill_s + other.prefill_s,
                        rows=self.rows + other.rows)

    def __radd__(self, other):  # sum() starts from the int 0
        return self if other == 0 else self.__add__(other)

    @property
    def drafting(self) -> bool:
        """Whether a drafter ran (draft calls were made)."""
        return self.draft_calls > 0

    @property
    def mean_accepted_tokens(self) -> float | None:
        """τ: new tokens per target call (``None`` without target calls): :func:`tau`."""
        return tau(self.new_tokens, self.target_calls)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted ÷ checked draft tokens; ``None`` without a drafter or when no draft was checked (no data)."""
        return ratio(self.accepted_tokens, self.checked_tokens) if self.drafting else None

    @property
    def acceptance_by_position(self) -> list[float | None] | None:
        """Per-position acceptance ``[α_1, α_2, ...]`` from :attr:`accept_hist`: α_k = rounds with ≥ k
        drafts accepted ÷ rounds with ≥ k − 1 accepted (the chance draft k is accepted once drafts
        1..k−1 were; for a tree, depth k). ``None`` without a drafter. Rounds that offered fewer
        than k drafts (an EOS or length cut, a confidence stop) count as rejections at k, so the
        later positions read slightly low; a position no round reached is ``None``."""
        if not self.drafting:
            return None
        h = list(self.accept_hist)
        tail = [sum(h[k:]) for k in range(len(h))]  # rounds with >= k accepted
        return [ratio(tail[k], tail[k - 1]) for k in range(1, len(h))]

    @property
    def tokens_per_s(self) -> float | None:
        """New tokens per decode second (``None`` before any decode time): :func:`tokens_per_second`."""
        return tokens_per_second(self.new_tokens, self.decode_s)

    def summary(self) -> dict:
        """Counters and derived figures as a plain dict (JSON-ready)."""
        d = {k: getattr(self, k) for k in COUNTERS}
        d.update(accept_hist=list(self.accept_hist), decode_s=self.decode_s, prefill_s=self.prefill_s,
                 rows=self.rows, mean_accepted_tokens=self.mean_accepted_tokens,
                 acceptance_rate=self.acceptance_rate, acceptance_by_position=self.acceptance_by_position,
                 tokens_per_s=self.tokens_per_s)
        return d
