"""The notebooks under notebooks/: executed top to bottom with nbclient in small settings
(``SPECJAX_NOTEBOOK_SMALL=1``, copies in tmp_path; the committed files are never touched), and
the committed copies checked for outputs (they are committed executed, with full settings)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

# the test extra (pyproject.toml) installs these: a missing one is an error, not a skip
import ipykernel  # noqa: E402,F401  (the kernel the notebooks run on)
import nbclient  # noqa: E402,F401
import nbformat  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB_DIR = os.path.join(ROOT, "notebooks")
NOTEBOOKS = ["quickstart.ipynb", "speculative_sampling.ipynb"]
CELL_TIMEOUT_S = 300  # per cell
TOTAL_TIMEOUT_S = 900  # both notebooks (they run concurrently)

# Runs in a child process: execute one notebook in place, fail on the first cell error.
_RUNNER = """
import sys, nbformat
from nbclient import NotebookClient
path, timeout = sys.argv[1], int(sys.argv[2])
nb = nbformat.read(path, as_version=4)
try:
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": sys.argv[3]}}).execute()
finally:
    nbformat.write(nb, path)
"""


def _load(name):
    return nbformat.read(os.path.join(NB_DIR, name), as_version=4)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Both notebooks executed concurrently (small settings): ``{name: (returncode, log, nb, seconds)}``."""
    tmp = tmp_path_factory.mktemp("notebooks")
    env = dict(os.environ, SPECJAX_NOTEBOOK_SMALL="1", HF_HUB_OFFLINE="1", MPLBACKEND="module://matplotlib_inline.backend_inline")
    # the test suite's persistent compilation cache (tests/conftest.py), read by the kernels through JAX_* variables
    cache = os.path.abspath(os.environ.get("SPECJAX_TEST_CACHE", os.path.join(ROOT, ".jax_cache")))
    env.setdefault("JAX_COMPILATION_CACHE_DIR", cache)
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    def start(name):
        dst = tmp / name
        shutil.copy(os.path.join(NB_DIR, name), dst)
        return dst, time.perf_counter(), subprocess.Popen(
            [sys.executable, "-c", _RUNNER, str(dst), str(CELL_TIMEOUT_S), str(tmp)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finish(dst, t0, proc):
        try:
            log, _ = proc.communicate(timeout=TOTAL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            log, _ = proc.communicate()
            log = f"timed out after {TOTAL_TIMEOUT_S} s\n" + log
        return proc.returncode, log, nbformat.read(str(dst), as_version=4), time.perf_counter() - t0

    procs = {name: start(name) for name in NOTEBOOKS}
    out = {}
    for name, run in procs.items():
        out[name] = finish(*run)
        # two kernels starting at once can race for the same free port (jupyter_client picks ports,
        # then the kernel binds them): that kernel never ran a cell, so it is started once more
        if out[name][0] != 0 and "Address already in use" in out[name][1]:
            out[name] = finish(*start(name))
    return out


# Absolute local paths (a checkout, temp dirs, home directories, Colab's /content, installed
# packages) must not appear in saved outputs; URLs (…github.com/…) are not matched.
_LOCAL_PATH = re.compile(r"(?<![\w.:/~-])/(?:work|tmp|root|home|Users|usr|opt|var|private|content|mnt)/|"
                         r"site-packages|dist-packages|[A-Za-z]:\\Users")


def _local_paths(nb):
    """``[(cell index, match)]`` in the text of every output (images are skipped)."""
    found = []
    for i, c in enumerate(nb.cells):
        for o in c.get("outputs", []) if c.cell_type == "code" else []:
            texts = [o.get("text", "")] + list(o.get("traceback", []))
            texts += [v for k, v in o.get("data", {}).items() if k.startswith("text/")]
            for t in texts:
                t = "".join(t) if isinstance(t, list) else str(t)
                found += [(i, t[max(0, m.start() - 40): m.end() + 40]) for m in _LOCAL_PATH.finditer(t)]
    return found


def _errors(nb):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes_small(executed, name):
    rc, log, nb, seconds = executed[name]
    errs = _errors(nb)
    assert rc == 0 and not errs, f"{name} failed (exit {rc}, {seconds:.0f} s):\n{log[-6000:]}\n" + "\n".join(
        f"{e.get('ename')}: {e.get('evalue')}" for e in errs)
    for i, c in enumerate(nb.cells):
        if c.cell_type == "code":
            assert c.get("outputs"), f"{name}: code cell {i} produced no output in small settings"
    assert not _local_paths(nb), f"{name}: outputs print absolute local paths: {_local_paths(nb)}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_has_outputs(name):
    nb = _load(name)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and (
        f"colab.research.google.com/github/specjax-dev/specjax/blob/main/notebooks/{name}" in first.source)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{name} has no code cells"
    for i, c in enumerate(code):
        assert c.get("outputs"), f"{name}: code cell {i} has no committed output (commit the notebook executed)"
        assert c.get("execution_count") is not None, f"{name}: code cell {i} was not executed"
    assert not _errors(nb), f"{name}: the committed notebook contains error outputs"
    assert not _local_paths(nb), f"{name}: saved outputs contain absolute local paths: {_local_paths(nb)}"
    pngs = [o for c in code for o in c["outputs"] if "image/png" in o.get("data", {})]
    assert pngs, f"{name}: no image/png output (plots must be committed inline)"
    assert "SPECJAX_NOTEBOOK_SMALL" in "".join(c.source for c in code)
