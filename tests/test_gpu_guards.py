"""The guards and the fed learning rate with real CUDA graphs: :mod:`tests.test_guards`' cases on a GPU.

Run with ``pytest -m cuda``. Each case is trained eagerly and through ``cudagraph_full``, ``strategy="cudagraph"`` and
``scope=["layer"]`` on the GPU, and compared with the eager fit on losses, logged values, parameters and the user's
state.
"""

from __future__ import annotations

import pytest

from lightning_cudagraph import Stage
from tests.test_guards import CASES, FED, check_never_trains_a_wrong_step

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]


@pytest.mark.parametrize("variant", ["cudagraph_full", "cudagraph", "layer"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_value_changed_between_steps_never_trains_a_wrong_step_on_cuda(name, variant):
    report = check_never_trains_a_wrong_step(name, variant, cuda=True)
    if name in FED and variant != "layer":
        assert report.stage == Stage.REPLAYING and report.rollbacks == 0, report.reason
