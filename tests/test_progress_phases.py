"""Honest phases (issue "the first minute"): compiling the programs and running the prefill are
separate progress lines; the compile line is finished before the prefill runs, so a long
prompt's prefill is never reported as compile time."""

from __future__ import annotations

import io

import jax

from conftest import tiny_model
from specjax.drafters.ngram import NgramDrafter
from specjax.runtime import decoder as decoder_mod
from specjax.runtime.decoder import Decoder
from specjax.runtime.progress import Progress


def _lines(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


def test_compile_and_prefill_are_separate_lines(monkeypatch):
    out = io.StringIO()
    dec = Decoder(tiny_model(seed=1), NgramDrafter(max_ngram=2), gamma=3, progress=Progress(stream=out, delay_s=0.0))
    seen = []
    real = jax.block_until_ready

    def watch(x):  # the prefill's sync: what had been written by then
        seen.append(out.getvalue())
        return real(x)
    monkeypatch.setattr(decoder_mod.jax, "block_until_ready", watch)
    res = dec.generate([[3, 4, 5, 6, 7]], max_new_tokens=4)
    monkeypatch.setattr(decoder_mod.jax, "block_until_ready", real)
    lines = _lines(out)
    assert len(lines) == 2, lines
    assert lines[0].startswith("specjax: compiling prefill + decode loop (γ = 3) for prompts of ≤ 32 tokens")
    assert lines[1].startswith("specjax: prefill of 1 prompt (32-token bucket) … ") and lines[1].endswith(" s")
    # when the prefill ran, the compile line was complete (both programs compiled) and the prefill's open
    assert seen[0].splitlines()[0] == lines[0] and lines[0].endswith(" s")
    assert seen[0].endswith("specjax: prefill of 1 prompt (32-token bucket) … ")
    assert res.compile_s > 0 and res.prefill_s > 0 and len(res.tokens[0]) == 4

    # the same bucket again: nothing compiles, no lines
    res2 = dec.generate([[9, 8, 7]], max_new_tokens=4)
    assert len(_lines(out)) == 2 and res2.compile_s == 0.0

