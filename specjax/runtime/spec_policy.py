"""Speculation under load, chosen from measured costs (issue 31): the serving engine's choice,
chunk by chunk, between its speculative program and its ``plain`` one (one-token target calls
on the same state, :func:`specjax.runtime.loop._plain_round`).

Each of the engine's programs computes all of its rows, running or free, so a round's cost depends on
the row count it runs on (the engine's ladder) and the attention view, not on how many of those rows
run. What decides is, per row count and attention view, the measured seconds per
round of each program (t_spec, t_plain: a property of the programs and the host), and τ, the tokens a
running row commits per speculative round (a property of the requests served, measured exactly from
the rows' committed tokens and target calls). A plain round commits one token per row, so plain
chunks are faster when 1 / t_plain > τ / t_spec; speculation runs only when τ / t_spec beats 1 / t_plain
by :data:`SPEC_MARGIN`. Unmeasured programs are measured first; then the
faster one runs and the other is re-measured now and then (while plain chunks win, a speculative chunk
every :func:`spec_probe_every` chunks — τ may rise —: every :data:`PROBE_SPEC` when the two are close,
rarer as speculation's measured loss grows, so the probes cost about :data:`PROBE_LOSS` of the time;
a plain chunk every :data:`PROBE_PLAIN` while speculative ones win), all as exponentially weighted means.

Only chunks whose rows do not depend on the method may switch (greedy rows: the same tokens
either way; the engine keeps every sampled row on its method so that its seed reproduces it):
:meth:`AutoSpeculation.plain` is asked only then.
"""

from __future__ import annotations

import dataclasses
import math

SPECULATION = ("always", "auto")  # Engine(speculation=...) / serve --speculation: always, or by measured costs
PROBE_SPEC = 8  # while plain chunks are faster: a speculative chunk at most every this many chunks (τ may rise)
PROBE_SPEC_MAX = 64  # ... and at least every this many
PROBE_LOSS = 0.03  # the share of decode time the speculative probes may cost (sets their interval in between)
PROBE_PLAIN = 32  # while speculative chunks are faster: a plain chunk every this many
WEIGHT = 0.3  # weight of the newest chunk in the running means
# Speculative chunks run only where their measured rate beats plain chunks' by this factor: a round's
# time leaves out what speculation costs around it (the drafter's share of every admission, the
# switches); measured (BENCHMARKS.md, turn 23; int8, 8 clients): with measured rates within 1 % of a tie,
# auto served at 0.79x and 0.97x of the target alone (two runs; the host's spread is ±10-20 %).
SPEC_MARGIN = 1.15


def spec_probe_every(t_spec: float, t_plain: float, tau: float) -> int:
    """Chunks between speculative probes while plain chunks are faster: a probe's round takes
    ``t_spec`` seconds for ``tau`` tokens that plain rounds make in ``tau · t_plain``, so it loses
    ``(t_spec − tau · t_plain) / t_plain`` plain rounds; one probe per ``n`` chunks then costs that
    over ``n`` — ``n`` is the smallest keeping it at :data:`PROBE_LOSS`, within
    [:data:`PROBE_SPEC`, :data:`PROBE_SPEC_MAX`]."""
    loss = max(0.0, t_spec - tau * t_plain) / t_plain
    return min(PROBE_SPEC_MAX, max(PROBE_SPEC, math.ceil(loss / PROBE_LOSS)))


def _mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - WEIGHT) * old + WEIGHT * new


@dataclasses.dataclass
class AutoSpeculation:
    """The measured costs and the choice (see the module docstring).

    ``t_spec`` / ``t_plain``: ``{key: seconds per round}``, the key a view (the number of cache slots
    the chunk's first round attends over, ``None`` for the whole buffer) or the engine's ``(rows, view)``
    (the rows a chunk computes: :func:`~specjax.runtime.engine.row_ladder`); ``tau``: tokens per
    running row per speculative round (``None`` until measured).
    """

    t_spec: dict = dataclasses.field(default_factory=dict)
    t_plain: dict = dataclasses.field(default_factory=dict)
    tau: float | None = None
    since_spec: int = 0
    since_plain: int = 0

    def plain(self, view) -> bool:
        """Whether the next chunk (whose rows may switch) should be plain."""
        ts, tp = self.t_spec.get(view), self.t_plain.get(view)
        if ts is None or self.tau is None:
            return False
        if tp is None:
            return True
        if SPEC_MARGIN / tp > self.tau / ts:
            return self.since_spec < spec_probe_every(ts, tp, self.tau) - 1
        return self.since_plain >= PROBE_PLAIN - 1

    def record(self, plain: bool, view, seconds: float, rounds: int, tokens: int, row_rounds: int,
               timed: bool = True) -> None:
        """A chunk's outcome: ``rounds`` rounds in ``seconds`` (decode only; admissions' prefills are
        not the method's cost); its running rows committed ``tokens`` in ``row_rounds`` rounds
        (each row's target calls: a row that finished early counts its own rounds). ``timed=False``:
        ``seconds`` include other work that ran beside the chunk (an admission's programs, dispatched
        asynchronously), so they update the seconds per round only while that program is unmeasured
        — such chunks read plain rounds at 8 rows 1.7× their cost (BENCHMARKS.md, turn 24) and, since
        speculative chunks are shortened under admission, weighed against speculation."""
        if rounds <= 0 or seconds <= 0:
            return
        table = self.t_plain if plain else self.t_spec
        if timed or view not in table:
            table[view] = _mean(table.get(view), seconds / rounds)
        if not plain and row_rounds > 0:
            self.tau = _mean(self.tau, tokens / row_rounds)
        if plain:
            self.since_plain, self.since_spec = 0, self.since_spec + 1
        else:
            self.since_spec, self.since_plain = 0, self.since_plain + 1

    def summary(self) -> dict:
        """The measurements (for logs and benchmarks, JSON-ready): seconds per round by key (the view, or
        ``"rows/view"`` for the engine's ``(rows, view)`` keys), and τ."""
        def key(k):
            return "/".join(map(str, k)) if isinstance(k, tuple) else str(k)

        return {"t_spec": {key(k): v for k, v in self.t_spec.items()},
                "t_plain": {key(k): v for k, v in self.t_plain.items()}, "tau": self.tau}
