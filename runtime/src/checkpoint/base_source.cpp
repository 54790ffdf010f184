#include "checkpoint/base_source.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "checkpoint/sha256.h"
#include "memrt/error.h"

namespace memrt {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kSample = uint64_t{1} << 20;

std::string sample_sha256(const fs::path& path, uint64_t bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileError(path.string(), "cannot be read");
  Sha256 h;
  std::string buf;
  auto hash = [&](uint64_t at, uint64_t n) {
    buf.resize(n);
    in.seekg(static_cast<std::streamoff>(at));
    if (!in.read(buf.data(), static_cast<std::streamsize>(n))) throw FileError(path.string(), "cannot be read");
    h.update(buf.data(), buf.size());
  };
  if (bytes <= 2 * kSample) {
    hash(0, bytes);
  } else {
    hash(0, kSample);
    hash(bytes - kSample, kSample);
  }
  return h.hex_digest();
}

bool is_weight_file(const std::string& name) {
  auto ends = [&](const std::string& s) { return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0; };
  return ends(".safetensors") || ends(".safetensors.index.json");
}

}  // namespace

BaseSource BaseSource::of(const std::string& dir) {
  BaseSource b;
  std::error_code ec;
  b.dir = fs::absolute(dir, ec).lexically_normal().string();
  if (ec || !fs::is_directory(b.dir)) throw FileError(dir, "is not a directory (the base model the frozen parameters come from)");
  b.config_sha256 = sha256_file((fs::path(b.dir) / "config.json").string());
  for (const fs::directory_entry& e : fs::directory_iterator(b.dir)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file() || !is_weight_file(name)) continue;
    File f;
    f.name = name;
    f.bytes = static_cast<uint64_t>(e.file_size());
    f.sample_sha256 = sample_sha256(e.path(), f.bytes);
    b.files.push_back(std::move(f));
  }
  std::sort(b.files.begin(), b.files.end(), [](const File& x, const File& y) { return x.name < y.name; });
  return b;
}

std::string BaseSource::difference(const BaseSource& now) const {
  if (config_sha256 != now.config_sha256) return "its config.json differs";
  for (const File& f : files) {
    const auto it = std::find_if(now.files.begin(), now.files.end(), [&](const File& g) { return g.name == f.name; });
    if (it == now.files.end()) return "it has no " + f.name;
    if (it->bytes != f.bytes) return f.name + " is " + std::to_string(it->bytes) + " bytes, not " + std::to_string(f.bytes);
    if (it->sample_sha256 != f.sample_sha256) return f.name + " holds other values";
  }
  for (const File& g : now.files)
    if (std::none_of(files.begin(), files.end(), [&](const File& f) { return f.name == g.name; }))
      return "it has a weight file more, " + g.name;
  return "";
}

}  // namespace memrt
