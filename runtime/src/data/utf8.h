// UTF-8 as the data area reads it: well-formed sequences, code points, character boundaries, and
// the two whitespace sets text tools strip by — Rust's (tokenizers) and Python's (str.strip).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace memrt {

// Whether byte c continues a UTF-8 sequence (10xxxxxx) rather than starting one.
inline bool is_continuation(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

// The characters (code points) of UTF-8 text, as Python's len counts them.
inline int64_t code_points(std::string_view s) {
  int64_t n = 0;
  for (const char c : s) n += !is_continuation(c);
  return n;
}

// The length of the UTF-8 sequence starting at s[i] when it is well-formed (RFC 3629: no overlong
// forms, no surrogates, nothing above U+10FFFF), else 0.
inline size_t utf8_sequence(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const auto cont = [&](size_t k) { return i + k < s.size() && (b(k) & 0xC0) == 0x80; };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (!cont(1) || !cont(2)) return 0;
    if ((c == 0xE0 && b(1) < 0xA0) || (c == 0xED && b(1) > 0x9F)) return 0;
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (!cont(1) || !cont(2) || !cont(3)) return 0;
    if ((c == 0xF0 && b(1) < 0x90) || (c == 0xF4 && b(1) > 0x8F)) return 0;
    return 4;
  }
  return 0;
}

// The code point of the n-byte sequence at s[i] (n from utf8_sequence).
inline uint32_t code_point(std::string_view s, size_t i, size_t n) {
  const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(s[i + k])); };
  switch (n) {
    case 1: return b(0);
    case 2: return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    case 3: return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    default: return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
  }
}

// Rust's char::is_whitespace (Unicode White_Space), which `tokenizers` strips added tokens with.
inline bool is_whitespace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// Python's str.isspace: Rust's set and the four separators U+001C..U+001F.
inline bool is_python_space(uint32_t c) { return is_whitespace(c) || (c >= 0x1C && c <= 0x1F); }

}  // namespace memrt
