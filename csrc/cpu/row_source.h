// Where the key or value rows of one (request, KV head) live: the row-source
// axis of the kernel core (DESIGN.md section 4). The core asks a source for
// the rows of positions [t, t + n) and never computes an address itself.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/decode_args.h"
#include "cpu/prefetch.h"

namespace mlx_batched_decode::cpu::MBD_CPU_ISA {

template <typename T>
struct RowSource {
  const T* base; // dense: the head [T, D] of one request; paged: the pool at one head
  const int64_t* stride; // dense: {batch, head, position, dim}; paged: {page, head, row, dim}
  const int32_t* table = nullptr; // paged: the request's row of block_tables
  int64_t table_stride = 0;
  int block_size = 0, num_blocks = 0;

  bool paged() const {
    return table != nullptr;
  }

  // Calls f(j, row) for positions t + j, j < n, in order: row points at the
  // position's first element, or is null when the position's table entry lies
  // outside [0, num_blocks) (a block with no keys, never dereferenced). The
  // table is read once per page, with one division per call.
  template <typename F>
  void for_rows(int t, int n, F&& f) const {
    if (!paged()) {
      for (int j = 0; j < n; ++j) {
        f(j, base + static_cast<int64_t>(t + j) * stride[2]);
      }
      return;
    }
    int page = t / block_size, row = t % block_size;
    for (int j = 0; j < n; ++page, row = 0) {
      const int32_t entry = table[page * table_stride];
      const bool valid = entry >= 0 && entry < num_blocks;
      const T* first = valid ? base + entry * stride[0] : nullptr;
      for (; row < block_size && j < n; ++row, ++j) {
        f(j, valid ? first + row * stride[2] : nullptr);
      }
    }
  }

  // Points rows[j] at position t + j, j < n <= 32, of a paged source whose
  // rows are read in place, and returns the bits j of the positions that hold
  // a key; rows[j] of the others is left as it was. One table entry and range
  // check per page and a plain store per row: through for_rows a row cost
  // about 60 instructions (callgrind), a fifth of a paged block-16 call's.
  uint32_t paged_rows(int t, int n, const T** rows) const {
    const int64_t step = stride[2];
    uint32_t valid = 0;
    int page = t / block_size, row = t % block_size;
    for (int j = 0; j < n; ++page, row = 0) {
      const int m = std::min(block_size - row, n - j);
      const int32_t entry = table[page * table_stride];
      if (entry >= 0 && entry < num_blocks) {
        const T* first = base + entry * stride[0] + row * step;
        for (int r = 0; r < m; ++r) {
          rows[j + r] = first + r * step;
        }
        valid |= (m >= 32 ? ~0u : (1u << m) - 1) << j;
      }
      j += m;
    }
    return valid;
  }

  // Requests positions [t, t + n) into L2, D elements each.
  void prefetch(int t, int n, int D) const {
    for_rows(t, n, [&](int, const T* row) {
      if (row == nullptr) {
        return;
      }
      for (int i = 0; i < D; i += 64 / static_cast<int>(sizeof(T))) {
        prefetch_l2(row + i * stride[3]);
      }
    });
  }
};

// The rows of request b, KV head h, in `data` with `stride` (a.keys with
// a.k_stride, or a.values with a.v_stride); position t at slot t + shift.
template <typename T>
RowSource<T> row_source(const DecodeArgs& a, const void* data, const int64_t* stride, int b, int h, int shift = 0) {
  const T* pool = static_cast<const T*>(data) + h * stride[1];
  if (a.block_tables == nullptr) {
    return {pool + b * stride[0] + shift * stride[2], stride};
  }
  return {pool, stride, a.block_tables + b * a.table_stride[0], a.table_stride[1], a.block_size, a.num_blocks};
}

// Whether some position of r in request b's table holds a key: its entry lies
// in [0, num_blocks). Always true for a dense layout.
inline bool holds_key(const DecodeArgs& a, int b, KeyRange r) {
  if (a.block_tables == nullptr) {
    return !r.empty();
  }
  for (int page = r.lo / a.block_size; !r.empty() && page <= (r.hi - 1) / a.block_size; ++page) {
    const int32_t entry = a.block_tables[b * a.table_stride[0] + page * a.table_stride[1]];
    if (entry >= 0 && entry < a.num_blocks) {
      return true;
    }
  }
  return false;
}

} // namespace mlx_batched_decode::cpu::MBD_CPU_ISA
