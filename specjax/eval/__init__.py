"""Measuring: benchmarks and their reports, costs and α, the speculative-decoding theory,
``--gamma auto`` / ``--dtype auto``, fidelity of the weight formats, deployment plans and the
per-host measurement cache (:mod:`~specjax.eval.hostcache`)."""
