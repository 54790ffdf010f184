// The files of a training-state checkpoint (docs/checkpoints.md): tags, `latest`, the manifest
// with every file's size and SHA-256, verification, pruning.
#pragma once

#include <cstdint>
#include <map>

#include "memrt/safetensors.h"
#include <string>
#include <vector>

namespace memrt {

// 2: the parameter store's shards and store.json (1: dense model.safetensors; not read).
constexpr int kCheckpointFormatVersion = 2;

// "global_step<step>"
std::string checkpoint_tag(int64_t step);
// The tag output_dir/latest names. FileError when there is none or it is malformed.
std::string read_latest(const std::string& output_dir);
// Resolves `--resume` (empty: latest) or `--resume=TAG` to a checkpoint folder.
std::string checkpoint_dir(const std::string& output_dir, const std::string& tag);

// The plugins the run loaded (plugin_host.h, plugins_json), for `launcher export`; rank 0 writes it.
inline constexpr char kPluginsFile[] = "plugins.json";

struct ManifestEntry {
  uint64_t bytes = 0;
  std::string sha256;
};

struct Manifest {
  int version = kCheckpointFormatVersion;
  std::string tag;
  int64_t step = 0;
  int world_size = 1;
  std::map<std::string, ManifestEntry> files;  // by file name inside the checkpoint folder
};

// Hashes `dir/name` into the manifest.
void add_to_manifest(Manifest& m, const std::string& dir, const std::string& name);
// Writes manifest.json and manifest.json.sha256 into `dir`.
void write_manifest(const std::string& dir, const Manifest& m);
// Reads `dir`'s manifest after checking it against manifest.json.sha256; FileError naming the
// file on any mismatch or malformed content.
Manifest read_manifest(const std::string& dir);
// Checks `dir/name` against the manifest (listed, size, SHA-256); FileError naming it.
void verify_checkpoint_file(const std::string& dir, const Manifest& m, const std::string& name);

// "rank00003.safetensors"
std::string rank_file_name(int rank);

// A checkpoint's rank files, each verified against the manifest and opened on first use only: a
// rank reads (and hashes) the files it needs, one on the world size that saved it, the few whose
// shards overlap its partition on another.
class RankFiles {
 public:
  RankFiles(std::string dir, const Manifest& m);
  ~RankFiles();
  const SafetensorsFile& operator()(int rank);
  int opened() const { return static_cast<int>(files_.size()); }

 private:
  std::string dir_;
  const Manifest& manifest_;
  std::map<int, SafetensorsFile> files_;
};

// What a rank file's safetensors metadata says besides the format's name and version: the
// counters and the state versions of the plugins that saved state.
struct RankFileMetadata {
  int64_t step = 0;             // optimizer steps taken, skipped ones included
  int64_t completed_steps = 0;  // updates (the LR schedule's clock)
  int64_t skipped_steps = 0;
  std::map<std::string, int> plugin_state_versions;  // plugin name -> its state_version()
};
// Parses a rank file's metadata; FileError naming `path` and the key when one is missing or is not
// what it should be (a non-negative decimal integer, a JSON object of integers).
RankFileMetadata parse_rank_metadata(const std::map<std::string, std::string>& metadata,
                                     const std::string& path);

// metrics.jsonl as a resumed run continues it: the lines of steps up to `step`, in order. A line
// that is not a JSON object with an integer "step" (the torn last line of a run killed while
// writing it) is dropped and counted in *dropped.
std::string metrics_up_to(const std::string& text, int64_t step, int64_t* dropped);

// fsync of a file or a folder (so a rename inside it is durable).
void fsync_path(const std::string& path);

// Deletes the oldest global_step* folders of output_dir beyond `limit` (> 0), never `keep`.
// Returns the deleted tags.
std::vector<std::string> prune_checkpoints(const std::string& output_dir, int64_t limit,
                                           const std::string& keep);

}  // namespace memrt
