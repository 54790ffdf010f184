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
//               ones keep their own storage (with the module buffers their FrozenLayout names),
//               plain ones in the compute dtype.
//
// Buffers of a group (StoreBuffer):
//   kCompute  what forward reads; a module parameter is a view of its range.
//   kMaster   fp32 copy the optimizer updates when the compute dtype is 16-bit.
//   kGrad     the gradient. Extent full in the compute dtype: autograd's own .grad per parameter
//             (not allocated by the store; the step reads it). Extent full in fp32 under 16-bit
//             compute: a flat buffer the host adds each .grad into as autograd hands it over (and
//             all-reduces). Extent partition: a flat buffer of this rank's partition that a
//             gradient-partitioning plugin (ZeRO-2) reduces into.
//   kState    the optimizer's state in the group's StateFormat: one flat tensor per state tensor
//             of the format — per StorePlan::state_names() entry in fp32 or bf16 (set_state_dtype:
//             DeepSpeed's bf16_optimizer_states), or codes and per-block scales of a quantized
//             format a plugin sets (set_state_format).
//
// Layout of group g (N ranks, A its alignment in elements), its parameters in segment order (the
// embedding, block 0, ..., the head; model order within a segment):
//   | p_0 | p_1 | ... | p_k | pad |   padded = round_up(end of p_k, N * A); rank r owns the
//   element range [r * padded / N, (r + 1) * padded / N). Padding is zeros and stays zeros. With
//   a blockwise state format (blocks_per_tensor) each parameter starts on a block boundary.
//
// ABI: plugins built against an older 2.x header index slots(), groups() and these structs inline,
// so their layouts never change within major 2; what 2.3 added lives behind member functions.
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
  std::string name;  // "decay", "no_decay", or a plugin's or the host's (add_group)
  double weight_decay = 0.0;
  double lr_scale = 1.0;   // the step's learning rate is the schedule's times this
  std::vector<int> slots;  // StorePlan::slots() indices, in layout (segment, then model) order
  int64_t numel = 0;       // up to its last parameter's end (gaps before block-aligned ones included)
  int64_t padded = 0;      // numel rounded up to world_size * StorePlan::group_alignment
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

// Which groups a setter of the plan applies to: every group (the default), the group of one name,
// or those a predicate accepts. A selector that matches no group is an error naming the groups.
class GroupSelector {
 public:
  GroupSelector() = default;  // every group
  GroupSelector(std::string name);  // NOLINT(google-explicit-constructor): plan.set_x(v, "lora_B")
  GroupSelector(const char* name) : GroupSelector(std::string(name)) {}  // NOLINT
  // `description` names the selection in errors ("groups of 8-bit state").
  GroupSelector(std::string description, std::function<bool(const StoreGroup&)> match);

  bool every() const { return !match_; }
  bool matches(const StoreGroup& g) const { return !match_ || match_(g); }
  const std::string& description() const { return description_; }  // "every group", "group 'x'"

 private:
  std::string description_ = "every group";
  std::function<bool(const StoreGroup&)> match_;
};

// One tensor of an optimizer state format: `per_value` consecutive elements of the group share one
// value, so it holds ceil(n / per_value) values of `dtype` for n elements. 1: one value per
// element (fp32 and bf16 moments, 8-bit codes); 2: two 4-bit codes in a byte; B: one per block of
// B (a block's absmax).
struct StateTensor {
  std::string name;  // in checkpoints: a state name ("exp_avg") or one with a suffix ("exp_avg.absmax")
  at::ScalarType dtype = at::kFloat;
  int64_t per_value = 1;
};

// How a group keeps its optimizer state. `plain` formats (fp32, bf16) are one tensor per state name
// with one value per element; quantized formats (a plugin's) are several tensors per state name.
// `block` is the quantization block in elements; every tensor's per_value divides it. With
// `blocks_per_tensor` (bitsandbytes and torchao: each tensor's first element starts a block) every
// parameter of the group starts on a block boundary; a format with blocks must have it, so a
// parameter's state is its own and re-partitions by name.
struct StateFormat {
  std::string name = "fp32";  // "fp32", "bf16", or the plugin's ("bnb_blockwise8", "ao4", ...)
  std::vector<StateTensor> tensors;
  int64_t block = 1;
  bool blocks_per_tensor = false;

  // One tensor per state name, named after it, one value of `dtype` per element.
  static StateFormat plain(at::ScalarType dtype, const std::vector<std::string>& state_names);
  bool is_plain() const;  // block 1 and every tensor one fp32 or bf16 value per element
};

// One tensor of a frozen slot: the parameter itself, or a module buffer that travels with it (a
// quantized weight's per-block scales), by the name the model's state dict gives it.
struct FrozenTensor {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  memory::Category category = memory::Category::kWeights;  // kQuantState for codes and scales
};

// How a frozen parameter is kept. Its tensors, the parameter first; `format` "" is a plain weight
// (one floating tensor, cast by set_compute_dtype for every group), anything else (a plugin's
// "nf4") is never cast. On the device or in host memory; replicated (extent full) or, for a plain
// weight alone (ZeRO-3, ABI 2.17), partitioned: each rank keeps its share of the flat elements
// (StorePlan::frozen_partition) and the parameter rests as a placeholder between
// ParamStore::attach_frozen and release_frozen.
struct FrozenLayout {
  std::string format;
  std::vector<FrozenTensor> tensors;
  Extent extent = Extent::kFull;
  memory::Placement placement = memory::Placement::kDevice;
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
  // Every parameter is in segment 0.
  StorePlan(const std::vector<ParamInfo>& params, const StoreOptions& options);
  // The same with each parameter's segment (parallel to `params`: SegmentContext::index, -1 the
  // embedding, i block i, the number of blocks the head): groups are laid out in segment order.
  StorePlan(const std::vector<ParamInfo>& params, const StoreOptions& options,
            const std::vector<int64_t>& segments);

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

  // ---- ABI 2.3 ----
  int64_t segment(int slot) const;
  // Group g's elements of the parameters of `segment`: one contiguous range (empty when the
  // segment has none in g): what ZeRO-3 gathers and a step in backward steps.
  ElementRange segment_range(int g, int64_t segment) const;
  // The slots (trainable and frozen) of `segment`, in layout order.
  std::vector<int> segment_slots(int64_t segment) const;
  const StateFormat& state_format(int g) const;
  // Group g's alignment: alignment() and its state format's block (so no block straddles two
  // ranks); its padded length is a multiple of world_size() times it.
  int64_t group_alignment(int g) const;
  // Values this rank holds of state tensor k of group g's format (0 when the group keeps none).
  int64_t held_state_values(int g, int k) const;
  // A frozen slot's layout: by default its parameter alone, plain, in its (compute) dtype, as
  // weights on the device. Throws for a trainable slot.
  const FrozenLayout& frozen_layout(int slot) const;
  // ---- ABI 2.17 ----
  // The flat elements of frozen slot `slot` rank r keeps when its layout is partitioned:
  // [min(n, r·c), min(n, (r+1)·c)), c = ceil(n / world_size()) (DeepSpeed's per-parameter share;
  // empty for a rank past the end); all of them when replicated.
  ElementRange frozen_partition(int slot, int r) const;
  ElementRange frozen_partition(int slot) const { return frozen_partition(slot, options_.rank); }

  // ---- the setters plugins call in plan_store ----
  // Moves the trainable parameters spec.select accepts into a new group (laid out after the others,
  // in segment order; a group left empty disappears) and returns its index. Its buffers and state
  // format start as the moved parameters' group had them. An unknown or empty selection, a name in
  // use, or parameters of groups whose layouts differ are errors naming the group.
  int add_group(const GroupSpec& spec);
  // Each applies to the groups `groups` selects, every group by default (set_compute_dtype for
  // every group also casts the floating frozen parameters). Who called is recorded per group: a
  // second plugin setting one axis of one group to another value is an error naming both.
  void set_compute_dtype(at::ScalarType dtype, const GroupSelector& groups);  // fp32, bf16, fp16
  // fp32 masters; needs a 16-bit compute dtype. Set explicitly off, bf16 weights are updated in
  // place (DeepSpeed's bf16_master_weights_and_grads): the step computes in fp32 and rounds.
  void set_master_weights(bool on, const GroupSelector& groups);
  // Adam's moments in fp32 (the default) or bf16: the plain format of that dtype.
  void set_state_dtype(at::ScalarType dtype, const GroupSelector& groups);
  // A quantized (or any) format: checked (StateFormat's rules); the groups' alignment grows to its
  // block (group_alignment) and blocks_per_tensor lays their parameters out on block boundaries.
  void set_state_format(const StateFormat& format, const GroupSelector& groups = GroupSelector());
  // A frozen slot's tensors and format (a quantizing plugin: the codes, then the buffers that hold
  // its scales): the first tensor is the slot's parameter as planned (name, dtype, shape); names
  // are unique and no other slot's; extent kPartition only for a plain weight alone. Recorded
  // per slot like the groups' axes.
  void set_frozen_layout(int slot, FrozenLayout layout);
  // Where every frozen slot is kept (device or host memory).
  void set_frozen_placement(memory::Placement placement);
  void set_grad_dtype(at::ScalarType dtype, const GroupSelector& groups);  // grad_accum_dtype
  // kCompute at kPartition (ZeRO-3, ABI 2.13) needs the group's gradient partitioned too (check()).
  void set_extent(StoreBuffer b, Extent extent, const GroupSelector& groups);
  void set_placement(StoreBuffer b, memory::Placement placement, const GroupSelector& groups);
  // ABI 2.8: the memory category the groups' compute weights are counted in (weights by default),
  // so that a plugin's own trainable parameters are reported apart: LoRA's adapters as adapters.
  // A group made by add_group from them keeps it.
  void set_weights_category(memory::Category category, const GroupSelector& groups);
  memory::Category weights_category(int group) const;
  // Every group (and, before 2.3, the only form): the same as with GroupSelector().
  void set_compute_dtype(at::ScalarType dtype);
  void set_master_weights(bool on);
  void set_state_dtype(at::ScalarType dtype);
  void set_grad_dtype(at::ScalarType dtype);
  void set_extent(StoreBuffer b, Extent extent);
  void set_placement(StoreBuffer b, memory::Placement placement);
  void require_alignment(int64_t elements);         // the alignment becomes the lcm
  // Whether the settings make a store the step can run (the host calls it after every plugin's
  // plan_store): 16-bit compute needs fp32 masters (bf16 may go without, when a plugin set
  // masters off), fp32 has none, gradients are the compute dtype or fp32, partitioned compute
  // weights come with a partitioned gradient. Throws memrt::Error
  // saying what to change. A weights-only plan takes no step and passes.
  void check() const;
  // ABI 2.11: the plan of a store that evaluates and takes no step (`launcher eval`): every group
  // keeps its compute copy as planned and drops its masters, gradients and optimizer state; frozen
  // slots stay as they are. The host calls it after every plugin's plan_store.
  void keep_weights_only();
  bool weights_only() const { return weights_only_; }

  // This rank's bytes of every buffer the store allocates, by (category, placement): compute ->
  // its group's weights_category (weights unless set; frozen parameters: their layout's), master ->
  // master_weights, grad (flat) -> gradients, state (every tensor of its format) -> optimizer_state.
  memory::Table bytes() const;
  // One line per group, for the start-up log.
  std::string describe() const;

  // The host names the plugin whose plan_store runs ("" while the host sets defaults).
  void set_author(std::string author) { author_ = std::move(author); }

 private:
  void record_key(const std::string& key, const std::string& value);
  void record(const StoreGroup& g, const std::string& axis, const std::string& value);
  const std::string* recorded(const StoreGroup& g, const std::string& axis) const;
  // The groups `groups` selects (an error naming the groups when none).
  std::vector<int> selected(const GroupSelector& groups, const char* setter) const;
  void relayout();
  BufferLayout& buffer(StoreGroup& g, StoreBuffer b) { return g.buffers[static_cast<size_t>(b)]; }

  StoreOptions options_;
  std::vector<ParamSlot> slots_;
  std::vector<StoreGroup> groups_;
  std::vector<std::string> state_names_;
  int64_t alignment_ = 16;  // 64 bytes of fp32: every partition starts on a cache line
  std::string author_;
  std::map<std::string, std::pair<std::string, std::string>> set_by_;  // axis -> (value, plugin)
  // ---- added in ABI 2.3, after every member an older plugin's inline accessors read ----
  std::vector<int64_t> segments_;      // per slot
  std::vector<StateFormat> formats_;   // per group
  std::vector<FrozenLayout> frozen_;   // per slot (empty for a trainable one)
  // ---- added in ABI 2.8 ----
  std::map<std::string, memory::Category> weights_category_;  // by group name; absent: weights
  // ---- added in ABI 2.11 ----
  bool weights_only_ = false;
};

// The allocated store.
class ParamStore {
 public:
  struct Group {
    at::Tensor compute;  // (padded) in the compute dtype; module parameters are views of it
    at::Tensor master;   // fp32, (held) elements; undefined without masters
    at::Tensor grad;     // flat partition gradient; undefined when autograd's .grad is the grad
    // One per tensor of the group's StateFormat (plain formats: per StorePlan::state_names()),
    // StorePlan::held_state_values() values each.
    std::vector<at::Tensor> state;
  };

  // Allocates every buffer of `plan` once and fills it from `params` (the model's parameters, the
  // plan's names in any order, fp32 or any floating dtype): masters from the values before they
  // are cast, compute buffers cast from them, state zeros. Each trainable parameter then becomes
  // (set_data) a view of its range of the compute buffer; a plain frozen one is cast to the compute
  // dtype. Every frozen slot's tensors (its parameter and the `buffers` its layout names: the
  // model's named buffers) are moved to its placement and counted in their categories. Throws
  // memrt::Error naming a parameter the plan and `params` disagree on, a buffer no layout names,
  // or a layout's tensor the model lacks or holds in another dtype or shape.
  ParamStore(StorePlan plan, const std::vector<std::pair<std::string, at::Tensor>>& params,
             const std::vector<std::pair<std::string, at::Tensor>>& buffers, at::Device device);
  // No module buffers.
  ParamStore(StorePlan plan, const std::vector<std::pair<std::string, at::Tensor>>& params,
             at::Device device);

  // ---- ABI 2.16: the same in steps, so that the model is taken in segment by segment as it is
  // built: a partitioned parameter's whole tensor goes as soon as its segment is adopted, and under
  // ZeRO-3 no rank ever holds the whole model. The constructors above are these three calls. ----
  // Allocates every buffer but the optimizer state; no parameter is taken yet.
  ParamStore(StorePlan plan, at::Device device);
  // Takes `params` — any of the plan's parameters not taken before — as the constructor above
  // does, with the module buffers their frozen layouts name (every one of `buffers` must be named
  // by the layout of a parameter taken in the same call). Throws memrt::Error naming a parameter
  // the plan lacks, one taken twice, or one whose shape differs from the plan's.
  void adopt(const std::vector<std::pair<std::string, at::Tensor>>& params,
             const std::vector<std::pair<std::string, at::Tensor>>& buffers);
  // Every parameter of the plan taken (else an error naming the first that is not); allocates the
  // optimizer state (zeros) — after the parameters, so that set-up never holds both.
  void finish();

  const StorePlan& plan() const { return plan_; }
  const std::vector<Group>& groups() const { return groups_; }
  std::vector<Group>& groups() { return groups_; }
  // The module parameter of slot i (a view of its group's compute buffer when trainable; with a
  // partitioned compute buffer, an empty placeholder unless attached).
  const at::Tensor& param(int slot) const { return params_[static_cast<size_t>(slot)]; }

  // Slot i's elements in buffer b as this rank holds them, in the parameter's flat order:
  // {view, first}: `view` covers the parameter's elements [first, first + view.numel()). For a
  // full buffer that is the whole parameter; for a partition the part of it this rank owns
  // (numel 0 when none). b is kCompute, kMaster, kGrad (flat only) or kState (tensor k of the
  // group's format). For a state tensor of per_value v, view and first count values: the values
  // covering those elements, the first being the parameter's value `first`.
  std::pair<at::Tensor, int64_t> slice(int slot, StoreBuffer b, int state = 0) const;

  // ---- ABI 2.3 ----
  // A frozen slot's tensors, as its layout lists them (the parameter first).
  const std::vector<at::Tensor>& frozen_tensors(int slot) const;

  // ---- ABI 2.13: partitioned compute weights (ZeRO-3) ----
  // With group g's compute buffer of extent kPartition this rank holds its partition only, and each
  // trainable parameter of g rests as an empty placeholder (numel 0; the group's dtype and
  // device). attach() points every parameter of g whose elements lie in `range` at its view of
  // `values` — group g's elements [range.begin, range.end) in the compute dtype, contiguous: a
  // buffer a plugin gathered, typically StorePlan::segment_range(g, s) — and release() sets them
  // back to placeholders, the store keeping no reference to `values`. (Autograd keeps what it
  // saved: a plugin that wants the memory back re-attaches before the segment's backward and
  // releases after it.) A parameter partly inside `range` is an error naming it, as is a group
  // whose compute weights are whole.
  void attach(int g, ElementRange range, const at::Tensor& values);
  void release(int g, ElementRange range);

  // ---- ABI 2.17: partitioned frozen weights (ZeRO-3) ----
  // A frozen slot whose layout is partitioned keeps its share (frozen_tensors(slot): one 1-d
  // tensor of StorePlan::frozen_partition(slot) elements) and its parameter rests as an empty
  // placeholder. attach_frozen() points the parameter at `values` — the whole weight as planned
  // (shape, dtype; contiguous) that a plugin gathered — and release_frozen() sets it back, the
  // store keeping no reference. A replicated slot, or values of another shape or dtype, is an
  // error naming the parameter.
  void attach_frozen(int slot, const at::Tensor& values);
  void release_frozen(int slot);

 private:
  void place_frozen(const std::vector<int>& slots, const std::vector<std::pair<std::string, at::Tensor>>& buffers);
  at::Tensor allocate(const BufferLayout& l, int64_t numel, memory::Category category) const;
  std::vector<int> slots_within(int g, ElementRange range, const char* who) const;

  StorePlan plan_;
  std::vector<Group> groups_;
  std::vector<at::Tensor> params_;
  std::vector<std::vector<at::Tensor>> frozen_;  // per slot (2.3)
  // ---- added in ABI 2.16 ----
  at::Device device_{at::kCPU};
  std::vector<bool> adopted_;  // per slot
};

}  // namespace memrt
