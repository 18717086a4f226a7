"""Decode-context benchmark: the per-step context built once vs rebuilt in every layer.

One decode step of an N-layer attention stack on the zero-copy path (``SlotKVCache`` +
``SlotAttention`` + ``batched_decode_attention``; Llama-3-8B heads H_q 32, H_kv 8, D 128,
float16, mixed contexts of 16-127 tokens so the kernels do not hide the host work). Each layer's
queries are the previous layer's output, so the layers form one chain as in a model. Variants:

- ``once``: one ``BatchedDecodeContext`` per step, read by every layer (this project);
- ``per-layer``: a fresh ``BatchedDecodeContext`` in every layer, i.e. the seed's per-layer
  ``mx.array(seq_lens)``, ``max``, ``valid_lens``, ``pad_sizes``, ``positions`` (and ``rows``).

Per (N, B, variant): median host time to build the step's graph (context + wrappers, nothing
evaluated), median time of the whole step (build + ``mx.eval``), and the arrays in the step's
graph, counted from ``mx.export_to_dot``: every array node (an output MLX allocates when the step
is evaluated, or a leaf: inputs, caches, host-to-device copies, scalar constants) and, of those,
the leaves. Both variants must give bit-identical outputs, and the output must match
``reference_attention`` applied layer by layer to the caches the step wrote.

Then, for B=8, N=32: the host overhead of the Python layer per step and per layer, and two checks
that nothing is read from the device while a step's graph is built: the fused kernel's call
counter does not move during construction (and moves by N at evaluation), and the same step
traces under ``mx.compile``, whose tracer raises on any evaluation (``.item()``, ``.tolist()``).

    python benchmarks/bench_context.py            # N in {8, 32, 64} x B in {1, 8, 32}
    python benchmarks/bench_context.py --quick    # N in {8, 32} x B in {1, 8}
"""

import argparse
import io
import time

import mlx.core as mx
import numpy as np

from mlx_batched_decode import (
    BatchedDecodeContext,
    SlotAttention,
    SlotKVCache,
    _ext,
    reference_attention,
)

from common import machine, median_seconds, print_table, save

H_Q, H_KV, D = 32, 8, 128
DTYPE = mx.float16


class Stack:
    """N layers of slot caches holding B requests of mixed lengths, and one step's inputs."""

    def __init__(self, layers, batch, seed=0):
        rng = np.random.default_rng(seed)
        self.seq_lens = [int(n) for n in rng.integers(16, 128, size=batch)]
        self.caches = [SlotKVCache(step=128) for _ in range(layers)]
        for cache in self.caches:
            for slot, n in enumerate(self.seq_lens):
                kv = mx.random.normal((2, 1, H_KV, n, D)).astype(DTYPE)
                cache.write_prompt(slot, kv[0], kv[1])
        self.queries = mx.random.normal((batch, H_Q, 1, D)).astype(DTYPE)
        # Distinct new K/V per layer, as a model's projections would give.
        self.new_kv = [
            tuple(mx.random.normal((2, batch, H_KV, 1, D)).astype(DTYPE)) for _ in range(layers)
        ]
        mx.eval(self.buffers(), self.queries, self.new_kv)
        self.attention = SlotAttention()

    def buffers(self, caches=None):
        return [(c.keys, c.values) for c in caches or self.caches]

    def step(self, per_layer, caches=None, queries=None):
        """Build one step's graph (nothing evaluated); returns the last layer's output."""
        caches = caches or self.caches
        batch = len(self.seq_lens)
        h = self.queries if queries is None else queries
        context = None if per_layer else BatchedDecodeContext(batch, self.seq_lens, caches)
        for layer, (keys, values) in enumerate(self.new_kv):
            ctx = BatchedDecodeContext(batch, self.seq_lens, caches) if per_layer else context
            h = self.attention(ctx, layer, h, keys, values)
        return h

    def reference(self):
        """The step's output from reference_attention over the caches the step wrote."""
        batch = len(self.seq_lens)
        lens = mx.array([n + 1 for n in self.seq_lens], dtype=mx.int32)
        end = max(self.seq_lens) + 1
        h = self.queries
        for cache in self.caches:
            h = reference_attention(h, cache.keys[:batch, :, :end], cache.values[:batch, :, :end], lens)
        return h


def time_steps(stack, variants=(False, True), warmup=3, repeats=21):
    """Per variant (``per_layer`` flag): median seconds of graph construction alone and of the
    whole step (build + eval), and the last output. Variants alternate within each repeat, so
    the load of other processes falls on both alike."""
    times = {v: ([], []) for v in variants}
    outs = {}
    for i in range(warmup + repeats):
        for per_layer in variants:
            start = time.perf_counter()
            out = stack.step(per_layer)
            built = time.perf_counter()
            # The caches' new buffers are evaluated too: every step starts from the same state.
            mx.eval(out, stack.buffers())
            if i >= warmup:
                times[per_layer][0].append(built - start)
                times[per_layer][1].append(time.perf_counter() - start)
            outs[per_layer] = out
    return {v: (float(np.median(b)), float(np.median(t)), outs[v]) for v, (b, t) in times.items()}


def count_arrays(stack, per_layer):
    """(array nodes, leaf array nodes) in one step's graph, from its DOT export."""
    out = stack.step(per_layer)
    dot = io.StringIO()
    mx.export_to_dot(dot, out, stack.buffers())
    mx.eval(out, stack.buffers())
    lines = dot.getvalue().splitlines()
    # Node lines start with "{"; primitives carry a label, arrays don't; leaves rank as sources.
    arrays = sum(1 for ln in lines if ln.startswith("{") and "label" not in ln)
    leaves = sum(1 for ln in lines if ln.startswith("{ rank=source;"))
    return arrays, leaves


def bench_case(layers, batch):
    stack = Stack(layers, batch)
    rows, outs = [], []
    timed = time_steps(stack)
    for per_layer in (False, True):
        build, step, out = timed[per_layer]
        arrays, leaves = count_arrays(stack, per_layer)
        outs.append(out)
        rows.append(
            {
                "N": layers, "B": batch, "context": "per-layer" if per_layer else "once",
                "build_ms": build * 1e3, "step_ms": step * 1e3, "arrays": arrays, "leaves": leaves,
            }
        )
    assert mx.array_equal(outs[0], outs[1]).item(), f"N={layers} B={batch}: variants disagree"
    err = mx.abs(outs[0].astype(mx.float32) - stack.reference().astype(mx.float32)).max().item()
    assert err < 1e-2, f"N={layers} B={batch}: max error {err} against reference_attention"
    for row in rows:
        row.update(
            max_err=err,
            build_x=row["build_ms"] / rows[0]["build_ms"],
            step_x=row["step_ms"] / rows[0]["step_ms"],
            extra_arrays=row["arrays"] - rows[0]["arrays"],
        )
    return rows


def host_overhead(layers=32, batch=8, repeats=51):
    """Host cost of the Python layer in one step, and the no-device-read checks."""
    stack = Stack(layers, batch)
    context_s = median_seconds(
        lambda: BatchedDecodeContext(batch, stack.seq_lens, stack.caches), repeats=repeats
    )
    build_s, step_s, _ = time_steps(stack, (False,), repeats=repeats)[False]

    calls = _ext.cpu_kernel_calls()
    out = stack.step(False)
    calls_during_build = _ext.cpu_kernel_calls() - calls
    mx.eval(out, stack.buffers())
    calls_during_eval = _ext.cpu_kernel_calls() - calls - calls_during_build

    def traced(buffers, queries):
        # Fresh caches over the traced buffers: the tracer never leaks into the stack's caches.
        caches = [SlotKVCache(step=128) for _ in buffers]
        for cache, (keys, values) in zip(caches, buffers):
            cache.keys, cache.values = keys, values
        return stack.step(False, caches=caches, queries=queries)

    compiled = mx.compile(traced)(stack.buffers(), stack.queries)
    assert mx.array_equal(compiled, out).item(), "the compiled step disagrees with the eager one"
    return {
        "N": layers, "B": batch,
        "context_us": context_s * 1e6,
        "build_us": build_s * 1e6,
        "wrapper_us_per_layer": (build_s - context_s) / layers * 1e6,
        "eval_ms": (step_s - build_s) * 1e3,
        "host_fraction": build_s / step_s,
        "kernel_calls_during_build": calls_during_build,
        "kernel_calls_during_eval": calls_during_eval,
        "traces_under_compile": True,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N in {8, 32} x B in {1, 8}")
    parser.add_argument("--output", default="context", help="results/<name>.json")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    info = machine() | {"cpu_isa": _ext.cpu_isa(), "threads": _ext.cpu_threads()}
    print(f"{info['cpu']}, {info['cores']} cores, kernel {info['cpu_isa']}")
    cases = [(n, b) for n in ((8, 32) if args.quick else (8, 32, 64)) for b in ((1, 8) if args.quick else (1, 8, 32))]
    rows = []
    for i, (layers, batch) in enumerate(cases, 1):
        case = bench_case(layers, batch)
        rows += case
        once, per_layer = case
        print(
            f"[{i}/{len(cases)}] N={layers} B={batch}: build {once['build_ms']:.2f} vs "
            f"{per_layer['build_ms']:.2f} ms, step {once['step_ms']:.2f} vs {per_layer['step_ms']:.2f} ms",
            flush=True,
        )

    print("\nOne decode step, context built once vs rebuilt per layer (medians; arrays from the step's graph):")
    print_table(
        rows,
        [
            ("N", "N", "{}"), ("B", "B", "{}"), ("context", "context", "{}"),
            ("build_ms", "build ms", "{:.3f}"), ("build_x", "x once", "{:.2f}"),
            ("step_ms", "step ms", "{:.2f}"), ("step_x", "x once", "{:.2f}"),
            ("arrays", "arrays", "{}"), ("extra_arrays", "+ arrays", "{}"), ("leaves", "leaves", "{}"),
            ("max_err", "max err", "{:.1e}"),
        ],
    )

    overhead = host_overhead()
    print(f"\nHost overhead of the Python layer, B={overhead['B']}, N={overhead['N']} (medians):")
    print_table(
        [overhead],
        [
            ("context_us", "context us", "{:.1f}"), ("build_us", "graph build us", "{:.1f}"),
            ("wrapper_us_per_layer", "wrapper us/layer", "{:.1f}"), ("eval_ms", "eval ms", "{:.2f}"),
            ("host_fraction", "host share", "{:.0%}"),
            ("kernel_calls_during_build", "kernel calls in build", "{}"),
            ("kernel_calls_during_eval", "in eval", "{}"),
            ("traces_under_compile", "traces under compile", "{}"),
        ],
    )
    assert overhead["kernel_calls_during_build"] == 0, "a kernel ran while the step's graph was built"
    path = save(args.output, {"machine": info, "rows": rows, "host_overhead": overhead})
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
