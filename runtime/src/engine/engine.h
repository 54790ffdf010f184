// The training engine: owns the step loop written as pseudocode at the top of memrt/plugin.h.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/base_source.h"
#include "config/train_config.h"
#include "memory/report.h"
#include "memrt/comm.h"
#include "memrt/plugin.h"
#include "plugin/plugin_host.h"

namespace memrt {

class DecoderLM;
class DistContext;
class DataLoader;
class TokenDataset;
class LrSchedule;

// One evaluation of eval_file (data/dataset.h, eval_windows): the mean next-token loss over every
// predicted token of every window, on all ranks together.
struct EvalResult {
  double loss = 0.0;
  double perplexity = 0.0;  // exp(loss)
  int64_t tokens = 0;       // predicted tokens: windows * (block_size - 1)
  int64_t windows = 0;
  int64_t step = 0;         // optimizer steps the model had taken
  double seconds = 0.0;
};

struct TrainSummary {
  int64_t steps = 0;          // optimizer steps taken (including skipped ones)
  int64_t skipped_steps = 0;
  double first_loss = 0.0;    // mean loss of the first step, over ranks
  double last_loss = 0.0;     // mean loss of the last step, over ranks
  double seconds = 0.0;       // wall time of the loop
  int64_t tokens = 0;         // input tokens trained on, all ranks together (padding not counted)
  double tokens_per_s = 0.0;  // those per second of the loop
  int64_t peak_rss_bytes = 0; // this process
  RankMemoryReport memory;     // this rank's estimate and measurement
  int stop_signal = 0;         // SIGTERM/SIGINT that stopped the run early (0: ran to the end)
  std::string last_checkpoint; // the folder of the newest checkpoint this run saved, if any
  std::optional<EvalResult> eval;  // the last evaluation of eval_file, if the run has one
};

// SIGTERM and SIGINT ask the engine to finish the current step, save a checkpoint and stop; a
// second signal aborts at once (the default action). Installed by the launcher.
void install_stop_signal_handlers();
// The stop signal received so far in this process (0: none).
int stop_signal_received();

// `launcher export`: verifies the checkpoint (a global_step* folder, or an output_dir whose
// `latest` names one) and writes a Hugging Face directory (config.json, model.safetensors): each
// plain parameter's exact weight in fp32 — its fp32 master where the run kept one, else its compute
// copy — gathered from every rank's shards of the store, and the parameters in a plugin's format as
// that plugin writes them (the run's plugins, loaded from its plugins.json; docs/checkpoints.md).
// With `merge`, plugins fold what they added into the model's weights (ExportContext::merge).
// `dtype` (fp32, bf16 or fp16) is what the model's dense floating parameters are written in (each
// rounded once from its fp32 value; a quantized weight and its companions stay as their plugin
// wrote them), and config.json's torch_dtype says so. A checkpoint that left its frozen parameters
// in its base model reads them from `base_dir` (default: the directory its run read), rebuilt as the
// run built them (a plugin's on_block_ready quantizing on load). Returns a summary line.
std::string export_checkpoint(const std::string& checkpoint, const std::string& out_dir, bool merge = false,
                              const std::string& dtype = "fp32", const std::string& base_dir = "");

// The facts plugins see (RunInfo) for a resolved config on a given rank.
RunInfo make_run_info(const TrainConfig& cfg, int rank, int world_size, int local_rank);

// The memory estimate for `run`'s rank and world size: the host's plan, then every plugin's term
// (docs/memory.md). The plugins must have been configured.
EstimateReport estimate_memory(const TrainConfig& cfg, const RunInfo& run, PluginHost& plugins);

// The elements of parameter `name` (flat, [lo, hi)) this rank reads from a Hugging Face
// checkpoint, or none: all of them. A parameter whose every copy the store partitions (ZeRO-3) is
// read for this rank's share alone — a trainable one's compute (and master) partition, a frozen
// one's frozen_partition unless `frozen_reads` names it (or is none: a plugin may read any) —
// shifted to the parameter's start; empty for a rank past its end (docs/zero.md).
std::optional<ElementRange> held_elements(const StorePlan& plan, const std::optional<std::set<std::string>>& frozen_reads,
                                          const std::string& name);

class Engine {
 public:
  // `log` receives the human-readable output (rank 0 only writes to it). `dist` may be null: one
  // process, no rendezvous.
  Engine(TrainConfig cfg, std::shared_ptr<DistContext> dist, PluginHost plugins, std::ostream& log);
  ~Engine();

  TrainSummary train();
  // `launcher eval`: builds the run as train() would (and loads the checkpoint resume_from names),
  // evaluates eval_file once, prints the result and writes output_dir/eval.json.
  EvalResult evaluate_only();

  // Continue from a checkpoint of cfg.output_dir: "" for the newest (its `latest`), else a tag
  // such as "global_step40". Call before train().
  void resume_from(std::string tag) { resume_ = std::move(tag); }

  const RunInfo& run_info() const { return run_; }
  // After train(): the trained model (tests, export).
  CausalLM& model() { return *model_; }
  const ParamStore& store() const { return *store_; }

 private:
  void setup();
  void train_step(TrainSummary& summary);
  void profiled_step(TrainSummary& summary);
  double micro_step(int64_t micro);
  // The model's forward through the segments' phases and wrappers (memrt/plugin.h) and the loss
  // summed over the targets (-100: not counted); `boundary`, when given, sees each segment's output
  // and index (0: the embedding; the head's output is the loss itself with chunked_cross_entropy,
  // the logits otherwise).
  at::Tensor forward_loss(const at::Tensor& tokens, const at::Tensor& targets, int64_t micro,
                          const std::function<void(at::Tensor&, int64_t)>& boundary = {});
  // The model as memrt's own decoder, which `feature` needs; memrt::Error naming it otherwise.
  DecoderLM* decoder_for(const char* feature);
  // Every eval window once, split across the ranks; the model in eval mode (no dropout), no grad.
  EvalResult evaluate();
  void report_eval(const EvalResult& result);
  // on_error of every plugin, reversed; what they throw is dropped (the original error is reported).
  void notify_error(const std::exception& e);
  struct Segment;
  void assign_segment_slots();
  at::Tensor run_segment(const Segment& segment, const at::Tensor& x, SegmentFn body, int64_t micro);
  // Per-segment backward phases, fired in order as the gradient reaches each segment boundary.
  void advance_backward_events(int64_t upto, int64_t micro);
  void write_memory_report(TrainSummary& summary);
  // docs/checkpoints.md: every rank writes its part, rank 0 the model and the manifest.
  std::string save_checkpoint();
  void load_checkpoint(const std::string& dir);
  void log_step(int64_t step, double loss, double lr, double grad_norm, double tokens_per_s,
                bool skipped, const Metrics& extra);

  TrainConfig cfg_;
  std::shared_ptr<DistContext> dist_;  // never null; also the plugins' Communicator
  PluginHost plugins_;
  std::ostream& log_;
  RunInfo run_;

  std::shared_ptr<CausalLM> model_;
  std::shared_ptr<ParamStore> store_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<LrSchedule> schedule_;
  std::unique_ptr<DataLoader> loader_;
  std::shared_ptr<const TokenDataset> eval_data_;  // eval_file, when set
  std::vector<at::Tensor> trainable_;

  int64_t step_ = 0;             // optimizer steps taken, skipped ones included
  int64_t completed_steps_ = 0;  // successful updates (the LR schedule's clock)
  int64_t skipped_steps_ = 0;
  int64_t step_tokens_ = 0;  // this rank's real input tokens in the step so far
  Control control_;

  // Backward-phase bookkeeping of the current micro-step: events [0, 2*S) are, for segments from
  // the head down to the embedding, before_segment_backward then after_segment_backward.
  struct Segment {
    SegmentKind kind;
    int64_t index;
    Block* block;
    std::vector<at::Tensor> params;
    std::vector<int> slots;   // the store's slots it owns (SegmentContext::slots)
    std::vector<int> shared;  // and those it reads but another segment owns
  };
  std::vector<Segment> segments_;  // forward order: embedding, blocks, head
  int64_t backward_events_fired_ = 0;
  std::exception_ptr hook_error_;

  std::string metrics_path_;
  // wall_clock_breakdown: each phase's milliseconds since the last log line, over `steps` steps.
  struct WallClock {
    double data = 0, forward = 0, backward = 0, gradient_reduce = 0, optimizer_step = 0;
    int64_t steps = 0;
  } wall_;
  // Where a phase adds its time: the field of wall_, or nowhere without wall_clock_breakdown.
  double* wall_ms(double WallClock::*phase) { return cfg_.wall_clock_breakdown ? &(wall_.*phase) : nullptr; }
  std::optional<std::string> resume_;
  // model_name_or_path as the run read its frozen parameters from it: checkpoints leave them there.
  std::optional<BaseSource> base_;
  bool eval_only_ = false;  // evaluate_only(): no training, metrics.jsonl untouched
  bool stop_signal_agreed_ = false;    // a rank saw a stop signal by this step's vote
  bool stop_training_agreed_ = false;  // a rank's plugin set Control::stop_training by this vote
  EstimateReport estimate_;
  MemoryMonitor memory_;
};

}  // namespace memrt
