"""Unit tests of the ragged launch plan (csrc/metal/ragged_launch_plan.h): the request table and
the groups of requests, each dispatch binding at most 16 buffers, that the Metal launcher and the
emulation harness both bind. Called through the harness library, which compiles that header
unchanged.

Dimensions: B requests, H_kv KV heads, T_b request b's positions."""

from __future__ import annotations

import pytest

from tests.metal_emu.build import build_library
from tests.metal_emu.driver import RAGGED_SLOTS, EmulatedLibrary, HarnessError

ITEMSIZE = 2
# Strides (head, position) in elements of a [H_kv, T_b, D] array: D = 64, T_b = 100.
STRIDES = (6400, 64)


@pytest.fixture(scope="module")
def lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library())


def layout(lib, buffers, lengths, offsets=None, strides=None, h_kv=8, slots=RAGGED_SLOTS):
    """The table and groups of requests whose keys (b) and values (B + b) lie in buffers[i]."""
    n = len(buffers)
    return lib.ragged_layout(buffers, offsets or [0] * n, strides or [STRIDES] * n, lengths, h_kv, ITEMSIZE, slots)


def check_groups(table, groups, buffers, lengths, slots=RAGGED_SLOTS):
    """Groups cover the requests in order; each binds at most `slots` distinct buffers, and each
    request's slots hold its own buffers."""
    b = len(lengths)
    assert [g[0] for g in groups] == [sum(g[1] for g in groups[:i]) for i in range(len(groups))]
    assert sum(g[1] for g in groups) == b
    for first, count, bound in groups:
        assert len(bound) <= slots and len({buffers[i] for i in bound}) == len(bound)
        for n in range(first, first + count):
            if lengths[n]:
                assert buffers[bound[table[n]["k_slot"]]] == buffers[n]
                assert buffers[bound[table[n]["v_slot"]]] == buffers[b + n]
            assert table[n]["length"] == lengths[n]


@pytest.mark.parametrize("b", [1, 7, 8, 9, 1024])
def test_buffers_of_their_own(lib, b):
    """Two buffers per request: 8 requests per group of 16, ceil(B / 8) dispatches."""
    buffers = [4096 * (i + 1) for i in range(2 * b)]
    lengths = [1 + n % 50 for n in range(b)]
    table, groups = layout(lib, buffers, lengths)
    check_groups(table, groups, buffers, lengths)
    assert len(groups) == -(-b // 8) and all(g[1] == 8 for g in groups[:-1])


def test_keys_and_values_in_one_buffer(lib):
    """A request's keys and values in one buffer (one per request) take one slot: 16 per group."""
    b = 40
    buffers = [4096 * (n % b + 1) for n in range(2 * b)]
    offsets = [0] * b + [1 << 11] * b
    table, groups = layout(lib, buffers, [30] * b, offsets)
    check_groups(table, groups, buffers, [30] * b)
    assert [g[1] for g in groups] == [16, 16, 8]
    assert all(r["k_slot"] == r["v_slot"] for r in table) and {r["v_offset"] for r in table} == {1 << 10}


def test_shared_buffers_bind_once(lib):
    """All keys in one buffer and all values in another (a batched cache): one group, two slots,
    each request at its own offsets."""
    b = 1024
    buffers = [4096] * b + [1 << 30] * b
    offsets = [n * 12800 for n in range(b)] * 2
    lengths = [n % 5 for n in range(b)]
    table, groups = layout(lib, buffers, lengths, offsets)
    check_groups(table, groups, buffers, lengths)
    assert groups == [(0, b, [1, b + 1])]  # request 0 has no position: request 1's arrays bind
    assert [r["k_offset"] for r in table[1:4]] == [6400, 12800, 19200]


def test_requests_without_positions_bind_nothing(lib):
    """T_b = 0 requests take no slot and join the group at hand; all of them: one empty group."""
    b = 1024
    assert layout(lib, list(range(1, 2 * b + 1)), [0] * b)[1] == [(0, b, [])]
    lengths = [0, 5, 0, 0, 5, 0] * 3 + [0]
    buffers = [4096 * (i + 1) for i in range(2 * len(lengths))]
    table, groups = layout(lib, buffers, lengths, slots=4)
    check_groups(table, groups, buffers, lengths, slots=4)
    assert [(g[0], g[1]) for g in groups] == [(0, 7), (7, 6), (13, 6)]  # two requests of positions each
    assert all(r["k_offset"] == r["k_slot"] == r["k_seq_stride"] == 0 for r, n in zip(table, lengths) if n == 0)


def test_a_request_never_splits_across_groups(lib):
    """With 3 slots a request needing 2 new buffers starts a new group when 1 is left."""
    buffers = [10, 20, 30, 11, 21, 30]  # keys 10, 20, 30; values 11, 21, and 30 again (its keys' buffer)
    table, groups = layout(lib, buffers, [4, 4, 4], slots=3)
    assert groups == [(0, 1, [0, 3]), (1, 2, [1, 4, 2])]
    assert (table[2]["k_slot"], table[2]["v_slot"]) == (2, 2)


def test_strides_of_size_one_axes_are_zero(lib):
    """H_kv = 1 or T_b = 1 never steps along that axis: its stride is 0, so that it cannot spoil the
    vector loads."""
    table, _ = layout(lib, [1, 2, 3, 4], [1, 9], strides=[(7, 5)] * 4, h_kv=1)
    assert [(r["k_head_stride"], r["k_seq_stride"]) for r in table] == [(0, 0), (0, 5)]
    table, _ = layout(lib, [1, 2, 3, 4], [1, 9], strides=[(7, 5)] * 4, h_kv=2)
    assert [(r["v_head_stride"], r["v_seq_stride"]) for r in table] == [(7, 0), (7, 5)]


@pytest.mark.parametrize(
    "args,message",
    [(dict(offsets=[0, 3, 0, 0]), r"\[ragged_decode_attention\] keys\[1\] starts 3 bytes into its buffer"),
     (dict(offsets=[0, 0, 0, 5]), r"values\[1\] starts 5 bytes"),
     (dict(lengths=[2, -1]), r"request 1 has a negative length"),
     (dict(slots=1), r"a group binds 2 to 16 buffers"),
     (dict(slots=17), r"a group binds 2 to 16 buffers")])
def test_invalid_layouts_raise(lib, args, message):
    options = dict(lengths=[2, 2]) | args
    with pytest.raises(HarnessError, match=message):
        layout(lib, [1, 2, 3, 4], **options)
