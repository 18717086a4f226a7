// Declarations-only stand-in for Apple's metal-cpp, for a syntax check of the
// Metal launcher on Linux against MLX's real host headers. Only what MLX's
// device.h and the launcher name; nothing here is ever linked or run.
#pragma once

#include <cstddef>

namespace NS {
using UInteger = unsigned long;
template <class T>
class SharedPtr {
 public:
  T* get() const;
  T* operator->() const;
};
class String {
 public:
  static String* string(const char* text, UInteger encoding);
  const char* utf8String() const;
};
constexpr UInteger UTF8StringEncoding = 4;
class AutoreleasePool;
class Error;
} // namespace NS

namespace MTL {
struct Size {
  Size(NS::UInteger w, NS::UInteger h, NS::UInteger d);
  NS::UInteger width, height, depth;
};
class Allocation;
class Buffer;
class CompileOptions;
class Device;
class Fence;
class Function;
class Library;
class LinkedFunctions;
class ResidencySet;
class Resource;
enum class DataType { DataTypeBool, DataTypeInt };
class ComputePipelineState {
 public:
  NS::UInteger maxTotalThreadsPerThreadgroup() const;
};
class CommandBuffer {
 public:
  NS::String* label() const;
  void setLabel(const NS::String* label);
};
class CommandQueue {
 public:
  void setLabel(const NS::String* label);
};
class ComputeCommandEncoder {
 public:
  void setComputePipelineState(ComputePipelineState* state);
  void setBytes(const void* bytes, NS::UInteger length, NS::UInteger index);
  void setThreadgroupMemoryLength(NS::UInteger length, NS::UInteger index);
};
} // namespace MTL
