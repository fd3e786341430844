"""The options are declared once (``_options/options.py``) and written into three signatures and their Args.

scripts/option_signatures.py writes them; these tests fail when a class drifts from the declaration: a name, a
default, an annotation or a description.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, DDPCUDAGraphStrategy
from lightning_cudagraph._options.config import CUDAGraphConfig
from lightning_cudagraph._options.options import OPTIONS

docstring_parser = pytest.importorskip("docstring_parser", reason="jsonargparse's docstring reader (the `test` extra)")

ROOT = Path(__file__).parents[1]
CLASSES = [CUDAGraphCallback, CUDAGraphStrategy, DDPCUDAGraphStrategy]
SCRIPT = ROOT / "scripts" / "option_signatures.py"


def test_the_declared_defaults_are_the_configs_defaults():
    # The config holds each option, and the component it names in messages (not an option).
    assert [option.name for option in OPTIONS] + ["component"] == [f.name for f in fields(CUDAGraphConfig)]
    defaults = {option.name: option.default for option in OPTIONS}
    assert CUDAGraphConfig.from_options("CUDAGraphCallback", **defaults) == CUDAGraphConfig()
    assert CUDAGraphConfig().options() == defaults


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_each_class_takes_every_option_as_declared(cls):
    parameters = inspect.signature(cls).parameters
    names = {option.name for option in OPTIONS}
    written = [(p.name, code(p.annotation), p.default, p.kind) for p in parameters.values() if p.name in names]
    declared = [(o.name, code(o.annotation), o.default, inspect.Parameter.KEYWORD_ONLY) for o in OPTIONS]
    assert written == declared


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_each_class_describes_every_option_as_declared(cls):
    described = {
        p.arg_name: " ".join((p.description or "").split()) for p in docstring_parser.parse(cls.__doc__).params
    }
    for option in OPTIONS:
        assert described.get(option.name) == " ".join(option.doc.split()), f"{cls.__name__} Args: {option.name}"


def test_the_written_signatures_are_current():
    result = subprocess.run([sys.executable, SCRIPT, "--check"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_the_script_writes_back_a_parameter_that_drifted():
    spec = importlib.util.spec_from_file_location("option_signatures", SCRIPT)
    option_signatures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(option_signatures)
    source = (ROOT / "lightning_cudagraph" / "callback.py").read_text()
    drifted = source.replace("        warmup_steps: int = 3,\n", "        warmup_steps: int = 4,\n", 1)
    assert drifted != source
    assert option_signatures.rewrite(drifted, "CUDAGraphCallback") == source


def test_a_keyword_the_class_does_not_take_is_refused_with_the_closest_option():
    with pytest.raises(ValueError, match="did you mean 'scope'"):
        CUDAGraphCallback(scopes=["attn"])  # type: ignore[call-arg]


def code(annotation: str) -> str:
    """An annotation's source in one spelling (``inspect`` shows it re-quoted)."""
    return ast.unparse(ast.parse(annotation))
