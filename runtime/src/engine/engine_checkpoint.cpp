// The engine's checkpoints (docs/checkpoints.md): save and resume.
#include <mutex>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/saved_view.h"
#include "checkpoint/sha256.h"
#include "checkpoint/store_checkpoint.h"
#include "dist/process_group.h"
#include "engine/engine.h"
#include "memrt/safetensors.h"
#include "models/hf_checkpoint.h"
#include "models/model_factory.h"

namespace memrt {
namespace {

namespace fs = std::filesystem;

bool same_shape(const ModelShape& a, const ModelShape& b) {
  return a.arch == b.arch && a.n_layer == b.n_layer && a.n_head == b.n_head &&
         a.n_kv_head == b.n_kv_head && a.d_model == b.d_model && a.d_ff == b.d_ff &&
         a.vocab_size == b.vocab_size && a.n_ctx == b.n_ctx && a.tie_embeddings == b.tie_embeddings;
}

}  // namespace

std::string Engine::save_checkpoint() {
  const std::string tag = checkpoint_tag(step_);
  const fs::path out(cfg_.output_dir);
  const fs::path tmp = out / (".tmp_" + tag);
  const bool main = run_.rank == 0;
  if (main) {
    fs::create_directories(out);
    fs::remove_all(tmp);  // what a killed save left
    fs::create_directories(tmp);
  }
  dist_->barrier();

  // This rank's state: its share of the store, the optimizer's own state, plugins, RNG; counters
  // and versions in the metadata.
  std::vector<std::pair<std::string, at::Tensor>> tensors = store_shard_tensors(*store_, base_ ? &*base_ : nullptr);
  for (const auto& [key, t] : optimizer_->state_dict()) tensors.emplace_back("optimizer/" + key, t);
  std::ostringstream versions;
  versions << "{";
  for (const LoadedPlugin& p : plugins_.plugins()) {
    TensorMap state;
    plugins_.call(p, "state_dict", step_, [&](Plugin& q) { state = q.state_dict(); });
    if (state.empty()) continue;  // a plugin without state leaves no trace
    for (const auto& [key, t] : state) tensors.emplace_back("plugin/" + p.name + "/" + key, t);
    versions << (versions.tellp() > 1 ? ", " : "") << "\"" << p.name << "\": " << p.plugin->state_version();
  }
  versions << "}";
  {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    tensors.emplace_back("rng/cpu", cpu.get_state());
  }
  const std::map<std::string, std::string> metadata = {
      {"format", "memrt-checkpoint"},
      {"version", std::to_string(kCheckpointFormatVersion)},
      {"step", std::to_string(step_)},
      {"completed_steps", std::to_string(completed_steps_)},
      {"skipped_steps", std::to_string(skipped_steps_)},
      {"rank", std::to_string(run_.rank)},
      {"world_size", std::to_string(run_.world_size)},
      {"optimizer", optimizer_->name()},
      {"plugin_state_versions", versions.str()},
  };
  const std::string mine = rank_file_name(run_.rank);
  write_safetensors((tmp / mine).string(), tensors, metadata);
  uint64_t bytes = 0;
  const std::string sha = sha256_file((tmp / mine).string(), &bytes);
  const std::vector<std::string> parts =
      all_gather_strings(*dist_, mine + " " + std::to_string(bytes) + " " + sha);

  if (main) {
    write_file_atomic((tmp / "config.json").string(), hf_config_json(run_.shape));
    write_file_atomic((tmp / kStoreLayoutFile).string(), store_layout_json(*store_, base_ ? &*base_ : nullptr));
    write_file_atomic((tmp / kPluginsFile).string(), plugins_json(plugins_));
    Manifest m;
    m.tag = tag;
    m.step = step_;
    m.world_size = run_.world_size;
    for (const std::string& part : parts) {
      std::istringstream in(part);
      std::string name;
      ManifestEntry e;
      in >> name >> e.bytes >> e.sha256;
      m.files[name] = e;
    }
    add_to_manifest(m, tmp.string(), "config.json");
    add_to_manifest(m, tmp.string(), kStoreLayoutFile);
    add_to_manifest(m, tmp.string(), kPluginsFile);
    // The plugins' own files, from the checkpoint as written (every rank's share is on disk).
    {
      std::map<int, SafetensorsFile> opened;
      SavedStore saved(tmp.string(), [&](int r) -> const SafetensorsFile& {
        auto it = opened.find(r);
        if (it == opened.end()) it = opened.emplace(r, SafetensorsFile::open((tmp / rank_file_name(r)).string())).first;
        return it->second;
      });
      saved.read_base_from(frozen_tensors_of(*store_));
      const SavedView view(saved);
      const std::string dir = tmp.string();
      std::vector<std::string> files;
      CheckpointFilesContext ctx{run_, view, dir, files};
      plugins_.each("write_checkpoint_files", step_, [&](Plugin& p) { p.write_checkpoint_files(ctx); });
      for (const std::string& f : files) {
        if (m.files.count(f))
          throw Error("a plugin's write_checkpoint_files listed '" + f + "', a file the checkpoint already has");
        add_to_manifest(m, dir, f);
      }
    }
    write_manifest(tmp.string(), m);
    fsync_path(tmp.string());
    // Only now does the checkpoint appear, whole; an older one of the same tag goes after.
    const fs::path final_dir = out / tag;
    const fs::path old = out / (".old_" + tag);
    fs::remove_all(old);
    if (fs::exists(final_dir)) fs::rename(final_dir, old);
    fs::rename(tmp, final_dir);
    fsync_path(out.string());
    write_file_atomic((out / "latest").string(), tag + "\n");
    fs::remove_all(old);
    if (cfg_.save_total_limit > 0) prune_checkpoints(out.string(), cfg_.save_total_limit, tag);
    log_ << "checkpoint saved: " << final_dir.string() << "\n" << std::flush;
    // DeepSpeed's stage3_gather_16bit_weights_on_model_save: the model as one Hugging Face
    // directory beside the rank files, in the compute dtype — what `launcher export` writes from it.
    if (cfg_.save_consolidated_model) {
      log_ << export_checkpoint(final_dir.string(), (final_dir / "model").string(), /*merge=*/false,
                                cfg_.compute_dtype, base_ ? base_->dir : "")
           << "\n" << std::flush;
    }
  }
  dist_->barrier();  // no rank goes on before the checkpoint exists
  return (out / tag).string();
}

void Engine::load_checkpoint(const std::string& dir) {
  const Manifest m = read_manifest(dir);
  for (const char* name : {"config.json", kStoreLayoutFile}) verify_checkpoint_file(dir, m, name);
  // Not read on resume (the run's own config loads the plugins), but export reads it: a damaged one
  // is found now, while the run that can rewrite it is running.
  if (m.files.count(kPluginsFile)) verify_checkpoint_file(dir, m, kPluginsFile);
  const ModelShape saved_shape = read_hf_config(dir);
  if (!same_shape(saved_shape, run_.shape)) {
    throw FileError((fs::path(dir) / "config.json").string(),
                    "describes another model than this run's (arch, sizes or tied embeddings "
                    "differ): resume with the train.yaml the checkpoint was made with");
  }

  // The store: every rank reads its partition of every buffer from whichever saved shards have it
  // (on the world size that saved it, its own file: a rank reads and hashes 1/N of the
  // checkpoint), then the replicated buffers are all-gathered. So the checkpoint may come from any
  // number of ranks and any stage.
  RankFiles files(dir, m);
  {
    const SavedStore saved(dir, std::ref(files));
    if (saved.base()) {  // the frozen parameters are the ones this run built from its model_name_or_path
      const std::string trained = "the checkpoint leaves its frozen parameters in the base model it was trained on, " +
                                  saved.base()->dir;
      if (!base_)
        throw FileError(saved.path(), trained + ", and this run reads no model_name_or_path: set model_name_or_path "
                                                "to that directory (or a copy of it)");
      const std::string diff = saved.base()->difference(*base_);
      if (!diff.empty())
        throw FileError(saved.path(), trained + "; this run's model_name_or_path, " + base_->dir + ", is another model (" +
                                          diff + "): resume with the base the checkpoint was trained on");
    }
    load_store(*store_, saved, LoadShare::kPartition);
    complete_loaded_store(*store_, saved, *dist_);
  }

  // The rest of the state is this rank's own; on another world size, rank 0's (plugins, RNG,
  // counters and every parameter's update count: the same on every rank).
  const bool same_world = m.world_size == run_.world_size;
  const SafetensorsFile& state = files(same_world ? run_.rank : 0);
  const RankFileMetadata meta = parse_rank_metadata(state.metadata(), state.path());
  TensorMap optimizer_state;
  std::map<std::string, TensorMap> plugin_states;
  for (const std::string& name : state.names()) {
    if (name.rfind("plugin/", 0) == 0) {
      const size_t slash = name.find('/', 7);
      plugin_states[name.substr(7, slash - 7)][name.substr(slash + 1)] = state.tensor(name).clone();
    }
  }
  for (const std::string& name : state.names())
    if (name.rfind("optimizer/", 0) == 0) optimizer_state.emplace(name.substr(10), state.tensor(name).clone());
  for (const LoadedPlugin& p : plugins_.plugins()) {
    auto saved = meta.plugin_state_versions.find(p.name);
    if (saved == meta.plugin_state_versions.end()) {
      TensorMap now;
      plugins_.call(p, "state_dict", -1, [&](Plugin& q) { now = q.state_dict(); });
      if (now.empty()) continue;  // nothing to restore
      throw FileError(state.path(), "holds no state of plugin '" + p.name +
                                        "', which this run loads: resume with the ds_config the "
                                        "checkpoint was made with");
    }
    const int version = saved->second;
    if (version > p.plugin->state_version()) {
      throw FileError(state.path(), "holds plugin '" + p.name + "' state version " +
                                        std::to_string(version) + ", newer than this plugin (" +
                                        p.version + ") reads (" +
                                        std::to_string(p.plugin->state_version()) +
                                        "): use the plugin version that wrote it");
    }
    plugins_.call(p, "load_state_dict", -1, [&](Plugin& q) { q.load_state_dict(plugin_states[p.name], version); });
    plugin_states.erase(p.name);
  }
  for (const auto& [name, version] : meta.plugin_state_versions) {
    bool loaded = false;
    for (const LoadedPlugin& p : plugins_.plugins()) loaded |= p.name == name;
    if (!loaded) {
      throw FileError(state.path(), "holds state of plugin '" + name +
                                        "', which this run does not load: resume with the "
                                        "ds_config the checkpoint was made with");
    }
  }
  if (optimizer_) optimizer_->load_state_dict(optimizer_state);  // (launcher eval builds none)
  if (!state.contains("rng/cpu")) throw FileError(state.path(), "lacks the RNG state \"rng/cpu\"");
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(cpu.mutex());
  cpu.set_state(state.tensor("rng/cpu").clone());
  step_ = meta.step;
  completed_steps_ = meta.completed_steps;
  skipped_steps_ = meta.skipped_steps;
  if (run_.rank == 0 && !metrics_path_.empty()) {  // (launcher eval leaves metrics.jsonl alone)
    // metrics.jsonl continues the resumed run: lines of steps after the checkpoint are dropped,
    // and so is a torn last line (a run killed while writing it).
    int64_t dropped = 0;
    std::ifstream in(metrics_path_, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    in.close();
    write_file_atomic(metrics_path_, metrics_up_to(text.str(), step_, &dropped));
    if (dropped > 0)
      log_ << "warning: " << metrics_path_ << ": dropped " << dropped
           << " unreadable line(s) (a run killed while writing it leaves a torn last line)\n";
  }
  if (run_.rank == 0) {
    log_ << (eval_only_ ? "loaded " : "resumed from ") << dir << " at step " << step_;
    if (!same_world)
      log_ << " (saved by " << m.world_size << " rank(s), re-partitioned onto " << run_.world_size << ")";
    log_ << "; rank 0 read " << files.opened() << " of " << m.world_size << " rank file(s)\n";
  }
}

}  // namespace memrt
