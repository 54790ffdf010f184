# memrt_find_torch(): finds LibTorch as memrt uses it, for memrt's own build and for out-of-tree
# plugins (the installed memrtConfig.cmake calls it too). Sets:
#   TORCH_LIBRARIES (LibTorch's CPU libraries, libtorch_cpu and libc10: what memrt and its plugins
#   link), TORCH_INCLUDE_DIRS, TORCH_INSTALL_PREFIX, MEMRT_TORCH_LIB_DIR, MEMRT_TORCH_VERSION,
#   MEMRT_TORCH_HAS_CUDA (whether LibTorch's CUDA libraries can be linked) and, when it is ON,
#   MEMRT_TORCH_CUDA_LIBRARIES (every LibTorch library, CUDA's included).
#
# LibTorch is found through Torch_DIR / CMAKE_PREFIX_PATH. A CUDA LibTorch (PyPI's torch wheel is
# one) has a CMake package that fails without a CUDA toolkit; on a machine without nvcc memrt
# reads its version and paths directly. Either way memrt links only the CPU libraries: loading
# LibTorch's CUDA ones (libtorch_cuda, cuDNN, cuBLAS, NCCL, ...) costs every process about 0.4 s and
# 390 MB of resident memory. They load where CUDA is used: libmemrt_nccl (a CUDA rank's process
# group, opened on demand) and the CUDA kernel tests. A CUDA tensor implies they are loaded, and
# memrt reaches the CUDA allocator, streams and generators through LibTorch's device-generic
# interfaces.
macro(memrt_find_torch)
  set(_memrt_torch_root "")
  if(Torch_DIR)
    get_filename_component(_memrt_torch_root "${Torch_DIR}/../../.." ABSOLUTE)
  else()
    foreach(_p ${CMAKE_PREFIX_PATH})
      if(EXISTS "${_p}/Torch/TorchConfig.cmake")
        get_filename_component(_memrt_torch_root "${_p}/../.." ABSOLUTE)
        break()
      endif()
    endforeach()
  endif()

  include(CheckLanguage)
  check_language(CUDA)
  if(_memrt_torch_root AND EXISTS "${_memrt_torch_root}/lib/libtorch_cuda.so"
     AND NOT CMAKE_CUDA_COMPILER)
    include("${_memrt_torch_root}/share/cmake/Torch/TorchConfigVersion.cmake")
    set(MEMRT_TORCH_VERSION ${PACKAGE_VERSION})
    set(TORCH_INSTALL_PREFIX ${_memrt_torch_root})
    set(TORCH_INCLUDE_DIRS ${_memrt_torch_root}/include
                           ${_memrt_torch_root}/include/torch/csrc/api/include)
    set(TORCH_LIBRARIES ${_memrt_torch_root}/lib/libtorch_cpu.so ${_memrt_torch_root}/lib/libc10.so)
    set(MEMRT_TORCH_HAS_CUDA OFF)
    message(STATUS "memrt: LibTorch at ${_memrt_torch_root} has CUDA, but no CUDA toolkit (nvcc) "
                   "was found: linking its CPU libraries only")
  else()
    find_package(Torch REQUIRED)
    set(MEMRT_TORCH_VERSION ${Torch_VERSION})
    if(TARGET torch_cuda OR TORCH_CUDA_LIBRARIES)
      set(MEMRT_TORCH_HAS_CUDA ON)
      set(MEMRT_TORCH_CUDA_LIBRARIES ${TORCH_LIBRARIES})
      set(TORCH_LIBRARIES ${TORCH_INSTALL_PREFIX}/lib/libtorch_cpu.so ${TORCH_INSTALL_PREFIX}/lib/libc10.so)
    else()
      set(MEMRT_TORCH_HAS_CUDA OFF)
    endif()
  endif()
  set(MEMRT_TORCH_LIB_DIR ${TORCH_INSTALL_PREFIX}/lib)
endmacro()
