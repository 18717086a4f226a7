#include "cpu/shared_blocks.h"

#include <algorithm>
#include <cstdint>
#include <unordered_map>

namespace mlx_batched_decode::cpu {

namespace {

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h;
}

int32_t entry(const DecodeArgs& a, int b, int page) {
  return a.block_tables[b * a.table_stride[0] + page * a.table_stride[1]];
}

} // namespace

std::vector<CellGroup> group_shared_cells(const DecodeArgs& a, int cell, int max_members) {
  max_members = std::max(1, max_members);
  std::vector<CellGroup> groups;
  // Hash of (bounds, entries) -> the groups with that hash that still take members.
  std::unordered_map<uint64_t, std::vector<int>> open;
  for (int b = 0; b < a.B; ++b) {
    const KeyRange keys = a.of_request(b).request_range(b);
    for (int t0 = keys.lo, t1; t0 < keys.hi; t0 = t1) {
      t1 = std::min(keys.hi, (t0 / cell + 1) * cell);
      const int first = t0 / a.block_size, last = (t1 - 1) / a.block_size;
      uint64_t h = mix(mix(0, static_cast<uint64_t>(t0)), static_cast<uint64_t>(t1));
      for (int p = first; p <= last; ++p) {
        h = mix(h, static_cast<uint32_t>(entry(a, b, p)));
      }
      std::vector<int>& candidates = open[h];
      int joined = -1;
      for (int g : candidates) {
        const CellGroup& c = groups[g];
        const int leader = c.requests[0];
        bool same = c.t0 == t0 && c.t1 == t1;
        for (int p = first; same && p <= last; ++p) {
          same = entry(a, leader, p) == entry(a, b, p);
        }
        if (same) {
          joined = g;
          break;
        }
      }
      if (joined < 0) {
        joined = static_cast<int>(groups.size());
        groups.push_back({t0, t1, {}});
        candidates.push_back(joined);
      }
      groups[joined].requests.push_back(b);
      if (static_cast<int>(groups[joined].requests.size()) == max_members) {
        candidates.erase(std::find(candidates.begin(), candidates.end(), joined));
      }
    }
  }
  return groups;
}

} // namespace mlx_batched_decode::cpu
