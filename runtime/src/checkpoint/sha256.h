// SHA-256 (FIPS 180-4), for checkpoint manifests: the digests `sha256sum` prints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace memrt {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t bytes);
  std::string hex_digest();  // finishes; 64 lowercase hex digits

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buffer_[64];
  size_t buffered_ = 0;
  uint64_t total_ = 0;
};

std::string sha256_hex(const std::string& bytes);
// The file's digest and size; memrt::FileError when it cannot be read.
std::string sha256_file(const std::string& path, uint64_t* bytes = nullptr);

}  // namespace memrt
