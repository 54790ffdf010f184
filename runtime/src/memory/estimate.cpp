// The host's memory plan and the activation terms (docs/memory.md, "The estimate").
#include "memory/estimate.h"

#include <algorithm>
#include <initializer_list>
#include <map>
#include <set>

#include "memrt/ops.h"
#include "models/model_factory.h"
#include "ops/attention_cpu.h"
#include "store/host_groups.h"

namespace memrt {
namespace memory {

int64_t ActivationEstimate::kept() const {
  int64_t sum = embedding + head + layout;
  for (int64_t b : per_block) sum += b;
  return sum;
}

int64_t ActivationEstimate::total() const { return kept() + backward_peak; }

void MemoryEstimate::refresh_activations(Placement placement) {
  table.at(Category::kActivations, Placement::kDevice) = 0;
  table.at(Category::kActivations, Placement::kHost) = 0;
  table.at(Category::kActivations, placement) = activations.total();
}

void MemoryEstimate::choose_backward_peak(int64_t grad_bytes) {
  ActivationEstimate& a = activations;
  const int64_t at_loss = a.backward_at_loss + grad_elements_at_loss * grad_bytes;
  const int64_t in_block = a.backward_in_last_block + grad_elements_in_last_block * grad_bytes;
  const bool loss = at_loss >= in_block;
  a.backward_peak = loss ? a.backward_at_loss : a.backward_in_last_block;
  backward_grad_elements = loss ? grad_elements_at_loss : grad_elements_in_last_block;
  if (a.embedding_trains && a.backward_in_embedding + grad_elements_in_embedding * grad_bytes > std::max(at_loss, in_block)) {
    a.backward_peak = a.backward_in_embedding;
    backward_grad_elements = grad_elements_in_embedding;
  }
}

int64_t block_backward_bytes(const ModelShape& s, int64_t micro_batch, int64_t block_size,
                             at::ScalarType dtype) {
  const int64_t b = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t BT = micro_batch * block_size;
  // Llama, the SwiGLU's backward: the gradients of the product, then of silu(gate) and up.
  if (s.arch == "llama") return 2 * BT * s.d_ff * b;
  // GPT-2, the MLP's backward: the gradient of gelu(fc), with mlp.c_proj's weight and bias
  // gradients in flight (at::linear's addmm makes all three in one node); with residual dropout
  // also the gradient of c_proj's output, the dropout's 1-byte mask being freed by then.
  const int64_t resid = s.resid_pdrop > 0.0 ? BT * s.d_model * (b - 1) : 0;
  return BT * s.d_ff * b + (s.d_ff + 1) * s.d_model * b + resid;
}

namespace {

// The chunked head (ops::linear_cross_entropy_sum) past the final norm: it keeps the gradients of
// its input (B*T*C, when the norm's output needs one) and of the head's weight (V*C, when it
// trains) from forward to backward. Inside its chunks it also holds the norm's output, its input,
// and one chunk's logits (in the compute dtype, again in fp32 for 16 bits) and per-row losses;
// the loss's scalar (one: the chunked sum keeps no total weight, as nll_loss does) comes after.
struct ChunkedHead {
  int64_t kept = 0;
  int64_t in_chunks = 0;  // on top of everything forward keeps, the loss's scalars not yet made
};
ChunkedHead chunked_head(const ModelShape& s, int64_t BT, int64_t b, bool input_grad, bool weight_grad) {
  const int64_t d = s.d_model, V = s.vocab_size, f = 4;
  const int64_t rows = ops::linear_cross_entropy_chunk_rows(BT, V);
  ChunkedHead h;
  h.kept = (input_grad ? BT * d * b : 0) + (weight_grad ? V * d * b : 0);
  h.in_chunks = BT * d * b + rows * V * (b == f ? f : b + f) + rows * f - f;
  return h;
}

// What a packed layout (RunInfo::sample_packing; docs/memory.md, "Packed rows") changes in the
// activations: GPT-2's position ids are the batch's positions (counted in `other` with the
// batch), not a tensor the embedding makes; a Llama's rotary tables are gathered at them once a
// micro-step (ActivationEstimate::layout); attention that does not run in one pass over a packed
// row (`joined`: not memrt's CPU kernel, which its dtype, head size, the device or dropout
// decide) runs sample by sample and joins the outputs, which a kernel that keeps its output (not
// dropout's math path) then keeps beside the joined copy.
struct Packing {
  bool packed = false;
  bool joined = false;
};

Packing packing_of(const RunInfo& run, at::ScalarType dtype) {
  Packing p;
  p.packed = run.sample_packing;
  p.joined = p.packed && run.shape.attn_pdrop == 0.0 &&
             !(run.device.is_cpu() && ops::causal_attention_cpu_takes(dtype, run.shape.head_dim()));
  return p;
}

// GPT-2's position ids (T int64) where the embedding makes them: not packed.
int64_t position_ids(const ModelShape& s, int64_t block_size, const Packing& p) {
  return s.arch == "gpt2" && !p.packed ? block_size * 8 : 0;
}

// In the embedding's backward: the gradient of its output, the gradients of the position and
// token tables being made (dense, whole tables), a tied table's gradient from the head waiting
// beside them, GPT-2's position ids, and the loss's scalars.
int64_t at_embedding(const ModelShape& s, int64_t BT, int64_t block_size, int64_t b, bool token, bool position,
                     const Packing& p) {
  const int64_t d = s.d_model, V = s.vocab_size;
  if (!token && !position) return 0;
  int64_t bytes = BT * d * b + 2 * 4;
  if (token) bytes += (s.tie_embeddings ? 2 : 1) * V * d * b;
  if (s.arch == "gpt2") bytes += position_ids(s, block_size, p) + (position ? s.n_ctx * d * b : 0);
  return bytes;
}

// Bytes of what autograd keeps, op by op; docs/memory.md lists the tensors behind each term.
// b: bytes per element of the compute dtype; f = 4: what LibTorch keeps in fp32 whatever the
// compute dtype (the attention's log-sum-exp; the loss side, which runs in fp32).
ActivationEstimate whole_model(const ModelShape& s, int64_t micro_batch, int64_t block_size, at::ScalarType dtype,
                               bool chunked, const Packing& packing) {
  const int64_t b = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t f = 4;
  const int64_t BT = micro_batch * block_size;
  const int64_t d = s.d_model, ff = s.d_ff, H = s.n_head, V = s.vocab_size;
  const int64_t kv = s.n_kv_head * s.head_dim();
  // The loss / GAS, and the total weight nll_loss keeps (chunked: the loss alone).
  const int64_t loss = chunked ? f : 2 * f;

  // Attention dropout sends scaled_dot_product_attention to its math path (the CPU's fused
  // kernel has no dropout): it keeps fp32 copies of the scaled q and k and of v (repeated to
  // every head under grouped-query attention), and three (T x T) matrices per head — the
  // softmax, the dropout's scaled mask and the dropped weights — in place of the fused kernel's
  // output and log-sum-exp; the attention output is then a copy, not a view. Other dropouts
  // (native_dropout) keep a 1-byte mask.
  const bool attn_drop = s.attn_pdrop > 0.0;
  const int64_t T = block_size;
  const int64_t math_attn = f * (3 * d + 3 * H * T);  // per token

  ActivationEstimate a;
  int64_t block = 0, head_kept = 0, block_backward = 0;
  if (s.arch == "llama") {
    // RMSNorm is composite and computes in fp32: whatever the compute dtype it keeps 2*C + 1
    // fp32 values per token (fp32: rstd, x*rstd, the output; 16-bit: the fp32 input, rstd,
    // x*rstd, with the 16-bit output a view the next op keeps).
    const int64_t norm = f * (2 * d + 1);
    a.embedding = BT * d * b;
    //   2 RMSNorms + q, k after RoPE, v + attention output and its log-sum-exp + residual
    //   + gate, up, silu(gate), product + block output
    block = attn_drop
                //   2 RMSNorms + attention output copy + residual + gate, up, silu(gate),
                //   product + block output + the math attention's tensors
                ? BT * (2 * norm + b * (d + d + 4 * ff + d) + math_attn)
                : BT * (2 * norm + b * (d + 2 * kv + d + d + 4 * ff + d) + f * H);
    //   the final RMSNorm + fp32 log-probabilities
    head_kept = BT * (norm + f * V);
    //   chunked: the RMSNorm without its output (d * b), which the LM head kept
    if (chunked) head_kept = BT * (norm - d * b);
    block_backward = block_backward_bytes(s, micro_batch, block_size, dtype);
  } else {
    // sum of the two lookups (with embd_pdrop: the dropout's output and its mask); position ids
    a.embedding = BT * d * b + position_ids(s, block_size, packing) + (s.embd_pdrop > 0.0 ? BT * d : 0);
    //   2 LayerNorms (mean, rstd, output) + qkv + attention output and log-sum-exp + residual
    //   + fc, gelu(fc) + block output; with attention dropout the math attention's tensors and
    //   the attention output's copy replace qkv, the output and the log-sum-exp
    block = attn_drop ? BT * (b * (2 * (2 + d) + d + d + 2 * ff + d) + math_attn)
                      : BT * (b * (2 * (2 + d) + 3 * d + d + d + 2 * ff + d) + f * H);
    if (s.resid_pdrop > 0.0) block += 2 * BT * d;  // the two residual dropouts' masks
    //   the final LayerNorm (mean, rstd, output) + fp32 log-probabilities; chunked, its statistics
    head_kept = chunked ? BT * 2 * b : BT * (b * (2 + d) + f * V);
    block_backward = block_backward_bytes(s, micro_batch, block_size, dtype);
  }
  if (packing.joined) block += BT * d * b;  // the samples' outputs beside the joined one
  a.per_block.assign(static_cast<size_t>(s.n_layer), block);
  if (packing.packed && s.arch == "llama") a.layout = 2 * BT * s.head_dim() * b;  // cos and sin
  ChunkedHead chunks;
  if (chunked) {
    chunks = chunked_head(s, BT, b, /*input_grad=*/true, /*weight_grad=*/true);
    head_kept += chunks.kept;
  }
  a.head = head_kept + loss;
  // Backward's working memory on top of what forward kept, at its largest: either at the loss
  // (the gradients of the log-probabilities and of the logits, both B*T*V, alive together; chunked,
  // inside the head's chunks in forward), or in the last block, once the head's activations are
  // freed (a tied embedding's gradient from the head waits in autograd's input buffer until the
  // embedding's own backward), or in the embedding's backward.
  const int64_t tied_grad = s.tie_embeddings ? V * d * b : 0;
  a.backward_at_loss = chunked ? chunks.in_chunks : 2 * BT * V * f;
  // Past the loss two scalars stay, the loss and backward's seed (ones_like(loss)): unchunked,
  // in place of the total weight nll_loss kept; chunked, one more than forward kept.
  const int64_t seed = chunked ? f : 0;
  a.backward_in_last_block = block_backward + tied_grad - head_kept + seed;
  a.embedding_trains = true;
  a.backward_in_embedding = at_embedding(s, BT, block_size, b, true, true, packing) + a.layout - a.kept();
  a.backward_peak = std::max(a.backward_at_loss, a.backward_in_last_block);
  return a;
}

}  // namespace

ActivationEstimate activation_estimate(const ModelShape& s, int64_t micro_batch, int64_t block_size,
                                       at::ScalarType dtype, bool chunked) {
  return whole_model(s, micro_batch, block_size, dtype, chunked, Packing());
}

namespace {
bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() > tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}
// A LoRA adapter's A, "<module>.lora_A.weight" (r, in), as PEFT names it.
const std::string kLoraA = ".lora_A.weight";
}  // namespace

int64_t param_segment(const std::string& name, int64_t n_layer) {
  for (const char* prefix : {"transformer.h.", "model.layers."}) {
    const std::string p = prefix;
    if (name.compare(0, p.size(), p) == 0) return std::stoll(name.substr(p.size()));
  }
  for (const char* embedding : {"wte", "wpe", "embed_tokens"})
    if (name.find(embedding) != std::string::npos) return -1;
  return n_layer;
}

bool is_last_projection(const std::string& name, const std::string& arch) {
  // Llama: down_proj's weight, or its LoRA adapter's A and B, whose gradients are handed over
  // before the SwiGLU's backward. GPT-2: a LoRA adapter on mlp.c_proj, whose backward is the
  // block's peak (gpt2_block).
  if (arch == "llama")
    return ends_with(name, ".mlp.down_proj.weight") || ends_with(name, ".mlp.down_proj" + kLoraA) ||
           ends_with(name, ".mlp.down_proj.lora_B.weight");
  return ends_with(name, ".mlp.c_proj" + kLoraA) || ends_with(name, ".mlp.c_proj.lora_B.weight");
}

namespace {

// Which parameters train: per block the names below the block's prefix ("attn.c_attn.weight",
// "self_attn.q_proj.weight"), and the full names of the others.
struct Trainable {
  std::vector<std::set<std::string>> blocks;
  std::set<std::string> outside;
  // Per block, the rank of each LoRA adapter by its module ("mlp.c_proj" -> r, from
  // "mlp.c_proj.lora_A.weight" (r, in)).
  std::vector<std::map<std::string, int64_t>> adapters;

  Trainable(const std::vector<ParamEstimate>& params, int64_t n_layer)
      : blocks(static_cast<size_t>(n_layer)), adapters(static_cast<size_t>(n_layer)) {
    for (const ParamEstimate& p : params) {
      if (!p.trainable) continue;
      const int64_t segment = param_segment(p.name, n_layer);
      if (segment < 0 || segment >= n_layer) {
        outside.insert(p.name);
        continue;
      }
      const std::string index = "." + std::to_string(segment) + ".";
      const std::string local = p.name.substr(p.name.find(index) + index.size());
      blocks[static_cast<size_t>(segment)].insert(local);
      if (ends_with(local, kLoraA) && !p.shape.empty())
        adapters[static_cast<size_t>(segment)][local.substr(0, local.size() - kLoraA.size())] = p.shape[0];
    }
  }
  // The rank of the LoRA adapter on a projection of the block, 0 without one.
  int64_t adapter_rank(int64_t block, const char* module) const {
    const auto& a = adapters[static_cast<size_t>(block)];
    const auto it = a.find(module);
    return it == a.end() ? 0 : it->second;
  }
  bool any(int64_t block, std::initializer_list<const char*> names) const {
    for (const char* n : names)
      if (blocks[static_cast<size_t>(block)].count(n)) return true;
    return false;
  }
  // Whether a projection of the block reads its input for a gradient: its weight trains, or a
  // parameter of a module inside it does (a LoRA adapter: "attn.c_attn.lora_A.weight").
  bool reads_input(int64_t block, std::initializer_list<const char*> modules) const {
    for (const char* m : modules)
      for (const std::string& n : blocks[static_cast<size_t>(block)])
        if (n.rfind(std::string(m) + ".", 0) == 0 && n != std::string(m) + ".bias") return true;
    return false;
  }
  // Whether a projection's output needs a gradient for a parameter of its own (bias included).
  bool trains_under(int64_t block, std::initializer_list<const char*> modules) const {
    for (const char* m : modules)
      if (reads_input(block, {m}) || blocks[static_cast<size_t>(block)].count(std::string(m) + ".bias")) return true;
    return false;
  }
  bool outside_any(std::initializer_list<const char*> names) const {
    for (const char* n : names)
      if (outside.count(n)) return true;
    return false;
  }
};

// One block under freezing: what its ops keep, per token, but its output (the next segment's norm
// keeps that); whether its output needs a gradient; and backward's working memory in its MLP on
// top of what it keeps (the last-block candidate), per micro-batch. An op keeps a tensor only for
// a gradient it computes: a linear layer its input only when its weight trains, a norm's
// statistics only when its input needs a gradient, an activation its input only when its output
// needs one.
struct BlockOps {
  int64_t kept = 0;
  bool out_grad = false;
  bool attention = false;  // whether attention keeps its inputs and output (a gradient goes through it)
  int64_t backward = 0;
};

BlockOps gpt2_block(const ModelShape& s, const Trainable& t, int64_t i, bool in_grad, int64_t BT, int64_t b) {
  const int64_t d = s.d_model, ff = s.d_ff, f = 4;
  BlockOps o;
  const bool g_ln1 = in_grad || t.any(i, {"ln_1.weight", "ln_1.bias"});
  o.kept += g_ln1 ? 2 * b : 0;                                   // ln_1's mean and rstd
  o.kept += t.reads_input(i, {"attn.c_attn"}) ? d * b : 0;        // ln_1's output, c_attn's input
  const bool g_qkv = g_ln1 || t.trains_under(i, {"attn.c_attn"});
  o.kept += g_qkv ? 3 * d * b + f * s.n_head : 0;               // q, k, v and the log-sum-exp
  o.attention = g_qkv;
  o.kept += g_qkv || t.reads_input(i, {"attn.c_proj"}) ? d * b : 0;  // the attention's output
  const bool g_h1 = in_grad || g_qkv || t.trains_under(i, {"attn.c_proj"});
  const bool g_ln2 = g_h1 || t.any(i, {"ln_2.weight", "ln_2.bias"});
  o.kept += g_ln2 ? d * b + 2 * b : 0;                           // the residual; ln_2's mean, rstd
  o.kept += t.reads_input(i, {"mlp.c_fc"}) ? d * b : 0;           // ln_2's output, c_fc's input
  const bool g_fc = g_ln2 || t.trains_under(i, {"mlp.c_fc"});
  const bool proj_w = t.reads_input(i, {"mlp.c_proj"}), proj_b = t.any(i, {"mlp.c_proj.bias"});
  o.kept += g_fc ? ff * b : 0;                                   // fc, GELU's input
  o.kept += proj_w ? ff * b : 0;                                 // gelu(fc), c_proj's input
  o.out_grad = g_fc || proj_w || proj_b;
  // At c_proj's backward: the gradient of gelu(fc), with c_proj's weight and bias gradients; at
  // GELU's: the gradients of its output and its input, c_proj having freed gelu(fc).
  const int64_t at_proj = (g_fc ? BT * ff * b : 0) + (t.any(i, {"mlp.c_proj.weight"}) ? ff * d * b : 0) +
                          (proj_b ? d * b : 0);
  const int64_t at_gelu = g_fc ? 2 * BT * ff * b - (proj_w ? BT * ff * b : 0) : 0;
  // With a LoRA adapter on c_proj: its backward computes gelu(fc)'s gradient twice, the base's and
  // the adapter's A's, alive together before autograd sums them (A's output, r a token, freed by
  // then; A's input, gelu(fc), not yet).
  const int64_t proj_rank = t.adapter_rank(i, "mlp.c_proj");
  const int64_t at_adapter = proj_rank > 0 && g_fc ? 2 * BT * ff * b - BT * proj_rank * b : 0;
  o.backward = std::max({at_proj, at_gelu, at_adapter});
  return o;
}

// Llama in fp32. RMSNorm is composite: it keeps rstd (and its input, the previous segment's
// output) for the input's gradient, x * rstd for the weight's.
BlockOps llama_block(const ModelShape& s, const Trainable& t, int64_t i, bool in_grad, int64_t BT, int64_t b) {
  const int64_t d = s.d_model, ff = s.d_ff, f = 4, kv = s.n_kv_head * s.head_dim();
  BlockOps o;
  const bool n1 = t.any(i, {"input_layernorm.weight"});
  const bool qkv_w = t.reads_input(i, {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"});
  o.kept += (in_grad ? f : 0) + (n1 ? d * f : 0) + (qkv_w ? d * b : 0);  // rstd, x * rstd, output
  const bool g_attn = in_grad || n1 || qkv_w;
  o.kept += g_attn ? (d + 2 * kv) * b + f * s.n_head : 0;  // q and k after RoPE, v, log-sum-exp
  o.attention = g_attn;
  const bool o_w = t.reads_input(i, {"self_attn.o_proj"});
  o.kept += g_attn || o_w ? d * b : 0;                     // the attention's output
  const bool g_h = g_attn || o_w || in_grad;
  const bool n2 = t.any(i, {"post_attention_layernorm.weight"});
  const bool gate_w = t.reads_input(i, {"mlp.gate_proj"}), up_w = t.reads_input(i, {"mlp.up_proj"});
  o.kept += (g_h ? d * b + f : 0) + (n2 ? d * f : 0) + (gate_w || up_w ? d * b : 0);  // h, rstd, ...
  const bool g_gate = g_h || n2 || gate_w, g_up = g_h || n2 || up_w;
  const bool down_w = t.reads_input(i, {"mlp.down_proj"});
  o.kept += g_gate ? 2 * ff * b : 0;  // gate (SiLU's input) and up (for silu(gate)'s gradient)
  o.kept += g_up ? ff * b : 0;        // silu(gate), for up's gradient
  o.kept += down_w ? ff * b : 0;      // the product, down_proj's input
  o.out_grad = g_gate || g_up || down_w;
  // The SwiGLU's backward: the product's gradient, then silu(gate)'s and up's, down_proj having
  // freed the product (its weight's gradient is handed over by then) and, with a LoRA adapter,
  // its A's output (r a token, kept for B's gradient).
  o.backward = BT * ff * b * ((g_gate || g_up ? 1 : 0) + (g_gate ? 1 : 0) + (g_up ? 1 : 0) - (down_w ? 1 : 0));
  if (o.backward > 0) o.backward -= BT * t.adapter_rank(i, "mlp.down_proj") * b;
  return o;
}

// Whole segments frozen (docs/memory.md): the rules where the op-by-op model is not built (dropout;
// Llama in 16 bits). Exact when whole segments are frozen, an upper bound otherwise.
void freeze_segments(ActivationEstimate& a, const ModelShape& s, int64_t BT, at::ScalarType dtype,
                     const std::vector<ParamEstimate>& params, bool chunked) {
  const int64_t L = s.n_layer;
  int64_t first_trained = L + 1;
  bool embedding_trains = false, head_weight_trains = false, final_norm_trains = false;
  for (const ParamEstimate& p : params) {
    if (!p.trainable) continue;
    final_norm_trains = final_norm_trains || p.name == "model.norm.weight" || p.name == "transformer.ln_f.weight";
    first_trained = std::min(first_trained, param_segment(p.name, L));
    const bool token_embedding = p.name.find("wte") != std::string::npos ||
                                 p.name.find("embed_tokens") != std::string::npos;
    embedding_trains = embedding_trains || token_embedding;
    head_weight_trains = head_weight_trains || (s.tie_embeddings ? token_embedding : p.name == "lm_head.weight");
  }
  const int64_t out = BT * s.d_model * static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t f = 4;
  const bool llama = s.arch == "llama";
  const int64_t prefix_output = llama ? 0 : out;
  if (first_trained >= 0) a.embedding = first_trained == 0 ? prefix_output : 0;
  for (int64_t i = 0; i < std::min(first_trained, L); ++i)
    a.per_block[static_cast<size_t>(i)] = i == first_trained - 1 ? prefix_output : 0;
  if (llama && first_trained >= 0 && first_trained < L) a.per_block[static_cast<size_t>(first_trained)] -= BT * f;
  const int64_t weight_grad = s.vocab_size * s.d_model * static_cast<int64_t>(c10::elementSize(dtype));
  if (!head_weight_trains && first_trained <= L) {
    // Unchunked, the LM head keeps no input; chunked, it makes no weight gradient.
    const int64_t saved = (chunked ? weight_grad : out) + (llama && !final_norm_trains ? BT * s.d_model * f : 0);
    a.head -= saved;
    a.backward_in_last_block += saved;
  }
  if (chunked && first_trained == L && !final_norm_trains) {  // only lm_head trains: no input gradient
    a.head -= out;
    a.backward_in_last_block += out;
  }
  if (s.tie_embeddings && !embedding_trains)
    a.backward_in_last_block -= s.vocab_size * s.d_model * static_cast<int64_t>(c10::elementSize(dtype));
}

// LoRA adapters inside a block's projections (PEFT's names, "<P>.lora_A.weight" (r, in)): A's
// output, r values a token, is kept for B's gradient. (What the projection itself then keeps is
// the op model's: its input, as for a weight that trains.)
void add_adapter_outputs(ActivationEstimate& a, const ModelShape& s, int64_t BT, at::ScalarType dtype,
                         const std::vector<ParamEstimate>& params) {
  for (const ParamEstimate& p : params) {
    if (!p.trainable || p.shape.size() != 2 || !ends_with(p.name, kLoraA)) continue;
    const int64_t block = param_segment(p.name, s.n_layer);
    if (block < 0 || block >= s.n_layer) continue;
    a.per_block[static_cast<size_t>(block)] += BT * p.shape[0] * static_cast<int64_t>(c10::elementSize(dtype));
  }
}

}  // namespace

bool activations_op_by_op(const ModelShape& s, at::ScalarType dtype) {
  const bool dropout = s.attn_pdrop > 0.0 || s.resid_pdrop > 0.0 || s.embd_pdrop > 0.0;
  return !dropout && (s.arch != "llama" || dtype == at::kFloat);
}

namespace {

ActivationEstimate by_params(const ModelShape& s, int64_t micro_batch, int64_t block_size, at::ScalarType dtype,
                             const std::vector<ParamEstimate>& params, bool chunked, const Packing& packing) {
  ActivationEstimate a = whole_model(s, micro_batch, block_size, dtype, chunked, packing);
  const int64_t BT = micro_batch * block_size;
  const bool llama = s.arch == "llama";
  if (!activations_op_by_op(s, dtype)) {
    freeze_segments(a, s, BT, dtype, params, chunked);
    add_adapter_outputs(a, s, BT, dtype, params);
    bool token = false, position = false;
    for (const ParamEstimate& p : params) {
      token = token || (p.trainable && (p.name == "transformer.wte.weight" || p.name == "model.embed_tokens.weight"));
      position = position || (p.trainable && p.name == "transformer.wpe.weight");
    }
    a.embedding_trains = token || position;
    a.backward_in_embedding = at_embedding(s, BT, block_size, static_cast<int64_t>(c10::elementSize(dtype)), token,
                                           position, packing) + a.layout - a.kept();
    a.backward_peak = std::max(a.backward_at_loss, a.backward_in_last_block);
    return a;
  }
  // Op by op, segment after segment, whether each tensor has an op that keeps it.
  const int64_t L = s.n_layer;
  const int64_t b = static_cast<int64_t>(c10::elementSize(dtype)), f = 4, d = s.d_model;
  const Trainable t(params, L);
  const bool embedding = t.outside_any({"transformer.wte.weight", "model.embed_tokens.weight"});
  const bool head_weight = s.tie_embeddings ? embedding : t.outside.count("lm_head.weight") > 0;
  const bool final_norm = t.outside_any({"model.norm.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"});
  const bool position = t.outside.count("transformer.wpe.weight") > 0;
  a.embedding_trains = embedding || position;
  // Whether the segment after one whose output needs a gradient `grad` keeps that output: a
  // LayerNorm whenever it has a gradient to compute, RMSNorm's x^2 only for its input's.
  auto output_kept = [&](bool grad, bool norm_trains) { return grad || (!llama && norm_trains); };
  bool grad = embedding || position;
  a.embedding = position ? position_ids(s, block_size, packing) : 0;
  int64_t* previous_output = &a.embedding;  // the term that counts the last segment's output
  BlockOps last;
  for (int64_t i = 0; i < L; ++i) {
    const bool norm = llama ? t.any(i, {"input_layernorm.weight"}) : t.any(i, {"ln_1.weight", "ln_1.bias"});
    *previous_output += output_kept(grad, norm) ? BT * d * b : 0;
    last = llama ? llama_block(s, t, i, grad, BT, b) : gpt2_block(s, t, i, grad, BT, b);
    a.per_block[static_cast<size_t>(i)] = BT * (last.kept + (packing.joined && last.attention ? d * b : 0));
    previous_output = &a.per_block[static_cast<size_t>(i)];
    grad = grad || last.out_grad;
  }
  *previous_output += output_kept(grad, final_norm) ? BT * d * b : 0;
  add_adapter_outputs(a, s, BT, dtype, params);
  // The head: the final norm (GPT-2: mean and rstd; Llama: rstd, x * rstd), its output for the
  // LM head's weight, the fp32 log-probabilities, and the loss's scalars; chunked, in place of the
  // last two, the gradients it computed in forward.
  const int64_t norm_kept = llama ? (grad ? f : 0) + (final_norm ? d * f : 0) : (grad || final_norm ? 2 * b : 0);
  int64_t head_kept = BT * (norm_kept + (head_weight ? d * b : 0) + f * s.vocab_size);
  if (chunked) {
    const ChunkedHead h = chunked_head(s, BT, b, grad || final_norm, head_weight);
    head_kept = BT * norm_kept + h.kept;
    a.backward_at_loss = h.in_chunks;
  }
  a.head = head_kept + (chunked ? f : 2 * f);
  const int64_t tied_grad = s.tie_embeddings && embedding ? s.vocab_size * d * b : 0;
  a.backward_in_last_block = last.backward + tied_grad - head_kept + (chunked ? f : 0);  // backward's seed
  a.backward_in_embedding = at_embedding(s, BT, block_size, b, embedding, position, packing) + a.layout - a.kept();
  a.backward_peak = std::max(a.backward_at_loss, a.backward_in_last_block);
  return a;
}

}  // namespace

ActivationEstimate activation_estimate(const ModelShape& s, int64_t micro_batch, int64_t block_size,
                                       at::ScalarType dtype, const std::vector<ParamEstimate>& params,
                                       bool chunked) {
  return by_params(s, micro_batch, block_size, dtype, params, chunked, Packing());
}

ActivationEstimate activation_estimate(const RunInfo& run, at::ScalarType dtype,
                                       const std::vector<ParamEstimate>& params) {
  return by_params(run.shape, run.micro_batch_size, run.block_size, dtype, params, run.chunked_cross_entropy,
                   packing_of(run, dtype));
}

}  // namespace memory


std::vector<ParamInfo> shape_params(const ModelShape& shape, bool decay_all) {
  std::vector<ParamInfo> out;
  for (const ParamSpec& p : parameter_specs(shape))
    out.push_back({p.name, p.shape, at::kFloat, true, decays(p.name, decay_all)});
  return out;
}

std::vector<int64_t> param_segments(const std::vector<ParamInfo>& params, int64_t n_layer) {
  std::vector<int64_t> out;
  for (const ParamInfo& p : params) out.push_back(memory::param_segment(p.name, n_layer));
  return out;
}

memory::MemoryEstimate host_memory_plan(const RunInfo& run, const HostPlanOptions& options,
                                        const std::vector<ParamInfo>& params) {
  using memory::Category;
  memory::MemoryEstimate e;
  e.run = &run;
  e.compute_dtype = at::kFloat;
  const int64_t b = 4;
  const int64_t L = run.shape.n_layer;
  // Trainable elements: all, and in the final segment (final norm, untied lm_head).
  int64_t trainable = 0, final_segment = 0, last_projection = 0, embedding_segment = 0;
  for (const ParamInfo& p : params) {
    int64_t numel = 1;
    for (int64_t d : p.shape) numel *= d;
    e.params.push_back({p.name, p.shape, numel, p.trainable});
    if (!p.trainable) continue;
    trainable += numel;
    const int64_t segment = memory::param_segment(p.name, L);
    if (segment == L) final_segment += numel;
    if (segment < 0) embedding_segment += numel;
    if (segment == L - 1 && memory::is_last_projection(p.name, run.shape.arch)) last_projection += numel;
  }
  e.activations = memory::activation_estimate(run, e.compute_dtype, e.params);
  memory::ActivationEstimate& a = e.activations;
  memory::Table& t = e.table;
  StoreOptions store = options.store;
  store.rank = run.rank;
  store.world_size = run.world_size;
  e.store = std::make_shared<StorePlan>(host_store_plan(params, param_segments(params, L), store, options.optimizer));
  t = e.store->bytes();  // weights and optimizer state, as the default layout allocates them
  if (run.world_size > 1) {  // the all-reduce's staging buffers: up to two buckets, kept
    const int64_t grads = trainable * b;
    const int64_t bucket = std::min(options.allreduce_bucket_bytes, grads);
    const int64_t buckets = (grads + bucket - 1) / bucket;
    t.at(Category::kCommBuffers) = std::min<int64_t>(2, buckets) * bucket;
  }
  // input and target ids, and a packed layout's positions
  t.at(Category::kOther) = (run.sample_packing ? 3 : 2) * run.micro_batch_size * run.block_size * 8;
  if (run.shape.arch == "llama")  // the rotary cos/sin tables
    t.at(Category::kOther) += 2 * run.block_size * run.shape.head_dim() * b;

  // The peak is in backward — at the loss, or in the last block, with every gradient of the
  // earlier micro-steps alive when accumulating, and otherwise those handed over by then — or in
  // the optimizer step (every gradient, no activations).
  const int64_t all_grads = trainable * b;
  // In the last block the final segment (norm, untied lm_head) has handed over its gradients,
  // and so has Llama's down projection; in the embedding's backward every gradient but the
  // embedding's own.
  const bool accumulating = run.grad_accum_steps > 1;
  e.grad_elements_at_loss = accumulating ? trainable : 0;
  e.grad_elements_in_last_block = accumulating ? trainable : final_segment + last_projection;
  e.grad_elements_in_embedding = accumulating ? trainable : trainable - embedding_segment;
  e.choose_backward_peak(b);
  const int64_t grads_in_backward = e.backward_grad_elements * b;
  e.peak_in_backward = a.total() + grads_in_backward >= all_grads;
  if (e.peak_in_backward) {
    t.at(Category::kGradients) = grads_in_backward;
    e.refresh_activations();
  } else {
    t.at(Category::kGradients) = all_grads;
  }
  return e;
}

}  // namespace memrt
