"""``--gamma auto`` and ``--dtype auto``: quick measurements (:func:`specjax.eval.measure.recommend`,
:func:`~specjax.eval.measure.fastest_format`) cached on disk per host
(:mod:`specjax.eval.hostcache`): a cache hit measures nothing, the key follows what changes
the result (weight format, drafter, sampling, the checkpoint file), an unreadable file is
measured again with one note line, concurrent writes never leave half a file, α measured with
the cost programs equals the teacher-forced α, and on the command line an explicit ``--dtype``
always wins."""

from __future__ import annotations

import contextlib
import json
import os
import threading

import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

from conftest import tiny_model

from specjax.drafters.model import ModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.eval import auto, hostcache, measure
from specjax.eval.hostcache import HostCache
from specjax.io.loading import convert_model, load_model, save_model, source_identity
from specjax.runtime.settings import DecodeSettings

PROMPTS = [{"ids": [5, 9, 17, 33, 5, 9, 40, 41]}]
SETTINGS = DecodeSettings(max_new_tokens=12)
CONFTEST_CACHE = os.path.abspath(os.environ.get("SPECJAX_TEST_CACHE", os.path.join(os.path.dirname(__file__), "..",
                                                                                     ".jax_cache")))


def tiny_pair():
    """One-layer target and draft model (cheap compiles); the drafter is the target with a flatter embedding."""
    target = tiny_model(seed=0, scale=20.0, num_layers=1)
    return target, ModelDrafter.from_model(tiny_model(seed=0, scale=12.0, num_layers=1), name="flat")


def tiny_eagle(target):
    """An untrained EAGLE-style feature drafter for ``target`` (half the vocabulary in its head)."""
    from specjax.drafters import eagle

    cfg = eagle.EagleConfig.for_target(target.config, target.config.vocab_size // 2, 32)
    sub = np.arange(0, target.config.vocab_size, 2, dtype=np.int32)
    return eagle.EagleDrafter(cfg, {"train": eagle.init_params(cfg, 7), "frozen": eagle.frozen_params(target, sub)},
                              name="eagle")


@contextlib.contextmanager
def count_compiles():
    """Yield a list of the functions JAX compiles in the block (its backend-compile events)."""
    names: list[str] = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(str(kw.get("fun_name", "?")))

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        monitoring.unregister_event_duration_listener(listener)


@pytest.fixture
def counted(monkeypatch):
    """Count :func:`measure.measure_costs` and :func:`measure.alpha_by_decoding` calls (real ones) made
    by :func:`measure.recommend` (patched in :mod:`specjax.eval.auto`, where it looks them up)."""
    calls = {"costs": 0, "alpha": 0}
    real_costs, real_alpha = measure.measure_costs, measure.alpha_by_decoding

    def costs(*a, **k):
        calls["costs"] += 1
        return real_costs(*a, **k)

    def alpha(*a, **k):
        calls["alpha"] += 1
        return real_alpha(*a, **k)

    monkeypatch.setattr(auto, "measure_costs", costs)  # where recommend looks them up
    monkeypatch.setattr(auto, "alpha_by_decoding", alpha)
    return calls


@pytest.fixture
def faked(monkeypatch):
    """:func:`measure.measure_costs` and :func:`measure.alpha_by_decoding` replaced by counted
    fakes (nothing compiles): for tests of the keys only."""
    calls = {"costs": 0, "alpha": 0}

    def costs(target, drafter, gammas, **k):
        calls["costs"] += 1
        return {"c": [0.1] * len(gammas), "v": [1.0 + 0.1 * g for g in gammas], "t_target_ms": {1: 10.0},
                "t_draft_ms": {1: 1.0}, "interpolated": []}

    def alpha(*a, **k):
        calls["alpha"] += 1
        return {"alpha": 0.6, "positions": 8, "coverage": 1.0, "betas": [[0.6] * 8]}

    monkeypatch.setattr(auto, "measure_costs", costs)  # where recommend looks them up
    monkeypatch.setattr(auto, "alpha_by_decoding", alpha)
    return calls


# --------------------------------------------------------------------------- the cache itself
def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert hostcache.cache_dir() == str(tmp_path / "a")
    monkeypatch.delenv("SPECJAX_CACHE_DIR")
    assert hostcache.cache_dir() == str(tmp_path / "x" / "specjax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hostcache.cache_dir() == str(tmp_path / "home" / ".cache" / "specjax")
    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    assert hostcache.default_cache() is None
    monkeypatch.delenv("SPECJAX_NO_CACHE")
    assert hostcache.default_cache().dir == str(tmp_path / "home" / ".cache" / "specjax" / "measured")


def test_host_fingerprint_names_the_machine():
    fp = hostcache.host_fingerprint()
    for key in ("cpu", "cpu_flags", "cores", "backend", "device_kind", "specjax", "jax", "jaxlib", "xla_flags"):
        assert key in fp, key
    assert fp["cpu"] and fp["cores"] >= 1
    json.dumps(fp)


def test_put_get_and_keys(tmp_path):
    c = HostCache(str(tmp_path))
    assert c.get("costs", {"a": 1}) is None
    path = c.put("costs", {"a": 1}, {"v": [1.5, 2.0]}, seconds=3.0)
    assert path and os.path.dirname(path) == str(tmp_path / "measured")
    hit = c.get("costs", {"a": 1})
    assert hit["value"] == {"v": [1.5, 2.0]} and hit["seconds"] == 3.0 and hit["created"]
    assert c.get("costs", {"a": 2}) is None and c.get("alpha", {"a": 1}) is None
    assert c.path("costs", {"a": 1}) != c.path("costs", {"a": 2})
    assert json.loads(open(path).read())["key"]["host"] == json.loads(json.dumps(hostcache.host_fingerprint()))


@pytest.mark.parametrize("content", [b"\xff\xfe not utf-8", b'{"key": {', b"[]", b'{"key": {"kind": "other"}, "value": {}}'])
def test_unreadable_file_is_ignored_with_one_note(tmp_path, capsys, content):
    c = HostCache(str(tmp_path))
    path = c.put("costs", {"a": 1}, {"v": 1})
    capsys.readouterr()
    with open(path, "wb") as f:
        f.write(content)
    assert c.get("costs", {"a": 1}) is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("specjax: note: ignoring") and path in err[0], err
    c.put("costs", {"a": 1}, {"v": 2})  # measured again: the file is replaced
    assert c.get("costs", {"a": 1})["value"] == {"v": 2}


def test_unwritable_cache_is_one_note_not_an_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    c = HostCache(str(blocker))
    assert c.put("costs", {"a": 1}, {"v": 1}) is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "could not write the measurement cache file" in err[0]
    assert c.get("costs", {"a": 1}) is None


def test_concurrent_writes_never_leave_half_a_file(tmp_path):
    """Writers replace one entry over and over with large values while a reader reads it: every
    read is a whole value one writer wrote (or nothing yet), no temporary file is left."""
    c = HostCache(str(tmp_path), note=lambda msg: bad.append(msg))
    bad, seen, stop = [], [], threading.Event()
    values = {w: {"writer": w, "data": [w] * 20000} for w in range(4)}

    def write(w):
        for _ in range(15):
            c.put("costs", {"k": 1}, values[w])

    def read():
        while not stop.is_set():
            hit = c.get("costs", {"k": 1})
            if hit is not None:
                seen.append(hit["value"]["writer"])
                assert hit["value"] == values[hit["value"]["writer"]]

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert not bad, bad
    assert seen and set(seen) <= set(values)
    assert os.listdir(tmp_path / "measured") == [os.path.basename(c.path("costs", {"k": 1}))]


# --------------------------------------------------------------------------- --gamma auto
def test_gamma_auto_cache_hit_measures_nothing(tmp_path, counted):
    target, drafter = tiny_pair()
    cache = HostCache(str(tmp_path))
    g1, r1 = measure.recommend(target, drafter, PROMPTS, SETTINGS, gamma_max=2, cache=cache, timing_repeats=1)
    assert counted == {"costs": 1, "alpha": 1}
    assert not r1["costs_source"]["cached"] and not r1["alpha_source"]["cached"]
    assert 1 <= g1 <= 2 and len(r1["c"]) == len(r1["v"]) == 2 and 0 <= r1["alpha"] <= 1
    assert r1["predicted_speedup"] == max(r["speedup"] for r in r1["table"])
    with count_compiles() as compiled:
        g2, r2 = measure.recommend(target, drafter, PROMPTS, SETTINGS, gamma_max=2, cache=cache, timing_repeats=1)
    # the decision from the cache: nothing measured (no timing, no decoding) and nothing compiled
    assert counted == {"costs": 1, "alpha": 1}
    assert compiled == []
    assert r2["costs_source"]["cached"] and r2["alpha_source"]["cached"]
    assert (g2, r2["c"], r2["v"], r2["alpha"]) == (g1, r1["c"], r1["v"], r1["alpha"])
    # another prompt of the same length bucket: α is measured again, the costs are not
    measure.recommend(target, drafter, [{"ids": [7, 8, 9, 7, 8, 9, 7]}], SETTINGS, gamma_max=2, cache=cache,
                      timing_repeats=1)
    assert counted == {"costs": 1, "alpha": 2}
    # no cache: always measured
    measure.recommend(target, drafter, PROMPTS, SETTINGS, gamma_max=2, cache=None, timing_repeats=1)
    assert counted == {"costs": 2, "alpha": 3}


def test_gamma_auto_key_follows_format_drafter_and_sampling(tmp_path, faked):
    target, drafter = tiny_pair()
    cache = HostCache(str(tmp_path))

    def run(t, d, settings=SETTINGS):
        measure.recommend(t, d, PROMPTS, settings, gamma_max=2, cache=cache)
        return dict(faked)

    assert run(target, drafter) == {"costs": 1, "alpha": 1}
    assert run(target, drafter) == {"costs": 1, "alpha": 1}  # hit
    assert run(convert_model(target, "bfloat16"), drafter) == {"costs": 2, "alpha": 2}  # target format
    dm = tiny_model(seed=0, scale=12.0, num_layers=1)
    assert run(target, ModelDrafter.from_model(convert_model(dm, "int8"), name="flat")) == {"costs": 3, "alpha": 3}
    assert run(target, ModelDrafter.from_model(tiny_model(seed=5, num_layers=1), name="flat")) \
        == {"costs": 4, "alpha": 4}  # other weights, same name
    assert run(target, NgramDrafter(max_ngram=2)) == {"costs": 5, "alpha": 5}
    assert run(target, NgramDrafter(max_ngram=3)) == {"costs": 6, "alpha": 6}
    # sampling changes α, not the costs (the programs are the same)
    assert run(target, drafter, DecodeSettings(max_new_tokens=12, temperature=0.7)) == {"costs": 6, "alpha": 7}
    # a longer max_new_tokens changes the decode programs' buffers: the costs are measured again
    assert run(target, drafter, DecodeSettings(max_new_tokens=200)) == {"costs": 7, "alpha": 8}
    assert run(target, drafter) == {"costs": 7, "alpha": 8}  # everything above is still cached


def test_gamma_auto_corrupt_cache_file_is_measured_again(tmp_path, faked, capsys):
    target, drafter = tiny_pair()
    cache = HostCache(str(tmp_path))
    _, rep = measure.recommend(target, drafter, PROMPTS, SETTINGS, gamma_max=2, cache=cache)
    path = rep["costs_source"]["path"]
    with open(path, "w") as f:
        f.write('{"key": {"kind": "costs", "host"')  # a truncated write from an old version / a crash
    capsys.readouterr()
    _, rep = measure.recommend(target, drafter, PROMPTS, SETTINGS, gamma_max=2, cache=cache)
    assert faked == {"costs": 2, "alpha": 1} and not rep["costs_source"]["cached"]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "ignoring the unreadable measurement cache file" in err[0]
    _, rep = measure.recommend(target, drafter, PROMPTS, SETTINGS, gamma_max=2, cache=cache)
    assert faked == {"costs": 2, "alpha": 1} and rep["costs_source"]["cached"]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("kind", ["model", "ngram", "eagle"])
def test_alpha_by_decoding_equals_teacher_forcing(kind, temperature):
    """α from the cost programs (KV-cached target steps, the drafter's first proposal per
    position) is :func:`measure.measure_alpha`'s teacher-forced α on the same continuation."""
    target, drafter = tiny_pair()
    drafter = {"model": drafter, "ngram": NgramDrafter(max_ngram=2), "eagle": tiny_eagle(target)}[kind]
    settings = DecodeSettings(max_new_tokens=12, temperature=temperature, top_k=20 if temperature else 0, seed=3)
    recs = measure.prompt_records([[5, 6, 7, 8, 9, 5, 6, 7, 3, 4], [9, 10, 11, 9, 10]])
    progs = measure.timed_programs(target, drafter, [0, 1, 2], max(len(r["ids"]) for r in recs), 12)
    fast = measure.alpha_by_decoding(target, drafter, recs, progs, settings, new_tokens=10)
    assert [len(c) for c in fast["continuations"]] == [len(b) for b in fast["betas"]]
    assert all(1 <= len(c) <= 10 for c in fast["continuations"])
    ref = measure.measure_alpha(target, drafter, recs, fast["continuations"], temperature=temperature,
                                top_k=settings.top_k, seed=3)
    a, b = np.concatenate(fast["betas"]), np.concatenate(ref["betas"])
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    np.testing.assert_allclose(a[~np.isnan(a)], b[~np.isnan(b)], atol=2e-5)
    assert fast["positions"] == ref["positions"] > 0


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_greedy_continuation_is_the_decoders(fmt):
    """The target's own continuation that α is measured on is greedy decoding's output, in every
    weight format (the prompt is prefilled in one call over its bucket, as the Decoder does: in
    int8 a prompt fed token by token changed the default model's second token)."""
    from specjax.runtime.decoder import Decoder

    target, drafter = tiny_pair()
    target = convert_model(target, fmt)
    recs = measure.prompt_records([[5, 6, 7, 8, 9, 5, 6, 7, 3, 4]])
    progs = measure.timed_programs(target, drafter, [0, 1], 10, 12)
    a = measure.alpha_by_decoding(target, drafter, recs, progs, DecodeSettings(max_new_tokens=12, ignore_eos=True),
                                  new_tokens=12)
    ref = Decoder(target).generate([recs[0]["ids"]], max_new_tokens=12, eos_ids=[])
    assert a["continuations"][0] == list(ref.tokens[0])


# --------------------------------------------------------------------------- --dtype auto
def fake_fidelity(monkeypatch, faithful: dict):
    """:func:`specjax.eval.fidelity.measure` returning ``faithful[format]`` (nothing runs); counts calls."""
    from specjax.eval import fidelity

    calls = []

    def fake(source, fmt, **kw):
        calls.append(fmt)
        return {"mean_kl": 1e-4 if faithful[fmt] else 0.05, "top1_agreement": 1.0 if faithful[fmt] else 0.86,
                "faithful": faithful[fmt], "source": {"cached": False}}

    monkeypatch.setattr(fidelity, "measure", fake)
    return calls


def fake_steps(monkeypatch, ms: dict):
    """:func:`costs.median_ms` returning ``ms[format]`` for each step (nothing runs); counts calls
    (patched in :mod:`specjax.eval.auto`, where :func:`measure.fastest_format` looks it up)."""
    calls = []

    def median(cases, warmup, repeats):
        calls.append(sorted(cases))
        return {k: ms[k[1]] for k in cases}

    monkeypatch.setattr(auto, "median_ms", median)  # where fastest_format looks it up
    return calls


@pytest.fixture
def tiny_dir(tmp_path):
    from test_analysis_cli import tiny_tokenizer

    return save_model(tiny_model(seed=2, num_layers=1).replace(tokenizer=tiny_tokenizer()), str(tmp_path / "tiny"))


def test_convert_model_equals_loading_in_the_format(tiny_dir):
    f32 = load_model(tiny_dir)
    for fmt in ("bfloat16", "int8"):
        direct, conv = load_model(tiny_dir, dtype=fmt), convert_model(f32, fmt)
        assert conv.dtype == fmt
        import jax

        la, lb = jax.tree_util.tree_leaves(direct.params), jax.tree_util.tree_leaves(conv.params)
        assert len(la) == len(lb)
        for x, y in zip(la, lb):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))
    assert convert_model(f32, "float32") is f32


def test_fastest_format_choice_is_cached(tmp_path, tiny_dir, monkeypatch):
    fake_fidelity(monkeypatch, {"bfloat16": True, "int8": True})
    calls = fake_steps(monkeypatch, {"float32": 30.0, "bfloat16": 20.0, "int8": 25.0})
    cache = HostCache(str(tmp_path / "cache"))
    fmt, info, model = measure.fastest_format(tiny_dir, cache=cache)
    assert fmt == "bfloat16" and model.dtype == "bfloat16" and len(calls) == 1
    assert calls[0] == [("step", "bfloat16"), ("step", "float32"), ("step", "int8")]
    assert info["step_ms"] == {"float32": 30.0, "bfloat16": 20.0, "int8": 25.0} and not info["source"]["cached"]
    fmt, info, model = measure.fastest_format(tiny_dir, cache=cache)
    assert (fmt, model, len(calls)) == ("bfloat16", None, 1) and info["source"]["cached"]
    # other candidates or tokens per call: another entry
    assert measure.fastest_format(tiny_dir, formats=["float32", "int8"], cache=cache)[0] == "int8"
    assert measure.fastest_format(tiny_dir, tokens=3, cache=cache)[0] == "bfloat16" and len(calls) == 3
    # the checkpoint changed on disk: measured again
    st = os.stat(os.path.join(tiny_dir, "model.safetensors"))
    os.utime(os.path.join(tiny_dir, "model.safetensors"), ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    measure.fastest_format(tiny_dir, cache=cache)
    assert len(calls) == 4
    # a loaded model: keyed by its fingerprint; the chosen format is returned converted
    m = load_model(tiny_dir)
    fmt, _, conv = measure.fastest_format(m, cache=cache)
    assert (fmt, conv.dtype, len(calls)) == ("bfloat16", "bfloat16", 5)
    fmt, info, conv = measure.fastest_format(m, cache=cache)
    assert info["source"]["cached"] and conv.dtype == "bfloat16" and len(calls) == 5
    with pytest.raises(ValueError, match="unknown"):
        measure.fastest_format(m, formats=["fp8"])
    with pytest.raises(ValueError, match="tokens"):
        measure.fastest_format(m, tokens=0)


def test_fastest_format_times_the_decoders_step(tiny_dir, monkeypatch):
    """Unfaked timing: every faithful format's one-token step is timed (positive medians) and the
    smallest wins."""
    fake_fidelity(monkeypatch, {"bfloat16": True, "int8": True})
    fmt, info, model = measure.fastest_format(tiny_dir, repeats=2, warmup=1)
    assert set(info["step_ms"]) == {"float32", "bfloat16", "int8"} and all(v > 0 for v in info["step_ms"].values())
    assert fmt == min(info["step_ms"], key=info["step_ms"].get) and model.dtype == fmt


def test_source_identity(tmp_path, tiny_dir):
    a = source_identity(tiny_dir)
    assert a["path"] == os.path.realpath(tiny_dir) and a["config_sha256"]
    assert {f[0] for f in a["files"]} >= {"config.json", "model.safetensors"}
    assert source_identity(tiny_dir) == a
    with open(os.path.join(tiny_dir, "config.json"), "a") as f:
        f.write("\n")
    assert source_identity(tiny_dir) != a
    assert source_identity("org/not-cached-anywhere-xyz") == {"hub_id": "org/not-cached-anywhere-xyz"}


# --------------------------------------------------------------------------- the command line
@pytest.fixture
def cli_env(monkeypatch, tmp_path):
    """The measurement cache on (in tmp), the compilation cache of the test session."""
    monkeypatch.delenv("SPECJAX_NO_CACHE", raising=False)
    monkeypatch.delenv("SPECJAX_DEBUG", raising=False)
    monkeypatch.setenv("SPECJAX_CACHE", CONFTEST_CACHE)
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "specjax-cache"))
    return tmp_path / "specjax-cache"


def run_cli(capsys, *argv):
    from specjax.cli import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_dtype_auto_measures_once_then_reads_the_cache(tiny_dir, cli_env, capsys, monkeypatch):
    calls = fake_steps(monkeypatch, {"float32": 30.0, "bfloat16": 20.0, "int8": 12.5})
    argv = ["generate", "--model", tiny_dir, "--max-new-tokens", "3", "--no-chat", "--json", "w3 w4 w5"]
    rc, out, err = run_cli(capsys, *argv, "--dtype", "auto")
    assert rc == 0, err
    line = [x for x in err.splitlines() if "--dtype auto chose" in x]
    assert len(line) == 1 and "chose int8" in line[0] and "measured now" in line[0], err
    assert "measuring its decode step (1 token per call) in float32, bfloat16, int8" in err
    assert "float32 30.0 ms, bfloat16 20.0 ms, int8 12.5 ms" in line[0]
    assert sum("loading" in x for x in err.splitlines()) <= 1  # loaded once, for the measurement
    first = json.loads(out)
    rc, out, err = run_cli(capsys, *argv, "--dtype", "auto")
    assert rc == 0 and len(calls) == 1, err
    assert "--dtype auto chose int8" in err and "cached, measured" in err
    assert json.loads(out)["tokens"] == first["tokens"]
    assert os.listdir(cli_env / "measured")


def test_cli_explicit_dtype_wins(tiny_dir, cli_env, capsys, monkeypatch, tmp_path):
    def boom(*a, **k):
        raise AssertionError("fastest_format must not run")

    monkeypatch.setattr(measure, "fastest_format", boom)
    cfg = tmp_path / "pair.toml"
    cfg.write_text(f'model = "{tiny_dir}"\ndtype = "auto"\nchat = false\n')
    rc, out, err = run_cli(capsys, "generate", "--config", str(cfg), "--dtype", "bfloat16", "--max-new-tokens", "2",
                           "--json", "w3 w4")
    assert rc == 0, err
    assert "--dtype auto" not in err
    rc, out, err = run_cli(capsys, "generate", "--model", tiny_dir, "--dtype", "int8", "--max-new-tokens", "2",
                           "--no-chat", "--json", "w3 w4")
    assert rc == 0, err


def test_cli_pair_config_dtype_auto(tiny_dir, cli_env, capsys, monkeypatch, tmp_path):
    from specjax.api import load_pair_config

    calls = fake_steps(monkeypatch, {"float32": 10.0, "bfloat16": 20.0, "int8": 30.0})
    cfg = tmp_path / "pair.toml"
    cfg.write_text(f'model = "{tiny_dir}"\ndtype = "auto"\nchat = false\n')
    assert load_pair_config(str(cfg))["dtype"] == "auto"
    rc, out, err = run_cli(capsys, "generate", "--config", str(cfg), "--max-new-tokens", "2", "--json", "w3 w4")
    assert rc == 0, err
    assert "--dtype auto chose float32" in err and len(calls) == 1
    bad = tmp_path / "bad.toml"
    bad.write_text('dtype = "fp8"\n')
    rc, out, err = run_cli(capsys, "generate", "--config", str(bad), "w3")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "auto" in err and "fp8" in err


@pytest.mark.parametrize("argv, msg", [
    (["generate", "--dtype", "fp8", "w3"], "invalid choice"),
    (["bench", "--prompts", "x.jsonl", "--dtype", "fp8"], "invalid choice"),
    (["analyze", "--alpha", "0.5", "--c", "0.1", "--dtype", "auto"], "invalid choice"),
])
def test_cli_bad_dtype_is_one_line(capsys, cli_env, argv, msg):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and msg in err, err


def test_cli_gamma_auto_uses_the_cache(tiny_dir, cli_env, capsys, tmp_path):
    ddir = save_model(tiny_model(seed=2, scale=3.0, num_layers=1).replace(
        tokenizer=load_model(tiny_dir).tokenizer), str(tmp_path / "draft"))
    argv = ["generate", "--model", tiny_dir, "--draft", ddir, "--gamma", "auto", "--max-new-tokens", "6", "--no-chat",
            "--json", "w3 w4 w5 w6 w3 w4"]
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 0, err
    assert "measuring costs for --gamma auto" in err and "measuring α for --gamma auto" in err
    (line,) = [x for x in err.splitlines() if "--gamma auto chose" in x]
    assert "measured now" in line and "cached" not in line
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 0, err
    assert "measuring" not in err
    (line2,) = [x for x in err.splitlines() if "--gamma auto chose" in x]
    assert line2.split(":")[2] == line.split(":")[2] and line2.count("cached") == 2


def test_cli_bench_dtype_auto(tiny_dir, cli_env, capsys, monkeypatch, tmp_path):
    calls = fake_steps(monkeypatch, {"float32": 30.0, "bfloat16": 20.0, "int8": 25.0})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w3 w4 w5", "category": "qa"}\n')
    rc, out, err = run_cli(capsys, "bench", "--prompts", str(prompts), "--model", tiny_dir, "--draft", "none",
                           "--dtype", "auto", "float32", "bfloat16", "--max-new-tokens", "2", "--no-chat", "--json",
                           "--no-progress", "--warmup", "0")
    assert rc == 0, err
    assert "--dtype auto chose bfloat16" in err and len(calls) == 1
    res = json.loads(out)
    assert res["config"]["dtype"] == ["bfloat16", "float32"]  # auto resolved, duplicates dropped


def test_gamma_auto_near_the_context_limit(tmp_path, faked):
    """A prompt that fills the context is the Decoder's one-line error; one that leaves room
    for a few tokens measures α on that many."""
    target, drafter = tiny_pair()
    ctx = target.config.max_position_embeddings
    with pytest.raises(ValueError, match="longer than the model's context"):
        measure.recommend(target, drafter, [{"ids": [5] * ctx}], SETTINGS, gamma_max=2)
    measure.recommend(target, drafter, [{"ids": [5] * (ctx - 3)}], SETTINGS, gamma_max=2)
    assert faked["alpha"] == 1


def test_alpha_continuation_stays_inside_the_context():
    target, drafter = tiny_pair()
    ctx = target.config.max_position_embeddings
    ids = list(np.random.default_rng(1).integers(3, 100, ctx - 3))
    _, rep = measure.recommend(target, drafter, [{"ids": ids}], DecodeSettings(max_new_tokens=50, ignore_eos=True),
                               gamma_max=1, timing_repeats=1)
    assert rep["positions"] <= 3


def test_dtype_auto_predicts_int8_for_the_default_model_on_an_x86_cpu(tmp_path, monkeypatch):
    """``predict=True`` (generate): the default model on an x86 CPU with the int8 kernel runs int8
    (measured faithful, issue 26), on other CPUs float32 (faithful by construction), on GPU/TPU
    bfloat16 — without measuring, until this host has cached the fidelity of every candidate and the
    speed of the faithful ones; then the cached measurement wins; a format this host measured
    unfaithful is never predicted; other models measure."""
    from specjax.models import q8

    x86 = {"backend": "cpu", "machine": "x86_64", "cpu_flags": ["avx", "avx2"]}
    want = "int8" if q8.available() else "float32"
    assert measure.predicted_format(["float32", "bfloat16", "int8"], "default", x86)[0] == want
    assert measure.predicted_format(["float32", "bfloat16"], "default", x86)[0] == "float32"
    assert measure.predicted_format(["float32", "bfloat16", "int8"], None, dict(x86, machine="aarch64"))[0] == "float32"
    assert measure.predicted_format(["float32", "bfloat16", "int8"], None, dict(x86, backend="gpu"))[0] == "bfloat16"
    assert measure.predicted_format(["float32", "bfloat16", "int8"], None, dict(x86, backend="tpu"))[0] == "bfloat16"
    assert measure.predicted_format(["float32", "int8"], None, dict(x86, backend="gpu")) is None
    assert measure.predicted_format(["float32", "int8"], "some/other-model", x86) is None

    monkeypatch.setattr(hostcache, "host_fingerprint", lambda: dict(x86))
    fid = fake_fidelity(monkeypatch, {"bfloat16": True, "int8": False})
    calls = fake_steps(monkeypatch, {"float32": 30.0, "bfloat16": 20.0, "int8": 10.0})
    cache = HostCache(str(tmp_path / "cache"))
    fmt, info, model = measure.fastest_format("default", cache=cache, predict=True)
    assert (fmt, model, info["step_ms"]) == (want, None, {})
    assert ("measured faithful" if want == "int8" else "faithful by construction") in info["source"]["predicted"]
    assert not calls and not fid
    from specjax.cli.common import auto_dtype_line

    assert auto_dtype_line(fmt, info).startswith(f"--dtype auto chose {want}: ")
    # measurements in the cache (fidelity of both candidates, speed of the faithful ones) win over the rule
    stored = {"bfloat16": {"mean_kl": 1e-4, "top1_agreement": 1.0, "faithful": True},
              "int8": {"mean_kl": 0.05, "top1_agreement": 0.86, "faithful": False}}

    def get(self, kind, p):
        value = stored[p["format"]] if kind == "fidelity" else {"step_ms": {"float32": 30.0, "bfloat16": 20.0}}
        return {"value": value, "created": "then", "seconds": 1.0, "path": "p"}

    monkeypatch.setattr(HostCache, "get", get)
    fmt, info, _ = measure.fastest_format("default", cache=cache, predict=True)
    assert fmt == "bfloat16" and info["source"]["cached"] and "predicted" not in info["source"]
    assert info["unfaithful"] == ["int8"] and not calls and not fid
    line = auto_dtype_line(fmt, info)
    assert "fastest faithful" in line and "not faithful to this model: int8: mean KL 0.05" in line


def test_dtype_auto_never_chooses_an_unfaithful_format(tmp_path, tiny_dir, monkeypatch):
    """int8 has the fastest step but misses the fidelity bar: auto takes the fastest faithful
    format; with float32 the only faithful one, nothing is timed."""
    fid = fake_fidelity(monkeypatch, {"bfloat16": True, "int8": False})
    calls = fake_steps(monkeypatch, {"float32": 30.0, "bfloat16": 20.0, "int8": 10.0})
    cache = HostCache(str(tmp_path / "cache"))
    fmt, info, model = measure.fastest_format(tiny_dir, cache=cache)
    assert (fmt, model.dtype, info["unfaithful"]) == ("bfloat16", "bfloat16", ["int8"])
    assert calls == [[("step", "bfloat16"), ("step", "float32")]] and sorted(fid) == ["bfloat16", "int8"]
    fake_fidelity(monkeypatch, {"bfloat16": False, "int8": False})
    fmt, info, model = measure.fastest_format(tiny_dir, cache=HostCache(str(tmp_path / "other")))
    assert (fmt, model.dtype, info["step_ms"], len(calls)) == ("float32", "float32", {}, 1)
    assert info["source"]["only_faithful"] and info["unfaithful"] == ["bfloat16", "int8"]


def test_fidelity_measured_once_then_cached(tmp_path, monkeypatch):
    """The fidelity of a format is measured on the built-in prompts once per model and host,
    then read from the cache; float32 is faithful without a measurement; the verdict follows the
    bar (KL, and top-1 or only near-ties)."""
    from specjax.eval import fidelity

    assert fidelity.verdict(5e-4, 0.99, False) and fidelity.verdict(5e-4, 0.9, True)
    assert not fidelity.verdict(2e-3, 1.0, True) and not fidelity.verdict(5e-4, 0.97, False)
    assert len(fidelity.fidelity_prompts()) >= 8
    ran = []
    monkeypatch.setattr(fidelity, "compare", lambda ref, other, ids: ran.append(other.dtype) or
                        {"mean_kl": 0.04, "top1_agreement": 0.9, "faithful": False})
    target = tiny_model(seed=3, num_layers=1)
    monkeypatch.setattr("specjax.api.encode_prompts", lambda m, texts, chat: [[1, 2, 3]] * len(texts))
    cache = HostCache(str(tmp_path / "cache"))
    assert fidelity.measure(target, "float32", cache=cache)["by_construction"] and not ran
    a = fidelity.measure(target, "int8", cache=cache)
    b = fidelity.measure(target, "int8", cache=cache)
    assert ran == ["int8"] and not a["source"]["cached"] and b["source"]["cached"] and not b["faithful"]
    assert fidelity.known(target, "int8", cache)["mean_kl"] == 0.04
    assert fidelity.known(target, "bfloat16", cache) is None  # not measured, not the default model
    assert fidelity.known(None, "int8", None)["faithful"] is True  # shipped for the default model (issue 26)


def test_fidelity_compare_on_a_tiny_model():
    """:func:`fidelity.compare` unfaked: a model against itself is faithful with KL 0; int8 of a
    random tiny model gives a finite KL and an agreement in [0, 1]."""
    from specjax.eval import fidelity

    f32 = tiny_model(seed=4, num_layers=1)
    same = fidelity.compare(f32, f32, [[5, 9, 17], [3, 4, 5, 6, 7]], max_new_tokens=6)
    assert same["mean_kl"] == 0.0 and same["top1_agreement"] == 1.0 and same["faithful"] and same["positions"] == 12
    q = fidelity.compare(f32, convert_model(f32, "int8"), [[5, 9, 17], [3, 4, 5, 6, 7]], max_new_tokens=6)
    assert np.isfinite(q["mean_kl"]) and q["mean_kl"] >= 0 and 0 <= q["top1_agreement"] <= 1
