// Every reader of a training-state checkpoint — manifest.json (and its .sha256), store.json, a rank
// file's safetensors header and its metadata, metrics.jsonl — against damaged input: each
// truncation and single-byte change of a real checkpoint's files either still reads or throws
// memrt::FileError naming the file. Never an abort, an assert, a std::stoll exception or a read
// out of bounds: CI also runs this file built with AddressSanitizer and UndefinedBehaviorSanitizer
// (test_checkpoint_corruption_sanitized), which turn the latter into failures.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <algorithm>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/sha256.h"
#include "checkpoint/store_checkpoint.h"
#include "memrt/safetensors.h"
#include "memrt/error.h"
#include "memrt/param_store.h"

using namespace memrt;
namespace fs = std::filesystem;

#ifdef __SANITIZE_ADDRESS__
// LibTorch keeps allocations until exit: a leak report would be about it, not the readers.
extern "C" const char* __asan_default_options() { return "detect_leaks=0"; }
#endif

namespace {

std::vector<ParamInfo> infos() {
  return {{"a.weight", {7, 5}, at::kFloat, true, true},
          {"a.bias", {5}, at::kFloat, true, false},
          {"frozen.weight", {3, 2}, at::kFloat, false, true},
          {"b.weight", {13}, at::kFloat, true, true}};
}

std::shared_ptr<ParamStore> make_store() {
  StoreOptions o;
  o.optimizer = "AdamW";
  StorePlan plan(infos(), o);
  at::manual_seed(3);
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const ParamInfo& p : infos()) params.emplace_back(p.name, at::randn(p.shape).set_requires_grad(p.trainable));
  return std::make_shared<ParamStore>(std::move(plan), params, at::kCPU);
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

// A one-rank checkpoint as the engine writes it: store.json, rank00000.safetensors (the store's
// shards, an update count, the metadata), the manifest.
class Checkpoint {
 public:
  Checkpoint() : dir_(fs::temp_directory_path() / ("memrt_corrupt_" + std::to_string(getpid()))) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    store_ = make_store();
    write_file_atomic((dir_ / kStoreLayoutFile).string(), store_layout_json(*store_));
    std::vector<std::pair<std::string, at::Tensor>> tensors = store_shard_tensors(*store_);
    tensors.emplace_back("optimizer/a.weight.step", at::scalar_tensor(int64_t{3}, at::kLong));
    write_safetensors((dir_ / "rank00000.safetensors").string(), tensors,
                      {{"format", "memrt-checkpoint"}, {"version", "2"}, {"step", "3"},
                       {"completed_steps", "3"}, {"skipped_steps", "0"},
                       {"plugin_state_versions", "{\"precision\": 3}"}});
    Manifest m;
    m.tag = "global_step3";
    m.step = 3;
    for (const char* f : {"rank00000.safetensors", kStoreLayoutFile}) add_to_manifest(m, dir_.string(), f);
    write_manifest(dir_.string(), m);
    for (const char* f : {"manifest.json", "manifest.json.sha256", kStoreLayoutFile, "rank00000.safetensors"})
      original_[f] = read_bytes(dir_ / f);
  }
  ~Checkpoint() { fs::remove_all(dir_); }

  const fs::path& dir() const { return dir_; }
  const std::string& original(const std::string& file) const { return original_.at(file); }
  void restore() {
    for (const auto& [f, bytes] : original_) write_bytes(dir_ / f, bytes);
  }

  // Each reader of `file` as resume runs it, without the manifest's hash in front (the point is
  // the parser; the hash is checked separately below).
  void read(const std::string& file) const {
    if (file == "manifest.json" || file == "manifest.json.sha256") {
      read_manifest(dir_.string());
    } else if (file == kStoreLayoutFile || file == "rank00000.safetensors") {
      std::map<int, SafetensorsFile> open;
      const SavedStore saved(dir_.string(), [&](int rank) -> const SafetensorsFile& {
        if (!open.count(rank))
          open.emplace(rank, SafetensorsFile::open((dir_ / "rank00000.safetensors").string()));
        return open.at(rank);
      });
      std::shared_ptr<ParamStore> target = make_store();
      load_store(*target, saved);
      const SafetensorsFile& f = saved.world_size() == 1 ? open.begin()->second
                                                         : SafetensorsFile::open((dir_ / "rank00000.safetensors").string());
      parse_rank_metadata(f.metadata(), f.path());
      if (f.contains("optimizer/a.weight.step")) (void)f.tensor("optimizer/a.weight.step").item<int64_t>();
    }
  }

 private:
  fs::path dir_;
  std::shared_ptr<ParamStore> store_;
  std::map<std::string, std::string> original_;
};

// Runs `read` on `bytes` written over `file`; the outcome must be a clean read or a FileError that
// names the file (or, for the rank file read through store.json, either file of the checkpoint).
void expect_read_or_file_error(Checkpoint& c, const std::string& file, const std::string& bytes,
                               const std::string& what, int* errors) {
  write_bytes(c.dir() / file, bytes);
  try {
    c.read(file);
  } catch (const FileError& e) {
    ++*errors;
    const std::string msg = e.what();
    const bool named = msg.find(file) != std::string::npos ||
                       (file == "manifest.json.sha256" && msg.find("manifest.json") != std::string::npos) ||
                       msg.find(kStoreLayoutFile) != std::string::npos ||
                       msg.find("rank00000.safetensors") != std::string::npos;
    EXPECT_TRUE(named) << file << ", " << what << ": " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << file << ", " << what << ": not a FileError: " << e.what();
  }
  c.restore();
}

// Every truncation and, at every byte, a few replacements chosen to reach the parsers' number,
// string and structure paths.
void damage_every_byte(Checkpoint& c, const std::string& file, size_t limit) {
  const std::string good = c.original(file);
  const size_t n = std::min(good.size(), limit);
  int errors = 0;
  for (size_t len = 0; len < good.size(); len += len < n ? 1 : std::max<size_t>(1, good.size() / 64))
    expect_read_or_file_error(c, file, good.substr(0, len), "truncated to " + std::to_string(len), &errors);
  for (size_t i = 0; i < n; ++i) {
    for (char r : {'9', '-', '"', '}', '\x80', '\0'}) {
      if (good[i] == r) continue;
      std::string bad = good;
      bad[i] = r;
      expect_read_or_file_error(c, file, bad, "byte " + std::to_string(i) + " := " + std::to_string(int(r)), &errors);
    }
    std::string flipped = good;
    flipped[i] = static_cast<char>(flipped[i] ^ 0x01);
    expect_read_or_file_error(c, file, flipped, "byte " + std::to_string(i) + " ^ 1", &errors);
  }
  EXPECT_GT(errors, 0) << file << ": no damage was noticed";
}

}  // namespace

TEST(CheckpointCorruption, TheUndamagedCheckpointReads) {
  Checkpoint c;
  for (const char* f : {"manifest.json", kStoreLayoutFile, "rank00000.safetensors"}) EXPECT_NO_THROW(c.read(f)) << f;
  const Manifest m = read_manifest(c.dir().string());
  for (const char* f : {"rank00000.safetensors", kStoreLayoutFile}) EXPECT_NO_THROW(verify_checkpoint_file(c.dir().string(), m, f));
}

TEST(CheckpointCorruption, ManifestAndItsChecksum) {
  Checkpoint c;
  damage_every_byte(c, "manifest.json", SIZE_MAX);
  damage_every_byte(c, "manifest.json.sha256", SIZE_MAX);
}

// The manifest's parser behind a matching checksum: a damaged manifest.json whose .sha256 was
// written for it (as a buggy or hostile writer would) still gives a FileError, never a crash.
TEST(CheckpointCorruption, ManifestWithAMatchingChecksum) {
  Checkpoint c;
  const std::string good = c.original("manifest.json");
  int errors = 0;
  auto check = [&](const std::string& bad, const std::string& what) {
    write_bytes(c.dir() / "manifest.json.sha256", sha256_hex(bad) + "  manifest.json\n");
    expect_read_or_file_error(c, "manifest.json", bad, what, &errors);
  };
  for (size_t len = 0; len < good.size(); ++len) check(good.substr(0, len), "truncated to " + std::to_string(len));
  for (size_t i = 0; i < good.size(); ++i)
    for (char r : {'9', '-', '"', '}', '\x80', '\0'}) {
      std::string bad = good;
      bad[i] = r;
      check(bad, "byte " + std::to_string(i));
    }
  EXPECT_GT(errors, 0);
}

TEST(CheckpointCorruption, StoreLayout) {
  Checkpoint c;
  damage_every_byte(c, kStoreLayoutFile, SIZE_MAX);
}

// The header and metadata bytes exhaustively, the tensor data by sample (its values are the
// manifest's hash's business, below).
TEST(CheckpointCorruption, RankFileHeaderAndMetadata) {
  Checkpoint c;
  const std::string good = c.original("rank00000.safetensors");
  uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = header << 8 | static_cast<uint8_t>(good[static_cast<size_t>(i)]);
  ASSERT_LT(8 + header, good.size());
  damage_every_byte(c, "rank00000.safetensors", 8 + header);
}

// Every single-byte change and truncation of a listed file fails verification, naming it.
TEST(CheckpointCorruption, TheManifestsHashCatchesEveryChangeToAListedFile) {
  Checkpoint c;
  const Manifest m = read_manifest(c.dir().string());
  for (const char* f : {"rank00000.safetensors", kStoreLayoutFile}) {
    const std::string good = c.original(f);
    for (size_t i = 0; i < good.size(); i += 1 + good.size() / 97) {
      std::string bad = good;
      bad[i] = static_cast<char>(bad[i] ^ 0x20);
      write_bytes(c.dir() / f, bad);
      try {
        verify_checkpoint_file(c.dir().string(), m, f);
        ADD_FAILURE() << f << ": byte " << i << " changed and not noticed";
      } catch (const FileError& e) {
        EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
      }
      write_bytes(c.dir() / f, good.substr(0, i));
      EXPECT_THROW(verify_checkpoint_file(c.dir().string(), m, f), FileError) << f << " truncated to " << i;
      c.restore();
    }
  }
}

// Counters are non-negative decimal integers and plugin versions integers; anything else names
// the file and the key (resume used std::stoll and rapidjson's GetInt unchecked: an exception
// without the file's name, or an assert).
TEST(CheckpointCorruption, RankMetadataValuesAreChecked) {
  const std::map<std::string, std::string> good = {
      {"step", "12"}, {"completed_steps", "11"}, {"skipped_steps", "1"}, {"plugin_state_versions", "{\"precision\": 3}"}};
  const RankFileMetadata m = parse_rank_metadata(good, "rank00000.safetensors");
  EXPECT_EQ(m.step, 12);
  EXPECT_EQ(m.completed_steps, 11);
  EXPECT_EQ(m.skipped_steps, 1);
  EXPECT_EQ(m.plugin_state_versions.at("precision"), 3);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"step", ""}, {"step", "-1"}, {"step", "12x"}, {"step", "99999999999999999999"}, {"step", " 12"},
      {"completed_steps", "1e3"}, {"skipped_steps", "+1"}, {"plugin_state_versions", "{\"precision\": \"3\"}"},
      {"plugin_state_versions", "{\"precision\": 3.5}"}, {"plugin_state_versions", "[3]"},
      {"plugin_state_versions", "{\"precision\": 99999999999}"}, {"plugin_state_versions", "{"}};
  for (const auto& [key, value] : bad) {
    std::map<std::string, std::string> meta = good;
    meta[key] = value;
    try {
      parse_rank_metadata(meta, "rank00003.safetensors");
      ADD_FAILURE() << key << " = " << value << " accepted";
    } catch (const FileError& e) {
      EXPECT_NE(std::string(e.what()).find("rank00003.safetensors"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  }
  std::map<std::string, std::string> missing = good;
  missing.erase("completed_steps");
  EXPECT_THROW(parse_rank_metadata(missing, "r"), FileError);
}

// metrics.jsonl after a SIGKILL mid-line: the torn line is dropped and counted, the lines up to the
// checkpoint's step kept, later ones dropped (resume used std::stoll on the line: "stoll").
TEST(CheckpointCorruption, ATornMetricsLineIsDroppedOnResume) {
  const std::string lines = "{\"step\": 1, \"loss\": 5.5}\n{\"step\": 2, \"loss\": 5.1}\n{\"step\": 3, \"loss\": 4.9}\n";
  const size_t end1 = lines.find('\n'), end2 = lines.find('\n', end1 + 1);
  for (size_t cut = 0; cut <= lines.size(); ++cut) {
    int64_t dropped = 0;
    const std::string kept = metrics_up_to(lines.substr(0, cut) + "\n{\"step\": 4, \"lo", 2, &dropped);
    std::string want;  // the lines of steps 1 and 2 that the cut left whole
    if (cut >= end1) want += lines.substr(0, end1 + 1);
    if (cut >= end2) want += lines.substr(end1 + 1, end2 - end1);
    EXPECT_EQ(kept, want) << cut;
    EXPECT_GE(dropped, 1) << cut;
  }
  int64_t dropped = 0;
  EXPECT_EQ(metrics_up_to("{\"step\": \"x\"}\n{\"step\": 1}\n", 5, &dropped), "{\"step\": 1}\n");
  EXPECT_EQ(dropped, 1);
}
