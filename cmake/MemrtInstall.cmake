# `cmake --install` puts the SDK headers, libmemrt, the launcher, the built-in plugins and a CMake
# package (find_package(memrt) + memrt_add_plugin) under the prefix.
