"""Bucketed padding: variable-length data in a few shapes, which the per-shape cache then replays."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_cudagraph import CUDAGraphCallback, Stage
from lightning_cudagraph.bucketing import PadToBucket, bucket_length
from tests.fake_backend import FakeBackend
from tests.helpers import assert_losses_close, fit
from tests.models import TINY, DecoderModule, decoder


@pytest.mark.parametrize(
    ("length", "options", "expected"),
    [(1, {"buckets": [4, 8]}, 4), (4, {"buckets": [4, 8]}, 4), (5, {"buckets": [4, 8]}, 8), (9, {"multiple": 8}, 16)],
)
def test_bucket_length(length, options, expected):
    assert bucket_length(length, **options) == expected


def test_tuple_samples_are_padded_per_position_and_stacked():
    collate = PadToBucket(multiple=4, pad_values={1: -100})
    x, y = collate([(torch.arange(3), torch.arange(3)), (torch.arange(6), torch.arange(6))])
    assert x.shape == y.shape == (2, 8)
    assert x[0].tolist() == [0, 1, 2, 0, 0, 0, 0, 0] and y[0].tolist() == [0, 1, 2, -100, -100, -100, -100, -100]


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        pytest.param({}, ["exactly one of them"], id="neither"),
        pytest.param({"buckets": [8], "multiple": 8}, ["exactly one of them"], id="both"),
        pytest.param({"buckets": [16, 8]}, ["increasing positive lengths"], id="unsorted"),
        pytest.param({"multiple": 0}, ["multiple=0"], id="multiple-zero"),
    ],
)
def test_bad_options_are_refused(options, fragments):
    with pytest.raises(ValueError, match="PadToBucket") as error:
        PadToBucket(**options)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_a_sample_longer_than_every_bucket_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"the longest here is 9.*add a bucket of at least 9"):
        PadToBucket(buckets=[4, 8])([(torch.arange(9),)])


class _MaskedLoss(DecoderModule):
    """Ignores padded targets (-100), as a model trained on padded batches does."""

    def loss(self, batch):
        x, y = batch
        logits = self(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)


def variable_length_loader(lengths: list[int], collate: PadToBucket) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    samples = []
    for length in lengths:
        tokens = torch.randint(TINY["vocab_size"], (length + 1,), generator=generator)
        samples.append((tokens[:-1], tokens[1:]))
    return DataLoader(samples, batch_size=2, collate_fn=collate)


def test_variable_lengths_padded_to_two_buckets_replay_two_graph_sets():
    lengths = [3, 5, 9, 14, 6, 7, 12, 16, 2, 4, 10, 11, 5, 8, 13, 15] * 2  # 16 batches of 2
    collate = PadToBucket(buckets=[8, 16], pad_values={1: -100})
    callback = CUDAGraphCallback(scope=["layer"], warmup_steps=2, on_shape_change="recapture", max_graphs=2)
    callback.capture_backend = FakeBackend()
    model = decoder(TINY, module=_MaskedLoss)[0]
    run = fit(model, variable_length_loader(lengths, collate), 16, [callback], accelerator="cpu", devices=1)
    report = callback.report
    assert report.stage == Stage.REPLAYING and (report.captures, report.evictions) == (2, 0)
    assert report.hit_rate > 0.8
    eager = fit(decoder(TINY, module=_MaskedLoss)[0], variable_length_loader(lengths, collate), 16, accelerator="cpu")
    assert_losses_close(eager.losses, run.losses, 1e-6)


# ---------------------------------------------------------------------------------------------- borderline inputs
@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        ({"buckets": "8,16"}, ["buckets='8,16'", "buckets=[8, 16]"]),
        ({"buckets": [8], "pad_values": {"labels": "pad"}}, ["pad_values", "a number per field"]),
        ({"buckets": [8], "pad_values": {"labels": float("nan")}}, ["pad_values", "a number per field"]),
    ],
)
def test_string_buckets_and_pad_values_that_are_not_numbers_are_refused(options, fragments):
    with pytest.raises(ValueError, match="PadToBucket") as error:
        PadToBucket(**options)
    for fragment in fragments:
        assert fragment in str(error.value), str(error.value)


def test_a_fractional_pad_value_on_an_integer_field_is_refused_not_rounded():
    collate = PadToBucket(buckets=[8], pad_values={"labels": -100.5})
    samples = [{"labels": torch.ones(3, dtype=torch.long)}]
    with pytest.raises(ValueError, match=r"integer pad value for the integer field 'labels'.*-100"):
        collate(samples)
    floats = PadToBucket(buckets=[8], pad_values={"weights": 0.5})([{"weights": torch.ones(3)}])
    assert floats["weights"][0, -1].item() == 0.5, "a float field takes a float pad value"


def test_bare_token_tensors_namedtuples_and_text_fields_are_collated():
    collate = PadToBucket(buckets=[8, 16])
    tokens = collate([torch.ones(5, dtype=torch.long), torch.ones(9, dtype=torch.long)])
    assert tokens.shape == (2, 16) and tokens[0, 5:].eq(0).all()

    Pair = collections.namedtuple("Pair", ["ids", "labels"])
    pairs = collate([Pair(torch.ones(3, dtype=torch.long), torch.ones(3, dtype=torch.long))])
    assert isinstance(pairs, Pair) and pairs.ids.shape == (1, 8)

    rows = collate(
        [
            {"input_ids": torch.ones(4, dtype=torch.long), "text": "a b c d"},
            {"input_ids": torch.ones(2, dtype=torch.long), "text": "e f"},
        ]
    )
    assert rows["text"] == ["a b c d", "e f"] and rows["input_ids"].shape == (2, 8)


def test_an_empty_batch_and_samples_with_other_fields_get_a_clear_error():
    collate = PadToBucket(buckets=[8])
    with pytest.raises(ValueError, match="PadToBucket: got no samples"):
        collate([])
    with pytest.raises(ValueError, match=r"sample 1 has other fields than sample 0 \(\['input_ids'\] against"):
        collate([{"input_ids": torch.ones(2), "labels": torch.ones(2)}, {"input_ids": torch.ones(2)}])
