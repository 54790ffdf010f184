// GPT-2: token + learned position embeddings, pre-LayerNorm blocks (causal self-attention with a
// fused qkv projection, GELU-tanh MLP), final LayerNorm, lm_head tied to the token embedding.
#include <cmath>

#include "memrt/error.h"
#include "models/decoder.h"

namespace memrt {
namespace {

class Gpt2Block : public DecoderBlock {
 public:
  Gpt2Block(const ModelShape& s, int64_t index, std::shared_ptr<const SequenceLayout> layout)
      : DecoderBlock("transformer.h." + std::to_string(index)),
        n_head_(s.n_head), attn_pdrop_(s.attn_pdrop), resid_pdrop_(s.resid_pdrop), layout_(std::move(layout)) {
    const int64_t C = s.d_model;
    auto ln = [&](const char* name) {
      return register_module(name, torch::nn::LayerNorm(
                                       torch::nn::LayerNormOptions({C}).eps(s.norm_eps)));  // (C)
    };
    ln_1_ = ln("ln_1");
    auto attn = register_module("attn", std::make_shared<torch::nn::Module>("attn"));
    c_attn_ = &add_linear(*attn, "attn", "c_attn", C, 3 * C, true);  // (3C, C)
    attn_proj_ = &add_linear(*attn, "attn", "c_proj", C, C, true);   // (C, C)
    ln_2_ = ln("ln_2");
    auto mlp = register_module("mlp", std::make_shared<torch::nn::Module>("mlp"));
    c_fc_ = &add_linear(*mlp, "mlp", "c_fc", C, s.d_ff, true);        // (F, C)
    mlp_proj_ = &add_linear(*mlp, "mlp", "c_proj", s.d_ff, C, true);  // (C, F)
  }

  at::Tensor forward(const at::Tensor& x) override {  // (B, T, C) -> (B, T, C)
    const bool train = is_training();
    at::Tensor h = x + train_dropout(attention(ln_1_(x)), resid_pdrop_, train);
    at::Tensor m = mlp_proj_->forward(ops::gelu_tanh(c_fc_->forward(ln_2_(h))));  // (B, T, C)
    return h + train_dropout(m, resid_pdrop_, train);
  }

 private:
  at::Tensor attention(const at::Tensor& x) {  // (B, T, C)
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / n_head_;
    at::Tensor qkv = c_attn_->forward(x);  // (B, T, 3C)
    auto heads = [&](const at::Tensor& t) {
      return t.view({B, T, n_head_, hd}).transpose(1, 2);  // (B, nh, T, hd)
    };
    auto parts = qkv.split(C, -1);
    at::Tensor y = ops::causal_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]),
                                         is_training() ? attn_pdrop_ : 0.0, layout_->positions);  // (B, nh, T, hd)
    return attn_proj_->forward(y.transpose(1, 2).reshape({B, T, C}));  // (B, T, C)
  }

  int64_t n_head_;
  double attn_pdrop_, resid_pdrop_;
  std::shared_ptr<const SequenceLayout> layout_;
  torch::nn::LayerNorm ln_1_{nullptr}, ln_2_{nullptr};
  torch::nn::AnyModule *c_attn_, *attn_proj_, *c_fc_, *mlp_proj_;
};

class Gpt2LM : public DecoderLM {
 public:
  explicit Gpt2LM(const ModelShape& s) : DecoderLM(s) {
    transformer_ = register_module("transformer", std::make_shared<torch::nn::Module>("transformer"));
    // (V, C), made with no rows: build_model allocates it (DecoderLM, decoder.h).
    wte_ = transformer_->register_module(
        "wte", torch::nn::Embedding(torch::nn::EmbeddingOptions(0, s.d_model)));
    wpe_ = transformer_->register_module(
        "wpe", torch::nn::Embedding(s.n_ctx, s.d_model));  // (n_ctx, C)
    layers_ = transformer_->register_module("h", torch::nn::ModuleList());
  }

  std::shared_ptr<Block> new_block(int64_t index) override {
    return std::make_shared<Gpt2Block>(shape_, index, layout_);
  }

  void finish() override {
    ln_f_ = transformer_->register_module(
        "ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({shape_.d_model})
                                         .eps(shape_.norm_eps)));  // (C)
    if (!shape_.tie_embeddings)
      lm_head_ = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(
                                                 shape_.d_model, 0)
                                                 .bias(false)));  // (V, C), allocated by build_model
  }

  NamedTensors embedding_parameters() override {
    return {{"transformer.wte.weight", wte_->weight}, {"transformer.wpe.weight", wpe_->weight}};
  }
  NamedTensors final_parameters() override {
    NamedTensors p{{"transformer.ln_f.weight", ln_f_->weight},
                   {"transformer.ln_f.bias", ln_f_->bias}};
    if (lm_head_) p.emplace_back("lm_head.weight", lm_head_->weight);
    return p;
  }

  at::Tensor embed(const at::Tensor& tokens) override {  // (B, T) int64 -> (B, T, C)
    const int64_t T = tokens.size(1);
    if (T > shape_.n_ctx)
      throw Error("gpt2: sequence length " + std::to_string(T) + " exceeds the model's context (" +
                  "n_ctx " + std::to_string(shape_.n_ctx) + "); lower block_size");
    const at::Tensor pos = layout_->packed() ? layout_->positions                              // (B, T)
                                             : at::arange(T, tokens.options().dtype(at::kLong));  // (T)
    // wte before wpe, as registered (one statement each: the order of an operator's operands is the
    // compiler's), so backward hands wpe's gradient over first: ZeRO's bucket order (llama.cpp).
    const at::Tensor token_embedding = wte_(tokens);                                  // (B, T, C)
    return train_dropout(token_embedding + wpe_(pos), shape_.embd_pdrop, is_training());  // (B, T, C)
  }

  at::Tensor final_norm(const at::Tensor& hidden) override { return ln_f_(hidden); }
  const at::Tensor& head_weight() const override { return lm_head_ ? lm_head_->weight : wte_->weight; }

 private:
  std::shared_ptr<torch::nn::Module> transformer_;
  torch::nn::Embedding wte_{nullptr}, wpe_{nullptr};
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear lm_head_{nullptr};
};

}  // namespace

std::shared_ptr<DecoderLM> make_gpt2(const ModelShape& shape) {
  return std::make_shared<Gpt2LM>(shape);
}

}  // namespace memrt
