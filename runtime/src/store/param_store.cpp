// The parameter store (memrt/param_store.h, docs/parameter-store.md).
#include "memrt/param_store.h"

#include <algorithm>
#include <numeric>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ceil_div.h>
#include <ATen/core/grad_mode.h>

#include "memrt/error.h"

namespace memrt {

using memory::Category;
using memory::Placement;

const char* to_string(StoreBuffer b) {
  switch (b) {
    case StoreBuffer::kCompute: return "compute";
    case StoreBuffer::kMaster: return "master";
    case StoreBuffer::kGrad: return "grad";
    case StoreBuffer::kState: return "state";
  }
  return "?";
}

const char* to_string(Extent e) { return e == Extent::kFull ? "full" : "partition"; }

namespace {

constexpr StoreBuffer kAllBuffers[] = {StoreBuffer::kCompute, StoreBuffer::kMaster,
                                       StoreBuffer::kGrad, StoreBuffer::kState};

bool is_16bit(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "fp32";
    case at::kBFloat16: return "bf16";
    case at::kHalf: return "fp16";
    default: return c10::toString(t);
  }
}

int64_t elem_size(at::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); }

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

Category category_of(StoreBuffer b) {
  switch (b) {
    case StoreBuffer::kCompute: return Category::kWeights;
    case StoreBuffer::kMaster: return Category::kMasterWeights;
    case StoreBuffer::kGrad: return Category::kGradients;
    case StoreBuffer::kState: return Category::kOptimizerState;
  }
  return Category::kOther;
}

// How a per-group axis is recorded: "compute dtype of group 'decay'".
std::string group_suffix(const std::string& group) { return " of group '" + group + "'"; }

}  // namespace

// ---- selectors and formats ------------------------------------------------------------------------

GroupSelector::GroupSelector(std::string name)
    : description_("group '" + name + "'"),
      match_([name = std::move(name)](const StoreGroup& g) { return g.name == name; }) {}

GroupSelector::GroupSelector(std::string description, std::function<bool(const StoreGroup&)> match)
    : description_(std::move(description)), match_(std::move(match)) {
  if (!match_) throw Error("parameter store: a group selector needs a predicate (" + description_ + ")");
}

StateFormat StateFormat::plain(at::ScalarType dtype, const std::vector<std::string>& state_names) {
  StateFormat f;
  f.name = dtype_name(dtype);
  for (const std::string& s : state_names) f.tensors.push_back({s, dtype, 1});
  return f;
}

bool StateFormat::is_plain() const {
  if (block != 1) return false;
  for (const StateTensor& t : tensors)
    if (t.per_value != 1 || (t.dtype != at::kFloat && t.dtype != at::kBFloat16)) return false;
  return true;
}

// ---- the plan -------------------------------------------------------------------------------------

StorePlan::StorePlan(const std::vector<ParamInfo>& params, const StoreOptions& options)
    : StorePlan(params, options, std::vector<int64_t>(params.size(), 0)) {}

StorePlan::StorePlan(const std::vector<ParamInfo>& params, const StoreOptions& options,
                     const std::vector<int64_t>& segments)
    : options_(options), segments_(segments) {
  if (segments.size() != params.size()) {
    throw Error("parameter store: " + std::to_string(segments.size()) + " segments given for " +
                std::to_string(params.size()) + " parameters");
  }
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    throw Error("parameter store: rank " + std::to_string(options.rank) + " of world size " +
                std::to_string(options.world_size) + " is not a rank of that world");
  }
  if (options.optimizer == "Adam" || options.optimizer == "AdamW") {
    state_names_ = {"exp_avg", "exp_avg_sq"};
  } else if (options.optimizer == "SGD") {
    if (options.momentum != 0.0) state_names_ = {"momentum_buffer"};
  } else {
    throw Error("parameter store: no state layout for optimizer '" + options.optimizer +
                "' (Adam, AdamW, SGD)");
  }
  int decay = -1, no_decay = -1;
  std::unordered_set<std::string> seen;
  for (const ParamInfo& p : params) {
    ParamSlot slot;
    slot.param = p;
    slot.numel = 1;
    for (int64_t d : p.shape) slot.numel *= d;
    if (!seen.insert(p.name).second) throw Error("parameter store: parameter '" + p.name + "' is listed twice");
    if (p.trainable) {
      if (p.dtype != at::kFloat && !is_16bit(p.dtype)) {
        throw Error("parameter store: trainable parameter '" + p.name + "' is " +
                    c10::toString(p.dtype) + "; the optimizer step trains fp32, bf16 and fp16 "
                    "parameters (cast it, or freeze it: requires_grad false)");
      }
      int& index = p.decay ? decay : no_decay;
      if (index < 0) {
        index = static_cast<int>(groups_.size());
        StoreGroup g;
        g.name = p.decay ? "decay" : "no_decay";
        g.weight_decay = p.decay ? options.weight_decay : 0.0;
        for (StoreBuffer b : kAllBuffers) buffer(g, b).dtype = p.dtype;
        buffer(g, StoreBuffer::kMaster) = {false, at::kFloat, Extent::kFull, Placement::kDevice};
        buffer(g, StoreBuffer::kState).dtype = at::kFloat;
        buffer(g, StoreBuffer::kState).present = !state_names_.empty();
        groups_.push_back(g);
      }
      StoreGroup& g = groups_[static_cast<size_t>(index)];
      if (g.buffer(StoreBuffer::kCompute).dtype != p.dtype) {
        throw Error("parameter store: parameter '" + p.name + "' is " + dtype_name(p.dtype) +
                    " but the others of group '" + g.name + "' are " +
                    dtype_name(g.buffer(StoreBuffer::kCompute).dtype) +
                    "; a group's parameters share one compute dtype");
      }
      slot.group = index;
      g.slots.push_back(static_cast<int>(slots_.size()));
    }
    slots_.push_back(std::move(slot));
  }
  // Decay group first, as the host has always ordered its parameter groups.
  if (decay > 0) {
    std::swap(groups_[0], groups_[1]);
    for (ParamSlot& s : slots_)
      if (s.group >= 0) s.group = 1 - s.group;
  }
  formats_.assign(groups_.size(), StateFormat::plain(at::kFloat, state_names_));
  frozen_.resize(slots_.size());
  for (size_t i = 0; i < slots_.size(); ++i) {
    const ParamInfo& p = slots_[i].param;
    if (slots_[i].group < 0) frozen_[i].tensors = {{p.name, p.dtype, p.shape, Category::kWeights}};
  }
  relayout();
}

int StorePlan::add_group(const GroupSpec& spec) {
  const std::string where = "parameter store: group '" + spec.name + "'";
  if (spec.name.empty() || !spec.select) throw Error("parameter store: add_group needs a name and a selection");
  for (const StoreGroup& g : groups_)
    if (g.name == spec.name) throw Error(where + " exists already; group names are unique");
  if (!(spec.lr_scale > 0.0) || !(spec.weight_decay >= 0.0))
    throw Error(where + ": lr_scale must be > 0 and weight_decay >= 0");
  StoreGroup added;
  added.name = spec.name;
  added.weight_decay = spec.weight_decay;
  added.lr_scale = spec.lr_scale;
  int origin = -1;  // the group the first selected parameter leaves: its layout is the new group's
  for (size_t i = 0; i < slots_.size(); ++i) {
    ParamSlot& s = slots_[i];
    if (s.group < 0 || !spec.select(s.param)) continue;
    const StoreGroup& from = groups_[static_cast<size_t>(s.group)];
    if (origin < 0) {
      origin = s.group;
      added.buffers = from.buffers;
    } else if (s.group != origin) {
      const StoreGroup& first = groups_[static_cast<size_t>(origin)];
      bool same = formats_[static_cast<size_t>(origin)].name == formats_[static_cast<size_t>(s.group)].name;
      for (StoreBuffer b : kAllBuffers) {
        const BufferLayout& x = first.buffer(b);
        const BufferLayout& y = from.buffer(b);
        same = same && x.present == y.present && x.dtype == y.dtype && x.extent == y.extent &&
               x.placement == y.placement;
      }
      if (!same) {
        throw Error(where + " selects parameters of groups '" + first.name + "' and '" + from.name +
                    "' ('" + s.param.name + "'), whose buffers or state formats differ; a group has "
                    "one layout: select from one of them, or make their layouts agree first");
      }
    }
    added.slots.push_back(static_cast<int>(i));
  }
  if (added.slots.empty()) throw Error(where + " selects no trainable parameter");
  record_key("group " + spec.name, "added");
  // The new group's axes were set by whoever set them for the group its parameters came from.
  const std::string from_suffix = group_suffix(groups_[static_cast<size_t>(origin)].name);
  std::vector<std::pair<std::string, std::pair<std::string, std::string>>> inherited;
  for (const auto& [key, value] : set_by_) {
    if (key.size() > from_suffix.size() &&
        key.compare(key.size() - from_suffix.size(), from_suffix.size(), from_suffix) == 0)
      inherited.emplace_back(key.substr(0, key.size() - from_suffix.size()) + group_suffix(spec.name), value);
  }
  set_by_.insert(inherited.begin(), inherited.end());
  const int index = static_cast<int>(groups_.size());
  for (int i : added.slots) slots_[static_cast<size_t>(i)].group = index;
  if (auto it = weights_category_.find(groups_[static_cast<size_t>(origin)].name); it != weights_category_.end())
    weights_category_[spec.name] = it->second;
  groups_.push_back(std::move(added));
  formats_.push_back(formats_[static_cast<size_t>(origin)]);
  // Every group keeps the slots still in it; empty ones go, and the slots' indices follow.
  std::vector<StoreGroup> kept;
  std::vector<StateFormat> kept_formats;
  std::vector<int> renumber(groups_.size(), -1);
  for (size_t g = 0; g < groups_.size(); ++g) {
    StoreGroup& group = groups_[g];
    std::vector<int> still;
    for (int i : group.slots)
      if (slots_[static_cast<size_t>(i)].group == static_cast<int>(g)) still.push_back(i);
    group.slots = std::move(still);
    if (group.slots.empty()) continue;
    renumber[g] = static_cast<int>(kept.size());
    kept.push_back(std::move(group));
    kept_formats.push_back(std::move(formats_[g]));
  }
  groups_ = std::move(kept);
  formats_ = std::move(kept_formats);
  for (ParamSlot& s : slots_)
    if (s.group >= 0) s.group = renumber[static_cast<size_t>(s.group)];
  relayout();
  return renumber[static_cast<size_t>(index)];
}

void StorePlan::relayout() {
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    StoreGroup& g = groups_[gi];
    const int64_t unit = group_alignment(static_cast<int>(gi)) * options_.world_size;
    // Segment order: one segment's parameters are one range of every buffer; model order within it.
    std::stable_sort(g.slots.begin(), g.slots.end(), [&](int a, int b) {
      return segments_[static_cast<size_t>(a)] < segments_[static_cast<size_t>(b)];
    });
    const StateFormat& f = formats_[gi];
    const int64_t start = f.blocks_per_tensor ? f.block : 1;
    g.numel = 0;
    for (int i : g.slots) {
      ParamSlot& s = slots_[static_cast<size_t>(i)];
      s.offset = at::round_up(g.numel, start);  // gaps are padding: zeros that stay zeros
      g.numel = s.offset + s.numel;
    }
    g.padded = at::round_up(g.numel, unit);
  }
}

int64_t StorePlan::segment(int slot) const { return segments_.at(static_cast<size_t>(slot)); }

ElementRange StorePlan::segment_range(int g, int64_t segment) const {
  ElementRange out{0, 0};
  bool any = false;
  for (int i : groups_.at(static_cast<size_t>(g)).slots) {
    if (segments_[static_cast<size_t>(i)] != segment) continue;
    const ElementRange r = range(i);
    if (!any) out.begin = r.begin;
    out.end = r.end;
    any = true;
  }
  return out;
}

std::vector<int> StorePlan::segment_slots(int64_t segment) const {
  std::vector<int> out;
  for (const StoreGroup& g : groups_)
    for (int i : g.slots)
      if (segments_[static_cast<size_t>(i)] == segment) out.push_back(i);
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].group < 0 && segments_[i] == segment) out.push_back(static_cast<int>(i));
  return out;
}

const StateFormat& StorePlan::state_format(int g) const { return formats_.at(static_cast<size_t>(g)); }

int64_t StorePlan::group_alignment(int g) const {
  return std::lcm(alignment_, formats_.at(static_cast<size_t>(g)).block);
}

int64_t StorePlan::held_state_values(int g, int k) const {
  const int64_t elements = held_numel(g, StoreBuffer::kState);
  return at::ceil_div(elements, formats_.at(static_cast<size_t>(g)).tensors.at(static_cast<size_t>(k)).per_value);
}

const FrozenLayout& StorePlan::frozen_layout(int slot) const {
  const ParamSlot& s = slots_.at(static_cast<size_t>(slot));
  if (s.group >= 0) throw Error("parameter store: '" + s.param.name + "' is trainable; it has no frozen layout");
  return frozen_[static_cast<size_t>(slot)];
}

int64_t StorePlan::find(const std::string& name) const {
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].param.name == name) return static_cast<int64_t>(i);
  return -1;
}

ElementRange StorePlan::partition(int g, int r) const {
  const int64_t part = groups_.at(static_cast<size_t>(g)).padded / options_.world_size;
  return {r * part, (r + 1) * part};
}

bool StorePlan::partitioned(int g) const {
  const StoreGroup& group = groups_.at(static_cast<size_t>(g));
  for (StoreBuffer b : {StoreBuffer::kMaster, StoreBuffer::kState, StoreBuffer::kGrad})
    if (group.buffer(b).extent == Extent::kPartition) return true;
  return false;
}

ElementRange StorePlan::step_range(int g) const {
  return partitioned(g) ? partition(g) : ElementRange{0, groups_.at(static_cast<size_t>(g)).padded};
}

ElementRange StorePlan::range(int slot) const {
  const ParamSlot& s = slots_.at(static_cast<size_t>(slot));
  if (s.group < 0) throw Error("parameter store: '" + s.param.name + "' is frozen; it is in no group");
  return {s.offset, s.offset + s.numel};
}

int64_t StorePlan::held_numel(int g, StoreBuffer b) const {
  const StoreGroup& group = groups_.at(static_cast<size_t>(g));
  const BufferLayout& l = group.buffer(b);
  if (!l.present) return 0;
  if (b == StoreBuffer::kGrad && !flat_grad(g)) return 0;  // autograd's .grad
  return l.extent == Extent::kFull ? group.padded : group.padded / options_.world_size;
}

bool StorePlan::flat_grad(int g) const {
  const StoreGroup& group = groups_.at(static_cast<size_t>(g));
  const BufferLayout& l = group.buffer(StoreBuffer::kGrad);
  return l.extent == Extent::kPartition || l.dtype != group.buffer(StoreBuffer::kCompute).dtype;
}

void StorePlan::record_key(const std::string& key, const std::string& value) {
  if (author_.empty()) return;  // the host's defaults
  auto it = set_by_.find(key);
  if (it != set_by_.end() && it->second.second != author_) {
    if (it->second.first == value) return;  // agrees with the plugin that set it first
    throw Error("parameter store: plugins '" + it->second.second + "' and '" + author_ +
                "' both set the store's " + key + ", to " + it->second.first + " and to " +
                value + "; only one plugin may decide it: drop one of them from the config or "
                "make their settings agree");
  }
  set_by_[key] = {value, author_};
}

void StorePlan::record(const StoreGroup& g, const std::string& axis, const std::string& value) {
  record_key(axis + group_suffix(g.name), value);
}

const std::string* StorePlan::recorded(const StoreGroup& g, const std::string& axis) const {
  auto it = set_by_.find(axis + group_suffix(g.name));
  return it == set_by_.end() ? nullptr : &it->second.first;
}

std::vector<int> StorePlan::selected(const GroupSelector& groups, const char* setter) const {
  std::vector<int> out;
  for (size_t g = 0; g < groups_.size(); ++g)
    if (groups.matches(groups_[g])) out.push_back(static_cast<int>(g));
  if (out.empty() && !groups.every()) {
    std::string names;
    for (const StoreGroup& g : groups_) names += (names.empty() ? "'" : ", '") + g.name + "'";
    throw Error(std::string("parameter store: ") + setter + " for " + groups.description() +
                " selects no group; the groups are " + names);
  }
  return out;
}

void StorePlan::set_compute_dtype(at::ScalarType dtype, const GroupSelector& groups) {
  if (dtype != at::kFloat && !is_16bit(dtype)) {
    throw Error(std::string("parameter store: compute dtype ") + c10::toString(dtype) +
                " is not one the step takes (fp32, bf16, fp16)");
  }
  for (int gi : selected(groups, "set_compute_dtype")) {
    StoreGroup& g = groups_[static_cast<size_t>(gi)];
    record(g, "compute dtype", dtype_name(dtype));
    buffer(g, StoreBuffer::kCompute).dtype = dtype;
    if (!recorded(g, "gradient dtype")) buffer(g, StoreBuffer::kGrad).dtype = dtype;  // follows
  }
  if (!groups.every()) return;
  for (size_t i = 0; i < slots_.size(); ++i) {  // plain frozen weights; never a quantized base's
    ParamSlot& s = slots_[i];
    if (s.group >= 0 || !frozen_[i].format.empty() || !at::isFloatingType(s.param.dtype)) continue;
    s.param.dtype = dtype;
    frozen_[i].tensors.front().dtype = dtype;
  }
}

void StorePlan::set_frozen_layout(int slot, FrozenLayout layout) {
  const ParamSlot& s = slots_.at(static_cast<size_t>(slot));
  const std::string where = "parameter store: frozen layout '" + layout.format + "' of '" + s.param.name + "'";
  if (s.group >= 0) throw Error(where + ": the parameter is trainable; only frozen ones have a layout");
  if (layout.tensors.empty() || layout.tensors.front().name != s.param.name ||
      layout.tensors.front().dtype != s.param.dtype || layout.tensors.front().shape != s.param.shape) {
    throw Error(where + ": its first tensor must be the parameter as planned (" + dtype_name(s.param.dtype) +
                " " + shape_str(s.param.shape) + "); plan_params sets the parameter's dtype and shape");
  }
  if (layout.extent == Extent::kPartition && (!layout.format.empty() || layout.tensors.size() != 1))
    throw Error(where + ": only a plain weight alone is partitioned; a quantized base's codes and scales "
                "stay replicated (docs/zero.md)");
  std::unordered_set<std::string> names;
  for (const FrozenTensor& t : layout.tensors) {
    if (!names.insert(t.name).second) throw Error(where + " names tensor '" + t.name + "' twice");
    if (&t != &layout.tensors.front() && find(t.name) >= 0)
      throw Error(where + " names '" + t.name + "', which is a parameter of its own; its other tensors are module buffers");
    for (int64_t d : t.shape)
      if (d < 0) throw Error(where + ": tensor '" + t.name + "' has a negative dimension");
  }
  record_key("frozen layout of '" + s.param.name + "'",
             (layout.format.empty() ? std::string("plain") : layout.format) +
                 (layout.extent == Extent::kPartition ? ", partitioned" : ""));
  frozen_[static_cast<size_t>(slot)] = std::move(layout);
}

ElementRange StorePlan::frozen_partition(int slot, int r) const {
  const FrozenLayout& layout = frozen_layout(slot);
  const int64_t n = slots_[static_cast<size_t>(slot)].numel;
  if (layout.extent == Extent::kFull) return {0, n};
  const int64_t c = at::ceil_div(n, static_cast<int64_t>(options_.world_size));
  return {std::min(n, r * c), std::min(n, (r + 1) * c)};
}

void StorePlan::set_frozen_placement(Placement placement) {
  record_key("frozen placement", memory::to_string(placement));
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].group < 0) frozen_[i].placement = placement;
}

void StorePlan::set_master_weights(bool on, const GroupSelector& groups) {
  for (int gi : selected(groups, "set_master_weights")) {
    StoreGroup& g = groups_[static_cast<size_t>(gi)];
    record(g, "master weights", on ? "on" : "off");
    buffer(g, StoreBuffer::kMaster).present = on;
  }
}

void StorePlan::set_state_dtype(at::ScalarType dtype, const GroupSelector& groups) {
  if (dtype != at::kFloat && dtype != at::kBFloat16) {
    throw Error(std::string("parameter store: optimizer state in ") + c10::toString(dtype) +
                " is not a format the step takes (fp32, bf16)");
  }
  set_state_format(StateFormat::plain(dtype, state_names_), groups);
}

void StorePlan::set_state_format(const StateFormat& format, const GroupSelector& groups) {
  const std::string where = "parameter store: state format '" + format.name + "'";
  if (format.name.empty()) throw Error("parameter store: a state format needs a name");
  if (format.tensors.empty() && !state_names_.empty())
    throw Error(where + " has no tensors for the optimizer's state");
  if (format.block < 1) throw Error(where + ": block must be at least one element");
  if (format.block > 1 && !format.blocks_per_tensor) {
    throw Error(where + " has blocks of " + std::to_string(format.block) + " elements but not "
                "blocks_per_tensor: a block straddling two parameters could not be re-partitioned "
                "by name; start blocks at each parameter (blocks_per_tensor = true)");
  }
  std::unordered_set<std::string> names;
  for (const StateTensor& t : format.tensors) {
    if (t.name.empty() || !names.insert(t.name).second)
      throw Error(where + ": every tensor needs a name of its own ('" + t.name + "')");
    if (t.per_value < 1 || format.block % t.per_value != 0) {
      throw Error(where + ": tensor '" + t.name + "' has one value per " + std::to_string(t.per_value) +
                  " elements, which does not divide the block of " + std::to_string(format.block));
    }
  }
  for (const std::string& state : state_names_) {  // every state name has its tensors
    bool found = false;
    for (const StateTensor& t : format.tensors)
      found = found || t.name == state || t.name.compare(0, state.size() + 1, state + ".") == 0;
    if (!found) throw Error(where + " has no tensor for the optimizer's state '" + state + "'");
  }
  for (int gi : selected(groups, "set_state_format")) {
    StoreGroup& g = groups_[static_cast<size_t>(gi)];
    record(g, "optimizer state format", format.name);
    formats_[static_cast<size_t>(gi)] = format;
    if (!format.tensors.empty()) buffer(g, StoreBuffer::kState).dtype = format.tensors.front().dtype;
  }
  relayout();
}

void StorePlan::set_grad_dtype(at::ScalarType dtype, const GroupSelector& groups) {
  for (int gi : selected(groups, "set_grad_dtype")) {
    StoreGroup& g = groups_[static_cast<size_t>(gi)];
    record(g, "gradient dtype", dtype_name(dtype));
    buffer(g, StoreBuffer::kGrad).dtype = dtype;
  }
}

void StorePlan::set_extent(StoreBuffer b, Extent extent, const GroupSelector& groups) {
  for (int gi : selected(groups, "set_extent")) {
    StoreGroup& g = groups_[static_cast<size_t>(gi)];
    record(g, std::string(to_string(b)) + " extent", to_string(extent));
    buffer(g, b).extent = extent;
  }
}

void StorePlan::set_placement(StoreBuffer b, Placement placement, const GroupSelector& groups) {
  for (int gi : selected(groups, "set_placement")) {
    StoreGroup& g = groups_[static_cast<size_t>(gi)];
    record(g, std::string(to_string(b)) + " placement", memory::to_string(placement));
    buffer(g, b).placement = placement;
  }
}

void StorePlan::set_weights_category(memory::Category category, const GroupSelector& groups) {
  for (int gi : selected(groups, "set_weights_category")) {
    const StoreGroup& g = groups_[static_cast<size_t>(gi)];
    record(g, "weights category", memory::to_string(category));
    weights_category_[g.name] = category;
  }
}

memory::Category StorePlan::weights_category(int group) const {
  auto it = weights_category_.find(groups_.at(static_cast<size_t>(group)).name);
  return it == weights_category_.end() ? Category::kWeights : it->second;
}

void StorePlan::set_compute_dtype(at::ScalarType dtype) { set_compute_dtype(dtype, GroupSelector()); }
void StorePlan::set_master_weights(bool on) { set_master_weights(on, GroupSelector()); }
void StorePlan::set_state_dtype(at::ScalarType dtype) { set_state_dtype(dtype, GroupSelector()); }
void StorePlan::set_grad_dtype(at::ScalarType dtype) { set_grad_dtype(dtype, GroupSelector()); }
void StorePlan::set_extent(StoreBuffer b, Extent extent) { set_extent(b, extent, GroupSelector()); }
void StorePlan::set_placement(StoreBuffer b, Placement placement) {
  set_placement(b, placement, GroupSelector());
}

void StorePlan::require_alignment(int64_t elements) {
  if (elements < 1) throw Error("parameter store: an alignment must be at least one element");
  alignment_ = std::lcm(alignment_, elements);
  relayout();
}

void StorePlan::keep_weights_only() {
  for (StoreGroup& g : groups_)
    for (StoreBuffer b : {StoreBuffer::kMaster, StoreBuffer::kGrad, StoreBuffer::kState}) buffer(g, b).present = false;
  weights_only_ = true;
}

void StorePlan::check() const {
  for (const StoreGroup& g : groups_) {
    const at::ScalarType c = g.buffer(StoreBuffer::kCompute).dtype;
    if (weights_only_) continue;  // no step to take: masters need not be there
    const bool master = g.buffer(StoreBuffer::kMaster).present;
    const std::string* set_off = recorded(g, "master weights");
    const bool in_place = c == at::kBFloat16 && set_off && *set_off == "off";
    if (is_16bit(c) && !master && !in_place) {
      throw Error(std::string("parameter store: group '") + g.name + "' computes in " +
                  dtype_name(c) + " without fp32 master weights; the optimizer step updates " +
                  "fp16 weights only through masters, and bf16 ones in place only when a plugin says "
                  "so (set_master_weights(true), or set_master_weights(false) for bf16)");
    }
    if (!is_16bit(c) && master) {
      throw Error(std::string("parameter store: group '") + g.name + "' has fp32 master weights "
                  "but computes in " + dtype_name(c) + ": masters are for a 16-bit compute dtype");
    }
    if (g.buffer(StoreBuffer::kCompute).extent == Extent::kPartition &&
        g.buffer(StoreBuffer::kGrad).extent != Extent::kPartition) {
      throw Error(std::string("parameter store: group '") + g.name + "' keeps its compute weights partitioned "
                  "(ZeRO stage 3) but its gradient whole; partition the gradient too "
                  "(set_extent(StoreBuffer::kGrad, Extent::kPartition))");
    }
    const at::ScalarType grad = g.buffer(StoreBuffer::kGrad).dtype;
    if (grad != c && grad != at::kFloat) {
      throw Error(std::string("parameter store: group '") + g.name + "' keeps " + dtype_name(grad) +
                  " gradients for " + dtype_name(c) + " weights; gradients are the compute dtype "
                  "or fp32");
    }
  }
}

memory::Table StorePlan::bytes() const {
  memory::Table t;
  for (int g = 0; g < static_cast<int>(groups_.size()); ++g) {
    const StoreGroup& group = groups_[static_cast<size_t>(g)];
    for (StoreBuffer b : kAllBuffers) {
      const BufferLayout& l = group.buffer(b);
      if (b != StoreBuffer::kState) {
        const Category c = b == StoreBuffer::kCompute ? weights_category(g) : category_of(b);
        t.at(c, l.placement) += held_numel(g, b) * elem_size(l.dtype);
        continue;
      }
      const StateFormat& f = formats_[static_cast<size_t>(g)];
      for (size_t k = 0; k < f.tensors.size() && l.present; ++k)
        t.at(category_of(b), l.placement) += held_state_values(g, static_cast<int>(k)) * elem_size(f.tensors[k].dtype);
    }
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].group >= 0) continue;
    for (const FrozenTensor& f : frozen_[i].tensors) {
      int64_t numel = 1;
      for (int64_t d : f.shape) numel *= d;
      if (frozen_[i].extent == Extent::kPartition) numel = frozen_partition(static_cast<int>(i)).size();
      t.at(f.category, frozen_[i].placement) += numel * elem_size(f.dtype);
    }
  }
  return t;
}

std::string StorePlan::describe() const {
  std::ostringstream os;
  for (int g = 0; g < static_cast<int>(groups_.size()); ++g) {
    const StoreGroup& group = groups_[static_cast<size_t>(g)];
    os << "  group " << group.name << ": " << group.slots.size() << " tensors, " << group.numel
       << " elements (padded to " << group.padded << ", " << options_.world_size
       << " partition(s) of " << group.padded / options_.world_size << ")";
    if (group.lr_scale != 1.0) os << "; lr x" << group.lr_scale;
    for (StoreBuffer b : kAllBuffers) {
      const BufferLayout& l = group.buffer(b);
      if (!l.present || (b == StoreBuffer::kState && state_names_.empty())) continue;
      os << "; " << to_string(b) << " "
         << (b == StoreBuffer::kState ? formats_[static_cast<size_t>(g)].name : dtype_name(l.dtype)) << " ";
      if (b == StoreBuffer::kGrad && !flat_grad(g)) {
        os << "per tensor";
      } else {
        os << to_string(l.extent);
      }
      if (l.placement == Placement::kHost) os << " on host";
    }
    os << "\n";
  }
  int64_t frozen = 0, tensors = 0, on_host = 0, partitioned = 0;
  std::map<std::string, int> formats;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].group >= 0) continue;
    frozen += slots_[i].numel;
    tensors += static_cast<int64_t>(frozen_[i].tensors.size());
    on_host += frozen_[i].placement == Placement::kHost ? 1 : 0;
    partitioned += frozen_[i].extent == Extent::kPartition ? 1 : 0;
    if (!frozen_[i].format.empty()) ++formats[frozen_[i].format];
  }
  if (frozen > 0) {
    os << "  frozen: " << frozen << " elements in " << tensors << " tensors";
    for (const auto& [format, n] : formats) os << "; " << n << " " << format;
    if (partitioned > 0) os << "; " << partitioned << " partitioned";
    if (on_host > 0) os << "; on host";
    os << "\n";
  }
  return os.str();
}

// ---- the allocated store --------------------------------------------------------------------------

ParamStore::ParamStore(StorePlan plan, const std::vector<std::pair<std::string, at::Tensor>>& params,
                       at::Device device)
    : ParamStore(std::move(plan), params, {}, device) {}

ParamStore::ParamStore(StorePlan plan, const std::vector<std::pair<std::string, at::Tensor>>& params,
                       const std::vector<std::pair<std::string, at::Tensor>>& buffers, at::Device device)
    : ParamStore(std::move(plan), device) {
  adopt(params, buffers);
  finish();
}

ParamStore::ParamStore(StorePlan plan, at::Device device) : plan_(std::move(plan)), device_(device) {
  plan_.check();
  params_.resize(plan_.slots().size());
  frozen_.resize(plan_.slots().size());
  adopted_.assign(plan_.slots().size(), false);
  for (int g = 0; g < static_cast<int>(plan_.groups().size()); ++g) {
    const StoreGroup& group = plan_.groups()[static_cast<size_t>(g)];
    Group out;
    out.compute = allocate(group.buffer(StoreBuffer::kCompute), plan_.held_numel(g, StoreBuffer::kCompute),
                           plan_.weights_category(g));
    if (group.buffer(StoreBuffer::kMaster).present) {
      out.master = allocate(group.buffer(StoreBuffer::kMaster), plan_.held_numel(g, StoreBuffer::kMaster),
                            Category::kMasterWeights);
    }
    if (const int64_t n = plan_.held_numel(g, StoreBuffer::kGrad); n > 0) {
      out.grad = allocate(group.buffer(StoreBuffer::kGrad), n, Category::kGradients);
    }
    groups_.push_back(std::move(out));
  }
}

// Zeros of a buffer's layout: its dtype, in its placement, counted in `category`.
at::Tensor ParamStore::allocate(const BufferLayout& l, int64_t numel, Category category) const {
  at::NoGradGuard no_grad;
  memory::Scope scope(category, l.placement);
  const at::Device where = l.placement == Placement::kHost ? at::Device(at::kCPU) : device_;
  return at::zeros({numel}, at::TensorOptions().dtype(l.dtype).device(where));
}

// Masters from the values as they are (fp32), then the compute copy; each parameter then becomes
// a view of its range (or, with the compute buffer partitioned, an empty placeholder), and its old
// storage goes at once (unless the caller holds it).
void ParamStore::adopt(const std::vector<std::pair<std::string, at::Tensor>>& params,
                       const std::vector<std::pair<std::string, at::Tensor>>& buffers) {
  std::vector<int> taken;
  for (const auto& [name, t] : params) {
    const int64_t found = plan_.find(name);
    if (found < 0) throw Error("parameter store: the model has parameter '" + name + "', which the plan lacks");
    const int slot = static_cast<int>(found);
    const ParamSlot& s = plan_.slots()[static_cast<size_t>(slot)];
    if (adopted_[static_cast<size_t>(slot)])
      throw Error("parameter store: parameter '" + name + "' is taken in twice");
    if (t.sizes().vec() != s.param.shape) {
      throw Error("parameter store: parameter '" + name + "' has shape " + shape_str(t.sizes().vec()) +
                  " but the plan says " + shape_str(s.param.shape));
    }
    params_[static_cast<size_t>(slot)] = t;
    adopted_[static_cast<size_t>(slot)] = true;
    taken.push_back(slot);
  }
  at::NoGradGuard no_grad;
  std::vector<int> frozen;
  for (int i : taken) {
    const ParamSlot& s = plan_.slots()[static_cast<size_t>(i)];
    at::Tensor& p = params_[static_cast<size_t>(i)];
    if (s.group < 0) {
      frozen.push_back(i);
      continue;
    }
    Group& out = groups_[static_cast<size_t>(s.group)];
    const at::Tensor flat = p.detach().reshape({-1});
    if (out.master.defined()) {
      auto [view, first] = slice(i, StoreBuffer::kMaster);
      view.copy_(flat.narrow(0, first, view.numel()));
    }
    if (plan_.groups()[static_cast<size_t>(s.group)].buffer(StoreBuffer::kCompute).extent == Extent::kPartition) {
      auto [view, first] = slice(i, StoreBuffer::kCompute);
      view.copy_(flat.narrow(0, first, view.numel()));
      p.set_data(at::empty({0}, out.compute.options()));
      continue;
    }
    at::Tensor range = out.compute.narrow(0, s.offset, s.numel);
    range.copy_(flat);
    p.set_data(range.view(s.param.shape));
  }
  place_frozen(frozen, buffers);
}

void ParamStore::finish() {
  for (size_t i = 0; i < plan_.slots().size(); ++i) {
    if (!adopted_[i])
      throw Error("parameter store: the plan has parameter '" + plan_.slots()[i].param.name + "', which the model lacks");
  }
  for (int g = 0; g < static_cast<int>(plan_.groups().size()); ++g) {
    const BufferLayout& l = plan_.groups()[static_cast<size_t>(g)].buffer(StoreBuffer::kState);
    if (!l.present || !groups_[static_cast<size_t>(g)].state.empty()) continue;
    const std::vector<StateTensor>& tensors = plan_.state_format(g).tensors;
    for (size_t k = 0; k < tensors.size(); ++k) {
      BufferLayout t = l;
      t.dtype = tensors[k].dtype;
      groups_[static_cast<size_t>(g)].state.push_back(
          allocate(t, plan_.held_state_values(g, static_cast<int>(k)), Category::kOptimizerState));
    }
  }
}

// Every frozen slot's tensors among `slots` as its layout says: a plain weight cast to its planned
// dtype, each tensor moved to the layout's placement and counted in its category; every one of
// `buffers` belongs to one of their layouts.
void ParamStore::place_frozen(const std::vector<int>& slots,
                              const std::vector<std::pair<std::string, at::Tensor>>& buffers) {
  std::unordered_map<std::string, at::Tensor> by_name;
  for (const auto& [name, t] : buffers) by_name.emplace(name, t);
  std::unordered_set<std::string> named;
  for (int slot : slots) {
    const size_t i = static_cast<size_t>(slot);
    const FrozenLayout& layout = plan_.frozen_layout(slot);
    const at::Device where = layout.placement == Placement::kHost ? at::Device(at::kCPU) : device_;
    for (size_t k = 0; k < layout.tensors.size(); ++k) {
      const FrozenTensor& f = layout.tensors[k];
      at::Tensor t;
      if (k == 0) {
        t = params_[i];
      } else {
        auto it = by_name.find(f.name);
        if (it == by_name.end()) {
          throw Error("parameter store: the frozen layout of '" + plan_.slots()[i].param.name +
                      "' names module buffer '" + f.name + "', which the model lacks");
        }
        t = it->second;
        named.insert(f.name);
      }
      if (k == 0 && layout.format.empty() && t.is_floating_point() && t.scalar_type() != f.dtype) {
        t.set_data(t.to(f.dtype));  // a plain frozen weight in the compute dtype
      }
      if (t.scalar_type() != f.dtype || t.sizes().vec() != f.shape) {
        throw Error("parameter store: '" + f.name + "' is " + dtype_name(t.scalar_type()) + " " +
                    shape_str(t.sizes().vec()) + " but its frozen layout says " + dtype_name(f.dtype) + " " +
                    shape_str(f.shape));
      }
      if (t.device() != where) t.set_data(t.to(where));
      if (layout.extent == Extent::kPartition) {  // this rank's share; the parameter a placeholder
        const ElementRange held = plan_.frozen_partition(slot);
        memory::Scope scope(f.category, layout.placement);
        at::Tensor share = t.detach().reshape({-1}).narrow(0, held.begin, held.size()).clone();
        t.set_data(at::empty({0}, t.options()));
        frozen_[i].push_back(std::move(share));
        continue;
      }
      memory::claim(t, f.category, layout.placement);
      frozen_[i].push_back(t);
    }
  }
  for (const auto& [name, t] : buffers) {
    if (named.count(name)) continue;
    throw Error("parameter store: module buffer '" + name + "' belongs to no frozen parameter's layout; a "
                "plugin that registers a buffer names it in that parameter's FrozenLayout (plan_store: "
                "set_frozen_layout), so that it is counted, placed and saved with it");
  }
}

// The trainable slots of group g inside `range`, for attach and release: a slot partly inside it
// is an error naming the parameter.
std::vector<int> ParamStore::slots_within(int g, ElementRange range, const char* who) const {
  const StoreGroup& group = plan_.groups().at(static_cast<size_t>(g));
  if (group.buffer(StoreBuffer::kCompute).extent != Extent::kPartition)
    throw Error(std::string("parameter store: ") + who + " of group '" + group.name +
                "', whose compute weights are whole: only partitioned ones (ZeRO stage 3) are attached");
  std::vector<int> out;
  for (int slot : group.slots) {
    const ElementRange r = plan_.range(slot);
    if ((r & range).empty()) continue;
    if (r.begin < range.begin || r.end > range.end)
      throw Error(std::string("parameter store: ") + who + " of elements [" + std::to_string(range.begin) + ", " +
                  std::to_string(range.end) + ") of group '" + group.name + "' cuts parameter '" +
                  plan_.slots()[static_cast<size_t>(slot)].param.name + "' [" + std::to_string(r.begin) + ", " +
                  std::to_string(r.end) + "); a range holds whole parameters (StorePlan::segment_range)");
    out.push_back(slot);
  }
  return out;
}

void ParamStore::attach(int g, ElementRange range, const at::Tensor& values) {
  const std::vector<int> slots = slots_within(g, range, "attach");
  const at::Tensor& compute = groups_.at(static_cast<size_t>(g)).compute;
  // A partition resting in host memory (offload_param) is gathered onto the device the run computes on.
  const bool any_device =
      plan_.groups()[static_cast<size_t>(g)].buffer(StoreBuffer::kCompute).placement == Placement::kHost;
  if (values.dim() != 1 || values.numel() != range.size() || !values.is_contiguous() ||
      values.scalar_type() != compute.scalar_type() || (values.device() != compute.device() && !any_device))
    throw Error("parameter store: attach to group '" + plan_.groups()[static_cast<size_t>(g)].name + "' needs " +
                std::to_string(range.size()) + " contiguous " + dtype_name(compute.scalar_type()) + " elements on " +
                compute.device().str() + ", got " +
                (values.is_contiguous() ? "" : "non-contiguous ") + dtype_name(values.scalar_type()) + " " +
                shape_str(values.sizes().vec()) + " on " + values.device().str());
  for (int slot : slots) {
    const ParamSlot& s = plan_.slots()[static_cast<size_t>(slot)];
    params_[static_cast<size_t>(slot)].set_data(values.narrow(0, s.offset - range.begin, s.numel).view(s.param.shape));
  }
}

void ParamStore::release(int g, ElementRange range) {
  const at::Tensor& compute = groups_.at(static_cast<size_t>(g)).compute;
  for (int slot : slots_within(g, range, "release"))
    params_[static_cast<size_t>(slot)].set_data(at::empty({0}, compute.options()));
}

// The frozen slot `slot` if its layout is partitioned, else an error saying `who` needs one.
static const ParamSlot& partitioned_frozen(const StorePlan& plan, int slot, const char* who) {
  const ParamSlot& s = plan.slots().at(static_cast<size_t>(slot));
  if (s.group >= 0 || plan.frozen_layout(slot).extent != Extent::kPartition)
    throw Error(std::string("parameter store: ") + who + " of '" + s.param.name + "', which is " +
                (s.group >= 0 ? "trainable" : "frozen whole") + ": only partitioned frozen weights (ZeRO stage 3) are attached");
  return s;
}

void ParamStore::attach_frozen(int slot, const at::Tensor& values) {
  const ParamSlot& s = partitioned_frozen(plan_, slot, "attach_frozen");
  const at::Tensor& share = frozen_[static_cast<size_t>(slot)].front();
  const bool any_device = plan_.frozen_layout(slot).placement == Placement::kHost;  // gathered onto the device
  if (values.sizes().vec() != s.param.shape || !values.is_contiguous() || values.scalar_type() != share.scalar_type() ||
      (values.device() != share.device() && !any_device))
    throw Error("parameter store: attach_frozen of '" + s.param.name + "' needs the whole weight, contiguous " +
                dtype_name(share.scalar_type()) + " " + shape_str(s.param.shape) + " on " + share.device().str() +
                ", got " + (values.is_contiguous() ? "" : "non-contiguous ") + dtype_name(values.scalar_type()) + " " +
                shape_str(values.sizes().vec()) + " on " + values.device().str());
  params_[static_cast<size_t>(slot)].set_data(values);
}

void ParamStore::release_frozen(int slot) {
  partitioned_frozen(plan_, slot, "release_frozen");
  at::Tensor& p = params_[static_cast<size_t>(slot)];
  p.set_data(at::empty({0}, p.options()));
}

const std::vector<at::Tensor>& ParamStore::frozen_tensors(int slot) const {
  const ParamSlot& s = plan_.slots().at(static_cast<size_t>(slot));
  if (s.group >= 0) throw Error("parameter store: '" + s.param.name + "' is trainable; it has no frozen tensors");
  return frozen_[static_cast<size_t>(slot)];
}

std::pair<at::Tensor, int64_t> ParamStore::slice(int slot, StoreBuffer b, int state) const {
  const ParamSlot& s = plan_.slots().at(static_cast<size_t>(slot));
  if (s.group < 0) {
    throw Error("parameter store: '" + s.param.name + "' is frozen; it has no " + to_string(b) +
                " buffer");
  }
  const Group& group = groups_[static_cast<size_t>(s.group)];
  const at::Tensor* buf = nullptr;
  switch (b) {
    case StoreBuffer::kCompute: buf = &group.compute; break;
    case StoreBuffer::kMaster: buf = &group.master; break;
    case StoreBuffer::kGrad: buf = &group.grad; break;
    case StoreBuffer::kState: buf = &group.state.at(static_cast<size_t>(state)); break;
  }
  if (!buf->defined()) {
    throw Error("parameter store: group '" + plan_.groups()[static_cast<size_t>(s.group)].name +
                "' allocates no " + to_string(b) + " buffer (parameter '" + s.param.name + "')");
  }
  const BufferLayout& l = plan_.groups()[static_cast<size_t>(s.group)].buffer(b);
  const int64_t begin = l.extent == Extent::kFull ? 0 : plan_.partition(s.group).begin;
  // Elements per value: 1, except for a state tensor of a quantized format. The parameter starts
  // on a value boundary (blocks_per_tensor), and so does every partition (the alignment).
  const int64_t v = b == StoreBuffer::kState ? plan_.state_format(s.group).tensors.at(static_cast<size_t>(state)).per_value : 1;
  const ElementRange held = plan_.range(slot) & ElementRange{begin, begin + plan_.held_numel(s.group, b)};
  if (held.empty()) return {buf->narrow(0, 0, 0), 0};
  const int64_t first = (held.begin - begin) / v;
  return {buf->narrow(0, first, at::ceil_div(held.end - begin, v) - first), (held.begin - s.offset) / v};
}

}  // namespace memrt
