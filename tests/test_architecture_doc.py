"""docs/architecture.md and CONTRIBUTING.md say what tests/test_layering.py enforces.

The layer order is stated once, as `LAYERS`; these tests hold the prose to it: the architecture's numbered
list and CONTRIBUTING's paragraph on layering name its layers in its order, the layers the architecture calls
independent by design import each other neither way (directly or through a third), and its section of each
layer names every module of that layer.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.test_layering import LAYERS, PACKAGE, layer_imports

ROOT = PACKAGE.parents[1]
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
CONTRIBUTING = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
NAME = re.compile(r"`([\w.]+(?:/|\.py))`")  # a folder (`nn/`) or a module (`recipes.py`), as the docs write them


def _names(text: str) -> list[str]:
    """The layers or modules named in `text`, in order: `nn/` -> nn, `recipes.py` -> recipes."""
    return [name.removesuffix("/").removesuffix(".py") for name in NAME.findall(text)]


def _section(text: str, heading: str) -> str:
    """The body of the `## heading` section of a Markdown page, up to the next `## ` heading."""
    start = text.index(f"\n## {heading}\n") + len(heading) + 5
    end = text.find("\n## ", start)
    return text[start:] if end == -1 else text[start:end]


def _numbered_list(section: str) -> list[str]:
    """The items of the first numbered list of `section` (an item runs to its first blank line)."""
    items = [item.split("\n\n")[0] for item in re.split(r"^(?=\d+\. )", section, flags=re.M)[1:]]
    assert [int(item.split(".")[0]) for item in items] == list(range(1, len(items) + 1)), "numbered 1, 2, ..."
    return items


def _after(section: str, opening: str) -> list[str]:
    """The lines of the block that follows the line `opening`, up to the first blank line."""
    return section[section.index(opening + "\n") + len(opening) + 1:].split("\n\n")[0].splitlines()


def _reaches(graph: dict[str, set[str]], layer: str) -> set[str]:
    found, todo = set(), [layer]
    while todo:
        for target in graph[todo.pop()] - found:
            found.add(target)
            todo.append(target)
    return found


def _check_layer_list(text: str, heading: str) -> None:
    items = _numbered_list(_section(text, heading))
    assert [set(_names(item)) for item in items] == [set(names) for names in LAYERS], \
        f"the list under '{heading}' is not tests/test_layering.py's LAYERS, layer by layer"


def test_architecture_lists_the_layers_in_the_order_the_layering_test_enforces() -> None:
    _check_layer_list(ARCHITECTURE, "Layer order")


def test_contributing_names_the_layers_in_the_order_the_layering_test_enforces() -> None:
    paragraph = _section(CONTRIBUTING, "Layering").strip().split("\n\n")[0]
    assert _names(paragraph) == [name for names in LAYERS for name in names], \
        "CONTRIBUTING.md's paragraph under 'Layering' is not tests/test_layering.py's LAYERS, in order"


def test_architecture_layers_independent_by_design_import_each_other_neither_way() -> None:
    graph = layer_imports()
    reach = {layer: _reaches(graph, layer) for layer in graph}
    bullets = [line for line in _after(_section(ARCHITECTURE, "Layer order"), "other by design:")
               if line.startswith("- ")]
    assert bullets, "'Layer order' names the layers that are independent by design"
    for bullet in bullets:
        first, second = _names(bullet.split(": ")[0])
        assert second not in reach[first] and first not in reach[second], \
            f"{first}/ and {second}/ are said to be independent, but one reaches the other: {bullet}"


def _defines_something(path: Path) -> bool:
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               for node in ast.parse(path.read_text(encoding="utf-8")).body)


def _modules_of(layer: str) -> list[str]:
    """The modules a reader looks for in a layer's section: a flat module, or a folder's files as named there
    (`atomic.py`); a folder's `__init__.py` only where it defines a function or class, not just re-exports."""
    folder = PACKAGE / layer
    if not folder.is_dir():
        return [f"{layer}.py"]
    return [path.relative_to(folder).as_posix() for path in sorted(folder.rglob("*.py"))
            if path.name != "__init__.py" or _defines_something(path)]


def test_architecture_has_a_section_for_each_layer_naming_every_module_of_it() -> None:
    sections = re.split(r"^### ", _section(ARCHITECTURE, "Folders and modules"), flags=re.M)[1:]
    assert [int(section.split(".")[0]) for section in sections] == list(range(1, len(LAYERS) + 1))
    for section, layers in zip(sections, LAYERS, strict=True):
        named = set(NAME.findall(section))
        heading = section.splitlines()[0]
        for layer in layers:
            if (PACKAGE / layer).is_dir():
                assert f"`{layer}/`" in heading, f"section '{heading}' is not {layer}/'s"
            missing = [module for module in _modules_of(layer) if not {module, f"{layer}/{module}"} & named]
            assert not missing, f"section '{heading}' does not name {missing} of {layer}"
