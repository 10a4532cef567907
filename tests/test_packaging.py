"""Packaging: every third-party module that specjax imports (anywhere in specjax/, imports
inside functions included) is a declared runtime dependency in pyproject.toml, so that
``pip install -e .`` without the test extra is enough for the README's quick start. The one
exception is the server package ``specjax/serve/``: its imports may come from the ``serve``
extra instead (``pip install "specjax[serve]"``), which the ``test`` extra includes."""

from __future__ import annotations

import ast
import importlib.metadata as md
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIRST_PARTY = {"specjax"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_top_level_modules(package_dir: pathlib.Path) -> dict[str, set[str]]:
    """``{top-level module: {files importing it}}`` for absolute imports in ``package_dir``."""
    found: dict[str, set[str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for n in names:
                found.setdefault(n.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def declared_runtime_dependencies() -> set[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return {_norm(re.match(r"\s*([A-Za-z0-9_.\-]+)", d).group(1)) for d in deps}


def extra_dependencies(name: str) -> set[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["optional-dependencies"][name]
    return {_norm(re.match(r"\s*([A-Za-z0-9_.\-]+)", d).group(1)) for d in deps}


SERVE_DIR = "specjax/serve/"


def undeclared_imports(declared: set[str], serve_extra: set[str] | None = None) -> list[str]:
    """Problems, one line each: third-party modules imported by specjax whose distribution
    is not in ``declared`` (or is not installed, so it cannot be mapped). A module imported only
    under ``specjax/serve/`` may come from ``serve_extra`` instead (default: the ``serve`` extra)."""
    serve_extra = extra_dependencies("serve") if serve_extra is None else serve_extra
    dists = md.packages_distributions()
    problems = []
    for mod, files in sorted(imported_top_level_modules(ROOT / "specjax").items()):
        if mod in FIRST_PARTY or mod in sys.stdlib_module_names:
            continue
        provided_by = {_norm(d) for d in dists.get(mod, [])}
        where = ", ".join(sorted(files))
        if not provided_by:
            problems.append(f"{mod} (imported in {where}) is not installed: cannot map it to a distribution")
        elif not provided_by & declared and not (all(f.startswith(SERVE_DIR) for f in files)
                                                 and provided_by & serve_extra):
            problems.append(f"{mod} (imported in {where}) comes from {sorted(provided_by)}, "
                            "which is not in [project] dependencies of pyproject.toml")
    return problems


def test_walker_sees_imports_inside_functions():
    mods = imported_top_level_modules(ROOT / "specjax")
    # jinja2 is imported only inside a method (the chat template): the walker must see it
    assert "specjax/io/tokenizer.py" in mods["jinja2"]
    assert "jax" in mods and "numpy" in mods


def test_every_third_party_import_is_a_runtime_dependency():
    problems = undeclared_imports(declared_runtime_dependencies())
    assert not problems, "\n".join(problems)


def test_check_fails_when_a_dependency_is_removed():
    declared = declared_runtime_dependencies()
    assert "jinja2" in declared
    problems = undeclared_imports(declared - {"jinja2"})
    assert len(problems) == 1 and problems[0].startswith("jinja2 ")


def test_serve_imports_need_the_serve_extra_and_only_there():
    mods = imported_top_level_modules(ROOT / "specjax")
    assert {"starlette", "uvicorn", "prometheus_client"} <= set(mods)
    # only specjax/serve/ may import them (the CLI imports specjax.serve lazily, after checking the extra)
    for m in ("starlette", "uvicorn", "prometheus_client"):
        assert all(f.startswith(SERVE_DIR) for f in mods[m]), (m, mods[m])
    problems = undeclared_imports(declared_runtime_dependencies(), serve_extra=set())
    assert sorted(p.split()[0] for p in problems) == ["prometheus_client", "starlette", "uvicorn"]
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extra_dependencies("serve") <= extra_dependencies("test")  # CI's pip install -e ".[test]" gets them
    assert "openai" in {_norm(re.match(r"\s*([A-Za-z0-9_.\-]+)", d).group(1)) for d in extras["test"]}
