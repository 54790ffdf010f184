// Loading a run's configuration: ds_config.json (DeepSpeed's schema and semantics) + train.yaml
// (Hugging Face TrainingArguments names and common aliases) + command-line overrides, resolved
// into one TrainConfig. Every key is supported, accepted with one warning, or an error; see
// docs/configuration.md for the tables.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "config/train_config.h"

namespace memrt {

// Reads, validates and resolves both files and the overrides. Throws ConfigError naming the file,
// the key path, what was expected and how to fix it.
TrainConfig load_train_config(const ConfigSources& sources);

// How `train_yaml` (a loaded TrainConfig::train_yaml) spells the setting `key` names — axolotl's
// `micro_batch_size` for `per_device_train_batch_size` — or `key` when it holds no spelling of it.
std::string yaml_spelling(const ConfigNode& train_yaml, const std::string& key);

// A size as users write it: bytes ("6442450944"), or a number with a unit — binary K/Ki/KiB,
// M/Mi/MiB, G/Gi/GiB, T/Ti/TiB (2^10 steps; bare K, M, G, T too, as memory tools read them) or
// decimal KB, MB, GB, TB (10^3 steps), case-insensitive, "6.5GiB" allowed; none for anything else
// or a size not above zero (train.yaml memory_budget).
std::optional<int64_t> parse_size(const std::string& text);

// What `launcher --print-config` prints: the resolved values (batch triple with its equation and N,
// optimizer, scheduler, model, data, plugins with their options, warnings) as pretty JSON.
std::string resolved_config_json(const TrainConfig& cfg);

}  // namespace memrt
