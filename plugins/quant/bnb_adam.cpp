#include "bnb_adam.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <string>

#include <memrt/error.h>

#include "adam_state.h"
#include "blockwise.h"
#include "cpu_loops.h"

namespace memrt::quant {

namespace {

// The tables of the two maps, built once (64 KiB each).
const QuantizeTable& signed_table() {
  static const QuantizeTable table(dynamic_map(true));
  return table;
}
const QuantizeTable& unsigned_table() {
  static const QuantizeTable table(dynamic_map(false));
  return table;
}

// Blocks per task: 16 blocks of 256 elements, each task's buffers in the L1 cache.
constexpr int64_t kGrainBlocks = 16;

class BnbAdamKernel final : public StepKernel {
 public:
  explicit BnbAdamKernel(bool eight_bit) : eight_bit_(eight_bit) {}

  void step(const StepRange& r) const override {
    if (eight_bit_ && r.first % kBnbBlock != 0)
      throw Error("bitsandbytes Adam step: the range of '" + r.param->name + "' starts at element " +
                  std::to_string(r.first) + ", inside a block of " + std::to_string(kBnbBlock) +
                  " (the store's block alignment is broken)");
    if (!r.decoupled && r.weight_decay > 0)
      throw Error("bitsandbytes Adam step: '" + r.param->name + "' decays by L2 in the gradient (Adam with "
                  "adam_w_mode false); bitsandbytes' 8-bit step decays the weight (AdamW): set adam_w_mode true "
                  "or weight_decay 0");
    const Fp32Range f(r, "bitsandbytes Adam step");
    const BnbAdamScalars s =
        bnb_adam_scalars(r.lr, r.beta1, r.beta2, r.eps, r.weight_decay, r.step, r.bias_correction);
    if (eight_bit_) {
      bnb_adam8_cpu(f.p.data_ptr<float>(), f.grad, r.state[0].data_ptr<uint8_t>(),
                    r.state[1].data_ptr<float>(), r.state[2].data_ptr<uint8_t>(), r.state[3].data_ptr<float>(), r.n, s);
    } else {
      bnb_adam32_cpu(f.p.data_ptr<float>(), f.grad, r.state[0].data_ptr<float>(),
                     r.state[1].data_ptr<float>(), r.n, s);
    }
    f.finish(r);
  }

 private:
  bool eight_bit_;
};

}  // namespace

StateFormat bnb8_format() {
  StateFormat f;
  f.name = kBnb8Format;
  f.tensors = {{"exp_avg", at::kByte, 1},
               {"exp_avg.absmax", at::kFloat, kBnbBlock},
               {"exp_avg_sq", at::kByte, 1},
               {"exp_avg_sq.absmax", at::kFloat, kBnbBlock}};
  f.block = kBnbBlock;
  f.blocks_per_tensor = true;
  return f;
}

StateFormat bnb32_format() {
  StateFormat f = StateFormat::plain(at::kFloat, {"exp_avg", "exp_avg_sq"});
  f.name = kBnb32Format;
  return f;
}

void plan_bnb_adam8(StorePlan& plan) {
  plan_low_bit_state(plan, [](int64_t numel) { return numel < kBnbMin8BitSize; }, bnb32_format(), bnb8_format());
}

BnbAdamScalars bnb_adam_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                                int64_t step, bool bias_correction) {
  const double t = static_cast<double>(step);
  const double correction1 = bias_correction ? 1.0 - std::pow(beta1, t) : 1.0;
  const double correction2 = bias_correction ? std::sqrt(1.0 - std::pow(beta2, t)) : 1.0;
  BnbAdamScalars s;
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  s.correction2 = static_cast<float>(correction2);
  s.step_size = static_cast<float>(-lr / correction1);
  s.eps_c2 = static_cast<float>(eps * correction2);
  s.step_size32 = static_cast<float>(-lr * correction2 / correction1);
  s.decays = weight_decay > 0.0;
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  return s;
}

namespace {

// The two maps and their quantization tables, looked up once per step, not per block.
struct BnbMaps {
  const float* signed_map;
  const float* unsigned_map;
  const uint8_t* signed_table;
  const uint8_t* unsigned_table;
  TableCodesFn codes;    // the widest quantizer loop this processor runs
  TableValuesFn values;  // and dequantizer loop
};

// One block (len <= 256): the gradient widened, both moments dequantized, updated with p, and
// requantized.
MEMRT_QUANT_CLONES void bnb_adam8_block(float* __restrict p, const GradIn& grad, int64_t begin, uint8_t* m_codes,
                                        float* m_absmax, uint8_t* v_codes, float* v_absmax, int64_t len,
                                        const BnbAdamScalars& s, const BnbMaps& maps) {
  float g[kBnbBlock], m[kBnbBlock], v[kBnbBlock];
  grad.load(begin, len, g);
  maps.values(m_codes, len, maps.signed_map, *m_absmax, m);
  maps.values(v_codes, len, maps.unsigned_map, *v_absmax, v);
  const BnbAdamScalars sc = s;  // local: loop-invariant branches, a vectorised loop
  for (int64_t i = 0; i < len; ++i) {
    bnb_adam_moments(g[i], m[i], v[i], sc);
    p[i] = bnb_adam8_param(p[i], m[i], v[i], sc);
  }
  quantize_block(m, len, maps.signed_table, m_codes, m_absmax, maps.codes);
  quantize_block(v, len, maps.unsigned_table, v_codes, v_absmax, maps.codes);
}

MEMRT_QUANT_CLONES void bnb_adam32_block(float* __restrict p, const GradIn& grad, int64_t begin, float* __restrict m,
                                         float* __restrict v, int64_t len, const BnbAdamScalars& s) {
  float g[kBnbBlock];
  grad.load(begin, len, g);
  const BnbAdamScalars sc = s;  // local: loop-invariant branches, a vectorised loop
  for (int64_t i = 0; i < len; ++i) {
    bnb_adam_moments(g[i], m[i], v[i], sc);
    p[i] = bnb_adam32_param(p[i], m[i], v[i], sc);
  }
}

}  // namespace

void bnb_adam8_cpu(float* p, const GradIn& g, uint8_t* m_codes, float* m_absmax, uint8_t* v_codes,
                   float* v_absmax, int64_t n, const BnbAdamScalars& s) {
  const BnbMaps maps{dynamic_map_values(true), dynamic_map_values(false), signed_table().data(), unsigned_table().data(),
                     table_codes_kernel(), table_values_kernel()};
  at::parallel_for(0, (n + kBnbBlock - 1) / kBnbBlock, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * kBnbBlock;
      bnb_adam8_block(p + begin, g, begin, m_codes + begin, m_absmax + b, v_codes + begin, v_absmax + b,
                      std::min(kBnbBlock, n - begin), s, maps);
    }
  });
}

void bnb_adam32_cpu(float* p, const GradIn& g, float* m, float* v, int64_t n, const BnbAdamScalars& s) {
  at::parallel_for(0, (n + kBnbBlock - 1) / kBnbBlock, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * kBnbBlock;
      bnb_adam32_block(p + begin, g, begin, m + begin, v + begin, std::min(kBnbBlock, n - begin), s);
    }
  });
}

std::shared_ptr<const StepKernel> bnb_adam_kernel(bool eight_bit) {
  return std::make_shared<BnbAdamKernel>(eight_bit);
}

}  // namespace memrt::quant
