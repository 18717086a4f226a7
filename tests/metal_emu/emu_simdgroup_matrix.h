// MSL's simdgroup matrices (<metal_simdgroup_matrix>): 8x8 tiles owned by a
// whole simdgroup, each lane holding two elements (thread_elements()). Load,
// store and multiply(-accumulate) are collectives: rendezvous points of all
// lanes of the simdgroup, like simd_sum, so a call from only some lanes is
// reported. Included by metal_emu.h after the MSL keyword macros.
#pragma once

namespace metal {

/**
 * An 8x8 tile of T. A lane's two elements sit where emu::simdgroup_matrix_coord
 * says: the layout MLX's steel kernels rely on (steel/attn/mma.h,
 * BaseMMAFrag::get_coord, the second element one column right of the first).
 */
template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the harness models 8x8 simdgroup matrices only");
  // Unwritten elements read as NaN (as threadgroup memory does), so a tile used before a load shows.
  vec<T, 2> elements = vec<T, 2>(T(std::numeric_limits<float>::quiet_NaN()));

  vec<T, 2>& thread_elements() { return elements; }
  const vec<T, 2>& thread_elements() const { return elements; }
};

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

} // namespace metal

namespace emu {

/** {row, column} in an 8x8 tile of thread element `j` (0 or 1) of lane `lane`. */
inline void simdgroup_matrix_coord(int lane, int j, int& row, int& column) {
  const int quad = lane / 4;
  row = (quad & 4) + (lane / 2) % 4;
  column = (quad & 2) * 2 + (lane % 2) * 2 + j;
}

/** Offset of tile element (row, column) in memory with `elements_per_row`, as MSL's load and store address it. */
inline unsigned long simdgroup_matrix_offset(int row, int column, unsigned long elements_per_row,
                                             metal::ulong2 origin, bool transpose) {
  // The origin is {column, row} in memory; a transposed tile's element (row, column) is memory's (column, row).
  const unsigned long r = static_cast<unsigned long>(transpose ? column : row);
  const unsigned long c = static_cast<unsigned long>(transpose ? row : column);
  return (origin.y + r) * elements_per_row + origin.x + c;
}

template <typename P>
struct MatrixAccess {
  P memory;
  unsigned long elements_per_row;
  metal::ulong2 origin;
  bool transpose;
};

} // namespace emu

namespace metal {

template <typename T, int Cols = 8, int Rows = Cols>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(const T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.elements = vec<T, 2>(value);
  return m;
}

/** Loads an 8x8 tile from device or threadgroup memory; the simdgroup's first lane's arguments address it. */
template <typename T, typename U, int Cols, int Rows>
void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const U* src, ulong elements_per_row = Cols,
                    ulong2 matrix_origin = ulong2(0, 0), bool transpose_matrix = false,
                    std::source_location where = std::source_location::current()) {
  static_assert(std::is_same_v<std::remove_cv_t<U>, T>, "simdgroup_load: pointer and matrix element types differ");
  const emu::MatrixAccess<const T*> in{src, elements_per_row, matrix_origin, transpose_matrix};
  emu::rendezvous(emu::Scope::simd, "simdgroup_load", where, &in, &d.elements,
                  [](const void* const* ins, void* const* outs, int n) {
                    const auto& a = *static_cast<const emu::MatrixAccess<const T*>*>(ins[0]);
                    for (int lane = 0; lane < n; ++lane) {
                      vec<T, 2>& out = *static_cast<vec<T, 2>*>(outs[lane]);
                      for (int j = 0; j < 2; ++j) {
                        int row, column;
                        emu::simdgroup_matrix_coord(lane, j, row, column);
                        out[j] = a.memory[emu::simdgroup_matrix_offset(row, column, a.elements_per_row, a.origin,
                                                                       a.transpose)];
                      }
                    }
                  });
}

/** Stores an 8x8 tile to device or threadgroup memory; the simdgroup's first lane's arguments address it. */
template <typename T, int Cols, int Rows>
void simdgroup_store(const simdgroup_matrix<T, Cols, Rows>& s, T* dst, ulong elements_per_row = Cols,
                     ulong2 matrix_origin = ulong2(0, 0), bool transpose_matrix = false,
                     std::source_location where = std::source_location::current()) {
  struct In {
    emu::MatrixAccess<T*> access;
    vec<T, 2> elements;
  } in{{dst, elements_per_row, matrix_origin, transpose_matrix}, s.elements};
  emu::rendezvous(emu::Scope::simd, "simdgroup_store", where, &in, nullptr,
                  [](const void* const* ins, void* const*, int n) {
                    const emu::MatrixAccess<T*>& a = static_cast<const In*>(ins[0])->access;
                    for (int lane = 0; lane < n; ++lane) {
                      for (int j = 0; j < 2; ++j) {
                        int row, column;
                        emu::simdgroup_matrix_coord(lane, j, row, column);
                        a.memory[emu::simdgroup_matrix_offset(row, column, a.elements_per_row, a.origin,
                                                              a.transpose)] = static_cast<const In*>(ins[lane])->elements[j];
                      }
                    }
                  });
}

/** d = a * b + c over the whole tile, in float32 (then rounded to d's type). */
template <typename TD, typename TA, typename TB, typename TC, int Cols, int Rows>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, Cols, Rows>& d, const simdgroup_matrix<TA, Cols, Rows>& a,
                                   const simdgroup_matrix<TB, Cols, Rows>& b, const simdgroup_matrix<TC, Cols, Rows>& c,
                                   std::source_location where = std::source_location::current()) {
  struct In {
    vec<TA, 2> a;
    vec<TB, 2> b;
    vec<TC, 2> c;
  } in{a.elements, b.elements, c.elements};  // copies: d may alias a, b or c
  emu::rendezvous(emu::Scope::simd, "simdgroup_multiply_accumulate", where, &in, &d.elements,
                  [](const void* const* ins, void* const* outs, int n) {
                    // A partial simdgroup leaves elements unset: NaN, so its result shows it.
                    constexpr float nan = std::numeric_limits<float>::quiet_NaN();
                    float ma[8][8], mb[8][8], mc[8][8];
                    std::fill(&ma[0][0], &ma[0][0] + 64, nan);
                    std::fill(&mb[0][0], &mb[0][0] + 64, nan);
                    std::fill(&mc[0][0], &mc[0][0] + 64, nan);
                    for (int lane = 0; lane < n; ++lane) {
                      const In& l = *static_cast<const In*>(ins[lane]);
                      for (int j = 0; j < 2; ++j) {
                        int row, column;
                        emu::simdgroup_matrix_coord(lane, j, row, column);
                        ma[row][column] = float(l.a[j]);
                        mb[row][column] = float(l.b[j]);
                        mc[row][column] = float(l.c[j]);
                      }
                    }
                    for (int lane = 0; lane < n; ++lane) {
                      vec<TD, 2>& out = *static_cast<vec<TD, 2>*>(outs[lane]);
                      for (int j = 0; j < 2; ++j) {
                        int row, column;
                        emu::simdgroup_matrix_coord(lane, j, row, column);
                        float acc = mc[row][column];
                        for (int k = 0; k < 8; ++k) {
                          acc = std::fma(ma[row][k], mb[k][column], acc);
                        }
                        out[j] = TD(acc);
                      }
                    }
                  });
}

/** d = a * b. */
template <typename TD, typename TA, typename TB, int Cols, int Rows>
void simdgroup_multiply(simdgroup_matrix<TD, Cols, Rows>& d, const simdgroup_matrix<TA, Cols, Rows>& a,
                        const simdgroup_matrix<TB, Cols, Rows>& b,
                        std::source_location where = std::source_location::current()) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<TD, Cols, Rows>(TD(0)), where);
}

} // namespace metal
