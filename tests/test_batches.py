"""Batches of every kind Lightning moves: their keys, their tensors and the package's own copies of them."""

from collections import OrderedDict, UserDict, namedtuple
from dataclasses import dataclass

import pytest
import torch

from lightning_cudagraph._options.batches import batch_key, batch_tensors, copy_into, describe_batch_key, own_copy


class Encoding(UserDict):
    """Like Hugging Face's ``BatchEncoding``: a ``UserDict`` with attributes of its own."""

    def __init__(self, data: dict) -> None:
        super().__init__(data)
        self.n_sequences = 1


@dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


Sample = namedtuple("Sample", ["x", "y"])


class GraphBatch:
    """Like torch_geometric's ``Batch``: moves itself with ``.to()`` and lists its tensors with ``to_dict()``."""

    def __init__(self, x: torch.Tensor, edge_index: torch.Tensor) -> None:
        self.x, self.edge_index = x, edge_index

    def to_dict(self) -> dict:
        return {"x": self.x, "edge_index": self.edge_index}

    def to(self, device: torch.device) -> "GraphBatch":
        return self


class Opaque:
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def to(self, device: torch.device) -> "Opaque":
        return self


def tokens(length: int) -> dict:
    return {"input_ids": torch.zeros(8, length, dtype=torch.long), "labels": torch.zeros(8, length, dtype=torch.long)}


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda n: tokens(n), id="dict"),
        pytest.param(lambda n: Encoding(tokens(n)), id="UserDict"),
        pytest.param(lambda n: OrderedDict(tokens(n)), id="OrderedDict"),
        pytest.param(lambda n: Pair(torch.zeros(8, n), torch.zeros(8)), id="dataclass"),
        pytest.param(lambda n: Sample(torch.zeros(8, n), torch.zeros(8)), id="namedtuple"),
        pytest.param(lambda n: [torch.zeros(8, n), {"mask": torch.ones(8, n)}], id="nested"),
        pytest.param(lambda n: GraphBatch(torch.zeros(n, 4), torch.zeros(2, 2 * n, dtype=torch.long)), id="graph"),
    ],
)
def test_each_shape_of_every_batch_kind_gets_its_own_key(make):
    assert batch_key(make(64)) == batch_key(make(64))
    assert batch_key(make(64)) != batch_key(make(128))
    assert hash(batch_key(make(64))) == hash(batch_key(make(64)))
    assert len(batch_tensors(make(64))) >= 2


def test_a_user_dict_is_not_one_leaf_and_its_key_names_the_fields():
    key = batch_key(Encoding(tokens(192)))
    assert describe_batch_key(key) == "input_ids: int64[8, 192], labels: int64[8, 192]"
    assert batch_key(Encoding(tokens(192))) != batch_key(tokens(192))  # the container type is part of the key


def test_values_count_for_a_whole_step_key_only():
    a, b = {"x": torch.zeros(2), "n": 3}, {"x": torch.zeros(2), "n": 4}
    assert batch_key(a) == batch_key(b)
    assert batch_key(a, values=True) != batch_key(b, values=True)
    assert batch_key((torch.zeros(2),)) != batch_key([torch.zeros(2)])
    assert batch_key({"x": torch.zeros(2)}) != batch_key({"x": torch.zeros(2, dtype=torch.int32)})


def test_an_object_the_package_cannot_see_into_has_no_key():
    assert batch_key(Opaque(torch.zeros(2))) is None
    assert batch_key({"graph": Opaque(torch.zeros(2))}, values=True) is None
    assert describe_batch_key(None) == "<opaque batch>"


@pytest.mark.parametrize(
    "batch",
    [
        pytest.param(Encoding(tokens(4)), id="UserDict"),
        pytest.param(Pair(torch.ones(2, 4), torch.ones(2)), id="dataclass"),
        pytest.param(Sample(torch.ones(2, 4), torch.ones(2)), id="namedtuple"),
        pytest.param(GraphBatch(torch.ones(3, 4), torch.ones(2, 6, dtype=torch.long)), id="graph"),
    ],
)
def test_own_copy_keeps_the_type_and_never_aliases_the_users_tensors(batch):
    static = own_copy(batch)
    assert type(static) is type(batch)
    assert batch_key(static) == batch_key(batch)
    user = {t.data_ptr() for t in batch_tensors(batch)}
    assert not user & {t.data_ptr() for t in batch_tensors(static)}
    later = own_copy(batch)
    for tensor in batch_tensors(later):
        tensor.fill_(7)
    copy_into(static, later)
    assert all(bool((t == 7).all()) for t in batch_tensors(static))
    assert not any(bool((t == 7).any()) for t in batch_tensors(batch))  # the user's batch is untouched
    if isinstance(batch, Encoding):
        assert static.n_sequences == 1
