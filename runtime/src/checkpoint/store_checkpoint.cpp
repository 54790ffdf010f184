#include "checkpoint/store_checkpoint.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <ATen/core/grad_mode.h>
#include <rapidjson/document.h>
#include <rapidjson/prettywriter.h>
#include <rapidjson/stringbuffer.h>

#include "memrt/error.h"

namespace memrt {
namespace {

namespace fs = std::filesystem;

constexpr char kWeight[] = "weight";

std::string dtype_name(at::ScalarType t) {
  const auto name = safetensors_dtype_name(t);
  return name ? *name : std::string(c10::toString(t));
}

std::string shard_name(const std::string& group, const std::string& buffer) {
  return "store/" + group + "/" + buffer;
}

std::string frozen_name(const std::string& param) { return "store/frozen/" + param; }

// Group g's saved buffers, in the order store.json lists them: the exact weight, then the state.
// The weight is the master when there is one, else the compute buffer (held whole in stages <= 2).
std::vector<std::pair<std::string, at::Tensor>> saved_buffers(const ParamStore& store, int g) {
  const ParamStore::Group& group = store.groups()[static_cast<size_t>(g)];
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.emplace_back(kWeight, group.master.defined() ? group.master : group.compute);
  for (size_t k = 0; k < store.plan().state_names().size(); ++k)
    out.emplace_back(store.plan().state_names()[k], group.state[k]);
  return out;
}

}  // namespace

std::string store_layout_json(const ParamStore& store) {
  const StorePlan& plan = store.plan();
  rapidjson::StringBuffer sb;
  rapidjson::PrettyWriter<rapidjson::StringBuffer> w(sb);
  w.SetIndent(' ', 2);
  w.SetFormatOptions(rapidjson::kFormatSingleLineArray);
  // Opens a parameter's object with its name and shape; the caller adds the rest and closes it.
  auto begin_param = [&](const ParamInfo& p) {
    w.StartObject();
    w.Key("name");
    w.String(p.name.c_str());
    w.Key("shape");
    w.StartArray();
    for (int64_t d : p.shape) w.Int64(d);
    w.EndArray();
  };
  w.StartObject();
  w.Key("format");
  w.String("memrt-store");
  w.Key("version");
  w.Int(1);
  w.Key("world_size");
  w.Int(plan.world_size());
  w.Key("state");
  w.StartArray();
  for (const std::string& s : plan.state_names()) w.String(s.c_str());
  w.EndArray();
  w.Key("groups");
  w.StartArray();
  for (int g = 0; g < static_cast<int>(plan.groups().size()); ++g) {
    const StoreGroup& group = plan.groups()[static_cast<size_t>(g)];
    w.StartObject();
    w.Key("name");
    w.String(group.name.c_str());
    w.Key("numel");
    w.Int64(group.numel);
    w.Key("padded");
    w.Int64(group.padded);
    w.Key("buffers");
    w.StartObject();
    for (const auto& [name, t] : saved_buffers(store, g)) {
      w.Key(name.c_str());
      w.String(dtype_name(t.scalar_type()).c_str());
    }
    w.EndObject();
    w.Key("params");
    w.StartArray();
    for (int slot : group.slots) {
      const ParamSlot& s = plan.slots()[static_cast<size_t>(slot)];
      begin_param(s.param);
      w.Key("offset");
      w.Int64(s.offset);
      w.EndObject();
    }
    w.EndArray();
    w.EndObject();
  }
  w.EndArray();
  w.Key("frozen");
  w.StartArray();
  for (size_t i = 0; i < plan.slots().size(); ++i) {
    const ParamSlot& s = plan.slots()[i];
    if (s.group >= 0) continue;
    begin_param(s.param);
    w.Key("dtype");
    w.String(dtype_name(store.param(static_cast<int>(i)).scalar_type()).c_str());
    w.EndObject();
  }
  w.EndArray();
  w.EndObject();
  return std::string(sb.GetString(), sb.GetSize()) + "\n";
}

std::vector<std::pair<std::string, at::Tensor>> store_shard_tensors(const ParamStore& store) {
  const StorePlan& plan = store.plan();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (int g = 0; g < static_cast<int>(plan.groups().size()); ++g) {
    const StoreGroup& group = plan.groups()[static_cast<size_t>(g)];
    const auto [first, last] = plan.partition(g);  // this rank's share of the group
    for (const auto& [name, t] : saved_buffers(store, g)) {
      // A partition buffer holds exactly this share; a full one is narrowed to it.
      const bool whole = t.numel() == group.padded;
      out.emplace_back(shard_name(group.name, name),
                       whole ? t.narrow(0, first, last - first) : t);
    }
  }
  if (plan.rank() == 0) {
    for (size_t i = 0; i < plan.slots().size(); ++i)
      if (plan.slots()[i].group < 0)
        out.emplace_back(frozen_name(plan.slots()[i].param.name), store.param(static_cast<int>(i)));
  }
  return out;
}

SavedStore::SavedStore(const std::string& dir, std::function<const SafetensorsFile&(int)> rank_file)
    : path_((fs::path(dir) / kStoreLayoutFile).string()), rank_file_(std::move(rank_file)) {
  std::ifstream in(path_, std::ios::binary);
  if (!in) throw FileError(path_, "cannot be read: the checkpoint lacks the store's layout");
  std::stringstream text;
  text << in.rdbuf();
  const std::string s = text.str();
  rapidjson::Document d;
  d.Parse(s.c_str(), s.size());
  auto bad = [&](const std::string& what) { return FileError(path_, "malformed: " + what); };
  if (d.HasParseError() || !d.IsObject()) throw bad("not a JSON object");
  if (!d.HasMember("format") || !d["format"].IsString() || std::string(d["format"].GetString()) != "memrt-store")
    throw bad("\"format\" is not \"memrt-store\"");
  if (!d.HasMember("version") || !d["version"].IsInt() || d["version"].GetInt() != 1)
    throw bad("\"version\" is not 1, the only store layout this memrt reads");
  if (!d.HasMember("world_size") || !d["world_size"].IsInt() || d["world_size"].GetInt() < 1)
    throw bad("no positive integer \"world_size\"");
  world_size_ = d["world_size"].GetInt();
  if (!d.HasMember("state") || !d["state"].IsArray()) throw bad("no \"state\" array");
  for (const auto& v : d["state"].GetArray()) {
    if (!v.IsString()) throw bad("\"state\" holds a non-string");
    state_names_.push_back(v.GetString());
  }
  auto read_shape = [&](const rapidjson::Value& v, const std::string& name) {
    if (!v.HasMember("shape") || !v["shape"].IsArray()) throw bad("parameter '" + name + "' has no \"shape\"");
    std::vector<int64_t> shape;
    int64_t numel = 1;
    for (const auto& dim : v["shape"].GetArray()) {
      if (!dim.IsInt64() || dim.GetInt64() < 0) throw bad("parameter '" + name + "' has a bad \"shape\"");
      if (dim.GetInt64() > 0 && numel > INT64_MAX / dim.GetInt64())
        throw bad("parameter '" + name + "' has a \"shape\" of more than 2^63 elements");
      numel *= dim.GetInt64();
      shape.push_back(dim.GetInt64());
    }
    return shape;
  };
  auto add = [&](const std::string& name, Param p) {
    p.numel = 1;
    for (int64_t dim : p.shape) p.numel *= dim;
    if (!params_.emplace(name, std::move(p)).second) throw bad("parameter '" + name + "' listed twice");
  };
  if (!d.HasMember("groups") || !d["groups"].IsArray()) throw bad("no \"groups\" array");
  for (const auto& g : d["groups"].GetArray()) {
    if (!g.IsObject() || !g.HasMember("name") || !g["name"].IsString() || !g.HasMember("padded") ||
        !g["padded"].IsInt64() || !g.HasMember("numel") || !g["numel"].IsInt64() ||
        !g.HasMember("params") || !g["params"].IsArray() || !g.HasMember("buffers") || !g["buffers"].IsObject())
      throw bad("a group lacks \"name\", \"numel\", \"padded\", \"buffers\" or \"params\"");
    Group group{g["name"].GetString(), g["padded"].GetInt64(), g["numel"].GetInt64(), {}};
    if (group.padded < 0) throw bad("group '" + group.name + "': \"padded\" is negative");
    if (group.numel < 0 || group.numel > group.padded)
      throw bad("group '" + group.name + "': \"numel\" is not between 0 and \"padded\"");
    for (const auto& b : g["buffers"].GetObject()) {
      if (!b.value.IsString()) throw bad("group '" + group.name + "': a buffer's dtype is not a string");
      group.dtypes[b.name.GetString()] = b.value.GetString();
    }
    for (const std::string& b : saved_buffer_names())
      if (!group.dtypes.count(b)) throw bad("group '" + group.name + "' lists no buffer \"" + b + "\"");
    if (group.padded % world_size_ != 0)
      throw bad("group '" + group.name + "': \"padded\" does not split across " + std::to_string(world_size_) + " ranks");
    for (const auto& v : g["params"].GetArray()) {
      if (!v.IsObject() || !v.HasMember("name") || !v["name"].IsString()) throw bad("a parameter has no \"name\"");
      const std::string name = v["name"].GetString();
      Param p;
      p.shape = read_shape(v, name);
      p.group = static_cast<int>(groups_.size());
      if (!v.HasMember("offset") || !v["offset"].IsInt64() || v["offset"].GetInt64() < 0)
        throw bad("parameter '" + name + "' has no \"offset\"");
      p.offset = v["offset"].GetInt64();
      const int64_t offset = p.offset;
      add(name, std::move(p));
      if (params_.at(name).numel > group.numel - offset)
        throw bad("parameter '" + name + "' ends beyond its group's \"numel\"");
    }
    groups_.push_back(std::move(group));
  }
  if (!d.HasMember("frozen") || !d["frozen"].IsArray()) throw bad("no \"frozen\" array");
  for (const auto& v : d["frozen"].GetArray()) {
    if (!v.IsObject() || !v.HasMember("name") || !v["name"].IsString() || !v.HasMember("dtype") ||
        !v["dtype"].IsString())
      throw bad("a frozen parameter has no \"name\" or \"dtype\"");
    Param p;
    p.shape = read_shape(v, v["name"].GetString());
    p.dtype = v["dtype"].GetString();
    add(v["name"].GetString(), std::move(p));
  }
}

std::vector<std::string> SavedStore::saved_buffer_names() const {
  std::vector<std::string> out = {kWeight};
  out.insert(out.end(), state_names_.begin(), state_names_.end());
  return out;
}

std::vector<std::string> SavedStore::param_names() const {
  std::vector<std::string> out;
  for (const auto& [name, p] : params_) out.push_back(name);
  return out;
}

bool SavedStore::trainable(const std::string& param) const { return params_.at(param).group >= 0; }

const std::vector<int64_t>& SavedStore::shape(const std::string& param) const {
  return params_.at(param).shape;
}

void SavedStore::read(const std::string& param, const std::string& buffer, int64_t first,
                      at::Tensor dst) const {
  auto it = params_.find(param);
  if (it == params_.end()) throw FileError(path_, "lists no parameter '" + param + "'");
  const Param& p = it->second;
  const int64_t n = dst.numel();
  TORCH_CHECK(first >= 0 && first + n <= p.numel && dst.is_contiguous(), "SavedStore::read: bad range");
  at::Tensor out = dst.view({-1});
  auto shard = [&](int rank, const std::string& name, int64_t numel, const std::string& dtype) {
    const SafetensorsFile& file = rank_file_(rank);
    if (!file.contains(name))
      throw FileError(file.path(), "lacks tensor '" + name + "', which store.json says this rank saved");
    const at::Tensor t = file.tensor(name);
    if (t.numel() != numel || dtype_name(t.scalar_type()) != dtype)
      throw FileError(file.path(), "tensor '" + name + "' is " + std::to_string(t.numel()) + " " +
                                       dtype_name(t.scalar_type()) + " elements; store.json gives it " +
                                       std::to_string(numel) + " " + dtype + " elements");
    return t.view({-1});
  };
  if (p.group < 0) {
    if (buffer != kWeight)
      throw FileError(path_, "parameter '" + param + "' is frozen: it has no optimizer state '" + buffer + "'");
    out.copy_(shard(0, frozen_name(param), p.numel, p.dtype).narrow(0, first, n));
    return;
  }
  if (buffer != kWeight && std::find(state_names_.begin(), state_names_.end(), buffer) == state_names_.end())
    throw FileError(path_, "holds no optimizer state '" + buffer + "'");
  const Group& g = groups_[static_cast<size_t>(p.group)];
  const int64_t share = g.padded / world_size_;
  // The elements' positions in the group, [a, b), split over the shards that hold them.
  const int64_t a = p.offset + first, b = a + n;
  for (int64_t pos = a; pos < b;) {
    const int rank = static_cast<int>(pos / share);
    const int64_t end = std::min(b, (rank + 1) * share);
    const at::Tensor src = shard(rank, shard_name(g.name, buffer), share, g.dtypes.at(buffer));
    out.narrow(0, pos - a, end - pos).copy_(src.narrow(0, pos - rank * share, end - pos));
    pos = end;
  }
}

int64_t load_store(ParamStore& store, const SavedStore& saved, LoadShare share) {
  const StorePlan& plan = store.plan();
  auto fix = [](const std::string& what) {
    return what + ": resume with the model, plugins and optimizer the checkpoint was made with "
                  "(or export it with `launcher export` and start a new run from its weights)";
  };
  if (saved.state_names() != plan.state_names()) {
    auto list = [](const std::vector<std::string>& v) {
      std::string s = "{";
      for (const std::string& x : v) s += (s.size() > 1 ? ", " : "") + x;
      return s + "}";
    };
    throw FileError(saved.path(), fix("the checkpoint's optimizer state is " + list(saved.state_names()) +
                                    ", this run's optimizer keeps " + list(plan.state_names())));
  }
  const bool partition_only = share == LoadShare::kPartition;
  std::set<std::string> planned;
  at::NoGradGuard no_grad;
  for (int slot = 0; slot < static_cast<int>(plan.slots().size()); ++slot) {
    const ParamSlot& s = plan.slots()[static_cast<size_t>(slot)];
    planned.insert(s.param.name);
    if (!saved.contains(s.param.name))
      throw FileError(saved.path(), fix("the checkpoint has no parameter '" + s.param.name + "', which this run's model has"));
    if (saved.shape(s.param.name) != s.param.shape)
      throw FileError(saved.path(), fix("parameter '" + s.param.name + "' has shape " +
                                      c10::str(at::IntArrayRef(saved.shape(s.param.name))) + " in the checkpoint, " +
                                      c10::str(at::IntArrayRef(s.param.shape)) + " in this run"));
    if (s.group < 0) {
      if (!partition_only || plan.rank() == 0) saved.read(s.param.name, kWeight, 0, store.param(slot));
      continue;
    }
    if (!saved.trainable(s.param.name))
      throw FileError(saved.path(), fix("parameter '" + s.param.name + "' was frozen in the checkpoint's run and is trained in this one"));
    // What this rank reads of buffer b: what it holds of the parameter, or only the part in its
    // partition. The compute copy is rounded from the exact weight as the step's write-back rounds.
    const ElementRange wanted = partition_only ? plan.range(slot) & plan.partition(s.group) : plan.range(slot);
    auto load = [&](StoreBuffer b, int k, const std::string& name) {
      const auto [view, first] = store.slice(slot, b, k);
      const ElementRange held{s.offset + first, s.offset + first + view.numel()};
      const ElementRange part = held & wanted;
      if (!part.empty())
        saved.read(s.param.name, name, part.begin - s.offset, view.narrow(0, part.begin - held.begin, part.size()));
    };
    load(StoreBuffer::kCompute, 0, kWeight);
    const ParamStore::Group& g = store.groups()[static_cast<size_t>(s.group)];
    if (g.master.defined()) load(StoreBuffer::kMaster, 0, kWeight);
    for (size_t k = 0; k < plan.state_names().size(); ++k)
      load(StoreBuffer::kState, static_cast<int>(k), plan.state_names()[k]);
  }
  for (const std::string& name : saved.param_names())
    if (!planned.count(name))
      throw FileError(saved.path(), fix("the checkpoint has parameter '" + name + "', which this run's model lacks"));
  return static_cast<int64_t>(plan.slots().size());
}

void complete_loaded_store(ParamStore& store, Communicator& comm) {
  if (comm.world_size() == 1) return;  // one rank's partition is everything
  const StorePlan& plan = store.plan();
  at::NoGradGuard no_grad;
  for (int g = 0; g < static_cast<int>(plan.groups().size()); ++g) {
    ParamStore::Group& group = store.groups()[static_cast<size_t>(g)];
    const ElementRange mine = plan.partition(g);
    std::vector<at::Tensor*> full = {&group.compute};
    if (group.master.defined() && plan.groups()[static_cast<size_t>(g)].buffer(StoreBuffer::kMaster).extent == Extent::kFull)
      full.push_back(&group.master);
    if (plan.groups()[static_cast<size_t>(g)].buffer(StoreBuffer::kState).extent == Extent::kFull)
      for (at::Tensor& t : group.state) full.push_back(&t);
    for (at::Tensor* t : full) {
      const at::Tensor part = t->narrow(0, mine.begin, mine.size()).clone();  // all_gather's input
      comm.all_gather(*t, part);
    }
  }
  for (size_t i = 0; i < plan.slots().size(); ++i) {
    if (plan.slots()[i].group >= 0) continue;
    at::Tensor p = store.param(static_cast<int>(i));
    comm.broadcast(p, 0);
  }
}

}  // namespace memrt
