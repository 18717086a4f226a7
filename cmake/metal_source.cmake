# The Metal kernel source embedded in _ext, on every platform: the .metal files
# of csrc/kernels with their includes resolved (cmake/metal_source.py, which the
# Linux emulation harness runs too). Sets MBD_METAL_SOURCE, the flattened .metal
# file, from which cmake/metal.cmake builds the metallib where it can.
set(MBD_KERNEL_DIR ${CMAKE_CURRENT_LIST_DIR}/../csrc/kernels)
file(GLOB MBD_METAL_ENTRIES CONFIGURE_DEPENDS ${MBD_KERNEL_DIR}/*.metal)
file(GLOB_RECURSE MBD_METAL_HEADERS CONFIGURE_DEPENDS ${MBD_KERNEL_DIR}/*.h)
set(MBD_METAL_SOURCE ${CMAKE_CURRENT_BINARY_DIR}/generated/mlx_batched_decode.metal)
set(MBD_METAL_SOURCE_CPP ${CMAKE_CURRENT_BINARY_DIR}/generated/metal_source.cpp)
add_custom_command(
  OUTPUT ${MBD_METAL_SOURCE} ${MBD_METAL_SOURCE_CPP}
  COMMAND ${Python_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/metal_source.py
          --metal ${MBD_METAL_SOURCE} --cpp ${MBD_METAL_SOURCE_CPP} ${MBD_METAL_ENTRIES}
  DEPENDS ${CMAKE_CURRENT_LIST_DIR}/metal_source.py ${MBD_METAL_ENTRIES} ${MBD_METAL_HEADERS}
  COMMENT "Embedding the Metal kernel source"
  VERBATIM)
# A library of its own: the module's other files need not wait for the
# custom command, which waits for the module's dependencies (the kernel builds).
add_library(mbd_metal_source STATIC ${MBD_METAL_SOURCE_CPP})
target_include_directories(mbd_metal_source PRIVATE ${CMAKE_CURRENT_LIST_DIR}/../csrc)
target_link_libraries(_ext PRIVATE mbd_metal_source)
