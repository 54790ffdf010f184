// Llama: token embedding, pre-RMSNorm blocks (causal self-attention with rotary position
// embeddings and grouped-query attention, SwiGLU MLP), final RMSNorm, lm_head (tied or not).
#include "models/decoder.h"

namespace memrt {
namespace {

// HF's rotate_half: (x1, x2) -> (-x2, x1) over the two halves of the last dimension.
at::Tensor rotate_half(const at::Tensor& x) {  // (..., D)
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

class LlamaBlock : public DecoderBlock {
 public:
  LlamaBlock(const ModelShape& s, int64_t index, std::shared_ptr<RopeCache> rope,
             std::shared_ptr<const SequenceLayout> layout)
      : DecoderBlock("model.layers." + std::to_string(index)),
        n_head_(s.n_head), n_kv_head_(s.n_kv_head), head_dim_(s.head_dim()),
        attention_dropout_(s.attn_pdrop), rope_(std::move(rope)), layout_(std::move(layout)) {
    // Registered in the order forward uses them (Hugging Face registers the two norms last), so
    // that backward hands their gradients over in reverse registration order, the order ZeRO
    // reduces its buckets in: a bucket holding the input norm, whose gradient comes last, is then
    // reduced after the block's matrices instead of holding them back (docs/zero.md).
    const int64_t C = s.d_model, kv = s.n_kv_head * s.head_dim();
    input_layernorm_ = register_module("input_layernorm", RMSNorm(C, s.norm_eps));
    auto attn = register_module("self_attn", std::make_shared<torch::nn::Module>("self_attn"));
    q_proj_ = &add_linear(*attn, "self_attn", "q_proj", C, C, false);   // (C, C)
    k_proj_ = &add_linear(*attn, "self_attn", "k_proj", C, kv, false);  // (kv*hd, C)
    v_proj_ = &add_linear(*attn, "self_attn", "v_proj", C, kv, false);  // (kv*hd, C)
    o_proj_ = &add_linear(*attn, "self_attn", "o_proj", C, C, false);   // (C, C)
    post_attention_layernorm_ = register_module("post_attention_layernorm", RMSNorm(C, s.norm_eps));
    auto mlp = register_module("mlp", std::make_shared<torch::nn::Module>("mlp"));
    gate_proj_ = &add_linear(*mlp, "mlp", "gate_proj", C, s.d_ff, false);  // (F, C)
    up_proj_ = &add_linear(*mlp, "mlp", "up_proj", C, s.d_ff, false);      // (F, C)
    down_proj_ = &add_linear(*mlp, "mlp", "down_proj", s.d_ff, C, false);  // (C, F)
  }

  at::Tensor forward(const at::Tensor& x) override {  // (B, T, C) -> (B, T, C)
    at::Tensor h = x + attention(input_layernorm_(x));
    at::Tensor n = post_attention_layernorm_(h);
    // gate before up, as registered (one statement each: the order of a call's arguments is the
    // compiler's), so backward reaches up's gradient first, then gate's.
    at::Tensor gate = at::silu(gate_proj_->forward(n));
    at::Tensor m = down_proj_->forward(gate * up_proj_->forward(n));
    return h + m;  // (B, T, C)
  }

 private:
  at::Tensor attention(const at::Tensor& x) {  // (B, T, C)
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
    at::Tensor q = q_proj_->forward(x).view({B, T, n_head_, head_dim_}).transpose(1, 2);  // (B, nh, T, hd)
    at::Tensor k = k_proj_->forward(x).view({B, T, n_kv_head_, head_dim_}).transpose(1, 2);  // (B, nkv, T, hd)
    at::Tensor v = v_proj_->forward(x).view({B, T, n_kv_head_, head_dim_}).transpose(1, 2);  // (B, nkv, T, hd)
    auto [cos, sin] = rope_->get(T, q.options(), *layout_);  // (T, hd) each; packed: (B, 1, T, hd)
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    at::Tensor y = ops::causal_attention(q, k, v, is_training() ? attention_dropout_ : 0.0, layout_->positions);  // (B, nh, T, hd)
    return o_proj_->forward(y.transpose(1, 2).reshape({B, T, C}));  // (B, T, C)
  }

  int64_t n_head_, n_kv_head_, head_dim_;
  double attention_dropout_;
  std::shared_ptr<RopeCache> rope_;
  std::shared_ptr<const SequenceLayout> layout_;
  torch::nn::AnyModule *q_proj_, *k_proj_, *v_proj_, *o_proj_, *gate_proj_, *up_proj_, *down_proj_;
  RMSNorm input_layernorm_{nullptr}, post_attention_layernorm_{nullptr};
};

class LlamaLM : public DecoderLM {
 public:
  explicit LlamaLM(const ModelShape& s)
      : DecoderLM(s), rope_(std::make_shared<RopeCache>(s.head_dim(), s.rope_theta)) {
    model_ = register_module("model", std::make_shared<torch::nn::Module>("model"));
    // (V, C), made with no rows: build_model allocates it (DecoderLM, decoder.h).
    embed_tokens_ = model_->register_module(
        "embed_tokens", torch::nn::Embedding(torch::nn::EmbeddingOptions(0, s.d_model)));
    layers_ = model_->register_module("layers", torch::nn::ModuleList());
  }

  std::shared_ptr<Block> new_block(int64_t index) override {
    return std::make_shared<LlamaBlock>(shape_, index, rope_, layout_);
  }

  void finish() override {
    norm_ = model_->register_module("norm", RMSNorm(shape_.d_model, shape_.norm_eps));  // (C)
    if (!shape_.tie_embeddings)
      lm_head_ = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(
                                                 shape_.d_model, 0)
                                                 .bias(false)));  // (V, C), allocated by build_model
  }

  NamedTensors embedding_parameters() override {
    return {{"model.embed_tokens.weight", embed_tokens_->weight}};
  }
  NamedTensors final_parameters() override {
    NamedTensors p{{"model.norm.weight", norm_->weight}};
    if (lm_head_) p.emplace_back("lm_head.weight", lm_head_->weight);
    return p;
  }

  at::Tensor embed(const at::Tensor& tokens) override {  // (B, T) int64 -> (B, T, C)
    return embed_tokens_(tokens);
  }

  at::Tensor final_norm(const at::Tensor& hidden) override { return norm_(hidden); }
  const at::Tensor& head_weight() const override { return lm_head_ ? lm_head_->weight : embed_tokens_->weight; }

 private:
  std::shared_ptr<RopeCache> rope_;
  std::shared_ptr<torch::nn::Module> model_;
  torch::nn::Embedding embed_tokens_{nullptr};
  RMSNorm norm_{nullptr};
  torch::nn::Linear lm_head_{nullptr};
};

}  // namespace

std::shared_ptr<DecoderLM> make_llama(const ModelShape& shape) {
  return std::make_shared<LlamaLM>(shape);
}

}  // namespace memrt
