// memrt/safetensors.h — safetensors read (memory-mapped, zero-copy) and write (atomic), our own
// implementation of the format of huggingface/safetensors (SDK: plugins read and write their own
// files with it, e.g. PEFT adapters):
//
//   [ 8 bytes: N, u64 little-endian ][ N bytes: JSON header, space-padded ][ tensor bytes ]
//
//   header: {"__metadata__": {"k": "v", ...},                      (optional, string -> string)
//            "<name>": {"dtype": "F32", "shape": [d0, ...], "data_offsets": [begin, end]}, ...}
//
// Offsets are relative to the first byte after the header; the tensors tile that buffer exactly
// (sorted by begin: the first at 0, each next where the previous ended, the last at the file's end).
// Every violation is a memrt::FileError naming the file, the tensor and the problem.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace memrt {

// "F32" <-> at::kFloat, ... Unknown names / dtypes without a safetensors name: std::nullopt.
std::optional<at::ScalarType> safetensors_dtype(const std::string& name);
std::optional<std::string> safetensors_dtype_name(at::ScalarType dtype);

// Largest header accepted (as the reference reader: 100 MB).
constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

class SafetensorsFile {
 public:
  struct Entry {
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    uint64_t begin = 0;  // byte offsets within the data buffer, end exclusive
    uint64_t end = 0;
  };

  // Maps the file and validates the whole header (throws memrt::FileError).
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  // in file (offset) order
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  const Entry& entry(const std::string& name) const;  // unknown name: FileError
  // A CPU tensor viewing the mapped bytes (no copy; copied only when misaligned for its dtype).
  // The mapping stays alive as long as any tensor from it does. The mapping is private
  // copy-on-write: writing into the tensor never changes the file.
  at::Tensor tensor(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  uint64_t data_bytes() const;  // size of the tensor buffer
  // Tells the kernel the pages holding tensor `name` (those wholly inside it) are no longer
  // needed, so a loader that copied it does not keep the file resident: a 7B checkpoint is
  // streamed through memory block by block. Views read the file's bytes again on next access
  // (changes written into those pages through a view are lost).
  void drop_pages(const std::string& name) const;

 private:
  struct Mapping;
  std::string path_;
  std::shared_ptr<Mapping> mapping_;
  const uint8_t* data_ = nullptr;  // start of the tensor buffer inside the mapping
  std::map<std::string, Entry> entries_;
  std::vector<std::string> order_;
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` (any device; each written as a contiguous CPU copy) and `metadata` to `path`:
// tensors laid out by dtype (widest first) then name, header compact JSON padded with spaces to a
// multiple of 8 bytes, written to a temporary file in the same folder and renamed over `path`.
// Duplicate or empty names, or a dtype safetensors cannot name, are a memrt::Error.
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes `bytes` to `path` atomically (temporary file in the same folder, fsync, rename).
void write_file_atomic(const std::string& path, const std::string& bytes);

}  // namespace memrt
