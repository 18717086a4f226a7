"""interleaved_medians: the untimed pause before each timed call."""

import time

from mlx_batched_decode.tools.timing import interleaved_medians


def test_the_pause_is_not_timed():
    calls = []

    def fn():
        calls.append(time.perf_counter())

    (median,) = interleaved_medians([fn], warmup=1, repeats=3, pause=0.02)
    assert median < 0.01  # the 20 ms sleeps fall outside the timed calls
    gaps = [b - a for a, b in zip(calls[1:], calls[2:])]
    assert len(calls) == 4 and min(gaps) >= 0.02  # but they happen, before each timed call
