# memrt_find_torch(): finds LibTorch as memrt uses it, for memrt's own build and for out-of-tree
# plugins (the installed memrtConfig.cmake calls it too). Sets:
#   TORCH_LIBRARIES, TORCH_INCLUDE_DIRS, TORCH_INSTALL_PREFIX, MEMRT_TORCH_LIB_DIR,
#   MEMRT_TORCH_VERSION, MEMRT_TORCH_HAS_CUDA (whether LibTorch's CUDA libraries are linked).
#
# LibTorch is found through Torch_DIR / CMAKE_PREFIX_PATH. A CUDA LibTorch (PyPI's torch wheel is
# one) has a CMake package that fails without a CUDA toolkit; on a machine without nvcc memrt
# links the same LibTorch's CPU libraries (libtorch_cpu, libc10) directly instead.
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
    else()
      set(MEMRT_TORCH_HAS_CUDA OFF)
    endif()
  endif()
  set(MEMRT_TORCH_LIB_DIR ${TORCH_INSTALL_PREFIX}/lib)
endmacro()
