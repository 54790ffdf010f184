// memrt/ops.h: linear and causal attention, with fp32 arithmetic on 16-bit storage where the
// processor has no 16-bit GEMM (see cpu_math.h for the choice); the fused GELU; the LM head with
// its cross-entropy a chunk of rows at a time.
//
// The fp32-arithmetic nodes save exactly what LibTorch's own 16-bit kernels save (linear: x and
// W; flash attention: q, k, v, the output and the fp32 log-sum-exp), so forward keeps the same
// bytes either way. The fp32 copies they make are transient and bounded: rows (or batch entries)
// are converted a block at a time, the block sized to kBlockBytes; the linear's blocks live in a
// per-thread scratch outside the allocator, so it allocates what LibTorch's kernel allocates.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <ATen/record_function.h>
#include <torch/autograd.h>

#include "memrt/error.h"
#include "memrt/ops.h"
#include "ops/activations_cpu.h"
#include "ops/attention_cpu.h"
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

// ---- linear -----------------------------------------------------------------------------------
// The fp32 copies live in a per-thread scratch outside the allocator (like the BLAS's own packing
// buffers), in blocks of at most kBlockBytes each: the allocator sees exactly what LibTorch's
// 16-bit kernel allocates (y; gx, gW, gb), so the memory estimate holds on either path.
//   y[M,N]  = x[M,K] W[N,K]^T + b        per block of W's rows, per block of x's rows
//   gx[M,K] = gy[M,N] W[N,K]             per block of gy's rows, summed over blocks of W's rows
//   gW[N,K] = gy^T x, gb[N] = sum gy     per block of W's rows, summed over blocks of rows of x
// Each block of an output is accumulated in fp32 and rounded once.

// Per-thread fp32 scratch of five regions, grown as needed and kept for the next call.
struct Scratch {
  at::Tensor a, b, c, d, e;  // views of `storage`
};
Scratch scratch(int64_t a, int64_t b, int64_t c, int64_t d, int64_t e = 0) {
  thread_local std::vector<float> storage;
  const size_t need = static_cast<size_t>(a + b + c + d + e);
  if (storage.size() < need) {
    storage.clear();
    storage.shrink_to_fit();
    storage.resize(need);
  }
  float* p = storage.data();
  auto view = [&](int64_t n) {
    at::Tensor t = at::from_blob(p, {n}, at::TensorOptions().dtype(at::kFloat));
    p += n;
    return t;
  };
  Scratch s;
  s.a = view(a);
  s.b = view(b);
  s.c = view(c);
  s.d = view(d);
  s.e = view(e);
  return s;
}

// Rows per block of W (each K wide) and of x or gy (each K or nb wide), each block within
// kBlockBytes of fp32 (at least kMinBlockRows rows, or all of them).
std::pair<int64_t, int64_t> linear_blocks(int64_t M, int64_t N, int64_t K) {
  const int64_t values = kBlockBytes / 4;
  const int64_t nb = std::clamp<int64_t>(values / std::max<int64_t>(K, 1), std::min<int64_t>(kMinBlockRows, N), N);
  const int64_t mb = std::clamp<int64_t>(values / std::max(K, nb), std::min<int64_t>(kMinBlockRows, M), std::max<int64_t>(M, 1));
  return {nb, mb};
}

// y (M, N) = x (M, K) w (N, K)^T + b in fp32 blocks (with `accumulate`, y += x w^T + b, each block
// of y rounded once); any strides (copy_ gathers them).
void fp32_linear_into(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                      bool accumulate = false) {
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0);
  const auto [nb, mb] = linear_blocks(M, N, K);
  const Scratch s = scratch(nb * K, mb * K, mb * nb, nb);
  for (int64_t n0 = 0; n0 < N; n0 += nb) {
    const int64_t n = std::min(nb, N - n0);
    const at::Tensor w32 = s.a.narrow(0, 0, n * K).view({n, K}).copy_(w.narrow(0, n0, n));
    const at::Tensor b32 = bias.defined() ? s.d.narrow(0, 0, n).copy_(bias.narrow(0, n0, n)) : at::Tensor();
    for (int64_t m0 = 0; m0 < M; m0 += mb) {
      const int64_t m = std::min(mb, M - m0);
      const at::Tensor x32 = s.b.narrow(0, 0, m * K).view({m, K}).copy_(x.narrow(0, m0, m));
      at::Tensor y32 = s.c.narrow(0, 0, m * n).view({m, n});
      if (accumulate) {
        y32.copy_(y.narrow(0, m0, m).narrow(1, n0, n));
        y32.addmm_(x32, w32.t());
      } else {
        at::mm_out(y32, x32, w32.t());
      }
      if (b32.defined()) y32.add_(b32);
      y.narrow(0, m0, m).narrow(1, n0, n).copy_(y32);
    }
  }
}

struct Fp32Linear : torch::autograd::Function<Fp32Linear> {
  // The bias is optional: an undefined tensor is no autograd input.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias_opt) {
    const at::Tensor bias = bias_opt.value_or(at::Tensor());
    const int64_t K = weight.size(1), N = weight.size(0);
    const at::Tensor x2 = x.reshape({-1, K});
    at::Tensor y = at::empty({x2.size(0), N}, x.options());
    fp32_linear_into(y, x2, weight, bias);
    ctx->save_for_backward({x, weight});
    ctx->saved_data["has_bias"] = bias.defined();
    auto out_shape = x.sizes().vec();
    out_shape.back() = N;
    return y.view(out_shape);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const int64_t K = w.size(1), N = w.size(0);
    const at::Tensor gy = grads[0].reshape({-1, N});
    const at::Tensor x2 = x.reshape({-1, K});
    const int64_t M = gy.size(0);
    const bool want_x = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    const bool want_b = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2);
    const auto [nb, mb] = linear_blocks(M, N, K);
    // a: a block of W (or of gW's fp32 sums), b: of x (or of gx's sums), c: of gy, d: of gb's sums,
    // e: ones, which sum gy's rows into gb as one matrix-vector product.
    const Scratch s = scratch(nb * K, mb * K, mb * nb, nb, want_b ? mb : 0);
    if (want_b) s.e.fill_(1.0f);

    at::Tensor gx;
    if (want_x) {
      gx = at::empty({M, K}, x.options());
      for (int64_t m0 = 0; m0 < M; m0 += mb) {
        const int64_t m = std::min(mb, M - m0);
        at::Tensor gx32 = s.b.narrow(0, 0, m * K).view({m, K}).zero_();
        for (int64_t n0 = 0; n0 < N; n0 += nb) {
          const int64_t n = std::min(nb, N - n0);
          const at::Tensor w32 = s.a.narrow(0, 0, n * K).view({n, K}).copy_(w.narrow(0, n0, n));
          const at::Tensor gy32 = s.c.narrow(0, 0, m * n).view({m, n}).copy_(gy.narrow(0, m0, m).narrow(1, n0, n));
          gx32.addmm_(gy32, w32);
        }
        gx.narrow(0, m0, m).copy_(gx32);
      }
    }
    at::Tensor gw = want_w ? at::empty({N, K}, w.options()) : at::Tensor();
    at::Tensor gb = want_b ? at::empty({N}, w.options()) : at::Tensor();
    if (want_w || want_b) {
      for (int64_t n0 = 0; n0 < N; n0 += nb) {
        const int64_t n = std::min(nb, N - n0);
        at::Tensor gw32 = s.a.narrow(0, 0, n * K).view({n, K}).zero_();
        at::Tensor gb32 = s.d.narrow(0, 0, n).zero_();
        for (int64_t m0 = 0; m0 < M; m0 += mb) {
          const int64_t m = std::min(mb, M - m0);
          const at::Tensor gy32 = s.c.narrow(0, 0, m * n).view({m, n}).copy_(gy.narrow(0, m0, m).narrow(1, n0, n));
          if (want_w) gw32.addmm_(gy32.t(), s.b.narrow(0, 0, m * K).view({m, K}).copy_(x2.narrow(0, m0, m)));
          if (want_b) gb32.addmv_(gy32.t(), s.e.narrow(0, 0, m));
        }
        if (want_w) gw.narrow(0, n0, n).copy_(gw32);
        if (want_b) gb.narrow(0, n0, n).copy_(gb32);
      }
    }
    return {want_x ? gx.view(x.sizes()) : at::Tensor(), gw, gb};
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

// ---- causal attention (no dropout): memrt's CPU kernel (attention_cpu.h) -----------------------
// It saves what LibTorch's flash kernel saves (q, k, v, out and the fp32 log-sum-exp) and lays
// `out` out as (B, T, H, D), so the model's transpose(1, 2).reshape(B, T, C) is a view.
struct CpuCausalAttention : torch::autograd::Function<CpuCausalAttention> {
  // `positions`: a packed layout's (check_packed_positions), or none; saved as a reference to the
  // caller's tensor, no copy.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const std::optional<at::Tensor>& positions) {
    RECORD_FUNCTION("memrt::causal_attention", std::vector<c10::IValue>());
    at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).transpose(1, 2);
    at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
    causal_attention_forward_cpu(q, k, v, positions.value_or(at::Tensor()), out, lse);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["positions"] = positions;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("memrt::causal_attention_backward", std::vector<c10::IValue>());
    const auto s = ctx->get_saved_variables();
    const at::Tensor &q = s[0], &k = s[1], &v = s[2];
    const at::Tensor positions = ctx->saved_data["positions"].toOptional<at::Tensor>().value_or(at::Tensor());
    const at::Tensor go = grads[0].stride(3) == 1 ? grads[0] : grads[0].contiguous();
    at::Tensor gq = at::empty(q.sizes(), q.options()), gk = at::empty(k.sizes(), k.options()),
               gv = at::empty(v.sizes(), v.options());
    causal_attention_backward_cpu(q, k, v, positions, s[3], s[4], go.to(q.scalar_type()), gq, gk, gv);
    return {gq, gk, gv, at::Tensor()};
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

// y += x w^T (y (M, N), x (M, K), w (N, K), any strides), by the path linear() takes.
void linear_accumulate(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w) {
  if (fp32_arithmetic(w)) {
    fp32_linear_into(y, x, w, {}, /*accumulate=*/true);
  } else {
    at::Tensor out = y;
    at::addmm_out(out, y, x, w.t());
  }
}

// ---- the LM head and its cross-entropy, a chunk of rows at a time ----------------------------
// The summed loss; with gx / gw defined, the gradients of that sum with respect to x and weight
// written into them (gw accumulated: zero it first).
double linear_cross_entropy_chunks(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                   int64_t ignore_index, const at::Tensor& gx, const at::Tensor& gw) {
  const int64_t N = x.size(0), V = weight.size(0);
  const int64_t chunk = linear_cross_entropy_chunk_rows(N, V);
  const bool fp32 = x.scalar_type() == at::kFloat;
  const at::Tensor t = targets.contiguous();
  const int64_t* target = t.data_ptr<int64_t>();
  // The chunk's logits in x's dtype (a 16-bit product rounds them, as at::linear does), then in
  // fp32, where the softmax turns them into their gradient; that gradient in x's dtype again for
  // the two products.
  at::Tensor logits = at::empty({chunk, V}, x.options());
  at::Tensor logits32 = fp32 ? logits : at::empty({chunk, V}, x.options().dtype(at::kFloat));
  at::Tensor loss = at::empty({chunk}, x.options().dtype(at::kFloat));
  double sum = 0.0;
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t n = std::min(chunk, N - r0);
    const at::Tensor xs = x.narrow(0, r0, n);
    at::Tensor l = logits.narrow(0, 0, n), l32 = logits32.narrow(0, 0, n);
    linear_into(l, xs, weight);
    if (!fp32) l32.copy_(l);
    float* row_loss = loss.data_ptr<float>();
    cross_entropy_rows_cpu(l32.data_ptr<float>(), target + r0, row_loss, n, V, ignore_index);
    for (int64_t r = 0; r < n; ++r) sum += row_loss[r];  // in double, allocating nothing
    if (!gx.defined() && !gw.defined()) continue;
    if (!fp32) l.copy_(l32);
    if (gx.defined()) linear_into(gx.narrow(0, r0, n), l, weight.t());
    if (gw.defined()) linear_accumulate(gw, l.t(), xs.t());
  }
  return sum;
}

// The loss is the graph's last node: forward computes its gradients, backward scales them by the
// incoming scalar (the loss scale, 1 / the tokens counted) in place and hands them on.
struct LinearCrossEntropy : torch::autograd::Function<LinearCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& targets, int64_t ignore_index) {
    const at::Tensor gx = x.requires_grad() ? at::empty(x.sizes(), x.options()) : at::Tensor();
    const at::Tensor gw = weight.requires_grad() ? at::zeros(weight.sizes(), weight.options()) : at::Tensor();
    const double sum = linear_cross_entropy_chunks(x, weight, targets, ignore_index, gx, gw);
    ctx->saved_data["gx"] = gx;
    ctx->saved_data["gw"] = gw;
    return at::scalar_tensor(sum, x.options().dtype(at::kFloat));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor gx = ctx->saved_data["gx"].toTensor(), gw = ctx->saved_data["gw"].toTensor();
    ctx->saved_data.clear();  // the only references: handed on, not kept beside their products
    const at::Tensor& scale = grads[0];
    if (gx.defined()) gx.mul_(scale);
    if (gw.defined()) gw.mul_(scale);
    return {gx, gw, at::Tensor(), at::Tensor()};
  }
};

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

void linear_into(const at::Tensor& y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (fp32_arithmetic(weight) && x.scalar_type() == weight.scalar_type()) {
    fp32_linear_into(y, x, weight, bias);
  } else {
    at::Tensor out = y;  // a handle on y's storage: mm_out writes through it
    if (bias.defined()) {
      at::addmm_out(out, bias, x, weight.t());
    } else {
      at::mm_out(out, x, weight.t());
    }
  }
}

namespace {

// Causal attention over one whole row each: memrt's kernel where it takes the inputs, else LibTorch's.
at::Tensor causal_attention_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p) {
  if (dropout_p == 0.0 && causal_attention_cpu_takes(q, k, v)) return CpuCausalAttention::apply(q, k, v, std::nullopt);
  // With dropout LibTorch takes its math path, which on the CPU computes 16-bit inputs in fp32.
  if (!fp32_arithmetic(q) || dropout_p > 0.0) {
    return at::scaled_dot_product_attention(q, k, v, {}, dropout_p, /*is_causal=*/true,
                                            std::nullopt, /*enable_gqa=*/k.size(1) != q.size(1));
  }
  return causal_attention_fp32_arithmetic(q, k, v);
}

}  // namespace

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p,
                            const at::Tensor& positions) {
  if (!positions.defined()) return causal_attention_rows(q, k, v, dropout_p);
  const int64_t B = q.size(0), T = q.size(2);
  const at::Tensor pos = positions.device().is_cpu() ? positions : positions.cpu();
  // The kernel checks the positions itself (check_operands).
  if (dropout_p == 0.0 && causal_attention_cpu_takes(q, k, v)) return CpuCausalAttention::apply(q, k, v, std::optional<at::Tensor>(pos));
  // Elsewhere span by span, each sample's attention on its own, the spans' outputs joined.
  check_packed_positions(pos, B, T);
  const int64_t* p = pos.data_ptr<int64_t>();
  std::vector<at::Tensor> rows;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<at::Tensor> spans;
    for (int64_t begin = 0; begin < T;) {
      int64_t end = begin + 1;
      while (end < T && p[b * T + end] != 0) ++end;
      auto span = [&](const at::Tensor& x) { return x.narrow(0, b, 1).narrow(2, begin, end - begin); };
      spans.push_back(causal_attention_rows(span(q), span(k), span(v), dropout_p));  // (1, H, len, D)
      begin = end;
    }
    rows.push_back(spans.size() == 1 ? spans[0] : at::cat(spans, 2));
  }
  return B == 1 ? rows[0] : at::cat(rows, 0);  // (B, H, T, D)
}

int64_t linear_cross_entropy_chunk_rows(int64_t rows, int64_t vocab) {
  // fp32 logits per chunk. Each chunk reads the whole weight twice (its logits, its input's
  // gradient), so chunks much smaller than this lose more to that traffic and to the GEMMs' short
  // sides than they save (bench/RESULTS.md, "The chunked head").
  constexpr int64_t kLogitBytes = int64_t{32} << 20;
  return std::clamp<int64_t>(kLogitBytes / (4 * std::max<int64_t>(vocab, 1)), std::min<int64_t>(kMinBlockRows, rows),
                             std::max<int64_t>(rows, 1));
}

at::Tensor linear_cross_entropy_sum(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                    int64_t ignore_index) {
  RECORD_FUNCTION("memrt::linear_cross_entropy_sum", std::vector<c10::IValue>());
  if (x.dim() != 2 || weight.dim() != 2 || x.size(1) != weight.size(1) || targets.dim() != 1 ||
      targets.size(0) != x.size(0))
    throw Error("linear_cross_entropy_sum: expected x (N, C), weight (V, C) and targets (N), got " +
                c10::str(x.sizes(), ", ", weight.sizes(), " and ", targets.sizes()));
  if (!x.device().is_cpu() || !weight.device().is_cpu())
    throw Error("linear_cross_entropy_sum: the chunked head runs on the CPU only, and x is on " +
                x.device().str() + ": set chunked_cross_entropy: false");
  if (x.scalar_type() != weight.scalar_type() || !at::isFloatingType(x.scalar_type()) ||
      targets.scalar_type() != at::kLong)
    throw Error("linear_cross_entropy_sum: expected floating x and weight of one dtype and int64 targets, got " +
                std::string(c10::toString(x.scalar_type())) + ", " + c10::toString(weight.scalar_type()) + " and " +
                c10::toString(targets.scalar_type()));
  if (const at::Tensor t = targets.masked_select(targets.ne(ignore_index)); t.numel() > 0) {
    const int64_t lo = t.min().item<int64_t>(), hi = t.max().item<int64_t>();
    if (lo < 0 || hi >= weight.size(0))
      throw Error("linear_cross_entropy_sum: target " + std::to_string(lo < 0 ? lo : hi) +
                  " is outside the vocabulary [0, " + std::to_string(weight.size(0)) + ")");
  }
  if (!at::GradMode::is_enabled() || (!x.requires_grad() && !weight.requires_grad())) {
    at::NoGradGuard no_grad;
    const double sum = linear_cross_entropy_chunks(x, weight, targets, ignore_index, {}, {});
    return at::scalar_tensor(sum, x.options().dtype(at::kFloat));
  }
  return LinearCrossEntropy::apply(x, weight, targets, ignore_index);
}

at::Tensor gelu_tanh(const at::Tensor& x) {
  if (!x.device().is_cpu() || x.scalar_type() != at::kFloat || !x.is_contiguous()) {
    return at::gelu(x, "tanh");
  }
  RECORD_FUNCTION("memrt::gelu_tanh", std::vector<c10::IValue>());
  return FusedGeluTanh::apply(x);
}

std::string describe_cpu_math() {
  static const std::string line = describe(facts(), plan());
  return line;
}

}  // namespace memrt::ops
