# memrt_add_plugin(<target> SOURCES ...): a plugin shared library, loadable by the launcher.
# The same function ships in the installed CMake package (memrtConfig.cmake), so an out-of-tree
# plugin is built exactly like a built-in one:
#
#   find_package(memrt REQUIRED)
#   memrt_add_plugin(my_plugin SOURCES my_plugin.cpp)
function(memrt_add_plugin target)
  cmake_parse_arguments(P "" "OUTPUT_DIRECTORY" "SOURCES" ${ARGN})
  add_library(${target} MODULE ${P_SOURCES})
  target_link_libraries(${target} PRIVATE memrt::memrt)
  set_target_properties(${target} PROPERTIES PREFIX "lib" CXX_VISIBILITY_PRESET hidden
                                             VISIBILITY_INLINES_HIDDEN ON)
  if(P_OUTPUT_DIRECTORY)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${P_OUTPUT_DIRECTORY})
  endif()
endfunction()
