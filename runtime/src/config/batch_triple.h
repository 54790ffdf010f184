// DeepSpeed's batch-size triple: train_batch_size == micro_batch * gradient_accumulation_steps * N.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace memrt {

struct BatchTriple {
  int64_t train_batch_size = 0;
  int64_t micro_batch_size = 0;  // train_micro_batch_size_per_gpu
  int64_t grad_accum_steps = 0;  // gradient_accumulation_steps
};

// DeepSpeed's derivation (integer floor division) from whichever values are given, then its checks
// (each value > 0, then the product rule). Returns "" and fills `out`, or the reason it failed with
// the equation and the real N, e.g. "train_batch_size is not equal to micro_batch_per_gpu *
// gradient_acc_step * world_size: 10 != 3 * 3 * 1".
std::string derive_batch_triple(std::optional<int64_t> train_batch_size,
                                std::optional<int64_t> micro_batch_size,
                                std::optional<int64_t> grad_accum_steps, int world_size,
                                BatchTriple& out);

// "32 = 16 * 2 * 1 (train_batch_size = micro_batch * gradient_accumulation_steps * N)"
std::string batch_equation(const BatchTriple& b, int world_size);

}  // namespace memrt
