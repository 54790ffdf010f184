// The parameter store (memrt/param_store.h): layout, partitions, who sets what, allocation once
// with parameters as views, its bytes against DeepSpeed's per-rank formulas, and a partitioned
// step that equals the whole one bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "../data/test_util.h"
#include "test_formats.h"
#include "memory/tracking_allocator.h"
#include "memrt/error.h"
#include "memrt/param_store.h"
#include "optim/optimizers.h"

using namespace memrt;
using memory::Category;
using memory::Placement;
using memrt::test::expect_error;

namespace {

// Three decaying tensors and one that does not: 35 + 13 + 7 = 55 and 5 elements.
std::vector<ParamInfo> infos(at::ScalarType dtype = at::kFloat) {
  return {{"a.weight", {7, 5}, dtype, true, true},
          {"a.bias", {5}, dtype, true, false},
          {"b.weight", {13}, dtype, true, true},
          {"frozen.weight", {4, 4}, dtype, false, true},
          {"c.weight", {7}, dtype, true, true}};
}

StoreOptions options(int rank = 0, int world = 1, const char* optimizer = "AdamW") {
  StoreOptions o;
  o.optimizer = optimizer;
  o.weight_decay = 0.1;
  o.rank = rank;
  o.world_size = world;
  return o;
}

std::vector<std::pair<std::string, at::Tensor>> tensors_for(const std::vector<ParamInfo>& ps, int seed) {
  at::manual_seed(seed);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const ParamInfo& p : ps) out.emplace_back(p.name, at::randn(p.shape).set_requires_grad(p.trainable));
  return out;
}

// Rank `rank` of ZeRO stage 1 on `world` ranks (masters and state partitioned when world > 1):
// its store over parameters of seed 9, in `compute` (16-bit with fp32 masters), and its optimizer.
std::pair<std::shared_ptr<ParamStore>, std::unique_ptr<Optimizer>> stage1_rank(
    const OptimizerConfig& cfg, const std::vector<ParamInfo>& ps, int rank, int world, at::ScalarType compute) {
  StoreOptions o = store_options(cfg);
  o.rank = rank;
  o.world_size = world;
  StorePlan plan(ps, o);
  if (compute != at::kFloat) {
    plan.set_compute_dtype(compute);
    plan.set_master_weights(true);
  }
  if (world > 1) {
    plan.set_extent(StoreBuffer::kMaster, Extent::kPartition);
    plan.set_extent(StoreBuffer::kState, Extent::kPartition);
  }
  auto store = std::make_shared<ParamStore>(std::move(plan), tensors_for(ps, 9), at::kCPU);
  return std::make_pair(store, make_optimizer(cfg, store));
}

void expect_same_counts(const TensorMap& got, const TensorMap& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [key, t] : want) {
    ASSERT_TRUE(got.count(key)) << key;
    EXPECT_EQ(got.at(key).item<int64_t>(), t.item<int64_t>()) << key;
  }
}

}  // namespace

TEST(StorePlan, GroupsPadToWorldTimesAlignmentAndPartitionEvenly) {
  const StorePlan one(infos(), options());
  ASSERT_EQ(one.groups().size(), 2u);
  EXPECT_EQ(one.groups()[0].name, "decay");
  EXPECT_EQ(one.groups()[0].weight_decay, 0.1);
  EXPECT_EQ(one.groups()[0].numel, 35 + 13 + 7);
  EXPECT_EQ(one.groups()[0].padded, 64);
  EXPECT_EQ(one.groups()[1].name, "no_decay");
  EXPECT_EQ(one.groups()[1].weight_decay, 0.0);
  EXPECT_EQ(one.groups()[1].padded, 16);
  // Model order within a group; the frozen tensor is in none.
  EXPECT_EQ(one.slots()[static_cast<size_t>(one.find("b.weight"))].offset, 35);
  EXPECT_EQ(one.slots()[static_cast<size_t>(one.find("c.weight"))].offset, 48);
  EXPECT_EQ(one.slots()[static_cast<size_t>(one.find("frozen.weight"))].group, -1);

  for (int r = 0; r < 3; ++r) {
    const StorePlan p(infos(), options(r, 3));
    EXPECT_EQ(p.groups()[0].padded, 96);  // 55 up to a multiple of 3 * 16
    EXPECT_TRUE(p.partition(0) == (ElementRange{int64_t{32} * r, int64_t{32} * (r + 1)}));
  }
  StorePlan blocks(infos(), options(0, 2));
  blocks.require_alignment(256);  // an 8-bit state's block
  EXPECT_EQ(blocks.alignment(), 256);
  EXPECT_EQ(blocks.groups()[0].padded, 512);
}

TEST(StorePlan, TwoPluginsSettingOneAxisDifferentlyIsAnErrorNamingBoth) {
  StorePlan plan(infos(), options());
  plan.set_author("precision");
  plan.set_compute_dtype(at::kBFloat16);
  plan.set_master_weights(true);
  plan.set_author("quant");
  plan.set_compute_dtype(at::kBFloat16);  // the same value: fine
  expect_error<Error>([&] { plan.set_compute_dtype(at::kHalf); },
                      {"'precision'", "'quant'", "compute dtype", "bf16", "fp16"});
  plan.set_author("");
  EXPECT_NO_THROW(plan.check());
  EXPECT_EQ(plan.slots()[static_cast<size_t>(plan.find("frozen.weight"))].param.dtype, at::kBFloat16);
}

TEST(StorePlan, CheckRefusesLayoutsTheStepCannotRun) {
  StorePlan no_master(infos(), options());
  no_master.set_compute_dtype(at::kHalf);
  expect_error<Error>([&] { no_master.check(); }, {"without fp32 master weights"});
  StorePlan fp32_master(infos(), options());
  fp32_master.set_master_weights(true);
  expect_error<Error>([&] { fp32_master.check(); }, {"masters are for a 16-bit"});
  StorePlan stage3(infos(), options(0, 2));
  stage3.set_extent(StoreBuffer::kCompute, Extent::kPartition);
  expect_error<Error>([&] { stage3.check(); }, {"group 'decay'", "compute weights partitioned", "gradient whole",
                                                 "set_extent(StoreBuffer::kGrad"});
  stage3.set_extent(StoreBuffer::kGrad, Extent::kPartition);
  EXPECT_NO_THROW(stage3.check());
  EXPECT_EQ(stage3.held_numel(0, StoreBuffer::kCompute), 32);
  expect_error<Error>([&] { StorePlan(infos(at::kDouble), options()); }, {"'a.weight' is Double"});
  // fp32 gradients for bf16 weights are a flat buffer of the store's, full (4 bytes per element
  // on every rank) or stage 2's partition; bf16 gradients for fp16 weights are refused.
  StorePlan fp32_grads(infos(), options(0, 2));
  fp32_grads.set_compute_dtype(at::kBFloat16);
  fp32_grads.set_master_weights(true);
  EXPECT_FALSE(fp32_grads.flat_grad(0));
  EXPECT_EQ(fp32_grads.held_numel(0, StoreBuffer::kGrad), 0);
  fp32_grads.set_grad_dtype(at::kFloat);
  EXPECT_NO_THROW(fp32_grads.check());
  EXPECT_TRUE(fp32_grads.flat_grad(0));
  EXPECT_EQ(fp32_grads.held_numel(0, StoreBuffer::kGrad), 64);
  EXPECT_EQ(fp32_grads.bytes().at(Category::kGradients), 4 * (64 + 32));
  fp32_grads.set_extent(StoreBuffer::kGrad, Extent::kPartition);
  EXPECT_NO_THROW(fp32_grads.check());
  EXPECT_EQ(fp32_grads.held_numel(0, StoreBuffer::kGrad), 32);
  StorePlan mixed(infos(), options());
  mixed.set_compute_dtype(at::kHalf);
  mixed.set_master_weights(true);
  mixed.set_grad_dtype(at::kBFloat16);
  expect_error<Error>([&] { mixed.check(); }, {"gradients are the compute dtype or fp32"});
}

// Stage 1 with mixed-precision Adam on N ranks: masters and both moments partitioned, 12 bytes per
// element of the partition (DeepSpeed's 12 Psi / N), the 16-bit weights whole (2 Psi); with
// offload_optimizer the 12 bytes are host memory. Padding included, to the byte.
TEST(StorePlan, BytesAreDeepSpeedsPerRankModelStatesPlusPadding) {
  for (int world : {1, 2, 4}) {
    for (Placement where : {Placement::kDevice, Placement::kHost}) {
      StorePlan plan(infos(), options(world - 1, world));
      plan.set_compute_dtype(at::kBFloat16);
      plan.set_master_weights(true);
      for (StoreBuffer b : {StoreBuffer::kMaster, StoreBuffer::kState}) {
        plan.set_extent(b, Extent::kPartition);
        plan.set_placement(b, where);
      }
      plan.check();
      const int64_t unit = 16 * world;
      const int64_t padded = (55 + unit - 1) / unit * unit + (5 + unit - 1) / unit * unit;
      const memory::Table t = plan.bytes();
      EXPECT_EQ(t.at(Category::kWeights), 2 * padded + 2 * 16) << world;  // + the frozen 4x4
      EXPECT_EQ(t.at(Category::kMasterWeights, where), 4 * padded / world) << world;
      EXPECT_EQ(t.at(Category::kOptimizerState, where), 8 * padded / world) << world;
      EXPECT_EQ(t.category(Category::kGradients), 0) << "autograd's .grad is not the store's";
    }
  }
}

TEST(ParamStore, ParametersBecomeViewsAndMastersKeepTheFp32Values) {
  memory::install_tracking_allocator();
  const std::vector<ParamInfo> ps = infos();
  auto params = tensors_for(ps, 5);
  std::vector<at::Tensor> before;
  for (const auto& [name, t] : params) before.push_back(t.detach().clone());
  StorePlan plan(ps, options());
  plan.set_compute_dtype(at::kBFloat16);
  plan.set_master_weights(true);
  const memory::Table live0 = memory::live();
  ParamStore store(std::move(plan), params, at::kCPU);
  const memory::Table grew = memory::live() - live0;

  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSlot& s = store.plan().slots()[i];
    const at::Tensor& p = params[i].second;  // the caller's handle: the same tensor
    EXPECT_TRUE(p.is_same(store.param(static_cast<int>(i))));
    EXPECT_EQ(p.scalar_type(), at::kBFloat16) << s.param.name;
    EXPECT_TRUE(at::equal(p, before[i].to(at::kBFloat16))) << s.param.name;
    if (s.group < 0) continue;
    const ParamStore::Group& g = store.groups()[static_cast<size_t>(s.group)];
    EXPECT_EQ(p.data_ptr(), static_cast<char*>(g.compute.data_ptr()) + 2 * s.offset) << s.param.name;
    EXPECT_TRUE(at::equal(store.slice(static_cast<int>(i), StoreBuffer::kMaster).first,
                          before[i].reshape({-1})))
        << s.param.name;
  }
  // Padding is zeros; state is zeros.
  EXPECT_EQ(store.groups()[0].compute.narrow(0, 55, 9).abs().sum().item<float>(), 0.f);
  EXPECT_EQ(store.groups()[0].state[1].abs().sum().item<float>(), 0.f);
  // Allocated in its categories; the old fp32 parameters (made outside any scope here) are gone.
  EXPECT_EQ(grew.at(Category::kMasterWeights), 4 * (64 + 16));
  EXPECT_EQ(grew.at(Category::kOptimizerState), 8 * (64 + 16));
  EXPECT_EQ(grew.at(Category::kWeights), 2 * (64 + 16) + 2 * 16);  // the frozen one cast too
  EXPECT_EQ(grew.at(Category::kUnattributed), -4 * (55 + 5 + 16));
}

TEST(ParamStore, TheModelAndThePlanMustNameTheSameParameters) {
  const std::vector<ParamInfo> ps = infos();
  auto params = tensors_for(ps, 1);
  params.pop_back();
  expect_error<Error>([&] { ParamStore(StorePlan(ps, options()), params, at::kCPU); },
                      {"plan has parameter 'c.weight', which the model lacks"});
  params = tensors_for(ps, 1);
  params.emplace_back("extra.weight", at::zeros({2}));
  expect_error<Error>([&] { ParamStore(StorePlan(ps, options()), params, at::kCPU); },
                      {"model has parameter 'extra.weight', which the plan lacks"});
  params = tensors_for(ps, 1);
  params[0].second = at::zeros({5, 7});
  expect_error<Error>([&] { ParamStore(StorePlan(ps, options()), params, at::kCPU); },
                      {"'a.weight' has shape (5, 7) but the plan says (7, 5)"});
}

// ZeRO stage 1's arithmetic on one process: two ranks' stores, masters and moments partitioned,
// each stepping its partition and then taking the other's updated 16-bit values (the all-gather),
// give the bits of one unpartitioned store — parameters straddling the partition boundary included.
TEST(ParamStore, PartitionedStepsEqualTheWholeStepBitForBit) {
  const std::vector<ParamInfo> ps = infos();
  OptimizerConfig cfg;
  cfg.type = "AdamW";
  cfg.weight_decay = 0.1;
  auto make = [&](int rank, int world) { return stage1_rank(cfg, ps, rank, world, at::kBFloat16); };
  auto whole = make(0, 1);
  std::vector<std::pair<std::shared_ptr<ParamStore>, std::unique_ptr<Optimizer>>> ranks;
  ranks.push_back(make(0, 2));
  ranks.push_back(make(1, 2));
  EXPECT_FALSE(whole.second->grads_partitioned());
  EXPECT_TRUE(ranks[0].second->grads_partitioned());

  at::manual_seed(4);
  for (int step = 0; step < 3; ++step) {
    std::vector<at::Tensor> grads;
    for (const ParamInfo& p : ps) grads.push_back(at::randn(p.shape).to(at::kBFloat16));
    auto set_grads = [&](Optimizer& opt) {
      size_t k = 0;
      for (ParamGroup& g : opt.param_groups())
        for (size_t i = 0; i < g.params.size(); ++i) {
          const int64_t slot = whole.first->plan().find(g.names[i]);
          g.params[i].mutable_grad() = grads[static_cast<size_t>(slot)].clone();
          ++k;
        }
      EXPECT_EQ(k, 4u);
    };
    set_grads(*whole.second);
    for (auto& r : ranks) set_grads(*r.second);
    const GradSummary all = whole.second->grad_summary();
    const double parts = ranks[0].second->grad_summary().sum_squares + ranks[1].second->grad_summary().sum_squares;
    EXPECT_NEAR(parts, all.sum_squares, 1e-12 * all.sum_squares);

    const StepScalars scalars{1e-2, 0.25};
    whole.second->step(scalars);
    for (auto& r : ranks) r.second->step(scalars);
    // The all-gather of the updated 16-bit partitions.
    for (size_t g = 0; g < whole.first->groups().size(); ++g) {
      for (int r = 0; r < 2; ++r) {
        const auto [lo, hi] = ranks[static_cast<size_t>(r)].first->plan().partition(static_cast<int>(g));
        const at::Tensor mine = ranks[static_cast<size_t>(r)].first->groups()[g].compute.narrow(0, lo, hi - lo);
        ranks[static_cast<size_t>(1 - r)].first->groups()[g].compute.narrow(0, lo, hi - lo).copy_(mine);
      }
    }
  }
  // Every rank counts every parameter's updates, not only those in its partition.
  const TensorMap counts = whole.second->state_dict();
  ASSERT_EQ(counts.size(), 4u);
  for (auto& r : ranks) expect_same_counts(r.second->state_dict(), counts);
  for (size_t g = 0; g < whole.first->groups().size(); ++g) {
    const ParamStore::Group& w = whole.first->groups()[g];
    for (int r = 0; r < 2; ++r) {
      const ParamStore::Group& part = ranks[static_cast<size_t>(r)].first->groups()[g];
      EXPECT_TRUE(at::equal(part.compute.narrow(0, 0, w.compute.numel()), w.compute)) << g << " " << r;
      const auto [lo, hi] = ranks[static_cast<size_t>(r)].first->plan().partition(static_cast<int>(g));
      const int64_t end = std::min(hi, w.master.numel());
      if (end <= lo) continue;
      EXPECT_TRUE(at::equal(part.master.narrow(0, 0, end - lo), w.master.narrow(0, lo, end - lo))) << g << " " << r;
      EXPECT_TRUE(at::equal(part.state[1].narrow(0, 0, end - lo), w.state[1].narrow(0, lo, end - lo))) << g << " " << r;
    }
  }
}

// ZeRO-3's store on 2 ranks: each holds its partition of the compute copy, the parameters rest as
// empty placeholders, attach() over a segment's range hands each parameter its gathered values and
// release() takes them back; each rank's step writes its partition of the compute copy, which
// equals the whole store's step bit for bit.
TEST(ParamStore, PartitionedComputeWeightsRestAsPlaceholdersAndStepAsTheWholeStoreDoes) {
  const std::vector<ParamInfo> ps = infos();
  OptimizerConfig cfg;
  cfg.type = "AdamW";
  cfg.weight_decay = 0.1;
  auto whole = stage1_rank(cfg, ps, 0, 1, at::kBFloat16);
  std::vector<std::pair<std::shared_ptr<ParamStore>, std::unique_ptr<Optimizer>>> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    StoreOptions o = store_options(cfg);
    o.rank = rank;
    o.world_size = 2;
    StorePlan plan(ps, o);
    plan.set_compute_dtype(at::kBFloat16);
    plan.set_master_weights(true);
    for (StoreBuffer b : {StoreBuffer::kCompute, StoreBuffer::kMaster, StoreBuffer::kState, StoreBuffer::kGrad})
      plan.set_extent(b, Extent::kPartition);
    auto store = std::make_shared<ParamStore>(std::move(plan), tensors_for(ps, 9), at::kCPU);
    ranks.emplace_back(store, make_optimizer(cfg, store));
  }
  // Rank r's partition of group g's compute copy against the whole store's same elements.
  auto expect_partitions_equal_whole = [&](const char* when) {
    for (size_t g = 0; g < whole.first->groups().size(); ++g) {
      const at::Tensor& w = whole.first->groups()[g].compute;
      for (int r = 0; r < 2; ++r) {
        const auto [lo, hi] = ranks[static_cast<size_t>(r)].first->plan().partition(static_cast<int>(g));
        const at::Tensor& part = ranks[static_cast<size_t>(r)].first->groups()[g].compute;
        ASSERT_EQ(part.numel(), hi - lo);
        const int64_t end = std::min(hi, w.numel());
        if (end > lo) {
          EXPECT_TRUE(at::equal(part.narrow(0, 0, end - lo), w.narrow(0, lo, end - lo))) << when << " " << g << " " << r;
        }
      }
    }
  };
  for (auto& r : ranks)
    for (int slot = 0; slot < static_cast<int>(ps.size()); ++slot)
      if (r.first->plan().slots()[static_cast<size_t>(slot)].group >= 0) {
        EXPECT_EQ(r.first->param(slot).numel(), 0) << ps[static_cast<size_t>(slot)].name;
        EXPECT_EQ(r.first->param(slot).scalar_type(), at::kBFloat16);
      }
  expect_partitions_equal_whole("at rest");

  at::manual_seed(4);
  for (int step = 0; step < 3; ++step) {
    std::vector<at::Tensor> grads;
    for (const ParamInfo& p : ps) grads.push_back(at::randn(p.shape).to(at::kBFloat16));
    for (ParamGroup& g : whole.second->param_groups())
      for (size_t i = 0; i < g.params.size(); ++i)
        g.params[i].mutable_grad() = grads[static_cast<size_t>(whole.first->plan().find(g.names[i]))].clone();
    for (auto& r : ranks)  // stage 2's reduction leaves each rank its partition of the flat gradient
      for (int slot = 0; slot < static_cast<int>(ps.size()); ++slot) {
        if (r.first->plan().slots()[static_cast<size_t>(slot)].group < 0) continue;
        auto [view, first] = r.first->slice(slot, StoreBuffer::kGrad);
        view.copy_(grads[static_cast<size_t>(slot)].reshape({-1}).narrow(0, first, view.numel()));
      }
    const StepScalars scalars{1e-2, 0.25};
    whole.second->step(scalars);
    for (auto& r : ranks) r.second->step(scalars);
    for (auto& r : ranks)
      for (ParamStore::Group& g : r.first->groups()) g.grad.zero_();
  }
  expect_partitions_equal_whole("after 3 steps");

  // Gathered (here: the two partitions concatenated), a segment's range attached, every parameter
  // is the whole store's; released, a placeholder again, holding nothing of the gathered values.
  for (size_t g = 0; g < whole.first->groups().size(); ++g) {
    ParamStore& rank0 = *ranks[0].first;
    const at::Tensor gathered = at::cat({rank0.groups()[g].compute, ranks[1].first->groups()[g].compute});
    const ElementRange range = rank0.plan().segment_range(static_cast<int>(g), 0);
    const at::Tensor values = gathered.narrow(0, range.begin, range.size()).clone();
    rank0.attach(static_cast<int>(g), range, values);
    for (int slot : rank0.plan().groups()[g].slots) {
      EXPECT_TRUE(at::equal(rank0.param(slot), whole.first->param(slot))) << ps[static_cast<size_t>(slot)].name;
      EXPECT_EQ(rank0.param(slot).data_ptr<at::BFloat16>(),
                values.data_ptr<at::BFloat16>() + rank0.plan().range(slot).begin - range.begin);
    }
    rank0.release(static_cast<int>(g), range);
    for (int slot : rank0.plan().groups()[g].slots) EXPECT_EQ(rank0.param(slot).numel(), 0);
    EXPECT_EQ(values.use_count(), 1) << "the store keeps no reference to released values";
  }
  // A range must hold whole parameters, and only a partitioned group is attached.
  const at::Tensor some = at::zeros({10}, at::kBFloat16);
  expect_error<Error>([&] { ranks[0].first->attach(0, {0, 10}, some); }, {"cuts parameter 'a.weight'", "[0, 35)"});
  expect_error<Error>([&] { ranks[0].first->attach(0, {0, 35}, some); }, {"needs 35 contiguous bf16 elements", "got bf16 (10)"});
  expect_error<Error>([&] { whole.first->attach(0, {0, 35}, at::zeros({35}, at::kBFloat16)); },
                      {"whose compute weights are whole"});
}

// ZeRO stage 1 with fp32 SGD without momentum: no master and no state exist, but the partitioned
// extents still decide what each rank steps and measures. Each gradient element is summed on one
// rank only (the host adds the ranks' sums: before, every rank summed them all and the norm came
// out sqrt(N) too large), every rank counts every parameter's updates, and the stepped partitions
// gathered give the unpartitioned step's values.
TEST(ParamStore, PartitionedStepWithoutStateMeasuresEachGradientOnce) {
  const std::vector<ParamInfo> ps = infos();
  OptimizerConfig cfg;
  cfg.type = "SGD";
  cfg.lr = 0.1;
  auto make = [&](int rank, int world) { return stage1_rank(cfg, ps, rank, world, at::kFloat); };
  auto whole = make(0, 1);
  auto r0 = make(0, 2), r1 = make(1, 2);
  ASSERT_TRUE(r0.first->plan().state_names().empty());
  ASSERT_FALSE(r0.first->groups()[0].master.defined());
  EXPECT_FALSE(whole.second->grads_partitioned());
  EXPECT_TRUE(r0.second->grads_partitioned());
  for (int step = 0; step < 2; ++step) {
    for (auto* o : {&whole, &r0, &r1}) {
      at::manual_seed(100 + step);
      for (ParamGroup& g : o->second->param_groups())
        for (at::Tensor& p : g.params) p.mutable_grad() = at::randn(p.sizes());
    }
    const double all = whole.second->grad_summary().sum_squares;
    const double parts = r0.second->grad_summary().sum_squares + r1.second->grad_summary().sum_squares;
    EXPECT_NEAR(parts, all, 1e-12 * all);
    for (auto* o : {&whole, &r0, &r1}) o->second->step({0.1, 1.0});
    for (size_t g = 0; g < whole.first->groups().size(); ++g) {  // the all-gather
      for (auto* from : {&r0, &r1}) {
        const auto [lo, hi] = from->first->plan().partition(static_cast<int>(g));
        auto* to = from == &r0 ? &r1 : &r0;
        to->first->groups()[g].compute.narrow(0, lo, hi - lo).copy_(from->first->groups()[g].compute.narrow(0, lo, hi - lo));
      }
    }
  }
  for (size_t g = 0; g < whole.first->groups().size(); ++g) {
    const at::Tensor& w = whole.first->groups()[g].compute;
    for (auto* r : {&r0, &r1})
      EXPECT_TRUE(at::allclose(r->first->groups()[g].compute.narrow(0, 0, w.numel()), w, 0, 0)) << g;
  }
  const TensorMap counts = whole.second->state_dict();
  ASSERT_EQ(counts.size(), 4u);
  for (auto* r : {&r0, &r1}) expect_same_counts(r->second->state_dict(), counts);
}

// offload_optimizer on a GPU build: a group whose masters or optimizer state are host buffers steps
// on the host, whatever device its compute copy is on (the kernel used to be chosen by the compute
// copy's device, handing host pointers to the CUDA kernel); otherwise where its compute copy is.
// Buffers that do not exist do not count: fp32 SGD without momentum has nothing to offload.
TEST(ParamStore, AnOffloadedGroupStepsOnTheHost) {
  const at::Device gpu(at::kCUDA, 0);
  StorePlan adam(infos(), options());
  EXPECT_TRUE(step_device(adam.groups()[0], gpu) == gpu);
  adam.set_placement(StoreBuffer::kState, Placement::kHost);
  EXPECT_TRUE(step_device(adam.groups()[0], gpu).is_cpu());
  EXPECT_TRUE(step_device(adam.groups()[0], at::kCPU).is_cpu());

  StorePlan mixed(infos(), options());
  mixed.set_compute_dtype(at::kBFloat16);
  mixed.set_master_weights(true);
  EXPECT_TRUE(step_device(mixed.groups()[1], gpu) == gpu);
  mixed.set_placement(StoreBuffer::kMaster, Placement::kHost);
  EXPECT_TRUE(step_device(mixed.groups()[1], gpu).is_cpu());

  StorePlan sgd(infos(), options(0, 1, "SGD"));
  sgd.set_placement(StoreBuffer::kMaster, Placement::kHost);
  sgd.set_placement(StoreBuffer::kState, Placement::kHost);
  ASSERT_TRUE(sgd.state_names().empty());
  EXPECT_TRUE(step_device(sgd.groups()[0], gpu) == gpu);
}

// Groups a plugin creates: the selected trainable parameters move, in model order, to a group
// laid out after the others with its own weight decay and learning-rate multiplier; a group left
// empty disappears and the slots follow; the layout is redone. Bad specs name the group.
TEST(StorePlan, AddGroupMovesTheSelectedParameters) {
  StorePlan plan(infos(), options(0, 2));
  const int g = plan.add_group({"b", [](const ParamInfo& p) { return p.name == "b.weight" || p.name == "c.weight"; }, 0.05, 16.0});
  ASSERT_EQ(plan.groups().size(), 3u);
  ASSERT_EQ(g, 2);
  EXPECT_EQ(plan.groups()[0].name, "decay");
  EXPECT_EQ(plan.groups()[0].numel, 35);
  EXPECT_EQ(plan.groups()[0].padded, 64);
  const StoreGroup& b = plan.groups()[2];
  EXPECT_EQ(b.weight_decay, 0.05);
  EXPECT_EQ(b.lr_scale, 16.0);
  EXPECT_EQ(b.numel, 13 + 7);
  EXPECT_EQ(b.padded, 32);
  EXPECT_EQ(plan.slots()[static_cast<size_t>(plan.find("b.weight"))].group, 2);
  EXPECT_EQ(plan.slots()[static_cast<size_t>(plan.find("c.weight"))].offset, 13);
  EXPECT_EQ(plan.slots()[static_cast<size_t>(plan.find("frozen.weight"))].group, -1);
  // The bias moves out of no_decay, which disappears; the new group's index follows.
  EXPECT_EQ(plan.add_group({"bias", [](const ParamInfo& p) { return p.name == "a.bias"; }}), 2);
  ASSERT_EQ(plan.groups().size(), 3u);
  EXPECT_EQ(plan.groups()[1].name, "b");
  EXPECT_EQ(plan.slots()[static_cast<size_t>(plan.find("b.weight"))].group, 1);
  expect_error<Error>([&] { plan.add_group({"b", [](const ParamInfo&) { return true; }}); }, {"group 'b'", "exists"});
  expect_error<Error>([&] { plan.add_group({"none", [](const ParamInfo& p) { return p.name == "frozen.weight"; }}); },
                      {"group 'none'", "selects no trainable parameter"});
}

// A group's weights counted in another category (LoRA's adapters as adapters): planned and
// allocated there, kept by a group add_group makes from it; two plugins disagreeing name each other.
TEST(StorePlan, AGroupsWeightsCountInTheCategoryItsPluginSets) {
  memory::install_tracking_allocator();
  const std::vector<ParamInfo> ps = infos();
  StorePlan plan(ps, options());
  plan.set_author("lora");
  plan.add_group({"lora", [](const ParamInfo& p) { return p.name == "b.weight" || p.name == "c.weight"; }});
  plan.set_weights_category(Category::kAdapters, "lora");
  plan.add_group({"lora_B", [](const ParamInfo& p) { return p.name == "c.weight"; }, 0.0, 16.0});
  const auto index = [&](const std::string& name) {
    for (size_t g = 0; g < plan.groups().size(); ++g)
      if (plan.groups()[g].name == name) return static_cast<int>(g);
    return -1;
  };
  const int decay = index("decay"), lora = index("lora"), lora_b = index("lora_B");
  ASSERT_EQ(plan.groups().size(), 4u);  // decay, no_decay (a.bias), lora, lora_B
  ASSERT_GE(decay, 0);
  EXPECT_EQ(plan.weights_category(decay), Category::kWeights);
  EXPECT_EQ(plan.weights_category(lora), Category::kAdapters);
  EXPECT_EQ(plan.weights_category(lora_b), Category::kAdapters);
  const memory::Table t = plan.bytes();
  const int64_t adapters = 4 * (plan.groups()[static_cast<size_t>(lora)].padded + plan.groups()[static_cast<size_t>(lora_b)].padded);
  EXPECT_EQ(t.at(Category::kAdapters), adapters);
  const int no_decay = index("no_decay");
  const int64_t others = plan.groups()[static_cast<size_t>(decay)].padded + plan.groups()[static_cast<size_t>(no_decay)].padded;
  EXPECT_EQ(t.at(Category::kWeights), 4 * (others + 16));  // the host's groups + the frozen 4x4

  const memory::Table live0 = memory::live();
  ParamStore store(StorePlan(plan), tensors_for(ps, 5), at::kCPU);
  EXPECT_EQ((memory::live() - live0).at(Category::kAdapters), adapters);
  plan.set_author("other");
  expect_error<Error>([&] { plan.set_weights_category(Category::kWeights, "lora"); },
                      {"'lora'", "'other'", "weights category of group 'lora'"});
}

// A group's learning-rate multiplier: its parameters step as with the multiplied learning rate,
// bit for bit; the others as without it.
TEST(ParamStore, AGroupsLrScaleMultipliesItsLearningRate) {
  const std::vector<ParamInfo> ps = infos();
  OptimizerConfig cfg;
  cfg.type = "AdamW";
  cfg.weight_decay = 0.1;
  auto make = [&](bool scaled) {
    StorePlan plan(ps, store_options(cfg));
    if (scaled) plan.add_group({"b", [](const ParamInfo& p) { return p.name == "b.weight"; }, 0.1, 4.0});
    auto store = std::make_shared<ParamStore>(std::move(plan), tensors_for(ps, 9), at::kCPU);
    return std::make_pair(store, make_optimizer(cfg, store));
  };
  auto scaled = make(true), base = make(false), fast = make(false);
  for (auto* o : {&scaled, &base, &fast}) {  // the same gradient per name, whatever the groups
    for (ParamGroup& g : o->second->param_groups())
      for (size_t i = 0; i < g.params.size(); ++i) {
        at::manual_seed(static_cast<uint64_t>(std::hash<std::string>{}(g.names[i]) & 0xffff));
        g.params[i].mutable_grad() = at::randn(g.params[i].sizes());
      }
  }
  scaled.second->step({1e-2, 1.0});
  base.second->step({1e-2, 1.0});
  fast.second->step({4e-2, 1.0});
  auto value = [](auto& o, const char* name) { return o.first->param(static_cast<int>(o.first->plan().find(name))); };
  EXPECT_TRUE(at::equal(value(scaled, "b.weight"), value(fast, "b.weight")));
  EXPECT_FALSE(at::equal(value(scaled, "b.weight"), value(base, "b.weight")));
  for (const char* other : {"a.weight", "a.bias", "c.weight"})
    EXPECT_TRUE(at::equal(value(scaled, other), value(base, other))) << other;
}

// ---- issue 23's axes: per-group setters, segment order, state formats -----------------------------

using memrt::test::blockwise8;
using memrt::test::fourbit;

// Every setter takes a GroupSelector: by name, by predicate, or every group. Each group's axes are
// its own; who set them is recorded per group, and a group added later inherits its origin's.
TEST(StorePlan, SettersApplyToTheGroupsTheSelectorChooses) {
  StorePlan plan(infos(), options());
  plan.set_author("precision");
  plan.set_compute_dtype(at::kBFloat16, "no_decay");
  plan.set_master_weights(true, "no_decay");
  plan.set_state_dtype(at::kBFloat16, GroupSelector("decaying groups", [](const StoreGroup& g) { return g.weight_decay > 0; }));
  const StoreGroup& decay = plan.groups()[0];
  const StoreGroup& no_decay = plan.groups()[1];
  EXPECT_EQ(decay.buffer(StoreBuffer::kCompute).dtype, at::kFloat);
  EXPECT_FALSE(decay.buffer(StoreBuffer::kMaster).present);
  EXPECT_EQ(no_decay.buffer(StoreBuffer::kCompute).dtype, at::kBFloat16);
  EXPECT_EQ(no_decay.buffer(StoreBuffer::kGrad).dtype, at::kBFloat16);  // follows the compute dtype
  EXPECT_TRUE(no_decay.buffer(StoreBuffer::kMaster).present);
  EXPECT_EQ(plan.state_format(0).name, "bf16");
  EXPECT_EQ(plan.state_format(1).name, "fp32");
  // Frozen parameters are cast only by a setter for every group.
  EXPECT_EQ(plan.slots()[static_cast<size_t>(plan.find("frozen.weight"))].param.dtype, at::kFloat);
  EXPECT_NO_THROW(plan.check());
  // Bytes per group: decay 64 padded fp32 weights + 2 bf16 moments; no_decay 16 bf16 + fp32 master
  // + 2 fp32 moments; the frozen 4x4 in fp32.
  EXPECT_EQ(plan.bytes().at(Category::kWeights), 64 * 4 + 16 * 2 + 16 * 4);
  EXPECT_EQ(plan.bytes().at(Category::kMasterWeights), 16 * 4);
  EXPECT_EQ(plan.bytes().at(Category::kOptimizerState), 64 * 2 * 2 + 16 * 4 * 2);

  // Another plugin may set another group's axis, not the same group's to another value.
  plan.set_author("quant");
  plan.set_compute_dtype(at::kFloat, "decay");
  expect_error<Error>([&] { plan.set_compute_dtype(at::kHalf, "no_decay"); },
                      {"'precision'", "'quant'", "compute dtype of group 'no_decay'", "bf16", "fp16"});
  expect_error<Error>([&] { plan.set_master_weights(true, "lora"); },
                      {"set_master_weights", "group 'lora'", "selects no group", "'decay', 'no_decay'"});
  // A group added from no_decay keeps its layout and who set it: masters stay required by check().
  plan.set_author("");
  plan.add_group({"bias", [](const ParamInfo& p) { return p.name == "a.bias"; }});
  EXPECT_EQ(plan.groups()[1].buffer(StoreBuffer::kCompute).dtype, at::kBFloat16);
  EXPECT_NO_THROW(plan.check());
  // Parameters of two groups whose layouts differ cannot make one group.
  StorePlan two(infos(), options());
  two.set_compute_dtype(at::kBFloat16, "no_decay");
  two.set_master_weights(true, "no_decay");
  expect_error<Error>([&] { two.add_group({"all", [](const ParamInfo&) { return true; }}); },
                      {"group 'all'", "'decay' and 'no_decay'", "differ"});
}

// Groups are laid out in segment order: a parameter appended after the model's (an adapter of
// block 0) sits with block 0's, each segment's parameters are one range of the group, and the
// model's order holds within a segment.
TEST(StorePlan, GroupsAreLaidOutInSegmentOrder) {
  const std::vector<ParamInfo> ps = {{"embed.weight", {4, 8}, at::kFloat, true, true},
                                     {"layers.0.w", {8, 8}, at::kFloat, true, true},
                                     {"layers.1.w", {8, 8}, at::kFloat, true, true},
                                     {"head.w", {8}, at::kFloat, true, true},
                                     {"layers.0.adapter", {2, 8}, at::kFloat, true, true},
                                     {"layers.1.frozen", {3}, at::kFloat, false, true}};
  const StorePlan plan(ps, options(), {-1, 0, 1, 2, 0, 1});
  ASSERT_EQ(plan.groups().size(), 1u);
  std::vector<std::string> order;
  for (int slot : plan.groups()[0].slots) order.push_back(plan.slots()[static_cast<size_t>(slot)].param.name);
  EXPECT_EQ(order, (std::vector<std::string>{"embed.weight", "layers.0.w", "layers.0.adapter", "layers.1.w", "head.w"}));
  EXPECT_EQ(plan.segment_range(0, -1), (ElementRange{0, 32}));
  EXPECT_EQ(plan.segment_range(0, 0), (ElementRange{32, 32 + 64 + 16}));
  EXPECT_EQ(plan.segment_range(0, 1), (ElementRange{112, 176}));
  EXPECT_EQ(plan.segment_range(0, 2), (ElementRange{176, 184}));
  EXPECT_TRUE(plan.segment_range(0, 3).empty());
  EXPECT_EQ(plan.segment_slots(0), (std::vector<int>{1, 4}));
  EXPECT_EQ(plan.segment_slots(1), (std::vector<int>{2, 5}));  // trainable, then frozen
  EXPECT_EQ(plan.segment(4), 0);
  expect_error<Error>([&] { StorePlan(ps, options(), {0, 1}); }, {"2 segments given for 6 parameters"});
}

// A quantized state format is planned per tensor: codes one value per element, scales one per
// block, blocks starting at each parameter (its offset rounds up to the block) and partitions
// holding whole blocks (the group's alignment is the block). Bytes are exact; the other group
// keeps its fp32 state and alignment.
TEST(StorePlan, AQuantizedStateFormatIsPlannedTensorByTensor) {
  for (int world : {1, 2, 4}) {
    StorePlan plan(infos(), options(world - 1, world));
    plan.set_extent(StoreBuffer::kState, Extent::kPartition);
    plan.set_state_format(blockwise8(), "decay");
    EXPECT_EQ(plan.group_alignment(0), 256);
    EXPECT_EQ(plan.group_alignment(1), 16);
    // a.weight (35) at 0, b.weight (13) at 256, c.weight (7) at 512: 519 elements.
    EXPECT_EQ(plan.slots()[static_cast<size_t>(plan.find("b.weight"))].offset, 256);
    EXPECT_EQ(plan.slots()[static_cast<size_t>(plan.find("c.weight"))].offset, 512);
    EXPECT_EQ(plan.groups()[0].numel, 519);
    const int64_t padded = (519 + 256 * world - 1) / (256 * world) * (256 * world);
    EXPECT_EQ(plan.groups()[0].padded, padded) << world;
    EXPECT_EQ(plan.groups()[1].padded, 16 * world) << world;
    const int64_t share = padded / world;
    EXPECT_EQ(plan.held_state_values(0, 0), share);
    EXPECT_EQ(plan.held_state_values(0, 1), share / 256);
    EXPECT_EQ(plan.bytes().at(Category::kOptimizerState),
              2 * (share + 4 * share / 256) + 2 * 4 * (16 * world) / world)
        << world;
  }
  StorePlan ao(infos(), options(0, 2));
  ao.set_state_format(fourbit(), GroupSelector());
  EXPECT_EQ(ao.slots()[static_cast<size_t>(ao.find("c.weight"))].offset, 256);  // 0, 128, 256
  EXPECT_EQ(ao.groups()[0].padded, 512);                  // 263 rounded to 2 x 128
  EXPECT_EQ(ao.groups()[1].padded, 256);                  // 5 rounded to 2 x 128
  EXPECT_EQ(ao.held_state_values(0, 0), 512 / 2);         // full extent: two codes a byte
  EXPECT_EQ(ao.held_state_values(0, 1), 512 / 128);
  EXPECT_EQ(ao.bytes().at(Category::kOptimizerState), 2 * (256 + 4 * 4) + 2 * (128 + 4 * 2));
}

TEST(StorePlan, StateFormatRulesAreCheckedNamingTheFormat) {
  StorePlan plan(infos(), options());
  StateFormat straddling = blockwise8();
  straddling.blocks_per_tensor = false;
  expect_error<Error>([&] { plan.set_state_format(straddling, GroupSelector()); }, {"'test_blockwise8'", "blocks_per_tensor"});
  StateFormat odd = blockwise8();
  odd.tensors[1].per_value = 100;
  expect_error<Error>([&] { plan.set_state_format(odd, GroupSelector()); }, {"'exp_avg.absmax'", "does not divide the block of 256"});
  StateFormat missing = blockwise8();
  missing.tensors.resize(2);
  expect_error<Error>([&] { plan.set_state_format(missing, GroupSelector()); }, {"no tensor for the optimizer's state 'exp_avg_sq'"});
  StateFormat twice = blockwise8();
  twice.tensors[1].name = "exp_avg";
  expect_error<Error>([&] { plan.set_state_format(twice, GroupSelector()); }, {"a name of its own", "'exp_avg'"});
  EXPECT_TRUE(StateFormat::plain(at::kBFloat16, {"exp_avg"}).is_plain());
  EXPECT_FALSE(blockwise8().is_plain());
}

// The store allocates every tensor of a format once, counted to the byte as planned, and slices a
// parameter's state by value: its codes, and the absmax of its own blocks.
TEST(ParamStore, AQuantizedStateFormatIsAllocatedAndSlicedByValue) {
  memory::install_tracking_allocator();
  const std::vector<ParamInfo> ps = infos();
  auto tensors = tensors_for(ps, 3);
  for (int rank : {0, 1}) {
    StorePlan plan(ps, options(rank, 2));
    plan.set_extent(StoreBuffer::kState, Extent::kPartition);
    plan.set_state_format(blockwise8(), "decay");
    const int64_t planned = plan.bytes().category(Category::kOptimizerState);
    const int64_t before = memory::live().category(Category::kOptimizerState);
    ParamStore store(std::move(plan), tensors, at::kCPU);
    EXPECT_EQ(memory::live().category(Category::kOptimizerState) - before, planned);
    const ParamStore::Group& g = store.groups()[0];
    ASSERT_EQ(g.state.size(), 4u);
    EXPECT_EQ(g.state[0].scalar_type(), at::kByte);
    EXPECT_EQ(g.state[0].numel(), 512);  // 1024 padded, 2 ranks
    EXPECT_EQ(g.state[1].numel(), 2);
    // Rank 0 holds a.weight and b.weight ([0, 512)), rank 1 c.weight ([512, 519)).
    const int b = static_cast<int>(store.plan().find("b.weight"));
    const int c = static_cast<int>(store.plan().find("c.weight"));
    auto [codes, first] = store.slice(b, StoreBuffer::kState, 0);
    auto [absmax, first_block] = store.slice(b, StoreBuffer::kState, 1);
    auto [c_absmax, c_block] = store.slice(c, StoreBuffer::kState, 3);
    EXPECT_EQ(first, 0);
    EXPECT_EQ(first_block, 0);
    EXPECT_EQ(codes.numel(), rank == 0 ? 13 : 0);
    EXPECT_EQ(absmax.numel(), rank == 0 ? 1 : 0);
    EXPECT_EQ(c_absmax.numel(), rank == 1 ? 1 : 0);
    if (rank == 0) {
      EXPECT_EQ(absmax.data_ptr<float>(), g.state[1].data_ptr<float>() + 1);  // b's block is the second
    } else {
      EXPECT_EQ(c_absmax.data_ptr<float>(), g.state[3].data_ptr<float>());
    }
  }
}

// The built-in step has kernels for plain formats only: any other is refused naming the group and
// the format, until a plugin that brings its step replaces the optimizer.
TEST(ParamStore, TheBuiltInStepRefusesAFormatItHasNoKernelFor) {
  const std::vector<ParamInfo> ps = infos();
  StorePlan plan(ps, options());
  EXPECT_NO_THROW(check_step_formats(plan));
  plan.set_state_format(blockwise8(), "decay");
  expect_error<Error>([&] { check_step_formats(plan); }, {"group 'decay'", "'test_blockwise8'", "build_optimizer"});
  // The step itself refuses too (a plugin's wrapper that delegates to it).
  OptimizerConfig cfg;
  auto store = std::make_shared<ParamStore>(std::move(plan), tensors_for(ps, 2), at::kCPU);
  auto optimizer = make_optimizer(cfg, store);
  expect_error<Error>([&] { optimizer->step({1e-3, 1.0}); }, {"'test_blockwise8'"});
}

// A plugin's format joins the built-in step through a registered kernel (ABI 2.5): the step hands
// the kernel each range of that format's groups, block-aligned, with every state tensor's values
// and the update's scalars; the plain groups keep the built-in kernel.
TEST(ParamStore, TheBuiltInStepHandsAPluginsFormatToItsKernel) {
  struct Recorder final : StepKernel {
    mutable std::vector<StepRange> seen;
    void step(const StepRange& r) const override {
      seen.push_back(r);
      r.compute.add_(1.f);  // visible in the parameter afterwards
    }
  };
  const std::vector<ParamInfo> ps = infos();
  StorePlan plan(ps, options());
  plan.set_state_format(blockwise8(), "decay");
  auto kernels = std::make_shared<StepKernelTable>();
  auto recorder = std::make_shared<Recorder>();
  kernels->set("test_blockwise8", recorder);
  EXPECT_NO_THROW(check_step_formats(plan, "AdamW", kernels.get()));
  expect_error<Error>([&] { check_step_formats(plan, "SGD", kernels.get()); }, {"'test_blockwise8'", "SGD"});
  expect_error<Error>([&] { kernels->set("test_blockwise8", recorder); }, {"already has a kernel"});
  expect_error<Error>([&] { kernels->set("fp32", recorder); }, {"built-in step's own format"});

  OptimizerConfig cfg;
  cfg.beta1 = 0.8;
  auto store = std::make_shared<ParamStore>(std::move(plan), tensors_for(ps, 2), at::kCPU);
  std::vector<int> decay_slots;
  for (const StoreGroup& g : store->plan().groups())
    if (g.name == "decay") decay_slots = g.slots;
  std::vector<at::Tensor> before;
  for (int slot = 0; slot < static_cast<int>(ps.size()); ++slot) {
    if (ps[static_cast<size_t>(slot)].trainable) store->param(slot).mutable_grad() = at::ones_like(store->param(slot));
    before.push_back(store->param(slot).detach().clone());
  }
  auto optimizer = make_optimizer(cfg, store, kernels);
  optimizer->step({0.5, 0.25});
  ASSERT_EQ(recorder->seen.size(), decay_slots.size());
  for (size_t i = 0; i < decay_slots.size(); ++i) {
    const StepRange& r = recorder->seen[i];
    const int slot = decay_slots[i];
    EXPECT_EQ(r.param->name, ps[static_cast<size_t>(slot)].name);
    EXPECT_EQ(r.first, 0);
    EXPECT_EQ(r.n, store->param(slot).numel());
    EXPECT_EQ(r.state.size(), blockwise8().tensors.size());
    EXPECT_EQ(r.state[1].numel(), (r.n + 255) / 256) << "one absmax per block";
    EXPECT_EQ(r.step, 1);
    EXPECT_DOUBLE_EQ(r.lr, 0.5);
    EXPECT_FLOAT_EQ(r.grad_factor, 0.25f);
    EXPECT_DOUBLE_EQ(r.beta1, 0.8);
    EXPECT_TRUE(at::equal(store->param(slot), before[static_cast<size_t>(slot)] + 1)) << r.param->name;
  }
  for (int slot = 0; slot < static_cast<int>(ps.size()); ++slot) {  // the others: the built-in Adam
    if (!ps[static_cast<size_t>(slot)].trainable || std::find(decay_slots.begin(), decay_slots.end(), slot) != decay_slots.end()) continue;
    EXPECT_FALSE(at::equal(store->param(slot), before[static_cast<size_t>(slot)])) << ps[static_cast<size_t>(slot)].name;
  }
}

namespace {

// infos() and a 4-bit base as a quantizing plugin plans it: q.weight's 16 values as 8 bytes of
// packed codes, and its block's absmax in a module buffer.
std::vector<ParamInfo> with_quantized_base() {
  std::vector<ParamInfo> ps = infos();
  ps.push_back({"q.weight", {8, 1}, at::kByte, false, true});
  return ps;
}

FrozenLayout nf4_layout() {
  FrozenLayout l;
  l.format = "nf4";
  l.tensors = {{"q.weight", at::kByte, {8, 1}, Category::kQuantState},
               {"q.weight_absmax", at::kFloat, {1}, Category::kQuantState}};
  return l;
}

}  // namespace

// A frozen slot holds several tensors with their own dtypes and categories: a quantized base is
// never cast by set_compute_dtype (a plain frozen weight is), its codes and scales count as
// quant_state, and every frozen slot follows the frozen placement. Bad layouts name the parameter.
TEST(StorePlan, FrozenSlotsKeepTheirLayout) {
  const std::vector<ParamInfo> ps = with_quantized_base();
  StorePlan plan(ps, options());
  const int q = static_cast<int>(plan.find("q.weight"));
  const int frozen = static_cast<int>(plan.find("frozen.weight"));
  EXPECT_EQ(plan.frozen_layout(frozen).tensors.size(), 1u);
  EXPECT_EQ(plan.frozen_layout(frozen).format, "");
  plan.set_author("quant");
  plan.set_frozen_layout(q, nf4_layout());
  plan.set_author("precision");
  plan.set_compute_dtype(at::kBFloat16);
  plan.set_master_weights(true);
  EXPECT_EQ(plan.frozen_layout(frozen).tensors[0].dtype, at::kBFloat16);
  EXPECT_EQ(plan.slots()[static_cast<size_t>(frozen)].param.dtype, at::kBFloat16);
  EXPECT_EQ(plan.frozen_layout(q).tensors[0].dtype, at::kByte);
  EXPECT_EQ(plan.frozen_layout(q).tensors[1].dtype, at::kFloat);
  memory::Table t = plan.bytes();
  EXPECT_EQ(t.at(Category::kWeights), 2 * (64 + 16) + 2 * 16);  // groups' bf16 copies + the 4x4
  EXPECT_EQ(t.at(Category::kQuantState), 8 + 4);
  plan.set_author("zero");
  plan.set_frozen_placement(Placement::kHost);
  t = plan.bytes();
  EXPECT_EQ(t.at(Category::kQuantState, Placement::kHost), 12);
  EXPECT_EQ(t.at(Category::kWeights, Placement::kHost), 2 * 16);
  EXPECT_NE(plan.describe().find("1 nf4"), std::string::npos) << plan.describe();

  FrozenLayout wrong = nf4_layout();
  wrong.tensors[0].shape = {16};
  expect_error<Error>([&] { plan.set_frozen_layout(q, wrong); }, {"'q.weight'", "first tensor must be the parameter"});
  wrong = nf4_layout();
  wrong.tensors[1].name = "frozen.weight";
  expect_error<Error>([&] { plan.set_frozen_layout(q, wrong); }, {"'frozen.weight'", "parameter of its own"});
  wrong = nf4_layout();
  wrong.extent = Extent::kPartition;
  expect_error<Error>([&] { plan.set_frozen_layout(q, wrong); }, {"'q.weight'", "only a plain weight alone is partitioned"});
  expect_error<Error>([&] { plan.set_frozen_layout(static_cast<int>(plan.find("a.weight")), nf4_layout()); }, {"'a.weight'", "trainable"});
  plan.set_author("other");
  expect_error<Error>([&] { plan.set_frozen_layout(q, FrozenLayout{"fp4", nf4_layout().tensors}); },
                      {"'quant'", "'other'", "frozen layout of 'q.weight'", "nf4", "fp4"});
}

// The store binds a layout's module buffers by name, moves nothing it need not, and counts every
// tensor in its category: what the plan said, to the byte. A buffer no layout names, or a named
// one the model lacks, is an error naming it.
TEST(ParamStore, FrozenTensorsAreBoundAndCountedAsPlanned) {
  memory::install_tracking_allocator();
  const std::vector<ParamInfo> ps = with_quantized_base();
  auto make_plan = [&] {
    StorePlan plan(ps, options());
    plan.set_frozen_layout(static_cast<int>(plan.find("q.weight")), nf4_layout());
    return plan;
  };
  auto params = [&] {
    std::vector<std::pair<std::string, at::Tensor>> out = tensors_for(infos(), 4);
    out.emplace_back("q.weight", at::arange(8, at::kByte).view({8, 1}));
    return out;
  };
  const at::Tensor absmax = at::full({1}, 0.25f);
  const int64_t before = memory::live().category(Category::kQuantState);
  ParamStore store(make_plan(), params(), {{"q.weight_absmax", absmax}}, at::kCPU);
  EXPECT_EQ(memory::live().category(Category::kQuantState) - before, store.plan().bytes().category(Category::kQuantState));
  const std::vector<at::Tensor>& q = store.frozen_tensors(static_cast<int>(store.plan().find("q.weight")));
  ASSERT_EQ(q.size(), 2u);
  EXPECT_TRUE(q[1].is_same(absmax));
  EXPECT_EQ(q[0].scalar_type(), at::kByte);
  expect_error<Error>([&] { ParamStore(make_plan(), params(), at::kCPU); }, {"'q.weight_absmax'", "model lacks"});
  expect_error<Error>([&] {
    ParamStore(make_plan(), params(), {{"q.weight_absmax", absmax}, {"rotary.inv_freq", at::ones({4})}}, at::kCPU);
  }, {"module buffer 'rotary.inv_freq'", "no frozen parameter's layout"});
  expect_error<Error>([&] { ParamStore(make_plan(), params(), {{"q.weight_absmax", at::ones({2})}}, at::kCPU); },
                      {"'q.weight_absmax'", "(2)", "layout says fp32 (1)"});
}

// ZeRO-3's frozen partitions: a plain frozen weight of 16 elements on 3 ranks rests as shares of
// ceil(16 / 3) = 6, 6 and 4 elements (DeepSpeed's per-parameter ds_tensor), counted as such; the
// module parameter is a placeholder until attach_frozen hands it the whole weight, and again after
// release_frozen. Attaching a replicated slot, or a weight of another shape or dtype, names it.
TEST(ParamStore, PartitionedFrozenWeightsRestAsSharesAndAttachWhole) {
  memory::install_tracking_allocator();
  const std::vector<ParamInfo> ps = infos();
  const std::vector<std::pair<std::string, at::Tensor>> values = tensors_for(ps, 3);
  const at::Tensor whole = values[3].second.clone();  // frozen.weight
  const int64_t shares[] = {6, 6, 4};
  for (int rank = 0; rank < 3; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    StorePlan plan(ps, options(rank, 3));
    const int slot = static_cast<int>(plan.find("frozen.weight"));
    EXPECT_EQ(plan.frozen_partition(slot).size(), 16);  // replicated: all of it
    FrozenLayout layout = plan.frozen_layout(slot);
    layout.extent = Extent::kPartition;
    plan.set_frozen_layout(slot, layout);
    EXPECT_EQ(plan.frozen_partition(slot).begin, 6 * rank);
    EXPECT_EQ(plan.frozen_partition(slot).size(), shares[rank]);
    EXPECT_EQ(plan.bytes().at(Category::kWeights), 4 * (96 + 48) + 4 * shares[rank]);  // groups padded to 3 x 16
    EXPECT_NE(plan.describe().find("1 partitioned"), std::string::npos) << plan.describe();

    std::vector<std::pair<std::string, at::Tensor>> model;
    for (const auto& [name, t] : values) model.emplace_back(name, t.clone().set_requires_grad(t.requires_grad()));
    const at::Tensor param = model[3].second;
    const int64_t before = memory::live().category(Category::kWeights);
    ParamStore store(std::move(plan), model, at::kCPU);
    const at::Tensor& share = store.frozen_tensors(slot).front();
    EXPECT_TRUE(share.equal(whole.reshape({-1}).narrow(0, 6 * rank, shares[rank])));
    EXPECT_EQ(param.numel(), 0);  // the module's parameter rests as a placeholder
    EXPECT_EQ(memory::live().category(Category::kWeights) - before, store.plan().bytes().at(Category::kWeights));

    const at::Tensor gathered = whole.clone();
    store.attach_frozen(slot, gathered);
    EXPECT_TRUE(param.equal(whole));
    EXPECT_EQ(param.data_ptr(), gathered.data_ptr());
    store.release_frozen(slot);
    EXPECT_EQ(param.numel(), 0);
    expect_error<Error>([&] { store.attach_frozen(slot, at::zeros({16})); }, {"'frozen.weight'", "(4, 4)", "got fp32 (16)"});
    expect_error<Error>([&] { store.attach_frozen(slot, whole.to(at::kBFloat16)); }, {"'frozen.weight'", "bf16"});
    expect_error<Error>([&] { store.attach_frozen(static_cast<int>(store.plan().find("a.weight")), whole); },
                        {"'a.weight'", "trainable"});
  }
  StorePlan plan(ps, options(0, 3));
  const int slot = static_cast<int>(plan.find("frozen.weight"));
  ParamStore replicated(std::move(plan), tensors_for(ps, 3), at::kCPU);
  expect_error<Error>([&] { replicated.attach_frozen(slot, whole); }, {"'frozen.weight'", "frozen whole"});
}
