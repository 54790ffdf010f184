#include "engine/engine.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "data/dataset.h"
#include "data/progress.h"
#include "engine/preflight.h"
#include "engine/step_profile.h"
#include "dist/process_group.h"
#include "checkpoint/checkpoint_files.h"
#include "memrt/safetensors.h"
#include "memory/estimate.h"
#include "memory/report_html.h"
#include "memory/tracking_allocator.h"
#include "memrt/memory.h"
#include "memrt/ops.h"
#include "models/decoder.h"
#include "models/hf_checkpoint.h"
#include "models/model_factory.h"
#include "optim/grad_clip.h"
#include "optim/lr_schedule.h"
#include "optim/optimizers.h"
#include "store/host_groups.h"

namespace memrt {
namespace {

using Clock = std::chrono::steady_clock;
using memory::Category;

// One phase of the step, named in the step profile (engine/step_profile.h) when one is recording
// (its own time there is the phase's work outside any ATen operator), and added to `*total_ms`
// when given (wall_clock_breakdown); a flag test otherwise.
class PhaseScope {
 public:
  explicit PhaseScope(const char* name, double* total_ms = nullptr)
      : fn_(at::RecordScope::USER_SCOPE), total_ms_(total_ms) {
    if (fn_.isActive()) fn_.before(name);
    if (total_ms_) t0_ = Clock::now();
  }
  ~PhaseScope() { end(); }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;
  void end() {
    fn_.end();
    if (total_ms_) *total_ms_ += std::chrono::duration<double, std::milli>(Clock::now() - t0_).count();
    total_ms_ = nullptr;
  }

 private:
  at::RecordFunction fn_;
  double* total_ms_;
  Clock::time_point t0_;
};

std::string mib(int64_t bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << static_cast<double>(bytes) / (1024.0 * 1024.0)
     << " MiB";
  return os.str();
}

// The SDK's gradient hooks (plugin.h): the callbacks of every slot, run from one LibTorch
// post-accumulate-grad hook per parameter (LibTorch keeps one per tensor).
class GradHookTable final : public GradHooks {
 public:
  explicit GradHookTable(const ParamStore& store) : store_(store) {
    for (size_t i = 0; i < store.plan().slots().size(); ++i) callbacks_.push_back(std::make_shared<Callbacks>());
  }

  void on_grad_ready(int slot, GradReadyFn fn) override {
    if (slot < 0 || slot >= static_cast<int>(callbacks_.size()) ||
        store_.plan().slots()[static_cast<size_t>(slot)].group < 0) {
      throw Error("GradHooks::on_grad_ready: slot " + std::to_string(slot) +
                  " is not a trainable parameter's slot in the store");
    }
    callbacks_[static_cast<size_t>(slot)]->push_back(std::move(fn));
  }

  // After every build_optimizer: one hook on each parameter that has callbacks.
  void install() {
    for (size_t slot = 0; slot < callbacks_.size(); ++slot) {
      if (callbacks_[slot]->empty()) continue;
      torch::autograd::impl::set_post_acc_grad_hooks(store_.param(static_cast<int>(slot)),
                                                     std::make_unique<Hook>(callbacks_[slot]));
    }
  }

 private:
  using Callbacks = std::vector<GradReadyFn>;
  struct Hook final : torch::autograd::PostAccumulateGradHook {
    explicit Hook(std::shared_ptr<Callbacks> fns) : fns(std::move(fns)) {}
    void operator()(const torch::autograd::Variable& param) override {
      at::Tensor& grad = const_cast<at::Tensor&>(param).mutable_grad();
      for (const GradReadyFn& fn : *fns) {
        if (!grad.defined()) return;
        fn(grad);
      }
    }
    std::shared_ptr<Callbacks> fns;
  };

  const ParamStore& store_;
  std::vector<std::shared_ptr<Callbacks>> callbacks_;
};

// Whether group g's gradient is a flat buffer of full extent (fp32 accumulation of 16-bit
// gradients below ZeRO stage 2): the host fills it from its gradient hook and all-reduces it.
bool host_fills_flat_grad(const ParamStore& store, int g) {
  return store.plan().flat_grad(g) &&
         store.plan().groups()[static_cast<size_t>(g)].buffer(StoreBuffer::kGrad).extent == Extent::kFull;
}

std::vector<at::Tensor> full_flat_grads(const ParamStore& store) {
  std::vector<at::Tensor> out;
  for (int g = 0; g < static_cast<int>(store.groups().size()); ++g)
    if (host_fills_flat_grad(store, g)) out.push_back(store.groups()[static_cast<size_t>(g)].grad);
  return out;
}

std::string thousands(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// PEFT's print_trainable_parameters line, counted as PEFT counts: every parameter once, one that a
// plugin replaced by another format (a 4-bit weight's codes) by the elements it stands for.
std::string trainable_parameters_line(const std::vector<ParamInfo>& planned, const ModelShape& shape) {
  std::unordered_map<std::string, int64_t> logical;
  for (const auto& [name, dims] : model_parameter_shapes(shape))
    logical[name] = c10::multiply_integers(dims);
  int64_t trainable = 0, all = 0;
  for (const ParamInfo& p : planned) {
    auto it = logical.find(p.name);
    const int64_t n = at::isFloatingType(p.dtype) || it == logical.end() ? c10::multiply_integers(p.shape) : it->second;
    all += n;
    if (p.trainable) trainable += n;
  }
  std::ostringstream os;
  os << "trainable params: " << thousands(trainable) << " || all params: " << thousands(all)
     << " || trainable%: " << std::fixed << std::setprecision(4) << 100.0 * static_cast<double>(trainable) / static_cast<double>(std::max<int64_t>(1, all));
  return os.str();
}

}  // namespace

Engine::Engine(TrainConfig cfg, std::shared_ptr<DistContext> dist, PluginHost plugins,
               std::ostream& log)
    : cfg_(std::move(cfg)),
      dist_(dist ? std::move(dist) : DistContext::create(DistEnvironment{}, std::chrono::seconds(60))),
      plugins_(std::move(plugins)),
      log_(log) {
  memory::install_tracking_allocator();  // the launcher did already; tests may not have
}

Engine::~Engine() = default;

// ---- set-up: configure, build, transform, optimizer ---------------------------------------------
RunInfo make_run_info(const TrainConfig& cfg, int rank, int world_size, int local_rank) {
  RunInfo run;
  run.rank = rank;
  run.world_size = world_size;
  run.local_rank = local_rank;
  run.train_batch_size = cfg.train_batch_size;
  run.micro_batch_size = cfg.micro_batch_size;
  run.grad_accum_steps = cfg.grad_accum_steps;
  run.block_size = cfg.data.block_size;
  run.max_steps = cfg.max_steps;  // -1 until the engine knows the dataset's size
  // A Hugging Face checkpoint directory brings its own shape (config.json).
  run.shape = cfg.model.name_or_path.empty() ? cfg.model.shape : read_hf_config(cfg.model.name_or_path);
  run.output_dir = cfg.output_dir;
  run.model_name_or_path = cfg.model.name_or_path;
  run.zero_stage = cfg.zero_stage;
  run.chunked_cross_entropy = cfg.chunked_cross_entropy;
  run.sample_packing = cfg.data.pack && TokenDataset::yields_samples(cfg.data);  // as the DataLoader packs
  return run;
}

EstimateReport estimate_memory(const TrainConfig& cfg, const RunInfo& run, PluginHost& plugins) {
  HostPlanOptions options;
  options.store = store_options(cfg.optimizer);
  options.optimizer = cfg.optimizer;
  std::vector<ParamInfo> params = shape_params(run.shape, cfg.optimizer.from_ds_config);
  std::optional<std::set<std::string>> frozen_reads = plugins.plan_params(params, run);
  memory::MemoryEstimate plan = host_memory_plan(run, options, params);
  EstimateReport report;
  report.terms.push_back({"memrt", plan.table});
  for (memory::EstimateTerm& t : plugins.estimate_memory(plan)) report.terms.push_back(std::move(t));
  report.table = plan.table;
  report.params = std::move(params);
  report.store = plan.store;
  report.frozen_reads = std::move(frozen_reads);
  return report;
}

std::optional<ElementRange> held_elements(const StorePlan& plan, const std::optional<std::set<std::string>>& frozen_reads,
                                          const std::string& name) {
  const int64_t slot = plan.find(name);
  if (slot < 0) return std::nullopt;
  const int g = plan.slots()[static_cast<size_t>(slot)].group;
  if (g < 0) {  // frozen: unless a plugin reads it whole as its block is built
    if (plan.frozen_layout(static_cast<int>(slot)).extent != Extent::kPartition || !frozen_reads ||
        frozen_reads->count(name))
      return std::nullopt;
    return plan.frozen_partition(static_cast<int>(slot));
  }
  const StoreGroup& group = plan.groups()[static_cast<size_t>(g)];
  const BufferLayout& master = group.buffer(StoreBuffer::kMaster);
  if (group.buffer(StoreBuffer::kCompute).extent != Extent::kPartition ||
      (master.present && master.extent != Extent::kPartition))
    return std::nullopt;
  const ElementRange whole = plan.range(static_cast<int>(slot)), kept = whole & plan.partition(g);
  if (kept.empty()) return ElementRange{};
  return ElementRange{kept.begin - whole.begin, kept.end - whole.begin};
}

void Engine::setup() {
  run_ = make_run_info(cfg_, dist_->rank(), dist_->world_size(), dist_->local_rank());
  const bool main = run_.rank == 0;
  memory_.begin_setup();

  // Memory: each phase's allocations default to its category (memory.h) in a block that closes
  // where the category ends — the data in `other`, the model's build and transforms in `weights`,
  // the optimizer (the host's and the plugins' build_optimizer) in `optimizer_state`. Between and
  // after the blocks no scope is open: what a plugin allocates there without claiming it is
  // `unattributed`, and set-up's bookkeeping after the optimizer is not counted as its state.

  // data
  std::shared_ptr<TokenDataset> data;
  {
    memory::Scope data_scope(Category::kOther);
    // With a tokenizer, rank 0 tokenizes first and caches the tokens; the other ranks then map them.
    DataConfig eval = cfg_.data;
    eval.train_files = eval.eval_files;
    eval.datasets = eval.eval_datasets;
    const std::string eval_name = cfg_.data.held_out.tool != HeldOut::Tool::kNone ? cfg_.data.held_out.key
                                  : !eval.datasets.empty()                         ? eval.datasets.front().path
                                  : !eval.eval_files.empty()                       ? eval.eval_files.front()
                                                                                   : std::string();
    std::shared_ptr<TokenDataset> opened;
    auto open = [&] {
      data = TokenDataset::open(cfg_.data);
      if (!eval_name.empty()) opened = TokenDataset::open(eval);
      if (cfg_.data.held_out.tool != HeldOut::Tool::kNone) {  // val_set_size, val_size
        TokenDataset::Split split = TokenDataset::hold_out(*data, cfg_.data.held_out, cfg_.seed);
        data = std::move(split.train);
        opened = std::move(split.eval);
      }
    };
    if (main) open();
    if (!cfg_.data.tokenizer.empty() && run_.world_size > 1) dist_->barrier();
    if (!main) {
      open();
      // Another host's rank, or rank 0 unable to write the cache, tokenizes again: the same
      // tokens, the time spent once more.
      if (data->tokenized() || (opened && opened->tokenized()))
        log_ << "note: this rank tokenized its data itself (rank 0's cache entry was not there to map: "
             << (data->tokenized() ? data->description() : opened->description()) << ")\n";
    }
    if (data->vocab_size() > run_.shape.vocab_size) {
      throw ConfigError(cfg_.train_yaml_path, "model.vocab_size",
                        "the data has token ids up to " + std::to_string(data->vocab_size() - 1) +
                            " but the model's vocab_size is " +
                            std::to_string(run_.shape.vocab_size) +
                            "; raise model.vocab_size to at least " +
                            std::to_string(data->vocab_size()));
    }
    loader_ = std::make_unique<DataLoader>(data, cfg_.data.block_size, cfg_.micro_batch_size,
                                           cfg_.grad_accum_steps, run_.rank, run_.world_size,
                                           cfg_.seed, cfg_.data.pad_to_block, cfg_.data.pack);
    if (opened) {
      if (opened->vocab_size() > run_.shape.vocab_size) {
        throw FileError(eval_name, "has token ids up to " + std::to_string(opened->vocab_size() - 1) +
                                            " but the model's vocab_size is " + std::to_string(run_.shape.vocab_size));
      }
      if (eval_windows(*opened, cfg_.data.block_size) == 0) {
        throw FileError(eval_name, "holds " + std::to_string(opened->num_tokens()) +
                                            " tokens, fewer than one evaluation window of block_size " +
                                            std::to_string(cfg_.data.block_size) + " tokens");
      }
      eval_data_ = std::move(opened);
    }
  }
  run_.max_steps = cfg_.max_steps > 0
                       ? cfg_.max_steps
                       : static_cast<int64_t>(std::ceil(cfg_.num_train_epochs *
                                                        static_cast<double>(loader_->steps_per_epoch())));

  // configure: each plugin gets only its own subtree.
  ConfigDiagnostics diag;
  plugins_.configure(run_, diag);
  estimate_ = estimate_memory(cfg_, run_, plugins_);
  if (main) {
    for (const std::string& w : cfg_.warnings) log_ << "warning: " << w << "\n";
    for (const std::string& w : diag.warnings) log_ << "warning: " << w << "\n";
    log_ << ops::describe_cpu_math() << "\nthreads: " << at::get_num_threads() << " per rank\n" << plugins_.describe();
  }

  // Before a byte of the store or the model: will it fit? (docs/preflight.md) What this process
  // holds now is the baseline of the resident check at each step's end.
  const int64_t resident = current_rss_bytes();
  memory_.expect_resident(resident, host_growth(estimate_.table, run_.device));
  if (cfg_.preflight) {
    const std::string fits = preflight(estimate_.table, resident, cfg_, run_.device, *dist_);
    if (main) log_ << fits << "\n";
  }

  // The parameter store first: the estimate's plan, laid out on the model's shapes by every
  // plugin (plan_params, plan_store), so the run holds exactly what the estimate counted; every
  // buffer but the optimizer state is allocated before the model exists.
  std::vector<ParamInfo> planned = estimate_.params;
  {
    StorePlan plan = *estimate_.store;
    if (plan.groups().empty()) {
      throw Error("the model has no trainable parameters after the plugins' model transforms; "
                  "nothing to train");
    }
    if (eval_only_) plan.keep_weights_only();  // launcher eval takes no step: no masters, gradients or state
    plan.check();
    if (main) log_ << "parameter store:\n" << plan.describe();
    store_ = std::make_shared<ParamStore>(std::move(plan), run_.device);
  }

  // The model, materialised segment by segment: each block handed to the plugins as it appears
  // (on_block_ready: a 4-bit base quantized), then every segment taken into the store before the
  // next one exists — a trainable parameter becomes a view of its group's buffer, or under ZeRO-3
  // an empty placeholder, and its whole tensor goes: no rank ever holds the whole model.
  {
    memory::Scope weights_scope(Category::kWeights);
    BuildOptions build;
    build.init_std = cfg_.model.init_std;
    build.seed = cfg_.seed;
    build.weights_dir = cfg_.model.name_or_path;
    for (const ParamInfo& p : planned)
      if (!at::isFloatingType(p.dtype)) build.replaced.insert(p.name);
    // Frozen weights the store keeps in another floating dtype (a 16-bit base) take it as each
    // segment is built.
    const StorePlan& plan = store_->plan();
    for (int i = 0; i < static_cast<int>(plan.slots().size()); ++i) {
      const ParamSlot& s = plan.slots()[static_cast<size_t>(i)];
      if (s.group >= 0 || !at::isFloatingType(s.param.dtype)) continue;
      const FrozenLayout& layout = plan.frozen_layout(i);
      if (layout.format.empty() && layout.tensors.front().dtype != at::kFloat)  // build_model makes fp32
        build.frozen_dtypes[s.param.name] = layout.tensors.front().dtype;
    }
    build.on_block_ready = [&](int64_t index, Block& block, const CheckpointReader* checkpoint) {
      BlockReady ctx{index, block, run_, *dist_, checkpoint};
      plugins_.each("on_block_ready", -1, [&](Plugin& p) { p.on_block_ready(ctx); });
    };
    // From a checkpoint, a weight the store partitions (ZeRO-3) is read for the elements this
    // rank keeps alone. Every rank decides alike which parameters these are; their ranges differ.
    if (!build.weights_dir.empty()) {
      build.held = [&plan, this](const std::string& name) {
        return held_elements(plan, estimate_.frozen_reads, name);
      };
    }
    // Every rank starts from rank 0's weights (the same seed gives the same init; a loaded
    // checkpoint is the same file; this makes it so whatever a plugin did), but for the slices
    // each rank read for itself; each parameter trains as planned.
    std::set<std::string> taken_params, taken_buffers;
    auto take = [&](const NamedTensors& params, const NamedTensors& buffers, bool built) {
      at::NoGradGuard no_grad;
      for (const auto& [name, t] : params) {
        at::Tensor p = t;
        if (!(built && build.held && build.held(name))) dist_->broadcast(p, 0);
        const int64_t slot = plan.find(name);
        if (slot >= 0) p.set_requires_grad(plan.slots()[static_cast<size_t>(slot)].group >= 0);
        taken_params.insert(name);
      }
      for (const auto& [name, t] : buffers) taken_buffers.insert(name);
      store_->adopt(params, buffers);
    };
    build.on_segment_built = [&](int64_t, const NamedTensors& params, const NamedTensors& buffers) {
      take(params, buffers, /*built=*/true);
    };
    model_ = build_model(run_.shape, build);
    // The default generator feeds dropout: seeded like Hugging Face's set_seed (the same seed on
    // every rank), so a config's run is reproducible. Model init has its own generator.
    at::manual_seed(cfg_.seed);
    // transform_model adds what plan_params planned besides the model (LoRA's adapters): taken in
    // with the module buffers no segment had.
    ModelContext model_ctx{*model_, run_, *dist_};
    plugins_.each("transform_model", -1, [&](Plugin& p) { p.transform_model(model_ctx); });
    NamedTensors added, rest;
    for (const auto& item : model_->named_parameters(/*recurse=*/true))
      if (!taken_params.count(item.key())) added.emplace_back(item.key(), item.value());
    for (const auto& item : model_->named_buffers(/*recurse=*/true))
      if (!taken_buffers.count(item.key())) rest.emplace_back(item.key(), item.value());
    try {
      take(added, rest, /*built=*/false);
      store_->finish();
    } catch (const Error& e) {
      throw Error(std::string(e.what()) + ": a plugin's transform_model must create exactly what its "
                  "plan_params planned (memrt/plugin.h, ParamPlanContext)");
    }
  }
  int64_t model_parameters = 0;
  for (const ParamInfo& p : planned) model_parameters += c10::multiply_integers(p.shape);
  for (size_t i = 0; i < store_->plan().slots().size(); ++i)
    if (store_->plan().slots()[i].group >= 0) trainable_.push_back(store_->param(static_cast<int>(i)));
  if (trainable_.size() < store_->plan().slots().size() && !cfg_.model.name_or_path.empty())
    base_ = BaseSource::of(cfg_.model.name_or_path);
  // The optimizer over the store, and the hooks that hand it gradients: none for launcher eval.
  if (!eval_only_) {
    memory::Scope optimizer_scope(Category::kOptimizerState);
    auto kernels = std::make_shared<StepKernelTable>();
    optimizer_ = make_optimizer(cfg_.optimizer, store_, kernels);
    const Optimizer* built = optimizer_.get();
    // A flat gradient of full extent (another dtype than the compute one: fp32 accumulation) takes
    // each parameter's gradient as autograd hands it over; the host's callback runs first.
    GradHookTable hooks(*store_);
    for (size_t i = 0; i < store_->plan().slots().size(); ++i) {
      const int slot = static_cast<int>(i);
      const int g = store_->plan().slots()[i].group;
      if (g < 0 || !host_fills_flat_grad(*store_, g)) continue;
      hooks.on_grad_ready(slot, [store = store_, slot](at::Tensor& grad) {
        at::NoGradGuard no_grad;
        store->slice(slot, StoreBuffer::kGrad).first.add_(grad.reshape({-1}));
        grad = at::Tensor();
      });
    }
    OptimizerContext opt_ctx{*model_, *store_, optimizer_, run_, *dist_, hooks, *kernels};
    plugins_.each("build_optimizer", -1, [&](Plugin& p) { p.build_optimizer(opt_ctx); });
    if (!optimizer_) throw Error("a plugin's build_optimizer left no optimizer");
    if (optimizer_.get() == built) check_step_formats(store_->plan(), cfg_.optimizer.type, kernels.get());
    hooks.install();
  }

  // Gradients are counted as gradients from the moment autograd hands them over, before they are
  // accumulated: at any instant, mid-backward too, the gradients cell holds exactly what is alive.
  for (at::Tensor& p : trainable_) {
    p.register_hook([](const at::Tensor& grad) { memory::claim(grad, Category::kGradients); });
  }

  // Horizons left open by the config (training length from epochs, warmup_ratio) are known now.
  SchedulerConfig sched = cfg_.scheduler;
  if (sched.total_num_steps < 0) sched.total_num_steps = run_.max_steps;
  if (sched.warmup_num_steps < 0) {
    sched.warmup_num_steps =
        static_cast<int64_t>(std::ceil(sched.warmup_ratio * static_cast<double>(run_.max_steps)));
  }
  schedule_ = make_lr_schedule(sched, cfg_.optimizer.lr, run_.max_steps);

  // Segments in forward order, each with the parameters its forward reads.
  auto tensors = [](const NamedTensors& named) {
    std::vector<at::Tensor> out;
    for (const auto& [name, t] : named) out.push_back(t);
    return out;
  };
  segments_.clear();
  segments_.push_back({SegmentKind::kEmbedding, -1, nullptr, tensors(model_->embedding_parameters()), {}, {}});
  for (int64_t i = 0; i < model_->num_blocks(); ++i)
    segments_.push_back({SegmentKind::kBlock, i, &model_->block(i), model_->block(i).parameters(), {}, {}});
  std::vector<at::Tensor> head = tensors(model_->final_parameters());
  if (run_.shape.tie_embeddings) head.push_back(segments_.front().params.front());  // token embedding
  segments_.push_back({SegmentKind::kHead, model_->num_blocks(), nullptr, std::move(head), {}, {}});
  assign_segment_slots();

  if (main) {
    std::filesystem::create_directories(cfg_.output_dir);
    if (!eval_only_) {
      metrics_path_ = (std::filesystem::path(cfg_.output_dir) / "metrics.jsonl").string();
      if (!resume_) std::ofstream(metrics_path_, std::ios::trunc);  // a resumed run keeps its history
    }
    log_ << "model: " << run_.shape.arch << ", " << model_parameters << " parameters ("
         << trainable_.size() << " trainable tensors)\n"
         << trainable_parameters_line(planned, run_.shape) << "\n"
         << "data: " << data->description() << ", " << loader_->samples()
         << (loader_->packing_efficiency() > 0
                 ? " rows of " + std::to_string(cfg_.data.block_size) + " tokens packed " +
                       std::to_string(static_cast<int>(std::lround(100 * loader_->packing_efficiency()))) + "% full, "
                 : std::string(" samples, "))
         << loader_->steps_per_epoch() << " steps per epoch\n"
         << "batch: train_batch_size " << cfg_.train_batch_size << " = micro "
         << cfg_.micro_batch_size << " x accumulation " << cfg_.grad_accum_steps << " x ranks "
         << run_.world_size << "; " << run_.max_steps << " steps\n";
    if (cfg_.chunked_cross_entropy) {
      const int64_t tokens = cfg_.micro_batch_size * cfg_.data.block_size;
      log_ << "head: chunked_cross_entropy, the loss " << ops::linear_cross_entropy_chunk_rows(tokens, run_.shape.vocab_size)
           << " tokens at a time (of " << tokens << " a micro-batch); the logits are never whole\n";
    }
  }
}

// Each segment's store slots: those of its parameters the plan places in it (by name, as the
// estimate did: memory::param_segment) and those it reads from another (the head's tied embedding).
// A parameter the model keeps in one segment and the plan in another would be gathered or stepped
// with the wrong segment: an error naming it.
void Engine::assign_segment_slots() {
  const StorePlan& plan = store_->plan();
  std::unordered_map<const c10::TensorImpl*, int> slot_of;
  for (int i = 0; i < static_cast<int>(plan.slots().size()); ++i)
    slot_of[store_->param(i).unsafeGetTensorImpl()] = i;
  auto where = [&](int64_t index) {
    return index < 0 ? std::string("the embedding")
                     : index == model_->num_blocks() ? std::string("the head") : "block " + std::to_string(index);
  };
  for (Segment& seg : segments_) {
    for (const at::Tensor& p : seg.params) {
      auto it = slot_of.find(p.unsafeGetTensorImpl());
      if (it == slot_of.end()) throw Error("segment " + where(seg.index) + " reads a parameter that is not in the parameter store");
      (plan.segment(it->second) == seg.index ? seg.slots : seg.shared).push_back(it->second);
    }
    // What the model computes here is a subset of what the plan places here; equal, or an error.
    std::sort(seg.slots.begin(), seg.slots.end());
    for (int slot : plan.segment_slots(seg.index)) {
      if (std::binary_search(seg.slots.begin(), seg.slots.end(), slot)) continue;
      throw Error("parameter '" + plan.slots()[static_cast<size_t>(slot)].param.name + "' is named as a "
                  "parameter of " + where(seg.index) + " (memory::param_segment) but the model does not "
                  "compute it there; a plugin that adds parameters names them after the module they sit in");
    }
    seg.slots = plan.segment_slots(seg.index);  // the same slots, in layout order
  }
}

// ---- one segment: before/after hooks, wrapper chain ---------------------------------------------
at::Tensor Engine::run_segment(const Segment& segment, const at::Tensor& x, SegmentFn body,
                               int64_t micro) {
  // The chain may run again after this function returns (a recompute in backward calls `next`
  // from its autograd node), so every link owns the context it passes on.
  auto shared = std::make_shared<SegmentContext>(SegmentContext{segment.kind, segment.index, segment.block,
                                                                segment.params, step_, micro, run_, *dist_,
                                                                segment.slots, segment.shared, store_.get()});
  SegmentContext& ctx = *shared;
  plugins_.each("before_segment_forward", step_, [&](Plugin& p) { p.before_segment_forward(ctx); });
  SegmentFn fn = std::move(body);
  const auto& ps = plugins_.plugins();
  for (auto it = ps.rbegin(); it != ps.rend(); ++it) {  // lowest priority ends up outermost
    Plugin* p = it->plugin.get();
    if (!p->wraps_segments()) continue;
    fn = [p, shared, inner = std::move(fn)](const at::Tensor& in) { return p->run_segment(*shared, in, inner); };
  }
  at::Tensor out = fn(x);
  plugins_.each_reversed("after_segment_forward", step_, [&](Plugin& p) { p.after_segment_forward(ctx); });
  return out;
}

void Engine::advance_backward_events(int64_t upto, int64_t micro) {
  const int64_t n = static_cast<int64_t>(segments_.size());
  for (; backward_events_fired_ < upto && backward_events_fired_ < 2 * n; ++backward_events_fired_) {
    const Segment& s = segments_[n - 1 - backward_events_fired_ / 2];
    SegmentContext ctx{s.kind, s.index, s.block, s.params, step_, micro, run_, *dist_, s.slots, s.shared, store_.get()};
    if (backward_events_fired_ % 2 == 0) {
      plugins_.each("before_segment_backward", step_, [&](Plugin& p) { p.before_segment_backward(ctx); });
    } else {
      plugins_.each_reversed("after_segment_backward", step_, [&](Plugin& p) { p.after_segment_backward(ctx); });
    }
  }
}

// ---- the forward: every segment through its phases --------------------------------------------------
at::Tensor Engine::forward_loss(const at::Tensor& tokens, const at::Tensor& targets, int64_t micro,
                                const std::function<void(at::Tensor&, int64_t)>& boundary) {
  auto mark = [&](at::Tensor& out, int64_t segment) {
    if (boundary) boundary(out, segment);
  };
  at::Tensor h = run_segment(segments_.front(), tokens,
                             [this](const at::Tensor& t) { return model_->embed(t); }, micro);
  mark(h, 0);
  for (int64_t i = 0; i < model_->num_blocks(); ++i) {
    Block* block = segments_[i + 1].block;
    h = run_segment(segments_[i + 1], h, [block](const at::Tensor& t) { return block->forward(t); },
                    micro);
    mark(h, i + 1);
  }
  const int64_t head = static_cast<int64_t>(segments_.size()) - 1;
  if (cfg_.chunked_cross_entropy) {  // the head segment computes the loss; no logits outlive a chunk
    DecoderLM* model = decoder_for("chunked_cross_entropy");
    at::Tensor loss = run_segment(
        segments_.back(), h,
        [model, targets](const at::Tensor& t) {
          const at::Tensor x = model->final_norm(t);
          return ops::linear_cross_entropy_sum(x.reshape({-1, x.size(-1)}), model->head_weight(),
                                               targets.reshape({-1}));
        },
        micro);
    mark(loss, head);
    return loss;
  }
  at::Tensor logits = run_segment(segments_.back(), h,
                                  [this](const at::Tensor& t) { return model_->head(t); }, micro);
  mark(logits, head);
  // Autograd keeps what backward needs (log_softmax keeps its output); the logits themselves are
  // freed on return.
  return causal_lm_loss_sum(logits, targets);
}

DecoderLM* Engine::decoder_for(const char* feature) {
  auto* model = dynamic_cast<DecoderLM*>(model_.get());
  if (!model) throw Error(std::string(feature) + " needs one of memrt's built-in models");
  return model;
}

// ---- one micro-step: forward, loss, backward ------------------------------------------------------
double Engine::micro_step(int64_t micro) {
  Batch batch = [&] {
    PhaseScope phase("memrt::data", wall_ms(&WallClock::data));
    memory::Scope scope(Category::kOther);
    return loader_->get(step_, micro);
  }();
  // Packed rows: the model keeps attention and positions inside each sample for this micro-step
  // (its backward, and the recomputes of activation checkpointing in it, included).
  struct PackedLayout {
    DecoderLM* model = nullptr;
    ~PackedLayout() {
      if (model) model->set_layout({});
    }
  } packed;
  if (batch.positions.defined()) {
    packed.model = decoder_for("sample_packing");
    packed.model->set_layout(batch.positions);
  }
  memory::Scope scope(Category::kActivations);
  PhaseScope forward("memrt::forward", wall_ms(&WallClock::forward));
  MicroStepContext mctx{*model_, run_, *dist_, step_, micro, batch.inputs, batch.targets, {}, control_};
  plugins_.each("before_forward", step_, [&](Plugin& p) { p.before_forward(mctx); });

  // When the gradient reaches a segment's output, that segment's backward is about to run
  // (before_segment_backward) and the one after it has finished (after_segment_backward).
  // Segment k (0 = embedding) is event pair (S-1-k); its output's hook fires up to its "before".
  const int64_t n = static_cast<int64_t>(segments_.size());
  backward_events_fired_ = 0;
  auto boundary = [&](at::Tensor& h, int64_t segment) {
    if (!h.requires_grad()) return;
    const int64_t upto = 2 * (n - 1 - segment) + 1;
    h.register_hook([this, upto, micro](const at::Tensor& grad) {
      try {
        advance_backward_events(upto, micro);
      } catch (...) {
        hook_error_ = std::current_exception();
        throw;
      }
      return grad;
    });
  };

  // The step's loss is the mean over every prediction it trains on, on all ranks and micro-batches
  // (transformers' num_items_in_batch): each micro-batch adds its sum over that count. Ranks' gradients
  // are averaged, hence the world size. A stream's micro-batches are equal, so this is DeepSpeed's
  // mean divided by the accumulation steps.
  step_tokens_ += batch.tokens;
  const double labels = static_cast<double>(std::max<int64_t>(1, loader_->step_labels(step_)));
  at::Tensor loss = forward_loss(batch.inputs, batch.targets, micro, boundary) * (run_.world_size / labels);
  mctx.loss = loss;
  plugins_.each_reversed("after_forward", step_, [&](Plugin& p) { p.after_forward(mctx); });
  forward.end();

  PhaseScope backward("memrt::backward", wall_ms(&WallClock::backward));
  at::Tensor to_backprop = loss;
  BackwardContext bctx{run_, step_, micro, to_backprop};
  plugins_.each("before_backward", step_, [&](Plugin& p) { p.before_backward(bctx); });
  memory_.begin_backward();
  hook_error_ = nullptr;
  try {
    to_backprop.backward();
  } catch (...) {
    if (hook_error_) std::rethrow_exception(hook_error_);
    throw;
  }
  advance_backward_events(2 * n, micro);  // segments whose inputs needed no gradient
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : trainable_) grads.push_back(p.grad());
  memory_.add_late_gradient_claims(memory::claim_all(grads, Category::kGradients));
  plugins_.each_reversed("after_backward", step_, [&](Plugin& p) { p.after_backward(mctx); });
  return loss.item<double>();
}

// ---- one optimizer step ---------------------------------------------------------------------------
void Engine::train_step(TrainSummary& summary) {
  const auto t0 = Clock::now();
  memory_.begin_step();
  control_.skip_step = false;
  control_.skip_reason.clear();

  double loss_sum = 0.0;
  step_tokens_ = 0;
  for (int64_t micro = 0; micro < cfg_.grad_accum_steps; ++micro) loss_sum += micro_step(micro);

  std::vector<at::Tensor> grads;
  auto take_grads = [&] {  // every trainable parameter's .grad as it is now
    grads.clear();
    for (const at::Tensor& p : trainable_) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
  };
  take_grads();
  const double lr = schedule_->lr(completed_steps_);
  StepContext sctx{*model_, *optimizer_, run_, *dist_, step_, lr, control_, false, grads};
  plugins_.each("after_gradient_accumulation", step_,
                [&](Plugin& p) { p.after_gradient_accumulation(sctx); });
  if (!plugins_.any_reduces_gradients()) {
    {
      PhaseScope phase("memrt::gradient_reduce", wall_ms(&WallClock::gradient_reduce));
      memory::Scope scope(Category::kCommBuffers);
      const std::vector<at::Tensor> flat = full_flat_grads(*store_);
      if (flat.empty()) {
        dist_->all_reduce_gradients(trainable_, GradReduceOptions());
      } else {  // every trainable parameter's gradient is in them
        dist_->all_reduce_tensors(flat, GradReduceOptions());
      }
    }
    // The all-reduce may have replaced a gradient (a non-contiguous one by a contiguous copy), as
    // may a plugin's after_gradient_accumulation: the host measures and clips the gradients the
    // optimizer will read, so the list is taken again now.
    take_grads();
  }
  // Pass 1 of the step: the norm and the overflow check read the gradients once.
  {
    PhaseScope phase("memrt::grad_norm", wall_ms(&WallClock::optimizer_step));
    GradSummary pass1 = optimizer_->grad_summary();
    if (optimizer_->grads_partitioned()) {
      at::Tensor ss = at::tensor({pass1.sum_squares}, at::kDouble);
      dist_->all_reduce_sum(ss);  // squares are >= 0: an inf or NaN on any rank makes the sum one
      pass1.sum_squares = ss.item<double>();
    }
    sctx.grads_finite = pass1.finite && std::isfinite(pass1.sum_squares);
    sctx.grad_norm = std::sqrt(pass1.sum_squares) / sctx.grad_scale;
  }
  plugins_.each("before_optimizer_step", step_, [&](Plugin& p) { p.before_optimizer_step(sctx); });

  // The vote: skip requests, stop requests (a plugin's Control::stop_training, a stop signal) and
  // the loss are agreed across ranks here, once per step; any rank's request counts for all. The
  // loop stops on the agreed values only, so every rank stops after the same step, one rank or
  // many. A stop_training set after this point counts in the next step's vote (plugin.h, Control).
  at::Tensor agree = at::tensor({control_.skip_step ? 1.0 : 0.0, control_.stop_training ? 1.0 : 0.0,
                                 static_cast<double>(stop_signal_received()), loss_sum},
                                at::kDouble);  // (4,): three votes, the loss
  at::Tensor votes = agree.slice(0, 0, 3);
  dist_->all_reduce_max(votes);
  at::Tensor loss_t = agree.slice(0, 3, 4);
  dist_->all_reduce_sum(loss_t);
  const bool skip = agree[0].item<double>() > 0.0;
  stop_training_agreed_ = agree[1].item<double>() > 0.0;
  stop_signal_agreed_ = agree[2].item<double>() > 0.0;
  const double loss = agree[3].item<double>() / run_.world_size;

  const double grad_norm = sctx.grad_norm;
  if (!skip) {
    // Pass 2: unscale and clip as one factor of the fused step (DeepSpeed's combined scale).
    StepScalars scalars;
    scalars.lr = lr;
    scalars.grad_factor = 1.0 / (sctx.grad_scale * clip_divisor(grad_norm, cfg_.gradient_clipping));
    memory::Scope scope(Category::kOptimizerState);
    PhaseScope phase("memrt::optimizer_step", wall_ms(&WallClock::optimizer_step));
    optimizer_->step(scalars);
    ++completed_steps_;
  } else {
    ++skipped_steps_;
    if (run_.rank == 0) {
      log_ << "step " << step_ + 1 << ": update skipped"
           << (control_.skip_reason.empty() ? "" : " (" + control_.skip_reason + ")") << "\n";
    }
  }
  sctx.skipped = skip;
  plugins_.each_reversed("after_optimizer_step", step_, [&](Plugin& p) { p.after_optimizer_step(sctx); });
  optimizer_->zero_grad();
  for (ParamStore::Group& g : store_->groups())  // flat gradients: the next step adds from zero
    if (g.grad.defined()) g.grad.zero_();
  ++step_;
  grads.clear();
  for (const LeakFinding& leak : memory_.end_step(step_)) {
    if (run_.rank == 0) log_ << "warning: " << leak.message() << "\n";
  }
  if (const std::optional<ResidentGrowth> g = memory_.check_resident(); g && run_.rank == 0)
    log_ << "warning: " << g->message() << "\n";

  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const double tokens = static_cast<double>(step_tokens_ * run_.world_size);
  summary.tokens += step_tokens_ * run_.world_size;
  if (summary.steps == 0) summary.first_loss = loss;
  summary.last_loss = loss;
  summary.steps = step_;
  summary.skipped_steps = skipped_steps_;

  const bool print = step_ % std::max<int64_t>(1, cfg_.steps_per_print) == 0 ||
                     step_ == run_.max_steps || stop_training_agreed_ || stop_signal_agreed_;
  ++wall_.steps;
  if (print) {
    Metrics extra;
    if (cfg_.wall_clock_breakdown) {  // DeepSpeed's per-phase times, per optimizer step
      const double n = static_cast<double>(wall_.steps);
      extra["data_ms"] = wall_.data / n;
      extra["forward_ms"] = wall_.forward / n;
      extra["backward_ms"] = wall_.backward / n;
      extra["gradient_reduce_ms"] = wall_.gradient_reduce / n;
      extra["optimizer_step_ms"] = wall_.optimizer_step / n;
      wall_ = WallClock{};
    }
    plugins_.each("add_metrics", step_, [&](Plugin& p) { p.add_metrics(extra); });
    log_step(step_, loss, lr, grad_norm, tokens / seconds, skip, extra);
  } else if (run_.rank == 0 && stdout_is_terminal()) {
    std::ostringstream tail;
    tail << step_ << "/" << run_.max_steps << " loss " << std::fixed << std::setprecision(4) << loss;
    draw_progress("", step_, run_.max_steps, tail.str());
  }
}

// The step flops_profiler.profile_step, under LibTorch's profiler: its table to the log (or
// output_file), every row to output_dir/step_profile.json. Rank 0 only; the others train unobserved.
void Engine::profiled_step(TrainSummary& summary) {
  StepProfiler profiler;
  const auto t0 = Clock::now();
  profiler.start();
  train_step(summary);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const StepProfile profile = profiler.stop(step_, seconds);
  const std::string table = format_step_profile(profile, 25);
  const std::string& file = cfg_.flops_profiler.output_file;
  bool written = false;
  if (!file.empty()) {
    std::ofstream out(file, std::ios::trunc);
    written = static_cast<bool>(out << table);
  }
  if (written) {
    log_ << "step profile (flops_profiler, step " << step_ << ") written to " << file << "\n";
  } else {  // training goes on: a profile is not worth the run
    if (!file.empty()) log_ << "warning: flops_profiler.output_file " << file << " cannot be written; the table:\n";
    log_ << table;
  }
  std::filesystem::create_directories(cfg_.output_dir);
  const std::string json = (std::filesystem::path(cfg_.output_dir) / "step_profile.json").string();
  std::ofstream(json, std::ios::trunc) << step_profile_json(profile) << "\n";
}

// ---- evaluation -------------------------------------------------------------------------------------
EvalResult Engine::evaluate() {
  const auto t0 = Clock::now();
  const int64_t T = cfg_.data.block_size;
  const int64_t windows = eval_windows(*eval_data_, T);
  const int64_t per_forward = cfg_.eval.batch_size > 0 ? cfg_.eval.batch_size : cfg_.micro_batch_size;
  // Rank r takes the r-th of world_size contiguous shares of the windows. Shares differ by one
  // window at most, yet every rank runs the same number of forwards — that of the largest share —
  // since a plugin may communicate inside a segment's forward (ZeRO-3 gathers there): a rank past
  // its share evaluates one window with every target ignored, which adds nothing.
  const int64_t begin = windows * run_.rank / run_.world_size;
  const int64_t end = windows * (run_.rank + 1) / run_.world_size;
  const int64_t largest = (windows + run_.world_size - 1) / run_.world_size;
  const int64_t forwards = (largest + per_forward - 1) / per_forward;
  struct EvalMode {  // dropout off while evaluating, whatever happens
    CausalLM& model;
    explicit EvalMode(CausalLM& m) : model(m) { model.eval(); }
    ~EvalMode() { model.train(); }
  } mode(*model_);
  at::NoGradGuard no_grad;
  double sums[2] = {0.0, 0.0};  // this rank's token losses, and their count
  for (int64_t f = 0; f < forwards; ++f) {
    const int64_t first = begin + f * per_forward;
    const bool past = first >= end;
    Batch batch = [&] {
      memory::Scope scope(Category::kOther);
      Batch b = past ? eval_batch(*eval_data_, T, 0, 1) : eval_batch(*eval_data_, T, first, std::min(per_forward, end - first));
      if (past) b.targets = at::full_like(b.targets, -100);  // a new tensor: inputs may share its memory
      return b;
    }();
    memory::Scope scope(Category::kActivations);
    sums[0] += forward_loss(batch.inputs, batch.targets, /*micro=*/-1).item<double>();
    sums[1] += static_cast<double>(batch.targets.ne(-100).sum().item<int64_t>());
  }
  at::Tensor total = at::tensor({sums[0], sums[1]}, at::kDouble);
  dist_->all_reduce_sum(total);
  EvalResult result;
  result.windows = windows;
  result.tokens = static_cast<int64_t>(total[1].item<double>());
  result.loss = total[0].item<double>() / static_cast<double>(std::max<int64_t>(1, result.tokens));
  result.perplexity = std::exp(result.loss);
  result.step = step_;
  result.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  report_eval(result);
  return result;
}

// The log line, metrics.jsonl's record ({"step", "eval_loss", ...}: Hugging Face's log_history
// names) and output_dir/eval.json, which holds the newest evaluation.
void Engine::report_eval(const EvalResult& r) {
  if (run_.rank != 0) return;
  if (stdout_is_terminal()) std::cout << "\r\033[K" << std::flush;
  if (eval_only_) {
    log_ << "eval of the model at step " << r.step;
  } else {
    log_ << "eval " << std::setw(5) << r.step << "/" << run_.max_steps;
  }
  log_ << " | eval_loss " << std::fixed
       << std::setprecision(4) << r.loss << " | perplexity " << std::setprecision(3) << r.perplexity << " | "
       << r.windows << " windows, " << r.tokens << " tokens predicted | " << std::setprecision(1) << r.seconds
       << " s\n";
  std::ostringstream json;
  json << std::setprecision(std::numeric_limits<double>::max_digits10) << "{\"loss\": " << r.loss
       << ", \"perplexity\": " << r.perplexity << ", \"tokens\": " << r.tokens << ", \"windows\": " << r.windows
       << ", \"step\": " << r.step << "}";
  if (!metrics_path_.empty()) {
    std::ofstream(metrics_path_, std::ios::app)
        << std::setprecision(std::numeric_limits<double>::max_digits10) << "{\"step\": " << r.step
        << ", \"eval_loss\": " << r.loss << ", \"eval_perplexity\": " << r.perplexity
        << ", \"eval_tokens\": " << r.tokens << "}\n";
  }
  write_file_atomic((std::filesystem::path(cfg_.output_dir) / "eval.json").string(), json.str() + "\n");
}

void Engine::notify_error(const std::exception& e) {
  ErrorContext ectx{run_, step_, e};
  for (auto it = plugins_.plugins().rbegin(); it != plugins_.plugins().rend(); ++it) {
    try {
      it->plugin->on_error(ectx);
    } catch (...) {
      // The original error is the one to report.
    }
  }
}

EvalResult Engine::evaluate_only() {
  if (cfg_.data.eval_files.empty() && cfg_.data.eval_datasets.empty() && cfg_.data.held_out.tool == HeldOut::Tool::kNone) {
    throw ConfigError(cfg_.train_yaml_path, "eval_file",
                      "is not set: launcher eval needs the text to evaluate; add --eval_file=FILE (any format "
                      "train_file takes) or set eval_file in the train.yaml");
  }
  eval_only_ = true;  // the run's metrics.jsonl is left as it is
  try {
    setup();
    if (resume_) load_checkpoint(checkpoint_dir(cfg_.output_dir, *resume_));
    const EvalResult result = evaluate();
    if (run_.rank == 0) {
      // The store holds the weights alone (StorePlan::keep_weights_only): no masters, gradients or
      // optimizer state, whatever the config trains with.
      log_ << "memory: peak " << megabytes(memory::allocator_stats().peak_bytes) << " allocated (weights and "
           << "activations; no optimizer state), peak RSS " << mib(peak_rss_bytes()) << "\n"
           << "written: " << (std::filesystem::path(cfg_.output_dir) / "eval.json").string() << "\n";
    }
    return result;
  } catch (const std::exception& e) {
    notify_error(e);
    throw;
  }
}

void Engine::write_memory_report(TrainSummary& summary) {
  summary.memory = memory_.report(run_.rank, estimate_, run_.device);
  const std::vector<std::string> ranks = all_gather_strings(*dist_, rank_report_json(summary.memory));
  if (run_.rank != 0) return;
  const std::string json = memory_report_json(run_.world_size, ranks);
  const std::filesystem::path dir(cfg_.output_dir);
  write_file_atomic((dir / "memory_report.json").string(), json);
  write_file_atomic((dir / "memory_report.html").string(), render_memory_report_html(json));
  log_ << memory_table_text(summary.memory, run_.world_size) << "  report: "
       << (dir / "memory_report.json").string() << " and memory_report.html\n";
}

void Engine::log_step(int64_t step, double loss, double lr, double grad_norm, double tokens_per_s,
                      bool skipped, const Metrics& extra) {
  if (run_.rank != 0) return;
  if (stdout_is_terminal()) std::cout << "\r\033[K" << std::flush;
  const memory::AllocatorStats memory = memory::allocator_stats();
  std::ostringstream line;
  line << "step " << std::setw(5) << step << "/" << run_.max_steps << " | loss " << std::fixed
       << std::setprecision(4) << loss << " | lr " << std::scientific << std::setprecision(3) << lr
       << " | grad_norm " << std::fixed << std::setprecision(3) << grad_norm << " | "
       << std::setprecision(0) << tokens_per_s << " tok/s | mem " << megabytes(memory.current_bytes)
       << " (peak " << megabytes(memory.peak_bytes) << ", RSS " << mib(current_rss_bytes()) << ")";
  for (const auto& [k, v] : extra) line << " | " << k << " " << std::defaultfloat << std::setprecision(6) << v;
  log_ << line.str() << "\n" << std::flush;

  std::ofstream out(metrics_path_, std::ios::app);
  out << std::setprecision(std::numeric_limits<double>::max_digits10) << "{\"step\": " << step << ", \"loss\": " << loss
      << ", \"lr\": " << lr << ", \"grad_norm\": ";
  if (std::isfinite(grad_norm)) {
    out << grad_norm;  // every digit: tests compare it with a reference to 1e-5
  } else {
    out << "null";
  }
  out << ", \"tokens_per_s\": " << tokens_per_s << ", \"skipped\": " << (skipped ? "true" : "false")
      << ", \"skipped_steps\": " << skipped_steps_ << ", \"live_bytes\": " << memory.current_bytes
      << ", \"peak_bytes\": " << memory.peak_bytes << ", \"rss_bytes\": " << current_rss_bytes();
  for (const auto& [k, v] : extra) out << ", \"" << k << "\": " << v;
  out << "}\n";
}

// ---- the run ----------------------------------------------------------------------------------------
TrainSummary Engine::train() {
  TrainSummary summary;
  try {
    setup();
    if (resume_) load_checkpoint(checkpoint_dir(cfg_.output_dir, *resume_));
    TrainContext tctx{*model_, *optimizer_, run_, *dist_, step_};
    plugins_.each("on_train_begin", -1, [&](Plugin& p) { p.on_train_begin(tctx); });
    const auto t0 = Clock::now();
    // eval_file: evaluated every eval_every steps (0: never on the way) and once more at the end.
    // Per epoch, every ceil(steps per epoch / evals per epoch): the eval_steps axolotl derives from
    // evals_per_epoch (a fraction of the run's steps, which Hugging Face rounds up).
    const int64_t per_epoch = loader_->steps_per_epoch();
    auto share_of_epoch = [per_epoch](int64_t times) { return (per_epoch + times - 1) / times; };
    const int64_t eval_every = cfg_.eval.steps > 0       ? cfg_.eval.steps
                               : cfg_.eval.per_epoch > 0 ? share_of_epoch(cfg_.eval.per_epoch)
                                                         : 0;
    // Checkpoints where Hugging Face's save_strategy puts them: every save_every steps (steps:
    // save_steps, or that fraction of the run rounded up; epoch: an epoch's steps; axolotl's
    // saves_per_epoch: a share of one, as for evals_per_epoch) and after the last step; "no": none.
    const bool saving = cfg_.save_strategy != "no";
    int64_t save_every = cfg_.save_steps < 1 ? static_cast<int64_t>(std::ceil(cfg_.save_steps * static_cast<double>(run_.max_steps)))
                                             : static_cast<int64_t>(cfg_.save_steps);
    if (cfg_.saves_per_epoch > 0) {
      save_every = share_of_epoch(cfg_.saves_per_epoch);
    } else if (cfg_.save_strategy == "epoch") {
      save_every = per_epoch;
    }
    int64_t saved_step = -1;
    auto save_now = [&] {
      summary.last_checkpoint = save_checkpoint();
      saved_step = step_;
    };
    double eval_seconds = 0.0;  // not training time: tokens/s leaves it out
    auto evaluate_now = [&] {
      const auto e0 = Clock::now();
      summary.eval = evaluate();
      eval_seconds += std::chrono::duration<double>(Clock::now() - e0).count();
    };
    const TrainConfig::FlopsProfiler& profiler = cfg_.flops_profiler;
    while (step_ < run_.max_steps && !stop_training_agreed_ && !stop_signal_agreed_) {
      if (profiler.enabled && run_.rank == 0 && step_ + 1 == profiler.profile_step) {
        profiled_step(summary);
      } else {
        train_step(summary);
      }
      if (eval_data_ && eval_every > 0 && step_ % eval_every == 0) evaluate_now();
      const bool due = saving && ((save_every > 0 && step_ % save_every == 0) || step_ == run_.max_steps);
      if (due || stop_signal_agreed_) save_now();
    }
    // A plugin's stop (Control::stop_training) ends the run early: its last step is saved too.
    if (saving && stop_training_agreed_ && saved_step != step_) save_now();
    if (stop_signal_agreed_) summary.stop_signal = stop_signal_received() ? stop_signal_received() : SIGTERM;
    if (profiler.enabled && run_.rank == 0 && step_ < profiler.profile_step) {
      log_ << "warning: flops_profiler.profile_step " << profiler.profile_step
           << " was not reached (the run ended after step " << step_ << "): nothing was profiled\n";
    }
    if (eval_data_ && !stop_signal_agreed_ && (!summary.eval || summary.eval->step != step_)) evaluate_now();
    summary.seconds = std::chrono::duration<double>(Clock::now() - t0).count() - eval_seconds;
    summary.tokens_per_s = static_cast<double>(summary.tokens) / std::max(1e-9, summary.seconds);
    summary.peak_rss_bytes = peak_rss_bytes();
    TrainContext ectx{*model_, *optimizer_, run_, *dist_, step_};
    plugins_.each_reversed("on_train_end", -1, [&](Plugin& p) { p.on_train_end(ectx); });
    write_memory_report(summary);
  } catch (const std::exception& e) {
    notify_error(e);
    throw;
  }
  if (run_.rank == 0 && stop_training_agreed_ && !summary.stop_signal) {
    log_ << "stopped after step " << step_ << ": a plugin set Control::stop_training (agreed by "
         << run_.world_size << " rank(s))\n";
  }
  if (run_.rank == 0 && summary.stop_signal) {
    log_ << "stopped by " << (summary.stop_signal == SIGINT ? "SIGINT" : "SIGTERM") << " after step "
         << step_ << "; checkpoint saved in " << summary.last_checkpoint
         << "; continue with the same command and --resume\n";
  }
  if (run_.rank == 0) {
    log_ << std::defaultfloat << "done: " << summary.steps << " steps ("
         << summary.skipped_steps << " skipped) in " << std::fixed << std::setprecision(1)
         << summary.seconds << " s, loss " << std::setprecision(4) << summary.first_loss << " -> "
         << summary.last_loss << ", " << std::setprecision(0) << summary.tokens_per_s
         << " tok/s, peak RSS " << mib(summary.peak_rss_bytes) << "\n";
  }
  return summary;
}

}  // namespace memrt
