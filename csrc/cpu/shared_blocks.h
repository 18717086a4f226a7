// Finding the pages that requests of one paged call share (parallel sampling,
// a common system prompt): the scheduler gives each group one work item that
// reads the pages once for all its requests, the idea of FlashInfer's cascade
// attention found from the block tables themselves.
#pragma once

#include <vector>

#include "cpu/decode_args.h"

namespace mlx_batched_decode::cpu {

// Requests that read keys [t0, t1) of one cell from the same pages.
struct CellGroup {
  int t0, t1;
  std::vector<int> requests; // ascending
};

// Cuts each request's keys (request_range) at multiples of `cell` positions
// and groups the pieces whose bounds and table entries are equal, at most
// max_members requests to a group (at least 1). Every piece of every request
// is in exactly one group; only table entries inside a request's length are
// read.
std::vector<CellGroup> group_shared_cells(const DecodeArgs& a, int cell, int max_members);

} // namespace mlx_batched_decode::cpu
