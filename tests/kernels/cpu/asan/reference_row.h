// The drivers' scalar float64 reference: softmax attention of one query row
// over its keys, wherever a layout keeps them.
#pragma once

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

// The output [Dv] of query q [D] over positions [lo, hi), scaled by
// 1/sqrt(D) and, for cap > 0, capped to cap * tanh(s / cap); rows(t) gives
// position t's key [D] and value [Dv] rows, or nulls for a position that
// holds no key. A finite sink is one more logit in the denominator, of no
// value. No key at all gives zeros.
template <typename Rows>
std::vector<double> reference_output(const float* q, int lo, int hi, int D, int Dv, Rows rows, double cap = 0.0,
                                     double sink = -INFINITY) {
  double m = sink, l = 0.0;
  std::vector<double> acc(Dv, 0.0);
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
  if (sink > -INFINITY) {
    l += std::exp(sink - m);
  }
  for (const auto& [s, v] : scored) {
    const double w = std::exp(s - m);
    l += w;
    for (int e = 0; e < Dv; ++e) {
      acc[e] += w * v[e];
    }
  }
  for (double& x : acc) {
    x = scored.empty() ? 0.0 : x / l;
  }
  return acc;
}

// Element e of reference_output, the values' head dim e + 1 or more.
template <typename Rows>
double reference_row(const float* q, int lo, int hi, int D, int e, Rows rows, double cap = 0.0) {
  return reference_output(q, lo, hi, D, e + 1, rows, cap)[e];
}
