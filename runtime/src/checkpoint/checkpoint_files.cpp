#include "checkpoint/checkpoint_files.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <rapidjson/document.h>

#include "checkpoint/sha256.h"
#include "memrt/safetensors.h"
#include "memrt/error.h"

namespace memrt {
namespace {

namespace fs = std::filesystem;

constexpr const char* kManifest = "manifest.json";
constexpr const char* kManifestSum = "manifest.json.sha256";
constexpr const char* kTagPrefix = "global_step";

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileError(path, "cannot be read: " + std::string(std::strerror(errno)));
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool is_hex_digest(const std::string& s) {
  return s.size() == 64 &&
         std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// A non-negative decimal integer that fits int64 ("0", "42"), or -1 for anything else.
int64_t parse_count(const std::string& text) {
  int64_t v = -1;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  return ec == std::errc() && ptr == end && !text.empty() && text[0] != '-' && text[0] != '+' ? v : -1;
}

// The step of a tag "global_step<N>", or -1.
int64_t tag_step(const std::string& tag) {
  const std::string prefix = kTagPrefix;
  if (tag.rfind(prefix, 0) != 0) return -1;
  return parse_count(tag.substr(prefix.size()));
}

}  // namespace

std::string checkpoint_tag(int64_t step) { return kTagPrefix + std::to_string(step); }

std::string read_latest(const std::string& output_dir) {
  const std::string path = (fs::path(output_dir) / "latest").string();
  if (!fs::exists(path)) {
    throw FileError(path, "does not exist: there is no checkpoint to resume in " + output_dir +
                              " (save_steps in train.yaml makes them; --resume=TAG names one)");
  }
  std::string tag = slurp(path);
  while (!tag.empty() && (tag.back() == '\n' || tag.back() == '\r' || tag.back() == ' ')) tag.pop_back();
  if (tag.empty() || tag.find_first_of("/\\\n") != std::string::npos) {
    throw FileError(path, "should hold one checkpoint tag such as \"global_step40\", holds \"" + tag + "\"");
  }
  return tag;
}

std::string checkpoint_dir(const std::string& output_dir, const std::string& tag) {
  const std::string t = tag.empty() ? read_latest(output_dir) : tag;
  const fs::path dir = fs::path(output_dir) / t;
  if (!fs::is_directory(dir)) {
    std::string have;
    if (fs::is_directory(output_dir)) {
      for (const auto& e : fs::directory_iterator(output_dir))
        if (e.is_directory() && tag_step(e.path().filename().string()) >= 0)
          have += (have.empty() ? "" : ", ") + e.path().filename().string();
    }
    throw FileError(dir.string(), "no such checkpoint; " +
                                      (have.empty() ? "output_dir holds none" : "output_dir holds: " + have));
  }
  return dir.string();
}

void add_to_manifest(Manifest& m, const std::string& dir, const std::string& name) {
  ManifestEntry e;
  e.sha256 = sha256_file((fs::path(dir) / name).string(), &e.bytes);
  m.files[name] = e;
}

void write_manifest(const std::string& dir, const Manifest& m) {
  std::ostringstream os;
  os << "{\n  \"format\": \"memrt-checkpoint\",\n  \"version\": " << m.version << ",\n  \"tag\": \""
     << m.tag << "\",\n  \"step\": " << m.step << ",\n  \"world_size\": " << m.world_size
     << ",\n  \"files\": {";
  bool first = true;
  for (const auto& [name, e] : m.files) {
    os << (first ? "\n" : ",\n") << "    \"" << name << "\": {\"bytes\": " << e.bytes
       << ", \"sha256\": \"" << e.sha256 << "\"}";
    first = false;
  }
  os << "\n  }\n}\n";
  const std::string text = os.str();
  write_file_atomic((fs::path(dir) / kManifest).string(), text);
  write_file_atomic((fs::path(dir) / kManifestSum).string(), sha256_hex(text) + "  " + kManifest + "\n");
}

Manifest read_manifest(const std::string& dir) {
  const std::string path = (fs::path(dir) / kManifest).string();
  const std::string sum_path = (fs::path(dir) / kManifestSum).string();
  const std::string text = slurp(path);
  const std::string sum = slurp(sum_path);
  const std::string want = sum.substr(0, std::min<size_t>(64, sum.size()));
  if (sum != want + "  " + kManifest + "\n" || !is_hex_digest(want)) {
    throw FileError(sum_path, "is not \"<sha256>  manifest.json\": the checkpoint is damaged");
  }
  if (sha256_hex(text) != want) {
    throw FileError(path, "does not match its SHA-256 in " + sum_path +
                              ": one of the two is damaged (resume from another checkpoint with "
                              "--resume=TAG)");
  }
  rapidjson::Document d;
  d.Parse(text.c_str(), text.size());
  auto bad = [&](const std::string& what) { return FileError(path, "malformed: " + what); };
  if (d.HasParseError() || !d.IsObject()) throw bad("not a JSON object");
  if (!d.HasMember("version") || !d["version"].IsInt()) throw bad("no integer \"version\"");
  Manifest m;
  m.version = d["version"].GetInt();
  if (m.version > kCheckpointFormatVersion) {
    throw FileError(path, "checkpoint format version " + std::to_string(m.version) +
                              " is newer than this memrt reads (" +
                              std::to_string(kCheckpointFormatVersion) + "); use a newer memrt");
  }
  if (m.version < kCheckpointFormatVersion) {
    throw FileError(path, "checkpoint format version " + std::to_string(m.version) +
                              " predates the parameter store's layout, which this memrt reads "
                              "(version " + std::to_string(kCheckpointFormatVersion) +
                              "): export it with the memrt that wrote it (launcher export) and "
                              "start a new run from the exported weights (model_name_or_path)");
  }
  if (!d.HasMember("tag") || !d["tag"].IsString()) throw bad("no \"tag\"");
  if (!d.HasMember("step") || !d["step"].IsInt64()) throw bad("no integer \"step\"");
  if (!d.HasMember("world_size") || !d["world_size"].IsInt()) throw bad("no integer \"world_size\"");
  if (!d.HasMember("files") || !d["files"].IsObject()) throw bad("no \"files\" object");
  m.tag = d["tag"].GetString();
  m.step = d["step"].GetInt64();
  m.world_size = d["world_size"].GetInt();
  if (m.step < 0) throw bad("\"step\" is negative");
  if (m.world_size < 1) throw bad("\"world_size\" is not a positive number of ranks");
  for (const auto& f : d["files"].GetObject()) {
    const auto& v = f.value;
    if (!v.IsObject() || !v.HasMember("bytes") || !v["bytes"].IsUint64() || !v.HasMember("sha256") ||
        !v["sha256"].IsString() || !is_hex_digest(v["sha256"].GetString())) {
      throw bad(std::string("entry \"") + f.name.GetString() + "\" needs \"bytes\" and a \"sha256\"");
    }
    m.files[f.name.GetString()] = {v["bytes"].GetUint64(), v["sha256"].GetString()};
  }
  return m;
}

std::string rank_file_name(int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank%05d.safetensors", rank);
  return name;
}

RankFiles::RankFiles(std::string dir, const Manifest& m) : dir_(std::move(dir)), manifest_(m) {}
RankFiles::~RankFiles() = default;

const SafetensorsFile& RankFiles::operator()(int rank) {
  auto it = files_.find(rank);
  if (it != files_.end()) return it->second;
  if (rank < 0 || rank >= manifest_.world_size)
    throw FileError((fs::path(dir_) / kManifest).string(),
                    "has no rank " + std::to_string(rank) + " (world size " +
                        std::to_string(manifest_.world_size) + ")");
  verify_checkpoint_file(dir_, manifest_, rank_file_name(rank));
  return files_.emplace(rank, SafetensorsFile::open((fs::path(dir_) / rank_file_name(rank)).string())).first->second;
}

RankFileMetadata parse_rank_metadata(const std::map<std::string, std::string>& metadata,
                                     const std::string& path) {
  auto text = [&](const char* key) -> const std::string& {
    auto it = metadata.find(key);
    if (it == metadata.end()) throw FileError(path, std::string("lacks metadata \"") + key + "\"");
    return it->second;
  };
  auto count = [&](const char* key) {
    const int64_t v = parse_count(text(key));
    if (v < 0)
      throw FileError(path, std::string("metadata \"") + key + "\" is \"" + text(key) +
                                "\", not a non-negative integer: the file is damaged");
    return v;
  };
  RankFileMetadata out;
  out.step = count("step");
  out.completed_steps = count("completed_steps");
  out.skipped_steps = count("skipped_steps");
  auto it = metadata.find("plugin_state_versions");
  const std::string versions = it == metadata.end() ? "{}" : it->second;
  rapidjson::Document d;
  d.Parse(versions.c_str(), versions.size());
  if (d.HasParseError() || !d.IsObject())
    throw FileError(path, "metadata \"plugin_state_versions\" is not a JSON object");
  for (const auto& member : d.GetObject()) {
    const std::string name(member.name.GetString(), member.name.GetStringLength());
    if (!member.value.IsInt())
      throw FileError(path, "metadata \"plugin_state_versions\" gives plugin '" + name +
                                "' a version that is not an integer");
    out.plugin_state_versions[name] = member.value.GetInt();
  }
  return out;
}

std::string metrics_up_to(const std::string& text, int64_t step, int64_t* dropped) {
  std::string kept;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    rapidjson::Document d;
    d.Parse(line.c_str(), line.size());
    if (d.HasParseError() || !d.IsObject() || !d.HasMember("step") || !d["step"].IsInt64()) {
      if (dropped) ++*dropped;
      continue;
    }
    if (d["step"].GetInt64() <= step) kept += line + "\n";
  }
  return kept;
}

void verify_checkpoint_file(const std::string& dir, const Manifest& m, const std::string& name) {
  const std::string path = (fs::path(dir) / name).string();
  auto it = m.files.find(name);
  if (it == m.files.end()) throw FileError(path, "is not listed in manifest.json: the checkpoint is incomplete");
  if (!fs::exists(path)) throw FileError(path, "is missing: the checkpoint is incomplete");
  uint64_t bytes = 0;
  const std::string sha = sha256_file(path, &bytes);
  if (bytes != it->second.bytes) {
    throw FileError(path, "has " + std::to_string(bytes) + " bytes, the manifest says " +
                              std::to_string(it->second.bytes) + ": the file is truncated or damaged");
  }
  if (sha != it->second.sha256) {
    throw FileError(path, "does not match its SHA-256 in manifest.json: the file is damaged");
  }
}

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw FileError(path, "cannot be opened to sync: " + std::string(std::strerror(errno)));
  const int r = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (r != 0) throw FileError(path, "fsync failed: " + std::string(std::strerror(err)));
}

std::vector<std::string> prune_checkpoints(const std::string& output_dir, int64_t limit,
                                           const std::string& keep) {
  std::vector<std::pair<int64_t, std::string>> tags;
  for (const auto& e : fs::directory_iterator(output_dir)) {
    const std::string name = e.path().filename().string();
    const int64_t step = tag_step(name);
    if (e.is_directory() && step >= 0) tags.emplace_back(step, name);
  }
  std::sort(tags.begin(), tags.end());
  std::vector<std::string> deleted;
  for (size_t i = 0; i + static_cast<size_t>(limit) < tags.size(); ++i) {
    if (tags[i].second == keep) continue;
    fs::remove_all(fs::path(output_dir) / tags[i].second);
    deleted.push_back(tags[i].second);
  }
  return deleted;
}

}  // namespace memrt
