"""benchmarks/device.py, the accelerator benchmark, in its CPU smoke mode (``--cpu-smoke``), so the
script that only runs on GPU/TPU hosts cannot rot: run from the tree as the device host runs it
(a subprocess with ``PYTHONPATH`` = the repository root, no install), then every section of its
JSON is checked for real content — finite positive times, byte counts that match the tiny shape,
predictions that follow from the measured rounds and the replayed τ."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import jax
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SCRIPT = os.path.join(ROOT, "benchmarks", "device.py")
# the suite's persistent compilation cache (tests/conftest.py): re-runs load the programs
CACHE = os.path.abspath(os.environ.get("SPECJAX_TEST_CACHE", os.path.join(ROOT, ".jax_cache")))


@pytest.fixture(scope="module")
def device():
    """The benchmark script as a module (its tables and pure functions)."""
    spec = importlib.util.spec_from_file_location("device_benchmark", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(tmp_path, *extra: str):
    """``(completed process, results JSON)`` of ``device.py --cpu-smoke`` run in ``tmp_path``."""
    out = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--out", str(out), "--compile-cache", CACHE, *extra],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_cpu_smoke_writes_every_section(tmp_path, device):
    """One smoke run (tiny shape, γ 2, ``--bandwidth 0.02`` TB/s so the bound is computed on CPU):
    status complete; machine, settings and the replayed τ recorded; per k and γ a finite positive
    time and compile time; weight and KV bytes of the tiny shape; v(64) > 1 (64 tokens cost more
    than one on CPU); the predicted speedup is τ · t_AR / t_round; one printed line per measurement
    and no temp file left."""
    proc, res = _run(tmp_path, "--bandwidth", "0.02")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert res["status"] == "complete"
    st, m = res["settings"], res["machine"]
    assert (st["mode"], st["dtype"], st["batch"], st["ks"], st["gammas"]) == ("cpu-smoke", "bfloat16", 1,
                                                                               [1, 4, 16, 64], [2])
    assert st["forward_buffer_len"] >= st["prompt_len"] + st["max_new_tokens"] + 64
    assert (m["backend"], m["jax"], m["device_kind"]) == ("cpu", jax.__version__, jax.devices("cpu")[0].device_kind)
    assert m["cpu"] and isinstance(m["cpu_flags"], list) and m["bandwidth"]["bytes_per_s"] == pytest.approx(2e10)
    tau = res["tau_replayed"]
    assert tau["by_gamma"] == {"2": device.TAU_REPLAYED[2]} and "not measured" in tau["note"]
    assert "BENCHMARKS.md" in tau["source"]

    sh = res["shapes"]["tiny"]
    cfg = device.SMOKE_SHAPES["tiny"]["config"]
    assert sh["status"] == "complete" and sh["config"] == cfg and _positive(sh["init_s"])
    assert set(sh["compile_s"]) == {"forward_k1", "forward_k4", "forward_k16", "forward_k64", "decode_ar",
                                    "decode_gamma2"}
    assert all(_positive(v) for v in sh["compile_s"].values()), sh["compile_s"]
    assert set(sh["forward_ms"]) == set(sh["verification_curve"]) == {"1", "4", "16", "64"}
    assert all(_positive(v) for v in sh["forward_ms"].values()), sh["forward_ms"]
    assert sh["verification_curve"]["1"] == 1.0 and sh["verification_curve"]["64"] > 1.0
    assert all(_positive(v) for v in sh["verification_curve"].values())

    d, layers, kv, hd, v = (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"],
                            cfg["head_dim"], cfg["vocab_size"])
    ar = sh["ar_step"]
    # untied head: every bf16 weight but the embedding table, of which one row is read
    assert ar["forward_bound"]["weight_bytes"] == sh["weight_bytes"] - (v - 1) * d * 2
    assert ar["forward_bound"]["kv_bytes"] == 2 * layers * kv * st["forward_buffer_len"] * hd * 4  # float32 on CPU
    for which in ("forward", "loop"):
        assert _positive(ar[f"{which}_bound"]["bound_ms"]) and _positive(ar[f"ratio_{which}"])
    assert ar["ratio_loop"] == pytest.approx(ar["loop_ms"] / ar["loop_bound"]["bound_ms"])

    for key in ("ar", "2"):
        dec = sh["decode"][key]
        assert _positive(dec["round_ms"]) and _positive(dec["prefill_s"]) and dec["rounds_timed"] > 0
        assert dec["buffer_len"] > st["prompt_len"] + st["max_new_tokens"] and dec["cache_dtype"] == "float32"
    spec = sh["speculative"]["2"]
    assert spec["tau_replayed"] == device.TAU_REPLAYED[2]
    assert spec["predicted_speedup"] == pytest.approx(spec["tau_replayed"] * sh["decode"]["ar"]["round_ms"]
                                                      / sh["decode"]["2"]["round_ms"])
    assert all(_positive(spec[k]) for k in ("round_ms", "round_in_ar_rounds", "predicted_speedup",
                                            "predicted_tokens_per_s"))

    lines = proc.stdout.splitlines()
    assert sum(" forward k=" in line for line in lines) == 4 and sum(" decode loop " in line for line in lines) == 2
    assert lines[-1].endswith("status: complete")
    assert os.listdir(tmp_path) == ["results.json"]


def test_budget_stops_cleanly(tmp_path):
    """``--budget-s 0``: the run stops before its first measurement with exit status 0 and a valid
    JSON that says where it stopped."""
    proc, res = _run(tmp_path, "--budget-s", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert res["status"].startswith("stopped: the time budget of 0 s ran out before tiny")
    assert res["shapes"]["tiny"]["status"] == "incomplete (time budget)" and not res["shapes"]["tiny"]["forward_ms"]
    assert res["machine"]["backend"] == "cpu"


def test_peak_bandwidth_table(device):
    """Device kinds as JAX names them map to their peak bandwidth; CPU and unknown kinds get no bound
    but a note; ``--bandwidth`` wins."""
    tbs = lambda kind: device.peak_bandwidth(kind, "gpu", None)["bytes_per_s"]  # noqa: E731
    assert tbs("NVIDIA H200") == 4.8e12 and tbs("NVIDIA H100 80GB HBM3") == 3.35e12
    assert tbs("NVIDIA H100 PCIe") == 2.0e12 and tbs("NVIDIA A100-SXM4-80GB") == 2.0e12
    assert tbs("TPU v5 lite") == 0.82e12 and tbs("TPU v5p") == 2.76e12 and tbs("TPU v4") == 1.2e12
    assert tbs("TPU v6 lite") == 1.64e12
    unknown = device.peak_bandwidth("NVIDIA A100-SXM4-40GB", "gpu", None)
    assert unknown["bytes_per_s"] is None and "--bandwidth" in unknown["note"]
    cpu = device.peak_bandwidth("cpu", "cpu", None)
    assert cpu["bytes_per_s"] is None and "not meaningful" in cpu["note"]
    assert device.peak_bandwidth("cpu", "cpu", 0.5)["bytes_per_s"] == 0.5e12


def test_bandwidth_measure_and_dtype_options(device):
    """``--bandwidth measure`` takes the device's read rate (a positive, finite bytes/s with its
    source); a bandwidth that is not a positive number, or an unknown ``--dtype``, is refused by the
    parser with one message naming the value; ``--dtype float32`` reaches the settings."""
    m = device.measured_bandwidth(gib=1 / 64, repeats=2)
    assert _positive(m)
    bw = device.peak_bandwidth("cpu", "cpu", "measure")
    assert _positive(bw["bytes_per_s"]) and bw["source"].startswith("measured")
    for bad in ("fast", "0", "-1"):
        with pytest.raises(SystemExit):
            device.parse_args(["--out", "x.json", "--bandwidth", bad])
    with pytest.raises(SystemExit):
        device.parse_args(["--out", "x.json", "--dtype", "int4"])
    a = device.parse_args(["--out", "x.json", "--dtype", "float32", "--bandwidth", "measure"])
    assert a.dtype == "float32" and a.bandwidth == "measure"
    assert device.parse_args(["--out", "x.json", "--bandwidth", "2.5"]).bandwidth == 2.5


def test_overhead_ablations_cpu(tmp_path):
    """``benchmarks/device_overhead.py`` (the per-layer overhead ablations prepared for the next
    accelerator run) on the tiny shape on CPU, default XLA flags only: status complete, a finite
    positive time and compile time for every ablation, the fused attention's implementation named,
    the sampling step timed, and the optimized HLO written with its entry opcodes counted."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    script = os.path.join(ROOT, "benchmarks", "device_overhead.py")
    proc = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--shapes", "tiny", "--variants", "default",
                           "--prompt-len", "24", "--max-new-tokens", "40", "--repeats", "2", "--budget-s", "300"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "overhead-default.json").read_text())
    assert res["status"] == "complete" and res["backend"] == "cpu" and res["dtype"] == "bfloat16"
    sh = res["shapes"]["tiny"]
    assert set(sh["forward_ms"]) == {"blocked", "dense", "fused", "none", "no_row_pad"}
    assert all(_positive(v) for v in sh["forward_ms"].values()), (sh["forward_ms"], sh.get("errors"))
    assert all(_positive(v) for v in sh["compile_s"].values())
    assert sh["fused"]["implementation"] in ("cudnn", "xla") and _positive(sh["sampling_ms"])
    assert sh["entry_opcodes"].get("fusion", 0) > 0 and sh["layers"] == 2
    assert (tmp_path / "hlo-tiny.txt.gz").stat().st_size > 0
    assert sum("tiny " in line for line in proc.stdout.splitlines()) == 6
