// The files of a training-state checkpoint (docs/checkpoints.md): tags, `latest`, the manifest
// with every file's size and SHA-256, verification, pruning.
#pragma once

#include <cstdint>
#include <map>
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

// fsync of a file or a folder (so a rename inside it is durable).
void fsync_path(const std::string& path);

// Deletes the oldest global_step* folders of output_dir beyond `limit` (> 0), never `keep`.
// Returns the deleted tags.
std::vector<std::string> prune_checkpoints(const std::string& output_dir, int64_t limit,
                                           const std::string& keep);

}  // namespace memrt
