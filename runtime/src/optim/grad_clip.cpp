#include "optim/grad_clip.h"

#include <cmath>

namespace memrt {

namespace {
// The gradient a tensor stands for (see grad_clip.h), or an undefined tensor.
at::Tensor gradient_of(const at::Tensor& t) {
  if (!t.defined()) return {};
  if (t.requires_grad() || t.grad().defined()) return t.grad();
  return t;
}
}  // namespace

double grad_sq_norm(const std::vector<at::Tensor>& tensors) {
  double total = 0.0;
  for (const auto& t : tensors) {
    at::Tensor g = gradient_of(t);
    if (!g.defined()) continue;
    at::Tensor g32 = g.scalar_type() == at::kFloat ? g : g.to(at::kFloat);
    // The norm (torch's cascade summation, no temporary the size of the gradient), squared in double.
    double norm = at::linalg_vector_norm(g32, 2).item<float>();
    total += norm * norm;
  }
  return total;
}

void clip_grads(const std::vector<at::Tensor>& tensors, double max_norm, double total_norm) {
  if (max_norm <= 0 || !std::isfinite(total_norm)) return;
  double coef = max_norm / (total_norm + 1e-6);
  if (coef >= 1.0) return;
  at::NoGradGuard no_grad;
  for (const auto& t : tensors) {
    at::Tensor g = gradient_of(t);
    if (g.defined()) g.mul_(coef);
  }
}

}  // namespace memrt
