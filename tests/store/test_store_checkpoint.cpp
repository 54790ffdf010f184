// The parameter store's checkpoint (checkpoint/store_checkpoint.h): shards written by 2 ranks load
// element for element into stores of other world sizes, alignments, extents and precisions; a
// layout that does not fit is an error naming store.json or the rank file and what differs.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "../data/test_util.h"
#include "test_formats.h"
#include "checkpoint/store_checkpoint.h"
#include "memrt/safetensors.h"
#include "memrt/error.h"
#include "memrt/param_store.h"
#include "optim/optimizers.h"

using namespace memrt;
using memrt::test::expect_error;

namespace {

// Sizes chosen so parameters straddle partitions at every world size below.
std::vector<ParamInfo> infos() {
  return {{"a.weight", {7, 5}, at::kFloat, true, true},
          {"a.bias", {5}, at::kFloat, true, false},
          {"b.weight", {13}, at::kFloat, true, true},
          {"frozen.weight", {4, 4}, at::kFloat, false, true},
          {"c.weight", {7}, at::kFloat, true, true}};
}

StoreOptions options(int rank, int world, const char* optimizer = "AdamW", double momentum = 0.0) {
  StoreOptions o;
  o.optimizer = optimizer;
  o.momentum = momentum;
  o.weight_decay = 0.1;
  o.rank = rank;
  o.world_size = world;
  return o;
}

// What the saved run held, per parameter: the exact weight and Adam's two moments.
struct Truth {
  std::map<std::string, at::Tensor> weight, exp_avg, exp_avg_sq;
};

Truth truth() {
  at::manual_seed(1);
  Truth t;
  for (const ParamInfo& p : infos()) {
    t.weight[p.name] = at::randn(p.shape);
    t.exp_avg[p.name] = at::randn(p.shape);
    t.exp_avg_sq[p.name] = at::rand(p.shape);
  }
  return t;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

struct Layout {
  at::ScalarType compute = at::kFloat;
  Extent master = Extent::kFull, state = Extent::kFull;
  int64_t alignment = 16;
};

ParamStore make_store(const Layout& l, const std::map<std::string, at::Tensor>& values, const StoreOptions& o) {
  StorePlan plan(infos(), o);
  plan.set_compute_dtype(l.compute);
  if (l.compute != at::kFloat) {
    plan.set_master_weights(true);
    plan.set_extent(StoreBuffer::kMaster, l.master);
  }
  plan.set_extent(StoreBuffer::kState, l.state);
  plan.require_alignment(l.alignment);
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const ParamInfo& p : infos()) params.emplace_back(p.name, values.at(p.name).clone().set_requires_grad(p.trainable));
  return ParamStore(std::move(plan), params, at::kCPU);
}

ParamStore make_store(int rank, int world, const Layout& l, const std::map<std::string, at::Tensor>& values) {
  return make_store(l, values, options(rank, world));
}

// Writes the checkpoint of a 2-rank bf16 store with partitioned masters and state (ZeRO-1) whose
// masters and moments are `t`.
void save_two_ranks(const Truth& t, const memrt::test::TempDir& dir) {
  const Layout saved{at::kBFloat16, Extent::kPartition, Extent::kPartition, 16};
  for (int r = 0; r < 2; ++r) {
    ParamStore s = make_store(r, 2, saved, t.weight);
    for (int slot = 0; slot < static_cast<int>(s.plan().slots().size()); ++slot) {
      const ParamSlot& ps = s.plan().slots()[static_cast<size_t>(slot)];
      if (ps.group < 0) continue;
      const std::map<std::string, at::Tensor>* state[] = {&t.exp_avg, &t.exp_avg_sq};
      for (int k = 0; k < 2; ++k) {
        auto [view, first] = s.slice(slot, StoreBuffer::kState, k);
        view.copy_(state[k]->at(ps.param.name).reshape({-1}).narrow(0, first, view.numel()));
      }
    }
    write_safetensors(dir.file(r == 0 ? "rank0.safetensors" : "rank1.safetensors"), store_shard_tensors(s));
    const std::string layout = store_layout_json(s);
    if (r == 0) {
      std::ofstream(dir.file(kStoreLayoutFile)) << layout;
    } else {
      EXPECT_EQ(layout, slurp(dir.file(kStoreLayoutFile))) << "ranks disagree on the layout";
    }
  }
}

struct Files {
  explicit Files(const memrt::test::TempDir& dir) : dir_(dir) {}
  const SafetensorsFile& operator()(int r) {
    auto it = open_.find(r);
    if (it == open_.end())
      it = open_.emplace(r, SafetensorsFile::open(dir_.file(r == 0 ? "rank0.safetensors" : "rank1.safetensors"))).first;
    return it->second;
  }
  const memrt::test::TempDir& dir_;
  std::map<int, SafetensorsFile> open_;
};


}  // namespace

TEST(StoreCheckpoint, TwoRanksLoadOnAnyWorldSizeAlignmentAndPrecisionElementForElement) {
  const Truth t = truth();
  memrt::test::TempDir dir;
  save_two_ranks(t, dir);

  struct Target {
    const char* name;
    int world;
    Layout layout;
  };
  const Target targets[] = {
      {"1 rank, fp32, no masters", 1, {at::kFloat, Extent::kFull, Extent::kFull, 16}},
      {"3 ranks, bf16, partitioned, 256-element alignment", 3, {at::kBFloat16, Extent::kPartition, Extent::kPartition, 256}},
      {"4 ranks, fp16, full masters, partitioned state", 4, {at::kHalf, Extent::kFull, Extent::kPartition, 16}},
  };
  at::manual_seed(2);
  std::map<std::string, at::Tensor> other;  // what the new run starts from, to be overwritten
  for (const ParamInfo& p : infos()) other[p.name] = at::randn(p.shape);

  for (const Target& target : targets) {
    for (int r = 0; r < target.world; ++r) {
      SCOPED_TRACE(std::string(target.name) + ", rank " + std::to_string(r));
      ParamStore s = make_store(r, target.world, target.layout, other);
      Files files(dir);
      const SavedStore saved(dir.str(), std::ref(files));
      EXPECT_EQ(saved.world_size(), 2);
      EXPECT_EQ(load_store(s, saved), 5);
      for (int slot = 0; slot < static_cast<int>(s.plan().slots().size()); ++slot) {
        const ParamSlot& ps = s.plan().slots()[static_cast<size_t>(slot)];
        const std::string& name = ps.param.name;
        SCOPED_TRACE(name);
        const at::Tensor w = t.weight.at(name).reshape({-1});
        if (ps.group < 0) {  // frozen: saved in the old run's compute dtype, bf16
          EXPECT_TRUE(at::equal(s.param(slot).reshape({-1}),
                                w.to(at::kBFloat16).to(target.layout.compute)));
          continue;
        }
        // The compute copy whole, rounded from the exact weight.
        EXPECT_TRUE(at::equal(s.param(slot).reshape({-1}), w.to(target.layout.compute)));
        if (target.layout.compute != at::kFloat) {
          auto [view, first] = s.slice(slot, StoreBuffer::kMaster);
          EXPECT_TRUE(at::equal(view, w.narrow(0, first, view.numel())));
        }
        const at::Tensor moments[] = {t.exp_avg.at(name).reshape({-1}), t.exp_avg_sq.at(name).reshape({-1})};
        for (int k = 0; k < 2; ++k) {
          auto [view, first] = s.slice(slot, StoreBuffer::kState, k);
          EXPECT_TRUE(at::equal(view, moments[k].narrow(0, first, view.numel()))) << "state " << k;
        }
      }
    }
  }
}

TEST(StoreCheckpoint, ALayoutThatDoesNotFitIsRefusedNamingWhatDiffers) {
  const Truth t = truth();
  memrt::test::TempDir dir;
  save_two_ranks(t, dir);
  const Layout fp32{at::kFloat, Extent::kFull, Extent::kFull, 16};
  auto load = [&](ParamStore& s) {
    return [&] {
      Files files(dir);
      load_store(s, SavedStore(dir.str(), std::ref(files)));
    };
  };

  ParamStore sgd = make_store(fp32, t.weight, options(0, 1, "SGD", 0.9));
  expect_error<FileError>(load(sgd), {kStoreLayoutFile,
      "optimizer state is {exp_avg, exp_avg_sq}, this run's optimizer keeps {momentum_buffer}"});

  // A rank file that lacks a shard store.json promises.
  {
    const auto f = SafetensorsFile::open(dir.file("rank1.safetensors"));
    std::vector<std::pair<std::string, at::Tensor>> kept;
    for (const std::string& n : f.names())
      if (n != "store/decay/exp_avg_sq") kept.emplace_back(n, f.tensor(n).clone());
    write_safetensors(dir.file("rank1.safetensors"), kept);
  }
  ParamStore whole = make_store(0, 1, fp32, t.weight);
  expect_error<FileError>(load(whole), {"rank1.safetensors: lacks tensor 'store/decay/exp_avg_sq'"});
}

TEST(StoreCheckpoint, AParameterOnOneSideOnlyIsRefusedNamingIt) {
  const Truth t = truth();
  memrt::test::TempDir dir;
  save_two_ranks(t, dir);
  std::vector<ParamInfo> more = infos();
  more.push_back({"lora.weight", {3}, at::kFloat, true, true});
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const ParamInfo& p : more) params.emplace_back(p.name, at::zeros(p.shape).set_requires_grad(true));
  ParamStore s(StorePlan(more, options(0, 1)), params, at::kCPU);
  Files files(dir);
  expect_error<FileError>([&] { load_store(s, SavedStore(dir.str(), std::ref(files))); },
                          {"the checkpoint has no parameter 'lora.weight', which this run's model has"});
}

// The optimizer over a store resumes bit for bit from the store's checkpoint and its own state
// (update counts): bf16 with fp32 masters, 3 steps, save, load into a fresh store and optimizer
// started from other weights, 3 more steps: equal to 6 straight ones.
TEST(StoreCheckpoint, TheStepContinuesBitForBitAfterALoad) {
  OptimizerConfig cfg;
  cfg.type = "AdamW";
  const std::vector<ParamInfo> ps = infos();
  at::manual_seed(3);
  std::vector<std::vector<at::Tensor>> grads(6);  // [step][trainable parameter]
  for (auto& step : grads)
    for (const ParamInfo& p : ps)
      if (p.trainable) step.push_back(at::randn(p.shape).to(at::kBFloat16));
  // One group per decay setting, the trainable parameters in model order.
  auto make = [&](int seed) {
    at::manual_seed(seed);
    std::vector<ParamGroup> groups(2);
    groups[0].weight_decay = 0.1;
    for (const ParamInfo& p : ps) {
      if (!p.trainable) continue;
      ParamGroup& g = groups[p.decay ? 0 : 1];
      g.names.push_back(p.name);
      g.params.push_back(at::randn(p.shape).to(at::kBFloat16).set_requires_grad(true));
    }
    auto store = make_param_store(cfg, groups);
    return std::make_pair(store, make_optimizer(cfg, store));
  };
  auto steps = [&](Optimizer& opt, int from, int to) {
    for (int s = from; s < to; ++s) {
      size_t k = 0;
      for (const ParamInfo& p : ps) {
        if (!p.trainable) continue;
        ParamGroup& g = opt.param_groups()[p.decay ? 0 : 1];
        const auto it = std::find(g.names.begin(), g.names.end(), p.name);
        g.params[static_cast<size_t>(it - g.names.begin())].mutable_grad() = grads[static_cast<size_t>(s)][k++];
      }
      opt.step({1e-2});
    }
  };
  auto [straight_store, straight] = make(1);
  steps(*straight, 0, 6);

  auto [first_store, first] = make(1);
  steps(*first, 0, 3);
  memrt::test::TempDir dir;
  write_safetensors(dir.file("rank0.safetensors"), store_shard_tensors(*first_store));
  std::ofstream(dir.file(kStoreLayoutFile)) << store_layout_json(*first_store);
  const TensorMap counts = first->state_dict();

  auto [resumed_store, resumed] = make(2);
  Files files(dir);
  load_store(*resumed_store, SavedStore(dir.str(), std::ref(files)));
  resumed->load_state_dict(counts);
  steps(*resumed, 3, 6);
  for (size_t g = 0; g < 2; ++g) {
    for (size_t i = 0; i < straight->param_groups()[g].params.size(); ++i) {
      SCOPED_TRACE(straight->param_groups()[g].names[i]);
      EXPECT_TRUE(at::equal(resumed->param_groups()[g].params[i], straight->param_groups()[g].params[i]));
    }
    EXPECT_TRUE(at::equal(resumed_store->groups()[g].master, straight_store->groups()[g].master));
    for (size_t k = 0; k < 2; ++k)
      EXPECT_TRUE(at::equal(resumed_store->groups()[g].state[k], straight_store->groups()[g].state[k]));
  }
}

// A quantized state format saves each of its tensors in shards of whole blocks and loads on any
// world size and extent value for value: every parameter's codes and its blocks' scales. Loading it
// into a run that keeps another format is refused naming both.
TEST(StoreCheckpoint, AQuantizedStateFormatLoadsOnAnyWorldSizeValueForValue) {
  const Truth t = truth();
  const StateFormat format = memrt::test::blockwise8();
  // What a parameter's state tensor k holds, all its values: codes and absmax as functions of its
  // name and their position.
  auto expected = [&](const ParamSlot& ps, int k) {
    const StateTensor& tensor = format.tensors[static_cast<size_t>(k)];
    const int64_t seed = static_cast<int64_t>(std::hash<std::string>{}(ps.param.name) % 97) + 10 * k;
    const at::Tensor i = at::arange((ps.numel + tensor.per_value - 1) / tensor.per_value, at::kLong) + seed;
    return tensor.dtype == at::kByte ? (i % 251).to(at::kByte) : i.to(at::kFloat) * 0.5;
  };
  auto make = [&](int rank, int world, Extent state, const StateFormat& f) {
    StorePlan plan(infos(), options(rank, world));
    plan.set_extent(StoreBuffer::kState, state);
    plan.set_state_format(f, "decay");
    std::vector<std::pair<std::string, at::Tensor>> params;
    for (const ParamInfo& p : infos()) params.emplace_back(p.name, t.weight.at(p.name).clone().set_requires_grad(p.trainable));
    return ParamStore(std::move(plan), params, at::kCPU);
  };
  memrt::test::TempDir dir;
  for (int r = 0; r < 2; ++r) {
    ParamStore s = make(r, 2, Extent::kPartition, format);
    for (int slot : s.plan().groups()[0].slots) {
      const ParamSlot& ps = s.plan().slots()[static_cast<size_t>(slot)];
      for (int k = 0; k < 4; ++k) {
        auto [view, first] = s.slice(slot, StoreBuffer::kState, k);
        view.copy_(expected(ps, k).narrow(0, first, view.numel()));
      }
    }
    write_safetensors(dir.file(r == 0 ? "rank0.safetensors" : "rank1.safetensors"), store_shard_tensors(s));
    if (r == 0) std::ofstream(dir.file(kStoreLayoutFile)) << store_layout_json(s);
  }
  Files files(dir);
  const SavedStore saved(dir.str(), std::ref(files));
  EXPECT_EQ(saved.state_format("b.weight").name, "test_blockwise8");
  for (int world : {1, 3, 4}) {
    for (Extent state : {Extent::kFull, Extent::kPartition}) {
      for (int r = 0; r < world; ++r) {
        ParamStore s = make(r, world, state, format);
        load_store(s, saved);
        for (int slot : s.plan().groups()[0].slots) {
          const ParamSlot& ps = s.plan().slots()[static_cast<size_t>(slot)];
          for (int k = 0; k < 4; ++k) {
            auto [view, first] = s.slice(slot, StoreBuffer::kState, k);
            EXPECT_TRUE(at::equal(view, expected(ps, k).narrow(0, first, view.numel())))
                << ps.param.name << " tensor " << k << " rank " << r << " of " << world;
          }
        }
      }
    }
  }
  ParamStore fp32 = make_store(0, 1, Layout{}, t.weight);
  expect_error<FileError>([&] { load_store(fp32, saved); },
                          {"store.json", "'test_blockwise8' in the checkpoint", "'fp32' in this run"});
}

// Frozen parameters are saved once in all, each by the rank its name spreads it to, with the module
// buffers of its layout; they load whole on any world size, and a layout other than the
// checkpoint's is refused naming both.
TEST(StoreCheckpoint, FrozenSlotsAreSpreadOverRanksAndLoadWithTheirBuffers) {
  const Truth t = truth();
  std::vector<ParamInfo> ps = infos();
  for (int i = 0; i < 6; ++i) ps.push_back({"base." + std::to_string(i) + ".weight", {8, 1}, at::kByte, false, true});
  auto layout_of = [](const std::string& name) {
    FrozenLayout l;
    l.format = "nf4";
    l.tensors = {{name, at::kByte, {8, 1}, memory::Category::kQuantState},
                 {name + "_absmax", at::kFloat, {1}, memory::Category::kQuantState}};
    return l;
  };
  auto code = [](int i) { return (at::arange(8, at::kLong) * (i + 3) % 256).to(at::kByte).view({8, 1}); };
  auto make = [&](int rank, int world, bool quantized, bool blank = false) {
    StorePlan plan(ps, options(rank, world));
    std::vector<std::pair<std::string, at::Tensor>> params, buffers;
    for (const ParamInfo& p : infos()) {
      const at::Tensor& w = t.weight.at(p.name);
      params.emplace_back(p.name, (blank ? at::zeros_like(w) : w.clone()).set_requires_grad(p.trainable));
    }
    for (int i = 0; i < 6; ++i) {
      const std::string name = "base." + std::to_string(i) + ".weight";
      params.emplace_back(name, blank ? at::zeros({8, 1}, at::kByte) : code(i));
      if (!quantized) continue;
      plan.set_frozen_layout(static_cast<int>(plan.find(name)), layout_of(name));
      buffers.emplace_back(name + "_absmax", at::full({1}, blank ? 0.f : 0.5f * static_cast<float>(i)));
    }
    return ParamStore(std::move(plan), params, buffers, at::kCPU);
  };
  memrt::test::TempDir dir;
  std::set<std::string> saved_by[2];
  for (int r = 0; r < 2; ++r) {
    ParamStore s = make(r, 2, true);
    for (const auto& [name, tensor] : store_shard_tensors(s))
      if (name.rfind("store/frozen/", 0) == 0) saved_by[r].insert(name.substr(13));
    write_safetensors(dir.file(r == 0 ? "rank0.safetensors" : "rank1.safetensors"), store_shard_tensors(s));
    if (r == 0) std::ofstream(dir.file(kStoreLayoutFile)) << store_layout_json(s);
  }
  // Every frozen tensor once in all, both ranks writing some (7 parameters, 6 with a buffer).
  EXPECT_EQ(saved_by[0].size() + saved_by[1].size(), 7u + 6u);
  EXPECT_FALSE(saved_by[0].empty());
  EXPECT_FALSE(saved_by[1].empty());
  for (const std::string& name : saved_by[0]) EXPECT_EQ(saved_by[1].count(name), 0u) << name;
  Files files(dir);
  const SavedStore saved(dir.str(), std::ref(files));
  for (int world : {1, 3}) {
    ParamStore s = make(0, world, true, true);  // zeros until loaded
    load_store(s, saved);
    for (int i = 0; i < 6; ++i) {
      const auto& tensors = s.frozen_tensors(static_cast<int>(s.plan().find("base." + std::to_string(i) + ".weight")));
      EXPECT_TRUE(at::equal(tensors[0], code(i))) << i;
      EXPECT_EQ(tensors[1].item<float>(), 0.5f * static_cast<float>(i)) << i;
    }
    EXPECT_TRUE(at::equal(s.param(static_cast<int>(s.plan().find("frozen.weight"))), t.weight.at("frozen.weight")));
  }
  ParamStore plain = make(0, 1, false, true);
  expect_error<FileError>([&] { load_store(plain, saved); },
                          {"store.json", "'base.", "kept as 'nf4' in the checkpoint", "as a plain weight in this run"});
}

// Frozen parameters read from a base model's directory are left there: not written, store.json
// recording the directory ("rank": null), not read on load (the loading run built them), and read
// from a provider where one is given (export), else refused naming the directory.
TEST(StoreCheckpoint, FrozenParametersLeftInTheBaseAreNeitherWrittenNorRead) {
  const Truth t = truth();
  BaseSource base;
  base.dir = "/models/base";
  base.config_sha256 = "c0";
  base.files = {{"model.safetensors", 4096, "5a"}};
  memrt::test::TempDir dir;
  const ParamStore s = make_store(0, 1, Layout{}, t.weight);
  for (const auto& [name, tensor] : store_shard_tensors(s, &base)) EXPECT_NE(name.rfind("store/frozen/", 0), 0u) << name;
  write_safetensors(dir.file("rank0.safetensors"), store_shard_tensors(s, &base));
  std::ofstream(dir.file(kStoreLayoutFile)) << store_layout_json(s, &base);
  Files files(dir);
  SavedStore saved(dir.str(), std::ref(files));
  ASSERT_TRUE(saved.base().has_value());
  EXPECT_EQ(saved.base()->difference(base), "");
  BaseSource changed = base;
  changed.files[0].sample_sha256 = "5b";
  EXPECT_EQ(base.difference(changed), "model.safetensors holds other values");
  EXPECT_TRUE(saved.from_base("frozen.weight"));
  expect_error<FileError>([&] { saved.read_whole("frozen.weight", "weight"); },
                          {"store.json", "'frozen.weight'", "/models/base", "model_name_or_path"});
  // Loading leaves the frozen parameter as the loading store built it; the rest are read.
  std::map<std::string, at::Tensor> blank;
  for (const auto& [name, w] : t.weight) blank[name] = name == "frozen.weight" ? w + 1 : at::zeros_like(w);
  ParamStore loaded = make_store(0, 1, Layout{}, blank);
  load_store(loaded, saved);
  for (const auto& [name, w] : t.weight)
    EXPECT_TRUE(at::equal(loaded.param(static_cast<int>(loaded.plan().find(name))), name == "frozen.weight" ? w + 1 : w)) << name;
  saved.read_base_from(frozen_tensors_of(s));
  EXPECT_TRUE(at::equal(saved.read_whole("frozen.weight", "weight"), t.weight.at("frozen.weight")));
}
