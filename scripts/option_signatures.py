"""Write the options into the signatures and ``Args:`` of the callback and both strategies, or check them.

The options are declared once, in ``lightning_cudagraph/_options/options.py`` (``OPTIONS``). Each class lists them as
explicit keyword parameters, so type checkers, IDEs and LightningCLI see them, and describes them in its ``Args:``. This
script writes both from the declaration:

    python scripts/option_signatures.py          # rewrite the classes
    python scripts/option_signatures.py --check  # exit 1, naming the classes, when a class differs

In a signature, the options stand between the line ``# options: written by scripts/option_signatures.py`` and
the line ``# end of options``. In ``Args:``, they stand from the ``impl:`` entry to the end of the ``compile:``
entry. ``tests/test_option_signatures.py`` runs the check.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _load_options() -> ModuleType:
    """``lightning_cudagraph/_options/options.py`` alone: the package's import needs the classes this script writes."""
    spec = importlib.util.spec_from_file_location(
        "_declared_options", ROOT / "lightning_cudagraph" / "_options" / "options.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


OPTIONS = _load_options().OPTIONS

#: The classes whose ``__init__`` takes the options: (file, class).
TARGETS = (
    ("lightning_cudagraph/callback.py", "CUDAGraphCallback"),
    ("lightning_cudagraph/strategy.py", "CUDAGraphStrategy"),
    ("lightning_cudagraph/strategy.py", "DDPCUDAGraphStrategy"),
    ("lightning_cudagraph/model_parallel.py", "ModelParallelCUDAGraphStrategy"),
)
BEGIN = "# options: written by scripts/option_signatures.py"
END = "# end of options"


def _default(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def parameter_lines(indent: str) -> list[str]:
    """The options as keyword parameters, one a line."""
    return [f"{indent}{o.name}: {o.annotation} = {_default(o.default)}," for o in OPTIONS]


def args_lines(indent: str) -> list[str]:
    """The options' ``Args:`` entries, wrapped at 120 columns."""
    return [
        textwrap.fill(
            o.doc,
            width=120,
            initial_indent=f"{indent}{o.name}: ",
            subsequent_indent=indent + "    ",
            break_long_words=False,
            break_on_hyphens=False,
        )
        for o in OPTIONS
    ]


def _class_span(lines: list[str], name: str) -> tuple[int, int]:
    """The lines of class ``name``: from its ``class`` line to the next top-level line (text: it may not parse)."""
    start = next(i for i, line in enumerate(lines) if line.startswith(f"class {name}("))
    end = next((i for i in range(start + 1, len(lines)) if lines[i][:1] not in ("", " ", ")")), len(lines))
    return start, end


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def rewrite(source: str, name: str) -> str:
    """``source`` with the options of class ``name`` written from ``OPTIONS``."""
    lines = source.splitlines()
    start, end = _class_span(lines, name)
    first = next(i for i in range(start, end) if lines[i].lstrip().startswith("impl: "))
    last = next(i for i in range(first, end) if lines[i].lstrip().startswith("compile: "))
    indent = _indent(lines[first])
    stop = last + 1
    while stop < end and lines[stop].strip() and len(_indent(lines[stop])) > len(indent):
        stop += 1
    lines[first:stop] = "\n".join(args_lines(indent)).splitlines()
    start, end = _class_span(lines, name)
    begin = next(i for i in range(start, end) if lines[i].strip() == BEGIN)
    close = next(i for i in range(begin, end) if lines[i].strip() == END)
    lines[begin + 1 : close] = parameter_lines(_indent(lines[begin]))
    return "\n".join(lines) + "\n"


def main() -> int:
    """Rewrite the classes, or with ``--check`` report those that differ."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a class differs")
    check = parser.parse_args().check
    stale = []
    for path, name in TARGETS:
        file = ROOT / path
        source = file.read_text()
        written = rewrite(source, name)
        if written != source:
            stale.append(f"{path}:{name}")
            if not check:
                file.write_text(written)
    if check and stale:
        print(
            f"option_signatures: the options differ from lightning_cudagraph/_options/options.py in {', '.join(stale)};"
            " run `python scripts/option_signatures.py`",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
