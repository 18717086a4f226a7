# Whether Apple's Metal compiler runs. Since Xcode 26 the Metal Toolchain is an
# optional download, and `xcrun --find metal` succeeds without it: run the
# compiler itself.
function(mbd_metal_compiler_works out)
  execute_process(
    COMMAND xcrun -sdk macosx metal --version
    RESULT_VARIABLE result
    OUTPUT_QUIET ERROR_QUIET
    TIMEOUT 60)
  if(result STREQUAL "0")
    set(${out} TRUE PARENT_SCOPE)
  else()
    message(STATUS "mlx_batched_decode: no Metal compiler (`xcrun -sdk macosx metal --version` failed): "
                   "the Metal kernels will be compiled at first use")
    set(${out} FALSE PARENT_SCOPE)
  endif()
endfunction()
