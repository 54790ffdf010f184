# Third-party dependencies. Everything but LibTorch comes from Debian packages (scripts/setup.sh).

# ---- ccache ---------------------------------------------------------------------------------
find_program(MEMRT_CCACHE ccache)
if(MEMRT_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  # Precompiled headers need these sloppiness settings or ccache never hits. Paths under the source
  # tree are hashed relative to it and the working directory is not hashed, so a clone elsewhere
  # (CI's fresh clone) reuses what another clone compiled: otherwise every new folder is a cold
  # build, about 50 minutes on the slowest 2-core machine. (Debug info then names the folder that
  # compiled the object first.)
  set(CMAKE_CXX_COMPILER_LAUNCHER
      ${CMAKE_COMMAND} -E env
      "CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime"
      "CCACHE_BASEDIR=${CMAKE_SOURCE_DIR}" CCACHE_NOHASHDIR=1
      ${MEMRT_CCACHE})
  message(STATUS "memrt: compiling through ccache (${MEMRT_CCACHE})")
endif()

# ---- LibTorch ---------------------------------------------------------------------------------
# Either Torch_DIR / CMAKE_PREFIX_PATH point at a LibTorch, or MEMRT_PYTHON is the interpreter of
# a venv holding the `torch` wheel, which ships LibTorch's headers, libraries and CMake package.
if(NOT Torch_DIR AND MEMRT_PYTHON)
  execute_process(
    COMMAND ${MEMRT_PYTHON} -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE _memrt_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _memrt_rc)
  if(NOT _memrt_rc EQUAL 0)
    message(FATAL_ERROR "memrt: ${MEMRT_PYTHON} cannot import torch; run scripts/setup.sh "
                        "or pass -DTorch_DIR=<libtorch>/share/cmake/Torch")
  endif()
  list(APPEND CMAKE_PREFIX_PATH ${_memrt_torch_prefix})
endif()
include(${CMAKE_CURRENT_LIST_DIR}/MemrtFindTorch.cmake)
memrt_find_torch()
message(STATUS "memrt: LibTorch ${MEMRT_TORCH_VERSION} at ${TORCH_INSTALL_PREFIX} (CUDA: ${MEMRT_TORCH_HAS_CUDA})")

# The wheel's CUDA libraries (libnccl, cuBLAS, ...) live beside torch in site-packages/nvidia and
# are found at run time through libtorch_cuda's RUNPATH. At link time the toolkit's own (older)
# copies would win, so point the linker at the wheel's first.
file(GLOB _memrt_wheel_cuda_libs LIST_DIRECTORIES true "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
set(MEMRT_TORCH_LINK_OPTIONS "")
if(_memrt_wheel_cuda_libs)
  list(JOIN _memrt_wheel_cuda_libs ":" _memrt_rpath_link)
  set(MEMRT_TORCH_LINK_OPTIONS "LINKER:-rpath-link,${_memrt_rpath_link}")
endif()

# c10d's Gloo backend header includes Gloo's headers, which the wheel does not ship; Debian's
# libgloo-dev provides them (only the declarations are used; the code is inside libtorch_cpu).
find_path(MEMRT_GLOO_INCLUDE_DIR gloo/algorithm.h)
if(NOT MEMRT_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "memrt: Gloo headers not found; install Debian's libgloo-dev (scripts/setup.sh does)")
endif()

# With LibTorch's CUDA libraries linked, c10d's NCCL backend is available too; its header needs
# nccl.h, which the wheel ships beside torch (site-packages/nvidia/nccl/include).
if(MEMRT_TORCH_HAS_CUDA)
  find_path(MEMRT_NCCL_INCLUDE_DIR nccl.h HINTS ${TORCH_INSTALL_PREFIX}/../nvidia/nccl/include)
  if(MEMRT_NCCL_INCLUDE_DIR)
    message(STATUS "memrt: c10d NCCL backend enabled (nccl.h in ${MEMRT_NCCL_INCLUDE_DIR})")
  else()
    message(STATUS "memrt: nccl.h not found: CUDA tensors cannot be reduced across ranks")
  endif()
endif()

# One target for everything torch: headers marked SYSTEM (their warnings are not ours to fix),
# LibTorch's CPU libraries (cmake/MemrtFindTorch.cmake says why not the CUDA ones).
add_library(memrt_torch INTERFACE)
target_link_libraries(memrt_torch INTERFACE ${TORCH_LIBRARIES})
target_include_directories(memrt_torch SYSTEM INTERFACE ${TORCH_INCLUDE_DIRS} ${MEMRT_GLOO_INCLUDE_DIR})
target_compile_definitions(memrt_torch INTERFACE USE_C10D_GLOO)
# c10d's headers as LibTorch was built: with NCCL where it has CUDA (every memrt object sees the
# same declarations, libmemrt_nccl's included).
if(MEMRT_TORCH_HAS_CUDA AND MEMRT_NCCL_INCLUDE_DIR)
  target_include_directories(memrt_torch SYSTEM INTERFACE ${MEMRT_NCCL_INCLUDE_DIR})
  target_compile_definitions(memrt_torch INTERFACE USE_C10D_NCCL)
endif()
target_link_options(memrt_torch INTERFACE ${MEMRT_TORCH_LINK_OPTIONS})
# And for the few targets that use CUDA through LibTorch: its CUDA libraries too.
if(MEMRT_TORCH_HAS_CUDA)
  add_library(memrt_torch_cuda INTERFACE)
  target_link_libraries(memrt_torch_cuda INTERFACE memrt_torch ${MEMRT_TORCH_CUDA_LIBRARIES})
endif()
# find_package(Torch) adds its include dirs as non-system through the imported targets too.
foreach(_t torch torch_cpu c10 torch_cuda c10_cuda torch_library)
  if(TARGET ${_t})
    get_target_property(_inc ${_t} INTERFACE_INCLUDE_DIRECTORIES)
    if(_inc)
      set_property(TARGET ${_t} APPEND PROPERTY INTERFACE_SYSTEM_INCLUDE_DIRECTORIES ${_inc})
    endif()
  endif()
endforeach()

# ---- CUDA sources -----------------------------------------------------------------------------
# .cu files build only where the LibTorch found has CUDA and nvcc exists; nothing here runs them.
set(MEMRT_BUILD_CUDA OFF)
if(MEMRT_TORCH_HAS_CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    set(MEMRT_BUILD_CUDA ON)
    # find_package(Torch) appends "-gencode arch=compute_NN,code=sm_NN" for every architecture of
    # its own list to CMAKE_CUDA_FLAGS, and nvcc 13 rejects the oldest ones: drop them and name the
    # architectures memrt's kernels are built for instead.
    string(REGEX REPLACE "-gencode[ ;]+arch=compute_[0-9a-z]+,code=sm_[0-9a-z]+" ""
           CMAKE_CUDA_FLAGS "${CMAKE_CUDA_FLAGS}")
    set(MEMRT_CUDA_ARCHITECTURES 75 80 86 89 90 100 120 CACHE STRING "CUDA architectures of memrt's kernels")
  endif()
endif()
if(MEMRT_BUILD_CUDA)
  message(STATUS "memrt: CUDA sources will be compiled with ${CMAKE_CUDA_COMPILER}")
else()
  message(STATUS "memrt: CUDA sources skipped (LibTorch without CUDA, or no nvcc)")
endif()

# ---- OpenMP for memrt's CPU loops -------------------------------------------------------------
# at::parallel_for is an inline template: under LibTorch's OpenMP backend its `#pragma omp parallel`
# is compiled into the calling file, and a file built without OpenMP runs every loop on one thread
# whatever at::get_num_threads() says. The files with memrt's CPU loops (the ones that include
# optim/cpu_loops.h, which refuses to compile otherwise) take MEMRT_OPENMP_FLAGS and link
# memrt_openmp. At run time they share LibTorch's OpenMP runtime: the wheel's libgomp has the
# system's soname (libgomp.so.1), so the process loads one copy and at::set_num_threads() governs
# memrt's loops as it does LibTorch's.
find_package(OpenMP REQUIRED COMPONENTS CXX)
set(MEMRT_OPENMP_FLAGS ${OpenMP_CXX_FLAGS})
add_library(memrt_openmp INTERFACE)
target_link_libraries(memrt_openmp INTERFACE ${OpenMP_CXX_LIBRARIES})

# ---- the rest ---------------------------------------------------------------------------------
find_package(RapidJSON REQUIRED)
find_package(yaml-cpp REQUIRED)
find_package(Boost 1.74 REQUIRED COMPONENTS filesystem program_options)
find_package(Threads REQUIRED)
if(MEMRT_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
# Debian's RapidJSON config exports only variables.
if(NOT TARGET memrt_rapidjson)
  add_library(memrt_rapidjson INTERFACE)
  target_include_directories(memrt_rapidjson SYSTEM INTERFACE ${RapidJSON_INCLUDE_DIRS} ${RAPIDJSON_INCLUDE_DIRS})
endif()
# Tokenizers (runtime/src/data/tokenizer.cpp): PCRE2 runs the pre-tokenizers' Unicode regexes,
# utf8proc the NFC/NFKC normalizers, libsentencepiece reads tokenizer.model files (Debian's
# libpcre2-dev, libutf8proc-dev and libsentencepiece-dev).
find_path(MEMRT_PCRE2_INCLUDE pcre2.h REQUIRED)
find_library(MEMRT_PCRE2_LIBRARY pcre2-8 REQUIRED)
find_path(MEMRT_UTF8PROC_INCLUDE utf8proc.h REQUIRED)
find_library(MEMRT_UTF8PROC_LIBRARY utf8proc REQUIRED)
find_path(MEMRT_SENTENCEPIECE_INCLUDE sentencepiece_processor.h REQUIRED)
find_library(MEMRT_SENTENCEPIECE_LIBRARY sentencepiece REQUIRED)
add_library(memrt_text INTERFACE)
target_include_directories(memrt_text SYSTEM INTERFACE ${MEMRT_PCRE2_INCLUDE} ${MEMRT_UTF8PROC_INCLUDE}
                                                     ${MEMRT_SENTENCEPIECE_INCLUDE})
target_link_libraries(memrt_text INTERFACE ${MEMRT_PCRE2_LIBRARY} ${MEMRT_UTF8PROC_LIBRARY}
                                           ${MEMRT_SENTENCEPIECE_LIBRARY})
if(TARGET yaml-cpp::yaml-cpp)
  set(MEMRT_YAML_TARGET yaml-cpp::yaml-cpp)
else()
  set(MEMRT_YAML_TARGET yaml-cpp)
endif()
