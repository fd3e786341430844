"""A griffe extension for the API reference: a Google ``Example:`` section is read as ``Examples:``.

The package's docstrings title their runnable examples ``Example:`` (or ``Example::``), as Google's style guide
does. griffe reads only ``Examples:`` as an examples section: ``Example:`` becomes an admonition, whose doctest lines
render as prose.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example::?\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Renames every ``Example:`` and ``Example::`` section heading to ``Examples:`` before the docstring is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite the docstring of each object as it is loaded."""
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
