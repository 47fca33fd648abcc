"""The package's layering, read from the source: every import, module-level or inside a function.

The layers form one total order, bottom to top (`LAYERS`): a module imports only from its own layer or
from below, with no exception, and no two modules import each other, directly or round a longer cycle.
A folder is a layer; the flat base modules share the bottom one; the package itself is the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "plainformer"
LAYERS = [
    ("_checks", "config", "constants", "errors", "launch", "log", "memory", "_version"),  # what every layer may use
    ("files",),  # atomic writes, the run lock, the JSON reader
    ("nn",),
    ("inference",),  # decoding-time transforms of a built model's linear layers
    ("data",),
    ("generation",),
    ("checkpoint",),  # the format, below the models that load from it
    ("models",),
    ("hf",),  # Hugging Face adapters, above the models
    ("gguf",),  # llama.cpp's file format, written from a model's Hugging Face layout
    ("training",),
    ("families",),
    ("recipes",),
    ("cli", "serve", "explorer"),  # the applications: the command line, the HTTP server, the attention explorer
    ("__init__", "__main__"),  # `import plainformer as pf`
]
RANK = {layer: rank for rank, names in enumerate(LAYERS) for layer in names}
MODULES = sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the plainformer modules (or names inside them) that `path` imports."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("plainformer")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("plainformer"):
                found |= {f"{module}.{alias.name}" for alias in node.names}
    return found


def _layer(path: Path) -> str:
    """The folder a module sits in; for a flat module, its own name (`recipes`)."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


def _layer_of_name(name: str) -> str:
    """The layer of an imported name: `plainformer.nn.flash.flash_attention` -> nn, `plainformer` -> the top."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else "__init__"


_NAMES = {_module_name(path) for path in MODULES}


def _module_of_name(name: str) -> str:
    """The module an imported name belongs to: the longest prefix of it that is a module of the package."""
    while name not in _NAMES:
        name = name.rpartition(".")[0]
    return name


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_sits_in_a_layer_of_the_order(path: Path) -> None:
    assert _layer(path) in RANK, f"{path.relative_to(PACKAGE)}: add its layer to LAYERS"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_imports_only_from_its_own_layer_or_below(path: Path) -> None:
    own = RANK[_layer(path)]
    upward = sorted(m for m in imported_modules(path) if RANK[_layer_of_name(m)] > own)
    assert not upward, f"{path.relative_to(PACKAGE)} ({_layer(path)}) imports {upward} from above it"


def layer_imports() -> dict[str, set[str]]:
    """Each layer above the base -> the layers it imports from, besides its own and the base modules."""
    base = set(LAYERS[0])
    found: dict[str, set[str]] = {layer: set() for names in LAYERS[1:] for layer in names}
    for path in MODULES:
        if (own := _layer(path)) not in base:
            found[own] |= {_layer_of_name(name) for name in imported_modules(path)} - base - {own}
    return found


def _import_graph() -> dict[str, set[str]]:
    graph = {}
    for path in MODULES:
        module = _module_name(path)
        graph[module] = {_module_of_name(name) for name in imported_modules(path)} - {module}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the path being explored, "done" once all of it is seen
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[module] = "done"
        path.pop()
        return None

    return next((found for module in sorted(graph) if module not in state and (found := visit(module))), None)


def test_no_modules_import_each_other_round_a_cycle() -> None:
    cycle = _cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle_and_passes_a_tree() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_nn_depends_only_on_itself_and_the_base_modules() -> None:
    base = {f"plainformer.{name}" for name in LAYERS[0]}
    for path in (PACKAGE / "nn").rglob("*.py"):
        for module in imported_modules(path):
            assert module.startswith("plainformer.nn.") or module.rpartition(".")[0] in base \
                or module in base, f"{path.name} imports {module}"


def test_the_import_reader_sees_relative_and_nested_imports() -> None:
    probe = PACKAGE / "nn" / "attention.py"
    assert "plainformer._checks" in imported_modules(probe)
    assert "plainformer.nn.flash.flash_attention" in imported_modules(probe)  # imported inside a function
