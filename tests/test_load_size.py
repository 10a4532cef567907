"""Issue 29's gate: loading at size. A random-weight Llama checkpoint of 1.24 B parameters
(Llama-3.2-1B's shape, bfloat16 safetensors in 5 shards with an index; written by
``benchmarks/load_size.py``'s :func:`write_checkpoint` from a seeded generator, 2.5 GB under the
temporary directory, deleted after the module) is loaded in a fresh subprocess, and the load's
peak anonymous host memory (peak ``RssAnon`` minus the process's before the load; the script's
docstring says why not ``ru_maxrss``) must stay ≤ 1.5 × the loaded model's bytes in its final format:

* int8 on one device (each tensor quantized in blocks: no float32 copy of the embedding);
* bfloat16 on 8 virtual CPU devices, ``mesh="data=1,model=8"`` (each tensor straight into its
  sharding).

Gate phase only (``-m gate_matrix``, ``.ci/run``): about a minute (BENCHMARKS.md, issue 29).
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

pytestmark = pytest.mark.gate_matrix

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "load_size.py")
LIMIT = 1.5  # peak host memory of the load / the loaded model's bytes


def _script():
    spec = importlib.util.spec_from_file_location("load_size", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``(script module, directory)`` of the 1.24 B checkpoint; deleted after the module."""
    mod = _script()
    path = str(tmp_path_factory.mktemp("load_size") / "llama-1b-random")
    try:
        assert mod.write_checkpoint(path) >= 1_000_000_000
        yield mod, path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("case", ["int8", "bf16-mesh8"])
def test_loading_a_1b_checkpoint_peaks_below_one_and_a_half_models(checkpoint, case):
    mod, path = checkpoint
    r = mod.run_case(path, case, timeout=600)
    want_devices = mod.CASES[case][1]
    assert r["devices"] == want_devices
    assert r["device_gb"] >= r["model_gb"] > 1.2, r  # every parameter is on the devices
    assert r["load_peak_gb"] <= LIMIT * r["model_gb"], (
        f"{case}: the load's peak anonymous memory {r['load_peak_gb']} GB > {LIMIT} x the model's "
        f"{r['model_gb']} GB ({r})")
