// `launcher export`: a checkpoint's store consolidated into a Hugging Face directory, with the
// parameters in plugins' formats written by those plugins (engine.h, docs/checkpoints.md "Export").
#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <utility>

#include <ATen/ATen.h>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/saved_view.h"
#include "checkpoint/store_checkpoint.h"
#include "dist/process_group.h"
#include "engine/engine.h"
#include "memory/estimate.h"
#include "models/hf_checkpoint.h"
#include "models/model_factory.h"

namespace memrt {

namespace fs = std::filesystem;

namespace {

// The run's plugins as plugins.json lists them, loaded and configured as the run configured them,
// with plan_params run on the model's shapes (what a plugin's export reads, e.g. a weight's shape).
PluginHost load_run_plugins(const std::string& plugins_file, const RunInfo& run, std::vector<ParamInfo>& planned) {
  std::vector<PluginSpec> specs = read_plugins_json(plugins_file);
  for (const PluginSpec& spec : specs) {
    if (spec.library == "(linked in)")
      throw FileError(plugins_file, "lists plugin '" + spec.name + "', which was linked into the program that "
                                    "trained: export loads plugins from their libraries only");
  }
  PluginHost plugins = PluginHost::load(specs);
  ConfigDiagnostics notes;  // printed when the run started
  plugins.configure(run, notes);
  planned = shape_params(run.shape, /*decay_all=*/true);
  plugins.plan_params(planned, run);
  return plugins;
}

// The frozen parameters a checkpoint left in its base model, as SavedStore::read_base_from takes
// them: where a plugin keeps one in its own format (a 4-bit base), from the model rebuilt as the
// run built it, its plugins' on_block_ready converting each block as it loads (held: the base in
// those formats and what no plugin converts, e.g. the embeddings); else viewed in the base's
// memory-mapped files, nothing held.
SavedStore::BaseTensors base_tensors(const SavedStore& saved, const std::string& dir, const RunInfo& run,
                                     PluginHost& plugins, const std::vector<ParamInfo>& planned) {
  bool formatted = false;
  for (const std::string& name : saved.param_names())
    formatted |= !saved.trainable(name) && saved.from_base(name) && !saved.frozen_format(name).empty();
  if (!formatted) {
    auto weights = std::make_shared<HfWeights>(HfWeights::open(dir));
    auto specs = std::make_shared<std::vector<ParamSpec>>(parameter_specs(run.shape));
    weights->check(run.shape, *specs);
    return [weights, specs](const std::string& param, const std::string&) -> at::Tensor {
      for (const ParamSpec& spec : *specs)
        if (spec.name == param) return weights->tensor(spec);
      throw Error("export: the base model has no parameter '" + param + "'");
    };
  }
  BuildOptions build;
  build.weights_dir = dir;
  for (const ParamInfo& p : planned)
    if (!at::isFloatingType(p.dtype)) build.replaced.insert(p.name);
  std::shared_ptr<DistContext> one = DistContext::create(DistEnvironment{}, std::chrono::seconds(60));
  build.on_block_ready = [&](int64_t index, Block& block, const CheckpointReader* checkpoint) {
    BlockReady ctx{index, block, run, *one, checkpoint};
    plugins.each("on_block_ready", -1, [&](Plugin& p) { p.on_block_ready(ctx); });
  };
  auto tensors = std::make_shared<std::map<std::string, at::Tensor>>();
  {
    const std::shared_ptr<CausalLM> model = build_model(run.shape, build);
    for (const auto& item : model->named_parameters(/*recurse=*/true))
      if (saved.contains(item.key()) && !saved.trainable(item.key()) && saved.from_base(item.key()))
        (*tensors)[item.key() + "/weight"] = item.value();
    for (const auto& item : model->named_buffers(/*recurse=*/true)) (*tensors)[item.key()] = item.value();
  }
  return [tensors](const std::string& param, const std::string& buffer) -> at::Tensor {
    const auto it = tensors->find(buffer == "weight" ? param + "/weight" : buffer);
    if (it == tensors->end()) throw Error("export: the rebuilt base model has no tensor '" + param + "' " + buffer);
    return it->second;
  };
}

}  // namespace

std::string export_checkpoint(const std::string& checkpoint, const std::string& out_dir, bool merge,
                              const std::string& dtype, const std::string& base_dir) {
  // --dtype: Hugging Face's torch_dtype names for the three floating types memrt trains in.
  static const std::map<std::string, std::pair<at::ScalarType, const char*>> kDtypes = {
      {"fp32", {at::kFloat, "float32"}}, {"bf16", {at::kBFloat16, "bfloat16"}}, {"fp16", {at::kHalf, "float16"}}};
  const auto out_dtype = kDtypes.find(dtype);
  if (out_dtype == kDtypes.end())
    throw Error("launcher export: --dtype " + dtype + " is not one of fp32, bf16, fp16");
  const std::string dir = fs::exists(fs::path(checkpoint) / "manifest.json")
                              ? checkpoint
                              : checkpoint_dir(checkpoint, "");
  const Manifest m = read_manifest(dir);
  for (const char* name : {"config.json", kStoreLayoutFile}) verify_checkpoint_file(dir, m, name);
  // Checkpoints written before plugins.json export their plain parameters only.
  const bool has_plugins = m.files.count(kPluginsFile) > 0;
  if (has_plugins) verify_checkpoint_file(dir, m, kPluginsFile);

  RunInfo run;
  run.shape = read_hf_config(dir);
  run.output_dir = out_dir;
  std::vector<ParamInfo> planned;
  PluginHost plugins = has_plugins ? load_run_plugins((fs::path(dir) / kPluginsFile).string(), run, planned) : PluginHost();

  RankFiles files(dir, m);
  SavedStore saved(dir, std::ref(files));
  if (saved.base()) {
    const std::string base = base_dir.empty() ? saved.base()->dir : base_dir;
    const std::string left = "leaves its frozen parameters in the base model it was trained on, " + saved.base()->dir;
    if (!fs::is_directory(base))
      throw FileError(saved.path(), left + (base_dir.empty() ? ", which is not a directory now: pass --model_name_or_path "
                                                               "with where that model is"
                                                             : "; --model_name_or_path " + base + " is not a directory"));
    const std::string diff = saved.base()->difference(BaseSource::of(base));
    if (!diff.empty())
      throw FileError(saved.path(), left + "; " + base + " is another model (" + diff + ")" +
                                        (base_dir.empty() ? ": pass --model_name_or_path with where that model is" : ""));
    run.model_name_or_path = base;
    saved.read_base_from(base_tensors(saved, base, run, plugins, planned));
  }
  const SavedView view(saved);

  // Every parameter of the model in a plain format: its exact weight (the fp32 master where the run
  // kept one), whole from the shards of every rank, in fp32 and Hugging Face's layout — a view of
  // the mapped rank file where it lies in one (GPT-2's Conv1D weights a transposed view), so that
  // nothing is held until it is written, one tensor at a time (DeepSpeed's zero_to_fp32 holds the
  // model, DeepSpeed #4025). A weight saved in 16 bits (no masters) is converted, and held.
  std::map<std::string, at::Tensor> tensors;
  std::set<std::string> plain;
  const std::vector<ParamSpec> specs = parameter_specs(run.shape);
  int64_t parameters = 0;
  for (const ParamSpec& spec : specs) {
    parameters += spec.numel();
    if (!saved.contains(spec.name) || !view.format(spec.name).empty() || saved.shape(spec.name) != spec.shape)
      continue;  // a plugin's to write (checked below)
    const at::Tensor t = saved.view_weight(spec.name).to(at::kFloat);
    tensors[spec.name] = spec.transposed_on_disk ? t.t() : t;
    plain.insert(spec.name);
  }

  ConfigNode config = parse_json_text(hf_config_json(run.shape), "config.json");
  std::set<std::string> handled;
  ExportContext ctx{run, view, tensors, config, handled, merge};
  std::string writers;  // "quant: 8", the plugins that wrote parameters
  for (const LoadedPlugin& p : plugins.plugins()) {
    const size_t before = handled.size();
    plugins.call(p, "export_model", -1, [&](Plugin& plugin) { plugin.export_model(ctx); });
    if (handled.size() > before) writers += (writers.empty() ? "" : ", ") + p.name + ": " + std::to_string(handled.size() - before);
  }

  const std::string by = has_plugins ? " by the plugins of its run (" + (fs::path(dir) / kPluginsFile).string() + ")"
                                     : " (the checkpoint predates plugins.json: export writes plain parameters only)";
  for (const std::string& name : saved.param_names()) {
    if (plain.count(name) || handled.count(name)) continue;
    const std::string& format = view.format(name);
    throw FileError(saved.path(), "keeps '" + name + "'" + (format.empty() ? std::string() : " as \"" + format + "\"") +
                                      ", which is not a parameter of the model in config.json in a plain format, "
                                      "and it was not exported" + by);
  }
  for (const ParamSpec& spec : specs) {
    if (!tensors.count(spec.name))
      throw FileError(saved.path(), "leaves the model's parameter '" + spec.name + "' unwritten: it is not saved "
                                    "in a plain format and was not exported" + by);
  }

  // In name order: a tensor's companions ("<name>.absmax", ...) follow it. The model's floating
  // parameters are written in --dtype, each converted as it is written.
  std::vector<std::pair<std::string, at::Tensor>> ordered(tensors.begin(), tensors.end());
  std::vector<at::ScalarType> as(ordered.size(), at::ScalarType::Undefined);
  if (out_dtype->second.first != at::kFloat) {
    std::map<std::string, int64_t> numel;
    for (const ParamSpec& spec : specs) numel[spec.name] = spec.numel();
    for (size_t i = 0; i < ordered.size(); ++i) {
      const auto it = numel.find(ordered[i].first);
      const at::Tensor& t = ordered[i].second;
      if (it != numel.end() && at::isFloatingType(t.scalar_type()) && t.numel() == it->second) as[i] = out_dtype->second.first;
    }
    config.set("torch_dtype", ConfigNode::string(out_dtype->second.second));
  }
  tensors.clear();
  save_hf_tensors(out_dir, config.to_json() + "\n", ordered, /*max_shard_bytes=*/0, as);
  return "exported " + dir + " to " + out_dir + ": config.json, model.safetensors (" +
         (writers.empty() ? dtype : "parameters written by plugins (" + writers + "), the rest " + dtype) +
         ", " + std::to_string(parameters) + " parameters in " + std::to_string(ordered.size()) +
         " tensors, from the exact weights saved by " + std::to_string(m.world_size) + " rank(s))";
}

}  // namespace memrt
