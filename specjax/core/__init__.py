"""The bottom layer: pure, jittable decoding math with no model — sampling, modified rejection
sampling, draft trees, the drafter protocol (:mod:`~specjax.core.drafting`) — and what every layer
shares: settings declared once (:mod:`~specjax.core.settings`), environment variables declared once
(:mod:`~specjax.core.env`), cache paths, notes and Ctrl+C. Imports nothing else of specjax
(docs/design.md, "Layers")."""
