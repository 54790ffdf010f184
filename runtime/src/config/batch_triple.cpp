#include "config/batch_triple.h"

namespace memrt {

std::string derive_batch_triple(std::optional<int64_t> tbs, std::optional<int64_t> mbs,
                                std::optional<int64_t> gas, int world_size, BatchTriple& out) {
  if (world_size <= 0) return "the data-parallel world size must be positive, got " + std::to_string(world_size);
  const int64_t n = world_size;
  // The table of reference/deepspeed.md §1.1, row by row.
  if (tbs && mbs && gas) {
  } else if (tbs && mbs) {
    gas = mbs.value() != 0 ? (tbs.value() / mbs.value()) / n : 0;
  } else if (tbs && gas) {
    mbs = gas.value() != 0 ? (tbs.value() / n) / gas.value() : 0;
  } else if (mbs && gas) {
    tbs = mbs.value() * gas.value() * n;
  } else if (tbs) {
    gas = 1;
    mbs = tbs.value() / n;
  } else if (mbs) {
    gas = 1;
    tbs = mbs.value() * n;
  } else {
    return "either train_batch_size or train_micro_batch_size_per_gpu needs to be provided "
           "(in the ds_config, or per_device_train_batch_size in train.yaml)";
  }
  out = {tbs.value(), mbs.value(), gas.value()};
  if (out.train_batch_size <= 0) {
    return "train_batch_size: " + std::to_string(out.train_batch_size) + " has to be greater than 0 (" +
           batch_equation(out, world_size) + ")";
  }
  if (out.micro_batch_size <= 0) {
    return "train_micro_batch_size_per_gpu: " + std::to_string(out.micro_batch_size) +
           " has to be greater than 0 (" + batch_equation(out, world_size) + ")";
  }
  if (out.grad_accum_steps <= 0) {
    return "gradient_accumulation_steps: " + std::to_string(out.grad_accum_steps) +
           " has to be greater than 0 (" + batch_equation(out, world_size) + ")";
  }
  if (out.train_batch_size != out.micro_batch_size * out.grad_accum_steps * n) {
    return "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size: " +
           std::to_string(out.train_batch_size) + " != " + std::to_string(out.micro_batch_size) + " * " +
           std::to_string(out.grad_accum_steps) + " * " + std::to_string(n);
  }
  return {};
}

std::string batch_equation(const BatchTriple& b, int world_size) {
  return std::to_string(b.train_batch_size) + " = " + std::to_string(b.micro_batch_size) + " * " +
         std::to_string(b.grad_accum_steps) + " * " + std::to_string(world_size) +
         " (train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * N)";
}

}  // namespace memrt
