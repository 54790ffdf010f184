// memrt/ops.h: linear and causal attention, with fp32 arithmetic on 16-bit storage where the
// processor has no 16-bit GEMM (see cpu_math.h for the choice).
//
// The fp32-arithmetic nodes save exactly what LibTorch's own 16-bit kernels save (linear: x and
// W; flash attention: q, k, v, the output and the fp32 log-sum-exp), so forward keeps the same
// bytes either way. The fp32 copies they make are transient and bounded: rows (or batch entries)
// are converted a block at a time, the block sized to kBlockBytes.
#include <algorithm>

#include <torch/autograd.h>

#include "memrt/ops.h"
#include "ops/activations_cpu.h"
#include "ops/cpu_math.h"

namespace memrt::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kBlockBytes = int64_t{4} << 20;  // fp32 bytes converted per block
constexpr int64_t kMinBlockRows = 64;               // below this MKL's GEMM loses its speed

const CpuFacts& facts() {
  static const CpuFacts f = read_cpu_facts();
  return f;
}

const MatmulPlan& plan() {
  static const MatmulPlan p = choose_matmul_plan(facts());
  return p;
}

// Rows per block when each row converts `row_elems` elements to fp32.
int64_t block_rows(int64_t rows, int64_t row_elems) {
  const int64_t fit = kBlockBytes / std::max<int64_t>(1, row_elems * 4);
  return std::clamp<int64_t>(fit, kMinBlockRows, std::max<int64_t>(rows, 1));
}

// ---- linear -----------------------------------------------------------------------------------
//   y[M,N]  = x[M,K] W[N,K]^T + b        forward, per block of rows of x
//   gx[M,K] = gy[M,N] W[N,K]             per block of rows of gy
//   gW[N,K] = sum over blocks gy^T x      accumulated in fp32, rounded once
//   gb[N]   = sum over rows gy            accumulated in fp32
struct Fp32Linear : torch::autograd::Function<Fp32Linear> {
  // The bias is optional: an undefined tensor is no autograd input.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias_opt) {
    const at::Tensor bias = bias_opt.value_or(at::Tensor());
    const int64_t K = weight.size(1), N = weight.size(0);
    at::Tensor x2 = x.reshape({-1, K});
    const int64_t M = x2.size(0);
    at::Tensor y = at::empty({M, N}, x.options());
    const at::Tensor w32 = weight.to(at::kFloat);
    const at::Tensor b32 = bias.defined() ? bias.to(at::kFloat) : at::Tensor();
    const int64_t rows = block_rows(M, K + N);
    for (int64_t r = 0; r < M; r += rows) {
      const int64_t n = std::min(rows, M - r);
      at::Tensor x32 = x2.narrow(0, r, n).to(at::kFloat);
      y.narrow(0, r, n).copy_(b32.defined() ? at::addmm(b32, x32, w32.t()) : at::mm(x32, w32.t()));
    }
    ctx->save_for_backward({x, weight});
    ctx->saved_data["has_bias"] = bias.defined();
    auto out_shape = x.sizes().vec();
    out_shape.back() = N;
    return y.view(out_shape);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const int64_t K = weight.size(1), N = weight.size(0);
    at::Tensor gy = grads[0].reshape({-1, N});
    at::Tensor x2 = x.reshape({-1, K});
    const int64_t M = gy.size(0);
    const bool want_x = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    const bool want_b = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2);

    // Two passes over gy, so that the fp32 copy of W is freed before the fp32 gradient of W is
    // made: the transient fp32 bytes are max(W, gW) + one block, not W + gW + one block.
    const int64_t rows = block_rows(M, K + N);
    at::Tensor gx;
    if (want_x) {
      gx = at::empty({M, K}, x.options());
      const at::Tensor w32 = weight.to(at::kFloat);
      for (int64_t r = 0; r < M; r += rows) {
        const int64_t n = std::min(rows, M - r);
        gx.narrow(0, r, n).copy_(at::mm(gy.narrow(0, r, n).to(at::kFloat), w32));
      }
    }
    at::Tensor gw32 = want_w ? at::zeros({N, K}, weight.options().dtype(at::kFloat)) : at::Tensor();
    at::Tensor gb32 = want_b ? at::zeros({N}, weight.options().dtype(at::kFloat)) : at::Tensor();
    if (want_w || want_b) {
      for (int64_t r = 0; r < M; r += rows) {
        const int64_t n = std::min(rows, M - r);
        const at::Tensor gy32 = gy.narrow(0, r, n).to(at::kFloat);
        if (want_w) gw32.addmm_(gy32.t(), x2.narrow(0, r, n).to(at::kFloat));
        if (want_b) gb32.add_(gy32.sum(0));
      }
    }
    return {want_x ? gx.view(x.sizes()) : at::Tensor(),
            want_w ? gw32.to(weight.scalar_type()) : at::Tensor(),
            want_b ? gb32.to(weight.scalar_type()) : at::Tensor()};
  }
};

// ---- causal attention (no dropout): LibTorch's CPU flash attention in fp32 ------------------
// Blocks over the batch: each batch entry's attention is independent of the others.
struct Fp32FlashAttention : torch::autograd::Function<Fp32FlashAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v) {
    const int64_t B = q.size(0);
    // (B, H, T, D) laid out as (B, T, H, D), as LibTorch's kernel lays it out: the model's
    // transpose(1, 2).reshape(B, T, C) is then a view, not a copy it would keep.
    at::Tensor out = at::empty({B, q.size(2), q.size(1), q.size(3)}, q.options()).transpose(1, 2);
    at::Tensor lse = at::empty({B, q.size(1), q.size(2)}, q.options().dtype(at::kFloat));  // (B, H, T)
    const int64_t per_entry = 2 * q[0].numel() + 2 * k[0].numel();
    const int64_t rows = std::clamp<int64_t>(kBlockBytes / (4 * per_entry), 1, B);
    for (int64_t b = 0; b < B; b += rows) {
      const int64_t n = std::min(rows, B - b);
      auto [o32, lse32] = at::_scaled_dot_product_flash_attention_for_cpu(
          q.narrow(0, b, n).to(at::kFloat), k.narrow(0, b, n).to(at::kFloat),
          v.narrow(0, b, n).to(at::kFloat), 0.0, /*is_causal=*/true);
      out.narrow(0, b, n).copy_(o32);
      lse.narrow(0, b, n).copy_(lse32);
    }
    ctx->save_for_backward({q, k, v, out, lse});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor &q = s[0], &k = s[1], &v = s[2], &out = s[3], &lse = s[4];
    const at::Tensor& go = grads[0];
    const int64_t B = q.size(0);
    at::Tensor gq = at::empty(q.sizes(), q.options());
    at::Tensor gk = at::empty(k.sizes(), k.options());
    at::Tensor gv = at::empty(v.sizes(), v.options());
    const int64_t per_entry = 4 * q[0].numel() + 4 * k[0].numel();
    const int64_t rows = std::clamp<int64_t>(kBlockBytes / (4 * per_entry), 1, B);
    for (int64_t b = 0; b < B; b += rows) {
      const int64_t n = std::min(rows, B - b);
      auto f32 = [&](const at::Tensor& t) { return t.narrow(0, b, n).to(at::kFloat); };
      auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          f32(go), f32(q), f32(k), f32(v), f32(out), lse.narrow(0, b, n), 0.0, /*is_causal=*/true);
      gq.narrow(0, b, n).copy_(dq);
      gk.narrow(0, b, n).copy_(dk);
      gv.narrow(0, b, n).copy_(dv);
    }
    return {gq, gk, gv};
  }
};

// ---- GELU (tanh), fused: one pass each way over contiguous fp32 ------------------------------
struct FusedGeluTanh : torch::autograd::Function<FusedGeluTanh> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
    gelu_tanh_forward_cpu(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
    ctx->save_for_backward({x});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const at::Tensor dy = grads[0].to(x.scalar_type()).contiguous();
    at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
    gelu_tanh_backward_cpu(x.data_ptr<float>(), dy.data_ptr<float>(), dx.data_ptr<float>(), x.numel());
    return {dx};
  }
};

bool fp32_arithmetic(const at::Tensor& t) {
  return matmul_path(t.scalar_type(), t.device()) == MatmulPath::kFp32Arithmetic;
}

}  // namespace

at::Tensor linear_fp32_arithmetic(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  return Fp32Linear::apply(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
}

at::Tensor causal_attention_fp32_arithmetic(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return Fp32FlashAttention::apply(q, k, v);
}

MatmulPath matmul_path(at::ScalarType dtype, at::Device device) {
  if (!device.is_cpu()) return MatmulPath::kNative;
  if (dtype == at::kHalf) return plan().fp16;
  if (dtype == at::kBFloat16) return plan().bf16;
  return MatmulPath::kNative;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (!fp32_arithmetic(weight) || x.scalar_type() != weight.scalar_type()) {
    return at::linear(x, weight, bias);
  }
  return linear_fp32_arithmetic(x, weight, bias);
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double dropout_p) {
  // With dropout LibTorch takes its math path, which on the CPU computes 16-bit inputs in fp32.
  if (!fp32_arithmetic(q) || dropout_p > 0.0) {
    return at::scaled_dot_product_attention(q, k, v, {}, dropout_p, /*is_causal=*/true,
                                            std::nullopt, /*enable_gqa=*/k.size(1) != q.size(1));
  }
  return causal_attention_fp32_arithmetic(q, k, v);
}

at::Tensor gelu_tanh(const at::Tensor& x) {
  if (!x.device().is_cpu() || x.scalar_type() != at::kFloat || !x.is_contiguous()) {
    return at::gelu(x, "tanh");
  }
  return FusedGeluTanh::apply(x);
}

std::string describe_cpu_math() {
  static const std::string line = describe(facts(), plan());
  return line;
}

}  // namespace memrt::ops
