"""Measuring the theory's inputs on real models and prompts (the other half of
:mod:`specjax.eval.theory`): the acceptance rate α, the cost ratios c and v(γ), and the
speculative run itself. This is the public module; the measurements live in

* :mod:`specjax.eval.alpha` — :func:`measure_alpha`: α as ``Σ_x min(p, q)`` (Leviathan et al.
  2023, Definition 3.1, Theorem 3.5) along the target's own output, by teacher forcing: one target
  forward and one drafter forward over prompt + continuation, both processed with the same
  :meth:`SamplingParams.process` the decode loop uses. Independent of the loop's acceptance
  counters. (And :func:`alpha_by_decoding`, the same β along a decoded continuation.)
* :mod:`specjax.eval.costs` — :func:`measure_costs`: ``c = t_draft/t_target`` and
  ``v(γ) = t_target(γ+1)/t_target(1)`` from timed jitted calls with the decode loop's shapes: the
  batch, and the buffer length and KV-cache dtype of the very programs the
  :class:`~specjax.runtime.decoder.Decoder` runs (:func:`timed_programs`); draft trees: ``c_tree``
  and ``v(N)``.
* :mod:`specjax.eval.speedup` — :func:`measure_speedup`: the real decode loop, autoregressive and
  speculative interleaved in the same run: ``mean_accepted_tokens``, ``acceptance_rate``, tokens/s,
  and the measured speedup.
* :mod:`specjax.eval.pair` — :func:`analyze_pair`: the table of predictions next to the
  measurements (``specjax analyze``; :func:`compare` is :mod:`specjax.eval.speedup`'s).
* :mod:`specjax.eval.auto` — :func:`recommend` (``--gamma auto``) and :func:`fastest_format`
  (``--dtype auto``).
* :mod:`specjax.eval.common` — :func:`prompt_records` and what the measurements share.

Prompts are records ``{"ids": [...]} | {"prompt": text}`` with optional ``category`` and
``question_id`` (plain strings and id lists are accepted too).
"""

from __future__ import annotations

# re-exported: measure is the public module (tests patch the functions where their callers look
# them up: recommend's measure_costs / alpha_by_decoding and fastest_format's median_ms in
# specjax.eval.auto)
from specjax.eval.alpha import ALPHA_METHOD, AUTO_NEW_TOKENS, alpha_by_decoding, measure_alpha  # noqa: F401
from specjax.eval.auto import (  # noqa: F401
    AUTO_METHOD, AUTO_PROMPTS, FORMAT_SHAPE, PREDICTED_FORMATS, fastest_format, predicted_format, recommend,
    recommend_gamma,
)
from specjax.eval.common import sampling_params, sampling_key, prompt_records  # noqa: F401
from specjax.eval.costs import (  # noqa: F401
    COST_METHOD, median_ms, target_case, measure_costs, timed_programs, tree_key, tree_program,
)
from specjax.eval.pair import TREE_MODEL, analyze_pair, recommend_shape, tree_entry  # noqa: F401
from specjax.eval.speedup import (  # noqa: F401
    progress_bar, autoregressive_run, best_row, compare, measure_speedup, theory_rows,
)

__all__ = [
    "prompt_records",
    "measure_alpha",
    "measure_costs",
    "measure_speedup",
    "compare",
    "theory_rows",
    "analyze_pair",
    "timed_programs",
    "alpha_by_decoding",
    "recommend",
    "recommend_gamma",
    "fastest_format",
    "tree_key",
    "tree_program",
]
