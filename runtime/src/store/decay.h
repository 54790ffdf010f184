// Which parameters decay: Hugging Face's Trainer excludes biases and normalisation weights from
// weight decay; DeepSpeed, when the optimizer comes from the ds_config, decays every trainable
// parameter (decay_all).
#pragma once

#include <string>

namespace memrt {

inline bool decays(const std::string& name, bool decay_all) {
  if (decay_all) return true;
  auto ends_with = [&](const char* s) {
    const std::string suffix(s);
    return name.size() >= suffix.size() &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return !(ends_with(".bias") || name.find("ln_") != std::string::npos ||
           name.find("norm") != std::string::npos);
}

}  // namespace memrt
