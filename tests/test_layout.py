"""The package's layers import one way: each private folder only from the folders below it, never from the face.

From the bottom: ``_options`` (what the user asked), ``_backend`` (the seam to CUDA graphs), ``_trust`` (the
evidence against eager), ``_graphs`` (each kind of graph), ``_rollout`` (the fit's plan and ladder), then the public
face (the callback, the strategies). The report (``health``) and Lightning's internals (``_lightning``) are the
vocabulary every layer may use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_cudagraph"
LAYERS = ("_options", "_backend", "_trust", "_graphs", "_rollout")
#: Modules of the package's root that any layer may import: the report's types and Lightning's internals.
SHARED = {"health", "_lightning"}


def _layer_of(module: str) -> int:
    """The rank of a submodule: its folder's place in :data:`LAYERS`; the face ranks above them all."""
    head = module.split(".")[0]
    if head in SHARED:
        return -1
    return LAYERS.index(head) if head in LAYERS else len(LAYERS)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_cudagraph."):
            found.add(node.module.removeprefix("lightning_cudagraph."))
        elif isinstance(node, ast.ImportFrom) and node.module == "lightning_cudagraph":
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_only_the_layers_below_it(layer):
    modules = sorted((PACKAGE / layer).glob("*.py"))
    assert modules, f"no modules in {layer}"
    upward = {
        f"{layer}/{path.name} imports {target}"
        for path in modules
        for target in _imports(path)
        if _layer_of(target) > LAYERS.index(layer)
    }
    assert not upward, sorted(upward)


def test_the_root_holds_only_the_face_and_the_shared_vocabulary():
    root = {path.stem for path in PACKAGE.glob("*.py")}
    face = {"__init__", "callback", "strategy", "strategy_base", "model_parallel", "bucketing"}
    assert root == face | SHARED, sorted(root - face - SHARED)
