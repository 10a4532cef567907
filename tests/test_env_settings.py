"""Environment variables are settings (issue 50): every one specjax reads is declared once in
:mod:`specjax.core.env`; a value a variable does not accept is one line ``specjax: error: …`` naming
the variable, the value and what it accepts (exit status 2); ``SPECJAX_NO_CACHE=0`` keeps the caches
on; a ``JAX_PLATFORMS`` backend this host lacks is one line too; the README's table is the declaration's."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from specjax.core import env

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "specjax"



@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in env.VARS:
        if name.startswith("SPECJAX_"):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")  # keep the test session's compilation cache


def _bad_values(var: env.Var) -> list[str]:
    if var.kind == "flag":
        return ["maybe", "2"]
    if var.kind == "int":
        out = ["abc", "1.5"]
        if var.minimum is not None:
            out.append(str(var.minimum - 1))
        if var.maximum is not None:
            out.append(str(var.maximum + 1))
        return out
    if var.kind == "choice":
        return ["foo"]
    return []


_BAD = [(name, bad) for name, var in env.VARS.items() for bad in _bad_values(var)]


def _cli(argv, capsys):
    from specjax.cli import main

    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# ------------------------------------------------------------------ the declaration
def test_parse_kinds():
    flag = env.VARS["SPECJAX_NO_CACHE"]
    for raw in ("1", "true", "YES", " on "):
        assert flag.parse(raw) is True
    for raw in ("0", "false", "No", "off"):
        assert flag.parse(raw) is False
    assert flag.parse("") is False and flag.parse(None) is False and flag.parse("  ") is False
    threads = env.VARS["SPECJAX_Q8_THREADS"]
    assert threads.parse("3") == 3 and threads.parse(None) is None
    assert env.VARS["SPECJAX_ATTENTION"].parse("XLA") == "xla"
    assert env.VARS["SPECJAX_ATTENTION"].parse("") == "auto"
    assert env.VARS["SPECJAX_CACHE_DIR"].parse("~/x") == os.path.expanduser("~/x")


@pytest.mark.parametrize("name,bad", _BAD)
def test_a_bad_value_is_one_line_error(name, bad):
    with pytest.raises(env.EnvError) as e:
        env.get(name, {name: bad})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{name}={bad!r} is not ") and "unset it or" in msg, msg
    assert isinstance(e.value, ValueError) and e.value.name == name and e.value.value == bad


def test_the_messages_name_the_fix():
    with pytest.raises(env.EnvError, match=r"^SPECJAX_Q8_THREADS='abc' is not an integer >= 1; unset it or give "
                                           r"a thread count like SPECJAX_Q8_THREADS=2$"):
        env.get("SPECJAX_Q8_THREADS", {"SPECJAX_Q8_THREADS": "abc"})
    with pytest.raises(env.EnvError, match=r"^SPECJAX_ATTENTION='foo' is not one of auto, xla; unset it or set "
                                           r"SPECJAX_ATTENTION=auto or SPECJAX_ATTENTION=xla$"):
        env.get("SPECJAX_ATTENTION", {"SPECJAX_ATTENTION": "foo"})


def test_an_undeclared_name_is_a_programming_error():
    with pytest.raises(KeyError, match="not declared"):
        env.get("SPECJAX_NOT_A_VARIABLE")


def test_every_specjax_name_in_the_source_is_declared():
    """Every ``SPECJAX_…`` name in specjax/ (Python, C++ sources and headers) is declared."""
    found: dict[str, str] = {}
    for path in sorted(SRC.rglob("*")):
        if path.suffix in (".py", ".cc", ".h") and path.is_file():
            for name in re.findall(r"\bSPECJAX_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(encoding="utf-8")):
                found.setdefault(name, str(path.relative_to(ROOT)))
    assert found, "the scan found nothing"
    missing = {n: where for n, where in found.items() if n not in env.VARS}
    assert not missing, f"SPECJAX_ variables used but not declared in specjax/core/env.py: {missing}"
    stale = sorted(n for n, v in env.VARS.items() if n.startswith("SPECJAX_") and n not in found)
    assert not stale, f"declared but never used in specjax/: {stale}"


def test_python_reads_go_through_the_declaration():
    """No module but specjax/core/env.py reads a ``SPECJAX_`` variable from ``os.environ`` itself."""
    direct = re.compile(r"""(?:os\.environ\.get|os\.getenv|os\.environ\[)\(?\s*["'](SPECJAX_\w+)["']""")
    found = set()
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel == "specjax/core/env.py":
            continue
        for name in direct.findall(path.read_text(encoding="utf-8")):
            found.add((rel, name))
    assert not found, f"direct reads (use specjax.core.env.get): {sorted(found)}"


def test_the_readme_table_is_the_declaration():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in env.VARS:
        assert f"`{name}`" in readme, f"README.md does not document {name}"
    assert env.markdown_table() in readme, ("README.md's environment table differs from specjax/core/env.py: "
                                            "paste specjax.core.env.markdown_table()'s output")


# ------------------------------------------------------------------ the command line
@pytest.mark.parametrize("name,bad", [(n, b) for n, b in _BAD if b in ("maybe", "abc", "foo")])
def test_the_cli_refuses_a_bad_value_in_one_line(name, bad, monkeypatch, capsys):
    monkeypatch.setenv(name, bad)
    rc, out, err = _cli(["analyze", "--alpha", "0.8", "--c", "0.1"], capsys)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"specjax: error: {name}={bad!r} is not "), err


def test_no_cache_0_keeps_the_caches_on(monkeypatch, capsys, tmp_path):
    from specjax import cli
    from specjax.eval import hostcache
    from specjax.io import convcache
    from specjax.runtime import programs

    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(cli, "enable_compilation_cache", lambda *a: calls.append(a) or False)
    for value, on in (("0", True), ("false", True), ("off", True), ("", True), ("1", False), ("yes", False)):
        monkeypatch.setenv("SPECJAX_NO_CACHE", value)
        calls.clear()
        rc, out, err = _cli(["analyze", "--alpha", "0.8", "--c", "0.1"], capsys)
        assert rc == 0, err
        assert bool(calls) == on, (value, calls)
        assert convcache.enabled() == on, value
        assert (hostcache.default_cache() is not None) == on, value
        programs.enable(str(tmp_path / "programs"))  # (main() disables it when the command returns)
        try:
            assert (programs.directory() is not None) == on, value
        finally:
            programs.disable()
    monkeypatch.setenv("SPECJAX_NO_CACHE", "0")
    monkeypatch.setenv("SPECJAX_NO_PROGRAM_CACHE", "0")
    programs.enable(str(tmp_path / "programs"))
    try:
        assert programs.directory() == str(tmp_path / "programs")
        monkeypatch.setenv("SPECJAX_NO_PROGRAM_CACHE", "1")
        assert programs.directory() is None and convcache.enabled()
    finally:
        programs.disable()


def test_q8_threads(monkeypatch):
    from specjax.models import q8

    monkeypatch.setenv("SPECJAX_Q8_THREADS", "3")
    assert q8.default_threads() == 3
    monkeypatch.setenv("SPECJAX_Q8_THREADS", "")
    assert 1 <= q8.default_threads() <= 8
    monkeypatch.setenv("SPECJAX_Q8_THREADS", "0")
    with pytest.raises(env.EnvError, match="SPECJAX_Q8_THREADS='0'"):
        q8.default_threads()


def test_attention_env(monkeypatch):
    from specjax.models import cpu_attention

    monkeypatch.setenv("SPECJAX_ATTENTION", "xla")
    assert not cpu_attention.enabled() and not cpu_attention.planned()  # decided before any build
    monkeypatch.setenv("SPECJAX_ATTENTION", "foo")
    with pytest.raises(env.EnvError, match="SPECJAX_ATTENTION='foo'"):
        cpu_attention.enabled()


def test_backend_error_lines(monkeypatch):
    from specjax.cli.errors import backend_error

    e = RuntimeError("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: no such file "
                     "(set JAX_PLATFORMS='' to automatically choose an available backend)")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert backend_error(e) is None  # JAX_PLATFORMS unset: not this error
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert backend_error(e) == ("JAX_PLATFORMS=tpu but JAX cannot start the tpu backend here (INTERNAL: Failed to "
                                "open libtpu.so: no such file); unset JAX_PLATFORMS (or set JAX_PLATFORMS=cpu) or "
                                "install jax[tpu]")
    assert backend_error(RuntimeError("something else")) is None
    assert backend_error(AssertionError()) is None  # not raised by jax's backend start


def _cuda_here() -> bool:
    try:
        from jax._src import hardware_utils

        return hardware_utils.has_visible_nvidia_gpu()
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.parametrize("platforms,expect", [
    ("cuda", r"JAX_PLATFORMS=cuda but no CUDA backend is available here \(.+\); unset JAX_PLATFORMS .*jax\[cuda12\]"),
    ("foo", r"JAX_PLATFORMS=foo but JAX cannot start the foo backend here \(.+\); unset JAX_PLATFORMS"),
])
def test_jax_platforms_without_that_backend_is_one_line(platforms, expect):
    """``JAX_PLATFORMS=cuda specjax generate`` on a host without CUDA ended in a bare AssertionError
    traceback (JAX skips cuda without a visible GPU, then asserts it found a backend)."""
    if platforms == "cuda" and _cuda_here():
        pytest.skip("this host has an NVIDIA GPU: JAX_PLATFORMS=cuda may well work")
    e = {k: v for k, v in os.environ.items() if not k.startswith("SPECJAX_")}
    e.update(JAX_PLATFORMS=platforms, SPECJAX_NO_CACHE="1", SPECJAX_NO_PROGRESS="1", PYTHONPATH=str(ROOT))
    code = "import sys; from specjax.cli import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "generate", "hi", "--max-new-tokens", "2"], env=e,
                       capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("specjax: error: "), r.stderr[-2000:]
    assert re.search(expect, lines[0]), lines[0]
    assert "Traceback" not in r.stderr
