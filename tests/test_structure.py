"""The shape of the package: imports follow the pipeline's layers, never in a circle, and no module
reaches into another's private names."""
import ast
from fnmatch import fnmatch

from conftest import ROOT

# Lowest first: a module may import its own layer or a lower one. Every module must be listed.
LAYERS = [
    ["eagle3.files", "eagle3.ops", "eagle3.linear", "eagle3.float8", "eagle3.config", "eagle3.distributed",
     "eagle3.vocab", "eagle3.data.errors",
     "eagle3.data.fp8", "eagle3.sampling", "eagle3.models.attention", "eagle3.models.quant", "eagle3.models.tiny", "kernels*"],
    ["eagle3.models.*"],                                                    # the target model
    ["eagle3.resolve", "eagle3.data.*"],                                    # "auto" resolved; inputs, shards, batches
    ["eagle3.extraction"],
    ["eagle3.draft", "eagle3.ttt"],
    ["eagle3.checkpoint", "eagle3.export"],
    ["eagle3.training"],
    ["eagle3.speculative", "eagle3.generate", "eagle3.evaluate"],
    ["eagle3.bench*", "eagle3.__main__", "eagle3"],
]


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted([*ROOT.glob("eagle3/**/*.py"), *ROOT.glob("kernels/*.py")]):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
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
