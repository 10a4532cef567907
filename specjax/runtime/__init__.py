"""Decoding: the :class:`~specjax.runtime.decoder.Decoder` and its compiled programs (prefill,
the decode loop), batching, the continuous-batching engine, sharding, exported programs, progress
lines and the statistics of a run (:mod:`~specjax.runtime.stats`: the one place tokens/s and τ are
computed)."""
