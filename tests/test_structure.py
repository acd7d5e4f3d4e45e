"""The shape of the package: imports follow the pipeline's layers, never in a circle, and no module
reaches into another's private names."""
import ast
from fnmatch import fnmatch

from conftest import ROOT

# Lowest first: a module may import its own layer or a lower one. Every module must be listed.
LAYERS = [
    ["eagle3.files", "eagle3.ops", "eagle3.linear", "eagle3.float8", "eagle3.config", "eagle3.distributed",
     "eagle3.vocab", "eagle3.errors",
     "eagle3.data.aux_fp8", "eagle3.sampling", "eagle3.models.attention", "eagle3.models.quant", "eagle3.kernels*"],
    ["eagle3.models.*"],                                                    # the target model
    ["eagle3.resolve", "eagle3.data.*"],                                    # "auto" resolved; inputs, shards, batches
    ["eagle3.extraction"],
    ["eagle3.draft", "eagle3.ttt"],
    ["eagle3.train_state", "eagle3.draft_io", "eagle3.export"],
    ["eagle3.training.schedule", "eagle3.training.metrics", "eagle3.training.run_dir", "eagle3.training.resume",
     "eagle3.training.kernel_choice", "eagle3.training.feed", "eagle3.training.graph",
     "eagle3.training.context", "eagle3.training.memory"],                  # the trainer's parts
    ["eagle3.training.loop", "eagle3.training"],                            # the loop over them; the package
    ["eagle3.speculative", "eagle3.engines", "eagle3.generate", "eagle3.evaluate"],
    ["eagle3.bench*", "eagle3.demo", "eagle3.__main__", "eagle3"],
]


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted([*ROOT.glob("eagle3/**/*.py"), *ROOT.glob("kernels/*.py")]):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(("eagle3", *parts) if parts[0] == "kernels" else parts).removesuffix(".__init__")
        found[name] = ast.parse(path.read_text())
    return found


def imports(tree: ast.Module, known: dict) -> set[tuple[str, str]]:
    """(module, name) pairs imported anywhere in the file (also inside functions)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add((full, "") if full in known else (node.module, alias.name))
        elif isinstance(node, ast.Import):
            out |= {(alias.name, "") for alias in node.names}
    return {(m, n) for m, n in out if m in known}


def layer(name: str) -> int:
    hits = [i for i, group in enumerate(LAYERS) if any(fnmatch(name, pattern) for pattern in group)]
    assert hits, f"{name} is in no layer of tests/test_structure.py: place it"
    return hits[0]


def test_imports_go_down_the_layers_and_never_in_a_circle():
    mods = modules()
    graph = {name: {m for m, _ in imports(tree, mods)} - {name} for name, tree in mods.items()}
    upward = [f"{a} -> {b}" for a, deps in graph.items() for b in deps if layer(b) > layer(a)]
    assert not upward, upward

    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            assert state.get(dep) != 1, "import circle: " + " -> ".join(path[path.index(dep):] + [dep])
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_no_module_imports_another_modules_private_names():
    mods = modules()
    private = [f"{name}: {m}.{n}" for name, tree in mods.items() for m, n in imports(tree, mods)
               if n.startswith("_") and not n.startswith("__")]
    assert not private, private


def module_aliases(tree: ast.Module, known: dict) -> dict[str, str]:
    """Local names bound to a module of the package: `import a.b as c`, `from a import b` (b a module),
    and `c = importlib.import_module("a.b")`."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.asname: alias.name for alias in node.names if alias.asname and alias.name in known}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out |= {alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names
                    if f"{node.module}.{alias.name}" in known}
        elif (isinstance(node, ast.Assign) and isinstance(call := node.value, ast.Call)
              and isinstance(call.func, ast.Attribute) and call.func.attr == "import_module"
              and call.args and isinstance(call.args[0], ast.Constant) and call.args[0].value in known):
            out |= {target.id: call.args[0].value for target in node.targets if isinstance(target, ast.Name)}
    return out


def test_no_module_reaches_into_another_modules_private_names_by_attribute():
    mods = modules()
    private = []
    for name, tree in mods.items():
        aliases = module_aliases(tree, mods)
        for node in ast.walk(tree):
            attr = (node.attr if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and aliases.get(node.value.id, name) != name else
                    node.args[1].value if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "getattr" and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[0], ast.Name) and aliases.get(node.args[0].id, name) != name
                    else "")
            if isinstance(attr, str) and attr.startswith("_") and not attr.startswith("__"):
                private.append(f"{name}: {attr}")
    assert not private, private


def imported_roots(tree: ast.Module) -> set[str]:
    """The top-level package of every absolute import in the file."""
    return {name.split(".")[0] for node in ast.walk(tree)
            for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])}


def test_the_package_imports_nothing_outside_the_wheel():
    """benchmarks/ (the lab) and tests/ use the package, never the other way round."""
    outside = {name: roots for name, tree in modules().items()
               if (roots := imported_roots(tree) & {"benchmarks", "tests", "conftest"})}
    assert not outside, outside
