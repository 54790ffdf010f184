// Writes a ds_config and a train.yaml into the test's scratch folder and loads them.
#pragma once

#include "config_test_util.h"

namespace memrt::test {

struct Loaded {
  std::string ds_path, yaml_path;
};

// `ds` or `yaml` empty: that file is not given.
inline ConfigSources sources(const std::string& ds, const std::string& yaml, std::vector<std::string> overrides = {},
                             int world_size = 1) {
  const auto dir = scratch_dir();
  ConfigSources s;
  if (!ds.empty()) s.ds_config_path = write_file(dir / "ds_config.json", ds);
  if (!yaml.empty()) s.train_yaml_path = write_file(dir / "train.yaml", yaml);
  s.overrides = std::move(overrides);
  s.world_size = world_size;
  return s;
}

inline TrainConfig load(const std::string& ds, const std::string& yaml, std::vector<std::string> overrides = {},
                        int world_size = 1) {
  return load_train_config(sources(ds, yaml, std::move(overrides), world_size));
}

inline const PluginSpec* plugin(const TrainConfig& cfg, const std::string& name) {
  for (const auto& p : cfg.plugins) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

inline bool has_warning(const TrainConfig& cfg, const std::string& part) {
  for (const auto& w : cfg.warnings) {
    if (w.find(part) != std::string::npos) return true;
  }
  return false;
}

}  // namespace memrt::test
