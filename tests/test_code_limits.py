"""The code's sizes and seams, checked statically (``ast``; nothing is imported or run):

- every module of ``specjax/`` has at most :data:`MAX_MODULE_LINES` lines and every function or
  method at most :data:`MAX_FUNCTION_LINES` (its ``def`` line to its last line);
- no private name (``_name``, not a dunder) is used across modules, in ``specjax/`` and ``tests/``
  (:func:`private_violations`: imports, attribute reads and writes, the string forms of
  ``monkeypatch`` / ``setattr`` / ``getattr`` / ``mock.patch``): a name another module needs is
  given a public seam;
- drafters are told apart by their ``--draft`` strings only in :data:`REGISTRY`
  (:func:`dispatch_violations`); everything else asks the registry.

Each rule is a small function ``*_violations(path, source) -> list[str]`` run over the real files
and, in :func:`test_checkers_report_planted_violations`, over planted sources that break each rule
once, so that no rule passes by checking nothing.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
REGISTRY = "specjax/drafters/registry.py"

# private attributes of other libraries' objects that have no public spelling
ALLOWED_PRIVATE = {
    ("os", "_exit"),  # exit without cleanup (a child process, a signal handler)
    ("sys", "_getframe"),
}
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}  # public, underscored

# a --draft string that names a drafter kind (see specjax/drafters/registry.py)
KIND_WORDS = {"ngram", "default", "shipped"}
KIND_PREFIXES = ("ngram", "shipped")


def sources(*tops: str) -> list[tuple[str, str]]:
    """``(path relative to the repository, source)`` of every ``.py`` file under ``tops``."""
    return [(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8"))
            for top in tops for p in sorted((ROOT / top).rglob("*.py"))]


@functools.lru_cache(maxsize=None)
def _tree(source: str) -> ast.Module:
    return ast.parse(source)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name != "_"


# --------------------------------------------------------------------------- sizes
def module_violations(path: str, source: str, limit: int = MAX_MODULE_LINES) -> list[str]:
    """The module itself, when it has more than ``limit`` lines."""
    n = len(source.splitlines())
    return [f"{path}: {n} lines (at most {limit})"] if n > limit else []


def function_violations(path: str, source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function or method (nested ones too) longer than ``limit`` lines, ``def`` line to last line."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = child.end_lineno - child.lineno + 1
                if n > limit:
                    out.append(f"{path}:{child.lineno}: {prefix}{child.name} has {n} lines (at most {limit})")
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(_tree(source), "")
    return out


# --------------------------------------------------------------------------- private names
def defined_names(tree: ast.Module) -> set[str]:
    """The names a module defines: its functions, classes and methods, the names it assigns
    (module, class or local), and the attributes it assigns on any object (``self._x = …``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
    return names


def _literal(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _call_name(node: ast.Call) -> str:
    """``monkeypatch.setattr`` → ``"setattr"``, ``mock.patch.object`` → ``"patch.object"``, ``getattr`` → ``"getattr"``."""
    f = node.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        if isinstance(f.value, ast.Attribute) and f.value.attr == "patch":
            return f"patch.{f.attr}"
        return f.attr
    return ""


def _string_target_violation(node: ast.Call, defined: set[str]) -> str | None:
    """The private name a ``setattr``-like call names by a string, or None."""
    name = _call_name(node)
    args = node.args
    if name in ("setattr", "delattr", "getattr", "hasattr", "patch.object") and len(args) >= 2:
        attr = _literal(args[1])
        if attr is not None and _is_private(attr) and attr not in defined:
            return attr
    if name in ("setattr", "delattr", "patch") and args:
        dotted = _literal(args[0])
        if dotted is not None and "." in dotted and " " not in dotted:
            private = [p for p in dotted.split(".")[1:] if _is_private(p)]
            if private:
                return dotted
    return None


def private_violations(path: str, source: str) -> list[str]:
    """Private names (``_x``, not dunders) this module uses from another module:

    - ``from M import _x`` (any module M), and a private module of specjax (``from specjax._m import
      x``, ``import specjax._m``; a third-party library's private modules, ``jax._src``, are its own);
    - ``X._x`` (read, write or delete) for ``X`` other than ``self`` / ``cls``, unless this module
      defines ``_x`` itself (:func:`defined_names`: its own class's private attribute on another
      instance is fine); allowed: :data:`ALLOWED_PRIVATE`, namedtuple's :data:`NAMEDTUPLE_API`;
    - the string forms: ``setattr(X, "_x", …)``, ``getattr`` / ``hasattr`` / ``delattr``,
      ``monkeypatch.setattr(X, "_x", …)``, ``mock.patch.object(X, "_x")`` (``_x`` not defined here),
      and ``monkeypatch.setattr("pkg.mod._x", …)`` / ``mock.patch("pkg.mod._x")``.
    """
    tree = _tree(source)
    defined = defined_names(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = f"{'.' * node.level}{node.module or ''}"
            ours = node.level > 0 or module.split(".")[0] == "specjax"
            for a in node.names:
                if _is_private(a.name) or (ours and any(_is_private(m) for m in module.lstrip(".").split("."))):
                    out.append(f"{path}:{node.lineno}: from {module} import {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "specjax" and any(_is_private(m) for m in a.name.split(".")):
                    out.append(f"{path}:{node.lineno}: import {a.name}")
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if node.attr in defined or node.attr in NAMEDTUPLE_API:
                continue
            if isinstance(base, ast.Name) and (base.id, node.attr) in ALLOWED_PRIVATE:
                continue
            out.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call):
            hit = _string_target_violation(node, defined)
            if hit is not None:
                out.append(f"{path}:{node.lineno}: {_call_name(node)}(… {hit!r} …)")
    return sorted(set(out), key=lambda s: (int(s.split(":")[1]), s))


# --------------------------------------------------------------------------- drafter dispatch
def _operand_name(node) -> str:
    """The name an operand is known by: ``spec``, ``args.draft`` → ``draft``, ``s["draft"]`` → ``draft``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        key = _literal(node.slice)
        return key if key is not None else _operand_name(node.value)
    if isinstance(node, ast.Call):
        return _operand_name(node.func)
    return ""


def _literals(node) -> list[str]:
    """The string literals of a constant, or of a tuple / list / set of them."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _literals(e)]
    s = _literal(node)
    return [] if s is None else [s]


def _names_kind(s: str) -> bool:
    return s in KIND_WORDS or s.startswith(tuple(f"{p}:" for p in KIND_PREFIXES))


def dispatch_violations(path: str, source: str) -> list[str]:
    """Drafter dispatch by ``--draft`` string outside :data:`REGISTRY` (which is exempt):

    - ``X.startswith(…)`` / ``X.endswith(…)`` / ``X.removeprefix(…)`` with a literal ``"ngram"``,
      ``"default"``, ``"shipped"`` or one that begins ``"ngram:"`` / ``"shipped:"``
      (``spec.startswith("ngram:")``, ``spec.startswith("shipped:")``; not ``"shipped_"``, a directory);
    - a comparison (``==``, ``!=``, ``in``, ``not in``) of a literal ``"ngram:…"`` / ``"shipped:…"``
      with anything;
    - a comparison of ``"ngram"``, ``"default"`` or ``"shipped"`` (alone or in a tuple / list / set) with
      an operand named like a drafter spec (a name, attribute or string key containing ``spec`` or
      ``draft``: ``spec == "ngram"``, ``args.draft in ("default", …)``, ``s["draft"] == "default"``).

    ``"none"`` (no drafter at all) is not a kind and is not checked; nor is ``kind.name == "ngram"``
    (a kind the registry returned)."""
    if path == REGISTRY:
        return []
    out = []
    for node in ast.walk(_tree(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("startswith", "endswith", "removeprefix") and node.args:
            if any(_names_kind(s) for s in _literals(node.args[0])):
                out.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, op in enumerate(node.ops):
                if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                    continue
                pair = operands[i], operands[i + 1]
                for lit_side, other in (pair, pair[::-1]):
                    lits = _literals(lit_side)
                    named = any(w in _operand_name(other).lower() for w in ("spec", "draft"))
                    if any(s.startswith(tuple(f"{p}:" for p in KIND_PREFIXES)) for s in lits) \
                            or (named and any(_names_kind(s) for s in lits)):
                        out.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
                        break
    return sorted(set(out), key=lambda s: (int(s.split(":")[1]), s))


# --------------------------------------------------------------------------- the checks
def _all(check, *tops) -> list[str]:
    return [v for path, src in sources(*tops) for v in check(path, src)]


def _none(check, *tops) -> None:
    found = _all(check, *tops)
    assert not found, f"{len(found)} violation(s):\n" + "\n".join(found)


def test_the_checks_see_the_code():
    files = dict(sources("specjax", "tests"))
    assert len([p for p in files if p.startswith("specjax/")]) > 50
    assert REGISTRY in files and "specjax/runtime/decoder.py" in files and "tests/test_code_limits.py" in files


def test_modules_have_at_most_600_lines():
    _none(module_violations, "specjax")


def test_functions_have_at_most_80_lines():
    _none(function_violations, "specjax")


def test_no_private_name_is_used_across_modules():
    _none(private_violations, "specjax", "tests")


def test_drafters_are_told_apart_by_spec_only_in_the_registry():
    _none(dispatch_violations, "specjax")


PLANTED_FUNCTION = "def long():\n" + "    x = 1\n" * 80 + "\n\ndef short():\n    return 1\n"
PLANTED_PRIVATE = '''\
from specjax.runtime.decoder import _get, Decoder
from specjax.runtime import loop, _hidden


class Mine:
    def __init__(self):
        self._own = 1

    def same(self, other):
        return other._own  # this module's own attribute: fine


def use(dec, monkeypatch):
    dec._compiled = {}
    loop._round(None)
    monkeypatch.setattr(dec, "_program", None)
    monkeypatch.setattr("specjax.runtime.decoder._check_gamma", None)
    return getattr(dec, "_spare"), dec.__class__, os._exit, row._replace(a=1)
'''
PLANTED_DISPATCH = '''\
def label(spec, args, s, kind):
    if spec.startswith("ngram"):
        return 1
    if spec == "ngram" or args.draft in ("default", "none"):
        return 2
    if s["draft"] == "shipped:block" or "shipped:x" == name:
        return 3
    if kind.name == "ngram" or spec in (None, "none") or rope == "default" or d.startswith("shipped_"):
        return 4  # not dispatch on a spec string
'''


def test_checkers_report_planted_violations():
    assert module_violations("m.py", "x = 1\n" * 601) == ["m.py: 601 lines (at most 600)"]
    assert module_violations("m.py", "x = 1\n" * 600) == []
    assert function_violations("m.py", PLANTED_FUNCTION) == ["m.py:1: long has 81 lines (at most 80)"]
    method = "class C:\n    def m(self):\n" + "        x = 1\n" * 80
    assert function_violations("m.py", method) == ["m.py:2: C.m has 81 lines (at most 80)"]
    assert function_violations("m.py", "def f():\n" + "    x = 1\n" * 79) == []

    got = private_violations("t.py", PLANTED_PRIVATE)
    assert got == [
        "t.py:1: from specjax.runtime.decoder import _get",
        "t.py:2: from specjax.runtime import _hidden",
        "t.py:14: dec._compiled",
        "t.py:15: loop._round",
        "t.py:16: setattr(… '_program' …)",
        "t.py:17: setattr(… 'specjax.runtime.decoder._check_gamma' …)",
        "t.py:18: getattr(… '_spare' …)",
    ], got

    got = dispatch_violations("specjax/eval/x.py", PLANTED_DISPATCH)
    assert [v.split(":")[1] for v in got] == ["2", "4", "4", "6", "6"], got
    assert dispatch_violations(REGISTRY, PLANTED_DISPATCH) == []


@pytest.mark.parametrize("source", ["import os\nos._exit(0)\n", "import sys\nsys._getframe(1)\n",
                                    "p = q._replace(a=1)._asdict()\n", "class A:\n    def f(self):\n"
                                    "        return self._x, cls._y\n"])
def test_allowed_private_uses(source):
    assert private_violations("t.py", source) == []
