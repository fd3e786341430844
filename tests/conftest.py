import os
import warnings

import pytest
import torch
import torch.distributed as dist

#: What Lightning writes into the environment when a fit starts a process group in this process.
PROCESS_GROUP_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")


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


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A fit in this process that started a process group (FSDP2 on one device) leaves neither it nor its port.

    Lightning writes ``MASTER_PORT`` into the environment and keeps the group's store listening there; a later
    multi-process test would then reuse that port and fail with ``EADDRINUSE``.
    """
    saved = {name: os.environ.get(name) for name in PROCESS_GROUP_VARIABLES}
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """``ranks(case)``: the two ranks' reports of a ``tests/dist_worker.py`` case, launched once per test module."""
    from tests.test_rank_agreement import launch  # the launcher of the two-process tests

    done = {}

    def run(case):
        if case not in done:
            done[case] = launch(case, tmp_path_factory.mktemp(case))
        return done[case]

    return run
