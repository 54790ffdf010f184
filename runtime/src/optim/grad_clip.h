// Global-norm gradient clipping, split in two so the engine can all-reduce between the calls:
//   double sq = grad_sq_norm(grads);           // this rank's sum of squares
//   all-reduce SUM of sq over ranks;           // the engine
//   clip_grads(grads, max_norm, std::sqrt(sq));
// Same result as torch.nn.utils.clip_grad_norm_ over the parameters whose .grad these are.
//
// `grads` holds gradients only — p.grad() of each parameter, or the partitions a plugin replaced
// them by — never parameters. An undefined tensor (a parameter without a gradient, e.g. a frozen
// one) counts 0 and is left alone. A tensor that requires grad is a parameter, not a gradient:
// both functions refuse the whole list (memrt::Error naming its index) before scaling anything.
// (A frozen parameter, requires_grad false, cannot be told from a gradient: pass p.grad().)
#pragma once

#include <vector>

#include <ATen/ATen.h>

namespace memrt {

// Sum of squares of every gradient: each tensor's norm in fp32 (as clip_grad_norm_ computes it
// for fp32 grads), squared and added in double.
double grad_sq_norm(const std::vector<at::Tensor>& grads);

// Scales every defined gradient in place by max_norm / (total_norm + 1e-6) when that is < 1;
// otherwise leaves them as they are. max_norm <= 0 means clipping is off (DeepSpeed's
// gradient_clipping 0). A non-finite total_norm leaves the gradients unscaled (the overflow check
// decides the step).
void clip_grads(const std::vector<at::Tensor>& grads, double max_norm, double total_norm);

}  // namespace memrt
