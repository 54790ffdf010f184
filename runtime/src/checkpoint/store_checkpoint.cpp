#include "checkpoint/store_checkpoint.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <ATen/ceil_div.h>
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

std::string frozen_name(const std::string& tensor) { return "store/frozen/" + tensor; }

// The rank that saves (and, loading one share per rank, reads) a frozen parameter's tensors: spread
// by name (FNV-1a, the same on every rank and build), so no rank writes the whole frozen base.
int frozen_owner(const std::string& name, int world_size) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return static_cast<int>(h % static_cast<uint64_t>(world_size));
}

// Whether frozen slot i is partitioned (ZeRO-3): each rank saves and reads its own share.
bool partitioned_frozen(const StorePlan& plan, int slot) {
  return plan.frozen_layout(slot).extent == Extent::kPartition;
}

struct SavedBuffer {
  std::string name;
  at::Tensor tensor;
  int64_t per_value = 1;  // elements per value (a state tensor of a quantized format)
};

// Group g's saved buffers, in the order store.json lists them: the exact weight, then every tensor
// of the state format. The weight is the master when there is one, else the compute buffer (whole
// in stages <= 2, this rank's partition in stage 3).
std::vector<SavedBuffer> saved_buffers(const ParamStore& store, int g) {
  const ParamStore::Group& group = store.groups()[static_cast<size_t>(g)];
  std::vector<SavedBuffer> out;
  out.push_back({kWeight, group.master.defined() ? group.master : group.compute, 1});
  const std::vector<StateTensor>& tensors = store.plan().state_format(g).tensors;
  for (size_t k = 0; k < group.state.size(); ++k) out.push_back({tensors[k].name, group.state[k], tensors[k].per_value});
  return out;
}

}  // namespace

std::string store_layout_json(const ParamStore& store, const BaseSource* base) {
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
  w.Int(4);
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
    for (const SavedBuffer& b : saved_buffers(store, g)) {
      w.Key(b.name.c_str());
      w.String(dtype_name(b.tensor.scalar_type()).c_str());
    }
    w.EndObject();
    const StateFormat& format = plan.state_format(g);
    w.Key("state_format");
    w.StartObject();
    w.Key("name");
    w.String(format.name.c_str());
    w.Key("block");
    w.Int64(format.block);
    w.Key("blocks_per_tensor");
    w.Bool(format.blocks_per_tensor);
    w.Key("per_value");
    w.StartObject();
    for (const StateTensor& t : format.tensors) {
      w.Key(t.name.c_str());
      w.Int64(t.per_value);
    }
    w.EndObject();
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
    const std::vector<at::Tensor>& tensors = store.frozen_tensors(static_cast<int>(i));
    begin_param(s.param);
    w.Key("dtype");
    w.String(dtype_name(tensors.front().scalar_type()).c_str());
    w.Key("rank");
    if (base)
      w.Null();
    else if (partitioned_frozen(plan, static_cast<int>(i)))
      w.String("shares");
    else
      w.Int(frozen_owner(s.param.name, plan.world_size()));
    w.Key("format");
    w.String(plan.frozen_layout(static_cast<int>(i)).format.c_str());
    w.Key("buffers");  // the layout's other tensors, saved beside the parameter
    w.StartArray();
    for (size_t k = 1; k < tensors.size(); ++k) {
      w.StartObject();
      w.Key("name");
      w.String(plan.frozen_layout(static_cast<int>(i)).tensors[k].name.c_str());
      w.Key("dtype");
      w.String(dtype_name(tensors[k].scalar_type()).c_str());
      w.Key("shape");
      w.StartArray();
      for (int64_t d : tensors[k].sizes()) w.Int64(d);
      w.EndArray();
      w.EndObject();
    }
    w.EndArray();
    w.EndObject();
  }
  w.EndArray();
  w.Key("base");
  if (!base) {
    w.Null();
  } else {
    w.StartObject();
    w.Key("dir");
    w.String(base->dir.c_str());
    w.Key("config_sha256");
    w.String(base->config_sha256.c_str());
    w.Key("files");
    w.StartArray();
    for (const BaseSource::File& f : base->files) {
      w.StartObject();
      w.Key("name");
      w.String(f.name.c_str());
      w.Key("bytes");
      w.Uint64(f.bytes);
      w.Key("sample_sha256");
      w.String(f.sample_sha256.c_str());
      w.EndObject();
    }
    w.EndArray();
    w.EndObject();
  }
  w.EndObject();
  return std::string(sb.GetString(), sb.GetSize()) + "\n";
}

std::vector<std::pair<std::string, at::Tensor>> store_shard_tensors(const ParamStore& store, const BaseSource* base) {
  const StorePlan& plan = store.plan();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (int g = 0; g < static_cast<int>(plan.groups().size()); ++g) {
    const StoreGroup& group = plan.groups()[static_cast<size_t>(g)];
    const auto [first, last] = plan.partition(g);  // this rank's share of the group
    for (const SavedBuffer& b : saved_buffers(store, g)) {
      // A partition buffer holds exactly this share; a full one is narrowed to it. Partitions
      // start and end on value boundaries (the plan's alignment).
      const bool whole = b.tensor.numel() == group.padded / b.per_value;
      out.emplace_back(shard_name(group.name, b.name),
                       whole ? b.tensor.narrow(0, first / b.per_value, (last - first) / b.per_value) : b.tensor);
    }
  }
  for (size_t i = 0; i < plan.slots().size() && !base; ++i) {
    const ParamSlot& s = plan.slots()[i];
    if (s.group >= 0) continue;
    const std::vector<at::Tensor>& tensors = store.frozen_tensors(static_cast<int>(i));
    if (partitioned_frozen(plan, static_cast<int>(i))) {  // this rank's share (none past the end)
      if (tensors.front().numel() > 0) out.emplace_back(frozen_name(s.param.name), tensors.front());
      continue;
    }
    if (frozen_owner(s.param.name, plan.world_size()) != plan.rank()) continue;
    const FrozenLayout& layout = plan.frozen_layout(static_cast<int>(i));
    for (size_t k = 0; k < tensors.size(); ++k) out.emplace_back(frozen_name(layout.tensors[k].name), tensors[k]);
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
  if (!d.HasMember("version") || !d["version"].IsInt() || d["version"].GetInt() < 1 || d["version"].GetInt() > 4)
    throw bad("\"version\" is not 1 to 4, the store layouts this memrt reads");
  const int version = d["version"].GetInt();
  if (!d.HasMember("world_size") || !d["world_size"].IsInt() || d["world_size"].GetInt() < 1)
    throw bad("no positive integer \"world_size\"");
  world_size_ = d["world_size"].GetInt();
  if (!d.HasMember("state") || !d["state"].IsArray()) throw bad("no \"state\" array");
  for (const auto& v : d["state"].GetArray()) {
    if (!v.IsString()) throw bad("\"state\" holds a non-string");
    state_names_.push_back(v.GetString());
  }
  // The shape, and its product in `numel`, checked against overflow.
  auto read_shape = [&](const rapidjson::Value& v, const std::string& name, int64_t& numel) {
    if (!v.HasMember("shape") || !v["shape"].IsArray()) throw bad("parameter '" + name + "' has no \"shape\"");
    std::vector<int64_t> shape;
    numel = 1;
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
    if (!params_.emplace(name, std::move(p)).second) throw bad("parameter '" + name + "' listed twice");
  };
  if (!d.HasMember("groups") || !d["groups"].IsArray()) throw bad("no \"groups\" array");
  for (const auto& g : d["groups"].GetArray()) {
    if (!g.IsObject() || !g.HasMember("name") || !g["name"].IsString() || !g.HasMember("padded") ||
        !g["padded"].IsInt64() || !g.HasMember("numel") || !g["numel"].IsInt64() ||
        !g.HasMember("params") || !g["params"].IsArray() || !g.HasMember("buffers") || !g["buffers"].IsObject())
      throw bad("a group lacks \"name\", \"numel\", \"padded\", \"buffers\" or \"params\"");
    Group group{g["name"].GetString(), g["padded"].GetInt64(), g["numel"].GetInt64(), {}, {}};
    if (group.padded < 0) throw bad("group '" + group.name + "': \"padded\" is negative");
    if (group.numel < 0 || group.numel > group.padded)
      throw bad("group '" + group.name + "': \"numel\" is not between 0 and \"padded\"");
    for (const auto& b : g["buffers"].GetObject()) {
      if (!b.value.IsString()) throw bad("group '" + group.name + "': a buffer's dtype is not a string");
      group.dtypes[b.name.GetString()] = b.value.GetString();
    }
    if (!group.dtypes.count(kWeight)) throw bad("group '" + group.name + "' lists no buffer \"weight\"");
    if (group.padded % world_size_ != 0)
      throw bad("group '" + group.name + "': \"padded\" does not split across " + std::to_string(world_size_) + " ranks");
    // The state format: version 1 kept one tensor per state name, one value per element.
    StateFormat& f = group.format;
    if (version == 1) {
      for (const std::string& state : state_names_) f.tensors.push_back({state, at::kFloat, 1});
    } else {
      if (!g.HasMember("state_format") || !g["state_format"].IsObject()) throw bad("group '" + group.name + "' has no \"state_format\"");
      const auto& sf = g["state_format"];
      if (!sf.HasMember("name") || !sf["name"].IsString() || !sf.HasMember("block") || !sf["block"].IsInt64() ||
          sf["block"].GetInt64() < 1 || !sf.HasMember("blocks_per_tensor") || !sf["blocks_per_tensor"].IsBool() ||
          !sf.HasMember("per_value") || !sf["per_value"].IsObject())
        throw bad("group '" + group.name + "': \"state_format\" lacks \"name\", \"block\", \"blocks_per_tensor\" or \"per_value\"");
      f.name = sf["name"].GetString();
      f.block = sf["block"].GetInt64();
      f.blocks_per_tensor = sf["blocks_per_tensor"].GetBool();
      for (const auto& t : sf["per_value"].GetObject()) {
        if (!t.value.IsInt64() || t.value.GetInt64() < 1 || f.block % t.value.GetInt64() != 0 ||
            (group.padded / world_size_) % t.value.GetInt64() != 0)
          throw bad("group '" + group.name + "': state tensor '" + t.name.GetString() +
                    "' has a \"per_value\" that does not divide the block and the share of a rank");
        f.tensors.push_back({t.name.GetString(), at::kFloat, t.value.GetInt64()});
      }
    }
    for (StateTensor& t : f.tensors) {
      auto dtype = group.dtypes.find(t.name);
      if (dtype == group.dtypes.end()) throw bad("group '" + group.name + "' lists no buffer \"" + t.name + "\"");
      if (auto type = safetensors_dtype(dtype->second)) t.dtype = *type;
    }
    if (version == 1 && !f.tensors.empty()) f.name = f.tensors.front().dtype == at::kBFloat16 ? "bf16" : "fp32";
    if (f.block > 1 && !f.blocks_per_tensor) throw bad("group '" + group.name + "': blocks of a state format must start at each parameter");
    for (const auto& v : g["params"].GetArray()) {
      if (!v.IsObject() || !v.HasMember("name") || !v["name"].IsString()) throw bad("a parameter has no \"name\"");
      const std::string name = v["name"].GetString();
      Param p;
      p.shape = read_shape(v, name, p.numel);
      p.group = static_cast<int>(groups_.size());
      if (!v.HasMember("offset") || !v["offset"].IsInt64() || v["offset"].GetInt64() < 0)
        throw bad("parameter '" + name + "' has no \"offset\"");
      p.offset = v["offset"].GetInt64();
      const int64_t offset = p.offset;
      if (group.format.blocks_per_tensor && offset % group.format.block != 0)
        throw bad("parameter '" + name + "' does not start on a block of its group's state format");
      add(name, std::move(p));
      if (params_.at(name).numel > group.numel - offset)
        throw bad("parameter '" + name + "' ends beyond its group's \"numel\"");
    }
    groups_.push_back(std::move(group));
  }
  if (version >= 3 && d.HasMember("base") && !d["base"].IsNull()) {
    const auto& b = d["base"];
    auto field = [&](const rapidjson::Value& v, const char* key) -> std::string {
      if (!v.IsObject() || !v.HasMember(key) || !v[key].IsString()) throw bad(std::string("\"base\" has no \"") + key + "\"");
      return v[key].GetString();
    };
    BaseSource source;
    source.dir = field(b, "dir");
    source.config_sha256 = field(b, "config_sha256");
    if (!b.HasMember("files") || !b["files"].IsArray()) throw bad("\"base\" has no \"files\" array");
    for (const auto& f : b["files"].GetArray()) {
      if (!f.IsObject() || !f.HasMember("bytes") || !f["bytes"].IsUint64()) throw bad("a file of \"base\" has no \"bytes\"");
      source.files.push_back({field(f, "name"), f["bytes"].GetUint64(), field(f, "sample_sha256")});
    }
    base_ = std::move(source);
  }
  if (!d.HasMember("frozen") || !d["frozen"].IsArray()) throw bad("no \"frozen\" array");
  for (const auto& v : d["frozen"].GetArray()) {
    if (!v.IsObject() || !v.HasMember("name") || !v["name"].IsString() || !v.HasMember("dtype") ||
        !v["dtype"].IsString())
      throw bad("a frozen parameter has no \"name\" or \"dtype\"");
    const std::string name = v["name"].GetString();
    Param p;
    p.shape = read_shape(v, name, p.numel);
    p.dtype = v["dtype"].GetString();
    if (version >= 2) {  // version 1: rank 0 saved every frozen parameter, alone
      const bool in_base = base_ && v.HasMember("rank") && v["rank"].IsNull();
      const bool shares = version >= 4 && v.HasMember("rank") && v["rank"].IsString() &&
                          std::string(v["rank"].GetString()) == "shares";
      if (!v.HasMember("rank") ||
          (!in_base && !shares && (!v["rank"].IsInt() || v["rank"].GetInt() < 0 || v["rank"].GetInt() >= world_size_)) ||
          !v.HasMember("format") || !v["format"].IsString() || !v.HasMember("buffers") || !v["buffers"].IsArray())
        throw bad("frozen parameter '" + name + "' lacks a \"rank\" of the saving world (null: left in \"base\"; "
                  "\"shares\": every rank's share), a \"format\" or \"buffers\"");
      p.rank = in_base ? kInBase : shares ? kShares : v["rank"].GetInt();
      p.format = v["format"].GetString();
      for (const auto& b : v["buffers"].GetArray()) {
        if (!b.IsObject() || !b.HasMember("name") || !b["name"].IsString() || !b.HasMember("dtype") || !b["dtype"].IsString())
          throw bad("a buffer of frozen parameter '" + name + "' has no \"name\" or \"dtype\"");
        Buffer buffer{b["name"].GetString(), b["dtype"].GetString(), {}, 1};
        buffer.shape = read_shape(b, buffer.name, buffer.numel);
        p.buffers.push_back(std::move(buffer));
      }
    }
    add(name, std::move(p));
  }
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
  TORCH_CHECK(first >= 0 && dst.is_contiguous(), "SavedStore::read: bad range");
  at::Tensor out = dst.view({-1});
  if (p.rank == kInBase) {
    if (!base_tensors_)
      throw FileError(path_, "does not hold frozen parameter '" + param + "': its run read it from the base model in " +
                                 base_->dir + " (model_name_or_path), which the checkpoint leaves it in");
    const at::Tensor t = base_tensors_(param, buffer).reshape({-1});
    TORCH_CHECK(first + n <= t.numel() && (buffer == kWeight || (first == 0 && n == t.numel())),
                "SavedStore::read: bad range of '", param, "' ", buffer);
    out.copy_(t.narrow(0, first, n));
    return;
  }
  if (p.group < 0) {
    if (buffer == kWeight && p.rank == kShares) {  // saving rank r wrote [r·c, (r + 1)·c)
      TORCH_CHECK(first + n <= p.numel, "SavedStore::read: bad range");
      const int64_t c = at::ceil_div(p.numel, static_cast<int64_t>(world_size_));
      for (int64_t pos = first; pos < first + n;) {
        const int rank = static_cast<int>(pos / c);
        const int64_t end = std::min(first + n, (rank + 1) * c);
        const at::Tensor src = shard(rank, frozen_name(param), std::min(p.numel, (rank + 1) * c) - rank * c, p.dtype);
        out.narrow(0, pos - first, end - pos).copy_(src.narrow(0, pos - rank * c, end - pos));
        pos = end;
      }
      return;
    }
    if (buffer == kWeight) {
      TORCH_CHECK(first + n <= p.numel, "SavedStore::read: bad range");
      out.copy_(shard(p.rank, frozen_name(param), p.numel, p.dtype).narrow(0, first, n));
      return;
    }
    for (const Buffer& b : p.buffers) {  // a module buffer of its layout, whole
      if (b.name != buffer) continue;
      TORCH_CHECK(first == 0 && n == b.numel, "SavedStore::read: a frozen parameter's buffer is read whole");
      out.copy_(shard(p.rank, frozen_name(b.name), b.numel, b.dtype));
      return;
    }
    throw FileError(path_, "frozen parameter '" + param + "' has no buffer '" + buffer + "' (nor optimizer state)");
  }
  const Group& g = groups_[static_cast<size_t>(p.group)];
  const int64_t v = g.per_value(buffer);
  if (v == 0) throw FileError(path_, "holds no buffer '" + buffer + "' of group '" + g.name + "'");
  TORCH_CHECK(first + n <= at::ceil_div(p.numel, v), "SavedStore::read: bad range");
  // Values of the buffer: the group's share of each rank and the parameter's first, [a, b).
  const int64_t share = g.padded / world_size_ / v;
  const int64_t a = p.offset / v + first, b = a + n;
  for (int64_t pos = a; pos < b;) {
    const int rank = static_cast<int>(pos / share);
    const int64_t end = std::min(b, (rank + 1) * share);
    const at::Tensor src = shard(rank, shard_name(g.name, buffer), share, g.dtypes.at(buffer));
    out.narrow(0, pos - a, end - pos).copy_(src.narrow(0, pos - rank * share, end - pos));
    pos = end;
  }
}

at::Tensor SavedStore::shard(int rank, const std::string& name, int64_t numel, const std::string& dtype) const {
  const SafetensorsFile& file = rank_file_(rank);
  if (!file.contains(name))
    throw FileError(file.path(), "lacks tensor '" + name + "', which store.json says this rank saved");
  const at::Tensor t = file.tensor(name);
  if (t.numel() != numel || dtype_name(t.scalar_type()) != dtype)
    throw FileError(file.path(), "tensor '" + name + "' is " + std::to_string(t.numel()) + " " +
                                     dtype_name(t.scalar_type()) + " elements; store.json gives it " +
                                     std::to_string(numel) + " " + dtype + " elements");
  return t.view({-1});
}

at::Tensor SavedStore::view_weight(const std::string& param) const {
  auto it = params_.find(param);
  if (it == params_.end()) throw FileError(path_, "lists no parameter '" + param + "'");
  const Param& p = it->second;
  if (p.rank == kInBase && base_tensors_) {
    const at::Tensor t = base_tensors_(param, kWeight);
    if (t.sizes().vec() == p.shape) return t;
  } else if (p.group < 0 && p.rank >= 0) {
    return shard(p.rank, frozen_name(param), p.numel, p.dtype).view(p.shape);
  } else if (p.group >= 0 && p.numel > 0) {
    const Group& g = groups_[static_cast<size_t>(p.group)];
    const int64_t share = g.padded / world_size_;
    const int rank = static_cast<int>(p.offset / share);
    if ((p.offset + p.numel - 1) / share == rank)
      return shard(rank, shard_name(g.name, kWeight), share, g.dtypes.at(kWeight))
          .narrow(0, p.offset - rank * share, p.numel)
          .view(p.shape);
  }
  return read_whole(param, kWeight);
}

at::Tensor SavedStore::read_whole(const std::string& param, const std::string& buffer) const {
  auto it = params_.find(param);
  if (it == params_.end()) throw FileError(path_, "lists no parameter '" + param + "'");
  const Param& p = it->second;
  std::string dtype = p.group >= 0 ? groups_[static_cast<size_t>(p.group)].dtypes.at(kWeight) : p.dtype;
  std::vector<int64_t> shape = p.shape;
  if (buffer != kWeight) {
    const auto b = std::find_if(p.buffers.begin(), p.buffers.end(), [&](const Buffer& x) { return x.name == buffer; });
    if (b == p.buffers.end()) throw FileError(path_, "parameter '" + param + "' has no saved buffer '" + buffer + "'");
    dtype = b->dtype;
    shape = b->shape;
  }
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(*safetensors_dtype(dtype)));
  read(param, buffer, 0, out);
  return out;
}

int64_t SavedStore::Group::per_value(const std::string& buffer) const {
  if (buffer == kWeight) return 1;
  for (const StateTensor& t : format.tensors)
    if (t.name == buffer) return t.per_value;
  return 0;
}

const std::string& SavedStore::frozen_format(const std::string& param) const { return params_.at(param).format; }

std::vector<std::string> SavedStore::frozen_buffers(const std::string& param) const {
  std::vector<std::string> out;
  for (const Buffer& b : params_.at(param).buffers) out.push_back(b.name);
  return out;
}

const StateFormat& SavedStore::state_format(const std::string& param) const {
  static const StateFormat kNone;
  const Param& p = params_.at(param);
  return p.group < 0 ? kNone : groups_[static_cast<size_t>(p.group)].format;
}

SavedStore::BaseTensors frozen_tensors_of(const ParamStore& store) {
  return [&store](const std::string& param, const std::string& buffer) -> at::Tensor {
    const StorePlan& plan = store.plan();
    for (size_t i = 0; i < plan.slots().size(); ++i) {
      if (plan.slots()[i].group >= 0 || plan.slots()[i].param.name != param) continue;
      const FrozenLayout& layout = plan.frozen_layout(static_cast<int>(i));
      if (partitioned_frozen(plan, static_cast<int>(i)))
        throw Error("parameter store: frozen parameter '" + param + "' is partitioned (ZeRO-3); no rank holds it "
                    "whole: read it from the base model's files");
      for (size_t k = 0; k < layout.tensors.size(); ++k)
        if (k == 0 ? buffer == kWeight : layout.tensors[k].name == buffer) return store.frozen_tensors(static_cast<int>(i))[k];
    }
    throw Error("parameter store: no frozen parameter '" + param + "' with a buffer '" + buffer + "'");
  };
}

int64_t load_store(ParamStore& store, const SavedStore& saved, LoadShare share) {
  const StorePlan& plan = store.plan();
  auto fix = [](const std::string& what) {
    return what + ": resume with the model, plugins and optimizer the checkpoint was made with "
                  "(or export it with `launcher export` and start a new run from its weights)";
  };
  // A weights-only store (launcher eval) reads the weights of any optimizer's checkpoint.
  if (!plan.weights_only() && saved.state_names() != plan.state_names()) {
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
      // The same format and buffers (a plain weight converts between dtypes, and may have been
      // trained), read whole by every rank, or by the one that then broadcasts them
      // (complete_loaded_store).
      const FrozenLayout& layout = plan.frozen_layout(slot);
      std::vector<std::string> buffers;
      for (size_t k = 1; k < layout.tensors.size(); ++k) buffers.push_back(layout.tensors[k].name);
      const bool plain = layout.format.empty() && buffers.empty();
      if (saved.trainable(s.param.name) ? !plain
                                        : saved.frozen_format(s.param.name) != layout.format ||
                                              saved.frozen_buffers(s.param.name) != buffers) {
        auto as = [](const std::string& format) { return format.empty() ? std::string("a plain weight") : "'" + format + "'"; };
        throw FileError(saved.path(), fix("parameter '" + s.param.name + "' is " +
                                        (saved.trainable(s.param.name) ? std::string("trained") : "kept as " + as(saved.frozen_format(s.param.name))) +
                                        " in the checkpoint and kept frozen as " + as(layout.format) + " in this run"));
      }
      if (saved.from_base(s.param.name)) continue;  // built from the base (the caller's to check)
      const std::vector<at::Tensor>& tensors = store.frozen_tensors(slot);
      if (layout.extent == Extent::kPartition) {  // this rank's share, whatever the saving world
        saved.read(s.param.name, kWeight, plan.frozen_partition(slot).begin, tensors.front());
        continue;
      }
      if (partition_only && frozen_owner(s.param.name, plan.world_size()) != plan.rank()) continue;
      saved.read(s.param.name, kWeight, 0, tensors.front());
      for (size_t k = 1; k < tensors.size(); ++k) saved.read(s.param.name, buffers[k - 1], 0, tensors[k]);
      continue;
    }
    if (!saved.trainable(s.param.name))
      throw FileError(saved.path(), fix("parameter '" + s.param.name + "' was frozen in the checkpoint's run and is trained in this one"));
    // The state's format must be the checkpoint's, or both plain (fp32 and bf16 moments convert).
    const StateFormat& mine = plan.state_format(s.group);
    const StateFormat& theirs = saved.state_format(s.param.name);
    const bool plain = plan.weights_only() || (mine.is_plain() && theirs.is_plain());
    bool same = plain || (mine.name == theirs.name && mine.block == theirs.block &&
                          mine.tensors.size() == theirs.tensors.size());
    for (size_t k = 0; same && !plain && k < mine.tensors.size(); ++k)
      same = mine.tensors[k].name == theirs.tensors[k].name && mine.tensors[k].per_value == theirs.tensors[k].per_value &&
             mine.tensors[k].dtype == theirs.tensors[k].dtype;
    if (!same)
      throw FileError(saved.path(), fix("parameter '" + s.param.name + "' keeps its optimizer state as '" + theirs.name +
                                      "' in the checkpoint and as '" + mine.name + "' in this run"));
    // What this rank reads of buffer b: what it holds of the parameter, or only the part in its
    // partition. The compute copy is rounded from the exact weight as the step's write-back rounds.
    // Positions count values of the buffer (v elements each; the parameter starts on a value).
    const ElementRange wanted = partition_only ? plan.range(slot) & plan.partition(s.group) : plan.range(slot);
    auto load = [&](StoreBuffer b, int k, const std::string& name, int64_t v) {
      if (wanted.empty()) return;
      const auto [view, first] = store.slice(slot, b, k);
      const ElementRange held{first, first + view.numel()};
      const ElementRange part = held & ElementRange{(wanted.begin - s.offset) / v, at::ceil_div(wanted.end - s.offset, v)};
      if (!part.empty())
        saved.read(s.param.name, name, part.begin, view.narrow(0, part.begin - first, part.size()));
    };
    load(StoreBuffer::kCompute, 0, kWeight, 1);
    const ParamStore::Group& g = store.groups()[static_cast<size_t>(s.group)];
    if (g.master.defined()) load(StoreBuffer::kMaster, 0, kWeight, 1);
    for (size_t k = 0; k < g.state.size(); ++k)
      load(StoreBuffer::kState, static_cast<int>(k), mine.tensors[k].name, mine.tensors[k].per_value);
  }
  for (const std::string& name : saved.param_names())
    if (!planned.count(name))
      throw FileError(saved.path(), fix("the checkpoint has parameter '" + name + "', which this run's model lacks"));
  return static_cast<int64_t>(plan.slots().size());
}

void complete_loaded_store(ParamStore& store, const SavedStore& saved, Communicator& comm) {
  if (comm.world_size() == 1) return;  // one rank's partition is everything
  const StorePlan& plan = store.plan();
  at::NoGradGuard no_grad;
  for (int g = 0; g < static_cast<int>(plan.groups().size()); ++g) {
    ParamStore::Group& group = store.groups()[static_cast<size_t>(g)];
    const ElementRange mine = plan.partition(g);
    std::vector<std::pair<at::Tensor*, int64_t>> full;  // buffer, per value
    if (plan.groups()[static_cast<size_t>(g)].buffer(StoreBuffer::kCompute).extent == Extent::kFull)
      full.emplace_back(&group.compute, 1);  // partitioned (ZeRO-3): each rank read its own
    if (group.master.defined() && plan.groups()[static_cast<size_t>(g)].buffer(StoreBuffer::kMaster).extent == Extent::kFull)
      full.emplace_back(&group.master, 1);
    if (plan.groups()[static_cast<size_t>(g)].buffer(StoreBuffer::kState).extent == Extent::kFull)
      for (size_t k = 0; k < group.state.size(); ++k)
        full.emplace_back(&group.state[k], plan.state_format(g).tensors[k].per_value);
    for (auto [t, v] : full) {
      const at::Tensor part = t->narrow(0, mine.begin / v, mine.size() / v).clone();  // all_gather's input
      comm.all_gather(*t, part);
    }
  }
  for (size_t i = 0; i < plan.slots().size(); ++i) {
    if (plan.slots()[i].group >= 0 || saved.from_base(plan.slots()[i].param.name) ||
        partitioned_frozen(plan, static_cast<int>(i)))  // each rank read its own share
      continue;
    const int owner = frozen_owner(plan.slots()[i].param.name, plan.world_size());
    for (at::Tensor t : store.frozen_tensors(static_cast<int>(i))) comm.broadcast(t, owner);
  }
}

}  // namespace memrt
