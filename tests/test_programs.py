"""Exported programs (:mod:`specjax.runtime.programs`): a warm start that does not trace.

(a) A second Decoder in the same settings reads both programs from disk (nothing traced) and
decodes the same tokens as a Decoder that compiles the traced programs (greedy and sampled,
a chain with a drafter); (b) the executable of the exported program is the traced one's,
instruction for instruction (XLA's optimized HLO, names aside); (c) a damaged entry, or one whose
tree names a class outside the allowed packages, is rebuilt; (d) another program (a different
buffer) is another key, and the directory keeps at most ``MAX_ENTRIES`` programs; (e) the command
line switches it on with the compilation cache and off with ``SPECJAX_NO_PROGRAM_CACHE``.
"""

from __future__ import annotations

import json
import os
import pickle
import re

import pytest
from conftest import tiny_model

from specjax import Decoder, SamplingParams
from specjax.drafters.ngram import NgramDrafter
from specjax.runtime import programs

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 3, 4]]


@pytest.fixture
def program_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECJAX_NO_PROGRAM_CACHE", raising=False)
    monkeypatch.delenv("SPECJAX_NO_CACHE", raising=False)
    d = programs.enable(str(tmp_path / "programs"))
    yield d
    programs.disable()


def _entries(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".jaxexport")) if os.path.isdir(d) else []


def _decode(target, drafter, **kw):
    dec = Decoder(target, drafter, gamma=3)
    res = dec.generate(PROMPTS, max_new_tokens=12, **kw)
    return dec, res


def _loaded(dec):
    return [c.loaded for c in dec.compiled.values() if isinstance(c, programs.ExportedProgram)]


def test_a_second_decoder_reads_the_programs_and_decodes_the_same(program_dir, monkeypatch):
    target = tiny_model(seed=3)
    drafter = NgramDrafter(2)
    sampled = SamplingParams.create(2, temperature=[0.0, 0.8], top_k=[0, 5])
    dec1, first = _decode(target, drafter, seed=7, sampling=sampled)
    assert _loaded(dec1) == [False, False] and len(_entries(program_dir)) == 2
    dec2, second = _decode(target, drafter, seed=7, sampling=sampled)
    assert _loaded(dec2) == [True, True]  # both from disk: nothing traced
    programs.disable()
    dec3, traced = _decode(target, drafter, seed=7, sampling=sampled)
    assert _loaded(dec3) == []  # the traced programs
    for res in (first, second):
        assert [list(t) for t in res.tokens] == [list(t) for t in traced.tokens]
        assert [r.target_calls for r in res.stats] == [r.target_calls for r in traced.stats]


def test_the_executable_is_the_traced_one(program_dir):
    """XLA's optimized HLO of the exported prefill and decode loop equals the traced ones',
    instruction for instruction (names of values and computations, and the entry's parameter
    list, aside): the same arithmetic."""
    target = tiny_model(seed=4)
    dec_e = Decoder(target, NgramDrafter(2), gamma=2)
    dec_e.generate(PROMPTS, max_new_tokens=8)
    programs.disable()
    dec_t = Decoder(target, NgramDrafter(2), gamma=2)
    dec_t.generate(PROMPTS, max_new_tokens=8)

    def norm(text):
        text = re.sub(r", metadata=\{[^}]*\}", "", text)
        text = re.sub(r"%[\w.\-]+", "%v", text)
        text = re.sub(r"\b(tuple|arg)[\w.\-]*", r"\1", text)
        text = re.sub(r"(HloModule|ENTRY|fused_computation|region|wrapped|body|cond)[\w.\-]*", r"\1", text)
        text = re.sub(r"HloModule[^\n]*", "HloModule", text)
        # the entry's parameters aside: the exported module keeps arguments a program does not
        # read (a tiny prefill skips some weights), which only renumbers the parameters
        text = re.sub(r"parameter\(\d+\)", "parameter", text)
        return sorted(line.strip() for line in text.splitlines()
                      if line.strip() and not re.match(r"^\s*\d+ [{\"]", line)
                      and not re.search(r"^\s*(ENTRY|%v = \S+ parameter$)", line.strip()))

    def texts(dec):
        return {k[0]: norm(c.as_text()) for k, c in dec.compiled.items()}

    exported, traced = texts(dec_e), texts(dec_t)
    assert set(exported) == {"start", "run"}
    for which in ("start", "run"):
        assert len(exported[which]) > 100
        assert exported[which] == traced[which], which


def test_a_damaged_or_foreign_entry_is_rebuilt(program_dir):
    target = tiny_model(seed=5)
    _, ref = _decode(target, None)
    names = _entries(program_dir)
    assert len(names) == 2
    a, b = (os.path.join(program_dir, n) for n in names)
    with open(a, "wb") as f:
        f.write(b"not a program")
    with open(b[: -len(".jaxexport")] + ".tree", "wb") as f:  # a class outside the allowed packages
        f.write(pickle.dumps((os.system, False)))
    dec, again = _decode(target, None)
    assert _loaded(dec) == [False, False]  # both rebuilt
    assert [list(t) for t in again.tokens] == [list(t) for t in ref.tokens]
    dec, _ = _decode(target, None)
    assert _loaded(dec) == [True, True]


def test_another_program_is_another_entry_and_old_ones_go(program_dir, monkeypatch):
    target = tiny_model(seed=6)
    Decoder(target, None).generate(PROMPTS, max_new_tokens=4)
    assert len(_entries(program_dir)) == 2
    Decoder(target, None).generate(PROMPTS, max_new_tokens=200)  # another buffer: new programs
    assert len(_entries(program_dir)) > 2
    monkeypatch.setattr(programs, "MAX_ENTRIES", 2)
    Decoder(target, NgramDrafter(2), gamma=2).generate(PROMPTS, max_new_tokens=4)
    assert len(_entries(program_dir)) == 2


def test_the_command_line_switches_it(monkeypatch, tmp_path, capsys):
    """On with the compilation cache (the entries appear next to it); off with
    SPECJAX_NO_PROGRAM_CACHE=1 (nothing written); off again after the command returns."""
    from test_cli import word_tokenizer

    from specjax.cli import main
    from specjax.io.loading import save_model

    m = tiny_model(seed=8)
    model_dir = save_model(m.replace(tokenizer=word_tokenizer(m.config.vocab_size)), str(tmp_path / "tiny"))
    cache = tmp_path / "jaxcache"
    monkeypatch.setenv("SPECJAX_CACHE", str(cache))
    monkeypatch.delenv("SPECJAX_NO_CACHE", raising=False)  # (other test modules set it for the process)
    import jax

    old = jax.config.jax_compilation_cache_dir
    try:
        monkeypatch.setenv("SPECJAX_NO_PROGRAM_CACHE", "1")
        assert main(["generate", "w3 w4 w5", "--model", model_dir, "--max-new-tokens", "3", "--no-chat"]) == 0
        assert _entries(cache / programs.SUBDIR) == []
        monkeypatch.delenv("SPECJAX_NO_PROGRAM_CACHE")
        assert main(["generate", "w3 w4 w5", "--model", model_dir, "--max-new-tokens", "3", "--no-chat"]) == 0
        assert len(_entries(cache / programs.SUBDIR)) == 2
        assert programs.directory() is None
    finally:
        jax.config.update("jax_compilation_cache_dir", old)
    capsys.readouterr()


def _fresh_process():
    """What a new process starts with: no prefetch in flight, nothing recorded as used."""
    programs.finish()


def test_prefetch_compiles_the_last_runs_programs_for_the_next(program_dir):
    """remember(tag) records the programs a run used; prefetch(tag) in the next process compiles
    them on threads, and the Decoder takes them (same tokens as traced programs); another tag,
    or a damaged recent.json, prefetches nothing."""
    target = tiny_model(seed=9)
    sampled = SamplingParams.create(2, temperature=[0.0, 0.8], top_k=[0, 5])
    _fresh_process()
    dec1, first = _decode(target, NgramDrafter(2), seed=3, sampling=sampled)
    programs.remember("tag-a")
    recent = json.loads(open(os.path.join(program_dir, programs.RECENT)).read())
    assert list(recent) == ["tag-a"] and len(recent["tag-a"]) == 2
    _fresh_process()
    assert programs.prefetch("tag-b") == 0  # nothing recorded for it
    assert programs.prefetch("tag-a") == 2
    dec2, second = _decode(target, NgramDrafter(2), seed=3, sampling=sampled)
    got = [c for c in dec2.compiled.values() if isinstance(c, programs.ExportedProgram)]
    assert [c.prefetched for c in got] == [True, True] and programs.prefetches_pending() == 0
    programs.disable()
    dec3, traced = _decode(target, NgramDrafter(2), seed=3, sampling=sampled)
    for res in (first, second):
        assert [list(t) for t in res.tokens] == [list(t) for t in traced.tokens]
    programs.enable(program_dir)
    with open(os.path.join(program_dir, programs.RECENT), "w") as f:
        f.write("{not json")
    assert programs.prefetch("tag-a") == 0
    _decode(target, None)
    programs.remember("tag-c")  # rewrites the damaged index
    assert "tag-c" in json.loads(open(os.path.join(program_dir, programs.RECENT)).read())


def test_a_prefetch_that_guessed_wrong_is_not_used(program_dir):
    """Programs prefetched for another prompt bucket stay unused: the Decoder compiles its own
    (exact key match only), and the tokens are those of a run without any prefetch."""
    target = tiny_model(seed=10)
    _fresh_process()
    _decode(target, None)
    programs.remember("t")
    _fresh_process()
    assert programs.prefetch("t") == 2
    dec = Decoder(target, None, gamma=3)
    res = dec.generate([[5] * 40, [6] * 3], max_new_tokens=12)  # a longer prompt: another bucket
    got = [c for c in dec.compiled.values() if isinstance(c, programs.ExportedProgram)]
    assert got and not any(c.prefetched for c in got)
    programs.finish()
    programs.disable()
    ref = Decoder(target, None, gamma=3).generate([[5] * 40, [6] * 3], max_new_tokens=12)
    assert [list(t) for t in res.tokens] == [list(t) for t in ref.tokens]


def test_the_generate_tag_leaves_out_the_prompts_only():
    """The command's tag: the same for other prompts and seeds, another for another γ or batch."""
    from types import SimpleNamespace

    from specjax.cli.generate import program_tag

    s = {"model": None, "draft": "default", "gamma": 2, "dtype": "int8", "tree": None}
    a = SimpleNamespace(batch_size=1, logprobs=None, mesh=None, ignore_eos=False, stop=[], prompt_pos="x", seed=1)
    b = SimpleNamespace(**{**vars(a), "prompt_pos": "another prompt", "seed": 7})
    assert program_tag(s, a) == program_tag(s, b)
    assert program_tag({**s, "gamma": 3}, a) != program_tag(s, a)
    assert program_tag(s, SimpleNamespace(**{**vars(a), "batch_size": 4})) != program_tag(s, a)
    assert program_tag({**s, "sampling": object()}, a) is None  # no stable text: no tag
