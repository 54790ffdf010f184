// The memory advisor (docs/preflight.md): the changes to a user's own config that make a run fit
// the memory its host allows, each found by running the same estimate with the change applied —
// never by a rule of thumb — and ranked by what it costs in speed or fidelity.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/train_config.h"
#include "engine/preflight.h"

namespace memrt {

struct Suggestion {
  std::string change;                 // in words: "activation checkpointing of every 2nd block"
  std::vector<ConfigEdit> edits;      // the keys to set, in the files the user has them in
  int64_t peak = 0;                   // the largest estimated peak of this host's ranks (bytes)
  int64_t device = 0;                 // on an accelerator: the largest device need of them
  Tightest fit;                       // the host's need against the limit with the least room
  bool changes_what_is_trained = false;  // LoRA, QLoRA
};

struct Advice {
  std::vector<Suggestion> suggestions;  // single changes that fit, cheapest first, then combinations
  int64_t estimates = 0;                // how many configs were estimated to find them
};

// The changes that fit `host`, for the config `sources` describe (a refused run's, or
// `launcher --estimate --memory_budget`'s). A change the config refuses (8-bit state for SGD) is
// not suggested. Combinations are tried only while fewer than three suggestions are found.
Advice advise(const ConfigSources& sources, const HostMemory& host);

// The advice as the refusal and `launcher --estimate` print it: each change with its keys as the
// user writes them (train.yaml keys also as command-line overrides) and its estimated peak.
std::string advice_text(const Advice& advice, const ConfigSources& sources);

}  // namespace memrt
