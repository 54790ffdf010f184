// The engine's checkpoints (docs/checkpoints.md) and the stop signals that trigger one.
#include <signal.h>

#include <atomic>
#include <mutex>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <rapidjson/document.h>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/sha256.h"
#include "checkpoint/store_checkpoint.h"
#include "dist/process_group.h"
#include "engine/engine.h"
#include "io/safetensors.h"
#include "models/hf_checkpoint.h"
#include "models/model_factory.h"

namespace memrt {
namespace {

namespace fs = std::filesystem;

std::atomic<int> g_stop_signal{0};

extern "C" void memrt_on_stop_signal(int sig) {
  if (g_stop_signal.exchange(sig) != 0) {  // the second one: abort now
    ::signal(sig, SIG_DFL);
    ::raise(sig);
  }
}

std::string rank_file(int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank%05d.safetensors", rank);
  return name;
}

// A checkpoint's rank files, each verified against the manifest and opened on first use: a rank
// re-partitioning a checkpoint of another world size reads several.
class RankFiles {
 public:
  RankFiles(std::string dir, const Manifest& m) : dir_(std::move(dir)), manifest_(m) {}
  const SafetensorsFile& operator()(int rank) {
    auto it = files_.find(rank);
    if (it != files_.end()) return it->second;
    if (rank < 0 || rank >= manifest_.world_size)
      throw FileError((fs::path(dir_) / "manifest.json").string(),
                      "has no rank " + std::to_string(rank) + " (world size " +
                          std::to_string(manifest_.world_size) + ")");
    verify_checkpoint_file(dir_, manifest_, rank_file(rank));
    return files_.emplace(rank, SafetensorsFile::open((fs::path(dir_) / rank_file(rank)).string())).first->second;
  }

 private:
  std::string dir_;
  const Manifest& manifest_;
  std::map<int, SafetensorsFile> files_;
};

bool same_shape(const ModelShape& a, const ModelShape& b) {
  return a.arch == b.arch && a.n_layer == b.n_layer && a.n_head == b.n_head &&
         a.n_kv_head == b.n_kv_head && a.d_model == b.d_model && a.d_ff == b.d_ff &&
         a.vocab_size == b.vocab_size && a.n_ctx == b.n_ctx && a.tie_embeddings == b.tie_embeddings;
}

}  // namespace

void install_stop_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = memrt_on_stop_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
}

int stop_signal_received() { return g_stop_signal.load(); }

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
  std::vector<std::pair<std::string, at::Tensor>> tensors = store_shard_tensors(*store_);
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
  const std::string mine = rank_file(run_.rank);
  write_safetensors((tmp / mine).string(), tensors, metadata);
  uint64_t bytes = 0;
  const std::string sha = sha256_file((tmp / mine).string(), &bytes);
  const std::vector<std::string> parts =
      all_gather_strings(*dist_, mine + " " + std::to_string(bytes) + " " + sha);

  if (main) {
    write_file_atomic((tmp / "config.json").string(), hf_config_json(run_.shape));
    write_file_atomic((tmp / kStoreLayoutFile).string(), store_layout_json(*store_));
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
  }
  dist_->barrier();  // no rank goes on before the checkpoint exists
  return (out / tag).string();
}

void Engine::load_checkpoint(const std::string& dir) {
  const Manifest m = read_manifest(dir);
  for (const char* name : {"config.json", kStoreLayoutFile}) verify_checkpoint_file(dir, m, name);
  const ModelShape saved_shape = read_hf_config(dir);
  if (!same_shape(saved_shape, run_.shape)) {
    throw FileError((fs::path(dir) / "config.json").string(),
                    "describes another model than this run's (arch, sizes or tied embeddings "
                    "differ): resume with the train.yaml the checkpoint was made with");
  }

  // The store: every rank takes what it holds now from whichever saved shards have it, so the
  // checkpoint may come from any number of ranks.
  RankFiles files(dir, m);
  load_store(*store_, SavedStore(dir, std::ref(files)));

  // The rest of the state is this rank's own; on another world size, rank 0's (plugins, RNG,
  // counters: replicated) and every saved rank's optimizer entries (per parameter).
  const bool same_world = m.world_size == run_.world_size;
  const SafetensorsFile& state = files(same_world ? run_.rank : 0);
  const auto& meta = state.metadata();
  auto number = [&](const char* key) -> int64_t {
    auto it = meta.find(key);
    if (it == meta.end()) throw FileError(state.path(), std::string("lacks metadata \"") + key + "\"");
    return std::stoll(it->second);
  };
  rapidjson::Document versions;
  {
    auto it = meta.find("plugin_state_versions");
    versions.Parse(it == meta.end() ? "{}" : it->second.c_str());
    if (versions.HasParseError() || !versions.IsObject())
      throw FileError(state.path(), "metadata \"plugin_state_versions\" is not a JSON object");
  }
  TensorMap optimizer_state;
  std::map<std::string, TensorMap> plugin_states;
  for (const std::string& name : state.names()) {
    if (name.rfind("plugin/", 0) == 0) {
      const size_t slash = name.find('/', 7);
      plugin_states[name.substr(7, slash - 7)][name.substr(slash + 1)] = state.tensor(name).clone();
    }
  }
  for (int r = 0; r < m.world_size; ++r) {
    if (same_world && r != run_.rank) continue;
    const SafetensorsFile& f = files(r);
    for (const std::string& name : f.names())
      if (name.rfind("optimizer/", 0) == 0) optimizer_state.emplace(name.substr(10), f.tensor(name).clone());
  }
  for (const LoadedPlugin& p : plugins_.plugins()) {
    if (!versions.HasMember(p.name.c_str())) {
      TensorMap now;
      plugins_.call(p, "state_dict", -1, [&](Plugin& q) { now = q.state_dict(); });
      if (now.empty()) continue;  // nothing to restore
      throw FileError(state.path(), "holds no state of plugin '" + p.name +
                                        "', which this run loads: resume with the ds_config the "
                                        "checkpoint was made with");
    }
    const int version = versions[p.name.c_str()].GetInt();
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
  for (const auto& member : versions.GetObject()) {
    bool loaded = false;
    for (const LoadedPlugin& p : plugins_.plugins()) loaded |= p.name == member.name.GetString();
    if (!loaded) {
      throw FileError(state.path(), std::string("holds state of plugin '") + member.name.GetString() +
                                        "', which this run does not load: resume with the "
                                        "ds_config the checkpoint was made with");
    }
  }
  optimizer_->load_state_dict(optimizer_state);
  if (!state.contains("rng/cpu")) throw FileError(state.path(), "lacks the RNG state \"rng/cpu\"");
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(cpu.mutex());
  cpu.set_state(state.tensor("rng/cpu").clone());
  step_ = number("step");
  completed_steps_ = number("completed_steps");
  skipped_steps_ = number("skipped_steps");
  if (run_.rank == 0) {
    // metrics.jsonl continues the resumed run: lines of steps after the checkpoint are dropped.
    std::ifstream in(metrics_path_);
    std::string kept;
    for (std::string line; std::getline(in, line);) {
      const auto at = line.find("\"step\": ");
      if (at != std::string::npos && std::stoll(line.substr(at + 8)) <= step_) kept += line + "\n";
    }
    in.close();
    write_file_atomic(metrics_path_, kept);
    log_ << "resumed from " << dir << " at step " << step_;
    if (!same_world)
      log_ << " (saved by " << m.world_size << " rank(s), re-partitioned onto " << run_.world_size << ")";
    log_ << "\n";
  }
}

std::string export_checkpoint(const std::string& checkpoint, const std::string& out_dir) {
  const std::string dir = fs::exists(fs::path(checkpoint) / "manifest.json")
                              ? checkpoint
                              : checkpoint_dir(checkpoint, "");
  const Manifest m = read_manifest(dir);
  for (const char* name : {"config.json", kStoreLayoutFile}) verify_checkpoint_file(dir, m, name);
  std::shared_ptr<CausalLM> model = build_model(read_hf_config(dir), BuildOptions{});  // fp32

  // Each parameter whole, from the store's shards of every rank: its exact weight (the fp32
  // master where the run kept one).
  RankFiles files(dir, m);
  const SavedStore saved(dir, std::ref(files));
  at::NoGradGuard no_grad;
  int64_t tensors = 0;
  for (auto& item : model->named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    if (!saved.contains(name) || saved.shape(name) != item.value().sizes().vec()) {
      throw FileError(saved.path(), "has no parameter '" + name + "' of the shape the model in config.json "
                                    "gives it: the run changed the model's modules (e.g. adapters), "
                                    "which export does not merge");
    }
    saved.read(name, "weight", 0, item.value());
    ++tensors;
  }
  if (tensors != static_cast<int64_t>(saved.param_names().size())) {
    throw FileError(saved.path(), "lists " + std::to_string(saved.param_names().size()) +
                                      " parameters; the model in config.json has " +
                                      std::to_string(tensors) +
                                      ": the run changed the model's modules, which export does not merge");
  }
  save_hf_checkpoint(*model, out_dir);
  return "exported " + dir + " to " + out_dir + ": config.json, model.safetensors (fp32, " +
         std::to_string(count_parameters(*model)) + " parameters in " + std::to_string(tensors) +
         " tensors, from the exact weights saved by " + std::to_string(m.world_size) + " rank(s))";
}

}  // namespace memrt
