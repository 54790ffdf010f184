// The engine's checkpoints (docs/checkpoints.md) and the stop signals that trigger one.
#include <signal.h>

#include <atomic>
#include <mutex>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <rapidjson/document.h>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/sha256.h"
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

  // This rank's state: optimizer, plugins, RNG; counters and versions in the metadata.
  std::vector<std::pair<std::string, at::Tensor>> tensors;
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
    save_hf_checkpoint(*model_, tmp.string());  // config.json, model.safetensors
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
    add_to_manifest(m, tmp.string(), "model.safetensors");
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
  if (m.world_size != run_.world_size) {
    throw FileError((fs::path(dir) / "manifest.json").string(),
                    "was saved by " + std::to_string(m.world_size) + " rank(s); this run has " +
                        std::to_string(run_.world_size) +
                        ": resume with --num_procs " + std::to_string(m.world_size));
  }
  const std::string mine = rank_file(run_.rank);
  for (const char* name : {"config.json", "model.safetensors"}) verify_checkpoint_file(dir, m, name);
  verify_checkpoint_file(dir, m, mine);
  const ModelShape saved = read_hf_config(dir);
  if (!same_shape(saved, run_.shape)) {
    throw FileError((fs::path(dir) / "config.json").string(),
                    "describes another model than this run's (arch, sizes or tied embeddings "
                    "differ): resume with the train.yaml the checkpoint was made with");
  }

  at::NoGradGuard no_grad;
  // The model's weights.
  HfWeights weights = HfWeights::open(dir);
  const std::vector<ParamSpec> specs = parameter_specs(run_.shape);
  weights.check(run_.shape, specs);
  auto params = model_->named_parameters(/*recurse=*/true);
  for (const ParamSpec& spec : specs) params[spec.name].copy_(weights.tensor(spec));

  // This rank's state.
  const SafetensorsFile state = SafetensorsFile::open((fs::path(dir) / mine).string());
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
    at::Tensor t = state.tensor(name).clone();
    if (name.rfind("optimizer/", 0) == 0) {
      optimizer_state[name.substr(10)] = t;
    } else if (name.rfind("plugin/", 0) == 0) {
      const size_t slash = name.find('/', 7);
      plugin_states[name.substr(7, slash - 7)][name.substr(slash + 1)] = t;
    }
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
    log_ << "resumed from " << dir << " at step " << step_ << "\n";
  }
}

std::string export_checkpoint(const std::string& checkpoint, const std::string& out_dir) {
  const std::string dir = fs::exists(fs::path(checkpoint) / "manifest.json")
                              ? checkpoint
                              : checkpoint_dir(checkpoint, "");
  const Manifest m = read_manifest(dir);
  for (const char* name : {"config.json", "model.safetensors"}) verify_checkpoint_file(dir, m, name);
  BuildOptions build;
  build.weights_dir = dir;
  std::shared_ptr<CausalLM> model = build_model(read_hf_config(dir), build);  // fp32
  auto params = model->named_parameters(/*recurse=*/true);

  // Exact weights (plugin.h, exact_weight_key): whichever plugin stores one, in whichever rank's
  // file, replaces the model file's (possibly rounded) copy. Ranks holding the same plugin's
  // replicated state agree; the lowest rank's copy is written.
  struct Claim {
    std::string plugin, file;
  };
  std::map<std::string, Claim> claims;  // parameter -> who stored its exact weight first
  std::set<std::string> claimants;
  at::NoGradGuard no_grad;
  for (int r = 0; r < m.world_size; ++r) {
    const std::string mine = rank_file(r);
    verify_checkpoint_file(dir, m, mine);
    const SafetensorsFile state = SafetensorsFile::open((fs::path(dir) / mine).string());
    for (const std::string& name : state.names()) {
      // optimizer/<key> (the parameter store's masters) or plugin/<plugin>/<key>, as
      // save_checkpoint writes them.
      std::string plugin, key;
      if (name.rfind("optimizer/", 0) == 0) {
        plugin = "optimizer";
        key = name.substr(10);
      } else if (name.rfind("plugin/", 0) == 0) {
        const size_t slash = name.find('/', 7);
        if (slash == std::string::npos) continue;
        plugin = name.substr(7, slash - 7);
        key = name.substr(slash + 1);
      } else {
        continue;
      }
      if (key.rfind(kExactWeightPrefix, 0) != 0) continue;
      const std::string param = key.substr(sizeof(kExactWeightPrefix) - 1);
      auto claimed = claims.find(param);
      if (claimed != claims.end()) {
        if (claimed->second.plugin == plugin) continue;  // the same plugin on another rank
        throw FileError(state.path(), "plugins '" + claimed->second.plugin + "' (in " +
                                          claimed->second.file + ") and '" + plugin +
                                          "' both store the exact weight of parameter '" + param +
                                          "' (memrt::exact_weight_key): at most one plugin may; "
                                          "export cannot tell which is right. Fix the plugins or "
                                          "drop one of them from the ds_config of the run");
      }
      if (!params.contains(param)) {
        throw FileError(state.path(), "tensor '" + name + "' is the exact weight of '" + param +
                                          "' stored by plugin '" + plugin +
                                          "', a parameter the model in config.json lacks");
      }
      const at::Tensor t = state.tensor(name);
      at::Tensor& p = params[param];
      if (!t.is_floating_point() || t.sizes() != p.sizes()) {
        throw FileError(state.path(), "tensor '" + name + "' (the exact weight of '" + param +
                                          "' stored by plugin '" + plugin + "') is " +
                                          std::string(c10::toString(t.scalar_type())) + " " +
                                          c10::str(t.sizes()) + "; expected a floating tensor of the "
                                          "parameter's shape " + c10::str(p.sizes()));
      }
      p.copy_(t);
      claims[param] = {plugin, state.path()};
      claimants.insert(plugin);
    }
  }
  save_hf_checkpoint(*model, out_dir);
  std::string from;
  for (const std::string& p : claimants) from += (from.empty() ? "" : ", ") + p;
  return "exported " + dir + " to " + out_dir + ": config.json, model.safetensors (fp32, " +
         std::to_string(count_parameters(*model)) + " parameters" +
         (claims.empty() ? std::string()
                         : "; " + std::to_string(claims.size()) +
                               " tensor(s) from the exact weights in rank state (" + from + ")") +
         ")";
}

}  // namespace memrt
