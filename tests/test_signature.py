"""Input signatures on CPU tensors: what makes two calls share a graph, and how a change is described."""

import pytest
import torch
import torch.nn as nn

from lightning_cudagraph._backend.signature import (
    call_signature,
    describe_change,
    distinct_tensors,
    positional_key,
    rebuild_call,
    signatures_equal,
)


@pytest.fixture
def linear():
    return nn.Linear(4, 4)


def test_same_call_shape_has_equal_signatures(linear):
    first = call_signature(linear, (torch.randn(8, 4),), {})
    second = call_signature(linear, (torch.randn(8, 4),), {})
    assert signatures_equal(first, second)
    assert describe_change(first, second) == "no change"


@pytest.mark.parametrize(
    ("old", "new", "fragments"),
    [
        pytest.param(torch.zeros(8, 4), torch.zeros(5, 4), ["float32[8, 4]", "float32[5, 4]"], id="shape"),
        pytest.param(
            torch.zeros(8, 4), torch.zeros(8, 4, dtype=torch.float64), ["float32[8, 4]", "float64[8, 4]"], id="dtype"
        ),
        pytest.param(
            torch.zeros(8, 4),
            torch.zeros(8, 4, requires_grad=True),
            ["float32[8, 4] -> float32[8, 4], requires_grad"],
            id="requires-grad",
        ),
    ],
)
def test_tensor_change_is_described(linear, old, new, fragments):
    before, after = call_signature(linear, (old,), {}), call_signature(linear, (new,), {})
    assert not signatures_equal(before, after)
    message = describe_change(before, after)
    assert message.startswith("input 0:")
    for fragment in fragments:
        assert fragment in message, message


def test_kwarg_constant_change_is_described():
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)
    before = call_signature(mha, (x, x, x), {"need_weights": True})
    after = call_signature(mha, (x, x, x), {"need_weights": False})
    assert not signatures_equal(before, after)
    assert "True -> False" in describe_change(before, after)


def test_constant_of_another_type_is_a_change(linear):
    x = torch.randn(2, 4)
    assert not signatures_equal(call_signature(linear, (x, 1), {}), call_signature(linear, (x, True), {}))
    assert signatures_equal(call_signature(linear, (x, 0.5), {}), call_signature(linear, (x, 0.5), {}))


def test_training_mode_change_is_described(linear):
    x = torch.randn(2, 4)
    before = call_signature(linear, (x,), {})
    linear.eval()
    after = call_signature(linear, (x,), {})
    assert not signatures_equal(before, after)
    assert describe_change(before, after) == "training mode True -> False"


def test_grad_mode_change_is_described(linear):
    x = torch.randn(2, 4)
    before = call_signature(linear, (x,), {})
    with torch.no_grad():
        after = call_signature(linear, (x,), {})
    assert not signatures_equal(before, after)
    assert describe_change(before, after) == "grad mode True -> False"


def test_argument_layout_change_is_described(linear):
    x = torch.randn(2, 4)
    before = call_signature(linear, (x,), {})
    after = call_signature(linear, (), {"input": x})
    assert not signatures_equal(before, after)
    assert "structure" in describe_change(before, after)


def test_aliasing_is_part_of_the_signature():
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x, y, z = (torch.randn(2, 3, 8) for _ in range(3))
    self_attention = call_signature(mha, (x, x, x), {})
    cross_attention = call_signature(mha, (x, y, z), {})
    assert not signatures_equal(self_attention, cross_attention)
    assert "same tensor" in describe_change(self_attention, cross_attention)
    assert self_attention.tensor_positions == (0,)
    assert cross_attention.tensor_positions == (0, 1, 2)
    assert distinct_tensors(self_attention, (x, x, x), {}) == [x]


def test_rebuild_call_round_trips_args_and_kwargs():
    x, y, mask = torch.randn(2, 4), torch.randn(2, 4), torch.ones(2, 2, dtype=torch.bool)
    args = (x, None, True, y, x)
    kwargs = {"mask": mask, "causal": False, "scale": None, "sizes": [3, 4]}
    signature = call_signature(nn.Identity(), args, kwargs)
    tensors = distinct_tensors(signature, args, kwargs)
    assert [t is s for t, s in zip(tensors, [x, y, mask], strict=True)] == [True, True, True]

    rebuilt_args, rebuilt_kwargs = rebuild_call(signature, tensors)
    assert rebuilt_args[1] is None
    assert rebuilt_args[2] is True
    assert rebuilt_args[0] is x
    assert rebuilt_args[3] is y
    assert rebuilt_args[4] is x
    assert rebuilt_kwargs["mask"] is mask
    assert rebuilt_kwargs["causal"] is False
    assert rebuilt_kwargs["scale"] is None
    assert rebuilt_kwargs["sizes"] == [3, 4]


def test_rebuild_call_with_new_tensors_keeps_aliasing():
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    signature = call_signature(nn.Identity(), (x, y, x), {"flag": True})
    new_x, new_y = torch.zeros(2, 4), torch.ones(2, 4)
    args, kwargs = rebuild_call(signature, [new_x, new_y])
    assert args[0] is new_x
    assert args[1] is new_y
    assert args[2] is new_x
    assert kwargs == {"flag": True}
    assert signatures_equal(signature, call_signature(nn.Identity(), args, kwargs))


def test_rebuild_call_refuses_a_wrong_number_of_tensors():
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    signature = call_signature(nn.Identity(), (x, y), {})
    with pytest.raises(ValueError):
        rebuild_call(signature, [x])


def test_fast_key_of_a_positional_tensor_call_matches_its_signature(linear):
    args = (torch.randn(2, 4), torch.randn(3, 4, requires_grad=True))
    signature = call_signature(linear, args, {})
    assert signature.positional_key is not None
    assert positional_key(args) == signature.positional_key
    assert positional_key((torch.randn(5, 4), args[1])) != signature.positional_key


@pytest.mark.parametrize(
    ("make_call"),
    [
        pytest.param(lambda x, y: ((x,), {"mask": y}), id="kwargs"),
        pytest.param(lambda x, y: ((x, 3), {}), id="non-tensor"),
        pytest.param(lambda x, y: ((x, None), {}), id="none"),
        pytest.param(lambda x, y: ((x, x), {}), id="aliased"),
        pytest.param(lambda x, y: (([x, y],), {}), id="nested-list"),
    ],
)
def test_fast_key_is_none_for_calls_that_need_the_full_signature(linear, make_call):
    args, kwargs = make_call(torch.randn(2, 4), torch.randn(2, 4))
    assert call_signature(linear, args, kwargs).positional_key is None
    if not kwargs:
        assert positional_key(args) is None
