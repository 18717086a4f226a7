"""CPU peers: batched_decode_attention against the CPU kernels other runtimes decode with, on the
same K/V, side by side.

Llama-3-8B heads (32 query / 8 KV heads, D = 128), one new token per request, B = 8 and 32, ragged
lengths 512-4096 (the same per B), float32 / bfloat16 / float16. Every peer gets its K/V once, in
the layout it keeps its cache in, before any timing; what each needs beside the op's padded
[B, H_kv, T, D] cache read in place (T the longest length):

- torch: `F.scaled_dot_product_attention` on the same padded cache (zero-copy from numpy) with a
  boolean [B, 1, 1, T] mask, the G = 4 query heads of a KV head as its 4 query rows
  ([B, 8, 4, D]): 2.0x (float32) to 8.0x (bfloat16) faster at B=8 on 2 threads than
  `enable_gqa=True` on [B, 32, 1, D], which copies K/V per query head. Reads all T keys of every
  request.
- openvino-sdpa: opset13 ScaledDotProductAttention on the same padded cache (shared tensors),
  boolean mask, queries as for torch (the op broadcasts heads only numpy-style). Not the fused
  SDPA-with-KV-cache node of OpenVINO's stateful models, whose state grows by a token per call.
- openvino-pa: `_PagedAttentionExtension`, the op OpenVINO GenAI's continuous batching runs: a
  block cache [blocks, H_kv, 32, D] (a layout copy, made once; each request's blocks contiguous),
  a block table, past_lens = len - 1; the newest key and value are inputs the op writes into the
  cache, as in a real step.
- onnxruntime-gqa: `com.microsoft.GroupQueryAttention` as a one-node graph, what
  onnxruntime-genai decodes with: the padded cache as past_key/past_value, bound by IOBinding to
  the same buffers as present_key/present_value (ORT then writes the newest token in place, no
  copy), seqlens_k = len - 1. No bfloat16 on CPU.

Timing as bench_kernel.py: enough layers, each with its own K/V, that the valid bytes cycled are
>= 3x the last-level cache (common.rotation_sets, capped by --memory-gb), medians of calls timed in
turns with a pause between them, so no library's polling threads steal the next one's core. All on
4 KiB pages (numpy's and torch's buffers get no huge pages; the op would on SlotKVCache). GB/s: the
valid K/V bytes (sum of lengths x H_kv x D x 2 x itemsize) over the time, for every column.
"x op" is the peer's time over the op's. Each peer's output is checked against the op's (and the
op's against the reference); a mismatch fails the row.

Threads: each setting runs in its own process, its CPU affinity cut to that many CPUs before the
op's thread pool starts (the pool takes the affinity's size), and every peer told the same count
(torch.set_num_threads, ORT's intra_op_num_threads, OpenVINO's INFERENCE_NUM_THREADS).

The peers are no dependencies of the package; install them beside it in their own environment:

    python -m venv .venv-peers
    .venv-peers/bin/pip install -r benchmarks/peers-requirements.txt .
    .venv-peers/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    .venv-peers/bin/python benchmarks/bench_cpu_peers.py            # B=8 and 32, 3 dtypes, 1 and all threads
    .venv-peers/bin/python benchmarks/bench_cpu_peers.py --quick    # B=8, all threads
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import mlx.core as mx
import numpy as np

import mlx_batched_decode as mbd

from common import describe_machine, interleaved_medians, llc_bytes, machine, print_table, rotation_sets, save

H_Q, H_KV, D = 32, 8, 128
LENGTHS = (512, 4096)
DTYPES = ("float32", "bfloat16", "float16")
TOLERANCE = {"float32": 2e-4, "float16": 4e-3, "bfloat16": 3e-2}
PEERS = ("torch", "openvino-sdpa", "openvino-pa", "onnxruntime-gqa")


class Unsupported(Exception):
    """The peer cannot run this dtype (the row says why)."""


def bf16_bits(x):
    """float32 -> bfloat16 bits (round to nearest even), as uint16."""
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


class Case:
    """Host arrays of one row, in the dtype's storage (bfloat16 as uint16 bits): q [B, H_q, 1, D] and
    `layers` pairs of K/V [B, H_kv, T, D]; the second layer is the first negated (exact)."""

    def __init__(self, B, dtype, memory_gb):
        rng = np.random.default_rng(B)
        self.B, self.dtype = B, dtype
        self.lens = rng.integers(LENGTHS[0], LENGTHS[1] + 1, size=B).astype(np.int32)
        self.T = T = int(self.lens.max())
        self.itemsize = 4 if dtype == "float32" else 2
        self.valid_bytes = int(self.lens.sum()) * H_KV * D * 2 * self.itemsize
        padded = B * H_KV * T * D * 2 * self.itemsize
        self.layers = min(rotation_sets(self.valid_bytes), max(1, int(memory_gb * 1e9 // padded)))
        self.q = self.store(rng.standard_normal((B, H_Q, 1, D), dtype=np.float32))
        k, v = (self.store(rng.standard_normal((B, H_KV, T, D), dtype=np.float32)) for _ in range(2))
        self.kv = [(k, v) if i % 2 == 0 else (self.negate(k), self.negate(v)) for i in range(self.layers)]
        self.scale = 1.0 / math.sqrt(D)

    def store(self, x):
        return bf16_bits(x) if self.dtype == "bfloat16" else x.astype(self.dtype)

    def negate(self, x):
        return x ^ np.uint16(0x8000) if x.dtype == np.uint16 else -x

    def newest(self, x):
        """The newest key or value of each request, [B, H_kv * D]: what a step's projection made."""
        return np.ascontiguousarray(x[np.arange(self.B), :, self.lens - 1, :]).reshape(self.B, H_KV * D)


def as_float32(x):
    """A peer's output, as float32 numpy [B, H_q, D]."""
    import openvino as ov

    if isinstance(x, mx.array):
        x = np.array(x.astype(mx.float32))
    elif type(x).__module__.startswith("torch"):
        x = x.float().numpy()
    elif isinstance(x, ov.Tensor):
        bf16 = x.element_type == ov.Type.bf16
        x = x.data.view(np.uint16) if bf16 else x.data
        x = (x.astype(np.uint32) << 16).view(np.float32) if bf16 else x
    return np.asarray(x, dtype=np.float32).reshape(-1, H_Q, D)


# Each peer: built once for a case and a thread count, returns a callable that runs one decode call
# per layer and returns the outputs.


def ours(case, threads):
    dtype = getattr(mx, case.dtype)

    def to_mx(x):
        a = mx.array(x)
        return a.view(dtype) if case.dtype == "bfloat16" else a

    q, lens = to_mx(case.q), mx.array(case.lens)
    kv = [(to_mx(k), to_mx(v)) for k, v in case.kv]
    mx.eval(q, lens, kv)

    def run():
        outs = [mbd.batched_decode_attention(q, k, v, lens) for k, v in kv]
        mx.eval(outs)
        return outs

    def reference():
        return mbd.reference_attention(q, *kv[0], lens)

    run.reference = reference
    return run


def torch_sdpa(case, threads):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)

    def to_torch(x):
        t = torch.from_numpy(x)  # shares the numpy buffer
        return t.view(torch.bfloat16) if case.dtype == "bfloat16" else t

    q = to_torch(case.q).view(case.B, H_KV, H_Q // H_KV, D)  # a KV head's query heads as its rows
    kv = [(to_torch(k), to_torch(v)) for k, v in case.kv]
    mask = torch.from_numpy(np.arange(case.T)[None, None, None, :] < case.lens[:, None, None, None])

    def run():
        with torch.inference_mode():
            return [F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale) for k, v in kv]

    return run


def openvino_config(case, threads):
    """Compile options: the thread count, and the row's dtype as the precision of the arithmetic and
    of the KV cache, where this CPU has it (else OpenVINO's default)."""
    import openvino as ov

    core = ov.Core()
    capabilities = core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    config = {"INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
    precision = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[case.dtype]
    supported = {"f32": "FP32", "bf16": "BF16", "f16": "FP16"}[precision] in capabilities
    config["INFERENCE_PRECISION_HINT"] = precision if supported else "f32"
    config["KV_CACHE_PRECISION"] = precision
    return core, config


def ov_type(case):
    import openvino as ov

    return {"float32": ov.Type.f32, "bfloat16": ov.Type.bf16, "float16": ov.Type.f16}[case.dtype]


def ov_tensor(case, x, keep):
    """An OpenVINO tensor on x's memory (no copy); x is appended to `keep`, which the caller keeps
    alive as long as the tensor: the tensor holds no reference to it."""
    import openvino as ov

    x = np.ascontiguousarray(x)
    keep.append(x)
    if case.dtype == "bfloat16":
        return ov.Tensor(x, ov.Shape(list(x.shape)), ov.Type.bf16)  # shares the uint16 bits
    return ov.Tensor(x, shared_memory=True)


def _infer_each(compiled, keep, inputs):
    """A run of ``compiled`` once per layer's ``inputs`` (name -> ``ov.Tensor``), each on an infer
    request made and bound once; the run keeps ``keep`` (what the tensors share memory with)."""
    requests = []
    for tensors in inputs:
        request = compiled.create_infer_request()
        for name, tensor in tensors.items():
            request.set_tensor(name, tensor)
        requests.append(request)

    def run():
        for request in requests:
            request.infer()
        return [request.get_output_tensor(0) for request in requests]

    run.keep = keep
    return run


def openvino_sdpa(case, threads):
    import openvino as ov
    import openvino.opset13 as ops

    core, config = openvino_config(case, threads)
    config.pop("KV_CACHE_PRECISION")
    et, G = ov_type(case), H_Q // H_KV
    q = ops.parameter([case.B, H_KV, G, D], et, name="q")
    k, v = (ops.parameter([case.B, H_KV, case.T, D], et, name=n) for n in "kv")
    mask = ops.parameter([case.B, 1, 1, case.T], ov.Type.boolean, name="mask")
    scale = ops.convert(ops.constant(np.float32(case.scale)), et)
    out = ops.scaled_dot_product_attention(q, k, v, mask, scale, causal=False)
    compiled = core.compile_model(ov.Model([out], [q, k, v, mask]), "CPU", config)

    keep = []
    q_t = ov_tensor(case, case.q.reshape(case.B, H_KV, G, D), keep)
    mask_t = ov.Tensor(np.arange(case.T)[None, None, None, :] < case.lens[:, None, None, None])
    return _infer_each(compiled, keep, [
        {"q": q_t, "k": ov_tensor(case, kc, keep), "v": ov_tensor(case, vc, keep), "mask": mask_t}
        for kc, vc in case.kv
    ])


def openvino_pa(case, threads):
    import openvino as ov
    import openvino.opset13 as ops
    from openvino._pyopenvino.op import _PagedAttentionExtension

    core, config = openvino_config(case, threads)
    et, i32 = ov_type(case), ov.Type.i32

    def const(x):
        return ops.constant(np.asarray(x))

    def empty(dtype=np.int32):
        return const(np.zeros(0, dtype))

    names = ("key_cache", "value_cache", "past_lens", "subsequence_begins", "block_indices", "block_indices_begins")
    params = [ops.parameter([-1, H_Q * D], et, name="q")]
    params += [ops.parameter([-1, H_KV * D], et, name=n) for n in ("k", "v")]
    params += [ops.parameter([-1, -1, -1, -1], ov.Type.dynamic, name=n) for n in names[:2]]  # the plugin picks
    params += [ops.parameter([-1], i32, name=n) for n in names[2:]]
    # The 28 inputs of OpenVINO 2026.4's op: the 9 above, then scale, sliding_window, alibi_slopes,
    # max_context_len, and the unused features (score aggregation, cache rotation, xattention,
    # sinks, adaptive RKV, token types, qq bias), empty.
    rest = [
        const(np.float32(case.scale)), const(np.int32(0)), empty(np.float32), const(np.int32(case.T)),
        empty(), empty(), empty(), empty(np.float32), empty(np.float32), const(np.int32(64)),
        const(np.int32(8)), empty(np.float32), const(np.int32(0)), empty(), empty(), empty(), empty(),
        empty(np.uint8), empty(),
    ]
    pa = _PagedAttentionExtension([p.output(0) for p in params] + [r.output(0) for r in rest])
    info = pa.get_rt_info()  # the CPU plugin sizes its cache from these
    for key, value in (("num_k_heads", H_KV), ("k_head_size", D), ("num_v_heads", H_KV), ("v_head_size", D)):
        info[key] = value
    compiled = core.compile_model(ov.Model([pa.output(0)], params), "CPU", config)
    cache_shape = compiled.input("key_cache").get_partial_shape()
    block = cache_shape[2].get_length()
    if compiled.input("key_cache").get_element_type() != et or cache_shape[3].get_length() != D:
        raise Unsupported(f"cache is {compiled.input('key_cache').get_element_type()} {cache_shape}")

    blocks = -(-case.lens // block)  # per request
    begins = np.concatenate([[0], np.cumsum(blocks)]).astype(np.int32)
    keep = []
    fixed = {
        "q": ov_tensor(case, case.q.reshape(case.B, H_Q * D), keep),
        "past_lens": ov.Tensor(case.lens - 1),
        "subsequence_begins": ov.Tensor(np.arange(case.B + 1, dtype=np.int32)),
        "block_indices": ov.Tensor(np.arange(begins[-1], dtype=np.int32)),
        "block_indices_begins": ov.Tensor(begins),
    }

    def paged(x):
        """[B, H_kv, T, D] -> [blocks, H_kv, block, D], each request's blocks in turn."""
        out = np.zeros((begins[-1], H_KV, block, D), x.dtype)
        for b, n in enumerate(blocks):
            part = np.zeros((H_KV, n * block, D), x.dtype)
            part[:, : case.lens[b]] = x[b, :, : case.lens[b]]
            out[begins[b] : begins[b + 1]] = part.reshape(H_KV, n, block, D).transpose(1, 0, 2, 3)
        return out

    return _infer_each(compiled, keep, [
        fixed | {
            "k": ov_tensor(case, case.newest(kc), keep), "v": ov_tensor(case, case.newest(vc), keep),
            "key_cache": ov_tensor(case, paged(kc), keep), "value_cache": ov_tensor(case, paged(vc), keep),
        }
        for kc, vc in case.kv
    ])


def onnxruntime_gqa(case, threads):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    if case.dtype == "bfloat16":
        raise Unsupported("no bfloat16 CPU kernel")
    et = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[case.dtype]
    B, T = case.B, case.T
    inputs = [
        helper.make_tensor_value_info("query", et, [B, 1, H_Q * D]),
        helper.make_tensor_value_info("key", et, [B, 1, H_KV * D]),
        helper.make_tensor_value_info("value", et, [B, 1, H_KV * D]),
        helper.make_tensor_value_info("past_key", et, [B, H_KV, T, D]),
        helper.make_tensor_value_info("past_value", et, [B, H_KV, T, D]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [B]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
    ]
    outputs = [
        helper.make_tensor_value_info("output", et, [B, 1, H_Q * D]),
        helper.make_tensor_value_info("present_key", et, [B, H_KV, T, D]),
        helper.make_tensor_value_info("present_value", et, [B, H_KV, T, D]),
    ]
    node = helper.make_node(
        "GroupQueryAttention", [i.name for i in inputs], [o.name for o in outputs], domain="com.microsoft",
        num_heads=H_Q, kv_num_heads=H_KV, scale=case.scale,
    )
    model = helper.make_model(
        helper.make_graph([node], "gqa", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)], ir_version=10,
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    value = ort.OrtValue.ortvalue_from_numpy
    fixed = {
        "query": value(case.q.reshape(B, 1, H_Q * D)),
        "seqlens_k": value(case.lens - 1),
        "total_sequence_length": value(np.array(T, dtype=np.int32)),
    }
    bindings = []
    for kc, vc in case.kv:
        past = {"key": value(kc.copy()), "value": value(vc.copy())}  # ORT writes the newest token in
        binding = session.io_binding()
        binding.bind_output("output", "cpu")  # first: get_outputs()[0]
        for name, v in fixed.items():
            binding.bind_ortvalue_input(name, v)
        for name in ("key", "value"):
            binding.bind_ortvalue_input(name, value(case.newest(kc if name == "key" else vc).reshape(B, 1, -1)))
            binding.bind_ortvalue_input(f"past_{name}", past[name])
            binding.bind_ortvalue_output(f"present_{name}", past[name])  # the same buffer: no copy
        bindings.append(binding)

    def run():
        for binding in bindings:
            session.run_with_iobinding(binding)
        return [binding.get_outputs()[0].numpy() for binding in bindings]

    return run


BUILDERS = {
    "torch": torch_sdpa, "openvino-sdpa": openvino_sdpa, "openvino-pa": openvino_pa,
    "onnxruntime-gqa": onnxruntime_gqa,
}


def bench_case(B, dtype, threads, peers, args):
    """The rows of one case: the op and each peer, timed in turns, outputs checked."""
    case = Case(B, dtype, args.memory_gb)
    base = {
        "threads": threads, "B": B, "dtype": dtype, "T": case.T, "valid_bytes": case.valid_bytes,
        "layers": case.layers, "rotated_x_llc": case.valid_bytes * case.layers / llc_bytes(),
    }
    runs, rows = {"op": ours(case, threads)}, {}
    for name in peers:
        try:
            runs[name] = BUILDERS[name](case, threads)
        except Unsupported as e:
            rows[name] = base | {"impl": name, "note": f"unsupported: {e}"}
        except Exception as e:  # a peer that refuses the dtype: say so, keep the others
            rows[name] = base | {"impl": name, "note": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"}

    op_out = [as_float32(o) for o in runs["op"]()[:2]]
    ref = as_float32(runs["op"].reference())
    op_err = float(np.abs(op_out[0] - ref).max())
    assert op_err < TOLERANCE[dtype], f"op against the reference: {op_err}"
    errors = {"op": op_err}
    for name in list(runs)[1:]:
        outs = [as_float32(o) for o in runs[name]()[:2]]
        errors[name] = float(max(np.abs(o - r).max() for o, r in zip(outs, op_out)))

    seconds = interleaved_medians(list(runs.values()), warmup=args.warmup, repeats=args.repeats, pause=args.pause)
    t_op = seconds[0] / case.layers
    for name, s in zip(runs, seconds):
        t = s / case.layers
        rows[name] = base | {
            "impl": name, "ms": t * 1e3, "gbs": case.valid_bytes / t / 1e9, "max_err": errors[name],
            "op_speedup": t / t_op if name != "op" else None,
            "note": "" if errors[name] < TOLERANCE[dtype] else f"MISMATCH (tolerance {TOLERANCE[dtype]})",
        }
    return [rows[name] for name in ["op", *peers] if name in rows]


def worker(args):
    """One thread setting, in this process: rows to args.worker (JSON)."""
    cpus = sorted(os.sched_getaffinity(0))
    threads = len(cpus) if args.threads == "all" else int(args.threads)
    os.sched_setaffinity(0, cpus[:threads])  # before the op's pool starts: it sizes itself to this
    mx.set_default_device(mx.cpu)
    rows = []
    for B in args.batch:
        for dtype in args.dtypes:
            for row in bench_case(B, dtype, threads, args.peers, args):
                rows.append(row)
                print(
                    f"threads={threads} B={B} {dtype} {row['impl']}: "
                    + (f"{row['ms']:.3f} ms, {row['gbs']:.2f} GB/s, err {row['max_err']:.1e} " if "ms" in row else "")
                    + row["note"],
                    file=sys.stderr, flush=True,
                )
    with open(args.worker, "w") as f:
        json.dump({"machine": machine(), "rows": rows}, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="B=8, all threads")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--threads", nargs="+", default=["1", "all"], help="thread settings, each its own process")
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--memory-gb", type=float, default=4.0, help="most GB of padded K/V per case and peer")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--pause", type=float, default=0.02, help="seconds slept between timed calls")
    parser.add_argument("--output", default="cpu_peers", help="results/<name>.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one setting, rows to this file
    args = parser.parse_args()
    if args.worker:
        args.threads = args.threads[0]
        return worker(args)
    if args.quick:
        args.batch, args.threads = [8], ["all"]

    rows, info = [], None
    for threads in args.threads:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            command = [sys.executable, __file__, "--worker", out.name, "--threads", threads, "--batch",
                       *map(str, args.batch), "--dtypes", *args.dtypes, "--peers", *args.peers, "--memory-gb",
                       str(args.memory_gb), "--warmup", str(args.warmup), "--repeats", str(args.repeats),
                       "--pause", str(args.pause)]
            subprocess.run(command, check=True)
            result = json.load(open(out.name))
        rows += result["rows"]
        info = info or machine() | {"settings": []}
        info["settings"].append(result["machine"])
    info["versions"] = versions()

    print()
    print(describe_machine(info).rsplit("; kernel", 1)[0] + f"; kernel {info['cpu_isa']}; " + info["versions"])
    print_table(rows, [
        ("threads", "threads", "{}"), ("B", "B", "{}"), ("dtype", "dtype", "{}"), ("impl", "impl", "{}"),
        ("ms", "ms", "{:.3f}"), ("gbs", "GB/s", "{:.2f}"), ("op_speedup", "op x", "{:.2f}"),
        ("max_err", "max err", "{:.1e}"), ("rotated_x_llc", "x LLC", "{:.1f}"), ("note", "note", "{}"),
    ])
    path = save(args.output, {"machine": info, "rows": rows})
    print(f"\nsaved {path}")
    if any("MISMATCH" in r.get("note", "") for r in rows):
        sys.exit(1)


def versions():
    """The peers' versions, for the table's top."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("mlx", "torch", "openvino", "onnxruntime"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            found.append(f"{package} -")
    return ", ".join(found)


if __name__ == "__main__":
    main()
