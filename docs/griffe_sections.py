"""A griffe extension for the API reference: ``Example:`` sections read as ``Examples:``, Sphinx roles as code.

The package's docstrings title their runnable examples ``Example:`` (or ``Example::``), as Google's style guide
does. griffe reads only ``Examples:`` as an examples section: ``Example:`` becomes an admonition, whose doctest lines
render as prose. The docstrings also cross-reference with Sphinx roles (``:class:`~lightning_cudagraph.Stage```),
which Markdown would show as raw text: each becomes a code span of the name (its last part with ``~``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example::?\s*$", re.MULTILINE)
_ROLE = re.compile(r":(?:py:)?(?:class|mod|meth|func|attr|data|exc|obj):`(~?)([^`]+)`")


def plain_roles(text: str) -> str:
    """Sphinx cross-reference roles as Markdown code spans (``~`` keeps the last part of the name)."""
    return _ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)


class ExampleSections(griffe.Extension):
    """Renames every ``Example:`` and ``Example::`` section heading to ``Examples:`` before the docstring is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite the docstring of each object as it is loaded."""
        if obj.docstring is not None:
            obj.docstring.value = plain_roles(_EXAMPLE.sub(r"\1Examples:", obj.docstring.value))
