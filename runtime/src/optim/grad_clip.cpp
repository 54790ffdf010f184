#include "optim/grad_clip.h"

#include <cmath>
#include <string>

#include "memrt/error.h"

namespace memrt {

namespace {
// grad_clip.h's contract: gradients only. A tensor that requires grad is a parameter.
void check_gradients(const std::vector<at::Tensor>& grads, const char* fn) {
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].defined() && grads[i].requires_grad()) {
      throw Error(std::string(fn) + ": tensor " + std::to_string(i) + " of " +
                  std::to_string(grads.size()) + " (shape " + c10::str(grads[i].sizes()) +
                  ") requires grad: it is a parameter, not a gradient. Pass the gradients "
                  "(p.grad() of each parameter), never the parameters themselves");
    }
  }
}
}  // namespace

double grad_sq_norm(const std::vector<at::Tensor>& grads) {
  check_gradients(grads, "grad_sq_norm");
  double total = 0.0;
  for (const at::Tensor& g : grads) {
    if (!g.defined()) continue;
    at::Tensor g32 = g.scalar_type() == at::kFloat ? g : g.to(at::kFloat);
    // The norm (torch's cascade summation, no temporary the size of the gradient), squared in double.
    double norm = at::linalg_vector_norm(g32, 2).item<float>();
    total += norm * norm;
  }
  return total;
}

void clip_grads(const std::vector<at::Tensor>& grads, double max_norm, double total_norm) {
  check_gradients(grads, "clip_grads");
  if (max_norm <= 0 || !std::isfinite(total_norm)) return;
  double coef = max_norm / (total_norm + 1e-6);
  if (coef >= 1.0) return;
  at::NoGradGuard no_grad;
  for (const at::Tensor& g : grads) {
    if (g.defined()) g.mul_(coef);
  }
}

}  // namespace memrt
