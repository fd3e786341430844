"""Pad variable-length samples to a few lengths, so that real data replays a few graphs instead of none.

A graph replays one set of shapes. A collator that pads each batch to its longest sample makes a new shape for
almost every batch; padding to a small set of lengths (buckets, or multiples of a number) bounds the shapes to
that set, and the per-shape cache (``on_shape_change="recapture"``, ``max_graphs``) holds a graph set for each.
The model handles padding as usual (an attention mask, ``-100`` labels the loss ignores).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_cudagraph._options.config import config_error
from lightning_cudagraph._options.normalization import plain


def bucket_length(length: int, buckets: Sequence[int] | None = None, multiple: int | None = None) -> int:
    """The smallest bucket at least ``length`` long, or ``length`` rounded up to a multiple of ``multiple``.

    Example:
        >>> bucket_length(70, buckets=[64, 128, 256]), bucket_length(70, multiple=32)
        (128, 96)
    """
    buckets, multiple = _plain_lengths(buckets), plain(multiple)
    if buckets is not None:
        index = bisect.bisect_left(buckets, length)
        if index == len(buckets):
            raise config_error(
                "PadToBucket",
                "buckets",
                list(buckets),
                f"buckets that cover every sample (the longest here is {length})",
                f"add a bucket of at least {length}, or truncate samples to {buckets[-1]}",
            )
        return buckets[index]
    if multiple is None:
        raise config_error(
            "bucket_length", "multiple", multiple, "buckets or a multiple", "pass buckets=[64, 128] or multiple=64"
        )
    return -(-length // multiple) * multiple


class PadToBucket:
    """A ``collate_fn`` that pads every sample's tensors to one bucket length, then stacks them.

    Each sample is a mapping, a sequence (a tuple, a list, a namedtuple) or a single tensor whose first dimension is
    the length (token ids, labels, an attention mask). The batch is padded to the bucket of its longest sample. A
    field of strings (a Hugging Face ``text`` column) is kept as a list of the samples' strings, as Lightning's default
    collate keeps it.

    Args:
        buckets: Allowed lengths, e.g. ``[64, 128, 256, 512]``.
        multiple: Or pad to a multiple of this (like Hugging Face's ``pad_to_multiple_of``).
        pad_values: The pad value per field (a key of mapping samples, a position of sequence samples, or ``0`` for
            samples that are single tensors); 0 for the others. Labels the loss ignores are usually ``-100``.

    NumPy values (``np.array([64, 128])``, ``np.int64(64)``) are taken as the Python numbers they hold. A field that
    holds ``None`` in a sample is refused, naming the field and the sample.

    Example:
        >>> import torch
        >>> collate = PadToBucket(buckets=[8, 16], pad_values={"labels": -100})
        >>> samples = [{"input_ids": torch.ones(5, dtype=torch.long), "labels": torch.ones(5, dtype=torch.long)},
        ...            {"input_ids": torch.ones(7, dtype=torch.long), "labels": torch.ones(7, dtype=torch.long)}]
        >>> batch = collate(samples)
        >>> batch["input_ids"].shape, batch["labels"][0].tolist()
        (torch.Size([2, 8]), [1, 1, 1, 1, 1, -100, -100, -100])
    """

    def __init__(
        self,
        buckets: Sequence[int] | None = None,
        multiple: int | None = None,
        pad_values: Mapping[Any, float | int] | None = None,
    ) -> None:
        buckets, multiple = _plain_lengths(buckets), plain(multiple)
        if pad_values is not None and isinstance(pad_values, Mapping):
            pad_values = {plain(key): plain(value) for key, value in pad_values.items()}
        if (buckets is None) == (multiple is None):
            raise config_error(
                "PadToBucket", "buckets/multiple", (buckets, multiple), "exactly one of them", "pass buckets=[...]"
            )
        if isinstance(buckets, str):
            lengths = [part.strip() for part in buckets.replace(";", ",").split(",") if part.strip()]
            raise config_error(
                "PadToBucket",
                "buckets",
                buckets,
                "a list of increasing positive integer lengths",
                f"pass a list, e.g. buckets={[int(p) if p.isdigit() else p for p in lengths]!r}",
            )
        if buckets is not None and not all(isinstance(b, int) and not isinstance(b, bool) for b in buckets):
            raise config_error(
                "PadToBucket",
                "buckets",
                buckets,
                "increasing positive integer lengths",
                f"pass whole lengths, e.g. {[_whole(b) for b in buckets]!r} (a tensor is padded to a whole length)",
            )
        if buckets is not None and (not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1):
            raise config_error(
                "PadToBucket", "buckets", buckets, "increasing positive lengths", "pass e.g. [64, 128, 256]"
            )
        if multiple is not None and (isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1):
            raise config_error("PadToBucket", "multiple", multiple, "a positive integer", "pass e.g. multiple=64")
        for key in pad_values or {}:
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise config_error(
                    "PadToBucket",
                    "pad_values",
                    dict(pad_values or {}),
                    "keys that are field names (mapping samples) or positions (sequence samples)",
                    "pass e.g. pad_values={'labels': -100} or pad_values={1: -100}",
                )
        for key, value in (pad_values or {}).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise config_error(
                    "PadToBucket",
                    "pad_values",
                    dict(pad_values or {}),
                    "a number per field (an integer for integer fields such as token ids and labels)",
                    f"pass a number for {key!r}, e.g. pad_values={{{key!r}: -100}}",
                )
        self.buckets = list(buckets) if buckets is not None else None
        self.multiple = multiple
        self.pad_values = dict(pad_values or {})

    def __call__(self, samples: Sequence[Any]) -> Any:
        """Pad and stack ``samples``; a ``pad_values`` key that names no field of them is refused."""
        if not samples:
            raise ValueError(
                "PadToBucket: got no samples to collate. Fix: a DataLoader batch holds at least one sample"
            )
        first = samples[0]
        if isinstance(first, Tensor):  # bare token tensors: one field
            self._check_bare_pad_keys(first)
            return self._stack([{0: sample} for sample in samples], [0], bare=True)[0]
        fields = list(first) if isinstance(first, Mapping) else list(range(len(first)))
        self._check_pad_keys(first, fields)
        for index, sample in enumerate(samples):
            missing = [name for name in fields if name not in sample] if isinstance(first, Mapping) else []
            if missing or (not isinstance(first, Mapping) and len(sample) != len(fields)):
                raise ValueError(
                    f"PadToBucket: sample {index} has other fields than sample 0 ({_fields(sample)} against"
                    f" {fields}). Fix: give every sample the same fields (a collator pads them, it cannot invent them)"
                )
        padded = self._stack(samples, fields)
        if isinstance(first, Mapping):
            return padded
        values = [padded[i] for i in fields]
        return type(first)(*values) if hasattr(first, "_fields") else type(first)(values)

    def _stack(self, samples: Sequence[Any], fields: list[Any], bare: bool = False) -> dict[Any, Any]:
        """Each field of ``samples`` padded to the batch's bucket and stacked (strings kept as a list)."""
        text = {name for name in fields if isinstance(samples[0][name], str)}
        tensors = {
            name: [_tensor(sample[name], name, index, bare) for index, sample in enumerate(samples)]
            for name in fields
            if name not in text
        }
        longest = max((_length(tensor) for values in tensors.values() for tensor in values), default=0)
        length = bucket_length(longest, self.buckets, self.multiple)
        stacked: dict[Any, Any] = {name: [sample[name] for sample in samples] for name in text}
        for name, values in tensors.items():
            stacked[name] = torch.stack([self._pad(tensor, name, length) for tensor in values])
        return {name: stacked[name] for name in fields}

    def _pad(self, tensor: Tensor, name: Any, length: int) -> Tensor:
        if tensor.dim() == 0:
            return tensor
        pad = self.pad_values.get(name, 0)
        if not tensor.is_floating_point() and not tensor.is_complex() and pad != int(pad):
            raise config_error(
                "PadToBucket",
                "pad_values",
                self.pad_values,
                f"an integer pad value for the integer field {name!r} ({tensor.dtype})",
                f"pass a whole number, e.g. pad_values={{{name!r}: {math.trunc(pad)}}}",
            )
        filler = tensor.new_full((length - tensor.shape[0], *tensor.shape[1:]), pad)
        return torch.cat([tensor, filler])

    def _check_bare_pad_keys(self, first: Tensor) -> None:
        """Samples that are single tensors have one field, position 0: any other ``pad_values`` key would be ignored."""
        unknown = [key for key in self.pad_values if key != 0]
        if not unknown:
            return
        value = self.pad_values[unknown[0]]
        raise config_error(
            "PadToBucket",
            "pad_values",
            self.pad_values,
            f"only the key 0 for samples that are single tensors (these are {first.dtype} tensors of shape"
            f" {list(first.shape)}: one field, so a key such as {unknown[0]!r} names nothing and would be ignored)",
            f"pass pad_values={{0: {value!r}}} to pad them with {value!r}, or have the Dataset return a dict (e.g."
            " {'input_ids': ..., 'labels': ...}) to pad its fields with different values",
        )

    def _check_pad_keys(self, first: Any, fields: list[Any]) -> None:
        unknown = [key for key in self.pad_values if key not in fields]
        if not unknown:
            return
        if isinstance(first, Mapping):
            allowed, fix = f"keys of the samples: {fields}", "use the samples' own keys"
        else:
            allowed = f"positions 0 to {len(fields) - 1} of the {type(first).__name__} samples"
            named = [key for key in unknown if isinstance(key, str)]
            fix = (
                f"samples are {type(first).__name__}s, so fields are positions: pass e.g. pad_values={{1: -100}} for"
                f" the second element (with {named[0]!r} as a key every field would be padded with 0)"
                if named
                else "pass positions the samples have"
            )
        raise config_error("PadToBucket", "pad_values", self.pad_values, allowed, fix)


def _fields(sample: Any) -> list[Any]:
    return list(sample) if isinstance(sample, Mapping) else list(range(len(sample)))


def _whole(value: Any) -> Any:
    try:
        return math.ceil(value)
    except (TypeError, ValueError):
        return value


def _plain_lengths(lengths: Any) -> Any:
    """``buckets=`` with NumPy arrays and scalars as the Python lists and numbers they hold."""
    lengths = plain(lengths)
    return [plain(length) for length in lengths] if isinstance(lengths, (list, tuple)) else lengths


def _tensor(value: Any, name: Any, index: int, bare: bool) -> Tensor:
    """A sample's field as a tensor, or a ``ValueError`` naming the field and the sample (``None``, a dict...)."""
    where = f"samples[{index}]" if bare else f"samples[{index}][{name!r}]"
    if value is None:
        what = f"sample {index}" if bare else f"field {name!r} of sample {index}"
        raise config_error(
            "PadToBucket",
            where,
            None,
            "tensors, numbers, lists of numbers, or strings in every sample",
            f"{what} is None; give it a value in the Dataset (e.g. a tensor of -100 labels the loss ignores), or drop"
            f" the field from every sample; a sample without it cannot be stacked with the others",
        )
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise config_error(
            "PadToBucket",
            where,
            value,
            "tensors, numbers, lists of numbers, or strings in every sample",
            f"make it a tensor or a list of numbers in the Dataset (torch.as_tensor says: {error})",
        ) from error


def _length(tensor: Tensor) -> int:
    return tensor.shape[0] if tensor.dim() else 0
