"""The primitive called from several Python threads at once, each on its own CPU stream.

Results must be bitwise equal to a single-threaded run (the kernel merges its chunks in a fixed
order, whichever thread ran them), and the kernel must share one bounded thread pool rather
than start threads per call or per stream.
"""

import os
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

import mlx_batched_decode as mbd
from tests.support.numerics import DTYPES, TOLERANCE, dtype_id, make_inputs, max_abs_error, numpy_reference
from mlx_batched_decode import _ext

# Long enough to use the pool (more than 2**17 K/V elements) and to split requests into chunks.
B, H_q, H_kv, T, D = 4, 8, 2, 1100, 128
LENS = [1100, 300, 513, 0]
THREADS = 6
ITERATIONS = 25


def bits(x):
    """The raw bits of x, so that results compare bitwise (NaN payloads included)."""
    return np.array(x.view(mx.uint32 if x.dtype == mx.float32 else mx.uint16))


def thread_count():
    return len(os.listdir("/proc/self/task"))


def calls():
    """Three calls: one per dtype, one of them on a prefix view with NaN past its end."""
    out = []
    for i, dtype in enumerate(DTYPES):
        q, k, v = make_inputs(B, H_q, H_kv, T, D, dtype, seed=10 + i)
        if i == 1:
            nan = mx.full((B, H_kv, 40, D), float("nan"), dtype=dtype)
            k = mx.concatenate([k, nan], 2)[:, :, :T]
            v = mx.concatenate([v, nan], 2)[:, :, :T]
        lens = mx.array(LENS[i:] + LENS[:i], dtype=mx.int32)
        mx.eval(k, v)
        out.append((q, k, v, lens))
    return out


def run_threads(target, count):
    """Runs ``target(index)`` on ``count`` threads; returns the exceptions they raised."""
    errors = []

    def guarded(index):
        try:
            target(index)
        except Exception as e:  # noqa: BLE001  reported by the test, not swallowed
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.fixture(scope="module")
def cases():
    """The calls with their single-threaded results on the default stream."""
    results = [(args, mbd.batched_decode_attention(*args)) for args in calls()]
    mx.eval([out for _, out in results])
    return results


def test_single_threaded_results_match_reference(cases):
    for (q, k, v, lens), expected in cases:
        expected_64 = numpy_reference(q, k, v, np.array(lens))
        assert max_abs_error(expected, expected_64) < TOLERANCE[q.dtype]


def test_concurrent_streams_give_bitwise_equal_results(cases, kernel_calls):
    def worker(index):
        # MLX streams belong to the thread that made them.
        stream = mx.new_stream(mx.cpu)
        for it in range(ITERATIONS):
            # Each thread walks the calls in its own order, so different calls overlap.
            (q, k, v, lens), expected = cases[(index + it) % len(cases)]
            out = mbd.batched_decode_attention(q, k, v, lens, stream=stream)
            mx.eval(out)
            if not np.array_equal(bits(out), bits(expected)):
                raise AssertionError(
                    f"thread {index}, iteration {it}, dtype {dtype_id(q.dtype)}: differs"
                )

    assert run_threads(worker, THREADS) == []
    assert kernel_calls() == THREADS * ITERATIONS


def test_thread_growth_is_bounded_independent_of_calls(cases):
    (q, k, v, lens), _ = cases[0]
    mx.eval(mbd.batched_decode_attention(q, k, v, lens))  # the kernel's pool exists from here on
    pool = _ext.cpu_threads() - 1
    peak = {"threads": 0}

    def round_of(n_calls):
        start = thread_count()
        running = threading.Barrier(THREADS + 1)

        def worker(index):
            stream = mx.new_stream(mx.cpu)
            for it in range(n_calls):
                mx.eval(mbd.batched_decode_attention(q, k, v, lens, stream=stream))
                if it == n_calls // 2:
                    running.wait()

        def sampler(_):
            running.wait()
            peak["threads"] = max(peak["threads"], thread_count())

        peak["threads"] = 0
        assert run_threads(lambda i: (worker if i < THREADS else sampler)(i), THREADS + 1) == []
        # A joined thread may still be in /proc for a moment after join: wait for it.
        deadline = time.monotonic() + 2.0
        while thread_count() > start + THREADS and time.monotonic() < deadline:
            time.sleep(0.01)
        return start, peak["threads"], thread_count()

    for n_calls in (4, 80):
        start, during, after = round_of(n_calls)
        # Per round MLX adds one thread per new stream (kept after its thread exits); the
        # Python threads (workers and sampler) exist only during the round. The kernel adds
        # nothing beyond its pool, which already exists, whatever the number of calls.
        assert after - start <= THREADS, (start, after, n_calls)
        assert during - start <= 2 * THREADS + 1 + pool, (start, during, n_calls)
