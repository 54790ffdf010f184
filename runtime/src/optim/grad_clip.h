// Global-norm gradient clipping, split in two so the engine can all-reduce between the calls:
//   double sq = grad_sq_norm(params);          // this rank's sum of squares
//   all-reduce SUM of sq over ranks;           // the engine
//   clip_grads(params, max_norm, std::sqrt(sq));
// Same result as torch.nn.utils.clip_grad_norm_(params, max_norm) on one rank.
//
// `tensors` may hold parameters or gradients: a tensor whose .grad() is defined counts through
// its gradient; a tensor that does not require grad is taken to be a gradient itself (the engine
// passes the gradient tensors, which a plugin may have replaced by partitions); a parameter that
// requires grad but has none counts 0. So do not pass frozen parameters (requires_grad false):
// their values would be taken for gradients.
#pragma once

#include <vector>

#include <ATen/ATen.h>

namespace memrt {

// Sum of squares of every gradient: each tensor's norm in fp32 (as clip_grad_norm_ computes it
// for fp32 grads), squared and added in double.
double grad_sq_norm(const std::vector<at::Tensor>& tensors);

// Scales every defined gradient by max_norm / (total_norm + 1e-6) when that is < 1; otherwise
// leaves them as they are. max_norm <= 0 means clipping is off (DeepSpeed's gradient_clipping 0).
// A non-finite total_norm leaves the gradients unscaled (the overflow check decides the step).
void clip_grads(const std::vector<at::Tensor>& tensors, double max_norm, double total_norm);

}  // namespace memrt
