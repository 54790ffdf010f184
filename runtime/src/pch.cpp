// Compiles src/pch.h once for the build tree (see runtime/CMakeLists.txt).
