// memrt/plugin.h — the plugin SDK: the training loop, its phases, and what each phase may change.
//
// A plugin is a shared library exporting one C entry symbol (MEMRT_PLUGIN, at the bottom) whose
// object overrides the phases it needs. The host loads every plugin named by the configuration,
// orders them by priority, prints the order, and calls them at these points — this pseudocode is
// the engine's step function (runtime/src/engine/engine.cpp), line for line:
//
//   data = open train_file            # max_steps now known (from num_train_epochs if need be)
//   for plugin in plugins:            configure(options, diag, run)        # own config subtree only
//   params = the parameters from the model's shape (names, shapes, trainable, decay)
//   for plugin in plugins:            plan_params(ParamPlanContext)        # freeze, add, replace
//   for plugin in plugins:            estimate_memory(MemoryEstimate)      # its term of the memory plan
//   for plugin in plugins:            plan_store(StorePlanContext)         # on the estimate's plan
//   for plugin in plugins:            estimate_planned_memory(MemoryEstimate)  # terms of that layout
//   store = ParamStore(the estimate's plan)   # memrt/param_store.h: every buffer but the state
//   model = build_model(...)          # segments materialised one by one:
//       for each block:               on_block_ready(BlockReady)           # quantize early
//       each segment, once finished:  broadcast from rank 0, requires_grad := planned `trainable`,
//                                     store.adopt: parameters become views of the store's buffers
//                                     (placeholders when partitioned); their tensors go at once
//   for plugin in plugins:            transform_model(ModelContext)        # surgery: add what was planned
//   host: store.adopt(what transform_model added); store.finish(): every planned parameter
//         present (else an error naming it), the optimizer state allocated
//   optimizer = the fused step over the store
//   for plugin in plugins:            build_optimizer(OptimizerContext)    # wrap or replace it
//   for plugin in plugins:            on_train_begin(TrainContext)
//   while step < max_steps:
//       for micro in 0 .. grad_accum_steps-1:
//           for plugin:               before_forward(MicroStepContext)
//           h = model.embed(tokens)                 ─┐ each segment (embedding, block i, head):
//           for each block i: h = block_i(h)         │   before_segment_forward(SegmentContext)
//           logits = model.head(h)                   │   run through run_segment() wrappers
//                                                   ─┘   after_segment_forward(SegmentContext)   [reverse]
//           loss = cross_entropy(logits, targets) / grad_accum_steps
//           for plugin reversed:      after_forward(MicroStepContext)      # loss readable
//           for plugin:               before_backward(BackwardContext)     # may replace the loss
//           loss.backward()                         ─┐ as the gradient reaches each segment:
//                                                    │   before_segment_backward(SegmentContext)
//                                                    │   (segment backward; recompute if wrapped)
//                                                   ─┘   after_segment_backward(SegmentContext)  [reverse]
//           for plugin reversed:      after_backward(MicroStepContext)
//       for plugin:                   after_gradient_accumulation(StepContext)  # grads complete
//       host: all-reduce gradients (data parallel) unless a plugin reduces them itself, then take
//             StepContext::grads again from every trainable .grad (the all-reduce may replace one)
//       host: pass 1 — optimizer.grad_summary(), summed across ranks when partitioned: sets
//             StepContext::grad_norm (unscaled by grad_scale) and grads_finite
//       for plugin:                   before_optimizer_step(StepContext)   # check, vote skip
//       host: the vote — skip_step and stop_training agreed across ranks (any rank's counts for all)
//       host: if not skipped: optimizer.step(lr, 1 / (grad_scale * clip divisor))   # pass 2
//       for plugin reversed:          after_optimizer_step(StepContext)    # gather, copy back
//       host: zero grads; step += 1; log every steps_per_print (plugins add fields in add_metrics)
//       if the vote agreed to stop: break     # every rank after the same step (Control)
//       if eval_file is due (eval_steps): evaluate           # as after the loop, below
//   if eval_file: evaluate            # and `launcher eval`, after set-up (and --resume) alone:
//       model.eval(); no grad; for each batch of eval windows: the forward above, segment phases
//       and run_segment() wrappers included, with micro_step -1; no other phase runs
//   for plugin reversed:              on_train_end(TrainContext)
//   on any exception:                 on_error(ErrorContext), every plugin, reversed, then rethrow
//
// Before-phases run in ascending priority, after-phases ([reverse]) in descending priority, so a
// plugin can undo in an after-phase what it did in the matching before-phase (composer's rule).
//
// What each phase may change is what its context hands out as non-const: which parameters exist
// and which train only in plan_params; the model and its parameters only in on_block_ready and
// transform_model; the store's layout only in plan_store;
// the optimizer, the store's buffers and gradient hooks only in build_optimizer;
// the loss that is backpropagated only in before_backward; gradients from after_backward through
// before_optimizer_step; parameters again in after_optimizer_step. Observers (loggers, profilers)
// are plugins that only read.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/version.h>

#include "memrt/build_info.h"
#include "memrt/comm.h"
#include "memrt/config_node.h"
#include "memrt/error.h"
#include "memrt/memory.h"
#include "memrt/model.h"
#include "memrt/optimizer.h"
#include "memrt/param_store.h"

namespace memrt {

// ---- facts of the run, fixed at start -----------------------------------------------------------
struct RunInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int64_t train_batch_size = 0;
  int64_t micro_batch_size = 0;
  int64_t grad_accum_steps = 1;
  int64_t block_size = 0;   // tokens per sample (T)
  int64_t max_steps = 0;    // optimizer steps this run will take
  ModelShape shape;
  std::string output_dir;
  at::Device device = at::kCPU;
  int zero_stage = 0;       // zero_optimization.stage (0: plain data parallel)
  // ABI 2.10: the pretrained directory the model was read from, as the run names it ("" for random
  // init; `launcher export`: the base a checkpoint left its frozen parameters in).
  std::string model_name_or_path;
  // ABI 2.12: the head computes the loss a chunk of tokens at a time, never holding the logits
  // whole (train.yaml chunked_cross_entropy; ops::linear_cross_entropy_sum).
  bool chunked_cross_entropy = false;
  // ABI 2.21: micro-batches are packed rows of several samples (train.yaml sample_packing on a
  // dataset of samples): each brings its tokens' positions, and attention stays inside each sample
  // (docs/tokenizers.md, "Packing").
  bool sample_packing = false;
};

// ---- flow control: a small struct of flags, not a handle on the trainer ------------------------
struct Control {
  // Vote to skip this step's optimizer update (e.g. inf/NaN gradients, a loss spike). The host
  // agrees on it across ranks: if any rank votes, every rank skips. Parameters and optimizer
  // state stay untouched, the LR schedule does not advance, `step` still does (as in DeepSpeed).
  bool skip_step = false;
  std::string skip_reason;
  // Ask to stop training (like Hugging Face's TrainerControl.should_training_stop). The host reads
  // it once per step, in the same cross-rank vote as skip_step (after before_optimizer_step): if
  // it is set on any rank then, every rank finishes that step — the update (unless skipped),
  // after_optimizer_step, the log line — and leaves the loop after it; on_train_end follows. A
  // request made after the vote (in after_optimizer_step) counts in the next step's vote: that
  // step runs in full on every rank, and training stops after it. One rank behaves exactly as
  // many. The host never clears the flag. Stopping saves no checkpoint beyond the periodic ones.
  bool stop_training = false;
};

// ---- per-block segments -------------------------------------------------------------------------
enum class SegmentKind { kEmbedding, kBlock, kHead };
const char* to_string(SegmentKind kind);

struct SegmentContext {
  SegmentKind kind;
  int64_t index;                // block index; -1 for the embedding, num_blocks for the head
  Block* block;                 // the block (kBlock); nullptr for the embedding and the head
  // The parameters this segment's forward reads (the head's include a tied token embedding).
  const std::vector<at::Tensor>& params;
  int64_t step;                 // optimizer steps taken so far
  int64_t micro_step;           // 0 .. grad_accum_steps-1; -1 while evaluating (no grad)
  const RunInfo& run;
  Communicator& comm;
  // ABI 2.3. The store's slots of the parameters this segment owns (StorePlan::segment(slot) ==
  // index, in layout order: per group one range, StorePlan::segment_range), and of those it reads
  // but another segment owns (the head's tied token embedding, owned by the embedding).
  const std::vector<int>& slots;
  const std::vector<int>& shared;
  // ABI 2.15: the parameter store, in every run (launcher eval builds no optimizer, so
  // OptimizerContext never hands it over there): ZeRO-3 gathers a segment's weights into it.
  ParamStore* store = nullptr;
};

// run_segment() wrappers form a chain: each may run `next` differently (under no_grad with a
// recompute in backward, with gathered parameters, ...) and must return its result. `next` (and
// the SegmentContext it hands to inner wrappers) stays valid after run_segment returns: a wrapper
// may keep a copy and call it again inside backward (activation checkpointing's recompute).
using SegmentFn = std::function<at::Tensor(const at::Tensor&)>;

// ---- phase contexts -------------------------------------------------------------------------------
// A block's weights as built, before the store takes them in: random init, or the checkpoint's
// values. Under ZeRO-3 from a checkpoint, a weight the store partitions holds only the elements this
// rank keeps — the rest is zero, never read from the file (docs/zero.md): a trainable one always,
// a frozen one unless a plugin named it in ParamPlanContext::reads_frozen (ABI 2.20; a plugin built
// before 2.20 makes every frozen weight whole). So read here only the frozen weights you named (a
// base to quantize, DoRA's norms), and never read or change trainable weights.
struct BlockReady {
  int64_t index;
  Block& block;  // may be modified in place (quantize, cast frozen weights)
  const RunInfo& run;
  Communicator& comm;
  // ABI 2.7: the checkpoint the model is loaded from (memrt/model.h), or nullptr (random init).
  const CheckpointReader* checkpoint = nullptr;
};

// The model's parameters as they will be trained, before the model is touched (ABI 2.2): a plugin
// freezes (trainable = false), adds (LoRA's adapters) or replaces (a quantized base) parameters
// here, deciding from its config and the names and shapes alone. The host calls it on a list made
// from the model's shape, for the memory estimate (`launcher --estimate`, and at the start of a
// run) — since ABI 2.16 that plan is also the run's: the store is allocated from it before the
// model is built, each parameter's requires_grad is its `trainable`, and a parameter added here
// must be created by the plugin's transform_model. So the estimate and the run plan one store.
struct ParamPlanContext {
  std::vector<ParamInfo>& params;  // in model order; append what the plugin adds
  const RunInfo& run;
  // ABI 2.20: add the name of every frozen parameter (in `params` as planned) this plugin's
  // on_block_ready reads — a weight it quantizes and that layer's bias, a base whose norms it
  // takes. ZeRO-3 reads a frozen weight it partitions for this rank's share alone unless a plugin
  // named it here (BlockReady).
  std::set<std::string>& reads_frozen;
};

struct ModelContext {
  // May be modified: wrap modules, inject adapters (the parameters plan_params added). The model's
  // own parameters are in the parameter store already (ABI 2.16): their data, dtype and
  // requires_grad are the store's (a replicated one whole and readable; one ZeRO-3 partitions,
  // trainable or frozen, an empty placeholder: read a base weight in on_block_ready instead).
  CausalLM& model;
  const RunInfo& run;
  Communicator& comm;
};

// The store's layout, before anything is allocated: set this plugin's axis with the plan's setters
// (memrt/param_store.h). The same phase runs on a plan from shapes for `launcher --estimate`
// (run.rank and run.world_size are the estimated ones), so decide from the config only.
struct StorePlanContext {
  StorePlan& plan;
  const RunInfo& run;
};

// What to do with a trainable parameter's gradient the moment autograd has accumulated it (once
// per backward, after every use of the parameter: a tied weight's two uses included). `grad` is
// the parameter's .grad: a callback may read it, move it elsewhere and reset it (undefined: the
// callbacks after it then see none). LibTorch keeps one such hook per parameter, so the host
// installs it and calls, in order, every callback registered for the slot: the host's own first
// (fp32 accumulation into the store's flat gradient), then the plugins' in priority order.
using GradReadyFn = std::function<void(at::Tensor& grad)>;
class GradHooks {
 public:
  virtual ~GradHooks() = default;
  // `slot`: the parameter's slot in the store's plan (a trainable one).
  virtual void on_grad_ready(int slot, GradReadyFn fn) = 0;
};

struct OptimizerContext {
  CausalLM& model;
  // Writable here: a plugin may keep a reference and move bytes in and out of the store's buffers
  // (gradients, gathered compute copies) in the phases after this one. Its layout is fixed.
  ParamStore& store;
  // The optimizer the host built from the config, over the trainable parameters; replace or wrap it.
  std::unique_ptr<Optimizer>& optimizer;
  const RunInfo& run;
  Communicator& comm;
  GradHooks& grad_hooks;  // ABI 2.1
  // ABI 2.5: the kernels of state formats a plugin set (memrt/optimizer.h, StepKernel). The host's
  // Adam/AdamW step calls them for those groups; without one such a group is an error at start-up.
  StepKernels& step_kernels;
};

struct TrainContext {
  CausalLM& model;
  Optimizer& optimizer;
  const RunInfo& run;
  Communicator& comm;
  int64_t step;  // optimizer steps taken so far (resume: > 0)
};

struct MicroStepContext {
  CausalLM& model;
  const RunInfo& run;
  Communicator& comm;
  int64_t step;
  int64_t micro_step;
  const at::Tensor& inputs;   // (B, T) int64
  const at::Tensor& targets;  // (B, T) int64
  at::Tensor loss;            // after_forward/after_backward: this micro-batch's loss (already / GAS)
  Control& control;
};

struct BackwardContext {
  const RunInfo& run;
  int64_t step;
  int64_t micro_step;
  // The tensor backward() starts from; replace it to scale the loss (fp16 loss scaling).
  at::Tensor& loss;
};

struct StepContext {
  CausalLM& model;
  Optimizer& optimizer;
  const RunInfo& run;
  Communicator& comm;
  int64_t step;  // the step being taken (0-based)
  double lr;     // the learning rate this step uses
  Control& control;
  // after_optimizer_step only: whether the update was skipped (by any rank's vote).
  bool skipped = false;
  // Every trainable parameter's .grad as the optimizer will read it (taken again after the host's
  // all-reduce, which may replace one). Read-only for observers.
  std::vector<at::Tensor>& grads;
  // The factor the gradients carry (fp16: the loss scale). A plugin that scaled the loss sets it
  // in after_gradient_accumulation; the norm is divided by it and the step unscales by it.
  double grad_scale = 1.0;
  // Set by the host before before_optimizer_step (pass 1): the global L2 norm of the unscaled
  // gradients, and whether every gradient element on every rank is finite.
  double grad_norm = 0.0;
  bool grads_finite = true;
};

struct ErrorContext {
  const RunInfo& run;
  int64_t step;
  const std::exception& error;
};

// ---- export (ABI 2.8) ------------------------------------------------------------------------------
// `launcher export` loads the plugins a checkpoint's run used (its plugins.json), configures each
// with its saved options, runs plan_params on the model's shapes and then export_model, so that a
// parameter only its plugin understands (a 4-bit base, an adapter) is written by that plugin
// (docs/checkpoints.md, "Export").

// The checkpoint's parameters, by their names in the model, as the store saved them.
class SavedParameters {
 public:
  virtual ~SavedParameters() = default;
  virtual std::vector<std::string> names() const = 0;
  virtual bool trainable(const std::string& name) const = 0;
  // A frozen parameter's format as its plugin laid it out (FrozenLayout::format); "" for the rest.
  virtual const std::string& format(const std::string& name) const = 0;
  // The parameter's value ("weight": a trainable one's exact weight, its fp32 master where the run
  // kept one) or one of a frozen parameter's module buffers (FrozenLayout's names), whole, in the
  // dtype and shape it was saved in. memrt::FileError naming the file when it cannot be read.
  virtual at::Tensor read(const std::string& name, const std::string& buffer = "weight") const = 0;
};

struct ExportContext {
  const RunInfo& run;  // shape: the model of config.json; rank 0 of 1
  const SavedParameters& saved;
  // The tensors export writes, by Hugging Face name (sharded as the files of transformers). The host
  // has put every parameter of the model whose format is plain here, in fp32 and Hugging Face's
  // layout (GPT-2's Conv1D weights transposed) — read-only views of the checkpoint's mapped files
  // where it can, so never written in place; a plugin adds those it wrote, and may replace or
  // remove entries (an adapter merged into its base weight).
  std::map<std::string, at::Tensor>& tensors;
  // config.json as it will be written (transformers' keys for the model); a plugin adds its own
  // (quantization_config).
  ConfigNode& config;
  // Saved parameters a plugin has written (in any form): export refuses to finish while a saved
  // parameter is neither here nor among the model's plain ones, naming it and its format.
  std::set<std::string>& handled;
  // ABI 2.9: `launcher export --merge`: a plugin's additions folded into the model's own weights
  // (LoRA's B A added to its base weight), so the folder is a plain model; a plugin whose format
  // cannot be merged refuses, naming it.
  bool merge = false;
};

// ---- checkpoint files (ABI 2.9) ---------------------------------------------------------------------
// When a checkpoint is saved, once every rank has written its share of the store, rank 0 hands each
// plugin the checkpoint as saved, before it is put in place: a plugin writes files of its own
// there, in the formats users' tools read (PEFT's adapter_config.json and adapter_model.safetensors,
// which PeftModel.from_pretrained loads from the checkpoint's folder), and lists them; the manifest
// covers them like the rest (docs/checkpoints.md).
struct CheckpointFilesContext {
  const RunInfo& run;
  const SavedParameters& saved;  // the checkpoint's store, read back from its files
  const std::string& dir;        // the checkpoint's folder, as it is being written
  std::vector<std::string>& files;  // append the names (relative to dir) of the files written
};

// Extra fields for the log line and metrics.jsonl (e.g. "loss_scale", "skipped_steps").
using Metrics = std::map<std::string, double>;

// ---- the plugin -----------------------------------------------------------------------------------
// Priority bands of the built-in plugins; third-party plugins default to kObserver and may pick any
// value. Lower runs first in before-phases. Model transforms apply in this order: quantize base
// weights, inject adapters, set precision, wrap blocks for recompute, then partition.
namespace priority {
constexpr int kQuant = 100;
constexpr int kLora = 200;
constexpr int kPrecision = 300;
constexpr int kCheckpoint = 400;
constexpr int kZero = 500;
constexpr int kObserver = 1000;
}  // namespace priority

class Plugin {
 public:
  virtual ~Plugin() = default;

  virtual int priority() const { return priority::kObserver; }
  // Plugins this one cannot run with (by name); the host refuses to start, naming both.
  virtual std::vector<std::string> conflicts_with() const { return {}; }
  // True if this plugin reduces gradients across ranks itself (ZeRO); the host's data-parallel
  // all-reduce is then off. At most one plugin may say so.
  virtual bool reduces_gradients() const { return false; }

  // Receives only its own config subtree; must reject keys it does not know (ConfigReader::finish).
  virtual void configure(const ConfigNode& /*options*/, ConfigDiagnostics& /*diag*/,
                         const RunInfo& /*run*/) {}

  virtual void on_block_ready(BlockReady& /*ctx*/) {}
  virtual void transform_model(ModelContext& /*ctx*/) {}
  virtual void plan_store(StorePlanContext& /*ctx*/) {}
  virtual void build_optimizer(OptimizerContext& /*ctx*/) {}
  virtual void on_train_begin(TrainContext& /*ctx*/) {}

  virtual void before_forward(MicroStepContext& /*ctx*/) {}
  virtual void before_segment_forward(SegmentContext& /*ctx*/) {}
  // Wraps how a segment runs. Override wraps_segments() to return true to be put in the chain.
  virtual bool wraps_segments() const { return false; }
  virtual at::Tensor run_segment(SegmentContext& /*ctx*/, const at::Tensor& x, const SegmentFn& next) {
    return next(x);
  }
  virtual void after_segment_forward(SegmentContext& /*ctx*/) {}
  virtual void after_forward(MicroStepContext& /*ctx*/) {}
  virtual void before_backward(BackwardContext& /*ctx*/) {}
  virtual void before_segment_backward(SegmentContext& /*ctx*/) {}
  virtual void after_segment_backward(SegmentContext& /*ctx*/) {}
  virtual void after_backward(MicroStepContext& /*ctx*/) {}

  virtual void after_gradient_accumulation(StepContext& /*ctx*/) {}
  virtual void before_optimizer_step(StepContext& /*ctx*/) {}
  virtual void after_optimizer_step(StepContext& /*ctx*/) {}
  virtual void add_metrics(Metrics& /*metrics*/) {}

  // Checkpoint state, versioned: a plugin bumps state_version() when the layout changes and
  // refuses (with a clear error) versions it cannot read. Parameters' values and optimizer state
  // belong in the parameter store, which checkpoints save and export reads; a plugin's state is
  // what it adds (a loss scaler's counters), replicated across ranks: a run resumed on another
  // number of ranks gives every rank rank 0's.
  virtual int state_version() const { return 1; }
  virtual TensorMap state_dict() const { return {}; }
  virtual void load_state_dict(const TensorMap& /*state*/, int /*version*/) {}

  virtual void on_train_end(TrainContext& /*ctx*/) {}
  virtual void on_error(ErrorContext& /*ctx*/) {}

  // Memory this plugin adds, removes or moves, predicted from shapes alone: edit `estimate` (the
  // plan of plugins before this one, for estimate.run's rank and world size). Called by
  // `launcher --estimate` and at the start of every run; never allocates the model. The host
  // records what changed as this plugin's term. Tensors the plugin allocates while training are
  // counted where memory::claim() puts them (memrt/memory.h, docs/memory.md).
  virtual void estimate_memory(memory::MemoryEstimate& /*estimate*/) const {}

  // ---- ABI 2.2 (a minor appends its phases here, after every older one: the host never calls
  // them on a plugin built with an older minor, whose vtable has no slot for them) ----

  // Which parameters train, exist or are replaced (ParamPlanContext). Runs before
  // estimate_memory, which sees the result in MemoryEstimate::params and ::store.
  virtual void plan_params(ParamPlanContext& /*ctx*/) {}

  // ---- ABI 2.4 ----

  // The estimate's second pass, once every plugin's plan_store has laid out estimate.store (its
  // groups, dtypes, placements and alignment as the run will have them): for terms that depend on
  // that layout (ZeRO stage 2's buckets). Recorded in this plugin's term like estimate_memory.
  virtual void estimate_planned_memory(memory::MemoryEstimate& /*estimate*/) const {}

  // ---- ABI 2.8 ----

  // `launcher export`: write the parameters in this plugin's formats (ExportContext).
  virtual void export_model(ExportContext& /*ctx*/) {}

  // ---- ABI 2.9 ----

  // A checkpoint is being saved: add this plugin's files to it (CheckpointFilesContext). Rank 0.
  virtual void write_checkpoint_files(CheckpointFilesContext& /*ctx*/) {}
};

}  // namespace memrt

// ---- the handshake ------------------------------------------------------------------------------
// The one exported symbol. Plain C layout; fields are only ever appended (struct_size tells the
// host which ones exist). Minor versions only append virtual functions to Plugin; the host calls
// them only on plugins built with that minor or later; context structs only grow at their end.
// ABI 2.0: the parameter store (plan_store, Optimizer::step(StepScalars), StepContext::grad_scale;
// checkpoints save the store). 2.1: OptimizerContext::grad_hooks, a writable store there.
// 2.2: Plugin::plan_params (ParamPlanContext), ConfigNode::as_names. 2.3: the store's per-group
// setters (GroupSelector), state formats (StateFormat), segment order (StorePlan::segment_range)
// and SegmentContext::slots / ::shared. 2.4: Plugin::estimate_planned_memory. 2.5:
// OptimizerContext::step_kernels (StepKernel, StepRange in memrt/optimizer.h). 2.6: the CPU kernel
// dispatch in memrt/ops.h (ops::CpuKernels, cpu_supports, to_string). 2.7: BlockReady::checkpoint
// (CheckpointReader in memrt/model.h: a replaced parameter stored in a plugin's format). 2.8:
// Plugin::export_model (ExportContext, SavedParameters), StorePlan::set_weights_category,
// ConfigNode::real. 2.9: Plugin::write_checkpoint_files (CheckpointFilesContext), memrt/safetensors.h
// in the SDK, model_parameter_shapes (memrt/model.h), ExportContext::merge. 2.10:
// RunInfo::model_name_or_path. 2.11: StorePlan::keep_weights_only (launcher eval's store). 2.12:
// RunInfo::chunked_cross_entropy, the chunked head in memrt/ops.h and the activation estimates
// (memrt/memory.h). 2.13: partitioned compute weights in the store (StorePlan::set_extent(kCompute,
// kPartition), ParamStore::attach / release). 2.14: memory::activations_op_by_op. 2.15:
// SegmentContext::store. 2.16: ParamStore(plan, device), adopt, finish. 2.17: partitioned frozen
// weights (FrozenLayout::extent kPartition, StorePlan::frozen_partition, ParamStore::attach_frozen /
// release_frozen). 2.18: Communicator::broadcast_async (ZeRO-3's prefetch). 2.19:
// MemoryEstimate's gradient elements per backward candidate and choose_backward_peak. 2.20:
// ParamPlanContext::reads_frozen (ZeRO-3 reads the other partitioned frozen weights as slices of a
// checkpoint), Communicator::reduce_sum (ZeRO's gradient buckets onto their owners). 2.21: RunInfo::sample_packing,
// ActivationEstimate::layout, activation_estimate(run, dtype, params), ops::causal_attention's
// positions (packed rows). The host
// refuses a plugin whose ABI major differs, whose ABI minor is newer than the host's, or whose
// LibTorch version, C++ ABI flag or CUDA flag differ from its own — plugins pass at::Tensor and
// nn::Module across the boundary, the same contract as PyTorch C++ extensions.
#define MEMRT_PLUGIN_ABI_MAJOR 2
#define MEMRT_PLUGIN_ABI_MINOR 21
#define MEMRT_PLUGIN_ENTRY_SYMBOL "memrt_plugin_entry"

extern "C" {
struct memrt_plugin_info {
  uint32_t struct_size;
  uint32_t abi_major;
  uint32_t abi_minor;
  const char* torch_version;  // TORCH_VERSION the plugin was compiled against
  int32_t cxx11_abi;          // _GLIBCXX_USE_CXX11_ABI
  int32_t cuda;               // compiled against a CUDA LibTorch
  const char* name;           // unique; what the config and the printed plan call it
  const char* version;
  const char* description;
  memrt::Plugin* (*create)(void);
  void (*destroy)(memrt::Plugin*);
};
typedef const memrt_plugin_info* (*memrt_plugin_entry_fn)(void);
}

#ifndef _GLIBCXX_USE_CXX11_ABI
#define MEMRT_CXX11_ABI 0
#else
#define MEMRT_CXX11_ABI _GLIBCXX_USE_CXX11_ABI
#endif
// Whether the LibTorch this plugin compiles against has CUDA: memrt_add_plugin() defines it from
// the Torch package it finds; otherwise assume the SDK's own build.
#ifndef MEMRT_PLUGIN_TORCH_CUDA
#define MEMRT_PLUGIN_TORCH_CUDA MEMRT_TORCH_HAS_CUDA
#endif

// MEMRT_PLUGIN(MyPlugin, "my_plugin", "1.0", "what it does") in exactly one .cpp of the plugin.
#define MEMRT_PLUGIN(Class, Name, Version, Description)                                   \
  extern "C" __attribute__((visibility("default"))) const memrt_plugin_info*              \
  memrt_plugin_entry(void) {                                                              \
    static const memrt_plugin_info info = {                                               \
        sizeof(memrt_plugin_info), MEMRT_PLUGIN_ABI_MAJOR, MEMRT_PLUGIN_ABI_MINOR,        \
        TORCH_VERSION, MEMRT_CXX11_ABI, MEMRT_PLUGIN_TORCH_CUDA, Name, Version,             \
        Description, []() -> memrt::Plugin* { return new Class(); },                      \
        [](memrt::Plugin* p) { delete p; }};                                              \
    return &info;                                                                         \
  }
