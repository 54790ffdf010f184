// The parameter store (memrt/param_store.h, docs/parameter-store.md).
#include "memrt/param_store.h"

#include <algorithm>
#include <numeric>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

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

}  // namespace

// ---- the plan -------------------------------------------------------------------------------------

StorePlan::StorePlan(const std::vector<ParamInfo>& params, const StoreOptions& options)
    : options_(options) {
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
  for (size_t i = 0; i < slots_.size(); ++i) {
    ParamSlot& s = slots_[i];
    if (s.group < 0 || !spec.select(s.param)) continue;
    const StoreGroup& from = groups_[static_cast<size_t>(s.group)];
    if (added.slots.empty()) {
      added.buffers = from.buffers;
    } else if (added.buffer(StoreBuffer::kCompute).dtype != from.buffer(StoreBuffer::kCompute).dtype) {
      throw Error(where + " selects parameters of two compute dtypes ('" + s.param.name + "' is " +
                  dtype_name(from.buffer(StoreBuffer::kCompute).dtype) + "); a group has one");
    }
    added.slots.push_back(static_cast<int>(i));
  }
  if (added.slots.empty()) throw Error(where + " selects no trainable parameter");
  record("group " + spec.name, "added");
  const int index = static_cast<int>(groups_.size());
  for (int i : added.slots) slots_[static_cast<size_t>(i)].group = index;
  groups_.push_back(std::move(added));
  // Every group keeps the slots still in it; empty ones go, and the slots' indices follow.
  std::vector<StoreGroup> kept;
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
  }
  groups_ = std::move(kept);
  for (ParamSlot& s : slots_)
    if (s.group >= 0) s.group = renumber[static_cast<size_t>(s.group)];
  relayout();
  return renumber[static_cast<size_t>(index)];
}

void StorePlan::relayout() {
  const int64_t unit = alignment_ * options_.world_size;
  for (StoreGroup& g : groups_) {
    g.numel = 0;
    for (int i : g.slots) {
      ParamSlot& s = slots_[static_cast<size_t>(i)];
      s.offset = g.numel;
      g.numel += s.numel;
    }
    g.padded = (g.numel + unit - 1) / unit * unit;
  }
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

void StorePlan::record(const std::string& axis, const std::string& value) {
  if (author_.empty()) return;  // the host's defaults
  auto it = set_by_.find(axis);
  if (it != set_by_.end() && it->second.second != author_) {
    if (it->second.first == value) return;  // agrees with the plugin that set it first
    throw Error("parameter store: plugins '" + it->second.second + "' and '" + author_ +
                "' both set the store's " + axis + ", to " + it->second.first + " and to " +
                value + "; only one plugin may decide it: drop one of them from the config or "
                "make their settings agree");
  }
  set_by_[axis] = {value, author_};
}

void StorePlan::set_compute_dtype(at::ScalarType dtype) {
  if (dtype != at::kFloat && !is_16bit(dtype)) {
    throw Error(std::string("parameter store: compute dtype ") + c10::toString(dtype) +
                " is not one the step takes (fp32, bf16, fp16)");
  }
  record("compute dtype", dtype_name(dtype));
  const bool grad_follows = set_by_.count("gradient dtype") == 0;
  for (StoreGroup& g : groups_) {
    buffer(g, StoreBuffer::kCompute).dtype = dtype;
    if (grad_follows) buffer(g, StoreBuffer::kGrad).dtype = dtype;
  }
  for (ParamSlot& s : slots_)
    if (s.group < 0 && at::isFloatingType(s.param.dtype)) s.param.dtype = dtype;
}

void StorePlan::set_master_weights(bool on) {
  record("master weights", on ? "on" : "off");
  for (StoreGroup& g : groups_) buffer(g, StoreBuffer::kMaster).present = on;
}

void StorePlan::set_state_dtype(at::ScalarType dtype) {
  if (dtype != at::kFloat && dtype != at::kBFloat16) {
    throw Error(std::string("parameter store: optimizer state in ") + c10::toString(dtype) +
                " is not a format the step takes (fp32, bf16)");
  }
  record("optimizer state dtype", dtype_name(dtype));
  for (StoreGroup& g : groups_) buffer(g, StoreBuffer::kState).dtype = dtype;
}

void StorePlan::set_grad_dtype(at::ScalarType dtype) {
  record("gradient dtype", dtype_name(dtype));
  for (StoreGroup& g : groups_) buffer(g, StoreBuffer::kGrad).dtype = dtype;
}

void StorePlan::set_extent(StoreBuffer b, Extent extent) {
  if (b == StoreBuffer::kCompute && extent == Extent::kPartition) {
    throw Error("parameter store: partitioned compute weights (ZeRO stage 3) are not built yet");
  }
  record(std::string(to_string(b)) + " extent", to_string(extent));
  for (StoreGroup& g : groups_) buffer(g, b).extent = extent;
}

void StorePlan::set_placement(StoreBuffer b, Placement placement) {
  record(std::string(to_string(b)) + " placement", memory::to_string(placement));
  for (StoreGroup& g : groups_) buffer(g, b).placement = placement;
}

void StorePlan::require_alignment(int64_t elements) {
  if (elements < 1) throw Error("parameter store: an alignment must be at least one element");
  alignment_ = std::lcm(alignment_, elements);
  relayout();
}

void StorePlan::check() const {
  for (const StoreGroup& g : groups_) {
    const at::ScalarType c = g.buffer(StoreBuffer::kCompute).dtype;
    const bool master = g.buffer(StoreBuffer::kMaster).present;
    auto set_off = set_by_.find("master weights");
    const bool in_place = c == at::kBFloat16 && set_off != set_by_.end() && set_off->second.first == "off";
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
      const int64_t copies = b == StoreBuffer::kState ? static_cast<int64_t>(state_names_.size()) : 1;
      t.at(category_of(b), l.placement) += copies * held_numel(g, b) * elem_size(l.dtype);
    }
  }
  for (const ParamSlot& s : slots_)
    if (s.group < 0) t.at(Category::kWeights) += s.numel * elem_size(s.param.dtype);
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
      os << "; " << to_string(b) << " " << dtype_name(l.dtype) << " ";
      if (b == StoreBuffer::kGrad && !flat_grad(g)) {
        os << "per tensor";
      } else {
        os << to_string(l.extent);
      }
      if (l.placement == Placement::kHost) os << " on host";
    }
    os << "\n";
  }
  int64_t frozen = 0;
  for (const ParamSlot& s : slots_) frozen += s.group < 0 ? s.numel : 0;
  if (frozen > 0) os << "  frozen: " << frozen << " elements\n";
  return os.str();
}

// ---- the allocated store --------------------------------------------------------------------------

ParamStore::ParamStore(StorePlan plan, const std::vector<std::pair<std::string, at::Tensor>>& params,
                       at::Device device)
    : plan_(std::move(plan)) {
  plan_.check();
  std::unordered_map<std::string, const at::Tensor*> by_name;
  for (const auto& [name, t] : params) by_name[name] = &t;
  std::unordered_set<std::string> planned;
  for (const ParamSlot& s : plan_.slots()) planned.insert(s.param.name);
  for (const auto& [name, t] : params) {
    if (!planned.count(name))
      throw Error("parameter store: the model has parameter '" + name + "', which the plan lacks");
  }
  params_.reserve(plan_.slots().size());
  for (const ParamSlot& s : plan_.slots()) {
    auto it = by_name.find(s.param.name);
    if (it == by_name.end())
      throw Error("parameter store: the plan has parameter '" + s.param.name + "', which the model lacks");
    const at::Tensor& t = *it->second;
    if (t.sizes().vec() != s.param.shape) {
      throw Error("parameter store: parameter '" + s.param.name + "' has shape " +
                  shape_str(t.sizes().vec()) + " but the plan says " + shape_str(s.param.shape));
    }
    params_.push_back(t);
  }

  at::NoGradGuard no_grad;
  auto alloc = [&](const BufferLayout& l, int64_t numel, Category category) {
    memory::Scope scope(category, l.placement);
    const at::Device where = l.placement == Placement::kHost ? at::Device(at::kCPU) : device;
    return at::zeros({numel}, at::TensorOptions().dtype(l.dtype).device(where));
  };
  for (int g = 0; g < static_cast<int>(plan_.groups().size()); ++g) {
    const StoreGroup& group = plan_.groups()[static_cast<size_t>(g)];
    Group out;
    const BufferLayout& compute = group.buffer(StoreBuffer::kCompute);
    out.compute = alloc(compute, plan_.held_numel(g, StoreBuffer::kCompute), Category::kWeights);
    if (group.buffer(StoreBuffer::kMaster).present) {
      out.master = alloc(group.buffer(StoreBuffer::kMaster),
                         plan_.held_numel(g, StoreBuffer::kMaster), Category::kMasterWeights);
    }
    if (const int64_t n = plan_.held_numel(g, StoreBuffer::kGrad); n > 0) {
      out.grad = alloc(group.buffer(StoreBuffer::kGrad), n, Category::kGradients);
    }
    groups_.push_back(std::move(out));
  }
  // Fill: masters from the values as they are (fp32), then the compute copy; each parameter then
  // becomes a view of its range, and its old storage goes at once. The state comes after, so the
  // set-up's peak holds the old parameters or the state, never both.
  for (size_t i = 0; i < plan_.slots().size(); ++i) {
    const ParamSlot& s = plan_.slots()[i];
    at::Tensor& p = params_[i];
    if (s.group < 0) {
      if (p.is_floating_point() && p.scalar_type() != s.param.dtype) {
        memory::Scope scope(Category::kWeights);
        p.set_data(p.to(s.param.dtype));
      }
      continue;
    }
    Group& out = groups_[static_cast<size_t>(s.group)];
    const at::Tensor flat = p.detach().reshape({-1});
    if (out.master.defined()) {
      auto [view, first] = slice(static_cast<int>(i), StoreBuffer::kMaster);
      view.copy_(flat.narrow(0, first, view.numel()));
    }
    at::Tensor range = out.compute.narrow(0, s.offset, s.numel);
    range.copy_(flat);
    p.set_data(range.view(s.param.shape));
  }
  for (int g = 0; g < static_cast<int>(plan_.groups().size()); ++g) {
    for (size_t k = 0; k < plan_.state_names().size(); ++k) {
      groups_[static_cast<size_t>(g)].state.push_back(
          alloc(plan_.groups()[static_cast<size_t>(g)].buffer(StoreBuffer::kState),
                plan_.held_numel(g, StoreBuffer::kState), Category::kOptimizerState));
    }
  }
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
  const ElementRange held = plan_.range(slot) & ElementRange{begin, begin + buf->numel()};
  if (held.empty()) return {buf->narrow(0, 0, 0), 0};
  return {buf->narrow(0, held.begin - begin, held.size()), held.begin - s.offset};
}

}  // namespace memrt
