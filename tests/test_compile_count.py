"""Gate of issue 17: no recompilation within a bucket.

One :class:`specjax.Decoder` (autoregressive, and speculative with the n-gram drafter at γ 2) on a
tiny random model decodes a first batch, then several more batches whose prompts fall in the same
prompt bucket and whose ``max_new_tokens`` fall in the same buffer bucket, but with different
prompt lengths and contents, per-row ``max_new_tokens``, greedy and sampled rows (temperature,
top-k, top-p), seeds (one int, per-row lists, 64-bit), EOS ids, stop token ids (different numbers
of them), stop callbacks (the mechanism under stop strings), streaming and chunk sizes. Every XLA
compilation after the first batch is counted — not the Decoder's own table of programs, but
JAX's ``/jax/core/compile/backend_compile_duration`` event, which fires for every program handed
to the backend (a persistent-cache hit included, eager helper ops included) — and must be zero.

The counter is proven live in the same test: the first batch compiles, and a batch in the next
prompt bucket compiles the prefill and decode loop again.

Repeated prompts share one prefill per distinct prompt (runtime/decoder.shared_prompts): a batch with
repeats runs a prefill program of its own (the distinct prompts, rounded up to a power of two, are
its rows) and the same decode loop; checked here: such a batch compiles that one prefill and nothing
else, and the next batch with the same number of distinct prompts compiles nothing.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from conftest import tiny_model
from jax import monitoring

import specjax
from specjax import Decoder, SamplingParams
from specjax.runtime.decoder import prompt_bucket

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT
BATCH = 3


@contextlib.contextmanager
def count_compiles():
    """Yield a list that collects the name of every function JAX compiles in the block."""
    names: list[str] = []

    def listener(event, duration, **kw):
        if event == BACKEND_COMPILE:
            names.append(str(kw.get("fun_name", "?")))

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        monitoring.unregister_event_duration_listener(listener)


def _prompts(rng, lengths):
    return [rng.integers(2, 128, n).tolist() for n in lengths]


def _cut_row1(i, toks):  # a stop callback (what stop strings use): row 1 ends after 2 new tokens
    return 2 if i == 1 and len(toks) >= 3 else None


def _batches(rng):
    """``(prompts, max_new_tokens, call)`` of the batches after the first, all in one bucket;
    ``call(dec, prompts, max_new)`` decodes them in one of the ways the Decoder offers."""
    def generate(**kw):
        return lambda dec, p, mn: dec.generate(p, max_new_tokens=mn, **kw)

    def stream(**kw):
        return lambda dec, p, mn: list(dec.stream(p, max_new_tokens=mn, **kw))

    return [
        (_prompts(rng, [3, 32, 12]), 25,
         generate(sampling=SamplingParams.create(BATCH, temperature=[0.0, 0.7, 1.3], top_k=[0, 5, 0]),
                  seed=[11, 12, 2**63 + 5], stop_token_ids=[[4], [], [7, 9, 10, 11]])),
        (_prompts(rng, [20, 1, 8]), [1, 28, 9], generate(eos_ids=[], seed=2**40)),  # all greedy, EOS ignored
        (_prompts(rng, [9, 9, 9]), 16,
         generate(sampling=SamplingParams.create(BATCH, temperature=1.0, top_p=[0.5, 0.9, 1.0]), seed=3,
                  stop_token_ids=[5, 6, 7, 8, 9, 10, 11], stop_fn=_cut_row1, rounds_per_chunk=2)),
        (_prompts(rng, [31, 2, 17]), [10, 3, 20],
         stream(sampling=SamplingParams.create(BATCH, temperature=[0.0, 0.0, 0.9]), seed=99, rounds_per_chunk=3)),
        (_prompts(rng, [6, 14, 25]), 29, generate(seed=1, stop_fn=_cut_row1, on_chunk=lambda new: None)),
    ]


@pytest.mark.parametrize("kind", ["autoregressive", "ngram"])
def test_no_recompilation_within_a_bucket(kind):
    target = tiny_model(seed=1)
    drafter = specjax.load_drafter("ngram:3", target) if kind == "ngram" else None
    dec = Decoder(target, drafter, gamma=2)
    rng = np.random.default_rng(0)

    first = _prompts(rng, [5, 17, 30])
    first_mn = [12, 7, 20]
    with count_compiles() as warm:
        dec.generate(first, max_new_tokens=first_mn, seed=0, stop_token_ids=[[5], [], [7, 9]],
                     sampling=SamplingParams.create(BATCH, temperature=[0.0, 0.8, 1.0], top_k=[0, 20, 0],
                                                    top_p=[1.0, 1.0, 0.9]),
                     stop_fn=_cut_row1)
    assert any("prefill" in n for n in warm) and any("run_rounds" in n for n in warm), warm  # the counter is live

    batches = _batches(rng)
    # the batches really are in the first batch's buckets: one prompt bucket, one program
    prog = dec.program(max(map(len, first)), max(first_mn))
    for prompts, mn, _ in batches:
        assert prompt_bucket(max(map(len, prompts))) == prompt_bucket(max(map(len, first)))
        assert dec.program(max(map(len, prompts)), int(np.max(mn))) == prog

    with count_compiles() as later:
        for prompts, mn, call in batches:
            call(dec, prompts, mn)
    assert later == [], f"{len(later)} XLA compilations after the first batch, within its bucket: {later}"

    a, b, c, d = _prompts(rng, [7, 21, 30, 12])
    with count_compiles() as shared:  # 2 distinct prompts in 3 rows: a 2-row prefill, the same decode loop
        dec.generate([a, a, b], max_new_tokens=first_mn, seed=4)
    assert shared and all("prefill" in n for n in shared), shared
    with count_compiles() as again:
        dec.generate([c, d, d], max_new_tokens=9, seed=5, sampling=SamplingParams.create(BATCH, temperature=0.9))
    assert again == [], f"a second batch with 2 distinct prompts compiled {again}"

    # the next prompt bucket does compile (prefill and decode loop), so the counter above could fail
    with count_compiles() as new_bucket:
        dec.generate(_prompts(rng, [33, 4, 9]), max_new_tokens=8, seed=0)
    assert any("prefill" in n for n in new_bucket) and any("run_rounds" in n for n in new_bucket), new_bucket
