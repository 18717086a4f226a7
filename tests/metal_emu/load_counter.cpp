// Load hooks of the "loads" build (build.py): g++'s kernel-address
// instrumentation (-fsanitize=kernel-address, outlined) calls these for every
// load and store of the kernel object; loads are counted per bound buffer.
#include <cstddef>
#include <cstdint>

#include "emu_runtime.h"

#define EMU_LOAD_HOOKS(n)                                     \
  void __asan_load##n##_noabort(std::uintptr_t address) {     \
    emu::count_load(reinterpret_cast<const void*>(address), n); \
  }                                                            \
  void __asan_store##n##_noabort(std::uintptr_t) {}

extern "C" {

EMU_LOAD_HOOKS(1)
EMU_LOAD_HOOKS(2)
EMU_LOAD_HOOKS(4)
EMU_LOAD_HOOKS(8)
EMU_LOAD_HOOKS(16)

void __asan_loadN_noabort(std::uintptr_t address, std::size_t bytes) {
  emu::count_load(reinterpret_cast<const void*>(address), bytes);
}

void __asan_storeN_noabort(std::uintptr_t, std::size_t) {}

void __asan_handle_no_return() {}
void __asan_before_dynamic_init(const char*) {}
void __asan_after_dynamic_init() {}

} // extern "C"
