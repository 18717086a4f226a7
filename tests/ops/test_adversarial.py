"""Adversarial and malformed calls: each works correctly or is rejected, never a crash.

The risky cases (odd layouts, extreme lengths, foreign argument types) run together in a child
interpreter, so a crash in the kernel or the bindings fails one test instead of killing pytest.
Run as a script (``python -m tests.ops.test_adversarial`` from the repository root), this file
is that child: it runs every case and prints one JSON line per case.
"""

import itertools
import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import mlx_batched_decode as mbd
from tests.support.numerics import DTYPES, TOLERANCE, dtype_id, max_abs_error, numpy_reference

B, H_q, H_kv, T, D = 3, 4, 2, 9, 64
LENS = [5, 0, T]
I32_MAX, I32_MIN = 2**31 - 1, -(2**31)


def inputs(dtype=mx.float32, seed=0, b=B, t=T, rows=1):
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((b, H_q, rows, D)), dtype=dtype)
    k = mx.array(rng.standard_normal((b, H_kv, t, D)), dtype=dtype)
    v = mx.array(rng.standard_normal((b, H_kv, t, D)), dtype=dtype)
    return q, k, v


def call(q=None, k=None, v=None, lens=None, **kw):
    """Arguments of one call: the defaults, with the given ones swapped in."""
    dq, dk, dv = inputs()
    return (
        dq if q is None else q,
        dk if k is None else k,
        dv if v is None else v,
        mx.array(LENS, dtype=mx.int32) if lens is None else lens,
    ), kw


def wide(x):
    """x seen through a view whose last axis has stride 2 (every element stored twice)."""
    return mx.repeat(x, 2, axis=-1)[..., ::2]


def reversed_axis(x, axis):
    """x seen through a view with a negative stride on ``axis``: same values, reversed twice."""
    flip = tuple(slice(None, None, -1) if i == axis else slice(None) for i in range(x.ndim))
    return mx.contiguous(x[flip])[flip]


def broadcast_axis(x, axis):
    """A stride-0 view: x's first entry along ``axis`` repeated along it."""
    first = tuple(slice(0, 1) if i == axis else slice(None) for i in range(x.ndim))
    return mx.broadcast_to(x[first], x.shape)


def ok_cases():
    """Calls that must run and match the float64 reference (lengths clamped to [0, T])."""
    q, k, v = inputs()
    cases = {
        "empty batch": call(*inputs(b=0), lens=mx.zeros((0,), mx.int32)),
        "T = 0": call(*inputs(t=0)),
        "scale 0": call(scale=0.0),
        "negative scale": call(scale=-1.0),
        "numpy float scale": call(scale=np.float32(0.5)),
        "lens broadcast": call(lens=mx.broadcast_to(mx.array([4], mx.int32), (B,))),
        "lens strided": call(lens=mx.array([5, -1, 0, -1, T, -1], mx.int32)[::2]),
        "lens reversed": call(lens=mx.array(LENS[::-1], mx.int32)[::-1]),
    }
    for name, lens in {
        "int32 extremes": mx.array([I32_MAX, I32_MIN, 1], mx.int32),
        "int64 in int32 range": mx.array([I32_MAX, I32_MIN, 4], mx.int64),
        "int8": mx.array([127, -128, 3], mx.int8),
        "int16": mx.array([-1, 2, 32767], mx.int16),
        "uint8": mx.array([255, 0, 8], mx.uint8),
        "uint16": mx.array([65535, 1, 2], mx.uint16),
        "uint32 below 2**31": mx.array([I32_MAX, 0, 7], mx.uint32),
        "uint64 below 2**31": mx.array([I32_MAX, 6, 0], mx.uint64),
    }.items():
        cases[f"lens {name}"] = call(lens=lens)
    for name, x in (("queries", q), ("keys", k), ("values", v)):
        pos = {"queries": 0, "keys": 1, "values": 2}[name]
        for axis in range(4):
            args = [q, k, v]
            args[pos] = broadcast_axis(x, axis)
            cases[f"{name} broadcast axis {axis}"] = call(*args)
            args[pos] = reversed_axis(x, axis)
            cases[f"{name} negative stride axis {axis}"] = call(*args)
        args = [q, k, v]
        args[pos] = wide(x)
        cases[f"{name} strided last axis"] = call(*args)
    cases["all strided last axis"] = call(wide(q), wide(k), wide(v))
    q_rows = inputs(rows=2 * T)[0]
    cases["more query rows than T"] = call(q_rows)
    cases["more query rows than T, window 1"] = call(q_rows, window=1)
    for name, starts in {
        "int32 extremes": mx.array([I32_MAX, I32_MIN, 1], mx.int32),
        "int64 beyond int32": mx.array([2**40, -(2**40), 3], mx.int64),
        "uint64 beyond int32": mx.array(np.array([2**63, 0, 8], np.uint64)),
        "past the lengths": mx.array([6, 3, T], mx.int32),
        "broadcast": mx.broadcast_to(mx.array([2], mx.int32), (B,)),
        "reversed": mx.array([1, 2, 3], mx.int32)[::-1],
    }.items():
        cases[f"kv_starts {name}"] = call(kv_starts=starts)
    for window in (1, 2, T, T + 1, I32_MAX):
        cases[f"window {window}"] = call(window=window)
    sinks = mx.array([0.5, -2.0, 1.0, 0.0])
    for name, value in {
        "float64": sinks.astype(mx.float64),
        "bfloat16": sinks.astype(mx.bfloat16),
        "-inf": mx.full((H_q,), -float("inf")),
        "huge": mx.full((H_q,), 1e30),
        "broadcast": mx.broadcast_to(sinks[:1], (H_q,)),
        "negative stride": sinks[::-1],
    }.items():
        cases[f"sinks {name}"] = call(sinks=value)
    cases["every option, rows past T"] = call(
        q_rows, kv_starts=mx.array([I32_MIN, 4, I32_MAX], mx.int32), window=3, sinks=sinks
    )
    return cases


def value_error_cases():
    """Calls that must raise ValueError with a message containing the given fragment."""
    q, k, v = inputs()
    lens = mx.array(LENS, mx.int32)
    cases = {
        "queries batch 0, rest 3": (call(q=q[:0]), "keys have batch size 3 but queries have 0"),
        "keys batch 4": (call(k=mx.concatenate([k, k[:1]])), "values must have the shape of keys"),
        "keys and values batch 2": (call(k=k[:2], v=v[:2]), "keys have batch size 2"),
        "lens batch 2": (call(lens=lens[:2]), "valid_lens must have shape [B] = (3,)"),
        "lens batch 4": (call(lens=mx.zeros((4,), mx.int32)), "valid_lens must have shape [B]"),
        "lens 0-d": (call(lens=mx.array(3, mx.int32)), "valid_lens must have shape [B]"),
        "lens 2-d": (call(lens=lens[None]), "valid_lens must have shape [B]"),
        "empty batch, lens 1": (
            call(*inputs(b=0), lens=mx.zeros((1,), mx.int32)), "valid_lens must have shape [B]"
        ),
    }
    for dt in (mx.bool_, mx.float16, mx.bfloat16, mx.float32, mx.float64, mx.complex64):
        cases[f"lens {dtype_id(dt)}"] = (call(lens=lens.astype(dt)), "integer dtype")
        cases[f"kv_starts {dtype_id(dt)}"] = (call(kv_starts=lens.astype(dt)), "integer dtype")
    for dt in (mx.bool_, mx.int32, mx.uint8):
        cases[f"sinks {dtype_id(dt)}"] = (call(sinks=mx.zeros((H_q,), dt)), "floating dtype")
    cases["kv_starts batch 2"] = (call(kv_starts=lens[:2]), "kv_starts must have shape [B] = (3,)")
    cases["kv_starts 0-d"] = (call(kv_starts=mx.array(1)), "kv_starts must have shape [B]")
    cases["sinks per KV head"] = (call(sinks=mx.zeros((H_kv,))), "sinks must have shape [H_q] = (4,)")
    cases["sinks 2-d"] = (call(sinks=mx.zeros((1, H_q))), "sinks must have shape [H_q]")
    cases["sinks 0-d"] = (call(sinks=mx.array(1.0)), "sinks must have shape [H_q]")
    for window in (0, -1, I32_MIN):
        cases[f"window {window}"] = (call(window=window), "window must be >= 1")
    cases["no query rows"] = (call(q=inputs(rows=0)[0]), "at least one row per request")
    scalar, five_d = mx.array(1.0), mx.zeros((1, B, H_kv, T, D))
    for name, pos, message in (
        ("queries", 0, "queries must have shape"),
        ("keys", 1, "keys must have shape"),
        ("values", 2, "values must have the shape of keys"),
    ):
        for rank, x in (("0-d", scalar), ("5-d", five_d), ("1-d", mx.zeros((D,)))):
            args = [q, k, v]
            args[pos] = x
            cases[f"{name} {rank}"] = (call(*args), message)
    # Every dtype triple except the three valid ones (all float16, all bfloat16, all float32).
    pool = DTYPES + [mx.float64, mx.int32]
    for dq, dk, dv in itertools.product(pool, repeat=3):
        if dq == dk == dv and dq in DTYPES:
            continue
        message = "queries must be float16" if dq not in DTYPES else "must share one dtype"
        name = f"dtypes {dtype_id(dq)}/{dtype_id(dk)}/{dtype_id(dv)}"
        cases[name] = (call(q.astype(dq), k.astype(dk), v.astype(dv)), message)
    return cases


def type_error_cases():
    """Arguments of the wrong Python type: nanobind must raise TypeError."""
    q, k, v = inputs()
    lens = mx.array(LENS, mx.int32)
    foreign = {
        "numpy": lambda x: np.array(x),
        "list": lambda x: np.array(x).tolist(),
        "None": lambda x: None,
        "int": lambda x: 3,
        "str": lambda x: "keys",
    }
    cases = {}
    for name, pos in (("queries", 0), ("keys", 1), ("values", 2), ("valid_lens", 3)):
        for kind, convert in foreign.items():
            args = [q, k, v, lens]
            args[pos] = convert(args[pos])
            # None is a valid placeholder of call(); pass the arguments positionally instead.
            cases[f"{name} as {kind}"] = (tuple(args), {})
    cases["scale as str"] = call(scale="0.5")
    cases["stream as str"] = call(stream="cpu")
    cases["window as float"] = call(window=2.0)
    cases["window as str"] = call(window="2")
    cases["window beyond int32"] = call(window=2**31)
    cases["kv_starts as list"] = call(kv_starts=[0, 1, 2])
    cases["sinks as numpy"] = call(sinks=np.zeros(H_q, np.float32))
    return cases


def run_case(args, kwargs):
    """Runs one call; returns its outcome as JSON-able data."""
    try:
        out = mbd.batched_decode_attention(*args, **kwargs)
        mx.eval(out)
    except (ValueError, TypeError) as e:
        return {"outcome": type(e).__name__, "message": str(e)}
    q, k, v, lens = args
    starts, sinks = kwargs.get("kv_starts"), kwargs.get("sinks")
    # numpy_reference clamps each position to [0, T]; it reads the views through numpy.
    expected = numpy_reference(
        q, k, v, np.array(lens), kwargs.get("scale"),
        kv_starts=None if starts is None else [min(max(n, -1), T + 1) for n in np.array(starts).tolist()],
        window=kwargs.get("window"),
        sinks=sinks,
    )
    return {
        "outcome": "ok",
        "shape_and_dtype_match": out.shape == q.shape and out.dtype == q.dtype,
        "error": max_abs_error(out, expected),
        "tolerance": TOLERANCE.get(q.dtype, 0.0),
    }


def main():
    """Child mode: runs every case, flushing each result so a crash shows where it happened."""
    for group in (ok_cases, value_error_cases, type_error_cases):
        for name, case in group().items():
            if isinstance(case[1], str):
                case = case[0]
            print(json.dumps({"name": name, **run_case(*case)}), flush=True)


@pytest.fixture(scope="module")
def outcomes():
    # The child starts like this interpreter (same -S flag, same path), so that it imports the
    # same build of the package: the sanitized one when test_sanitizers runs this file.
    code = (
        f"import sys; sys.path[:0] = {sys.path!r}\n"
        f"import mlx_batched_decode as m; assert m._ext.__file__ == {mbd._ext.__file__!r}\n"
        f"import runpy; runpy.run_path({__file__!r})"
    )
    flags = ["-S"] if sys.flags.no_site else []
    done = subprocess.run(
        [sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=600
    )
    results = {}
    for line in done.stdout.splitlines():
        row = json.loads(line)
        results[row.pop("name")] = row
    last = list(results)[-1] if results else None
    assert done.returncode == 0, (
        f"child exited with {done.returncode} after case {last!r}:\n{done.stderr[-3000:]}"
    )
    return results


@pytest.fixture(scope="module")
def tally(request):
    """Counts cases tried and rejected; reports them when the module finishes."""
    counts = {"tried": 0, "rejected": 0}
    yield counts
    # Shown even under output capture, like pytest's own summary.
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print(
            f"\nadversarial inputs: {counts['tried']} cases tried, "
            f"{counts['rejected']} rejected with ValueError or TypeError"
        )


@pytest.mark.parametrize("name", list(ok_cases()))
def test_accepted_and_correct(outcomes, tally, name):
    result = outcomes[name]
    tally["tried"] += 1
    assert result["outcome"] == "ok", result
    assert result["shape_and_dtype_match"]
    assert result["error"] < result["tolerance"], result


@pytest.mark.parametrize("name,message", [(n, c[1]) for n, c in value_error_cases().items()])
def test_rejected_with_value_error(outcomes, tally, name, message):
    result = outcomes[name]
    tally["tried"] += 1
    tally["rejected"] += result["outcome"] == "ValueError"
    assert result["outcome"] == "ValueError", result
    assert result["message"].startswith("[batched_decode_attention] ")
    assert message in result["message"]


@pytest.mark.parametrize("name", list(type_error_cases()))
def test_rejected_with_type_error(outcomes, tally, name):
    result = outcomes[name]
    tally["tried"] += 1
    tally["rejected"] += result["outcome"] == "TypeError"
    assert result["outcome"] == "TypeError", result


def test_wide_lengths_beyond_int32_are_clamped_to_T():
    # Clamped in their own dtype before the int32 cast, so they cannot wrap.
    q, k, v = inputs()
    lens = [2**32 + 2, 2**31, -(2**32) + 1][:B]
    out = mbd.batched_decode_attention(q, k, v, mx.array(lens, mx.int64))
    assert max_abs_error(out, numpy_reference(q, k, v, lens)) < TOLERANCE[mx.float32]


@pytest.mark.parametrize("dtype", [mx.uint32, mx.uint64, mx.int64])
def test_unsigned_and_64_bit_lengths_clamp_like_the_reference(dtype):
    q, k, v = inputs()
    lens = mx.array([2**32 - 1, 2**31, 3][:B], dtype)
    out = mbd.batched_decode_attention(q, k, v, lens)
    expected = numpy_reference(q, k, v, [2**32 - 1, 2**31, 3][:B])
    assert max_abs_error(out, expected) < TOLERANCE[mx.float32]
    assert max_abs_error(mbd.reference_attention(q, k, v, lens), expected) < TOLERANCE[mx.float32]


def sprinkle(x, rng, count):
    """x with ``count`` random entries replaced by NaN, +inf or -inf."""
    a = np.array(x.astype(mx.float32))
    flat = a.reshape(-1)
    idx = rng.choice(flat.size, size=count, replace=False)
    flat[idx] = rng.choice([np.nan, np.inf, -np.inf], size=count)
    return mx.array(a).astype(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("seed", range(12))
def test_non_finite_values_propagate_like_the_reference(dtype, seed):
    rng = np.random.default_rng(seed)
    q, k, v = inputs(dtype, seed)
    # A few non-finite entries in one or more of q, k, v, valid region and padding alike.
    targets = rng.choice(3, size=rng.integers(1, 4), replace=False)
    q, k, v = [sprinkle(x, rng, 3) if i in targets else x for i, x in enumerate((q, k, v))]
    lens = mx.array(rng.integers(-1, T + 2, size=B), mx.int32)
    out = np.array(mbd.batched_decode_attention(q, k, v, lens).astype(mx.float32))
    ref = np.array(mbd.reference_attention(q, k, v, lens).astype(mx.float32))
    assert np.array_equal(np.isnan(out), np.isnan(ref))
    assert np.array_equal(np.isposinf(out), np.isposinf(ref))
    assert np.array_equal(np.isneginf(out), np.isneginf(ref))
    finite = np.isfinite(ref)
    assert np.max(np.abs(out[finite] - ref[finite]), initial=0.0) < TOLERANCE[dtype]


@pytest.mark.parametrize("scale", [1e30, -1e30, 3e38, 1e-45])
def test_extreme_scales_behave_like_the_reference(scale):
    # 3e38 overflows the scores to inf: NaN there, exactly where the reference has it.
    q, k, v = inputs()
    lens = mx.array(LENS, mx.int32)
    out = np.array(mbd.batched_decode_attention(q, k, v, lens, scale=scale))
    ref = np.array(mbd.reference_attention(q, k, v, lens, scale=scale))
    assert np.array_equal(np.isnan(out), np.isnan(ref))
    finite = ~np.isnan(ref)
    assert np.max(np.abs(out[finite] - ref[finite]), initial=0.0) < TOLERANCE[mx.float32]


if __name__ in ("__main__", "<run_path>"):
    main()
