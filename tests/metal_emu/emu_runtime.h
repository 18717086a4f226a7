// Interface between an emulated kernel and the harness runtime: the calling
// lane's built-in values, collectives as rendezvous points, threadgroup memory
// registration and the kernel registry. Plain C++20, no MSL macros.
#pragma once

#include <cstddef>
#include <source_location>
#include <string>

namespace emu {

/** Built-in values of the lane that is running (Metal's [[attribute]] inputs). */
struct LaneContext {
  unsigned threadgroup_position_in_grid[3];
  unsigned threads_per_threadgroup[3];
  unsigned threadgroups_per_grid[3];
  unsigned thread_index_in_threadgroup;
  unsigned simdgroup_index_in_threadgroup;
  unsigned thread_index_in_simdgroup;
  unsigned simdgroups_per_threadgroup;
  unsigned threads_per_simdgroup;
};

const LaneContext& lane();

enum class Scope { simd, group };  // not "threadgroup": MSL keyword macros

// Computes every lane's result from all lanes' inputs, in lane order.
using CombineFn = void (*)(const void* const* inputs, void* const* outputs, int lanes);

/**
 * Waits until every lane of the scope reached the same collective (same source
 * line, same kind), then writes each lane's result. Misuse is reported with the
 * source lines and the calling lane is unwound.
 */
void rendezvous(
    Scope scope,
    const char* op,
    const std::source_location& where,
    const void* input,
    void* output,
    CombineFn combine);

/** Threadgroup memory declared in a kernel body: poisoned before each threadgroup. */
struct ThreadgroupMemory {
  ThreadgroupMemory(void* data, std::size_t bytes);
};

// Calls a kernel with the buffers bound at its [[buffer(i)]] indices.
using KernelFn = void (*)(void* const* buffers);

struct KernelRegistration {
  KernelRegistration(const char* name, KernelFn fn, const int* indices, int count);
};

/** A function constant as the launch sets it (Metal: MTLFunctionConstantValues). */
struct ConstantValue {
  int index;
  const void* data;
  std::size_t size;
};

/** Copies function constant `index` of the running launch; an unset one fails the launch. */
void read_function_constant(int index, void* value, std::size_t size);

enum class Backend { fibers = 0, threads = 1 };

/** A bound buffer whose loads are counted: [begin, end) holds buffer `index`. */
struct WatchedBuffer {
  const void* begin;
  const void* end;
  int index;
};

// Buffer indices the load counts cover (Metal's 31; the kernels bind 0..28).
constexpr int kMaxBuffers = 31;

/** Replaces the watched buffers and zeroes their counts. */
void watch_buffers(const WatchedBuffer* buffers, int count);

/** Called for every load of a "loads" build (load_counter.cpp): adds `bytes` to the buffer holding `address`. */
void count_load(const void* address, std::size_t bytes);

/** Bytes loaded from each buffer index since watch_buffers; all zero in other builds. */
void loaded_bytes(unsigned long long out[kMaxBuffers]);

/**
 * Runs the kernel `name` on a grid of threadgroups, one threadgroup after
 * another. `buffers[i]` is what the host bound at index i, `constants` the
 * function constants of the pipeline. Returns an empty
 * string on success, otherwise the first problem found.
 */
std::string dispatch(
    const char* name,
    void* const* buffers,
    int buffer_count,
    const unsigned grid[3],
    const unsigned group[3],
    Backend backend,
    const ConstantValue* constants = nullptr,
    int constant_count = 0);

} // namespace emu
