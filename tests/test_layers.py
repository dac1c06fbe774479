"""The layer table of DESIGN.md holds: a package imports only packages below it (or its
own layer), and the framework never imports the demo (only entry points may)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "nemo_tlt"
# bottom to top; utilities at the bottom; entry points (cli, bench, plan) on top
LAYERS = [
    {"checks", "atomic", "imports", "registry", "optim", "device", "structured"},
    {"model"}, {"speculative"}, {"drafter"}, {"adaptive"}, {"rollout"}, {"dist"}, {"spot"}, {"weights"},
    {"algorithms"}, {"megatron"}, {"policy"}, {"config"}, {"rl"}, {"demo"}, {"integrations"},
    {"cli", "train", "convert", "bench", "plan", "first_drafter", "selfcheck"},
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def _unit(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("nemo_tlt.")}


def _files():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        unit = rel.parts[0].removesuffix(".py")
        if unit in ("__init__", "__main__"):
            continue
        yield path, unit


def test_every_package_has_a_layer():
    assert {unit for _, unit in _files()} <= set(LEVEL), sorted({u for _, u in _files()} - set(LEVEL))


def test_imports_only_point_down():
    upward = []
    for path, unit in _files():
        for module in _imports(path):
            target = _unit(module)
            if target in LEVEL and LEVEL[target] > LEVEL[unit]:
                upward.append(f"{path.relative_to(ROOT.parent)} ({unit}) imports {module} ({target})")
    assert not upward, "\n".join(upward)


def test_only_entry_points_import_the_demo():
    entry = LAYERS[-1]
    users = sorted(f"{path.relative_to(ROOT.parent)}" for path, unit in _files()
                   if unit not in entry | {"demo"} and any(_unit(m) == "demo" for m in _imports(path)))
    assert not users, users


def _module_graph() -> dict[str, set[str]]:
    """nemo_tlt module -> the nemo_tlt modules it imports (anywhere in the file, a function's
    deferred imports included: a cycle hidden in a function is still a cycle)."""
    modules = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        graph[name] = {m for m in out if m in modules and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_modules_import_each_other_in_a_circle():
    assert _cycles(_module_graph()) == []


def test_the_circle_check_finds_circles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


LONGEST_FUNCTION = 60  # lines of a def, decorators excluded
LOOP_LINES = 300       # rl/loop.py: the loop and its phases' order; the phases live in their modules


def _long_functions(root: Path, limit: int) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_function_is_longer_than_the_limit():
    assert _long_functions(ROOT, LONGEST_FUNCTION) == []


def test_the_function_length_check_finds_long_functions(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("def short():\n    return 1\n\n\ndef long():\n" + "    x = 1\n" * 3 + "    return x\n")
    assert _long_functions(pkg, 4) == ["pkg/m.py:5 long (5 lines)"]


def test_the_loop_module_stays_short():
    assert len((ROOT / "rl" / "loop.py").read_text().splitlines()) < LOOP_LINES
