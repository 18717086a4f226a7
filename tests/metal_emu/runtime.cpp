// Harness runtime: runs the lanes of a threadgroup as fibers (deterministic,
// the default) or as OS threads (for ThreadSanitizer), and implements every
// collective as a rendezvous that checks all lanes meet at the same place.
#include "emu_runtime.h"

#include <ucontext.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

namespace emu {
namespace {

constexpr int kSimdWidth = 32;
// Kernels keep small register arrays; sanitizers need room for redzones.
constexpr std::size_t kFiberStack = EMU_ASAN ? (1u << 19) : (1u << 17);
// A thread-backend lane waiting longer than this is reported as a deadlock
// (a harness bug: arrival checks report every misuse before it can hang).
constexpr auto kThreadWaitLimit = std::chrono::seconds(60);

struct Registered {
  KernelFn fn;
  std::vector<int> indices;
};

std::map<std::string, Registered>& registry() {
  static std::map<std::string, Registered> kernels;
  return kernels;
}

std::vector<std::pair<void*, std::size_t>>& threadgroup_regions() {
  static std::vector<std::pair<void*, std::size_t>> regions;
  return regions;
}

// Thrown inside a lane to unwind it once the launch has failed.
struct LaneAbort {};

// One instance of a collective while its lanes gather.
struct Pending {
  const char* op = nullptr;
  std::source_location where;
  int arrived = 0;
};

struct Lane {
  LaneContext ctx{};
  const void* input = nullptr;
  void* output = nullptr;
  bool waiting = false;
  bool finished = false;
  Scope scope = Scope::simd;
  const char* op = nullptr;
  std::source_location where;
  ucontext_t fiber{};
  std::unique_ptr<char[]> stack;
  void* fake_stack = nullptr;
};

std::string site(const char* op, const std::source_location& w) {
  std::ostringstream s;
  s << op << " at " << w.file_name() << ":" << w.line();
  return s.str();
}

bool same_site(const char* op, const std::source_location& a, const Pending& p) {
  return std::strcmp(op, p.op) == 0 && a.line() == p.where.line() &&
      std::strcmp(a.file_name(), p.where.file_name()) == 0;
}

// "lanes 0-15, 20" style list of thread indices in the threadgroup.
std::string lane_list(const std::vector<int>& ids) {
  std::ostringstream s;
  s << (ids.size() == 1 ? "thread " : "threads ");
  for (std::size_t i = 0; i < ids.size();) {
    std::size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) {
      ++j;
    }
    s << (i ? ", " : "") << ids[i];
    if (j > i) {
      s << "-" << ids[j];
    }
    i = j + 1;
  }
  return s.str();
}

class Threadgroup {
 public:
  Threadgroup(KernelFn fn, void* const* buffers, const unsigned grid[3], const unsigned group[3], Backend backend,
              std::vector<ConstantValue> constants)
      : fn_(fn), buffers_(buffers), backend_(backend), constants_(std::move(constants)) {
    const int n = int(group[0] * group[1] * group[2]);
    lanes_.resize(n);
    simd_.resize((n + kSimdWidth - 1) / kSimdWidth);
    for (int i = 0; i < n; ++i) {
      LaneContext& c = lanes_[i].ctx;
      for (int a = 0; a < 3; ++a) {
        c.threads_per_threadgroup[a] = group[a];
        c.threadgroups_per_grid[a] = grid[a];
      }
      c.thread_index_in_threadgroup = unsigned(i);
      c.simdgroup_index_in_threadgroup = unsigned(i / kSimdWidth);
      c.thread_index_in_simdgroup = unsigned(i % kSimdWidth);
      c.simdgroups_per_threadgroup = unsigned(simd_.size());
      c.threads_per_simdgroup = kSimdWidth;
      if (backend_ == Backend::fibers) {
        lanes_[i].stack.reset(new char[kFiberStack]);
      }
    }
  }

  std::string run(const unsigned position[3]) {
    for (auto& [data, bytes] : threadgroup_regions()) {
      std::memset(data, 0xFF, bytes);  // NaN in float, half and bfloat
    }
    for (Lane& l : lanes_) {
      std::copy(position, position + 3, l.ctx.threadgroup_position_in_grid);
      l.waiting = l.finished = false;
    }
    simd_.assign(simd_.size(), Pending{});
    barrier_ = Pending{};
    error_.clear();
    if (backend_ == Backend::fibers) {
      run_fibers();
    } else {
      run_threads();
    }
    return error_;
  }

  void arrive(Lane& me, Scope scope, const char* op, const std::source_location& where,
              const void* input, void* output, CombineFn combine) {
    std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
    if (backend_ == Backend::threads) {
      lock.lock();
    }
    if (!error_.empty()) {
      throw LaneAbort{};
    }
    auto [first, count] = members(me, scope);
    Pending& pending = scope == Scope::simd ? simd_[me.ctx.simdgroup_index_in_threadgroup] : barrier_;
    std::string problem = check_arrival(me, scope, op, where, pending, first, count);
    if (!problem.empty()) {
      fail(problem);
      throw LaneAbort{};
    }
    if (pending.arrived == 0) {
      pending.op = op;
      pending.where = where;
    }
    ++pending.arrived;
    me.input = input;
    me.output = output;
    me.scope = scope;
    me.op = op;
    me.where = where;
    me.waiting = true;
    if (pending.arrived == count) {
      std::vector<const void*> ins(count);
      std::vector<void*> outs(count);
      for (int i = 0; i < count; ++i) {
        ins[i] = lanes_[first + i].input;
        outs[i] = lanes_[first + i].output;
        lanes_[first + i].waiting = false;
      }
      combine(ins.data(), outs.data(), count);
      pending = Pending{};
      cv_.notify_all();
      return;
    }
    if (backend_ == Backend::fibers) {
      to_scheduler(me, false);
    } else if (!cv_.wait_for(lock, kThreadWaitLimit, [&] { return !me.waiting || !error_.empty(); })) {
      fail("deadlock (timeout): " + describe_waiting());
    }
    if (me.waiting) {
      throw LaneAbort{};
    }
  }

  void read_constant(int index, void* value, std::size_t size) {
    for (const ConstantValue& c : constants_) {
      if (c.index == index && c.size == size) {
        std::memcpy(value, c.data, size);
        return;
      }
    }
    std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
    if (backend_ == Backend::threads) {
      lock.lock();
    }
    fail("function constant " + std::to_string(index) + " (" + std::to_string(size) +
         " bytes) is read but the launch does not set it");
    throw LaneAbort{};
  }

  void lane_main(Lane& me) {
    try {
      fn_(buffers_);
    } catch (const LaneAbort&) {
      return;
    }
    std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
    if (backend_ == Backend::threads) {
      lock.lock();
    }
    me.finished = true;
    if (!error_.empty()) {
      return;
    }
    const Pending& mine = simd_[me.ctx.simdgroup_index_in_threadgroup];
    if (mine.arrived > 0) {
      fail(lane_list({int(me.ctx.thread_index_in_threadgroup)}) + " returned while " +
           waiting_at(members(me, Scope::simd)) + " of its simdgroup wait at " +
           site(mine.op, mine.where) + ": a collective reached by only some lanes");
    } else if (barrier_.arrived > 0) {
      fail(lane_list({int(me.ctx.thread_index_in_threadgroup)}) + " returned without reaching " +
           site(barrier_.op, barrier_.where) + " where " + waiting_at({0, int(lanes_.size())}) +
           " wait: a skipped barrier");
    }
  }

  static thread_local Lane* current;
  static Threadgroup* active;

 private:
  std::pair<int, int> members(const Lane& me, Scope scope) const {
    if (scope == Scope::group) {
      return {0, int(lanes_.size())};
    }
    const int first = int(me.ctx.simdgroup_index_in_threadgroup) * kSimdWidth;
    return {first, std::min(kSimdWidth, int(lanes_.size()) - first)};
  }

  std::string check_arrival(const Lane& me, Scope scope, const char* op, const std::source_location& where,
                            const Pending& pending, int first, int count) const {
    const std::string who = lane_list({int(me.ctx.thread_index_in_threadgroup)}) + " reached " + site(op, where);
    std::vector<int> gone;
    for (int i = first; i < first + count; ++i) {
      if (lanes_[i].finished) {
        gone.push_back(i);
      }
    }
    if (!gone.empty()) {
      return who + " after " + lane_list(gone) + " returned: " +
          (scope == Scope::group ? "a skipped barrier" : "a collective reached by only some lanes");
    }
    if (pending.arrived > 0 && !same_site(op, where, pending)) {
      return "mismatched collectives: " + who + " while " + waiting_at({first, count}) + " wait at " +
          site(pending.op, pending.where);
    }
    // A lane of my simdgroup parked at the other kind of collective never meets me.
    auto [sfirst, scount] = members(me, Scope::simd);
    std::vector<int> elsewhere;
    const Lane* other = nullptr;
    for (int i = sfirst; i < sfirst + scount; ++i) {
      if (lanes_[i].waiting && lanes_[i].scope != scope) {
        elsewhere.push_back(i);
        other = &lanes_[i];
      }
    }
    if (other != nullptr) {
      return "mismatched collectives: " + who + " while " + lane_list(elsewhere) + " of its simdgroup wait at " +
          site(other->op, other->where);
    }
    return {};
  }

  std::string waiting_at(std::pair<int, int> range) const {
    std::vector<int> ids;
    for (int i = range.first; i < range.first + range.second; ++i) {
      if (lanes_[i].waiting) {
        ids.push_back(i);
      }
    }
    return lane_list(ids);
  }

  std::string describe_waiting() const {
    std::map<std::string, std::vector<int>> by_site;
    for (int i = 0; i < int(lanes_.size()); ++i) {
      if (lanes_[i].waiting) {
        by_site[site(lanes_[i].op, lanes_[i].where)].push_back(i);
      }
    }
    std::string s;
    for (auto& [where, ids] : by_site) {
      s += (s.empty() ? "" : "; ") + lane_list(ids) + " wait at " + where;
    }
    return s;
  }

  void fail(const std::string& message) {
    if (error_.empty()) {
      std::ostringstream s;
      const unsigned* p = lanes_[0].ctx.threadgroup_position_in_grid;
      s << "threadgroup (" << p[0] << ", " << p[1] << ", " << p[2] << "): " << message;
      error_ = s.str();
    }
    cv_.notify_all();
  }

  static void fiber_entry() {
    Lane& me = *current;
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &active->scheduler_bottom_, &active->scheduler_size_);
#endif
    active->lane_main(me);
    active->to_scheduler(me, true);
  }

  void to_scheduler(Lane& me, [[maybe_unused]] bool last) {
#if EMU_ASAN
    __sanitizer_start_switch_fiber(last ? nullptr : &me.fake_stack, scheduler_bottom_, scheduler_size_);
#endif
    swapcontext(&me.fiber, &scheduler_);
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(me.fake_stack, &scheduler_bottom_, &scheduler_size_);
#endif
  }

  void to_lane(Lane& l) {
    current = &l;
#if EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, l.stack.get(), kFiberStack);
#endif
    swapcontext(&scheduler_, &l.fiber);
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  }

  void run_fibers() {
    for (Lane& l : lanes_) {
      getcontext(&l.fiber);
      l.fiber.uc_stack.ss_sp = l.stack.get();
      l.fiber.uc_stack.ss_size = kFiberStack;
      l.fiber.uc_link = &scheduler_;
      makecontext(&l.fiber, &Threadgroup::fiber_entry, 0);
    }
    // Round robin: each runnable lane runs until it parks at a collective or returns.
    for (bool progress = true; progress && error_.empty();) {
      progress = false;
      for (Lane& l : lanes_) {
        if (!l.finished && !l.waiting && error_.empty()) {
          to_lane(l);
          progress = true;
        }
      }
    }
    // Arrival checks report every misuse first; this keeps a harness bug from passing silently.
    if (error_.empty() && !describe_waiting().empty()) {
      fail("deadlock: " + describe_waiting());
    }
  }

  void run_threads() {
    std::vector<std::thread> threads;
    threads.reserve(lanes_.size());
    for (Lane& l : lanes_) {
      threads.emplace_back([this, &l] {
        current = &l;
        lane_main(l);
      });
    }
    for (std::thread& t : threads) {
      t.join();
    }
  }

  KernelFn fn_;
  void* const* buffers_;
  Backend backend_;
  std::vector<ConstantValue> constants_;
  std::vector<Lane> lanes_;
  std::vector<Pending> simd_;
  Pending barrier_;
  std::string error_;
  std::mutex mutex_;
  std::condition_variable cv_;
  ucontext_t scheduler_{};
  const void* scheduler_bottom_ = nullptr;
  std::size_t scheduler_size_ = 0;
};

thread_local Lane* Threadgroup::current = nullptr;
Threadgroup* Threadgroup::active = nullptr;

} // namespace

const LaneContext& lane() {
  return Threadgroup::current->ctx;
}

void read_function_constant(int index, void* value, std::size_t size) {
  Threadgroup::active->read_constant(index, value, size);
}

void rendezvous(Scope scope, const char* op, const std::source_location& where,
                const void* input, void* output, CombineFn combine) {
  Threadgroup::active->arrive(*Threadgroup::current, scope, op, where, input, output, combine);
}

ThreadgroupMemory::ThreadgroupMemory(void* data, std::size_t bytes) {
  // First use inside a running threadgroup: poison now, later ones in run().
  std::memset(data, 0xFF, bytes);
  threadgroup_regions().emplace_back(data, bytes);
}

namespace {

std::vector<WatchedBuffer> watched;
std::atomic<unsigned long long> loaded[kMaxBuffers];

} // namespace

void watch_buffers(const WatchedBuffer* buffers, int count) {
  watched.assign(buffers, buffers + count);
  for (auto& bytes : loaded) {
    bytes.store(0, std::memory_order_relaxed);
  }
}

void count_load(const void* address, std::size_t bytes) {
  // Lanes of the thread backend count concurrently; the set of buffers is fixed during a launch.
  for (const WatchedBuffer& w : watched) {
    if (std::less_equal<>()(w.begin, address) && std::less<>()(address, w.end)) {
      loaded[w.index].fetch_add(bytes, std::memory_order_relaxed);
      return;
    }
  }
}

void loaded_bytes(unsigned long long out[kMaxBuffers]) {
  for (int i = 0; i < kMaxBuffers; ++i) {
    out[i] = loaded[i].load(std::memory_order_relaxed);
  }
}

KernelRegistration::KernelRegistration(const char* name, KernelFn fn, const int* indices, int count) {
  registry()[name] = Registered{fn, std::vector<int>(indices, indices + count)};
}

std::string dispatch(const char* name, void* const* buffers, int buffer_count, const unsigned grid[3],
                     const unsigned group[3], Backend backend, const ConstantValue* constants,
                     int constant_count) {
  auto it = registry().find(name);
  if (it == registry().end()) {
    return std::string("no kernel named ") + name + " in the library";
  }
  for (int index : it->second.indices) {
    if (index >= buffer_count || buffers[index] == nullptr) {
      return std::string(name) + " reads [[buffer(" + std::to_string(index) + ")]], which the launch left unbound";
    }
  }
  const unsigned threads = group[0] * group[1] * group[2];
  if (threads == 0 || threads > 1024) {
    return "threadgroup of " + std::to_string(threads) + " threads (Metal allows 1 to 1024)";
  }
  Threadgroup tg(it->second.fn, buffers, grid, group, backend,
                 std::vector<ConstantValue>(constants, constants + constant_count));
  Threadgroup::active = &tg;
  std::string error;
  for (unsigned z = 0; z < grid[2] && error.empty(); ++z) {
    for (unsigned y = 0; y < grid[1] && error.empty(); ++y) {
      for (unsigned x = 0; x < grid[0] && error.empty(); ++x) {
        const unsigned position[3] = {x, y, z};
        error = tg.run(position);
      }
    }
  }
  Threadgroup::active = nullptr;
  return error;
}

} // namespace emu
