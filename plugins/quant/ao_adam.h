// plugins/quant/ao_adam.h — torchao's low-bit AdamW (torchao.optim.AdamW8bit, AdamW4bit; HF
// Trainer's `optim: adamw_torch_8bit | adamw_torch_4bit`) as a step kernel of the parameter store:
// exp_avg on the signed dynamic map, exp_avg_sq on the unsigned one (8 bits: bitsandbytes' maps,
// blocks of 256; 4 bits: dynamic(3 exponent bits) and linear maps, blocks of 128, two codes a
// byte), tensors under 4096 elements or not a whole number of blocks in 32-bit state.
// docs/quant.md, "torchao's AdamW8bit and AdamW4bit".
#pragma once

#include <cstdint>
#include <memory>

#include <ATen/ATen.h>

#include <memrt/optimizer.h>
#include <memrt/param_store.h>

#include "adam_state.h"
#include "quant_math.h"

namespace memrt::quant {

constexpr int64_t kAoMinQuantSize = 4096;  // torchao's _new_buffer: numel >= 4096 ...
constexpr const char* kAo8Format = "ao_blockwise8";
constexpr const char* kAo4Format = "ao_blockwise4";
constexpr const char* kAo32Format = "ao_fp32";

int64_t ao_block(int bits);  // 256 (8 bits) or 128 (4 bits)
// exp_avg, exp_avg.scale, exp_avg_sq, exp_avg_sq.scale: codes (u8 per value, or two 4-bit codes a
// byte) and one fp32 scale per block.
StateFormat ao_format(int bits);
StateFormat ao32_format();  // plain fp32 moments, stepped with torchao's arithmetic

// torchao's layout: a tensor under 4096 elements or not a multiple of the block keeps 32-bit state.
void plan_ao_adam(StorePlan& plan, int bits);

AoAdamScalars ao_adam_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                              int64_t step, bool decoupled, bool bias_correction);

// torchao's maps (fp32): 8 bits, bitsandbytes' dynamic maps; 4 bits, dynamic_map(true, 3, 4) and
// linear_map16().
at::Tensor ao_map(int bits, bool is_signed);
// torchao's scale_tensor + quantize_{8,4}bit_with_qmap on n values (whole blocks): per block
// scale = max(max |x|, 1e-12), codes of x / scale (nearest, ties up; 4 bits packed high nibble
// first).
void ao_quantize(int bits, bool is_signed, const float* x, int64_t n, uint8_t* codes, float* scale);

// n elements (a whole number of blocks) from a block boundary; codes of 4 bits hold n / 2 bytes.
void ao_adam_lowbit_cpu(int bits, float* p, const GradIn& g, uint8_t* m_codes, float* m_scale, uint8_t* v_codes,
                        float* v_scale, int64_t n, const AoAdamScalars& s);
void ao_adam32_cpu(float* p, const GradIn& g, float* m, float* v, int64_t n, const AoAdamScalars& s);

// The kernel of ao_format(bits) (bits 8 or 4), or of ao32_format() (bits 32).
std::shared_ptr<const StepKernel> ao_adam_kernel(int bits);

}  // namespace memrt::quant
