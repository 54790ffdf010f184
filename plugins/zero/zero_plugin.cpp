// plugins/zero — ZeRO partitioning over the parameter store, and optimizer offload.
//
// Stage 0 is plain data parallelism, done by the host (bucketed gradient all-reduce). Stage 1
// partitions the fp32 masters and the optimizer state: each rank steps its partition of every
// group, then the updated compute values are all-gathered. Stage 2 also partitions the
// gradients: as backward hands each parameter's gradient over, it goes into a bucket (staged in
// a buffer its segment's backward holds) and is dropped; a complete bucket is summed over the
// ranks in place and each rank adds its share into its flat gradient partition.
// Stage 3 also partitions the compute weights and a 16-bit frozen base: a segment's parameters are
// gathered into buffers before its forward and again before its backward, and released after each.
// docs/zero.md has the phases; the store (memrt/param_store.h) does the bookkeeping, so this
// plugin sets extents and placements and moves bytes between ranks.
#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <c10/core/StorageImpl.h>

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
    if (opt_.stage >= 3) plan_stage3(ctx.plan);
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

  // Stage 2 estimate: no replicated gradients (the store's cells add the partition) and, in
  // estimate_planned_memory, the staging of the segment in backward.
  void estimate_memory(memrt::memory::MemoryEstimate& e) const override {
    if (opt_.stage < 2) return;
    for (Placement pl : {Placement::kDevice, Placement::kHost}) {
      e.table.at(Category::kGradients, pl) = 0;
      e.table.at(Category::kCommBuffers, pl) = 0;
    }
    e.backward_grad_elements = 0;
    e.peak_in_backward = true;  // no full set of gradients ever exists at the step
    e.refresh_activations();
  }

  // A segment's staging (per group its largest bucket in the compute dtype, and as much again in
  // the partition's dtype and place where they differ) and, at stage 3, its gathered parameters
  // are alive through that segment's backward. Of backward's two candidate peaks, the loss's comes
  // before the head's backward starts (nothing staged or gathered); the last block's has that
  // block's beside it.
  void estimate_planned_memory(memrt::memory::MemoryEstimate& e) const override {
    if (opt_.stage < 2) return;
    const int64_t last = e.run->shape.n_layer - 1;
    memrt::memory::Table staging = staging_bytes(*e.store, last, e.run->device);
    if (opt_.stage >= 3) {
      staging.at(Category::kCommBuffers) += gathered(*e.store, last).bytes;
      if (prefetches(*e.store, last, last - 1)) staging.at(Category::kCommBuffers) += gathered(*e.store, last - 1).bytes;
    }
    memrt::memory::ActivationEstimate& a = e.activations;
    const bool at_loss = a.backward_at_loss >= a.backward_in_last_block + staging.total();
    a.backward_peak = at_loss ? a.backward_at_loss : a.backward_in_last_block;
    if (!at_loss) e.table = e.table + staging;
    e.refresh_activations();
  }

  // Every rank updated its partition of each compute buffer; gather the others' in chunks of
  // allgather_bucket_size elements (rank-major in a staging buffer, comm_buffers, alive only
  // here), then copy them in place.
  // Partitioned compute weights (stage 3) stay partitioned: each rank's step wrote its own.
  void after_optimizer_step(memrt::StepContext& ctx) override {
    if (opt_.stage < 1 || ctx.skipped || ctx.run.world_size == 1) return;
    const memrt::ParamStore& store = *store_;
    const int n = ctx.run.world_size;
    at::NoGradGuard no_grad;
    memrt::memory::Scope scope(Category::kCommBuffers);
    for (size_t g = 0; g < store.groups().size(); ++g) {
      if (compute_partitioned(store.plan(), static_cast<int>(g))) continue;
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
    device_ = ctx.run.device;
    if (opt_.stage < 2) return;
    buckets_ = plan_buckets(store_->plan());
    bucket_of_.assign(store_->plan().slots().size(), {});
    for (size_t b = 0; b < buckets_.size(); ++b)
      for (int slot : buckets_[b].slots) bucket_of_[static_cast<size_t>(slot)].push_back(static_cast<int>(b));
    staging_.assign(store_->groups().size(), Staging());
    next_flush_ = 0;
    // Each gradient, as soon as autograd has stored it, goes into its bucket(s) and is dropped.
    for (int slot = 0; slot < static_cast<int>(bucket_of_.size()); ++slot)
      if (!bucket_of_[static_cast<size_t>(slot)].empty())
        ctx.grad_hooks.on_grad_ready(slot, [this, slot](at::Tensor& grad) { hand_over(slot, grad); });
  }

  // Stage 3: the segment's parameters, gathered for its forward (evaluation included) and released
  // after it; the next segment's gather starts meanwhile.
  void before_segment_forward(memrt::SegmentContext& ctx) override {
    if (opt_.stage < 3) return;
    gather(ctx);
    prefetch(ctx, ctx.index + 1);
  }
  void after_segment_forward(memrt::SegmentContext& ctx) override {
    if (opt_.stage >= 3) release(ctx);
  }

  // Stage 3 gathers the segment again (autograd's saved views of its buffers read the values);
  // stage 2's staging: one buffer per group of the segment's largest bucket, reused bucket after
  // bucket.
  void before_segment_backward(memrt::SegmentContext& ctx) override {
    if (opt_.stage >= 3) {
      gather(ctx);
      prefetch(ctx, ctx.index - 1);
    }
    if (opt_.stage < 2 || buckets_.empty()) return;
    const memrt::StorePlan& plan = store_->plan();
    memrt::memory::Scope scope(Category::kCommBuffers);
    for (int g = 0; g < static_cast<int>(staging_.size()); ++g) {
      const int64_t numel = largest_bucket(plan, g, ctx.index);
      if (numel == 0) continue;
      const memrt::ParamStore::Group& group = store_->groups()[static_cast<size_t>(g)];
      Staging& st = staging_[static_cast<size_t>(g)];
      st = Staging{ctx.index, at::empty({numel}, group.compute.options()), {}, -1};
      if (converts(g)) {
        memrt::memory::Scope on(Category::kCommBuffers, plan.groups()[static_cast<size_t>(g)].buffer(StoreBuffer::kGrad).placement);
        st.convert = at::empty({numel}, group.grad.options());
      }
    }
  }

  // The segment's backward is over: its buckets are reduced now, in the same order on every rank,
  // complete or not (a parameter that got no gradient on this rank leaves its part zeros).
  void after_segment_backward(memrt::SegmentContext& ctx) override {
    if (opt_.stage >= 3) release(ctx);
    if (opt_.stage < 2 || buckets_.empty()) return;
    while (next_flush_ < buckets_.size() && buckets_[next_flush_].segment >= ctx.index) flush(next_flush_++);
    for (Staging& st : staging_)
      if (st.segment == ctx.index) st = Staging();
  }

  void after_backward(memrt::MicroStepContext& /*ctx*/) override {
    if (opt_.stage >= 3) drop_prefetch();  // the embedding's, when its backward did not run
    if (opt_.stage < 2) return;
    // Segments whose backward never ran on this rank (no gradient reached them) still reduce, in
    // the same order as every rank, so that every rank has reduced every bucket once.
    while (next_flush_ < buckets_.size()) flush(next_flush_++);
    for (Staging& st : staging_) st = Staging();
    for (Bucket& bucket : buckets_) bucket.pending = static_cast<int>(bucket.slots.size());
    next_flush_ = 0;
  }

 private:
  // A contiguous range of one group's elements, all of one segment, of at most reduce_bucket_size
  // elements, reduced together. A segment's buckets are cut from its range's end, as backward
  // produces gradients in reverse model order.
  struct Bucket {
    int group = 0;
    int64_t segment = 0;
    memrt::ElementRange range;
    std::vector<int> slots;  // parameters overlapping it, last in the model first
    int pending = 0;         // of them, still to hand their gradient over this micro-step
    at::Tensor sum;          // its elements in layout order while open (a view of its staging)
  };

  // Per group, what the segment in backward stages into: one bucket at a time.
  struct Staging {
    int64_t segment = 0;
    at::Tensor buffer;   // the group's largest bucket of the segment, compute dtype (comm_buffers)
    at::Tensor convert;  // the same length in the gradient partition's dtype and place, when it differs
    int owner = -1;      // the bucket using `buffer`, -1 when free
  };

  // Buckets in the order every rank reduces them: segment by segment in backward's order, and in a
  // segment by their first parameter in the model, last first, which is the order backward
  // completes them. A bucket is reduced once it is complete and every bucket before it has
  // been, or when its segment's backward ends, so the collectives line up across ranks even where a
  // parameter gets no gradient on some rank. The estimate plans the same buckets from shapes.
  std::vector<Bucket> plan_buckets(const memrt::StorePlan& plan) const {
    std::vector<Bucket> out;
    for (int g = 0; g < static_cast<int>(plan.groups().size()); ++g) {
      const std::vector<int>& slots = plan.groups()[static_cast<size_t>(g)].slots;
      for (size_t i = slots.size(); i > 0;) {  // segment by segment, from the group's end
        const int64_t segment = plan.segment(slots[i - 1]);
        const memrt::ElementRange whole = plan.segment_range(g, segment);
        for (int64_t end = whole.end; end > whole.begin; end -= opt_.reduce_bucket_size) {
          Bucket bucket{g, segment, {std::max(whole.begin, end - opt_.reduce_bucket_size), end}, {}, 0, {}};
          for (size_t j = i; j > 0 && plan.segment(slots[j - 1]) == segment; --j)
            if (!(plan.range(slots[j - 1]) & bucket.range).empty()) bucket.slots.push_back(slots[j - 1]);
          bucket.pending = static_cast<int>(bucket.slots.size());
          if (!bucket.slots.empty()) out.push_back(std::move(bucket));
        }
        while (i > 0 && plan.segment(slots[i - 1]) == segment) --i;
      }
    }
    std::stable_sort(out.begin(), out.end(), [](const Bucket& a, const Bucket& b) {
      return a.segment != b.segment ? a.segment > b.segment : a.slots.back() > b.slots.back();
    });
    return out;
  }

  int64_t largest_bucket(const memrt::StorePlan& plan, int g, int64_t segment) const {
    const int64_t numel = plan.segment_range(g, segment).size();
    return std::min(numel, opt_.reduce_bucket_size);
  }

  // Whether group g's partition has another dtype than its compute copy (fp32 accumulation), or
  // lies in other memory (offloaded from an accelerator), so that a reduced bucket goes through a
  // conversion buffer.
  static bool converts(const memrt::StorePlan& plan, int g, const c10::Device& device) {
    const memrt::StoreGroup& group = plan.groups()[static_cast<size_t>(g)];
    const memrt::BufferLayout& grad = group.buffer(StoreBuffer::kGrad);
    const memrt::BufferLayout& compute = group.buffer(StoreBuffer::kCompute);
    return grad.dtype != compute.dtype || (!device.is_cpu() && grad.placement != compute.placement);
  }
  bool converts(int g) const { return converts(store_->plan(), g, device_); }

  // What segment `segment`'s backward stages, by cell (the estimate's term).
  memrt::memory::Table staging_bytes(const memrt::StorePlan& plan, int64_t segment,
                                     const c10::Device& device) const {
    memrt::memory::Table t;
    for (int g = 0; g < static_cast<int>(plan.groups().size()); ++g) {
      const int64_t numel = largest_bucket(plan, g, segment);
      if (numel == 0) continue;
      const at::ScalarType compute = plan.groups()[static_cast<size_t>(g)].buffer(StoreBuffer::kCompute).dtype;
      t.at(Category::kCommBuffers) += numel * static_cast<int64_t>(c10::elementSize(compute));
      if (converts(plan, g, device)) {
        const memrt::BufferLayout& grad = plan.groups()[static_cast<size_t>(g)].buffer(StoreBuffer::kGrad);
        t.at(Category::kCommBuffers, grad.placement) += numel * static_cast<int64_t>(c10::elementSize(grad.dtype));
      }
    }
    return t;
  }

  // ---- stage 3 ----------------------------------------------------------------------------------

  // Every group's compute weights partitioned, and every plain frozen weight (a 16-bit base), but
  // for DeepSpeed's persistent parameters: those of at most param_persistence_threshold elements,
  // in model order, each while the sum stays within model_persistence_threshold. Trainable ones
  // move to a group of their own per parent group ("<group>_persistent", its weight decay and
  // learning rate) whose compute copy stays whole; frozen ones stay replicated. A quantized base
  // (plugins/quant's codes and scales) stays replicated: gathering it would move, every segment
  // and micro-step, what it saves at rest (docs/zero.md).
  void plan_stage3(memrt::StorePlan& plan) {
    std::map<int, std::set<std::string>> persistent;  // by parent group
    std::set<int> frozen_whole;
    int64_t kept = 0;
    for (int i = 0; i < static_cast<int>(plan.slots().size()); ++i) {  // model order
      const memrt::ParamSlot& s = plan.slots()[static_cast<size_t>(i)];
      if (s.group < 0 && !plain_frozen(plan, i)) continue;
      // DeepSpeed's mark_persistence: one that would pass the model's cap is skipped, not the rest.
      if (s.numel > opt_.param_persistence_threshold) continue;
      if (s.numel > opt_.model_persistence_threshold - kept) continue;
      kept += s.numel;
      if (s.group >= 0) persistent[s.group].insert(s.param.name);
      else frozen_whole.insert(i);
    }
    for (int i = 0; i < static_cast<int>(plan.slots().size()); ++i) {
      if (plan.slots()[static_cast<size_t>(i)].group >= 0 || !plain_frozen(plan, i) || frozen_whole.count(i)) continue;
      memrt::FrozenLayout layout = plan.frozen_layout(i);
      layout.extent = Extent::kPartition;
      if (opt_.offload_param) layout.placement = Placement::kHost;
      plan.set_frozen_layout(i, std::move(layout));
    }
    std::vector<std::string> whole;
    for (const auto& [g, names] : persistent) {
      const memrt::StoreGroup& parent = plan.groups()[static_cast<size_t>(g)];
      whole.push_back(parent.name + "_persistent");
      plan.add_group({whole.back(), [names = names](const memrt::ParamInfo& p) { return names.count(p.name) > 0; },
                      parent.weight_decay, parent.lr_scale});
    }
    const memrt::GroupSelector partitioned("groups of partitioned compute weights", [whole](const memrt::StoreGroup& g) {
      return std::find(whole.begin(), whole.end(), g.name) == whole.end();
    });
    bool any = false;
    for (const memrt::StoreGroup& g : plan.groups()) any |= partitioned.matches(g);
    if (!any) return;  // every trainable parameter is persistent
    plan.set_extent(StoreBuffer::kCompute, Extent::kPartition, partitioned);
    if (opt_.offload_param) plan.set_placement(StoreBuffer::kCompute, Placement::kHost, partitioned);
  }

  static bool compute_partitioned(const memrt::StorePlan& plan, int g) {
    return plan.groups()[static_cast<size_t>(g)].buffer(StoreBuffer::kCompute).extent == Extent::kPartition;
  }

  // A frozen weight in one floating tensor (a 16-bit base), not a quantized one's codes and scales.
  static bool plain_frozen(const memrt::StorePlan& plan, int slot) {
    const memrt::FrozenLayout& layout = plan.frozen_layout(slot);
    return layout.format.empty() && layout.tensors.size() == 1 && at::isFloatingType(layout.tensors.front().dtype);
  }

  static bool frozen_partitioned(const memrt::StorePlan& plan, int slot) {
    return plan.slots()[static_cast<size_t>(slot)].group < 0 && plan.frozen_layout(slot).extent == Extent::kPartition;
  }

  // What a segment gathers of its own: its elements of every partitioned group and its partitioned
  // frozen weights, in their dtypes on the device (the estimate's term and the prefetch limits'
  // measure; the head's shared tied embedding is its embedding's).
  struct Gathered {
    int64_t elements = 0, bytes = 0;
  };
  static Gathered gathered(const memrt::StorePlan& plan, int64_t segment) {
    Gathered out;
    for (int g = 0; g < static_cast<int>(plan.groups().size()); ++g) {
      if (!compute_partitioned(plan, g)) continue;
      const int64_t n = plan.segment_range(g, segment).size();
      out.elements += n;
      out.bytes += n * static_cast<int64_t>(c10::elementSize(plan.groups()[static_cast<size_t>(g)].buffer(StoreBuffer::kCompute).dtype));
    }
    for (int slot : plan.segment_slots(segment)) {
      if (!frozen_partitioned(plan, slot)) continue;
      const int64_t n = plan.slots()[static_cast<size_t>(slot)].numel;
      out.elements += n;
      out.bytes += n * static_cast<int64_t>(c10::elementSize(plan.frozen_layout(slot).tensors.front().dtype));
    }
    return out;
  }

  // Whether segment `next`'s gather starts while `current` computes (DeepSpeed's limits, in
  // elements): it gathers something, at most prefetch_bucket_size, and both at most
  // max_live_parameters. The same rule in the run and the estimate.
  bool prefetches(const memrt::StorePlan& plan, int64_t current, int64_t next) const {
    const int64_t n = gathered(plan, next).elements;
    return n > 0 && n <= opt_.prefetch_bucket_size && gathered(plan, current).elements + n <= opt_.max_live_parameters;
  }

  // What a segment's forward reads of what ZeRO-3 partitions: one range of one group — its own
  // parameters of the group (StorePlan::segment_range), or a parameter it shares (the head's tied
  // embedding) — or one partitioned frozen weight (group -1, `slot`). Its buffer is kept for the
  // run; between a gather and its release the buffer has storage, otherwise none.
  struct Piece {
    int group = 0;
    memrt::ElementRange range;
    at::Tensor buffer;
    int slot = -1;  // a frozen piece's slot
    std::vector<std::unique_ptr<memrt::Communicator::Pending>> pending;  // its broadcasts in flight
  };

  // The segment's pieces, made on its first gather. The store comes with the segment (ABI 2.15):
  // launcher eval builds no optimizer, so build_optimizer never hands it over there.
  std::vector<Piece>& pieces(const memrt::SegmentContext& ctx) {
    auto [it, added] = pieces_.try_emplace(ctx.index);
    if (!added) return it->second;
    const memrt::StorePlan& plan = ctx.store->plan();
    for (int g = 0; g < static_cast<int>(plan.groups().size()); ++g) {
      const memrt::ElementRange r = plan.segment_range(g, ctx.index);
      if (!r.empty() && compute_partitioned(plan, g)) it->second.push_back({g, r, {}, -1, {}});
    }
    for (int slot : ctx.shared) {
      const int g = plan.slots()[static_cast<size_t>(slot)].group;
      if (g >= 0 && compute_partitioned(plan, g)) it->second.push_back({g, plan.range(slot), {}, -1, {}});
    }
    for (const std::vector<int>* slots : {&ctx.slots, &ctx.shared})
      for (int slot : *slots)
        if (frozen_partitioned(plan, slot)) it->second.push_back({-1, {0, plan.slots()[static_cast<size_t>(slot)].numel}, {}, slot, {}});
    return it->second;
  }

  // The segment's parameters gathered (or, prefetched, their gather finished), then pointed at
  // views of the gathered buffers.
  void gather(const memrt::SegmentContext& ctx) {
    std::vector<Piece>& ps = pieces(ctx);
    if (prefetched_ != ctx.index) start(*ctx.store, ctx.comm, ctx.run.device, ps);
    prefetched_ = kNone;
    const memrt::StorePlan& plan = ctx.store->plan();
    for (Piece& piece : ps) {
      for (auto& p : piece.pending) p->wait();
      piece.pending.clear();
      if (piece.group < 0)
        ctx.store->attach_frozen(piece.slot, piece.buffer.view(plan.slots()[static_cast<size_t>(piece.slot)].param.shape));
      else
        ctx.store->attach(piece.group, piece.range, piece.buffer);
    }
  }

  // Starts gathering segment `next` (its pieces known from an earlier gather, so from the second
  // micro-step on) while the current one computes, within the limits.
  void prefetch(const memrt::SegmentContext& ctx, int64_t next) {
    auto it = pieces_.find(next);
    if (it == pieces_.end() || !prefetches(ctx.store->plan(), ctx.index, next)) return;
    start(*ctx.store, ctx.comm, ctx.run.device, it->second);
    prefetched_ = next;
  }

  // A prefetch no phase took (the embedding's, when no gradient reaches it): completed, freed.
  void drop_prefetch() {
    auto it = pieces_.find(prefetched_);
    prefetched_ = kNone;
    if (it == pieces_.end()) return;
    for (Piece& piece : it->second) {
      for (auto& p : piece.pending) p->wait();
      piece.pending.clear();
      free_storage(piece.buffer);
    }
  }

  // Starts each piece's broadcasts: the ranks whose partitions hold its elements each broadcast
  // their part, in the same order on every rank, into the piece's buffer. A buffer freed by
  // release() gets its storage back in place, so that the views of it autograd saved in the
  // segment's forward (at::linear saves W.t()) read the gathered values in its backward.
  static void start(memrt::ParamStore& store, memrt::Communicator& comm, const c10::Device& device,
                    std::vector<Piece>& ps) {
    const memrt::StorePlan& plan = store.plan();
    const int rank = plan.rank();
    at::NoGradGuard no_grad;
    memrt::memory::Scope scope(Category::kCommBuffers);
    for (Piece& piece : ps) {
      // Where this rank's part rests, and which elements rank r holds.
      const bool frozen = piece.group < 0;
      const at::Tensor& resting = frozen ? store.frozen_tensors(piece.slot).front()
                                         : store.groups()[static_cast<size_t>(piece.group)].compute;
      auto held = [&](int r) {
        return frozen ? plan.frozen_partition(piece.slot, r) : plan.partition(piece.group, r);
      };
      if (!piece.buffer.defined()) {
        piece.buffer = at::empty({piece.range.size()}, resting.options().device(device));
      } else {
        c10::StorageImpl* storage = piece.buffer.storage().unsafeGetStorageImpl();
        const size_t bytes = static_cast<size_t>(piece.range.size()) * piece.buffer.element_size();
        storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
        storage->set_nbytes(bytes);
      }
      for (int r = 0; r < plan.world_size(); ++r) {
        const memrt::ElementRange part = piece.range & held(r);
        if (part.empty()) continue;
        at::Tensor dst = piece.buffer.narrow(0, part.begin - piece.range.begin, part.size());
        if (r == rank) dst.copy_(resting.narrow(0, part.begin - held(rank).begin, part.size()));
        if (plan.world_size() > 1) piece.pending.push_back(comm.broadcast_async(dst, r));
      }
    }
  }

  static void free_storage(at::Tensor& buffer) {
    c10::StorageImpl* storage = buffer.storage().unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, buffer.device()));
    storage->set_nbytes(0);
  }

  // The segment's parameters back to placeholders and its buffers' bytes to the allocator.
  void release(const memrt::SegmentContext& ctx) {
    auto it = pieces_.find(ctx.index);
    if (it == pieces_.end()) return;
    for (Piece& piece : it->second) {
      if (piece.group < 0)
        ctx.store->release_frozen(piece.slot);
      else
        ctx.store->release(piece.group, piece.range);
      free_storage(piece.buffer);
    }
  }

  void hand_over(int slot, at::Tensor& grad) {
    const memrt::ElementRange mine = store_->plan().range(slot);
    at::Tensor flat = grad.reshape({-1});
    at::NoGradGuard no_grad;
    const std::vector<int>& buckets = bucket_of_[static_cast<size_t>(slot)];
    for (size_t i = 0; i < buckets.size(); ++i) {
      Bucket& bucket = buckets_[static_cast<size_t>(buckets[i])];
      open(buckets[i]);
      const memrt::ElementRange part = bucket.range & mine;
      bucket.sum.narrow(0, part.begin - bucket.range.begin, part.size())
          .copy_(flat.narrow(0, part.begin - mine.begin, part.size()));
      // All of the gradient is in buckets now: it goes before any reduction (no rank holds a
      // gradient it does not own).
      if (i + 1 == buckets.size()) {
        flat = at::Tensor();
        grad = at::Tensor();
      }
      // Reduced as soon as it may be, before the parameter's next bucket is opened: a parameter
      // spanning several buckets uses one staging at a time.
      if (--bucket.pending == 0) flush_ready();
    }
  }

  // Bucket b's elements, zeros until gradients arrive: its group's staging when free and of b's
  // segment, else (a gradient out of the usual order) a buffer of its own for as long as it is open.
  void open(int b) {
    Bucket& bucket = buckets_[static_cast<size_t>(b)];
    if (bucket.sum.defined()) return;
    Staging& st = staging_[static_cast<size_t>(bucket.group)];
    if (st.buffer.defined() && st.owner < 0 && st.segment == bucket.segment) {
      st.owner = b;
      bucket.sum = st.buffer.narrow(0, 0, bucket.range.size()).zero_();
      return;
    }
    memrt::memory::Scope scope(Category::kCommBuffers);
    bucket.sum = at::zeros({bucket.range.size()}, store_->groups()[static_cast<size_t>(bucket.group)].compute.options());
  }

  // Reduces, in order, every complete bucket whose predecessors are reduced.
  void flush_ready() {
    while (next_flush_ < buckets_.size() && buckets_[next_flush_].pending == 0) flush(next_flush_++);
  }

  // Sum the bucket over the ranks: each part onto the rank whose partition holds it (DeepSpeed's
  // reduce_scatter: one reduce, two where a partition ends inside the bucket, in rank order on
  // every rank), or with reduce_scatter false in place on every rank; then add the mean of this
  // rank's share into its flat gradient partition (DeepSpeed averages over the data-parallel
  // ranks). Nothing is allocated.
  void flush(size_t b) {
    Bucket& bucket = buckets_[b];
    const memrt::ParamStore::Group& g = store_->groups()[static_cast<size_t>(bucket.group)];
    const memrt::ElementRange partition = store_->plan().partition(bucket.group);
    at::NoGradGuard no_grad;
    open(static_cast<int>(b));
    if (opt_.reduce_scatter) {
      for (int r = 0; r < comm_->world_size(); ++r) {
        const memrt::ElementRange part = bucket.range & store_->plan().partition(bucket.group, r);
        if (part.empty()) continue;
        at::Tensor piece = bucket.sum.narrow(0, part.begin - bucket.range.begin, part.size());
        comm_->reduce_sum(piece, r);
      }
    } else {
      comm_->all_reduce_sum(bucket.sum);
    }
    const memrt::ElementRange share = bucket.range & partition;
    Staging& st = staging_[static_cast<size_t>(bucket.group)];
    if (!share.empty()) {
      at::Tensor src = bucket.sum.narrow(0, share.begin - bucket.range.begin, share.size());
      at::Tensor dst = g.grad.narrow(0, share.begin - partition.begin, share.size());
      if (converts(bucket.group)) {  // to the partition's dtype and place first
        at::Tensor convert;
        if (st.owner == static_cast<int>(b) && st.convert.defined()) {
          convert = st.convert.narrow(0, 0, share.size());
        } else {
          memrt::memory::Scope on(Category::kCommBuffers,
                                  store_->plan().groups()[static_cast<size_t>(bucket.group)].buffer(StoreBuffer::kGrad).placement);
          convert = at::empty({share.size()}, dst.options());
        }
        src = convert.copy_(src);
      }
      dst.add_(src, 1.0 / comm_->world_size());
    }
    if (st.owner == static_cast<int>(b)) st.owner = -1;
    bucket.sum = at::Tensor();
  }

  memrt::zero::Options opt_;
  memrt::ParamStore* store_ = nullptr;
  memrt::Communicator* comm_ = nullptr;
  std::vector<Bucket> buckets_;              // in the order every rank reduces them
  size_t next_flush_ = 0;                    // buckets_[0, next_flush_) reduced this micro-step
  std::vector<std::vector<int>> bucket_of_;  // per slot: the buckets it overlaps
  std::vector<Staging> staging_;             // per group
  std::map<int64_t, std::vector<Piece>> pieces_;  // stage 3: per segment, what it gathers
  static constexpr int64_t kNone = INT64_MIN;
  int64_t prefetched_ = kNone;               // the segment whose gather is in flight
  c10::Device device_{c10::kCPU};            // where the run computes
};

}  // namespace

MEMRT_PLUGIN(ZeroPlugin, "zero", "0.4.0",
             "ZeRO stages 1 to 3 over the parameter store (masters, optimizer state, gradients and "
             "compute weights partitioned), optimizer and parameter offload to host memory")
