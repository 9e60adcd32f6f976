"""The packages are layers: a module imports only from its own layer or the
layers below it, and no two modules import each other, directly or through
others. Read from the source's import statements (those inside functions and
under TYPE_CHECKING included), so the rule stays true as the code changes."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Lowest first, each a list of module prefixes (a package and its modules).
LAYERS = (
    ("base", ("transpiler.errors", "transpiler.world")),
    ("program", ("transpiler.program",)),
    ("capture", ("transpiler.capture",)),
    ("lowering", ("transpiler.lowering",)),
    ("passes", ("passes",)),
    ("pass manager", ("transpiler.pipeline", "transpiler.modes")),
    ("backends", ("transpiler.backends",)),
    ("runtime", ("transpiler.runtime",)),
    ("front", ("transpiler", "transpiler.api", "transpiler.mode_specs")),
    ("bench", ("transpiler.bench",)),
)


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted([*ROOT.glob("transpiler/**/*.py"), *ROOT.glob("passes/*.py")]):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The project's modules `name` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:   # a module imported from its package, or a name from a module
                full = f"{module}.{alias.name}"
                out.add(full if full in MODULES else module)
        elif isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def layer(module: str) -> int:
    """The layer of the longest prefix that names the module's package."""
    best, length = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = i, len(prefix)
    assert best is not None, f"{module} is in no layer: add its package to LAYERS"
    return best


def test_every_module_has_a_layer():
    for module in MODULES:
        layer(module)


def test_imports_go_down_the_layers():
    upward = [f"{m} ({LAYERS[layer(m)][0]}) imports {d} ({LAYERS[layer(d)][0]})"
              for m, deps in GRAPH.items() for d in sorted(deps) if layer(d) > layer(m)]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    """Tarjan's strongly connected components of the import graph: each a
    single module."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, "modules that import each other: " + "; ".join(map(", ".join, cycles))


def test_the_layer_rule_catches_an_upward_import():
    """The graph is read from the source: a pass that imported the runtime
    would be reported."""
    assert layer("passes.insert_allreduce") < layer("transpiler.runtime.step")
    assert "transpiler.lowering.reductions" in GRAPH["passes.insert_allreduce"]
