#include "ao_adam.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <vector>

#include <memrt/error.h>

#include "adam_state.h"
#include "ao_codes.h"
#include "blockwise.h"
#include "cpu_loops.h"
#include "dequant4.h"

namespace memrt::quant {

namespace {

std::vector<float> values_of(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

// A map as the kernel's constant (a plain array: not a tensor the memory report would count) and
// its quantizer (ao_codes.h), built once per process.
struct Map {
  explicit Map(const at::Tensor& t) : values(values_of(t)), quantizer(values.data(), static_cast<int>(values.size())) {}
  std::vector<float> values;
  AoQuantizer quantizer;
};

// torchao's maps: 8 bits, bitsandbytes' dynamic maps; 4 bits, create_dynamic_map(True, 3, 4) and
// linspace(0, 1, 17)[1:].
const Map& signed_map(int bits) {
  static const Map m8(ao_map(8, true)), m4(ao_map(4, true));
  return bits == 8 ? m8 : m4;
}
const Map& unsigned_map(int bits) {
  static const Map m8(ao_map(8, false)), m4(ao_map(4, false));
  return bits == 8 ? m8 : m4;
}

// The dequantizations' hand-written loops (table_codes.h: map256[code] * scale, gathered;
// dequant4.h: map16[code] * scale with the map in registers), looked up once per step.
struct AoLoops {
  TableValuesFn dequant8 = table_values_kernel();
  Dequant4Fn<float> dequant4 = dequant4_kernel<float>(ops::CpuKernels::kBest);
};

// One block of torchao's state, Bits 8 (256 elements, a code a byte) or 4 (128, two codes a byte);
// each step is the scalar rule of quant_math.h element by element.
template <int Bits>
struct AoBlock {
  static constexpr int64_t kLength = Bits == 8 ? 256 : 128;

  // map[code] * scale (element 2j in the high nibble of byte j at 4 bits).
  static void dequantize(const uint8_t* __restrict codes, float scale, const float* __restrict map,
                         float* __restrict out, const AoLoops& loops) {
    if constexpr (Bits == 8) {
      loops.dequant8(codes, kLength, map, scale, out);
    } else {
      loops.dequant4(codes, kLength / 2, map, scale, out);
    }
  }

  // torchao's scale_tensor and quantize_{8,4}bit_with_qmap: scale = max(max |x|, 1e-12), then
  // ao_code(x / scale).
  static void quantize(const float* __restrict x, const Map& map, uint8_t* __restrict codes, float* scale) {
    uint32_t largest = 0;
    for (int64_t i = 0; i < kLength; ++i) largest = std::max(largest, abs_bits(x[i]));
    const float s = std::max(from_bits(largest), 1e-12f);
    *scale = s;
    if constexpr (Bits == 8) {
      map.quantizer.codes(x, kLength, s, codes);
    } else {
      uint8_t c[kLength];
      map.quantizer.codes(x, kLength, s, c);
      for (int64_t j = 0; j < kLength / 2; ++j) codes[j] = pack4(c[2 * j], c[2 * j + 1]);
    }
  }

  // Inline into each ISA clone of ao8_block/ao4_block, so the update loop takes that ISA's vectors
  // (the map lookups are the hand-written loops', not gathers GCC would emulate).
  __attribute__((always_inline)) static void step(float* __restrict p, const GradIn& grad, int64_t begin,
                                                  uint8_t* m_codes, float* m_scale, uint8_t* v_codes,
                                                  float* v_scale, const AoAdamScalars& s, const Map& sm,
                                                  const Map& um, const AoLoops& loops) {
    float g[kLength], m[kLength], v[kLength];
    grad.load(begin, kLength, g);
    dequantize(m_codes, *m_scale, sm.values.data(), m, loops);
    dequantize(v_codes, *v_scale, um.values.data(), v, loops);
    const AoAdamScalars sc = s;  // a local copy: its branches are loop-invariant, and the loop vectorises
    for (int64_t i = 0; i < kLength; ++i) {
      ao_adam_moments(p[i], g[i], m[i], v[i], sc);
      p[i] = ao_adam_param(p[i], m[i], v[i], sc);
    }
    quantize(m, sm, m_codes, m_scale);
    quantize(v, um, v_codes, v_scale);
  }
};

// A block's signed and unsigned maps come in looked up once per step, not per block.
MEMRT_QUANT_CLONES void ao8_block(float* p, const GradIn& g, int64_t begin, uint8_t* mc, float* ms, uint8_t* vc,
                                  float* vs, const AoAdamScalars& s, const Map& sm, const Map& um,
                                  const AoLoops& loops) {
  AoBlock<8>::step(p, g, begin, mc, ms, vc, vs, s, sm, um, loops);
}
MEMRT_QUANT_CLONES void ao4_block(float* p, const GradIn& g, int64_t begin, uint8_t* mc, float* ms, uint8_t* vc,
                                  float* vs, const AoAdamScalars& s, const Map& sm, const Map& um,
                                  const AoLoops& loops) {
  AoBlock<4>::step(p, g, begin, mc, ms, vc, vs, s, sm, um, loops);
}
MEMRT_QUANT_CLONES void ao32_block(float* __restrict p, const GradIn& grad, int64_t begin, float* __restrict m,
                                   float* __restrict v, int64_t len, const AoAdamScalars& s) {
  float g[256];
  grad.load(begin, len, g);
  const AoAdamScalars sc = s;  // local: loop-invariant branches, a vectorised loop
  for (int64_t i = 0; i < len; ++i) {
    ao_adam_moments(p[i], g[i], m[i], v[i], sc);
    p[i] = ao_adam_param(p[i], m[i], v[i], sc);
  }
}

constexpr int64_t kGrainBlocks = 16;

class AoAdamKernel final : public StepKernel {
 public:
  explicit AoAdamKernel(int bits) : bits_(bits) {}

  void step(const StepRange& r) const override {
    if (bits_ != 32 && (r.first % ao_block(bits_) != 0 || r.n % ao_block(bits_) != 0))
      throw Error("torchao Adam step: the range of '" + r.param->name + "' [" + std::to_string(r.first) + ", " +
                  std::to_string(r.first + r.n) + ") is not whole blocks of " + std::to_string(ao_block(bits_)) +
                  " (the store's block alignment is broken)");
    const Fp32Range f(r, "torchao Adam step");
    const AoAdamScalars s =
        ao_adam_scalars(r.lr, r.beta1, r.beta2, r.eps, r.weight_decay, r.step, r.decoupled, r.bias_correction);
    if (bits_ == 32) {
      ao_adam32_cpu(f.p.data_ptr<float>(), f.grad, r.state[0].data_ptr<float>(),
                    r.state[1].data_ptr<float>(), r.n, s);
    } else {
      ao_adam_lowbit_cpu(bits_, f.p.data_ptr<float>(), f.grad, r.state[0].data_ptr<uint8_t>(),
                         r.state[1].data_ptr<float>(), r.state[2].data_ptr<uint8_t>(), r.state[3].data_ptr<float>(),
                         r.n, s);
    }
    f.finish(r);
  }

 private:
  int bits_;
};

}  // namespace

int64_t ao_block(int bits) { return bits == 4 ? 128 : 256; }

at::Tensor ao_map(int bits, bool is_signed) {
  if (bits == 8) return dynamic_map(is_signed);
  return is_signed ? dynamic_map(true, 3, 4) : linear_map16();
}

void ao_quantize(int bits, bool is_signed, const float* x, int64_t n, uint8_t* codes, float* scale) {
  const int64_t block = ao_block(bits), bytes = bits == 8 ? block : block / 2;
  const Map& map = is_signed ? signed_map(bits) : unsigned_map(bits);
  for (int64_t b = 0; b < n / block; ++b) {
    if (bits == 8) {
      AoBlock<8>::quantize(x + b * block, map, codes + b * bytes, scale + b);
    } else {
      AoBlock<4>::quantize(x + b * block, map, codes + b * bytes, scale + b);
    }
  }
}

StateFormat ao_format(int bits) {
  if (bits != 8 && bits != 4) throw Error("torchao Adam: " + std::to_string(bits) + "-bit state does not exist (8 or 4)");
  const int64_t per_code = bits == 8 ? 1 : 2;
  StateFormat f;
  f.name = bits == 8 ? kAo8Format : kAo4Format;
  f.block = ao_block(bits);
  f.blocks_per_tensor = true;
  f.tensors = {{"exp_avg", at::kByte, per_code},
               {"exp_avg.scale", at::kFloat, f.block},
               {"exp_avg_sq", at::kByte, per_code},
               {"exp_avg_sq.scale", at::kFloat, f.block}};
  return f;
}

StateFormat ao32_format() {
  StateFormat f = StateFormat::plain(at::kFloat, {"exp_avg", "exp_avg_sq"});
  f.name = kAo32Format;
  return f;
}

void plan_ao_adam(StorePlan& plan, int bits) {
  const int64_t block = ao_block(bits);
  plan_low_bit_state(plan, [block](int64_t numel) { return numel < kAoMinQuantSize || numel % block != 0; },
                     ao32_format(), ao_format(bits));
}

AoAdamScalars ao_adam_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                              int64_t step, bool decoupled, bool bias_correction) {
  AoAdamScalars s;
  s.lr = static_cast<float>(lr);
  s.lr_wd = s.lr * static_cast<float>(weight_decay);
  s.l2 = static_cast<float>(weight_decay);
  s.decoupled = decoupled;
  s.weight1 = static_cast<float>(1.0 - beta1);
  s.weight2 = static_cast<float>(1.0 - beta2);
  const double t = static_cast<double>(step);
  if (bias_correction) {
    s.bc1 = 1.f - static_cast<float>(std::pow(static_cast<double>(static_cast<float>(beta1)), t));
    s.sqrt_bc2 = std::sqrt(1.f - static_cast<float>(std::pow(static_cast<double>(static_cast<float>(beta2)), t)));
  }
  s.eps = static_cast<float>(eps);
  return s;
}

void ao_adam_lowbit_cpu(int bits, float* p, const GradIn& g, uint8_t* m_codes, float* m_scale, uint8_t* v_codes,
                        float* v_scale, int64_t n, const AoAdamScalars& s) {
  const int64_t block = ao_block(bits);
  const int64_t bytes = bits == 8 ? block : block / 2;  // of codes per block
  const Map& sm = signed_map(bits);
  const Map& um = unsigned_map(bits);
  const AoLoops loops;
  at::parallel_for(0, n / block, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      (bits == 8 ? ao8_block : ao4_block)(p + b * block, g, b * block, m_codes + b * bytes, m_scale + b,
                                          v_codes + b * bytes, v_scale + b, s, sm, um, loops);
  });
}

void ao_adam32_cpu(float* p, const GradIn& g, float* m, float* v, int64_t n, const AoAdamScalars& s) {
  at::parallel_for(0, (n + 255) / 256, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      ao32_block(p + b * 256, g, b * 256, m + b * 256, v + b * 256, std::min<int64_t>(256, n - b * 256), s);
  });
}

std::shared_ptr<const StepKernel> ao_adam_kernel(int bits) { return std::make_shared<AoAdamKernel>(bits); }

}  // namespace memrt::quant
