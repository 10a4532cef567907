"""Speculation under load, chosen from measured costs (issue 31): the serving engine's choice,
chunk by chunk, between its speculative program and its ``plain`` one (one-token target calls
on the same state, :func:`specjax.runtime.loop._plain_round`).

On one device the engine's programs compute every slot, running or free, so a round's cost does
not depend on how many requests run. What decides is, per attention view, the measured seconds per
round of each program (t_spec, t_plain: a property of the programs and the host), and τ, the tokens a
running row commits per speculative round (a property of the requests served, measured exactly from
the rows' committed tokens and target calls). A plain round commits one token per row, so plain
chunks are faster when 1 / t_plain > τ / t_spec. Unmeasured programs are measured first; then the
faster one runs and the other is re-measured now and then (a speculative chunk every
:data:`PROBE_SPEC` chunks while plain ones win — τ may rise —, a plain chunk every
:data:`PROBE_PLAIN` while speculative ones win), all as exponentially weighted means.

Only chunks whose rows do not depend on the method may switch (greedy rows: the same tokens
either way; the engine keeps every sampled row on its method so that its seed reproduces it):
:meth:`AutoSpeculation.plain` is asked only then.
"""

from __future__ import annotations

import dataclasses

SPECULATION = ("always", "auto")  # Engine(speculation=...) / serve --speculation: always, or by measured costs
PROBE_SPEC = 8  # while plain chunks are faster: a speculative chunk every this many chunks (τ may rise)
PROBE_PLAIN = 32  # while speculative chunks are faster: a plain chunk every this many
WEIGHT = 0.3  # weight of the newest chunk in the running means


def _mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - WEIGHT) * old + WEIGHT * new


@dataclasses.dataclass
class AutoSpeculation:
    """The measured costs and the choice (see the module docstring).

    ``t_spec`` / ``t_plain``: ``{view: seconds per round}`` (a view is the number of cache slots
    the chunk's first round attends over, ``None`` for the whole buffer); ``tau``: tokens per
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
        if 1.0 / tp > self.tau / ts:
            return self.since_spec < PROBE_SPEC - 1
        return self.since_plain >= PROBE_PLAIN - 1

    def record(self, plain: bool, view, seconds: float, rounds: int, tokens: int, row_rounds: int) -> None:
        """A chunk's outcome: ``rounds`` rounds in ``seconds`` (decode only; admissions' prefills are
        not the method's cost); its running rows committed ``tokens`` in ``row_rounds`` rounds
        (each row's target calls: a row that finished early counts its own rounds)."""
        if rounds <= 0 or seconds <= 0:
            return
        table = self.t_plain if plain else self.t_spec
        table[view] = _mean(table.get(view), seconds / rounds)
        if not plain and row_rounds > 0:
            self.tau = _mean(self.tau, tokens / row_rounds)
        if plain:
            self.since_plain, self.since_spec = 0, self.since_spec + 1
        else:
            self.since_spec, self.since_plain = 0, self.since_plain + 1

    def summary(self) -> dict:
        """The measurements (for logs and benchmarks): seconds per round by view, and τ."""
        return {"t_spec": dict(self.t_spec), "t_plain": dict(self.t_plain), "tau": self.tau}
