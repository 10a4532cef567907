"""``specjax plan`` (issue 29, "Real sizes"): per-device memory of the prefill and decode programs
``generate`` runs, compiled ahead of time on abstract inputs (no weights).

In the suite (seconds): a tiny config.json written here, planned in-process on a one-device mesh
(figures present, JSON valid, bytes integers, weights and KV cache equal to the analytic figures);
bad flags and unknown models as one-line errors (exit 2, nothing compiled); Llama-3.1-70B in bfloat16
on 8 × 16 GiB refused in one line from the weight table alone, naming what fits; the weight table's
abstract parameters equal the NNX modules'.

In the gate phase (``-m gate_matrix``, .ci/run): Llama-3.1-8B on 8 virtual devices, batch 8 × 8192
tokens, in a fresh process: done in ≤ 3 minutes, peak RSS far below its 16 GB of weights, weight and
KV bytes per device within 10% of the analytic figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jax
import pytest
from conftest import tiny_config

from specjax import cli

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")  # conftest's compilation cache
    monkeypatch.setenv("SPECJAX_NO_PROGRESS", "1")
    monkeypatch.delenv("SPECJAX_DEBUG", raising=False)
    jax.devices()  # the suite's backend is up: plan uses its CPU device and leaves XLA_FLAGS alone


@pytest.fixture
def tiny_json(tmp_path):
    """A 2-layer config.json (the tiny test config: heads divide 8-way meshes)."""
    from specjax.io.hf import hf_config_dict

    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config_dict(tiny_config())))
    return str(path)


def one_line_error(capsys, rc, words) -> str:
    out, err = capsys.readouterr()
    assert rc == 2, (rc, err)
    assert "Traceback" not in err and not out.strip(), (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specjax: error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _ints(d: dict, keys) -> None:
    for k in keys:
        assert isinstance(d[k], int) and not isinstance(d[k], bool) and d[k] > 0, (k, d[k])


def test_tiny_plan_json(capsys, tiny_json):
    """A tiny config on a one-device mesh with an n-gram drafter: one JSON object, every figure an
    integer byte count; weights and KV cache per device equal the analytic ones (exact: nothing is
    padded); the peak is weights + the larger program's state and temporaries; it fits."""
    rc = cli.main(["plan", "--model", tiny_json, "--mesh", "data=1,model=1", "--batch", "2", "--max-len", "192",
                   "--draft", "ngram", "--gamma", "3", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    fig = json.loads(out)
    _ints(fig, ["weights", "kv_cache", "state", "peak", "device_memory", "decode_step_weight_bytes", "buffer_len"])
    _ints(fig["temporaries"], ["prefill", "decode"])
    _ints(fig["analytic"], ["weights", "kv_cache"])
    assert (fig["batch"], fig["max_len"], fig["prompt_len"], fig["mesh"]) == (2, 192, 96, "data=1,model=1")
    assert (fig["dtype"], fig["kv_cache_dtype"], fig["draft"], fig["gamma"]) == ("bfloat16", "bfloat16", "ngram", 3)
    cfg = tiny_config()
    assert fig["weights"] == fig["analytic"]["weights"] == 2 * sum(
        v.size for v in jax.tree_util.tree_leaves(_shapes(cfg)))
    assert fig["kv_cache"] == fig["analytic"]["kv_cache"] == \
        2 * cfg.num_layers * 2 * cfg.num_kv_heads * fig["buffer_len"] * cfg.head_dim * 2
    assert fig["buffer_len"] >= 192 + 3
    assert fig["peak"] == max(fig["program_peaks"].values()) and fig["peak"] > fig["weights"] + fig["kv_cache"]
    assert fig["fits"] is True and fig["largest"]["batch"] >= 2 and fig["largest"]["max_len"] >= 192
    # an untied embedding is read by the rows it gathers: 2 rows × 4 tokens per call, not the whole table
    assert fig["decode_step_weight_bytes"] == fig["weights"] - (cfg.vocab_size - 8) * cfg.hidden_size * 2
    assert "CPU" in fig["note"]


def _shapes(cfg):
    from specjax.models import llama

    return llama.param_shapes(cfg, "bfloat16")


def test_tiny_plan_text(capsys, tiny_json):
    """The text form names each figure (the programs of test_tiny_plan_json: the compilation cache has them)."""
    rc = cli.main(["plan", "--model", tiny_json, "--mesh", "data=1,model=1", "--batch", "2", "--max-len", "192",
                   "--draft", "ngram", "--gamma", "3"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    for words in ("weights", "KV cache", "temporaries", "peak", "largest that fits", "each decode step reads",
                  "estimate"):
        assert words in out, (words, out)


@pytest.mark.parametrize("argv, words", [
    (["--mesh", "data=x"], ["--mesh", "data=D,model=M"]),
    (["--mesh", "data=0,model=2"], ["--mesh", "data must be >= 1"]),
    (["--mesh", "pipe=2"], ["unknown axis 'pipe'"]),
    (["--batch", "0"], ["--batch must be an integer >= 1"]),
    (["--batch", "many"], ["--batch", "invalid int value"]),
    (["--max-len", "100000"], ["--max-len 100000", "512 tokens"]),
    (["--device-memory", "lots"], ["--device-memory", "16GiB"]),
    (["--draft", "default"], ["--draft 'default'", "ngram"]),
    (["--gamma", "0"], ["--gamma"]),
])
def test_bad_flags_one_line(capsys, tiny_json, argv, words):
    """Each bad flag: one line, exit status 2, before anything is compiled."""
    one_line_error(capsys, cli.main(["plan", "--model", tiny_json, *argv]), words)


def test_unknown_model_one_line(capsys, tmp_path):
    line = one_line_error(capsys, cli.main(["plan", "--model", "llama-9-zillion"]), ["llama-9-zillion"])
    assert "llama-3.1-8b" in line and "config.json" in line
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    one_line_error(capsys, cli.main(["plan", "--model", str(tmp_path)]), ["config.json", "not valid JSON"])


def test_70b_bfloat16_refused_from_the_weight_table(capsys):
    """Llama-3.1-70B in bfloat16 on 8 × 16 GiB: its weights alone (16.4 GiB per device) do not fit,
    decided before compiling; the line names int8, which fits."""
    line = one_line_error(capsys, cli.main(["plan", "--model", "llama-3.1-70b", "--mesh", "data=1,model=8",
                                             "--dtype", "bfloat16", "--batch", "8", "--max-len", "8192",
                                             "--device-memory", "16GiB"]),
                          ["llama-3.1-70b", "does not fit", "before compiling", "--dtype int8"])
    assert "16.43 GiB" in line


def test_a_model_axis_that_does_not_divide_is_said_first(capsys, tiny_json):
    """``--mesh model=3`` on 8 heads / 2 KV heads (turn 18's new-user pass: Llama-3.1-8B on model=3
    compiled 53 s and then only said "use more memory"): the replication warning comes first, before
    the refusal or any compile."""
    rc = cli.main(["plan", "--model", tiny_json, "--mesh", "data=1,model=3", "--batch", "2", "--max-len", "192",
                   "--device-memory", "1KiB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 2, err
    assert "not divisible by model=3" in err[0] and "attention heads (8" in err[0], err
    assert err[1].startswith("specjax: error:") and "does not fit" in err[1], err


def test_a_non_dividing_model_axis_is_told_one_that_divides(capsys):
    """Llama-3.1-8B on ``model=3`` × 12 GiB (turn 18's new-user pass: the line said only "use more
    memory", while model=4 fits): the refusal names a model axis that divides the heads, KV heads and
    MLP, with its weight bytes; the order of sizes tried."""
    from specjax.eval import plan

    rc = cli.main(["plan", "--model", "llama-3.1-8b", "--mesh", "data=1,model=3", "--device-memory", "12GiB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "not divisible by model=3" in err[0], err
    assert "does not fit" in err[-1] and "--mesh data=1,model=4 (3.74 GiB of weights per device)" in err[-1], err
    assert "more memory" not in err[-1], err
    cfg = plan.model_shape("llama-3.1-8b")[1]  # 32 heads, 8 KV heads: 2, 4, 8 divide
    assert plan.model_axis_sizes(cfg, 3) == [4, 8, 2, 16, 32, 64]
    assert plan.model_axis_sizes(cfg, 2) == [4, 8, 16, 32, 64]
    assert plan.model_axis_sizes(cfg, 8) == [16, 32, 64]


def test_too_small_memory_suggests_shorter_context(capsys, tiny_json):
    """Weights fit but weights + KV cache do not: the line suggests a shorter context or a smaller batch."""
    line = one_line_error(capsys, cli.main(["plan", "--model", tiny_json, "--batch", "8", "--max-len", "512",
                                             "--device-memory", "700KiB"]), ["does not fit", "--max-len"])
    assert "KV cache" in line


def test_param_shapes_are_the_modules():
    """The weight table's abstract parameters (milliseconds) equal the NNX modules' (traced)."""
    from flax import nnx

    from specjax.models import llama

    for fmt in ("float32", "bfloat16", "int8"):
        for tied in (False, True):
            cfg = tiny_config(tie_word_embeddings=tied)
            _, abstract = llama.abstract_model(cfg, fmt)
            traced = {p: (v.shape, v.dtype) for p, v in llama.flatten_params(nnx.to_pure_dict(abstract))}
            table = {p: (v.shape, v.dtype) for p, v in llama.param_shapes(cfg, fmt).items()}
            assert traced == table, (fmt, tied)


@pytest.mark.gate_matrix
def test_llama_8b_plan_on_8_devices(tmp_path):
    """Llama-3.1-8B, bfloat16, batch 8 × 8192 tokens on ``--mesh data=1,model=8`` in a fresh process
    (8 virtual CPU devices set up by the command): ≤ 3 minutes, peak RSS below 4 GB (its weights are
    16 GB), weight and KV bytes per device within 10% of params × 2 / 8 and
    2 · layers · batch · kv_heads · 8192 · head_dim · 2 / 8."""
    from specjax.models import weights
    from specjax.models.shapes import shape_config

    env = dict(os.environ, PYTHONPATH=ROOT, SPECJAX_NO_CACHE="1", SPECJAX_NO_PROGRESS="1")
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_PLATFORMS", None)
    # the child reports its own peak RSS (VmHWM: ru_maxrss would carry the pytest worker's peak across exec)
    code = ("import sys; from specjax.cli import main; from specjax.eval.bench_io import peak_rss_bytes; "
            "rc = main(sys.argv[1:]); print('RSS', peak_rss_bytes(), file=sys.stderr); sys.exit(rc)")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, "plan", "--model", "llama-3.1-8b", "--mesh", "data=1,model=8",
                           "--dtype", "bfloat16", "--batch", "8", "--max-len", "8192", "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    fig = json.loads(proc.stdout)
    rss = int(proc.stderr.split("RSS ")[-1].split()[0])
    print(f"8B plan: {seconds:.1f} s, peak RSS {rss / 2 ** 30:.2f} GiB, figures {fig}")
    assert seconds <= 180, seconds
    assert rss < 4 * 2 ** 30, rss
    cfg = shape_config("llama-3.1-8b")
    w = weights.num_params(cfg) * 2 / 8
    kv = 2 * cfg.num_layers * 8 * cfg.num_kv_heads * 8192 * cfg.head_dim * 2 / 8
    assert abs(fig["weights"] / w - 1) < 0.1 and abs(fig["kv_cache"] / kv - 1) < 0.1, (fig, w, kv)
    assert fig["devices"] == 8 and fig["fits"] and fig["peak"] < fig["device_memory"]
    assert fig["decode_step_weight_bytes"] < fig["weights"]  # the untied embedding: only gathered rows
