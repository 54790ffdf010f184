// Global-norm gradient clipping as DeepSpeed folds it into the step: with the norm of the
// unscaled gradients known (pass 1 of the step, summed across ranks), clipping is one more
// divisor of the step's gradient factor,
//   grad_factor = 1 / (loss_scale * clip_divisor(norm, gradient_clipping)),
// which gives torch.nn.utils.clip_grad_norm_'s gradients (max_norm / (norm + 1e-6) when < 1).
#pragma once

namespace memrt {

// (norm + 1e-6) / max_norm when that is > 1, else 1. 1 when clipping is off (max_norm <= 0,
// DeepSpeed's gradient_clipping 0) or the norm is not finite (the overflow check decides).
double clip_divisor(double total_norm, double max_norm);

}  // namespace memrt
