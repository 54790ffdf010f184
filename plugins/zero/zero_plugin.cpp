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
      if (opt_.stage >= 2) {
        // DeepSpeed keeps an offloaded gradient partition in fp32 (stage_1_and_2.py copies each
        // gradient into the fp32 partition's .grad, as float, unless fp16_master_weights_and_
        // gradients): the host step reads fp32, whatever the compute dtype.
        ctx.plan.set_placement(StoreBuffer::kGrad, Placement::kHost);
        ctx.plan.set_grad_dtype(at::kFloat);
      }
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
    if (opt_.stage < 1 || ctx.skipped || ctx.run.world_size == 1) return;
    const memrt::ParamStore& store = *store_;
    const int n = ctx.run.world_size;
    at::NoGradGuard no_grad;
    memrt::memory::Scope scope(Category::kCommBuffers);
    for (size_t g = 0; g < store.groups().size(); ++g) {
      const at::Tensor& compute = store.groups()[g].compute;
      const auto [lo, hi] = store.plan().partition(static_cast<int>(g));
      const int64_t part = hi - lo;  // every rank's partition has this size
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
    if (opt_.stage >= 2) plan_buckets(ctx.run, ctx.grad_hooks);
  }

  void after_backward(memrt::MicroStepContext& /*ctx*/) override {
    if (opt_.stage < 2) return;
    // Buckets still open hold a parameter that got no gradient on this rank this micro-step (its
    // part is zeros): reduce them now, in the same order as every rank, so that every rank has
    // reduced every bucket once.
    while (next_flush_ < buckets_.size()) flush(buckets_[next_flush_++]);
    for (Bucket& bucket : buckets_) bucket.pending = static_cast<int>(bucket.slots.size());
    next_flush_ = 0;
  }

 private:
  // A contiguous range of one group's elements, reduced together. Buckets are laid out from the
  // group's end, as backward produces gradients in reverse model order.
  struct Bucket {
    int group = 0;
    memrt::ElementRange range;
    std::vector<int> slots;  // parameters overlapping it, last in the model first
    int pending = 0;         // of them, still to hand their gradient over this micro-step
    int64_t width = 0;       // the largest share of one rank: each rank's slot in `staging`
    at::Tensor staging;      // (world_size * width): rank r's share at [r * width, ...)
  };

  // Buckets in the order every rank reduces them: by their first parameter in the model, last
  // first, which is the order backward completes them. A bucket is reduced once it is complete and
  // every bucket before it has been, so the collectives line up across ranks even where a
  // parameter gets no gradient on some rank (its bucket then waits for after_backward).
  void plan_buckets(const memrt::RunInfo& run, memrt::GradHooks& hooks) {
    const memrt::StorePlan& plan = store_->plan();
    buckets_.clear();
    for (int g = 0; g < static_cast<int>(plan.groups().size()); ++g) {
      const memrt::StoreGroup& group = plan.groups()[static_cast<size_t>(g)];
      Bucket current;
      auto close = [&] {
        if (current.slots.empty()) return;
        for (int r = 0; r < run.world_size; ++r)
          current.width = std::max(current.width, (current.range & plan.partition(g, r)).size());
        current.pending = static_cast<int>(current.slots.size());
        buckets_.push_back(current);
        current = Bucket();
      };
      for (auto it = group.slots.rbegin(); it != group.slots.rend(); ++it) {
        const memrt::ElementRange param = plan.range(*it);
        if (current.slots.empty()) current = Bucket{g, param, {}, 0, 0, {}};
        current.range.begin = param.begin;
        current.slots.push_back(*it);
        if (current.range.size() >= opt_.reduce_bucket_size) close();
      }
      close();
    }
    std::stable_sort(buckets_.begin(), buckets_.end(),
                     [](const Bucket& a, const Bucket& b) { return a.slots.back() > b.slots.back(); });
    bucket_of_.assign(plan.slots().size(), {});
    for (size_t b = 0; b < buckets_.size(); ++b)
      for (int slot : buckets_[b].slots) bucket_of_[static_cast<size_t>(slot)].push_back(static_cast<int>(b));
    next_flush_ = 0;
    // Each gradient, as soon as autograd has stored it, goes into its bucket(s) and is dropped.
    for (int slot = 0; slot < static_cast<int>(plan.slots().size()); ++slot) {
      if (plan.slots()[static_cast<size_t>(slot)].group < 0) continue;
      hooks.on_grad_ready(slot, [this, slot](at::Tensor& grad) { hand_over(slot, grad); });
    }
  }

  void hand_over(int slot, at::Tensor& grad) {
    const memrt::StorePlan& plan = store_->plan();
    const memrt::ElementRange mine = plan.range(slot);
    at::Tensor flat = grad.reshape({-1});
    at::NoGradGuard no_grad;
    const std::vector<int>& buckets = bucket_of_[static_cast<size_t>(slot)];
    for (size_t i = 0; i < buckets.size(); ++i) {
      Bucket& bucket = buckets_[static_cast<size_t>(buckets[i])];
      stage(bucket);
      // The parameter's elements inside this bucket, each to its owner's share.
      for (int r = 0; r < comm_->world_size(); ++r) {
        const memrt::ElementRange share = bucket.range & plan.partition(bucket.group, r);
        const memrt::ElementRange part = share & mine;
        if (part.empty()) continue;
        bucket.staging.narrow(0, r * bucket.width + (part.begin - share.begin), part.size())
            .copy_(flat.narrow(0, part.begin - mine.begin, part.size()));
      }
      // All of the gradient is in buckets now: it goes before any reduction (no rank holds a
      // gradient it does not own), so a reduction's buffers never sit beside it.
      if (i + 1 == buckets.size()) {
        flat = at::Tensor();
        grad = at::Tensor();
      }
      // Reduced as soon as it may be, before the parameter's next bucket is staged: a parameter
      // spanning several buckets holds one staging at a time.
      if (--bucket.pending == 0) flush_ready();
    }
  }

  // Reduces, in order, every complete bucket whose predecessors are reduced.
  void flush_ready() {
    while (next_flush_ < buckets_.size() && buckets_[next_flush_].pending == 0) flush(buckets_[next_flush_++]);
  }

  // The bucket's rank-major staging, zeros until gradients arrive (comm_buffers).
  void stage(Bucket& bucket) {
    if (bucket.staging.defined()) return;
    memrt::memory::Scope scope(Category::kCommBuffers);
    bucket.staging = at::zeros({comm_->world_size() * bucket.width},
                               store_->groups()[static_cast<size_t>(bucket.group)].compute.options());
  }

  // Reduce-scatter the bucket: each rank adds the mean of every rank's share of it into its flat
  // gradient partition (DeepSpeed averages over the data-parallel ranks).
  void flush(Bucket& bucket) {
    const int n = comm_->world_size();
    const memrt::ParamStore::Group& g = store_->groups()[static_cast<size_t>(bucket.group)];
    const memrt::ElementRange partition = store_->plan().partition(bucket.group);
    at::NoGradGuard no_grad;
    stage(bucket);
    at::Tensor mine;
    {
      // The output, and whatever the backend allocates on this thread (with Gloo, as much again as
      // the input, measured): communication buffers, not the activations of the backward around it.
      memrt::memory::Scope scope(Category::kCommBuffers);
      mine = at::empty({bucket.width}, bucket.staging.options());
      comm_->reduce_scatter_sum(mine, bucket.staging);
    }
    bucket.staging = at::Tensor();
    const memrt::ElementRange share = bucket.range & partition;
    if (!share.empty()) {
      at::Tensor dst = g.grad.narrow(0, share.begin - partition.begin, share.size());
      dst.add_(mine.narrow(0, 0, share.size()).to(dst.options()), 1.0 / n);  // offloaded: to the host
    }
  }

  memrt::zero::Options opt_;
  memrt::ParamStore* store_ = nullptr;
  memrt::Communicator* comm_ = nullptr;
  std::vector<Bucket> buckets_;              // in the order every rank reduces them
  size_t next_flush_ = 0;                    // buckets_[0, next_flush_) reduced this micro-step
  std::vector<std::vector<int>> bucket_of_;  // per slot: the buckets it overlaps
};

}  // namespace

MEMRT_PLUGIN(ZeroPlugin, "zero", "0.3.0",
             "ZeRO stages 1 and 2 over the parameter store (masters, optimizer state and "
             "gradients partitioned), optimizer offload to host memory")
