// The nanobind module: bindings only, no logic.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "batched_decode_attention.h"
#include "cpu/arithmetic_probe.h"
#include "cpu/bandwidth_probe.h"
#include "cpu/isa.h"
#include "cpu/parallel_decode.h"
#include "cpu/worker_pool.h"
#include "huge_pages.h"
#include "metal_backend.h"
#include "metal_source.h"
#include "paged_decode_attention.h"
#include "quantized_batched_decode_attention.h"
#include "ragged_decode_attention.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mbd = mlx_batched_decode;
namespace mx = mlx::core;

namespace {

using OptionalArray = std::optional<mx::array>;

// The ops' keyword options, as the C++ functions take them.
mbd::DecodeOptions options(std::optional<float> scale, OptionalArray kv_starts, std::optional<int> window,
                           OptionalArray sinks, std::optional<float> softcap, OptionalArray query_starts) {
  return {scale, std::move(kv_starts), window, std::move(sinks), std::nullopt, softcap, std::move(query_starts)};
}

// The dense ops' ring_offset: an int (as a scalar array) or an array; the
// op checks the array's shape and dtype.
OptionalArray ring_array(const char* op, const nb::object& ring_offset) {
  if (ring_offset.is_none()) {
    return std::nullopt;
  }
  if (nb::isinstance<mx::array>(ring_offset)) {
    return nb::cast<mx::array>(ring_offset);
  }
  int64_t offset;
  if (!nb::isinstance<nb::int_>(ring_offset) || !nb::try_cast(ring_offset, offset)) {
    throw nb::value_error((std::string("[") + op + "] ring_offset must be an int or an integer [B] array, got " +
                           nb::type_name(ring_offset.type()).c_str() + ".")
                              .c_str());
  }
  return mx::array(offset, mx::int64);
}

// One Python function of an op pair: the C++ function it calls, its name and docstring.
template <typename Fn>
struct Binding {
  Fn fn;
  const char* name;
  const char* doc;
};

// Binds an op and its plain-MLX reference with one argument list, keyword
// defaults and signature, so that the two cannot drift apart. wrap(name, fn)
// makes the Python-callable lambda; `parameters` is the signature after the name.
template <typename Fn, typename Wrap, typename... Args>
void def_op_and_reference(nb::module_& m, const Binding<Fn>& op, const Binding<Fn>& reference, Wrap wrap,
                          const char* parameters, const Args&... args) {
  for (const Binding<Fn>& b : {op, reference}) {
    m.def(b.name, wrap(b.name, b.fn), args..., nb::sig((std::string("def ") + b.name + parameters).c_str()), b.doc);
  }
}

} // namespace

NB_MODULE(_ext, m) {
  // mlx.core registers the array and stream types this module passes around.
  nb::module_::import_("mlx.core");
  m.doc() = "Native core of mlx_batched_decode: the primitive and its CPU kernel.";

  def_op_and_reference(
      m,
      Binding{&mbd::batched_decode_attention, "batched_decode_attention",
              R"(Batched decode attention over per-request key/value ranges.

Dimension legend: B requests, H_q query heads, H_kv key/value heads
(G = H_q / H_kv query heads share one KV head), L query rows per request,
T padded length, D head dim of queries and keys (1 to 576), Dv of values and
the output (1 to 512; D itself unless values are narrower, as MLA's latent is).

The L query rows of request b are its last L tokens: with
len_b = clamp(valid_lens[b], 0, T), row i sits at position p = len_b - L + i
and attends keys max(start_b, p - window + 1, 0) .. p. Keys outside a row's
range are never read, so NaN there is harmless.

Args:
    queries (array): [B, H_q, L, D], float16, bfloat16 or float32.
    keys (array): [B, H_kv, T, D], same dtype. May be a strided view of a
        larger cache (e.g. ``cache[:, :, :T]``); it is read in place.
    values (array): [B, H_kv, T, Dv], same dtype, the keys' shape but for the
        head dim (a view of the keys' first Dv columns is read in place).
    valid_lens (array): [B], integer: the keys each request has.
    scale (float, optional): score scale, default 1/sqrt(D).
    kv_starts (array, optional): [B], integer: the first valid key of each
        request (a left-padded cache's padding); start_b = clamp(kv_starts[b], 0, T).
    window (int, optional): >= 1; each row attends at most its last
        ``window`` keys, itself included (a sliding-window layer).
    sinks (array, optional): [H_q], floating: a per-head logit that joins
        each row's softmax denominator and adds nothing to the output, as
        ``mx.fast.scaled_dot_product_attention``'s ``sinks``.
    ring_offset (int or array, optional): an int or [B] integer array: the
        T positions are a ring (mlx-lm's ``RotatingKVCache`` once it wraps),
        and logical position j of request b is stored in slot
        (j + ring_offset[b]) mod T. ``valid_lens``, ``kv_starts``, ``window``
        and the rows' positions stay logical (time order). Offsets of any
        size, negative ones included, are taken modulo T.
    softcap (float, optional): > 0: each score s = scale * q . k becomes
        softcap * tanh(s / softcap) before masking (Gemma 2's attention logit
        softcapping); sink logits are not capped.
    query_starts (array, optional): [B + 1], integer: packed queries. With
        it, ``queries`` are [N, H_q, D] and the output [N, H_q, D]; request
        b's q_b = query_starts[b + 1] - query_starts[b] rows (0 allowed) are
        rows query_starts[b] .. of ``queries``, row i at position
        p = len_b - q_b + i (bottom-right causal, as FlashAttention's varlen).
        Must start at 0, never decrease and end at N.
    stream (Stream or Device, optional): where to run, keyword only.

Returns:
    array: [B, H_q, L, Dv] in the queries' dtype, accumulated in float32. A
    row with no key to attend gets zeros; a row whose scores are all -inf
    (and no finite sink) gets NaN, a softmax of -inf logits only.

Raises:
    ValueError: malformed arguments, before any work is queued.)"},
      Binding{&mbd::reference_attention, "reference_attention",
              R"(``batched_decode_attention`` in plain MLX ops (float32 softmax with a
mask of each row's key range). Same arguments, shapes and errors; slower,
differentiable, and the fallback the primitive uses for vjp, jvp and vmap.)"},
      [](const char* name, auto fn) {
        return [name, fn](const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& lens,
                          std::optional<float> scale, OptionalArray kv_starts, std::optional<int> window,
                          OptionalArray sinks, const nb::object& ring_offset, std::optional<float> softcap,
                          OptionalArray query_starts, mx::StreamOrDevice s) {
          mbd::DecodeOptions o = options(scale, kv_starts, window, sinks, softcap, query_starts);
          o.ring_offset = ring_array(name, ring_offset);
          return fn(q, k, v, lens, o, s);
        };
      },
      "(queries: mlx.core.array, keys: mlx.core.array, "
      "values: mlx.core.array, valid_lens: mlx.core.array, *, scale: float | None = None, "
      "kv_starts: mlx.core.array | None = None, window: int | None = None, "
      "sinks: mlx.core.array | None = None, ring_offset: int | mlx.core.array | None = None, "
      "softcap: float | None = None, query_starts: mlx.core.array | None = None, "
      "stream: mlx.core.Stream | mlx.core.Device | None = None) -> mlx.core.array",
      "queries"_a,
      "keys"_a,
      "values"_a,
      "valid_lens"_a,
      nb::kw_only(),
      "scale"_a = nb::none(),
      "kv_starts"_a = nb::none(),
      "window"_a = nb::none(),
      "sinks"_a = nb::none(),
      "ring_offset"_a = nb::none(),
      "softcap"_a = nb::none(),
      "query_starts"_a = nb::none(),
      "stream"_a = nb::none());

  m.def(
      "quantized_batched_decode_attention",
      [](const mx::array& q, const std::vector<mx::array>& k, const std::vector<mx::array>& v, const mx::array& lens,
         int group_size, int bits, std::optional<float> scale, OptionalArray kv_starts, std::optional<int> window,
         OptionalArray sinks, std::optional<float> softcap, OptionalArray query_starts, mx::StreamOrDevice s) {
        return mbd::quantized_batched_decode_attention(
            q, k, v, lens, group_size, bits, options(scale, kv_starts, window, sinks, softcap, query_starts), s);
      },
      "queries"_a,
      "keys"_a,
      "values"_a,
      "valid_lens"_a,
      nb::kw_only(),
      "group_size"_a = 64,
      "bits"_a = 8,
      "scale"_a = nb::none(),
      "kv_starts"_a = nb::none(),
      "window"_a = nb::none(),
      "sinks"_a = nb::none(),
      "softcap"_a = nb::none(),
      "query_starts"_a = nb::none(),
      "stream"_a = nb::none(),
      nb::sig(
          "def quantized_batched_decode_attention(queries: mlx.core.array, "
          "keys: tuple[mlx.core.array, mlx.core.array, mlx.core.array], "
          "values: tuple[mlx.core.array, mlx.core.array, mlx.core.array], valid_lens: mlx.core.array, *, "
          "group_size: int = 64, bits: int = 8, scale: float | None = None, "
          "kv_starts: mlx.core.array | None = None, window: int | None = None, "
          "sinks: mlx.core.array | None = None, "
          "softcap: float | None = None, query_starts: mlx.core.array | None = None, "
          "stream: mlx.core.Stream | mlx.core.Device | None = None) -> mlx.core.array"),
      R"(Batched decode attention over quantized keys and values.

``batched_decode_attention`` (same lengths, ranges, window, sinks and L) on a
cache kept as the triples ``mx.quantize(x, group_size=group_size, bits=bits)``
returns (mlx-lm's ``QuantizedKVCache`` layout): the result is attention over
``mx.dequantize`` of the keys and values, accumulated in float32. The CPU
kernel scores against the packed integers directly and never writes a
dequantized copy; the Metal kernel widens them in registers as it loads them.

Dimension legend: B requests, H_q query heads, H_kv key/value heads
(G = H_q / H_kv), L query rows per request, T padded length, D head dim
(a multiple of group_size, at most 512), W = D * bits / 32 packed words per
row, S = D / group_size groups per row.

Args:
    queries (array): [B, H_q, L, D], float16, bfloat16 or float32 (not quantized).
    keys (tuple[array, array, array]): (packed, scales, biases): packed uint32
        [B, H_kv, T, W], scales and biases [B, H_kv, T, S] in float16,
        bfloat16 or float32 (any of them, not necessarily the queries'). Any
        strides: views of a larger cache are read in place.
    values (tuple[array, array, array]): the same layout and shapes as keys,
        scales of the same dtype.
    valid_lens (array): [B], integer: the keys each request has.
    group_size (int): 32, 64 or 128, dividing D; keyword, default 64.
    bits (int): 4 or 8; keyword, default 8.
    scale (float, optional): score scale, default 1/sqrt(D).
    kv_starts (array, optional): [B], integer: the first valid key of each request.
    window (int, optional): >= 1; each row attends at most its last ``window`` keys.
    sinks (array, optional): [H_q], floating: a per-head logit in each row's
        softmax denominator.
    softcap (float, optional): > 0: each score s = scale * q . k becomes
        softcap * tanh(s / softcap) before masking (Gemma 2's attention logit
        softcapping); sink logits are not capped.
    query_starts (array, optional): [B + 1], integer: packed queries. With
        it, ``queries`` are [N, H_q, D] and the output [N, H_q, D]; request
        b's q_b = query_starts[b + 1] - query_starts[b] rows (0 allowed) are
        rows query_starts[b] .. of ``queries``, row i at position
        p = len_b - q_b + i (bottom-right causal, as FlashAttention's varlen).
        Must start at 0, never decrease and end at N.
    stream (Stream or Device, optional): where to run, keyword only.

Returns:
    array: [B, H_q, L, Dv] in the queries' dtype. A row with no key to attend
    gets zeros. Positions outside every row's range are never read: NaN in
    their packed words, scales or biases changes nothing.

Raises:
    ValueError: malformed arguments (triples, shapes, dtypes, ``bits``,
        ``group_size``), before any work is queued.)");

  def_op_and_reference(
      m,
      Binding{&mbd::paged_decode_attention, "paged_decode_attention",
              R"(Batched decode attention over paged key/value caches (block tables).

Dimension legend: B requests, H_q query heads, H_kv key/value heads
(G = H_q / H_kv query heads share one KV head), L query rows per request,
D head dim (1 to 576; Dv of values, 1 to 512), NB blocks in the pool, BS
rows per block, MB table entries per request, T = MB * BS logical positions.

Position j of request b is row j % BS of block block_tables[b, j // BS].
With len_b = clamp(valid_lens[b], 0, T), query row i sits at position
p = len_b - L + i and attends positions max(p - window + 1, 0) .. p, as in
``batched_decode_attention``. Table entries at or past len_b are never read,
whatever they hold (-1 is customary); an entry inside len_b that lies outside
[0, NB) is never dereferenced and its block holds no key. Requests whose
tables hold the same block at the same position (a shared prefix) have that
block read once for all of them by the CPU kernel.

Args:
    queries (array): [B, H_q, L, D], float16, bfloat16 or float32.
    key_pages (array): [NB, BS, H_kv, D], same dtype; any strides, read in place.
    value_pages (array): [NB, BS, H_kv, Dv], same dtype, key_pages' shape
        but for the head dim.
    block_tables (array): [B, MB], int32.
    valid_lens (array): [B], integer: the positions each request has.
    scale (float, optional): score scale, default 1/sqrt(D).
    window (int, optional): >= 1; each row attends at most its last
        ``window`` positions, itself included.
    sinks (array, optional): [H_q], floating: a per-head logit in each row's
        softmax denominator, with no value.
    softcap (float, optional): > 0: each score s = scale * q . k becomes
        softcap * tanh(s / softcap) before masking (Gemma 2's attention logit
        softcapping); sink logits are not capped.
    query_starts (array, optional): [B + 1], integer: packed queries. With
        it, ``queries`` are [N, H_q, D] and the output [N, H_q, D]; request
        b's q_b = query_starts[b + 1] - query_starts[b] rows (0 allowed) are
        rows query_starts[b] .. of ``queries``, row i at position
        p = len_b - q_b + i (bottom-right causal, as FlashAttention's varlen).
        Must start at 0, never decrease and end at N.
    stream (Stream or Device, optional): where to run, keyword only. The
        Metal kernel reads a shared block once per request.

Returns:
    array: [B, H_q, L, Dv] in the queries' dtype, accumulated in float32. A
    row with no key to attend gets zeros.

Raises:
    ValueError: malformed arguments, before any work is queued.)"},
      Binding{&mbd::reference_paged_attention, "reference_paged_attention",
              R"(``paged_decode_attention`` in plain MLX ops (the pages gathered into a
dense cache, positions of out-of-pool blocks masked, float32 softmax). Same
arguments, shapes and errors; slower, differentiable, and the fallback the
primitive uses for vjp, jvp and vmap.)"},
      [](const char*, auto fn) {
        return [fn](const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& tables,
                    const mx::array& lens, std::optional<float> scale, std::optional<int> window, OptionalArray sinks,
                    std::optional<float> softcap, OptionalArray query_starts, mx::StreamOrDevice s) {
          return fn(q, k, v, tables, lens, options(scale, std::nullopt, window, sinks, softcap, query_starts), s);
        };
      },
      "(queries: mlx.core.array, key_pages: mlx.core.array, "
      "value_pages: mlx.core.array, block_tables: mlx.core.array, valid_lens: mlx.core.array, *, "
      "scale: float | None = None, window: int | None = None, sinks: mlx.core.array | None = None, "
      "softcap: float | None = None, query_starts: mlx.core.array | None = None, "
      "stream: mlx.core.Stream | mlx.core.Device | None = None) -> mlx.core.array",
      "queries"_a,
      "key_pages"_a,
      "value_pages"_a,
      "block_tables"_a,
      "valid_lens"_a,
      nb::kw_only(),
      "scale"_a = nb::none(),
      "window"_a = nb::none(),
      "sinks"_a = nb::none(),
      "softcap"_a = nb::none(),
      "query_starts"_a = nb::none(),
      "stream"_a = nb::none());

  def_op_and_reference(
      m,
      Binding{&mbd::ragged_decode_attention, "ragged_decode_attention",
              R"(Batched decode attention straight from one cache buffer per request.

Dimension legend: B requests, H_q query heads, H_kv key/value heads
(G = H_q / H_kv query heads share one KV head), L query rows per request,
T_b the positions of request b's buffer, D head dim (1 to 576; Dv of
values, 1 to 512).

``batched_decode_attention``'s semantics, with each request's keys and
values in arrays of their own (SGLang's per-request caches, mlx-lm's
``KVCache``): with len_b = clamp(valid_lens[b], 0, T_b), query row i sits
at position p = len_b - L + i and attends keys max(start_b, p - window + 1,
0) .. p. The arrays are read in place, never copied or padded; positions
outside a row's range are never read.

Args:
    queries (array): [B, H_q, L, D], float16, bfloat16 or float32.
    keys (sequence of array): B arrays, request b's [1, H_kv, T_b, D] or
        [H_kv, T_b, D] (the two may be mixed), the queries' dtype; slices of
        larger buffers and other strided views (a token-major
        [1, T, H_kv, D] buffer transposed) are read in place. T_b may differ
        between requests and may be 0.
    values (sequence of array): B arrays, each the shape of its keys but for
        the head dim Dv, one for all.
    valid_lens (array, optional): [B], integer; default each T_b.
    scale (float, optional): score scale, default 1/sqrt(D).
    kv_starts (array, optional): [B], integer: the first valid key of each request.
    window (int, optional): >= 1; each row attends at most its last
        ``window`` keys, itself included.
    sinks (array, optional): [H_q], floating: a per-head logit in each row's
        softmax denominator, with no value.
    softcap (float, optional): > 0: each score s = scale * q . k becomes
        softcap * tanh(s / softcap) before masking (Gemma 2's attention logit
        softcapping); sink logits are not capped.
    query_starts (array, optional): [B + 1], integer: packed queries. With
        it, ``queries`` are [N, H_q, D] and the output [N, H_q, D]; request
        b's q_b = query_starts[b + 1] - query_starts[b] rows (0 allowed) are
        rows query_starts[b] .. of ``queries``, row i at position
        p = len_b - q_b + i (bottom-right causal, as FlashAttention's varlen).
        Must start at 0, never decrease and end at N.
    stream (Stream or Device, optional): where to run, keyword only.

Returns:
    array: [B, H_q, L, Dv] in the queries' dtype, accumulated in float32. A
    row with no key to attend gets zeros. Under ``mx.compile``, each B (the
    number of arrays in the lists) is a graph of its own.

Raises:
    ValueError: malformed arguments (lists that are not B long, keys and
        values of different shapes, mixed dtypes, H_kv or D that differ
        between requests, a leading axis other than 1, and every check of
        ``batched_decode_attention``), before any work is queued.)"},
      Binding{&mbd::reference_ragged_attention, "reference_ragged_attention",
              R"(``ragged_decode_attention`` in plain MLX ops (``reference_attention`` on
each request's own arrays, joined on the batch axis). Same arguments, shapes
and errors; slower, differentiable, and the fallback the primitive uses for
vjp, jvp and vmap.)"},
      [](const char*, auto fn) {
        return [fn](const mx::array& q, const std::vector<mx::array>& k, const std::vector<mx::array>& v,
                    OptionalArray lens, std::optional<float> scale, OptionalArray kv_starts, std::optional<int> window,
                    OptionalArray sinks, std::optional<float> softcap, OptionalArray query_starts,
                    mx::StreamOrDevice s) {
          return fn(q, k, v, lens, options(scale, kv_starts, window, sinks, softcap, query_starts), s);
        };
      },
      "(queries: mlx.core.array, keys: collections.abc.Sequence[mlx.core.array], "
      "values: collections.abc.Sequence[mlx.core.array], valid_lens: mlx.core.array | None = None, *, "
      "scale: float | None = None, kv_starts: mlx.core.array | None = None, window: int | None = None, "
      "sinks: mlx.core.array | None = None, "
      "softcap: float | None = None, query_starts: mlx.core.array | None = None, "
      "stream: mlx.core.Stream | mlx.core.Device | None = None) -> mlx.core.array",
      "queries"_a,
      "keys"_a,
      "values"_a,
      "valid_lens"_a = nb::none(),
      nb::kw_only(),
      "scale"_a = nb::none(),
      "kv_starts"_a = nb::none(),
      "window"_a = nb::none(),
      "sinks"_a = nb::none(),
      "softcap"_a = nb::none(),
      "query_starts"_a = nb::none(),
      "stream"_a = nb::none());

  m.def(
      "advise_huge_pages",
      &mbd::advise_huge_pages,
      "array"_a,
      nb::sig("def advise_huge_pages(array: mlx.core.array) -> int"),
      R"(Moves an evaluated array's memory onto transparent huge pages (Linux).

Only whole huge pages inside the array's buffer move; contents are kept.

Args:
    array (array): evaluated, any shape and dtype.

Returns:
    int: bytes now on huge pages; 0 if the kernel gave none or the platform
    has no transparent huge pages.

Raises:
    ValueError: the array is not evaluated.)");

  m.def(
      "metal_source",
      [] { return std::string(mbd::metal_source()); },
      nb::sig("def metal_source() -> str"),
      R"(The Metal kernels' source, as embedded in this extension (every platform).

One ASCII text that includes nothing but ``<metal_stdlib>``: the .metal files
and headers of csrc/kernels with their includes resolved. The metallib is built
from it where Apple's Metal compiler runs; otherwise the GPU path compiles it at
first use, one dtype and head dim at a time. On Linux the tests run this very
text through the emulation harness.)");

  m.def(
      "metal_backend",
      [] {
        const char* name = mbd::metal_backend_name(mbd::metal_backend());
        return name ? std::optional<std::string>(name) : std::nullopt;
      },
      nb::sig("def metal_backend() -> str | None"),
      R"(Where this process's Metal kernels come from.

Returns:
    str | None: ``"metallib"`` (the prebuilt mlx_batched_decode.metallib next
    to the extension), ``"source"`` (the embedded source, compiled by Metal at
    the first GPU call of each dtype and head dim), or None without Metal.)");

  m.def("cpu_kernel_calls", &mbd::cpu::kernel_calls,
        "Number of times the fused CPU kernel has run in this process.");
  m.def("cpu_tile_blocks", &mbd::cpu::tile_blocks,
        "Number of 32-key blocks the CPU kernel has computed on AMX tiles in this process.");
  m.def("cpu_shared_items", &mbd::cpu::shared_items,
        "Number of paged work items the CPU kernel has run that read shared blocks once for "
        "several requests in this process.");
  m.def("cpu_isa", &mbd::cpu::current_isa,
        "Instruction-set variant of the CPU kernel in use: 'baseline', 'avx2', 'avxvnni', 'avx512bf16', "
        "'avx512fp16' or 'amx'.");
  m.def("cpu_isas", &mbd::cpu::available_isas,
        "CPU kernel variants this build has and this CPU supports, best last.");
  m.def("built_cpu_isas", &mbd::cpu::built_isas,
        "CPU kernel variants this build has, whether this CPU supports them or not, best last.");
  m.def("set_cpu_isa", &mbd::cpu::set_isa, "name"_a,
        "Selects the CPU kernel variant (for tests and benchmarks); ValueError "
        "if it is not available.");
  m.def("cpu_threads", &mbd::cpu::max_threads,
        "Threads that serve one CPU kernel call (pool plus caller).");
  m.def("cpu_spin_us", [] { return mbd::cpu::spin_time().count(); },
        "Microseconds an idle CPU kernel thread polls for work before it sleeps: "
        "MBD_CPU_SPIN_US, default 5000. ValueError if that variable is malformed.");

  m.attr("LLC_FALLBACK_BYTES") = mbd::cpu::kFallbackLlcBytes;
  m.def(
      "last_level_cache_bytes",
      [](const std::string& cpu_root) { return mbd::cpu::last_level_cache_bytes(cpu_root); },
      "cpu_root"_a = "/sys/devices/system/cpu",
      R"(Bytes of last-level cache in the machine.

The highest-level data or unified cache listed under
``cpu_root/cpu*/cache/index*/`` (Linux sysfs), each instance counted once
(instances are told apart by ``shared_cpu_list``, so every L3 of a CPU with
one per core complex counts). ``LLC_FALLBACK_BYTES`` where none is listed.)");

  nb::class_<mbd::cpu::ReadProbe>(
      m, "ReadProbe",
      R"(The machine's read bandwidth as the CPU kernel reads memory: on the
kernel's worker pool (all its threads), vector loads, four independent streams
per thread, over one buffer allocated and written at construction.

Time ``read()`` in turns with the code compared to it; GB/s is
``nbytes / seconds / 1e9``.)")
      .def(nb::init<size_t, bool, const std::string&>(), "nbytes"_a, "huge_pages"_a = true, "isa"_a = "",
           R"(Args:
    nbytes (int): buffer size, rounded up to whole 4 MiB; make it several
        times ``last_level_cache_bytes()`` so that caches hold little of it.
    huge_pages (bool): back it with transparent huge pages (Linux), else
        keep it on 4 KiB pages.
    isa (str): loads to use, ``"avx512"``, ``"avx2"`` or ``"baseline"``;
        empty for the widest this CPU runs.

Raises:
    ValueError: ``isa`` names loads this CPU does not run.)")
      .def("read", &mbd::cpu::ReadProbe::read, nb::call_guard<nb::gil_scoped_release>(),
           "Reads every byte of the buffer once; returns the seconds it took.")
      .def_prop_ro("nbytes", &mbd::cpu::ReadProbe::bytes, "Bytes read per call.")
      .def_prop_ro("huge_page_bytes", &mbd::cpu::ReadProbe::huge_page_bytes,
                   "Bytes of the buffer on huge pages now (/proc/self/smaps; 0 off Linux).")
      .def_prop_ro("isa", &mbd::cpu::ReadProbe::isa, "Loads in use: 'avx512', 'avx2' or 'baseline'.")
      .def_prop_ro("checksum", &mbd::cpu::ReadProbe::checksum,
                   "XOR of the 64-bit words the last read loaded; word i of the buffer holds i.");

  m.def("arithmetic_units", &mbd::cpu::arithmetic_units,
        "Units an ArithmeticProbe can rate: 'fma32', 'bf16_dot', 'int16_dot', 'int8_dot', 'amx_bf16', 'amx_int8'.");
  m.def("available_arithmetic_units", &mbd::cpu::available_arithmetic_units,
        "Those of arithmetic_units() this CPU (and OS, for AMX tile state) runs.");
  nb::class_<mbd::cpu::ArithmeticProbe>(
      m, "ArithmeticProbe",
      R"(The machine's arithmetic peak as the CPU kernel computes: on the
kernel's worker pool (all its threads), independent chains of one
instruction, no memory traffic.

Time ``run()`` in turns with the code compared to it; the rate is
``multiply_adds / seconds``. A multiply-add is one product of two elements
added into a sum; a dot-product instruction does several per lane.)")
      .def(nb::init<const std::string&, const std::string&>(), "unit"_a = "fma32", "isa"_a = "",
           R"(Args:
    unit (str): ``"fma32"`` (float32 fused multiply-adds), ``"bf16_dot"``
        (AVX512_BF16 ``vdpbf16ps``), ``"int16_dot"`` (AVX512-VNNI
        ``vpdpwssd``), ``"int8_dot"`` (AVX512-VNNI ``vpdpbusd``),
        ``"amx_bf16"`` (``tdpbf16ps``) or ``"amx_int8"`` (``tdpbusd``).
    isa (str): the vector width of ``"fma32"``: ``"avx512"``, ``"avx2"``
        or ``"baseline"`` (128-bit vectors); empty for the widest this CPU
        runs. The dot-product units take only ``""``.

Raises:
    ValueError: this CPU does not run ``unit`` (on ``isa``'s vectors).)")
      .def("run", &mbd::cpu::ArithmeticProbe::run, nb::call_guard<nb::gil_scoped_release>(),
           "Runs the probe's multiply-adds once; returns the seconds it took.")
      .def_prop_ro("multiply_adds", &mbd::cpu::ArithmeticProbe::multiply_adds, "Multiply-adds per call of run().")
      .def_prop_ro("unit", &mbd::cpu::ArithmeticProbe::unit, "The unit rated.")
      .def_prop_ro("isa", &mbd::cpu::ArithmeticProbe::isa,
                   "Vector width of 'fma32': 'avx512', 'avx2' or 'baseline'; '' for the other units.")
      .def_prop_ro("checksum", &mbd::cpu::ArithmeticProbe::checksum,
                   "The last run's accumulators folded; the same for every run of a probe.");
}
