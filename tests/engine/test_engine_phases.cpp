// The engine against the loop written in memrt/plugin.h: phases fire in the documented order, and
// the API carries the built-in plugins' patterns without host changes — ZeRO-3's release and
// re-gather around every segment in forward and backward, recompute in backward, loss scaling,
// a skipped step — each checked against a plain run of the same model and data.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <torch/autograd.h>

#include "engine/engine.h"

namespace memrt {
namespace {

namespace fs = std::filesystem;

TrainConfig tiny_config(const std::string& name) {
  TrainConfig cfg;
  cfg.micro_batch_size = 2;
  cfg.grad_accum_steps = 2;
  cfg.train_batch_size = 4;
  cfg.gradient_clipping = 1.0;
  cfg.steps_per_print = 1;
  cfg.max_steps = 3;
  cfg.seed = 7;
  cfg.optimizer.type = "AdamW";
  cfg.optimizer.lr = 1e-2;
  cfg.optimizer.weight_decay = 0.1;
  cfg.model.shape.arch = "gpt2";
  cfg.model.shape.n_layer = 2;
  cfg.model.shape.n_head = 2;
  cfg.model.shape.n_kv_head = 2;
  cfg.model.shape.d_model = 32;
  cfg.model.shape.d_ff = 64;
  cfg.model.shape.n_ctx = 16;
  cfg.data.block_size = 16;
  cfg.output_dir = (fs::temp_directory_path() / ("memrt_engine_" + name + "_" +
                                                 std::to_string(getpid()))).string();
  return cfg;
}

// Trains in this process (one rank); returns the final parameters. The output folder (metrics)
// is removed unless `keep_output`.
std::vector<at::Tensor> train_and_get_params(TrainConfig cfg, PluginHost host,
                                             bool keep_output = false) {
  const std::string out_dir = cfg.output_dir;
  std::ostringstream log;
  Engine engine(std::move(cfg), nullptr, std::move(host), log);
  engine.train();
  std::vector<at::Tensor> out;
  for (const auto& p : engine.model().parameters()) out.push_back(p.detach().clone());
  if (!keep_output) fs::remove_all(out_dir);
  return out;
}

void expect_params_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                         double rtol, double atol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::allclose(a[i], b[i], rtol, atol))
        << "parameter " << i << " differs by " << (a[i] - b[i]).abs().max().item<double>();
  }
}

std::string seg(const SegmentContext& c) {
  return std::string(to_string(c.kind)) + (c.kind == SegmentKind::kBlock ? std::to_string(c.index) : "");
}

// Records every phase (with segment names) of the first optimizer step.
class Recorder final : public Plugin {
 public:
  explicit Recorder(std::vector<std::string>* log) : log_(log) {}
  void before_forward(MicroStepContext& c) override { add(c.step, "before_forward"); }
  void before_segment_forward(SegmentContext& c) override { add(c.step, "before_segment_forward " + seg(c)); }
  void after_segment_forward(SegmentContext& c) override { add(c.step, "after_segment_forward " + seg(c)); }
  void after_forward(MicroStepContext& c) override { add(c.step, "after_forward"); }
  void before_backward(BackwardContext& c) override { add(c.step, "before_backward"); }
  void before_segment_backward(SegmentContext& c) override { add(c.step, "before_segment_backward " + seg(c)); }
  void after_segment_backward(SegmentContext& c) override { add(c.step, "after_segment_backward " + seg(c)); }
  void after_backward(MicroStepContext& c) override { add(c.step, "after_backward"); }
  void after_gradient_accumulation(StepContext& c) override { add(c.step, "after_gradient_accumulation"); }
  void before_optimizer_step(StepContext& c) override { add(c.step, "before_optimizer_step"); }
  void after_optimizer_step(StepContext& c) override { add(c.step, "after_optimizer_step"); }

 private:
  void add(int64_t step, const std::string& what) {
    if (step == 0) log_->push_back(what);
  }
  std::vector<std::string>* log_;
};

TEST(EnginePhases, OneStepFiresEveryPhaseInTheDocumentedOrder) {
  std::vector<std::string> log;
  PluginHost host;
  host.add("recorder", "plugins[0]", std::make_unique<Recorder>(&log));
  host.order();
  TrainConfig cfg = tiny_config("order");
  cfg.max_steps = 1;
  train_and_get_params(cfg, std::move(host));

  std::vector<std::string> micro = {"before_forward"};
  for (const char* s : {"embedding", "block0", "block1", "head"}) {
    micro.push_back(std::string("before_segment_forward ") + s);
    micro.push_back(std::string("after_segment_forward ") + s);
  }
  micro.push_back("after_forward");
  micro.push_back("before_backward");
  for (const char* s : {"head", "block1", "block0", "embedding"}) {
    micro.push_back(std::string("before_segment_backward ") + s);
    micro.push_back(std::string("after_segment_backward ") + s);
  }
  micro.push_back("after_backward");
  std::vector<std::string> want = micro;
  want.insert(want.end(), micro.begin(), micro.end());  // gradient_accumulation_steps = 2
  for (const char* s : {"after_gradient_accumulation", "before_optimizer_step", "after_optimizer_step"})
    want.push_back(s);
  EXPECT_EQ(log, want);
}

// ZeRO-3's pattern: a segment's parameters hold real data only between before_segment_* and
// after_segment_*; elsewhere they are empty placeholders. Training must equal the plain run.
class ReleaseGather final : public Plugin {
 public:
  explicit ReleaseGather(int64_t* releases) : releases_(releases) {}
  void before_segment_forward(SegmentContext& c) override { gather(c); }
  void after_segment_forward(SegmentContext& c) override { release(c); }
  void before_segment_backward(SegmentContext& c) override { gather(c); }
  void after_segment_backward(SegmentContext& c) override { release(c); }
  void after_gradient_accumulation(StepContext&) override {  // the optimizer needs them all
    for (auto& [param, full] : stash_) param.set_data(full);
    stash_.clear();
  }

 private:
  void gather(SegmentContext& c) {
    for (const at::Tensor& p : c.params) {
      for (auto it = stash_.begin(); it != stash_.end(); ++it) {
        if (it->first.is_same(p)) {
          at::Tensor(p).set_data(it->second);
          stash_.erase(it);
          break;
        }
      }
    }
  }
  void release(SegmentContext& c) {
    for (const at::Tensor& p : c.params) {
      if (p.numel() == 0) continue;
      stash_.emplace_back(p, p.data());
      at::Tensor(p).set_data(at::empty({0}, p.options()));
      ++*releases_;
    }
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> stash_;  // parameter, its real data
  int64_t* releases_;
};

TEST(EnginePhases, ParametersReleasedOutsideTheirSegmentsTrainLikeThePlainModel) {
  const auto plain = train_and_get_params(tiny_config("plain"), PluginHost());
  int64_t releases = 0;  // plugins die with their engine: results go to the test's variables
  PluginHost host;
  host.add("release_gather", "plugins[0]", std::make_unique<ReleaseGather>(&releases));
  host.order();
  const auto zero3 = train_and_get_params(tiny_config("zero3"), std::move(host));
  EXPECT_GT(releases, 0);
  expect_params_equal(plain, zero3, 0.0, 0.0);  // same arithmetic, bit for bit
}

// The same pattern on the parameter store, as ZeRO-3 will gather: outside the segments running,
// the store's compute buffers are NaN; each segment's phases restore exactly StorePlan::segment_range
// of its own segment (SegmentContext::index) and of the segments whose slots it shares (the head's
// tied embedding). Were a range or the shared slots wrong, NaN would reach the loss or a gradient.
class RangePoison final : public Plugin {
 public:
  explicit RangePoison(int64_t* restores) : restores_(restores) {}
  void build_optimizer(OptimizerContext& c) override { store_ = &c.store; }
  void before_forward(MicroStepContext&) override {
    if (!stash_.empty()) return;  // poisoned since the last step
    for (ParamStore::Group& g : store_->groups()) {
      stash_.push_back(g.compute.detach().clone());
      raw(g).fill_(std::nanf(""));
    }
  }
  void before_segment_forward(SegmentContext& c) override { move(c, true); }
  void after_segment_forward(SegmentContext& c) override { move(c, false); }
  void before_segment_backward(SegmentContext& c) override { move(c, true); }
  void after_segment_backward(SegmentContext& c) override { move(c, false); }
  void after_gradient_accumulation(StepContext&) override {  // the step reads every weight
    for (size_t g = 0; g < stash_.size(); ++g) raw(store_->groups()[g]).copy_(stash_[g]);
    stash_.clear();
  }

 private:
  // The buffer's memory without its version counter: autograd's saved parameters must not see
  // these writes as in-place changes.
  static at::Tensor raw(const ParamStore::Group& g) { return g.compute.variable_data(); }
  void move(const SegmentContext& c, bool restore) {
    std::vector<int64_t> segments = {c.index};
    for (int slot : c.shared) segments.push_back(store_->plan().segment(slot));
    for (int64_t segment : segments) {
      for (size_t g = 0; g < stash_.size(); ++g) {
        const ElementRange r = store_->plan().segment_range(static_cast<int>(g), segment);
        at::Tensor live = raw(store_->groups()[g]).narrow(0, r.begin, r.size());
        at::Tensor kept = stash_[g].narrow(0, r.begin, r.size());
        if (restore) {
          live.copy_(kept);
          ++*restores_;
        } else {
          kept.copy_(live);
          live.fill_(std::nanf(""));
        }
      }
    }
  }
  ParamStore* store_ = nullptr;
  std::vector<at::Tensor> stash_;  // per group: the compute buffer's real values
  int64_t* restores_;
};

TEST(EnginePhases, EachSegmentReadsExactlyItsRangesOfTheStore) {
  TrainConfig llama = tiny_config("llama");
  llama.model.shape.arch = "llama";
  llama.model.shape.n_kv_head = 1;
  llama.model.shape.tie_embeddings = false;
  for (const TrainConfig& cfg : {tiny_config("gpt2"), llama}) {
    const auto plain = train_and_get_params(cfg, PluginHost());
    int64_t restores = 0;
    PluginHost host;
    host.add("range_poison", "plugins[0]", std::make_unique<RangePoison>(&restores));
    host.order();
    TrainConfig poisoned = cfg;
    poisoned.output_dir += "_poisoned";
    const auto result = train_and_get_params(poisoned, std::move(host));
    EXPECT_GT(restores, 0);
    expect_params_equal(plain, result, 0.0, 0.0);  // no NaN anywhere, the same arithmetic
  }
}

// A plugin that adds a parameter the model computes in no segment its name points to (a
// top-level "extra.scale": by name the head's, but the head does not read it) is refused at
// start, naming the parameter: the store would gather and step it with the wrong segment.
class MisplacedParameter final : public Plugin {
 public:
  void plan_params(ParamPlanContext& c) override { c.params.push_back({"extra.scale", {4}, at::kFloat, true, true}); }
  void transform_model(ModelContext& c) override {
    auto extra = std::make_shared<torch::nn::Module>();
    extra->register_parameter("scale", at::ones({4}));
    c.model.register_module("extra", extra);
  }
};

TEST(EnginePhases, AParameterOutsideTheSegmentItsNameSaysIsRefused) {
  PluginHost host;
  host.add("misplaced", "plugins[0]", std::make_unique<MisplacedParameter>());
  host.order();
  TrainConfig cfg = tiny_config("misplaced");
  std::ostringstream log;
  Engine engine(cfg, nullptr, std::move(host), log);
  try {
    engine.train();
    ADD_FAILURE() << "a parameter outside its named segment was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'extra.scale' is named as a parameter of the head"), std::string::npos) << e.what();
  }
  fs::remove_all(cfg.output_dir);
}

// Activation checkpointing's pattern: a block runs under no_grad in forward and is recomputed,
// with grad, inside backward.
struct Recompute : public torch::autograd::Function<Recompute> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x, int64_t fn) {
    ctx->save_for_backward({x});
    ctx->saved_data["fn"] = fn;
    at::NoGradGuard no_grad;
    return (*reinterpret_cast<const SegmentFn*>(fn))(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto& fn = *reinterpret_cast<const SegmentFn*>(ctx->saved_data["fn"].toInt());
    at::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    at::Tensor y;
    {
      at::AutoGradMode grad_on(true);
      y = fn(x);
    }
    torch::autograd::backward({y}, {grads[0]});
    return {x.grad(), at::Tensor()};
  }
};

class Checkpointing final : public Plugin {
 public:
  explicit Checkpointing(std::vector<std::string>* log) : log_(log) {}
  bool wraps_segments() const override { return true; }
  at::Tensor run_segment(SegmentContext& c, const at::Tensor& x, const SegmentFn& next) override {
    if (c.kind != SegmentKind::kBlock) return next(x);
    fns_.push_back(std::make_unique<SegmentFn>([this, name = seg(c), next](const at::Tensor& in) {
      if (at::GradMode::is_enabled()) log_->push_back("recompute " + name);
      return next(in);
    }));
    return Recompute::apply(x, reinterpret_cast<int64_t>(fns_.back().get()));
  }
  void before_segment_backward(SegmentContext& c) override { log_->push_back("before_segment_backward " + seg(c)); }
  void after_segment_backward(SegmentContext& c) override { log_->push_back("after_segment_backward " + seg(c)); }
  void after_optimizer_step(StepContext&) override { fns_.clear(); }

 private:
  std::vector<std::string>* log_;
  std::vector<std::unique_ptr<SegmentFn>> fns_;
};

TEST(EnginePhases, RecomputeInBackwardTrainsLikeThePlainModel) {
  const auto plain = train_and_get_params(tiny_config("plain2"), PluginHost());
  std::vector<std::string> log;
  PluginHost host;
  host.add("checkpointing", "plugins[0]", std::make_unique<Checkpointing>(&log));
  host.order();
  TrainConfig cfg = tiny_config("recompute");
  const auto recomputed = train_and_get_params(cfg, std::move(host));
  expect_params_equal(plain, recomputed, 1e-5, 1e-6);
  // The recompute runs after before_segment_backward of its block, before after_segment_backward.
  const std::vector<std::string> first(log.begin(), log.begin() + 10);
  EXPECT_EQ(first, (std::vector<std::string>{
                       "before_segment_backward head", "after_segment_backward head",
                       "before_segment_backward block1", "recompute block1",
                       "after_segment_backward block1", "before_segment_backward block0",
                       "recompute block0", "after_segment_backward block0",
                       "before_segment_backward embedding", "after_segment_backward embedding"}));
}

// fp16 loss scaling's pattern: scale the loss in before_backward, unscale the gradients once
// they are complete. With a power of two the arithmetic is exact.
class LossScale final : public Plugin {
 public:
  void before_backward(BackwardContext& c) override { c.loss = c.loss * 1024.0; }
  void after_gradient_accumulation(StepContext& c) override {
    for (at::Tensor& g : c.grads) g.mul_(1.0 / 1024.0);
  }
};

TEST(EnginePhases, ScaledLossWithUnscaledGradientsTrainsLikeThePlainModel) {
  const auto plain = train_and_get_params(tiny_config("plain3"), PluginHost());
  PluginHost host;
  host.add("loss_scale", "plugins[0]", std::make_unique<LossScale>());
  host.order();
  const auto scaled = train_and_get_params(tiny_config("scaled"), std::move(host));
  expect_params_equal(plain, scaled, 1e-6, 1e-7);
}

// A vote to skip leaves parameters and optimizer state untouched and does not advance the LR
// schedule (DeepSpeed: the scheduler is not stepped on a skipped step).
struct SkipResult {
  std::vector<bool> skipped;
  bool params_unchanged = true;
  bool state_unchanged = true;
};

class SkipStep final : public Plugin {
 public:
  SkipStep(int64_t at, SkipResult* out) : at_(at), out_(out) {}
  void before_optimizer_step(StepContext& c) override {
    if (c.step != at_) return;
    c.control.skip_step = true;
    c.control.skip_reason = "test";
    for (const auto& p : c.model.parameters()) params_.push_back(p.detach().clone());
    for (const auto& [k, v] : c.optimizer.state_dict()) state_[k] = v.clone();
  }
  void after_optimizer_step(StepContext& c) override {
    out_->skipped.push_back(c.skipped);
    if (c.step != at_) return;
    auto now = c.model.parameters();
    for (size_t i = 0; i < now.size(); ++i) out_->params_unchanged &= at::equal(now[i], params_[i]);
    for (const auto& [k, v] : c.optimizer.state_dict())
      out_->state_unchanged &= at::equal(v, state_.at(k));
  }

 private:
  int64_t at_;
  SkipResult* out_;
  std::vector<at::Tensor> params_;
  TensorMap state_;
};

TEST(EnginePhases, SkippedStepLeavesParametersStateAndScheduleUntouched) {
  SkipResult r;
  PluginHost host;
  host.add("skip", "plugins[0]", std::make_unique<SkipStep>(1, &r));
  host.order();
  TrainConfig cfg = tiny_config("skip");
  cfg.max_steps = 3;
  cfg.scheduler.type = "linear";  // Hugging Face: lr * (T - c) / T after c updates, T = 3
  cfg.scheduler.warmup_num_steps = 0;
  cfg.scheduler.total_num_steps = 3;
  train_and_get_params(cfg, std::move(host), /*keep_output=*/true);
  EXPECT_EQ(r.skipped, (std::vector<bool>{false, true, false}));
  EXPECT_TRUE(r.params_unchanged);
  EXPECT_TRUE(r.state_unchanged);

  std::ifstream metrics(fs::path(cfg.output_dir) / "metrics.jsonl");
  std::vector<std::string> lines(3);
  for (auto& l : lines) std::getline(metrics, l);
  EXPECT_NE(lines[1].find("\"skipped\": true"), std::string::npos) << lines[1];
  EXPECT_NE(lines[2].find("\"skipped_steps\": 1"), std::string::npos) << lines[2];
  auto lr_of = [](const std::string& line) { return std::stod(line.substr(line.find("\"lr\": ") + 6)); };
  EXPECT_NEAR(lr_of(lines[0]), 1e-2, 1e-12);
  EXPECT_NEAR(lr_of(lines[1]), 1e-2 * 2 / 3, 1e-12);  // the update it would have made
  EXPECT_NEAR(lr_of(lines[2]), 1e-2 * 2 / 3, 1e-12);  // not advanced past the skipped step
  fs::remove_all(cfg.output_dir);
}

class ThrowsInBackward final : public Plugin {
 public:
  explicit ThrowsInBackward(bool* saw_error) : saw_error_(saw_error) {}
  void after_segment_backward(SegmentContext& c) override {
    if (c.kind == SegmentKind::kBlock && c.index == 0) throw std::runtime_error("bad block");
  }
  void on_error(ErrorContext&) override { *saw_error_ = true; }

 private:
  bool* saw_error_;
};

TEST(EnginePhases, ExceptionInsideBackwardNamesPluginPhaseAndStep) {
  bool saw_error = false;
  PluginHost host;
  host.add("thrower", "plugins[0]", std::make_unique<ThrowsInBackward>(&saw_error));
  host.order();
  std::ostringstream log;
  TrainConfig cfg = tiny_config("throw");
  const std::string out_dir = cfg.output_dir;
  Engine engine(std::move(cfg), nullptr, std::move(host), log);
  try {
    engine.train();
    FAIL() << "no error";
  } catch (const PluginError& e) {
    EXPECT_STREQ(e.what(), "plugin 'thrower' failed in after_segment_backward at step 0: bad block");
  }
  EXPECT_TRUE(saw_error);
  fs::remove_all(out_dir);
}

// Where set-up's memory lands: each category's scope closes where the category ends. Seen from
// the first phase after set-up (on_train_begin): the weights cell holds the parameters, the
// optimizer_state cell exactly the Adam moments — nothing set-up did after building the optimizer
// — and what a plugin allocates without claiming it, in configure (after the data is opened) or
// in on_train_begin, is unattributed, not the host's data (`other`) or optimizer state.
class SetupCells final : public Plugin {
 public:
  void configure(const ConfigNode&, ConfigDiagnostics&, const RunInfo&) override {
    const memory::Table before = memory::live();
    table = at::zeros({500}, at::kByte);  // (500,) bytes, claimed by nobody
    in_configure = memory::live() - before;
  }
  void on_train_begin(TrainContext& ctx) override {
    at_begin = memory::live();
    for (const at::Tensor& p : ctx.model.parameters()) {
      const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
      param_bytes += bytes;
      if (p.requires_grad()) trainable_bytes += bytes;
    }
    kept = at::zeros({1000}, at::kByte);  // (1000,) bytes, claimed by nobody
    after_alloc = memory::live();
  }
  memory::Table in_configure, at_begin, after_alloc;
  int64_t param_bytes = 0, trainable_bytes = 0;
  at::Tensor table, kept;
};

TEST(EnginePhases, SetupCountsEachCategoryOnlyWhileItLasts) {
  auto cells = std::make_unique<SetupCells>();
  SetupCells* seen = cells.get();
  PluginHost host;
  host.add("setup_cells", "plugins[0]", std::move(cells));
  host.order();
  TrainConfig cfg = tiny_config("setup_cells");
  cfg.max_steps = 1;
  const std::string out_dir = cfg.output_dir;
  std::ostringstream log;
  Engine engine(std::move(cfg), nullptr, std::move(host), log);
  engine.train();
  fs::remove_all(out_dir);

  using memory::Category;
  const memory::Table& t = seen->at_begin;
  ASSERT_GT(seen->param_bytes, 0);
  EXPECT_EQ(t.category(Category::kWeights), seen->param_bytes);
  // AdamW: exp_avg and exp_avg_sq, fp32, one of each per trainable parameter.
  EXPECT_EQ(t.category(Category::kOptimizerState), 2 * seen->trainable_bytes);
  for (Category c : {Category::kMasterWeights, Category::kGradients, Category::kQuantState,
                     Category::kAdapters, Category::kActivations, Category::kCommBuffers}) {
    EXPECT_EQ(t.category(c), 0) << memory::to_string(c);
  }
  EXPECT_EQ(seen->in_configure.category(Category::kUnattributed), 500);
  EXPECT_EQ(seen->in_configure.total(), 500) << "other: " << seen->in_configure.category(Category::kOther);
  const memory::Table grew = seen->after_alloc - seen->at_begin;
  EXPECT_EQ(grew.category(Category::kUnattributed), 1000);
  EXPECT_EQ(grew.total(), 1000) << "the plugin's tensor is in no category but unattributed";
}

}  // namespace
}  // namespace memrt
