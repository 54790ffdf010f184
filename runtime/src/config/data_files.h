// A local dataset directory's splits, found as Hugging Face datasets' `load_dataset(DIR)` finds
// them (datasets 5.2's data_files.get_data_patterns and load.infer_module_for_data_files;
// docs/tokenizers.md, "A dataset directory"): what `dataset_name: DIR` trains on.
//
//   LocalDataset d = find_local_dataset("data/my_sft");   // {train: [train.jsonl], test: [test.jsonl]}
//   const std::vector<std::string>* train = d.split("train");
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace memrt {

struct LocalDataset {
  // In datasets' order (train, validation, test, then the others by name), each split's files as
  // paths under the directory, in the order datasets reads them.
  std::vector<std::pair<std::string, std::vector<std::string>>> splits;
  // The packaged builder datasets picks for these files ("json", "text", "parquet", "csv", ...).
  std::string module;

  const std::vector<std::string>* split(const std::string& name) const;
  std::string split_names() const;  // "train, test"
};

// The splits of `dir`: the data files its README.md's `configs` list for `config_name` (empty: the
// default config), or else the files datasets' default patterns find. memrt::FileError naming
// `dir` when it holds no data file, when its splits' files are of different formats, when a
// sharded file names an invalid split, or when the config is not there; ConfigError naming
// README.md's key for a malformed card.
LocalDataset find_local_dataset(const std::string& dir, const std::string& config_name = "");

// Whether `path` (relative, '/'-separated) matches the glob `pattern` as fsspec's glob matches
// since 2023.12: `*` and `?` within one component, `[...]` classes, `**` as a whole component
// for zero or more components.
bool glob_match(const std::string& pattern, const std::string& path);

}  // namespace memrt
