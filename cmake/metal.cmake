# Metal backend of _ext (Apple builds only): the eval_gpu launcher, and the
# metallib of the kernels where Apple's Metal compiler runs, installed next to
# the extension module where eval_gpu looks for it. Without the compiler,
# eval_gpu compiles the embedded source (cmake/metal_source.cmake) at first use.
# Included by the top-level CMakeLists.txt when MLX_BUILD_METAL is set, after
# the _ext target and MBD_METAL_SOURCE exist.
set(MBD_CSRC ${CMAKE_CURRENT_LIST_DIR}/../csrc)

target_sources(_ext PRIVATE ${MBD_CSRC}/metal/decode_launch.cpp
                            ${MBD_CSRC}/metal/eval_gpu.cpp)
target_compile_definitions(_ext PRIVATE MLX_BATCHED_DECODE_METAL)

include(${CMAKE_CURRENT_LIST_DIR}/metal_compiler.cmake)
mbd_metal_compiler_works(MBD_METAL_COMPILER)
if(MBD_METAL_COMPILER)
  # Built from the embedded text itself. Metal 3.1 (macOS 14) for the native
  # bfloat type; IEEE infinities and NaN, as MLX's run-time compiles (safe math).
  mlx_build_metallib(
    TARGET
    mlx_batched_decode_metallib
    TITLE
    mlx_batched_decode
    SOURCES
    ${MBD_METAL_SOURCE}
    COMPILE_OPTIONS
    -std=metal3.1
    -fno-fast-math
    OUTPUT_DIRECTORY
    ${CMAKE_CURRENT_BINARY_DIR})
  add_dependencies(_ext mlx_batched_decode_metallib)
  install(FILES ${CMAKE_CURRENT_BINARY_DIR}/mlx_batched_decode.metallib
          DESTINATION mlx_batched_decode)
endif()
