"""The package's layering, read from the source: every import, module-level or inside a function.

nn/ imports nothing above it; models/ and data/ never import training/ or cli/; training/ never
imports cli/; the recipe registry (recipes.py) sits above models/, data/ and training/, which never
import it, and below cli/. The flat modules `_checks` and `config` sit below everything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "plainformer"
BASE = {"plainformer._checks", "plainformer.config"}
FORBIDDEN = {
    "nn": ("plainformer.models", "plainformer.data", "plainformer.generation", "plainformer.training",
           "plainformer.io", "plainformer.cli", "plainformer.recipes"),
    "models": ("plainformer.training", "plainformer.cli", "plainformer.recipes"),
    "data": ("plainformer.training", "plainformer.cli", "plainformer.recipes"),
    "generation": ("plainformer.cli", "plainformer.recipes"),
    "io": ("plainformer.cli", "plainformer.recipes"),
    "training": ("plainformer.cli", "plainformer.recipes"),
    "recipes": ("plainformer.cli",),
}


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


def _layer(path: Path) -> str | None:
    """The folder a module sits in; for a flat module, its own name (`recipes`)."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_imports_only_from_its_own_layer_or_below(path: Path) -> None:
    forbidden = FORBIDDEN.get(_layer(path), ())
    offending = sorted(m for m in imported_modules(path)
                       if any(m == f or m.startswith(f + ".") for f in forbidden))
    assert not offending, f"{path.relative_to(PACKAGE)} imports {offending}"


def test_nn_depends_only_on_itself_and_the_base_modules() -> None:
    for path in (PACKAGE / "nn").rglob("*.py"):
        for module in imported_modules(path):
            assert module.startswith("plainformer.nn.") or module.rpartition(".")[0] in BASE \
                or module in BASE, f"{path.name} imports {module}"


def test_the_import_reader_sees_relative_and_nested_imports() -> None:
    probe = PACKAGE / "nn" / "attention.py"
    assert "plainformer._checks" in imported_modules(probe)
    assert "plainformer.nn.flash.flash_attention" in imported_modules(probe)  # imported inside a function


def test_the_recipe_registry_is_checked_as_a_layer() -> None:
    assert _layer(PACKAGE / "recipes.py") == "recipes" and "recipes" in FORBIDDEN
