// The drivers' scalar float64 reference: softmax attention of one query row
// over its keys, wherever a layout keeps them.
#pragma once

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

// Element e of the output of query q [D] over positions [lo, hi), scaled by
// 1/sqrt(D) and, for cap > 0, capped to cap * tanh(s / cap); rows(t) gives
// position t's key and value rows, or nulls for a position that holds no key.
// No key at all gives 0.
template <typename Rows>
double reference_row(const float* q, int lo, int hi, int D, int e, Rows rows, double cap = 0.0) {
  double m = -INFINITY, l = 0.0, acc = 0.0;
  std::vector<std::pair<double, const float*>> scored;
  for (int t = lo; t < hi; ++t) {
    const auto [k, v] = rows(t);
    if (k == nullptr) {
      continue;
    }
    double s = 0.0;
    for (int d = 0; d < D; ++d) {
      s += double(q[d]) * k[d];
    }
    s /= std::sqrt(double(D));
    scored.push_back({cap > 0.0 ? cap * std::tanh(s / cap) : s, v});
    m = std::max(m, scored.back().first);
  }
  for (const auto& [s, v] : scored) {
    const double w = std::exp(s - m);
    l += w;
    acc += w * v[e];
  }
  return scored.empty() ? 0.0 : acc / l;
}
