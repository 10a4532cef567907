"""The converted-weights cache (:mod:`specjax.io.convcache`, issue "the first minute"): a second
load of a checkpoint in a format reads the converted arrays (and a GGUF's tokenizer) instead of
opening the GGUF and converting again, and gives the same model, bitwise; a broken entry is
converted again with one note line; ``SPECJAX_NO_CACHE`` writes nothing. Tiny GGUF files made
here (weights + a byte-level BPE tokenizer); a temporary ``SPECJAX_CACHE_DIR``."""

from __future__ import annotations

import io
import os

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_model
from specjax.io import convcache, loading
from specjax.io import gguf as gguf_loader
from specjax.io.loading import (
    conversion_cached, load_model, load_tokenizer, recording_loads, save_model,
)
from specjax.models import llama
from test_tokenizer import ALPHABET, EXTRA, SPECIALS, add_tiny_tokenizer
from test_weight_table import write_gguf

FORMATS = ("float32", "int8", "bfloat16")
TOKENS = SPECIALS + ALPHABET + EXTRA  # 262 tokens: the tiny models' vocabulary


def write_model_gguf(model, path, pre="smollm") -> str:
    """``model`` (vocabulary of ``len(TOKENS)``) as a float32 llama GGUF with a byte-level BPE
    tokenizer and a chat template."""
    def tokenizer(w):
        add_tiny_tokenizer(w, pre)
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}")

    return str(write_gguf(model, str(path), "llama", tokenizer=tokenizer))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(d))
    monkeypatch.delenv("SPECJAX_NO_CACHE", raising=False)
    return d


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model = tiny_model(seed=3, vocab_size=len(TOKENS), tie_word_embeddings=False)
    path = write_model_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    old = os.stat(path).st_mtime - 60  # not just written (a file that is may change again: hashed every load)
    os.utime(path, (old, old))
    return path


def _leaves(params) -> dict:
    return dict(llama.flatten_params(nnx.to_pure_dict(params)))


def assert_same_model(a, b):
    """Bitwise the same parameters (dtypes, shapes, values), graphdef, config, name, format and tokenizer."""
    assert a.config == b.config and a.name == b.name and a.dtype == b.dtype
    assert a.graphdef == b.graphdef
    assert jax.tree_util.tree_structure(a.params) == jax.tree_util.tree_structure(b.params)
    la, lb = _leaves(a.params), _leaves(b.params)
    assert la.keys() == lb.keys()
    for p in la:
        x, y = la[p], lb[p]
        assert x.dtype == y.dtype and x.shape == y.shape, p
        assert x.sharding == y.sharding and x.committed == y.committed and x.weak_type == y.weak_type, p
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), p
    ta, tb = a.tokenizer, b.tokenizer
    assert (ta is None) == (tb is None)
    if ta is not None:
        assert ta.fingerprint() == tb.fingerprint()
        assert (ta.bos_token_id, ta.eos_token_ids, ta.add_bos, ta.chat_template, ta.special_tokens) == \
            (tb.bos_token_id, tb.eos_token_ids, tb.add_bos, tb.chat_template, tb.special_tokens)
        for text in (" 123  12 x<|im_start|>y", "héllo\nworld"):
            assert ta.encode(text) == tb.encode(text)
            assert ta.encode(text, parse_special=False) == tb.encode(text, parse_special=False)
            assert ta.decode(ta.encode(text)) == tb.decode(tb.encode(text))


def _uncached(path, fmt, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv("SPECJAX_NO_CACHE", "1")
        return load_model(path, dtype=fmt)


def _no_gguf_reader(monkeypatch):
    def refuse(path):
        raise AssertionError(f"the GGUF reader was opened for {path}")
    monkeypatch.setattr(gguf_loader, "open_gguf", refuse)


@pytest.mark.parametrize("fmt", FORMATS)
def test_second_load_reads_the_cached_conversion(tiny_gguf, cache_dir, monkeypatch, fmt):
    assert not conversion_cached(tiny_gguf, fmt)
    with recording_loads() as loads:
        first = load_model(tiny_gguf, dtype=fmt)
    assert [x["cached"] for x in loads] == [False]
    assert conversion_cached(tiny_gguf, fmt)
    files = sorted(os.listdir(cache_dir / "converted"))
    assert sum(f.endswith(".safetensors") for f in files) == 1 and sum("-tokenizer-" in f for f in files) == 1
    assert not [f for f in files if f.endswith(".tmp")]
    with monkeypatch.context() as m:
        _no_gguf_reader(m)  # neither the weights nor the tokenizer come from the GGUF now
        with recording_loads() as loads:
            second = load_model(tiny_gguf, dtype=fmt)
        assert [x["cached"] for x in loads] == [True] and loads[0]["cache_file"].endswith(".safetensors")
        tok = load_tokenizer(tiny_gguf)
    assert_same_model(second, first)
    assert_same_model(second, _uncached(tiny_gguf, fmt, monkeypatch))
    assert tok.fingerprint() == first.tokenizer.fingerprint()


def test_formats_are_separate_entries(tiny_gguf, cache_dir):
    for fmt in FORMATS:
        load_model(tiny_gguf, dtype=fmt)
    entries = [f for f in os.listdir(cache_dir / "converted") if f.endswith(".safetensors")]
    assert len(entries) == 3
    with recording_loads() as loads:
        models = {fmt: load_model(tiny_gguf, dtype=fmt) for fmt in FORMATS}
    assert all(x["cached"] for x in loads)
    assert {m.dtype for m in models.values()} == set(FORMATS)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_shape"])
def test_a_broken_entry_is_converted_again_with_one_note(tiny_gguf, cache_dir, monkeypatch, capsys, damage):
    first = load_model(tiny_gguf, dtype="int8")
    entry = [cache_dir / "converted" / f for f in os.listdir(cache_dir / "converted") if f.endswith(".safetensors")][0]
    if damage == "truncate":
        size = entry.stat().st_size
        with open(entry, "r+b") as f:
            f.truncate(size // 2)
    elif damage == "garbage":
        entry.write_bytes(b"not a safetensors file")
    else:  # a readable file whose tensors do not fit the model
        from safetensors.numpy import save_file

        save_file({"embed": np.zeros((3, 3), np.float32)}, str(entry),
                  metadata={"specjax": '{"format": "int8", "dtypes": {}, "config": {}, "config_repr": ""}'})
    capsys.readouterr()
    with recording_loads() as loads:
        again = load_model(tiny_gguf, dtype="int8")
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("specjax: note:")]
    assert len(notes) == 1, err
    assert "the cached conversion" in notes[0] and str(entry) in notes[0] and notes[0].endswith("converted again")
    assert [x["cached"] for x in loads] == [False]
    assert_same_model(again, first)
    with monkeypatch.context() as m:  # written again, whole
        _no_gguf_reader(m)
        with recording_loads() as loads:
            third = load_model(tiny_gguf, dtype="int8")
    assert loads[0]["cached"]
    assert_same_model(third, first)
    assert "note" not in capsys.readouterr().err


def test_a_broken_tokenizer_entry_is_built_again(tiny_gguf, cache_dir, capsys):
    first = load_model(tiny_gguf)
    entry = [cache_dir / "converted" / f for f in os.listdir(cache_dir / "converted")
             if "-tokenizer-" in f][0]
    entry.write_text('{"tokenizer": {"tokenizer": "{not json"}}')
    capsys.readouterr()
    again = load_model(tiny_gguf)
    err = capsys.readouterr().err
    assert err.count("specjax: note:") == 1 and "converted again" in err, err
    assert_same_model(again, first)


def test_no_cache_reads_and_writes_nothing(tiny_gguf, cache_dir, monkeypatch):
    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    for fmt in FORMATS:
        with recording_loads() as loads:
            load_model(tiny_gguf, dtype=fmt)
        assert not loads[0]["cached"]
    load_tokenizer(tiny_gguf)
    assert not cache_dir.exists()
    assert not conversion_cached(tiny_gguf, "float32")


def test_an_existing_entry_is_not_read_with_no_cache(tiny_gguf, cache_dir, monkeypatch):
    load_model(tiny_gguf)
    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    with recording_loads() as loads:
        load_model(tiny_gguf)
    assert not loads[0]["cached"]


def test_a_placement_skips_the_cache(tiny_gguf, cache_dir):
    load_model(tiny_gguf, place=lambda p, a: jax.device_put(a))
    assert not (cache_dir / "converted").exists() or not [
        f for f in os.listdir(cache_dir / "converted") if f.endswith(".safetensors")]


def test_an_edited_source_is_a_new_entry(tmp_path, cache_dir):
    a = write_model_gguf(tiny_model(seed=4, vocab_size=len(TOKENS)), tmp_path / "m.gguf")
    before = np.array(_leaves(load_model(a).params)[("embed",)])  # a copy (a float32 GGUF's arrays may map the file)
    b = write_model_gguf(tiny_model(seed=4, scale=2.0, vocab_size=len(TOKENS)), tmp_path / "m.gguf")  # new weights
    assert a == b
    with recording_loads() as loads:
        second = load_model(b)
    assert not loads[0]["cached"]
    assert not np.array_equal(before, np.asarray(_leaves(second.params)[("embed",)]))


def test_the_source_hash_is_computed_once(tiny_gguf, cache_dir, monkeypatch):
    load_model(tiny_gguf)
    memo = cache_dir / "converted" / convcache.SOURCES_FILE
    assert memo.exists() and os.path.realpath(tiny_gguf) in memo.read_text()
    convcache.forget_digests()  # a new process: only sources.json remembers

    def no_hash(path, chunk=0):
        raise AssertionError("hashed again")
    monkeypatch.setattr(convcache, "sha256_file", no_hash)
    with recording_loads() as loads:
        load_model(tiny_gguf)
    assert loads[0]["cached"]


def test_a_file_just_written_is_hashed_every_time(tmp_path, cache_dir, monkeypatch):
    path = write_model_gguf(tiny_model(seed=8, vocab_size=len(TOKENS)), tmp_path / "new.gguf")
    calls = []
    real = convcache.sha256_file
    monkeypatch.setattr(convcache, "sha256_file", lambda p, chunk=1 << 20: calls.append(p) or real(p))
    for _ in range(2):
        load_model(path)
    assert len(calls) == 2


def test_a_converter_change_is_a_new_entry_that_replaces_the_old(tiny_gguf, cache_dir, monkeypatch):
    load_model(tiny_gguf, dtype="int8")
    load_model(tiny_gguf, dtype="float32")
    old = set(os.listdir(cache_dir / "converted"))
    monkeypatch.setattr(convcache, "CONVERTER_VERSION", convcache.CONVERTER_VERSION + 1)
    convcache.converter_fingerprint.cache_clear()
    try:
        with recording_loads() as loads:
            load_model(tiny_gguf, dtype="int8")
        assert not loads[0]["cached"]
        new = set(os.listdir(cache_dir / "converted"))
    finally:
        convcache.converter_fingerprint.cache_clear()
    entries = lambda names, kind: {n for n in names if f"-{kind}-" in n}  # noqa: E731
    assert len(entries(new, "int8")) == 1 and entries(new, "int8") != entries(old, "int8")  # the old one pruned
    assert entries(new, "float32") == entries(old, "float32")  # another format: kept
    assert len(entries(new, "tokenizer")) == 1 and entries(new, "tokenizer") != entries(old, "tokenizer")


def test_missing_pre_tokenizer_warning_is_given_again_from_the_cache(tmp_path, cache_dir):
    path = write_model_gguf(tiny_model(seed=6, vocab_size=len(TOKENS)), tmp_path / "nopre.gguf", pre=None)
    for _ in range(2):
        with pytest.warns(UserWarning, match="tokenizer.ggml.pre"):
            load_model(path)
    assert conversion_cached(path)


def test_model_directory_is_cached_too(tmp_path, cache_dir, monkeypatch):
    src = load_model(write_model_gguf(tiny_model(seed=7, vocab_size=len(TOKENS)), tmp_path / "t.gguf"))
    d = save_model(src, str(tmp_path / "hf"))
    with recording_loads() as loads:
        first = load_model(d, dtype="int8")
        second = load_model(d, dtype="int8")
    assert [x["cached"] for x in loads] == [False, True]
    assert_same_model(second, first)
    assert_same_model(second, _uncached(d, "int8", monkeypatch))


def test_abstract_model_is_the_models_own():
    """The loader's fast abstract model equals :func:`specjax.models.llama.abstract_model`."""
    from conftest import tiny_config

    for cfg in (tiny_config(), tiny_config(tie_word_embeddings=True),
                tiny_config(model_type="qwen2", attention_bias=True)):
        for fmt in FORMATS:
            g1, a1 = llama.abstract_model(cfg, fmt)
            g2, a2 = loading.abstract_model_of(cfg, fmt)
            assert g1 == g2
            assert jax.tree_util.tree_structure(a1) == jax.tree_util.tree_structure(a2)
            assert [(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(a1)] == \
                [(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(a2)]


def test_phase_detail_is_written_after_the_seconds():
    from specjax.runtime.progress import Progress, phase

    out = io.StringIO()
    with phase(Progress(stream=out, delay_s=10), "loading x") as ph:
        ph.detail = " (converted again)"
    import re

    assert re.fullmatch(r"specjax: loading x … \d+\.\d s \(converted again\)\n", out.getvalue()), out.getvalue()


def test_default_model_second_load_is_cached_and_identical(cache_dir, monkeypatch):
    """The shipped SmolLM2 GGUF (Q4_1, dequantized, Q/K unpermuted, fused, int8-quantized): the
    cached load is the uncached one, bitwise, and opens no GGUF reader."""
    first = load_model(None, dtype="int8")
    with monkeypatch.context() as m:
        _no_gguf_reader(m)
        with recording_loads() as loads:
            second = load_model(None, dtype="int8")
    assert loads[0]["cached"]
    assert_same_model(second, first)
