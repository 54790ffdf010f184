#include "blockwise.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "memrt/error.h"

#include "cpu_loops.h"

namespace memrt::quant {

namespace {

// Blocks per task of at::parallel_for: the work of one block is small.
constexpr int64_t kGrainBlocks = 16;

int64_t num_blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

void check_block(int64_t block, const char* what) {
  if (block <= 0) throw Error(std::string(what) + ": block size must be positive, got " + std::to_string(block));
}

// x as a contiguous fp32 CPU tensor (a copy only when it is not one already).
at::Tensor fp32_input(const at::Tensor& x, const char* what) {
  if (!x.defined() || !x.is_floating_point())
    throw Error(std::string(what) + ": expects a floating-point tensor");
  if (!x.is_cpu()) throw Error(std::string(what) + ": expects a CPU tensor, got one on " + x.device().str());
  return x.to(at::kFloat).contiguous();
}

void check_map(const at::Tensor& map, int64_t size, const char* what) {
  if (!map.defined() || map.scalar_type() != at::kFloat || map.numel() != size || !map.is_cpu())
    throw Error(std::string(what) + ": the map must be " + std::to_string(size) + " fp32 values on the CPU");
}

}  // namespace

const float* dynamic_map_values(bool is_signed) {
  static const std::array<std::array<float, 256>, 2> maps = [] {
    std::array<std::array<float, 256>, 2> m{};
    for (int s = 0; s < 2; ++s) {
      const at::Tensor t = dynamic_map(s == 1).contiguous();
      std::copy(t.data_ptr<float>(), t.data_ptr<float>() + 256, m[static_cast<size_t>(s)].begin());
    }
    return m;
  }();
  return maps[is_signed ? 1 : 0].data();
}

at::Tensor dynamic_map(bool is_signed, int max_exponent_bits, int total_bits) {
  // create_dynamic_map(signed, max_exponent_bits, total_bits), operation for operation.
  const int kExponentBits = max_exponent_bits;
  if (max_exponent_bits < 1 || total_bits - 1 < max_exponent_bits || total_bits > 8)
    throw Error("dynamic_map: needs 1 <= max_exponent_bits <= total_bits - 1 <= 7");
  std::vector<double> data;
  auto append = [&](const at::Tensor& boundaries, int i) {
    const at::Tensor means = (boundaries.slice(0, 0, -1) + boundaries.slice(0, 1)) / 2.0;
    const double scale = std::pow(10.0, -(kExponentBits - 1) + i);
    for (const at::Tensor& t : {means * scale, means * -scale}) {
      const at::Tensor c = t.contiguous();
      data.insert(data.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
      if (!is_signed) break;
    }
  };
  const int non_sign_bits = total_bits - 1;
  for (int i = 0; i < kExponentBits; ++i) {
    const int64_t items = (int64_t{1} << (i + non_sign_bits - kExponentBits + (is_signed ? 0 : 1))) + 1;
    append(at::linspace(0.1, 1, items, at::kFloat), i);
  }
  if (const int64_t additional = (int64_t{1} << (non_sign_bits - kExponentBits)) - 1; additional > 0)
    append(at::linspace(0.1, 1, additional + 1, at::kFloat), kExponentBits - 1);
  data.push_back(0.0);
  data.push_back(1.0);
  const size_t size = size_t{1} << total_bits;
  if (data.size() > size) throw Error("dynamic_map: " + std::to_string(data.size()) + " values for " + std::to_string(size) + " codes");
  data.resize(size, 0.0);  // bitsandbytes pads with zeros
  std::sort(data.begin(), data.end());
  at::Tensor out = at::empty({static_cast<int64_t>(size)}, at::kFloat);
  std::transform(data.begin(), data.end(), out.data_ptr<float>(), [](double v) { return static_cast<float>(v); });
  return out;
}

at::Tensor linear_map16() { return at::linspace(0, 1, 17, at::kFloat).slice(0, 1).contiguous(); }

at::Tensor map4(Map4 type) {
  at::Tensor out = at::empty({16}, at::kFloat);
  for (uint32_t c = 0; c < 16; ++c) out.data_ptr<float>()[c] = map4_value(type, c);
  return out;
}

QuantizeTable::QuantizeTable(const float* map256) {
  float midpoint[255];
  for (int i = 0; i < 255; ++i) midpoint[i] = mul_rn(0.5f, add_rn(map256[i], map256[i + 1]));
  // Points ascend, so the count of midpoints below them only grows.
  int below = 0;
  for (uint32_t i = 0; i < static_cast<uint32_t>(kTableSize); ++i) {
    const float point = table_point(i);
    while (below < 255 && midpoint[below] < point) ++below;
    codes_[i] = static_cast<uint8_t>(below);
  }
}

QuantizeTable::QuantizeTable(const at::Tensor& map256) {
  check_map(map256, 256, "QuantizeTable");
  *this = QuantizeTable(map256.contiguous().data_ptr<float>());  // the copy lives to the end of this line
}

void quantize_blockwise(const float* x, int64_t n, int64_t block, const QuantizeTable& table,
                        uint8_t* codes, float* absmax) {
  check_block(block, "quantize_blockwise");
  const TableCodesFn codes_fn = table_codes_kernel();
  at::parallel_for(0, num_blocks(n, block), kGrainBlocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * block;
      quantize_block(x + begin, std::min(block, n - begin), table.data(), codes + begin, absmax + b, codes_fn);
    }
  });
}

void dequantize_blockwise(const uint8_t* codes, const float* absmax, int64_t n, int64_t block,
                          const float* map256, float* out) {
  check_block(block, "dequantize_blockwise");
  const TableValuesFn values_fn = table_values_kernel();
  at::parallel_for(0, num_blocks(n, block), kGrainBlocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * block;
      values_fn(codes + begin, std::min(block, n - begin), map256, absmax[b], out + begin);
    }
  });
}

Blockwise quantize_blockwise(const at::Tensor& x, const at::Tensor& map256, int64_t block) {
  const at::Tensor in = fp32_input(x, "quantize_blockwise");
  check_block(block, "quantize_blockwise");
  Blockwise q{at::empty(in.sizes(), at::kByte), at::empty({num_blocks(in.numel(), block)}, at::kFloat)};
  quantize_blockwise(in.data_ptr<float>(), in.numel(), block, QuantizeTable(map256), q.codes.data_ptr<uint8_t>(),
                     q.absmax.data_ptr<float>());
  return q;
}

at::Tensor dequantize_blockwise(const Blockwise& q, const at::Tensor& map256, int64_t block,
                                at::ScalarType dtype) {
  check_map(map256, 256, "dequantize_blockwise");
  check_block(block, "dequantize_blockwise");
  const int64_t n = q.codes.numel();
  if (q.codes.scalar_type() != at::kByte || q.absmax.scalar_type() != at::kFloat ||
      q.absmax.numel() != num_blocks(n, block))
    throw Error("dequantize_blockwise: expects uint8 codes and one fp32 absmax per block of " + std::to_string(block));
  at::Tensor out = at::empty(q.codes.sizes(), at::kFloat);
  const at::Tensor codes = q.codes.contiguous(), absmax = q.absmax.contiguous(), map = map256.contiguous();
  dequantize_blockwise(codes.data_ptr<uint8_t>(), absmax.data_ptr<float>(), n, block, map.data_ptr<float>(),
                       out.data_ptr<float>());
  return out.to(dtype);
}

Quantized4 quantize_4bit(const at::Tensor& x, Map4 type, int64_t block, bool double_quant) {
  const at::Tensor in = fp32_input(x, "quantize_4bit");
  check_block(block, "quantize_4bit");
  const int64_t n = in.numel();
  if (n == 0) throw Error("quantize_4bit: the tensor is empty");
  const int64_t blocks = num_blocks(n, block);
  Quantized4 q;
  q.type = type;
  q.block = block;
  q.shape = x.sizes().vec();
  q.packed = at::empty({(n + 1) / 2, 1}, at::kByte);
  at::Tensor absmax = at::empty({blocks}, at::kFloat);
  const float* src = in.data_ptr<float>();
  float* am = absmax.data_ptr<float>();
  uint8_t* packed = q.packed.data_ptr<uint8_t>();
  const Map4Bounds bounds = map4_bounds(type);
  // Blocks of an even size pack their own bytes; an odd block size shares bytes between blocks,
  // so codes are produced first and packed after.
  std::vector<uint8_t> codes(static_cast<size_t>(n + 1), map4_code(bounds, 0.f));
  const bool partial = n % block != 0;
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * block, end = std::min(begin + block, n);
      float m = 0.f;
      for (int64_t i = begin; i < end; ++i) m = std::max(m, std::fabs(src[i]));
      const float clamped = std::max(m, 1e-38f);
      const bool last_partial = partial && b == blocks - 1;
      // bitsandbytes scales full blocks by a reciprocal and divides the partial last one, whose
      // stored absmax is the clamped value.
      am[b] = last_partial ? clamped : m;
      const float inv = 1.f / clamped;
      for (int64_t i = begin; i < end; ++i) {
        float s = last_partial ? src[i] / clamped : src[i] * inv;
        s = s < -1.f ? -1.f : (s > 1.f ? 1.f : s);
        codes[static_cast<size_t>(i)] = map4_code(bounds, s);
      }
    }
  });
  for (int64_t j = 0; j < (n + 1) / 2; ++j)
    packed[j] = pack4(codes[static_cast<size_t>(2 * j)], codes[static_cast<size_t>(2 * j + 1)]);
  if (!double_quant) {
    q.absmax = absmax;
    return q;
  }
  q.offset = absmax.mean();
  const Blockwise nested = quantize_blockwise(absmax - q.offset, dynamic_map(true), q.nested_block);
  q.absmax = nested.codes;
  q.nested_absmax = nested.absmax;
  return q;
}

at::Tensor absmax_fp32(const Quantized4& q) {
  if (!q.double_quant()) return q.absmax;
  return dequantize_blockwise(Blockwise{q.absmax, q.nested_absmax}, dynamic_map(true), q.nested_block, at::kFloat) +
         q.offset;
}

at::Tensor dequantize_4bit(const Quantized4& q, at::ScalarType dtype) {
  int64_t n = 1;
  for (int64_t d : q.shape) n *= d;
  const at::Tensor scale = absmax_fp32(q).contiguous();
  if (q.packed.scalar_type() != at::kByte || q.packed.numel() != (n + 1) / 2 ||
      scale.numel() != num_blocks(n, q.block))
    throw Error("dequantize_4bit: the packed codes or scales do not match a tensor of " + std::to_string(n) +
                " elements in blocks of " + std::to_string(q.block));
  at::Tensor out = at::empty({n}, at::kFloat);
  const at::Tensor packed_codes = q.packed.contiguous();
  const uint8_t* packed = packed_codes.data_ptr<uint8_t>();
  const float* s = scale.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const Map4 type = q.type;
  const int64_t block = q.block;
  at::parallel_for(0, n, kGrainBlocks * block, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) o[i] = map4_value(type, unpack4(packed, i)) * s[i / block];
  });
  return out.to(dtype).view(q.shape);
}

}  // namespace memrt::quant
