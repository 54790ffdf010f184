# cmake -DINPUT=<text file> -DOUTPUT=<.cpp> -P embed_corpus.cmake
# Writes the bytes of INPUT into a C++ source as an array, so the built-in corpus is part of
# libmemrt and training needs no data file.
file(READ "${INPUT}" hex HEX)
string(LENGTH "${hex}" hex_len)
math(EXPR size "${hex_len} / 2")
# 0xAB, per byte; a line break every 32 bytes keeps the generated file readable.
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
string(REGEX REPLACE "((0x[0-9a-f][0-9a-f],){32})" "\\1\n" bytes "${bytes}")
get_filename_component(name "${INPUT}" NAME)
file(WRITE "${OUTPUT}.tmp"
  "// Generated from runtime/src/data/corpus/${name} by embed_corpus.cmake: do not edit.\n"
  "#include <cstddef>\n"
  "namespace memrt::detail {\n"
  "extern const unsigned char kBuiltinCorpus[];\n"
  "extern const std::size_t kBuiltinCorpusSize;\n"
  "const unsigned char kBuiltinCorpus[] = {\n${bytes}\n};\n"
  "const std::size_t kBuiltinCorpusSize = ${size};\n"
  "}  // namespace memrt::detail\n")
file(RENAME "${OUTPUT}.tmp" "${OUTPUT}")
