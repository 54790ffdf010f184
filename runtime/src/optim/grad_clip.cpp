#include "optim/grad_clip.h"

#include <cmath>

namespace memrt {

double clip_divisor(double total_norm, double max_norm) {
  if (max_norm <= 0.0 || !std::isfinite(total_norm)) return 1.0;
  const double clip = (total_norm + 1e-6) / max_norm;
  return clip > 1.0 ? clip : 1.0;
}

}  // namespace memrt
