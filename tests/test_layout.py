"""The package's layers import one way: each private folder only from the folders below it, never from the face.

From the bottom: ``_options`` (what the user asked), ``_backend`` (the seam to CUDA graphs), ``_trust`` (the
evidence against eager), ``_graphs`` (each kind of graph), ``_rollout`` (the fit's plan and ladder), then the public
face (the callback, the strategies, the experts path). The report (``health``), Lightning's internals (``_lightning``)
and the package's warnings (``_warnings``) are the vocabulary every layer may use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_cudagraph"
LAYERS = ("_options", "_backend", "_trust", "_graphs", "_rollout")
#: Modules of the package's root that any layer may import: the report's types, Lightning's internals, the warnings.
SHARED = {"health", "_lightning", "_warnings"}


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
    face = {
        "__init__",
        "callback",
        "strategy",
        "strategy_base",
        "strategy_names",
        "model_parallel",
        "bucketing",
        "experts",
    }
    assert root == face | SHARED, sorted(root - face - SHARED)


#: The most lines a module may have, and the most lines of code (docstrings, comments and blank lines aside) a class.
MODULE_LINES, CLASS_CODE_LINES = 300, 200


def _code_lines(tree: ast.Module, source: list[str], first: int, last: int) -> int:
    """Lines ``first..last`` (1-based, inclusive) that are code: not blank, not a comment, not in a docstring."""
    docs = {
        line
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)
    }
    return sum(
        1
        for number in range(first, last + 1)
        if number not in docs and source[number - 1].strip() and not source[number - 1].strip().startswith("#")
    )


def test_no_module_is_over_300_lines_and_no_class_over_200_lines_of_code():
    too_big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        source, tree, name = text.splitlines(), ast.parse(text), path.relative_to(PACKAGE)
        if len(source) > MODULE_LINES:
            too_big.append(f"{name}: {len(source)} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                code = _code_lines(tree, source, node.lineno, node.end_lineno or node.lineno)
                if code > CLASS_CODE_LINES:
                    too_big.append(f"{name}: class {node.name} has {code} lines of code")
    assert not too_big, too_big
