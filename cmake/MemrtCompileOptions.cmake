# Warning flags applied to every memrt target (not to third-party headers, which are SYSTEM).
add_library(memrt_warnings INTERFACE)
target_compile_options(memrt_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow=local -Wnon-virtual-dtor
                            -Woverloaded-virtual -Wimplicit-fallthrough>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${MEMRT_WERROR}>>:-Werror>)

# The heavy LibTorch headers, compiled once per build tree and reused by every memrt target
# that links memrt_pch (see runtime/src/pch.h).
function(memrt_use_pch target)
  if(TARGET memrt_pch_owner AND NOT target STREQUAL memrt_pch_owner)
    target_precompile_headers(${target} REUSE_FROM memrt_pch_owner)
    # The PCH is built -fPIC; an executable would otherwise compile -fPIE and not use it.
    get_target_property(_type ${target} TYPE)
    if(_type STREQUAL "EXECUTABLE")
      target_compile_options(${target} PRIVATE -fPIC)
    endif()
  endif()
endfunction()
