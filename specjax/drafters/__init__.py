"""The drafters — n-gram, draft model, EAGLE / EAGLE-3 heads, block drafter — each a
:class:`specjax.core.drafting.Drafter`, their networks and files, and the registry of kinds
(:mod:`~specjax.drafters.registry`: how a ``--draft`` value names one). Imports core and models."""
