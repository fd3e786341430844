"""The guards and the fed learning rate with real CUDA graphs: :mod:`tests.test_guards`' cases on a GPU.

Run with ``pytest -m cuda``. Each case is trained eagerly and through ``cudagraph_full``, ``strategy="cudagraph"`` and
``scope=["layer"]`` on the GPU, and compared with the eager fit on losses, logged values, parameters and the user's
state.
"""

from __future__ import annotations

from typing import Any

import pytest

from lightning_cudagraph import Stage
from tests.test_guards import CASES, FED, SETTINGS
from tests.test_step_python import assert_same_training, run_case

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]

_EAGER: dict[str, Any] = {}


def run(name: str, variant: str | None) -> Any:
    SETTINGS["scale"] = 1.0
    return run_case(CASES[name], variant, cuda=True)


def eager(name: str) -> Any:
    if name not in _EAGER:
        _EAGER[name] = run(name, None)
    return _EAGER[name]


@pytest.mark.parametrize("variant", ["cudagraph_full", "cudagraph", "layer"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_value_changed_between_steps_never_trains_a_wrong_step_on_cuda(name, variant):
    outcome = run(name, variant)
    assert_same_training(eager(name), outcome)
    report = outcome.report
    on_graphs = report.stage in (Stage.CONFIRMING, Stage.REPLAYING) and report.replays > 0
    assert on_graphs or (report.stage == Stage.DISABLED and report.reason), "graphs off without a reason"
    assert not [reason for reason in report.rollback_reasons if reason.startswith("parity")], report.rollback_reasons
    if name in FED and variant != "layer":
        assert report.stage == Stage.REPLAYING and report.rollbacks == 0, report.reason
