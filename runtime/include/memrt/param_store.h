// memrt/param_store.h — the parameter store: every byte of every parameter's training state, kept
// once, in a layout all plugins configure and none owns privately (docs/parameter-store.md).
//
// Two objects, two moments:
//   StorePlan   what will be allocated: one slot per model parameter, the trainable ones laid end
//               to end in flat groups, and for each group the dtype, extent (full or this rank's
//               partition) and placement (device or host) of each of its buffers. The host builds
//               it from the model after transform_model; plugins set their axis in
//               Plugin::plan_store; nothing is allocated while they decide. `launcher --estimate`
//               runs the same phase on a plan built from shapes, so estimate and run agree.
//   ParamStore  the allocated buffers: each once, counted in its memory category and placement.
//               Trainable module parameters are views of their group's compute buffer; frozen
//               ones keep their own storage, in their compute dtype.
//
// Buffers of a group (StoreBuffer):
//   kCompute  what forward reads; a module parameter is a view of its range.
//   kMaster   fp32 copy the optimizer updates when the compute dtype is 16-bit.
//   kGrad     the gradient. Extent full in the compute dtype: autograd's own .grad per parameter
//             (not allocated by the store; the step reads it). Extent full in fp32 under 16-bit
//             compute: a flat buffer the host adds each .grad into as autograd hands it over (and
//             all-reduces). Extent partition: a flat buffer of this rank's partition that a
//             gradient-partitioning plugin (ZeRO-2) reduces into.
//   kState    the optimizer's state, one flat buffer per StorePlan::state_names() entry: fp32, or
//             bf16 (set_state_dtype: DeepSpeed's bf16_optimizer_states).
//
// Layout of group g (N ranks, A the alignment in elements):
//   | p_0 | p_1 | ... | p_k | pad |   padded = round_up(sum numel, N * A); rank r owns the
//   element range [r * padded / N, (r + 1) * padded / N). Padding is zeros and stays zeros.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "memrt/memory.h"

namespace memrt {

enum class StoreBuffer : uint8_t { kCompute, kMaster, kGrad, kState };
constexpr int kNumStoreBuffers = 4;
const char* to_string(StoreBuffer b);  // "compute", "master", "grad", "state"

enum class Extent : uint8_t { kFull, kPartition };
const char* to_string(Extent e);  // "full", "partition"

// Element positions [begin, end) in a group's buffers. `a & b` is the positions in both (empty
// when they are disjoint): the one piece of arithmetic for "the part of this parameter in that
// partition / bucket / shard". An aggregate, so `auto [lo, hi] = range;` reads it.
struct ElementRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end > begin ? end - begin : 0; }
  bool empty() const { return end <= begin; }
  ElementRange operator&(const ElementRange& o) const {
    return {begin > o.begin ? begin : o.begin, end < o.end ? end : o.end};
  }
  bool operator==(const ElementRange& o) const { return begin == o.begin && end == o.end; }
};

// How one buffer of a group is kept.
struct BufferLayout {
  bool present = true;  // kMaster: only with a 16-bit compute dtype; kState: not without state
  at::ScalarType dtype = at::kFloat;
  Extent extent = Extent::kFull;
  memory::Placement placement = memory::Placement::kDevice;
};

// A model parameter as the plan sees it: from the model (named_parameters) or from shapes.
struct ParamInfo {
  std::string name;  // Hugging Face name, as the module's state dict has it
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  bool trainable = true;
  bool decay = true;  // in the weight-decay group (else weight decay 0)
};

struct ParamSlot {
  ParamInfo param;
  int64_t numel = 0;
  int group = -1;      // trainable: its group; frozen: -1
  int64_t offset = 0;  // trainable: its first element in the group
};

struct StoreGroup {
  std::string name;  // "decay", "no_decay", or a plugin's (add_group)
  double weight_decay = 0.0;
  double lr_scale = 1.0;   // the step's learning rate is the schedule's times this
  std::vector<int> slots;  // StorePlan::slots() indices, in layout (model) order
  int64_t numel = 0;       // elements of its parameters
  int64_t padded = 0;      // numel rounded up to world_size * alignment
  std::array<BufferLayout, kNumStoreBuffers> buffers;

  const BufferLayout& buffer(StoreBuffer b) const { return buffers[static_cast<size_t>(b)]; }
};

// A group a plugin creates (StorePlan::add_group): the trainable parameters `select` accepts leave
// the group they were in for this one, with its own weight decay and learning-rate multiplier
// (LoRA+'s B matrices at 16x, bitsandbytes' small tensors kept in 32-bit state, ...).
struct GroupSpec {
  std::string name;
  std::function<bool(const ParamInfo&)> select;
  double weight_decay = 0.0;
  double lr_scale = 1.0;
};

struct StoreOptions {
  std::string optimizer = "AdamW";  // "Adam", "AdamW", "SGD": which state buffers
  double momentum = 0.0;            // SGD: a momentum buffer only when != 0
  double weight_decay = 0.0;        // the "decay" group's
  int rank = 0;
  int world_size = 1;
};

class StorePlan {
 public:
  // One slot per parameter in the given order; trainable ones in the "decay" or "no_decay" group.
  // Every trainable parameter must be floating point; a group's parameters must share a dtype.
  StorePlan(const std::vector<ParamInfo>& params, const StoreOptions& options);

  const std::vector<ParamSlot>& slots() const { return slots_; }
  const std::vector<StoreGroup>& groups() const { return groups_; }
  // Optimizer state buffers of each group: {"exp_avg", "exp_avg_sq"} (Adam), {"momentum_buffer"}
  // (SGD with momentum), {} (SGD without).
  const std::vector<std::string>& state_names() const { return state_names_; }
  int rank() const { return options_.rank; }
  int world_size() const { return options_.world_size; }
  int64_t alignment() const { return alignment_; }
  const StoreOptions& options() const { return options_; }

  // This rank's element range of group g's buffers of extent kPartition.
  ElementRange partition(int g) const { return partition(g, options_.rank); }
  // Rank r's.
  ElementRange partition(int g, int r) const;
  // Whether the optimizer's side of group g (master, state or gradient) is partitioned (ZeRO >= 1),
  // whether or not those buffers exist.
  bool partitioned(int g) const;
  // The elements of group g this rank's optimizer steps: its partition when partitioned(g), else
  // all of them. Decided by the extents the
  // plugins set, whether or not those buffers exist (fp32 SGD without momentum has neither).
  ElementRange step_range(int g) const;
  // Slot i's elements in group positions: [offset, offset + numel). Throws for a frozen slot.
  ElementRange range(int slot) const;
  // Elements this rank holds of buffer b of group g (0 when absent or autograd-owned).
  int64_t held_numel(int g, StoreBuffer b) const;
  int64_t find(const std::string& name) const;  // slot index, -1 if none
  // Whether group g's gradient is a flat buffer of the store (partitioned, or of another dtype
  // than the compute copy: fp32 accumulation) rather than autograd's own .grad per parameter.
  bool flat_grad(int g) const;

  // ---- the setters plugins call in plan_store ----
  // Moves the trainable parameters spec.select accepts into a new group (laid out after the others,
  // in model order; a group left empty disappears) and returns its index. Its buffers start as the
  // moved parameters' group had them. An unknown or empty selection, a name in use, or parameters
  // of two compute dtypes are errors naming the group.
  int add_group(const GroupSpec& spec);
  // Each applies to every group (and set_compute_dtype to floating frozen parameters too). Who
  // called is recorded: a second plugin setting one axis to another value is an error naming both.
  void set_compute_dtype(at::ScalarType dtype);     // fp32, bf16 or fp16
  // fp32 masters; needs a 16-bit compute dtype. Set explicitly off, bf16 weights are updated in
  // place (DeepSpeed's bf16_master_weights_and_grads): the step computes in fp32 and rounds.
  void set_master_weights(bool on);
  void set_state_dtype(at::ScalarType dtype);       // Adam's moments: fp32 (default) or bf16
  void set_grad_dtype(at::ScalarType dtype);        // DeepSpeed's data_types.grad_accum_dtype
  void set_extent(StoreBuffer b, Extent extent);    // kCompute: full only (stage 3 is not built)
  void set_placement(StoreBuffer b, memory::Placement placement);
  void require_alignment(int64_t elements);         // the alignment becomes the lcm
  // Whether the settings make a store the step can run (the host calls it after every plugin's
  // plan_store): 16-bit compute needs fp32 masters (bf16 may go without, when a plugin set
  // masters off), fp32 has none, gradients are the compute dtype or fp32. Throws memrt::Error
  // saying what to change.
  void check() const;

  // This rank's bytes of every buffer the store allocates, by (category, placement): compute ->
  // weights (frozen parameters included), master -> master_weights, grad (flat) -> gradients,
  // state -> optimizer_state.
  memory::Table bytes() const;
  // One line per group, for the start-up log.
  std::string describe() const;

  // The host names the plugin whose plan_store runs ("" while the host sets defaults).
  void set_author(std::string author) { author_ = std::move(author); }

 private:
  void record(const std::string& axis, const std::string& value);
  void relayout();
  BufferLayout& buffer(StoreGroup& g, StoreBuffer b) { return g.buffers[static_cast<size_t>(b)]; }

  StoreOptions options_;
  std::vector<ParamSlot> slots_;
  std::vector<StoreGroup> groups_;
  std::vector<std::string> state_names_;
  int64_t alignment_ = 16;  // 64 bytes of fp32: every partition starts on a cache line
  std::string author_;
  std::map<std::string, std::pair<std::string, std::string>> set_by_;  // axis -> (value, plugin)
};

// The allocated store.
class ParamStore {
 public:
  struct Group {
    at::Tensor compute;  // (padded) in the compute dtype; module parameters are views of it
    at::Tensor master;   // fp32, (held) elements; undefined without masters
    at::Tensor grad;     // flat partition gradient; undefined when autograd's .grad is the grad
    std::vector<at::Tensor> state;  // one per StorePlan::state_names(), fp32, (held) elements
  };

  // Allocates every buffer of `plan` once and fills it from `params` (the model's parameters, the
  // plan's names in any order, fp32 or any floating dtype): masters from the values before they
  // are cast, compute buffers cast from them, state zeros. Each trainable parameter then becomes
  // (set_data) a view of its range of the compute buffer, each floating frozen one is cast to the
  // compute dtype. Throws memrt::Error naming a parameter the plan and `params` disagree on.
  ParamStore(StorePlan plan, const std::vector<std::pair<std::string, at::Tensor>>& params,
             at::Device device);

  const StorePlan& plan() const { return plan_; }
  const std::vector<Group>& groups() const { return groups_; }
  std::vector<Group>& groups() { return groups_; }
  // The module parameter of slot i (a view of its group's compute buffer when trainable).
  const at::Tensor& param(int slot) const { return params_[static_cast<size_t>(slot)]; }

  // Slot i's elements in buffer b as this rank holds them, in the parameter's flat order:
  // {view, first}: `view` covers the parameter's elements [first, first + view.numel()). For a
  // full buffer that is the whole parameter; for a partition the part of it this rank owns
  // (numel 0 when none). b is kCompute, kMaster, kGrad (flat only) or kState (state index k).
  std::pair<at::Tensor, int64_t> slice(int slot, StoreBuffer b, int state = 0) const;

 private:
  StorePlan plan_;
  std::vector<Group> groups_;
  std::vector<at::Tensor> params_;
};

}  // namespace memrt
