// memrt/memory.h — where the bytes go: categories, ownership, and the memory estimate.
//
// Measuring. memrt installs a tracking allocator under LibTorch's CPU allocator at start-up. Every
// allocation is counted in exactly one (category, placement) cell:
//   - by default, in the category of the innermost memory::Scope open on the allocating thread
//     (the engine opens one per phase: model build -> weights, forward/backward -> activations,
//     optimizer step -> optimizer_state, gradient all-reduce -> comm_buffers; outside any scope:
//     unattributed);
//   - whoever owns a tensor may move its storage to another cell with memory::claim() — a plugin
//     claims its master weights, quantization codes, adapters, offloaded state.
// The engine claims parameter gradients (as gradients) as they are produced. The report then says,
// to the byte, how the allocator's live bytes split — and what nobody claimed is `unattributed`.
//
// Estimating. `launcher --estimate` builds a MemoryEstimate from the model's shapes without
// allocating it: the host writes the plain fp32 + AdamW data-parallel plan, then every plugin's
// Plugin::estimate_memory() adjusts it in priority order (precision halves the compute weights and
// adds masters, ZeRO divides by the world size, checkpointing shrinks activations, ...). What each
// plugin changed is kept as its term. The same estimate is printed next to the measurement at the
// end of every run. docs/memory.md has the formulas.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "memrt/model_shape.h"

namespace memrt {

struct RunInfo;
class StorePlan;

namespace memory {

enum class Category : uint8_t {
  kWeights,         // the parameters forward computes with (compute copy), trainable or frozen
  kMasterWeights,   // higher-precision copies the optimizer updates (fp32 masters)
  kGradients,       // parameter gradients (accumulated, possibly partitioned)
  kOptimizerState,  // Adam moments, 8-bit states, their scales
  kQuantState,      // quantized codes and scales of frozen weights (NF4/FP4, absmax)
  kAdapters,        // LoRA matrices
  kActivations,     // what forward keeps for backward, and backward's working memory
  kCommBuffers,     // flattened buckets, gathered partitions
  kOther,           // claimed, none of the above (the data batch, plugin bookkeeping)
  kUnattributed,    // nobody claimed it
};
constexpr int kNumCategories = 10;
const char* to_string(Category c);  // "weights", "master_weights", ... (the JSON keys)
constexpr std::array<Category, kNumCategories> all_categories() {
  return {Category::kWeights,         Category::kMasterWeights, Category::kGradients,
          Category::kOptimizerState,  Category::kQuantState,    Category::kAdapters,
          Category::kActivations,     Category::kCommBuffers,   Category::kOther,
          Category::kUnattributed};
}

// Where the config places a tensor: on the training device, or offloaded to host memory. On a
// CPU-only machine both are the same RAM; the split still says what the config offloads.
enum class Placement : uint8_t { kDevice, kHost };
constexpr int kNumPlacements = 2;
const char* to_string(Placement p);  // "device", "host"

// Bytes per (category, placement).
struct Table {
  std::array<std::array<int64_t, kNumPlacements>, kNumCategories> bytes{};

  int64_t& at(Category c, Placement p = Placement::kDevice) {
    return bytes[static_cast<size_t>(c)][static_cast<size_t>(p)];
  }
  int64_t at(Category c, Placement p = Placement::kDevice) const {
    return bytes[static_cast<size_t>(c)][static_cast<size_t>(p)];
  }
  int64_t category(Category c) const { return at(c, Placement::kDevice) + at(c, Placement::kHost); }
  int64_t placement(Placement p) const;
  int64_t total() const { return placement(Placement::kDevice) + placement(Placement::kHost); }
  Table operator-(const Table& other) const;
  Table operator+(const Table& other) const;
  bool operator==(const Table& other) const { return bytes == other.bytes; }
};

// ---- measuring -----------------------------------------------------------------------------------

// True once the host has installed the tracking allocator (always, in the launcher).
bool tracking();

// Counts the storage of `t` under (category, placement) from now on; its bytes move out of
// whatever cell they were in. Returns false, and changes nothing, for storage the tracker did not
// allocate (a view of a memory-mapped file, memory from another device's allocator).
bool claim(const at::Tensor& t, Category category, Placement placement = Placement::kDevice);
// claim() for several tensors; returns the bytes that moved.
int64_t claim_all(const std::vector<at::Tensor>& tensors, Category category,
                  Placement placement = Placement::kDevice);

// Allocations made on this thread while a Scope lives default to its cell. Scopes nest.
class Scope {
 public:
  explicit Scope(Category category, Placement placement = Placement::kDevice);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  uint8_t saved_;
};

// Live bytes per cell right now (all threads).
Table live();

// ---- estimating ----------------------------------------------------------------------------------

// One parameter tensor of the model, from its shape alone.
struct ParamEstimate {
  std::string name;  // Hugging Face name
  std::vector<int64_t> shape;
  int64_t numel = 0;
  bool trainable = true;
};

// Activation terms, in bytes, of one micro-batch (docs/memory.md derives each).
struct ActivationEstimate {
  std::vector<int64_t> per_block;  // kept by each block's forward for its backward
  int64_t embedding = 0;           // kept by the embedding segment
  int64_t head = 0;                // kept by the final norm, the LM head and the loss
  // Backward's working memory on top of what forward kept, at its two candidate peaks: at the
  // loss (with a chunked head: inside its chunks, at the end of forward, where its working memory
  // sits on what the other segments kept), and in the last block once the head's activations are
  // freed.
  int64_t backward_at_loss = 0;
  int64_t backward_in_last_block = 0;
  // ABI 2.12: the third candidate, in the embedding's backward when a parameter of it trains (all
  // blocks' activations freed; its weight's gradient made whole beside every later one, a tied
  // one beside the head's): what is alive then, less what forward kept. `embedding_trains` false:
  // no such candidate.
  int64_t backward_in_embedding = 0;
  bool embedding_trains = false;
  int64_t backward_peak = 0;  // the one at the step's peak (the host plan decides)
  // ABI 2.21: kept through the micro-step by a packed layout (RunInfo::sample_packing): a Llama's
  // rotary tables gathered at the tokens' positions, once for every block (docs/memory.md,
  // "Packed rows").
  int64_t layout = 0;
  int64_t kept() const;       // what forward keeps: blocks, embedding, head, layout
  int64_t total() const;      // kept() + backward_peak: the activations at the step's peak
};

// The activation terms of the built-in architectures (docs/memory.md derives them) for a
// micro-batch of `micro_batch` sequences of `block_size` tokens computed in `dtype`.
// `chunked_head` (RunInfo::chunked_cross_entropy): the head keeps the gradients of its input and
// weight from forward to backward, not the log-probabilities, and its peak is inside its chunks.
ActivationEstimate activation_estimate(const ModelShape& shape, int64_t micro_batch,
                                       int64_t block_size, at::ScalarType dtype, bool chunked_head = false);

// The segment a parameter belongs to, from its Hugging Face name: -1 the embedding ("wte", "wpe",
// "embed_tokens"), i for block i ("transformer.h.i." / "model.layers.i."), n_layer the head (final
// norm, untied lm_head).
int64_t param_segment(const std::string& name, int64_t n_layer);
// Whether a block's backward has handed this parameter's gradient over at the block's peak
// (docs/memory.md, "The peak"): Llama's down projection weight and the A and B of a LoRA adapter
// on it; the A and B of a LoRA adapter on GPT-2's mlp.c_proj. GPT-2's c_proj weight and bias
// gradients are still in flight then (block_backward_bytes counts them).
bool is_last_projection(const std::string& name, const std::string& arch);

// The same, training only the trainable ones of `params` (the model's parameters as planned), op
// by op: a linear layer with a frozen weight keeps no input, a norm keeps its statistics only when
// its input needs a gradient, the segments before the first that trains keep nothing, a frozen
// tied embedding holds no gradient through the last block (docs/memory.md, "Frozen parameters").
// Measured exact in fp32 for any set of frozen parameters (GPT-2, Llama); GPT-2 in 16 bits follows
// the same rules; with dropout, or Llama in 16 bits, the rules of whole segments (exact when whole
// segments are frozen, an upper bound otherwise).
ActivationEstimate activation_estimate(const ModelShape& shape, int64_t micro_batch,
                                       int64_t block_size, at::ScalarType dtype,
                                       const std::vector<ParamEstimate>& params, bool chunked_head = false);
// ABI 2.21: the same for the run as `run` describes it — its shape, micro-batch, block size, head
// (chunked_cross_entropy) and packed rows (sample_packing), and its device where that decides which
// attention kernel runs — in `dtype`. What plugins that re-derive the activations call.
ActivationEstimate activation_estimate(const RunInfo& run, at::ScalarType dtype,
                                       const std::vector<ParamEstimate>& params);
// ABI 2.14: whether that estimate is op by op for this model and dtype (no dropout; GPT-2, or a
// Llama in fp32) rather than by whole segments. Op by op, the embedding term holds the embedding's
// output exactly when an op keeps it (activation checkpointing adds it where only a checkpoint
// does).
bool activations_op_by_op(const ModelShape& shape, at::ScalarType dtype);

// Backward's working memory inside one block at its largest, on top of what the block's forward
// kept (docs/memory.md: the gradients alive in the MLP's backward). The last-block candidate of
// activation_estimate() is this plus a tied embedding's gradient minus the head's activations;
// a plugin that changes what blocks keep (activation checkpointing) builds its candidates from it.
int64_t block_backward_bytes(const ModelShape& shape, int64_t micro_batch, int64_t block_size,
                             at::ScalarType dtype);

// What a plugin's estimate_memory() receives and adjusts. `table` is the memory at this rank's
// peak, by cell; `activations` details its activations cell; `params` the model's parameters as
// the plan stands (the list every plugin's plan_params left; read it, do not edit it here).
struct MemoryEstimate {
  const RunInfo* run = nullptr;     // the rank and world size being estimated
  at::ScalarType compute_dtype = at::kFloat;
  std::vector<ParamEstimate> params;
  ActivationEstimate activations;
  // Gradient elements alive at backward's peak (the host's plan: all of them when accumulating,
  // else those handed over by then). A plugin that changes the gradients' dtype scales these.
  int64_t backward_grad_elements = 0;
  // ABI 2.19: the gradient elements alive at each of backward's candidates (the host's plan: all
  // of them when accumulating; else at the loss none, in the last block those of the final segment
  // and of the block's last projection, in the embedding's backward all but its own).
  int64_t grad_elements_at_loss = 0;
  int64_t grad_elements_in_last_block = 0;
  int64_t grad_elements_in_embedding = 0;
  // Whether the peak is in backward (else in the optimizer step, every gradient alive).
  bool peak_in_backward = true;
  Table table;
  // The parameter store's layout from these shapes (memrt/param_store.h): plugins set their axis
  // in Plugin::plan_store, after every estimate_memory; the host then moves the store's cells of
  // `table` (weights, master_weights, optimizer_state, flat gradients) by what each changed.
  std::shared_ptr<StorePlan> store;

  // A plugin that changes the activation terms calls this to re-derive table's activations cell.
  void refresh_activations(Placement placement = Placement::kDevice);
  // ABI 2.19: picks backward's candidate at the peak as the host's plan does — the largest of each
  // candidate's activations plus its gradients at `grad_bytes` per element (the loss's on a tie,
  // the embedding's only when larger) — and sets activations.backward_peak and
  // backward_grad_elements. A plugin that re-derives the activations (another compute dtype)
  // calls it: which candidate is largest can change with the dtype (the head's fp32 gradients do
  // not shrink in 16 bits, a block's do). Only the host's candidates are chosen among: a plugin
  // that sets backward_peak from candidates of its own (plugins/checkpoint's per-block
  // recomputes) leaves grad_elements_* as they were, and a plugin after it must not call this.
  void choose_backward_peak(int64_t grad_bytes);
};

// A named contribution to the estimate: what one plugin (or the host) changed.
struct EstimateTerm {
  std::string source;  // "memrt" for the host's plan, else the plugin's name
  Table delta;
};

}  // namespace memory
}  // namespace memrt
