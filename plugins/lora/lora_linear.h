// plugins/lora/lora_linear.h — a LoRA adapter around one linear layer, as PEFT computes it
// (docs/lora.md, "What PEFT computes"):
//
//   y = base(x) + lora_B(lora_A(dropout(x))) · scaling       scaling = alpha / r (rsLoRA: alpha / sqrt(r))
//
// and with DoRA (use_dora), PEFT's DoraLinearLayer: a magnitude m (out) and, for W the base's
// (out, in) weight,
//
//   n     = ||W + scaling · B A||_row, detached (no gradient, as the DoRA paper's section 4.3)
//   s     = m / n
//   y     = base(x) + (s - 1) · x_d W^T + s · lora_B(lora_A(x_d)) · scaling
//
// where x_d = dropout(x), and x_d W^T is base(x) less its bias when no dropout applies. W is the
// base's "weight" parameter when it is a floating tensor, else (a 4-bit base: QDoRA) read through
// memrt::DenseWeight, a tile of rows at a time: n never needs all of W + scaling · B A at once.
//
// `base` is any layer of in -> out features (nn::Linear, plugins/quant's Linear4bit: the lora plugin
// sees only its forward and its tensors). The wrapper registers the base's own parameters and
// buffers under their own names — the same tensors, so the parameter store's set_data reaches the
// base's forward — and adds "lora_A.weight" (r, in) and "lora_B.weight" (out, r): in a block,
// "<t>.weight" keeps its name and "<t>.lora_A.weight" is PEFT's key without "base_model.model.".
#pragma once

#include <cstdint>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <memrt/model.h>

namespace memrt::lora {

// PEFT's init_lora_weights, of the values memrt builds (docs/lora.md, "Initialisation"): those that
// set the adapters alone, and two that take them from the base weight and leave the base its
// residual; the others (CorDA, LoftQ, EVA, ...) read data or quantize and are not built.
enum class LoraInit {
  kDefault,     // true: A kaiming-uniform with a = sqrt(5), B zeros
  kGaussian,    // "gaussian": A normal(0, 1/r), B zeros
  kOrthogonal,  // "orthogonal": A and B from the odd and even rows of one random orthogonal r x r, B A = 0
  kLinear,      // false: both left at nn.Linear's init (B non-zero: the layer no longer starts as its base)
  kPissa,       // "pissa": A, B from W's r principal singular triplets; the base keeps W - scaling · B A
  kOlora,       // "olora": A, B from the QR decomposition of W; the base keeps W - scaling · B A
};

// Whether `init` takes the adapters from the base weight (and changes the base).
inline bool init_from_base(LoraInit init) { return init == LoraInit::kPissa || init == LoraInit::kOlora; }

struct LoraOptions {
  int64_t r = 8;          // PEFT's defaults
  double alpha = 8.0;
  double dropout = 0.0;   // on A's input only
  bool rslora = false;
  bool dora = false;      // DoRA: "lora_magnitude_vector" (out)
  LoraInit init = LoraInit::kDefault;
};

// alpha / r, or alpha / sqrt(r) with rsLoRA.
double lora_scaling(const LoraOptions& options);

// What the lora plugin takes from a base weight while it is whole, in on_block_ready (under ZeRO-3
// the weight is a placeholder by the time it is wrapped); undefined members are not needed.
struct FromBase {
  at::Tensor norm;  // DoRA: the base's row norms ||W||_row, fp32
  at::Tensor a, b;  // PiSSA / OLoRA: the initial A0 (r, in) and B0 (out, r), fp32
};

// PiSSA's and OLoRA's start (PEFT's pissa_init and olora_init) from a base weight `w` (out, in) of
// any floating dtype, computed in fp32: A0 and B0 in `from` (a, b), and the residual
// W - scaling · B0 A0 in fp32, returned. options.init says which; a rank above min(out, in) is an
// error.
at::Tensor init_from_weight(const at::Tensor& w, const LoraOptions& options, FromBase& from);

class LoraLinearImpl : public torch::nn::Module {
 public:
  // `from_base`: what was taken from the base while its weight was whole — DoRA's norms (undefined:
  // computed from the base here) and PiSSA's / OLoRA's A0 and B0 (required by those inits).
  LoraLinearImpl(torch::nn::AnyModule base, int64_t in_features, int64_t out_features, LoraOptions options,
                 FromBase from_base = {});

  at::Tensor forward(const at::Tensor& x);

  // PEFT's init_lora_weights (options().init), from the default generator in PEFT's order of draws:
  // true, A kaiming-uniform with a = sqrt(5) (uniform in ±1/sqrt(in)) and B zeros, so that the
  // adapter starts as the identity on the base's output; "gaussian", A normal(0, 1/r); "orthogonal",
  // B A = 0 from two orthogonal halves; false, A and B as nn.Linear made them; "pissa" and "olora",
  // the A0 and B0 given (init_from_weight). With DoRA, m = ||W + scaling · B A||_row (= ||W||_row:
  // B A is zero, up to rounding for "orthogonal").
  void reset_parameters();

  // DoRA's norm ||W + scaling · B A||_row (out) in `dtype`, without gradient, made a tile of rows at
  // a time (W's rows through base_rows()).
  at::Tensor weight_norm(at::ScalarType dtype) const;

  double scaling() const { return scaling_; }
  const LoraOptions& options() const { return options_; }

  // memrt's projection (ops::linear): 16-bit adapters at speed on CPUs without 16-bit GEMM too.
  memrt::Linear lora_A{nullptr};
  memrt::Linear lora_B{nullptr};
  at::Tensor lora_magnitude_vector;  // DoRA's m (out); undefined without DoRA

 private:
  // Rows [r0, r1) of the base's W in `dtype`, no gradient: its floating "weight", or through
  // memrt::DenseWeight (a 4-bit base); another base is an error naming it.
  at::Tensor base_rows(int64_t r0, int64_t r1, at::ScalarType dtype) const;
  at::Tensor base_weight_parameter() const;  // the base's floating "weight", or undefined
  at::Tensor base_bias() const;              // the base's bias, or undefined
  torch::nn::AnyModule base_;
  LoraOptions options_;
  FromBase from_base_;  // dropped once used
  double scaling_;
  int64_t in_features_;
};
TORCH_MODULE(LoraLinear);

}  // namespace memrt::lora
