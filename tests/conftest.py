import warnings

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Skip tests marked `cuda` (or `te`) where there is no CUDA device; they run on the GPU machine."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="Requires: [CUDA GPU] (run `pytest -m cuda` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords or "te" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _quiet_lightning(monkeypatch):
    monkeypatch.setenv("PL_DISABLE_FORK", "1")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
        yield
