// A read-only memory map of a whole file: big token files are read in place, never copied.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace memrt {

class MappedFile {
 public:
  // Maps `path` read-only. Throws FileError naming the path when it cannot be opened or mapped.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace memrt
