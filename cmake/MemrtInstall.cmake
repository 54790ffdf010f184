# `cmake --install` puts the SDK headers, libmemrt, the launcher, the built-in plugins and a CMake
# package (find_package(memrt) + memrt_add_plugin) under the prefix.
include(CMakePackageConfigHelpers)

install(DIRECTORY runtime/include/memrt DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h")
install(FILES ${PROJECT_BINARY_DIR}/runtime/include/memrt/build_info.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/memrt)
install(TARGETS memrt LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS launcher RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
get_property(_memrt_plugin_targets GLOBAL PROPERTY MEMRT_BUILTIN_PLUGINS)
if(_memrt_plugin_targets)
  install(TARGETS ${_memrt_plugin_targets} LIBRARY DESTINATION ${MEMRT_PLUGIN_SUBDIR})
endif()

set(MEMRT_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/memrt)
set(MEMRT_TORCH_CMAKE_DIR ${TORCH_INSTALL_PREFIX}/share/cmake/Torch)
configure_package_config_file(cmake/memrtConfig.cmake.in ${PROJECT_BINARY_DIR}/memrtConfig.cmake
                              INSTALL_DESTINATION ${MEMRT_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/memrtConfigVersion.cmake
                                 COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/memrtConfig.cmake ${PROJECT_BINARY_DIR}/memrtConfigVersion.cmake
              cmake/MemrtPlugin.cmake cmake/MemrtFindTorch.cmake
        DESTINATION ${MEMRT_CMAKE_DIR})
