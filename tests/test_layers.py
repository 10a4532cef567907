"""GATE (issue 16): imports inside ``specjax/`` run one way — core → models → drafters → runtime →
io → api → eval → train → cli — with no cycle, and nothing outside the CLI imports
``specjax.cli``. Every import counts, also those inside functions (read with ``ast``)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "specjax"
# a module may import its own layer and the layers before it (train may use eval: bench reports)
LAYERS = ["core", "models", "drafters", "runtime", "io", "api", "eval", "train", "cli"]
RANK = {name: i for i, name in enumerate(LAYERS)}



def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(mod: str) -> str | None:
    parts = mod.split(".")
    if len(parts) < 2:
        return None  # the top-level facade `specjax` (imported by users, never by the package)
    return parts[1] if parts[1] in RANK else None


def imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "specjax"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "specjax":
            for a in node.names:  # `from specjax.x import y` may import the module specjax.x.y
                sub = f"{node.module}.{a.name}"
                out.add(sub if (ROOT.parent / (sub.replace(".", "/") + ".py")).exists()
                        or (ROOT.parent / sub.replace(".", "/")).is_dir() else node.module)
    return out


def graph() -> dict[str, set[str]]:
    g = {}
    for path in sorted(ROOT.rglob("*.py")):
        g[module_name(path)] = imports(path)
    return g


def test_every_module_has_a_layer():
    assert all(layer(m) is not None for m in graph() if m != "specjax"), \
        [m for m in graph() if m != "specjax" and layer(m) is None]


def test_imports_run_one_way():
    bad = []
    for mod, deps in graph().items():
        if mod == "specjax":
            continue
        for d in deps:
            if d == "specjax":
                bad.append(f"{mod} imports the top-level package (import the defining module)")
            elif RANK[layer(d)] > RANK[layer(mod)]:
                bad.append(f"{mod} ({layer(mod)}) imports {d} ({layer(d)})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles():
    g = graph()
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in g.get(v, ()):
                cycles.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_nothing_imports_the_cli():
    offenders = [m for m, deps in graph().items()
                 if layer(m) != "cli" and m != "specjax" and any(d.startswith("specjax.cli") for d in deps)]
    assert not offenders, offenders


@pytest.mark.parametrize("bad", [{"specjax.core.x": {"specjax.runtime.y"}}])
def test_the_check_can_fail(bad):
    """Negative control: an upward import is reported."""
    (mod, deps), = bad.items()
    assert any(RANK[layer(d)] > RANK[layer(mod)] for d in deps)


def test_design_doc_lists_every_module():
    """docs/design.md's layer picture names every module of the package (so it cannot drift)."""
    doc = (ROOT.parent / "docs" / "design.md").read_text(encoding="utf-8")
    missing = [m for m in graph() if m != "specjax" and not m.endswith("__main__")
               and f"{m.split('.', 1)[1].replace('.', '/')}" not in doc]
    assert not missing, f"docs/design.md does not name: {missing}"
