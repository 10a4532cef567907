"""Speculation under load, chosen from measured costs (issue 31): the serving engine's choice,
chunk by chunk, between its speculative program and its ``plain`` one (one-token target calls
on the same state, :func:`specjax.runtime.loop._plain_round`).

On one device the engine's programs compute every slot, running or free, so a round's cost does
not depend on how many requests run; what a speculative round buys — the tokens a row commits
per round, τ — depends on the requests being served, and what it costs relative to a one-token
step depends on the attention view (the longest running row) and the host. So the choice is made
from the engine's own measurements, per attention view: each program's committed tokens per
second per running row (an exponentially weighted mean over its recent chunks); the faster one
runs, and the other is re-measured now and then (a speculative chunk every :data:`PROBE_SPEC`
chunks while plain ones are faster, a plain chunk every :data:`PROBE_PLAIN` while speculative
ones are) so that a change in the traffic is noticed.

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


@dataclasses.dataclass
class AutoSpeculation:
    """Per attention view, the measured throughput of speculative and plain chunks, and the choice.

    ``spec`` / ``plain_rate``: ``{view: tokens per second per running row}`` (a view is the
    number of cache slots the chunk's first round attends over, ``None`` for the whole buffer).
    """

    spec: dict = dataclasses.field(default_factory=dict)
    plain_rate: dict = dataclasses.field(default_factory=dict)
    since_spec: int = 0
    since_plain: int = 0

    def plain(self, view) -> bool:
        """Whether the next chunk (whose rows may switch) should be plain: unmeasured programs are
        measured first (speculative, then plain), then the faster one runs but for the probes."""
        s, p = self.spec.get(view), self.plain_rate.get(view)
        if s is None:
            return False
        if p is None:
            return True
        if p > s:
            return self.since_spec < PROBE_SPEC - 1
        return self.since_plain >= PROBE_PLAIN - 1

    def record(self, plain: bool, view, tokens: int, rows: int, seconds: float) -> None:
        """A chunk's outcome: ``tokens`` committed by its ``rows`` running rows in ``seconds``
        (the decode time only; admissions' prefills are not the method's cost)."""
        if rows <= 0 or seconds <= 0:
            return
        rate = tokens / rows / seconds
        table = self.plain_rate if plain else self.spec
        old = table.get(view)
        table[view] = rate if old is None else (1 - WEIGHT) * old + WEIGHT * rate
        if plain:
            self.since_plain, self.since_spec = 0, self.since_spec + 1
        else:
            self.since_spec, self.since_plain = 0, self.since_plain + 1

    def summary(self) -> dict:
        """``{"spec": {...}, "plain": {...}}`` tokens/s per row by view (for logs and metrics)."""
        return {"spec": dict(self.spec), "plain": dict(self.plain_rate)}
