# Metal backend of _ext (Apple builds only): the eval_gpu launcher and the
# metallib of the kernels, installed next to the extension module where
# eval_gpu looks for it. Included by the top-level CMakeLists.txt when
# MLX_BUILD_METAL is set, after the _ext target exists.
set(MBD_CSRC ${CMAKE_CURRENT_LIST_DIR}/../csrc)

target_sources(_ext PRIVATE ${MBD_CSRC}/metal/batched_decode_attention_gpu.cpp)
target_compile_definitions(_ext PRIVATE MLX_BATCHED_DECODE_METAL)

# Metal 3.1 (macOS 14) for the native bfloat type.
mlx_build_metallib(
  TARGET
  mlx_batched_decode_metallib
  TITLE
  mlx_batched_decode
  SOURCES
  ${MBD_CSRC}/kernels/batched_decode_attention.metal
  INCLUDE_DIRS
  ${MBD_CSRC}/kernels
  ${MLX_INCLUDE_DIRS}
  DEPS
  ${MBD_CSRC}/kernels/batched_decode_attention.h
  ${MBD_CSRC}/kernels/batched_decode_attention_params.h
  COMPILE_OPTIONS
  -std=metal3.1
  OUTPUT_DIRECTORY
  ${CMAKE_CURRENT_BINARY_DIR})
add_dependencies(_ext mlx_batched_decode_metallib)

install(FILES ${CMAKE_CURRENT_BINARY_DIR}/mlx_batched_decode.metallib
        DESTINATION mlx_batched_decode)
