// memrt/model_shape.h — a model described by its shapes alone (no weights, no LibTorch).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

namespace memrt {

// Everything needed to build a model without its weights.
struct ModelShape {
  std::string arch = "gpt2";  // "gpt2" | "llama"
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_kv_head = 4;      // llama: grouped-query attention (n_head % n_kv_head == 0)
  int64_t d_model = 128;      // C
  int64_t d_ff = 512;         // MLP hidden width
  int64_t vocab_size = 256;   // V
  int64_t n_ctx = 128;        // maximum sequence length (gpt2: learned positions)
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;  // llama
  bool tie_embeddings = true;   // lm_head shares the token embedding
  // Dropout probabilities while training, as Hugging Face names them (0: none, the default).
  // GPT-2: embd_pdrop after the embedding sum, attn_pdrop on the attention weights, resid_pdrop
  // after each block's attention and MLP projections. Llama: attention_dropout is attn_pdrop;
  // Hugging Face's Llama has no other dropout.
  double embd_pdrop = 0.0;
  double attn_pdrop = 0.0;
  double resid_pdrop = 0.0;

  int64_t head_dim() const { return d_model / n_head; }
};

// What is wrong with a shape, if anything: the field (as named in a train.yaml `model:` block)
// and why. The config loader and the model builder both report through it.
struct ShapeProblem {
  std::string field;
  std::string message;
  explicit operator bool() const { return !field.empty(); }
};

inline ShapeProblem find_shape_problem(const ModelShape& s) {
  if (s.arch != "gpt2" && s.arch != "llama")
    return {"arch", "is \"" + s.arch + "\"; memrt's built-in architectures are \"gpt2\" and \"llama\""};
  const std::pair<const char*, int64_t> sizes[] = {
      {"n_layer", s.n_layer}, {"n_head", s.n_head}, {"n_kv_head", s.n_kv_head}, {"d_model", s.d_model},
      {"d_ff", s.d_ff}, {"vocab_size", s.vocab_size}, {"n_ctx", s.n_ctx}};
  for (const auto& [field, v] : sizes)
    if (v < 1) return {field, "must be positive, got " + std::to_string(v)};
  if (s.d_model % s.n_head != 0)
    return {"n_head", "is " + std::to_string(s.n_head) + ", which does not divide d_model " +
                          std::to_string(s.d_model)};
  if (s.n_head % s.n_kv_head != 0)
    return {"n_kv_head", "is " + std::to_string(s.n_kv_head) + ", which does not divide n_head " +
                             std::to_string(s.n_head)};
  if (s.arch == "gpt2" && s.n_kv_head != s.n_head)
    return {"n_kv_head", "differs from n_head, but GPT-2 has no grouped-query attention: use "
                         "arch: llama or remove it"};
  if (s.arch == "llama" && s.head_dim() % 2 != 0)
    return {"d_model", "gives an odd head size (d_model / n_head = " + std::to_string(s.head_dim()) +
                           "); rotary embeddings need an even one"};
  if (!(s.norm_eps > 0.0)) return {"norm_eps", "must be positive"};
  if (s.arch == "llama" && !(s.rope_theta > 0.0)) return {"rope_theta", "must be positive"};
  const std::pair<const char*, double> drops[] = {
      {"embd_pdrop", s.embd_pdrop}, {s.arch == "llama" ? "attention_dropout" : "attn_pdrop", s.attn_pdrop},
      {"resid_pdrop", s.resid_pdrop}};
  for (const auto& [field, p] : drops)
    if (!(p >= 0.0 && p < 1.0))
      return {field, "is " + std::to_string(p) + "; a dropout probability must be in [0, 1)"};
  if (s.arch == "llama" && (s.embd_pdrop != 0.0 || s.resid_pdrop != 0.0))
    return {s.embd_pdrop != 0.0 ? "embd_pdrop" : "resid_pdrop",
            "is a GPT-2 dropout; Llama has attention dropout only (attention_dropout)"};
  return {};
}

}  // namespace memrt
