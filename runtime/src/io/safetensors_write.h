// write_safetensors with the dtype each tensor is written in (memrt/safetensors.h has the format).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace memrt {

// As write_safetensors, each tensor written in `as[i]` (at::ScalarType::Undefined, or `as` empty: its own
// dtype), converted as it is written: one converted copy is alive at a time, so a caller may hand
// over views (of mapped files, transposed) and hold nothing converted itself.
void write_safetensors_as(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                          const std::vector<at::ScalarType>& as, const std::map<std::string, std::string>& metadata);

}  // namespace memrt
