"""The first hour of a new user: the package's warnings, the one notice on a CPU, and the CLI help.

The package warns with ``CUDAGraphWarning`` at the line of the user's code that led to the warning, on rank zero.
A fit on a CPU says once that graphs are off (PYPI.md promises one warning), with no second notice from evaluation.
The help that LightningCLI prints for the callback and the strategies is plain text: no Sphinx roles, no private
module names.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import warnings
from pathlib import Path

import pytest
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import lightning_cudagraph
from lightning_cudagraph import (
    CUDAGraphCallback,
    CUDAGraphStrategy,
    CUDAGraphWarning,
    DDPCUDAGraphStrategy,
    ModelParallelCUDAGraphStrategy,
)
from lightning_cudagraph._warnings import NO_USER_FILE, user_frame, warn_user
from tests.helpers import trainer
from tests.models import TINY, decoder

THIS_FILE = str(Path(__file__).resolve())
PACKAGE = str(Path(lightning_cudagraph.__file__).resolve().parent)


def _internal_caller(body: str, namespace: dict[str, object]) -> dict[str, object]:
    """Functions defined as if in a module of the package (its name and a path inside it), to call from a test."""
    scope = {"__name__": "lightning_cudagraph._first_hour_stand_in", **namespace}
    exec(compile(body, f"{PACKAGE}/_first_hour_stand_in.py", "exec"), scope)
    return scope


INTERNAL = _internal_caller(
    "def warn_inside(message, **options):\n    warn_user(message, **options)\n", {"warn_user": warn_user}
)


# =================================================================== the category and where it points
def test_the_category_is_public_and_a_user_warning():
    assert "CUDAGraphWarning" in lightning_cudagraph.__all__
    assert lightning_cudagraph.__all__ == sorted(lightning_cudagraph.__all__)
    assert issubclass(CUDAGraphWarning, UserWarning)


def test_a_warning_from_inside_the_package_names_the_users_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _line_of_next_call()
        INTERNAL["warn_inside"]("graphs off")
    assert [(w.category, str(w.message)) for w in caught] == [(CUDAGraphWarning, "graphs off")]
    assert (caught[0].filename, caught[0].lineno) == (THIS_FILE, line)


def _line_of_next_call() -> int:
    """The line after the caller's current line."""
    return sys._getframe(1).f_lineno + 1


def test_default_filters_show_a_message_once_per_user_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            INTERNAL["warn_inside"]("said once")
    assert [str(w.message) for w in caught] == ["said once"]


def test_only_rank_zero_warns_unless_every_rank_should(monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 1, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        INTERNAL["warn_inside"]("rank zero only")
        INTERNAL["warn_inside"]("every rank", all_ranks=True)
    assert [str(w.message) for w in caught] == ["every rank"]


def test_with_no_user_frame_the_warning_names_the_package_not_a_file_of_it():
    # A thread started by internal code runs internal code: threading's frames, the package's, and no user frame.
    found: list[object] = []
    inside = _internal_caller(
        "def start(target):\n    t = threading.Thread(target=target)\n    t.start()\n    t.join()\n\n"
        "def find():\n    found.append(user_frame())\n\n"
        "def warn():\n    warn_user('from a thread')\n",
        {"threading": threading, "found": found, "user_frame": user_frame, "warn_user": warn_user},
    )
    inside["start"](inside["find"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inside["start"](inside["warn"])
    assert found == [None]
    assert [(w.filename, w.lineno, w.category) for w in caught] == [(NO_USER_FILE, 0, CUDAGraphWarning)]


# =================================================================== a fit on a CPU: one notice, at the user's line
def test_a_cpu_fit_gives_one_notice_a_cuda_graph_warning_at_the_users_line(caplog):
    """Graphs off (no_cuda), said once: no second notice when validation runs eagerly on the CPU too."""
    model, data = decoder(TINY)
    options = {"accelerator": "cpu", "devices": 1, "limit_val_batches": 2, "val_check_interval": 2}
    run = trainer(4, strategy="cudagraph_layer", **options)
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _line_of_next_call()
        run.fit(model, datamodule=data)

    ours = [w for w in caught if issubclass(w.category, CUDAGraphWarning)]
    assert [str(w.message) for w in ours if "no_cuda" in str(w.message)] == [str(ours[0].message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert (ours[0].filename, ours[0].lineno) == (THIS_FILE, line), "the warning names the user's fit, not the package"
    others = [str(w.message) for w in caught if "CUDAGraph" in str(w.message) and w not in ours]
    assert others == [], "every package warning is a CUDAGraphWarning"
    notices = [r.getMessage() for r in caplog.records if "CUDAGraph" in r.getMessage() or "no_cuda" in r.getMessage()]
    assert notices == [], f"a second notice after the warning: {notices}"


# =================================================================== the CLI help
# Lightning's own docstrings (the DDP strategy's keywords) have roles of their own; the package's text has none.
ROLE = re.compile(r":(class|mod|meth|func|data|attr|exc|obj):`~?lightning_cudagraph")
PRIVATE = re.compile(r"lightning_cudagraph\._|\b_(trust|graphs|rollout|backend|options)\b")


def _class_help(cls: type) -> str:
    jsonargparse = pytest.importorskip("jsonargparse", reason="LightningCLI's parser (the `test` extra)")
    parser = jsonargparse.ArgumentParser(prog=cls.__name__)
    parser.add_class_arguments(cls, "graph")
    return parser.format_help()


@pytest.mark.parametrize(
    "cls",
    [CUDAGraphCallback, CUDAGraphStrategy, DDPCUDAGraphStrategy, ModelParallelCUDAGraphStrategy],
    ids=lambda cls: cls.__name__,
)
def test_the_cli_help_is_plain_text(cls):
    shown = _class_help(cls)
    assert "--graph.scope" in shown
    assert ROLE.findall(shown) == [], f"Sphinx roles in the help of {cls.__name__}"
    assert PRIVATE.findall(shown) == [], f"private modules named in the help of {cls.__name__}"


def test_the_docs_say_how_to_list_the_options():
    index = (Path(__file__).parents[1] / "docs" / "index.md").read_text()
    assert "--trainer.strategy.help CUDAGraphStrategy" in index
    assert "--trainer.callbacks.help CUDAGraphCallback" in index
