// memrt/model_shape.h — a model described by its shapes alone (no weights, no LibTorch).
#pragma once

#include <cstdint>
#include <string>

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

  int64_t head_dim() const { return d_model / n_head; }
};

}  // namespace memrt
