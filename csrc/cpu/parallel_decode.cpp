#include "cpu/parallel_decode.h"

#include <algorithm>
#include <cstdlib>
#include <atomic>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "cpu/cache_lines.h"
#include "cpu/isa.h"
#include "cpu/shared_blocks.h"
#include "cpu/worker_pool.h"

namespace mlx_batched_decode::cpu {

namespace {

// Keys per work item: long requests are split (flash-decoding) so that one
// request or a skewed batch still spreads over all cores.
constexpr int kChunk = 512;
// Query rows of one work item that serves several requests (shared pages):
// the scratch of its queries and scores stays in L2.
constexpr int kMaxSharedRows = 256;
// Below this many K/V elements in all, waking pool threads costs more than it saves.
constexpr int64_t kMinParallelElements = int64_t{1} << 17;

std::atomic<uint64_t> g_calls{0};
std::atomic<uint64_t> g_tile_blocks{0};
std::atomic<uint64_t> g_shared_items{0};

int cpu_count() {
#if defined(__linux__)
  // Respects affinity masks and container CPU sets, unlike hardware_concurrency.
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    return std::max(1, CPU_COUNT(&set));
  }
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

// Where a request's partial state of one work item goes.
struct Slot {
  int64_t pair; // index of (b, h) in parts_begin / remaining
  int part; // index of the chunk among its pair's
};

// A work item and the slots of its chunk.count requests: slots[slot ..].
struct Item {
  Chunk chunk;
  int64_t slot;
};

struct Call {
  DecodeArgs args;
  KernelFns fns;
  std::vector<Item> items;
  std::vector<Slot> slots;
  std::vector<int> members; // the requests of shared items, which point into it
  std::vector<int64_t> parts_begin; // [pairs + 1], prefix sum of chunk counts
  // [pairs + 1]: where each pair's states start in parts, PartialState::size(rows, Dvp)
  // each for its request's rows.
  std::vector<int64_t> parts_offset;
  // Partial states; left unset (a call's are megabytes), since each chunk
  // sets its own rows before any are read.
  LineArray<float> parts;
  std::unique_ptr<std::atomic<int>[]> remaining; // chunks left per pair
  std::atomic<int> next{0};
  std::atomic<int> done{0};

  void process(const Item& it, const Item* following) {
    const Chunk& c = it.chunk;
    // Requests of shared items have rows of one count (plan_paged).
    const DecodeArgs own = args.of_request(c.b);
    const int R = own.rows();
    const int64_t part_size = PartialState::size(R, args.Dvp);
    const Chunk* after = following ? &following->chunk : nullptr;
    auto state_of = [&](const Slot& slot) {
      return parts.get() + parts_offset[slot.pair] + slot.part * part_size;
    };
    if (c.t1 <= c.t0) {
      fns.finalize(own, c.b, c.h, nullptr, 0);
      return;
    }
    // The item's slots are head-major: head c.h + i, member m at it.slot + i * count + m.
    PartialState states[kMaxItemHeads];
    if (c.count == 1) {
      for (int i = 0; i < c.heads; ++i) {
        states[i] = PartialState::at(state_of(slots[it.slot + i]), R);
      }
      fns.chunk(own, c, states, after);
    } else {
      // One state per head for all requests' rows, then each request's rows to
      // its own slot, where they merge with its other chunks as split-K parts do.
      thread_local LineVector<float> shared;
      const int all_rows = c.count * R;
      const int64_t all_size = PartialState::size(all_rows, args.Dvp);
      shared.resize(all_size * c.heads);
      for (int i = 0; i < c.heads; ++i) {
        states[i] = PartialState::at(shared.data() + i * all_size, all_rows);
      }
      fns.chunk(args, c, states, after);
      for (int i = 0; i < c.heads; ++i) {
        for (int m = 0; m < c.count; ++m) {
          const PartialState own = PartialState::at(state_of(slots[it.slot + i * c.count + m]), R);
          std::copy_n(states[i].m + m * R, R, own.m);
          std::copy_n(states[i].l + m * R, R, own.l);
          std::copy_n(states[i].acc + static_cast<int64_t>(m) * R * args.Dvp, static_cast<int64_t>(R) * args.Dvp,
                      own.acc);
        }
      }
      g_shared_items.fetch_add(1, std::memory_order_relaxed);
    }
    // The last chunk of a pair to finish merges them; acq_rel makes the other
    // chunks' partial states visible to it.
    for (int i = 0; i < c.heads; ++i) {
      for (int m = 0; m < c.count; ++m) {
        const int64_t pair = slots[it.slot + i * c.count + m].pair;
        if (remaining[pair].fetch_sub(1, std::memory_order_acq_rel) == 1) {
          const int n = static_cast<int>(parts_begin[pair + 1] - parts_begin[pair]);
          fns.finalize(args.of_request(c.request(m)), c.request(m), c.h + i, parts.get() + parts_offset[pair], n);
        }
      }
    }
  }

  void work() {
    const int n = static_cast<int>(items.size());
    for (int i = next.fetch_add(1); i < n;) {
      // The following item is claimed before this one runs, so that its first
      // rows arrive while this one ends: short items would otherwise start cold.
      const int j = next.fetch_add(1);
      process(items[i], j < n ? &items[j] : nullptr);
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
        done.notify_all();
      }
      i = j;
    }
  }
};

// KV heads per work item of request b with `rows` query rows (more where
// requests share pages): all of them (up to kMaxItemHeads) when its key and
// value rows hold the heads side by side (token-major: reading one head's part
// of a row at a time runs at about half the read bandwidth), else one. Not for
// quantized rows, nor for items that the AMX tiles may take (they hold one
// head's queries: their arithmetic, not the reads, bounds such items).
int item_heads(const DecodeArgs& a, int b, int rows) {
  const DecodeArgs r = a.of_request(b);
  const auto side_by_side = [](const int64_t* s) { return std::abs(s[1]) < std::abs(s[2]); };
  if (a.quant.bits != 0 || a.tiles_for(rows) || !side_by_side(r.k_stride) || !side_by_side(r.v_stride)) {
    return 1;
  }
  return std::min(a.H_kv, kMaxItemHeads);
}

// The pieces of a request's keys, at most kChunk each, each on one side of a
// ring's wrap (logical position wrap = T - slot of position 0 is stored at slot 0).
std::vector<Chunk> dense_pieces(const DecodeArgs& a, int b, KeyRange keys) {
  const int slot = a.ring_slot(b), wrap = a.T - slot;
  std::vector<Chunk> pieces;
  for (int t = keys.lo; t < keys.hi;) {
    int end = std::min(keys.hi, t + kChunk);
    if (t < wrap && end > wrap) {
      end = wrap;
    }
    pieces.push_back({b, 0, t, end, nullptr, 1, t < wrap ? slot : slot - a.T});
    t = end;
  }
  return pieces;
}

// Items of a dense call: each request's keys in chunks of kChunk from its first one.
void plan_dense(const DecodeArgs& a, Call& call) {
  int64_t total = 0;
  for (int b = 0; b < a.B; ++b) {
    // Only the keys some query row attends are read: a window or a start skips the rest.
    const DecodeArgs own = a.of_request(b);
    const int heads = item_heads(a, b, own.rows());
    const std::vector<Chunk> pieces = dense_pieces(a, b, own.request_range(b));
    const int chunks = static_cast<int>(pieces.size());
    for (int h = 0; h < a.H_kv; ++h) {
      const int64_t pair = static_cast<int64_t>(b) * a.H_kv + h;
      call.parts_begin[pair] = total;
      call.remaining[pair].store(chunks, std::memory_order_relaxed);
      total += chunks;
      if (chunks == 0) {
        call.items.push_back({{b, h, 0, 0}, -1});
      }
    }
    for (int h = 0; h < a.H_kv; h += heads) {
      for (int c = 0; c < chunks; ++c) {
        Chunk piece = pieces[c];
        piece.h = h;
        piece.heads = std::min(heads, a.H_kv - h);
        call.items.push_back({piece, static_cast<int64_t>(call.slots.size())});
        for (int i = 0; i < piece.heads; ++i) {
          call.slots.push_back({static_cast<int64_t>(b) * a.H_kv + h + i, c});
        }
      }
    }
  }
  call.parts_begin[static_cast<int64_t>(a.B) * a.H_kv] = total;
}

// Items of a paged call: the keys on a grid of kChunk positions, one item per
// group of requests that read the same pages in a cell (shared_blocks.h), per
// head. Packed rows differ in count per request: their requests share no item.
void plan_paged(const DecodeArgs& a, Call& call) {
  const int max_members = a.query_starts ? 1 : kMaxSharedRows / std::max(1, a.rows());
  const std::vector<CellGroup> groups = group_shared_cells(a, kChunk, max_members);
  std::vector<int> chunks(a.B, 0);
  for (const CellGroup& g : groups) {
    for (int b : g.requests) {
      ++chunks[b];
    }
  }
  int64_t total = 0;
  for (int b = 0; b < a.B; ++b) {
    for (int h = 0; h < a.H_kv; ++h) {
      const int64_t pair = static_cast<int64_t>(b) * a.H_kv + h;
      call.parts_begin[pair] = total;
      call.remaining[pair].store(chunks[b], std::memory_order_relaxed);
      total += chunks[b];
      if (chunks[b] == 0) {
        call.items.push_back({{b, h, 0, 0}, -1});
      }
    }
  }
  call.parts_begin[static_cast<int64_t>(a.B) * a.H_kv] = total;
  std::vector<int> used(a.B, 0); // parts given out per request so far
  std::vector<int64_t> first_member; // per item, into members (its pointer is set below)
  for (const CellGroup& g : groups) {
    const int count = static_cast<int>(g.requests.size());
    const int64_t at = static_cast<int64_t>(call.members.size());
    call.members.insert(call.members.end(), g.requests.begin(), g.requests.end());
    const int heads = item_heads(a, g.requests[0], count * a.of_request(g.requests[0]).rows());
    for (int h = 0; h < a.H_kv; h += heads) {
      Chunk item{g.requests[0], h, g.t0, g.t1, nullptr, count};
      item.heads = std::min(heads, a.H_kv - h);
      call.items.push_back({item, static_cast<int64_t>(call.slots.size())});
      first_member.push_back(count > 1 ? at : -1);
      for (int i = 0; i < item.heads; ++i) {
        for (int b : g.requests) {
          call.slots.push_back({static_cast<int64_t>(b) * a.H_kv + h + i, used[b]});
        }
      }
    }
    for (int b : g.requests) {
      ++used[b];
    }
  }
  // The empty pairs' items come first, without members.
  const size_t offset = call.items.size() - first_member.size();
  for (size_t i = 0; i < first_member.size(); ++i) {
    if (first_member[i] >= 0) {
      call.items[offset + i].chunk.members = call.members.data() + first_member[i];
    }
  }
}

std::shared_ptr<Call> plan(const DecodeArgs& a) {
  auto call = std::make_shared<Call>();
  call->args = a;
  call->args.amx_tiles = tiles_selected();
  // Keys and values of different head dims run the generic kernel (head dim 0).
  const int head_dim = a.D == a.Dv ? a.D : 0;
  call->fns = a.quant.bits ? quantized_kernel_fns(a.dtype, head_dim, a.quant.bits) : kernel_fns(a.dtype, head_dim);
  if (call->fns.chunk == nullptr) {
    throw std::logic_error("[batched_decode_attention] the CPU kernel variant " + current_isa() +
                           " has no kernel for this call");
  }
  const int64_t pairs = static_cast<int64_t>(a.B) * a.H_kv;
  call->parts_begin.resize(pairs + 1);
  call->remaining = std::make_unique<std::atomic<int>[]>(pairs);
  // call->args, not a: it says whether the tiles may run (item_heads).
  if (a.block_tables != nullptr) {
    plan_paged(call->args, *call);
  } else {
    plan_dense(call->args, *call);
  }
  call->parts_offset.resize(pairs + 1);
  int64_t offset = 0;
  for (int64_t pair = 0; pair < pairs; ++pair) {
    call->parts_offset[pair] = offset;
    const int rows = a.of_request(static_cast<int>(pair / a.H_kv)).rows();
    offset += (call->parts_begin[pair + 1] - call->parts_begin[pair]) * PartialState::size(rows, a.Dvp);
  }
  call->parts_offset[pairs] = offset;
  call->parts = make_line_array<float>(offset);
  return call;
}

} // namespace

// One pool for all calls and streams, so concurrent callers share a bounded
// number of threads; never destroyed (its workers are detached), so exit does
// not wait on it.
WorkerPool& shared_pool() {
  static WorkerPool* p = new WorkerPool(max_threads() - 1, spin_time());
  return *p;
}

int max_threads() {
  static const int n = cpu_count();
  return n;
}

uint64_t kernel_calls() {
  return g_calls.load();
}

uint64_t tile_blocks() {
  return g_tile_blocks.load();
}

void count_tile_blocks(uint64_t n) {
  g_tile_blocks.fetch_add(n, std::memory_order_relaxed);
}

uint64_t shared_items() {
  return g_shared_items.load();
}

void run_decode(const DecodeArgs& args) {
  g_calls.fetch_add(1);
  if (args.query_starts && !args.packed_rows_valid()) {
    // Rows no request (or two) would own: the whole output is zeros instead.
    const size_t bytes = args.dtype == Dtype::float32 ? 4 : 2;
    std::memset(args.out, 0, static_cast<size_t>(args.L) * args.H_q * args.Dv * bytes);
    return;
  }
  auto call = plan(args);
  const int n_items = static_cast<int>(call->items.size());
  if (n_items == 0) {
    return;
  }

  // K/V elements read, times the rows that use each: the arithmetic grows with L.
  int64_t elements = 0;
  for (const Item& it : call->items) {
    const int rows = args.query_starts ? args.of_request(it.chunk.b).L : args.L;
    elements += static_cast<int64_t>(it.chunk.t1 - it.chunk.t0) * args.D * rows * it.chunk.count * it.chunk.heads;
  }
  const int helpers = elements < kMinParallelElements
      ? 0
      : std::min(max_threads() - 1, n_items - 1);
  if (helpers > 0) {
    shared_pool().enqueue([call] { call->work(); }, helpers);
  }
  call->work();
  // The helpers' last items end within one item's time of ours (worker_pool.h).
  wait_for_count(call->done, n_items);
}

} // namespace mlx_batched_decode::cpu
