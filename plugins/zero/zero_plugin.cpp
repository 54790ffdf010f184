// plugins/zero — ZeRO partitioning over the parameter store, and optimizer offload.
//
// Stage 0 is plain data parallelism, done by the host (bucketed gradient all-reduce). Stage 1
// partitions the fp32 masters and the optimizer state: each rank steps its partition of every
// group, then the updated compute values are all-gathered. Stage 2 also partitions the
// gradients: as backward hands each parameter's gradient over, it goes into a bucket and is
// dropped; a full bucket is reduce-scattered into the owners' flat gradient partitions.
// docs/zero.md has the phases; the store (memrt/param_store.h) does the bookkeeping, so this
// plugin sets extents and placements and moves bytes between ranks.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <memrt/plugin.h>

#include "zero_config.h"

namespace {

using memrt::Extent;
using memrt::StoreBuffer;
using memrt::memory::Category;
using memrt::memory::Placement;

class ZeroPlugin final : public memrt::Plugin {
 public:
  int priority() const override { return memrt::priority::kZero; }

  void configure(const memrt::ConfigNode& options, memrt::ConfigDiagnostics& diag,
                 const memrt::RunInfo& run) override {
    memrt::ConfigReader top(options, diag);
    const memrt::ConfigNode* zero = top.child("zero_optimization");
    top.finish();
    if (!zero) return;
    opt_ = memrt::zero::read_options(*zero, diag, run.device.is_cpu());
  }

  void plan_store(memrt::StorePlanContext& ctx) override {
    if (opt_.stage < 1) return;
    ctx.plan.set_extent(StoreBuffer::kMaster, Extent::kPartition);
    ctx.plan.set_extent(StoreBuffer::kState, Extent::kPartition);
    if (opt_.stage >= 2) ctx.plan.set_extent(StoreBuffer::kGrad, Extent::kPartition);
    if (opt_.offload_optimizer) {
      ctx.plan.set_placement(StoreBuffer::kMaster, Placement::kHost);
      ctx.plan.set_placement(StoreBuffer::kState, Placement::kHost);
      if (opt_.stage >= 2) ctx.plan.set_placement(StoreBuffer::kGrad, Placement::kHost);
    }
  }

  bool reduces_gradients() const override { return opt_.stage >= 2; }

  // Stage 2 estimate: no replicated gradients (the store's cells add the partition); in flight,
  // at most the bucket being filled, its rank-major staging and the reduce-scatter's output.
  void estimate_memory(memrt::memory::MemoryEstimate& e) const override {
    if (opt_.stage < 2) return;
    const int64_t b = static_cast<int64_t>(c10::elementSize(e.compute_dtype));
    int64_t trainable = 0;
    for (const auto& p : e.params) trainable += p.trainable ? p.numel : 0;
    const int64_t n = e.run->world_size;
    const int64_t bucket = std::min(opt_.reduce_bucket_size, trainable);
    for (Placement pl : {Placement::kDevice, Placement::kHost}) {
      e.table.at(Category::kGradients, pl) = 0;
      e.table.at(Category::kCommBuffers, pl) = 0;
    }
    e.table.at(Category::kCommBuffers) = (n * bucket + bucket) * b;
    e.backward_grad_elements = 0;
    e.peak_in_backward = true;  // no full set of gradients ever exists at the step
    e.refresh_activations();
  }

  // Every rank updated its partition of each compute buffer; gather the others' in chunks of
  // allgather_bucket_size elements (rank-major in a staging buffer, comm_buffers, alive only
  // here), then copy them in place.
  void after_optimizer_step(memrt::StepContext& ctx) override {
    if (opt_.stage >= 2) {  // the next step accumulates from zero
      for (const auto& g : store_->groups()) g.grad.zero_();
    }
    if (opt_.stage < 1 || ctx.skipped || ctx.run.world_size == 1) return;
    const memrt::ParamStore& store = *store_;
    const int n = ctx.run.world_size;
    at::NoGradGuard no_grad;
    memrt::memory::Scope scope(Category::kCommBuffers);
    for (size_t g = 0; g < store.groups().size(); ++g) {
      const at::Tensor& compute = store.groups()[g].compute;
      const auto [lo, hi] = store.plan().partition(static_cast<int>(g));
      const int64_t part = hi - lo;
      const int64_t chunk = std::max<int64_t>(1, std::min(part, opt_.allgather_bucket_size / n));
      at::Tensor staging = at::empty({n * chunk}, compute.options());
      for (int64_t c0 = 0; c0 < part; c0 += chunk) {
        const int64_t len = std::min(chunk, part - c0);
        at::Tensor out = staging.narrow(0, 0, n * len);
        ctx.comm.all_gather(out, compute.narrow(0, lo + c0, len));
        for (int r = 0; r < n; ++r) {
          if (r == ctx.run.rank) continue;
          at::Tensor dst = compute.narrow(0, r * part + c0, len);
          dst.copy_(out.narrow(0, r * len, len));
        }
      }
    }
  }

  void build_optimizer(memrt::OptimizerContext& ctx) override {
    store_ = &ctx.store;
    comm_ = &ctx.comm;
    if (opt_.stage >= 2) plan_buckets(ctx.run);
  }

  void after_backward(memrt::MicroStepContext& /*ctx*/) override {
    if (opt_.stage < 2) return;
    // Parameters that got no gradient this micro-step leave their bucket unfinished: reduce what
    // it holds (their part is zeros), so every rank has reduced every bucket once.
    for (Bucket& bucket : buckets_)
      if (bucket.staging.defined()) flush(bucket);
    for (Bucket& bucket : buckets_) bucket.pending = static_cast<int>(bucket.slots.size());
  }
 private:
  // A contiguous range [begin, end) of one group's elements, reduced together. Buckets are laid
  // out from the group's end, as backward produces gradients in reverse model order.
  struct Bucket {
    int group = 0;
    int64_t begin = 0, end = 0;
    std::vector<int> slots;  // parameters overlapping it
    int pending = 0;         // of them, still to hand their gradient over this micro-step
    int64_t width = 0;       // the largest share of one rank: each rank's slot in `staging`
    at::Tensor staging;      // (world_size * width): rank r's share at [r * width, ...)
  };

  // Stage 2: one post-accumulate hook per trainable parameter: its gradient, as soon as autograd
  // has stored it, goes into its bucket(s) in rank-major order and is dropped.
  struct HandOver final : torch::autograd::PostAccumulateGradHook {
    HandOver(ZeroPlugin* self, int slot) : self(self), slot(slot) {}
    void operator()(const torch::autograd::Variable& param) override { self->hand_over(slot, param); }
    ZeroPlugin* self;
    int slot;
  };

  void plan_buckets(const memrt::RunInfo& run) {
    const memrt::StorePlan& plan = store_->plan();
    buckets_.clear();
    bucket_of_.assign(plan.slots().size(), {});
    for (int g = 0; g < static_cast<int>(plan.groups().size()); ++g) {
      const memrt::StoreGroup& group = plan.groups()[static_cast<size_t>(g)];
      const int64_t part = group.padded / run.world_size;
      Bucket current;
      current.group = g;
      current.end = group.numel;
      current.begin = group.numel;
      auto close = [&] {
        if (current.slots.empty()) return;
        for (int r = 0; r < run.world_size; ++r) {
          const int64_t lo = std::max(current.begin, r * part), hi = std::min(current.end, (r + 1) * part);
          current.width = std::max(current.width, hi - lo);
        }
        for (int slot : current.slots) bucket_of_[static_cast<size_t>(slot)].push_back(static_cast<int>(buckets_.size()));
        current.pending = static_cast<int>(current.slots.size());
        buckets_.push_back(current);
        current = Bucket();
        current.group = g;
      };
      for (auto it = group.slots.rbegin(); it != group.slots.rend(); ++it) {
        const memrt::ParamSlot& s = plan.slots()[static_cast<size_t>(*it)];
        if (current.slots.empty()) current.end = s.offset + s.numel;
        current.begin = s.offset;
        current.slots.push_back(*it);
        if (current.end - current.begin >= opt_.reduce_bucket_size) close();
      }
      close();
    }
    for (size_t slot = 0; slot < plan.slots().size(); ++slot) {
      if (plan.slots()[slot].group < 0) continue;
      torch::autograd::impl::set_post_acc_grad_hooks(
          store_->param(static_cast<int>(slot)), std::make_unique<HandOver>(this, static_cast<int>(slot)));
    }
  }

  void hand_over(int slot, const at::Tensor& param) {
    at::Tensor& grad = const_cast<at::Tensor&>(param).mutable_grad();
    if (!grad.defined()) return;
    const memrt::ParamSlot& s = store_->plan().slots()[static_cast<size_t>(slot)];
    const at::Tensor flat = grad.reshape({-1});
    at::NoGradGuard no_grad;
    for (int b : bucket_of_[static_cast<size_t>(slot)]) {
      Bucket& bucket = buckets_[static_cast<size_t>(b)];
      const int64_t part = store_->plan().groups()[static_cast<size_t>(bucket.group)].padded / comm_->world_size();
      if (!bucket.staging.defined()) {
        memrt::memory::Scope scope(Category::kCommBuffers);
        bucket.staging = at::zeros({comm_->world_size() * bucket.width}, grad.options());
      }
      // The parameter's elements inside this bucket, each to its owner's share.
      const int64_t lo = std::max(bucket.begin, s.offset), hi = std::min(bucket.end, s.offset + s.numel);
      for (int64_t x = lo; x < hi;) {
        const int64_t r = x / part, stop = std::min(hi, (r + 1) * part);
        const int64_t share_begin = std::max(bucket.begin, r * part);
        bucket.staging.narrow(0, r * bucket.width + (x - share_begin), stop - x)
            .copy_(flat.narrow(0, x - s.offset, stop - x));
        x = stop;
      }
      if (--bucket.pending == 0) flush(bucket);
    }
    grad = at::Tensor();  // after backward, no rank holds a gradient it does not own
  }

  // Reduce-scatter the bucket: each rank adds the mean of every rank's share of it into its flat
  // gradient partition (DeepSpeed averages over the data-parallel ranks).
  void flush(Bucket& bucket) {
    const int n = comm_->world_size();
    const memrt::ParamStore::Group& g = store_->groups()[static_cast<size_t>(bucket.group)];
    const auto [my_lo, my_hi] = store_->plan().partition(bucket.group);
    at::NoGradGuard no_grad;
    at::Tensor mine;
    {
      memrt::memory::Scope scope(Category::kCommBuffers);
      mine = at::empty({bucket.width}, bucket.staging.options());
    }
    comm_->reduce_scatter_sum(mine, bucket.staging);
    bucket.staging = at::Tensor();
    const int64_t lo = std::max(bucket.begin, my_lo), hi = std::min(bucket.end, my_hi);
    if (hi > lo) {
      at::Tensor dst = g.grad.narrow(0, lo - my_lo, hi - lo);
      dst.add_(mine.narrow(0, 0, hi - lo).to(dst.scalar_type()), 1.0 / n);
    }
  }

  memrt::zero::Options opt_;
  const memrt::ParamStore* store_ = nullptr;
  memrt::Communicator* comm_ = nullptr;
  std::vector<Bucket> buckets_;
  std::vector<std::vector<int>> bucket_of_;  // per slot: the buckets it overlaps
};

}  // namespace

MEMRT_PLUGIN(ZeroPlugin, "zero", "0.3.0",
             "ZeRO stages 1 and 2 over the parameter store (masters, optimizer state and "
             "gradients partitioned), optimizer offload to host memory")
