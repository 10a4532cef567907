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
    import re

    doc = (ROOT.parent / "docs" / "design.md").read_text(encoding="utf-8")
    block = doc.split("## Layers", 1)[1].split("```")[1]
    named, section = set(), None
    for line in block.splitlines():
        top = re.match(r"^(\w+)(/|\.py)\s", line + " ")
        if top:
            section = top.group(1) if top.group(2) == "/" else None
            if top.group(2) == ".py":
                named.add(top.group(1))
            continue
        sub = re.match(r"^\s+(\w+)\.py\s", line + " ")
        if sub and section:
            named.add(f"{section}/{sub.group(1)}")
    modules = {m.split(".", 1)[1].replace(".", "/") for m in graph() if m != "specjax"}
    modules = {m + ("/__init__" if (ROOT / m).is_dir() else "") for m in modules}
    empty = {m for m in modules if m.endswith("__init__") and not (ROOT / (m + ".py")).read_text().strip()}
    missing = sorted(m for m in modules - empty if not m.endswith("__main__") and m not in named)
    assert not missing, f"docs/design.md does not name: {missing}"
    stale = sorted(n for n in named if n not in modules)
    assert not stale, f"docs/design.md names modules that do not exist: {stale}"
