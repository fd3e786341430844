"""When TE's graphs may reuse FP8 weights: the first micro-batch of each accumulation window quantizes them."""

from lightning_cudagraph._backend.te import FP8WeightCache

BATCH = ("int64[8, 128]",)


def skip_flags(micro_batches: list[tuple[tuple[str, ...], int, bool]]) -> list[bool]:
    """TE's skip flag for each micro-batch ``(captured batch key, optimizer steps, every region replayed)``."""
    flags: list[bool] = []
    cache = FP8WeightCache(set_skip_flag=flags.append)
    for key, steps, every_region_replayed in micro_batches:
        cache.begin_microbatch(key, steps)
        assert cache.first_microbatch is not flags[-1]  # what the replays pass as ``is_first_microbatch``
        cache.end_microbatch(every_region_replayed)
    return flags


def test_weights_quantized_on_the_first_micro_batch_of_every_window():
    micro_batches = [(BATCH, step, True) for step in range(3) for _ in range(4)]
    assert skip_flags(micro_batches) == [False, True, True, True] * 3


def test_a_fallback_makes_the_next_micro_batch_quantize_again():
    micro_batches = [(BATCH, 0, True), (BATCH, 0, False), (BATCH, 0, True), (BATCH, 0, True)]
    assert skip_flags(micro_batches) == [False, True, False, True]


def test_a_window_that_starts_with_a_fallback_does_not_trust_the_previous_window():
    micro_batches = [(BATCH, 0, True), (BATCH, 0, True), (BATCH, 1, False), (BATCH, 1, True), (BATCH, 1, True)]
    assert skip_flags(micro_batches) == [False, True, False, False, True]


def test_each_captured_batch_shape_has_its_own_window():
    ragged = ("int64[5, 128]",)
    assert skip_flags([(BATCH, 0, True), (ragged, 0, True), (BATCH, 0, True)]) == [False, False, True]
