// The pretrained directory a run's frozen parameters come from (its model_name_or_path): a
// checkpoint of such a run leaves them out and records the directory and its fingerprint, and
// resume and export read them from there again (docs/checkpoints.md, "The frozen base").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace memrt {

struct BaseSource {
  struct File {
    std::string name;           // relative to dir: a *.safetensors shard or its index
    uint64_t bytes = 0;
    std::string sample_sha256;  // of the first and the last MiB (the whole file when shorter)
  };
  std::string dir;  // absolute
  std::string config_sha256;
  std::vector<File> files;  // by name

  // Fingerprints `dir` as it is now: config.json's SHA-256, and each weight file's size and the
  // SHA-256 of its first and last MiB (the header and data at both ends: a fine-tuned copy of the
  // same model differs there; hashing every byte of a 14 GB base on each save would not pay).
  // FileError naming the file when config.json or a weight file cannot be read.
  static BaseSource of(const std::string& dir);
  // "" when `now` has this fingerprint; else the first difference, in words.
  std::string difference(const BaseSource& now) const;
};

}  // namespace memrt
