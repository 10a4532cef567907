"""Packaging: every third-party module that specjax imports (anywhere in specjax/, imports
inside functions included) is a declared runtime dependency in pyproject.toml, so that
``pip install -e .`` without the test extra is enough for the README's quick start."""

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


def undeclared_imports(declared: set[str]) -> list[str]:
    """Problems, one line each: third-party modules imported by specjax whose distribution
    is not in ``declared`` (or is not installed, so it cannot be mapped)."""
    dists = md.packages_distributions()
    problems = []
    for mod, files in sorted(imported_top_level_modules(ROOT / "specjax").items()):
        if mod in FIRST_PARTY or mod in sys.stdlib_module_names:
            continue
        provided_by = {_norm(d) for d in dists.get(mod, [])}
        where = ", ".join(sorted(files))
        if not provided_by:
            problems.append(f"{mod} (imported in {where}) is not installed: cannot map it to a distribution")
        elif not provided_by & declared:
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
