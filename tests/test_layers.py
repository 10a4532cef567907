"""GATE (issue 16): imports inside ``specjax/`` run one way — core → models → drafters → runtime →
io → api → eval → train → serve → cli — with no cycle, and nothing outside the CLI imports
``specjax.cli`` (nor, by its rank, anything but the CLI ``specjax.serve``). Every import counts, also those inside functions (read with ``ast``)."""

from __future__ import annotations

import ast
import pathlib


ROOT = pathlib.Path(__file__).resolve().parent.parent / "specjax"
# a module may import its own layer and the layers before it (train may use eval: bench reports)
LAYERS = ["core", "models", "drafters", "runtime", "io", "api", "eval", "train", "serve", "cli"]
RANK = {name: i for i, name in enumerate(LAYERS)}



def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(mod: str) -> str | None:
    parts = mod.split(".")
    if len(parts) < 2:
        return None  # the top-level facade `specjax` (imported by users, never by the package)
    return parts[1] if parts[1] in RANK else None


def imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "specjax"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "specjax":
            for a in node.names:  # `from specjax.x import y` may import the module specjax.x.y
                sub = f"{node.module}.{a.name}"
                out.add(sub if (root.parent / (sub.replace(".", "/") + ".py")).exists()
                        or (root.parent / sub.replace(".", "/")).is_dir() else node.module)
    return out


def graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """``{module: the specjax modules it imports}`` for every ``.py`` file under ``root`` (a package dir)."""
    g = {}
    for path in sorted(root.rglob("*.py")):
        g[module_name(path, root)] = imports(path, root)
    return g


# ------------------------------------------------------------------ the checks (each returns its findings)
def unlayered(g: dict[str, set[str]]) -> list[str]:
    """Modules of no known layer."""
    return sorted(m for m in g if m != "specjax" and layer(m) is None)


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    """Every import of a later layer (or of the top-level package) from inside the package."""
    bad = []
    for mod, deps in g.items():
        if layer(mod) is None:
            continue  # the facade `specjax`; a module of no layer is `unlayered`'s finding
        for d in deps:
            if d == "specjax":
                bad.append(f"{mod} imports the top-level package (import the defining module)")
            elif layer(d) is None or RANK[layer(d)] > RANK[layer(mod)]:
                bad.append(f"{mod} ({layer(mod)}) imports {d} ({layer(d)})")
    return sorted(bad)


def import_cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a self-import)."""
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
    return cycles


def cli_importers(g: dict[str, set[str]]) -> list[str]:
    """Modules outside the CLI that import ``specjax.cli``."""
    return sorted(m for m, deps in g.items()
                  if layer(m) != "cli" and m != "specjax" and any(d.startswith("specjax.cli") for d in deps))


def test_every_module_has_a_layer():
    assert not unlayered(graph())


def test_imports_run_one_way():
    bad = upward_imports(graph())
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    cycles = import_cycles(graph())
    assert not cycles, cycles


def test_nothing_imports_the_cli():
    offenders = cli_importers(graph())
    assert not offenders, offenders


def test_the_check_can_fail(tmp_path):
    """Negative control: the real checks, run on a planted package tree (written to ``tmp_path``),
    report its upward import (also one inside a function, and ``from specjax.runtime import y``),
    its cycle, its import of the CLI and its module of no layer; the same tree without the
    planted imports passes."""
    pkg = tmp_path / "specjax"

    def plant(files: dict[str, str]):
        for rel, text in files.items():
            f = pkg / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text, encoding="utf-8")

    clean = {"__init__.py": "", "core/__init__.py": "", "core/x.py": "import numpy\n",
             "runtime/__init__.py": "", "runtime/y.py": "from specjax.core import x\n",
             "cli/__init__.py": "", "cli/main.py": "import specjax.runtime.y\n"}
    plant(clean)
    g = graph(pkg)
    assert g["specjax.runtime.y"] == {"specjax.core.x"} and g["specjax.cli.main"] == {"specjax.runtime.y"}
    assert not (unlayered(g) or upward_imports(g) or import_cycles(g) or cli_importers(g))

    plant({"core/x.py": "def f():\n    from specjax.runtime import y\n    return y\n",
           "drafters/z.py": "import specjax.cli.main\n", "misc/w.py": ""})
    g = graph(pkg)
    assert upward_imports(g) == ["specjax.core.x (core) imports specjax.runtime.y (runtime)",
                                 "specjax.drafters.z (drafters) imports specjax.cli.main (cli)"]
    assert import_cycles(g) == [["specjax.core.x", "specjax.runtime.y"]]
    assert cli_importers(g) == ["specjax.drafters.z"] and unlayered(g) == ["specjax.misc.w"]


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


def test_every_module_says_what_it_owns():
    """Every module of the package, ``__init__`` included, opens with a docstring (issue 50)."""
    missing = sorted(str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")
                     if not ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))))
    assert not missing, f"modules without a docstring: {missing}"
