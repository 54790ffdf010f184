// plugins/quant/bnb_adam.h — bitsandbytes' Adam/AdamW as a step kernel of the parameter store: the
// 8-bit blockwise state (Adam8bit/AdamW8bit: exp_avg on the signed dynamic map, exp_avg_sq on the
// unsigned one, blocks of 256 from each tensor's first element) and the 32-bit state bitsandbytes
// keeps for tensors under min_8bit_size. docs/quant.md, "The step".
#pragma once

#include <cstdint>
#include <memory>

#include <memrt/optimizer.h>
#include <memrt/param_store.h>

#include "adam_state.h"
#include "quant_math.h"

namespace memrt::quant {

constexpr int64_t kBnbMin8BitSize = 4096;  // bitsandbytes' min_8bit_size
constexpr const char* kBnb8Format = "bnb_blockwise8";
constexpr const char* kBnb32Format = "bnb_fp32";

// exp_avg u8, exp_avg.absmax fp32 per 256, exp_avg_sq u8, exp_avg_sq.absmax fp32 per 256.
StateFormat bnb8_format();
// exp_avg, exp_avg_sq in fp32: the built-in layout, stepped with bitsandbytes' 32-bit arithmetic.
StateFormat bnb32_format();

// bitsandbytes' layout of 8-bit Adam state on the plan's groups: each group's tensors under
// min_8bit_size move to a "<group>_32bit" group (its weight decay and lr_scale; a group left empty
// disappears) of bnb32_format(); every other group gets bnb8_format().
void plan_bnb_adam8(StorePlan& plan);

// The scalars of update `step` (1-based). Without bias correction both corrections are 1.
BnbAdamScalars bnb_adam_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                                int64_t step, bool bias_correction);

// n elements from a block boundary: p updated in place from the gradient g, the blocks' codes and
// absmax dequantized, updated and requantized.
void bnb_adam8_cpu(float* p, const GradIn& g, uint8_t* m_codes, float* m_absmax, uint8_t* v_codes,
                   float* v_absmax, int64_t n, const BnbAdamScalars& s);
void bnb_adam32_cpu(float* p, const GradIn& g, float* m, float* v, int64_t n, const BnbAdamScalars& s);

// The kernel of kBnb8Format (eight_bit) or kBnb32Format.
std::shared_ptr<const StepKernel> bnb_adam_kernel(bool eight_bit);

}  // namespace memrt::quant
