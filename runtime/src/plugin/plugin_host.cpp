#include "plugin/plugin_host.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <sstream>

#include <boost/dll/shared_library.hpp>

namespace memrt {
namespace fs = std::filesystem;

const char* to_string(SegmentKind kind) {
  switch (kind) {
    case SegmentKind::kEmbedding: return "embedding";
    case SegmentKind::kBlock: return "block";
    case SegmentKind::kHead: return "head";
  }
  return "?";
}

namespace {

// Libraries are never unloaded: a plugin's code must outlive every object, exception and
// std::function it handed to the host. One process-wide list, appended under load().
std::vector<boost::dll::shared_library>& loaded_libraries() {
  static auto* libs = new std::vector<boost::dll::shared_library>();
  return *libs;
}

std::string yes_no(int v) { return v ? "on" : "off"; }

}  // namespace

uint32_t phase_abi_minor(const char* phase) {
  // The phases a minor after 2.0 appended to Plugin (memrt/plugin.h); every other phase is 2.0's.
  static const std::pair<const char*, uint32_t> later[] = {{"plan_params", 2}, {"estimate_planned_memory", 4}, {"export_model", 8},
                                                           {"write_checkpoint_files", 9}};
  for (const auto& [name, minor] : later)
    if (std::string(name) == phase) return minor;
  return 0;
}

void check_plugin_abi(const memrt_plugin_info& info, const std::string& library,
                      const HostAbi& host) {
  const std::string who = "plugin library " + library;
  const std::string rebuild = " Rebuild the plugin against this memrt's installed SDK "
                              "(find_package(memrt) + memrt_add_plugin).";
  if (info.struct_size < sizeof(uint32_t) * 3 || info.abi_major != host.abi_major) {
    throw PluginError(who + ": plugin ABI " + std::to_string(info.abi_major) + "." +
                      std::to_string(info.abi_minor) + " is incompatible with the host's ABI " +
                      std::to_string(host.abi_major) + "." + std::to_string(host.abi_minor) +
                      " (major versions must match)." + rebuild);
  }
  if (info.abi_minor > host.abi_minor) {
    throw PluginError(who + ": plugin needs ABI " + std::to_string(info.abi_major) + "." +
                      std::to_string(info.abi_minor) + " but this host provides only " +
                      std::to_string(host.abi_major) + "." + std::to_string(host.abi_minor) +
                      ". Upgrade memrt or rebuild the plugin against this SDK.");
  }
  if (info.struct_size < sizeof(memrt_plugin_info)) {
    throw PluginError(who + ": its memrt_plugin_info is " + std::to_string(info.struct_size) +
                      " bytes, smaller than ABI " + std::to_string(info.abi_major) + "." +
                      std::to_string(info.abi_minor) + " defines." + rebuild);
  }
  const std::string torch = info.torch_version ? info.torch_version : "(none)";
  if (torch != host.torch_version) {
    throw PluginError(who + ": built against LibTorch " + torch + " but the host runs LibTorch " +
                      host.torch_version + "; plugins exchange at::Tensor with the host, so both "
                      "must use the same LibTorch." + rebuild);
  }
  if (info.cxx11_abi != host.cxx11_abi) {
    throw PluginError(who + ": built with _GLIBCXX_USE_CXX11_ABI=" +
                      std::to_string(info.cxx11_abi) + " but the host uses " +
                      std::to_string(host.cxx11_abi) + "." + rebuild);
  }
  if (info.cuda != host.cuda) {
    throw PluginError(who + ": built against a LibTorch with CUDA " + yes_no(info.cuda) +
                      " but the host's LibTorch has CUDA " + yes_no(host.cuda) + "." + rebuild);
  }
  if (!info.name || !*info.name || !info.create || !info.destroy) {
    throw PluginError(who + ": its memrt_plugin_info lacks a name, create or destroy function; "
                      "declare the plugin with MEMRT_PLUGIN(Class, name, version, description).");
  }
}

std::string builtin_plugin_dir() {
  if (const char* env = std::getenv("MEMRT_PLUGIN_DIR"); env && *env) return env;
  Dl_info dl{};
  if (dladdr(reinterpret_cast<void*>(&builtin_plugin_dir), &dl) && dl.dli_fname) {
    return (fs::path(dl.dli_fname).parent_path() / "memrt" / "plugins").string();
  }
  return "lib/memrt/plugins";
}

PluginHost PluginHost::load(const std::vector<PluginSpec>& specs, const HostAbi& host) {
  PluginHost out;
  for (const PluginSpec& spec : specs) {
    fs::path path;
    if (spec.library.empty()) {
      path = fs::path(builtin_plugin_dir()) / ("libmemrt_" + spec.name + ".so");
      if (!fs::exists(path)) {
        throw PluginError("built-in plugin '" + spec.name + "' (claimed by config key '" +
                          spec.config_key + "') is not available in this build: " +
                          path.string() + " does not exist. Build it (target memrt_plugins) or "
                          "set MEMRT_PLUGIN_DIR to the folder holding the built-in plugins.");
      }
    } else {
      path = spec.library;
      if (!fs::exists(path)) {
        throw PluginError("plugin '" + spec.name + "' (config key '" + spec.config_key +
                          "'): library " + path.string() + " not found. Check \"library\" in the "
                          "ds_config's plugins entry (relative paths are resolved against the "
                          "ds_config's folder).");
      }
    }
    path = fs::absolute(path);

    boost::dll::shared_library lib;
    boost::system::error_code ec;
    lib.load(path.string(), boost::dll::load_mode::default_mode, ec);
    if (ec) {
      const char* why = dlerror();
      throw PluginError("plugin library " + path.string() + " could not be loaded: " +
                        (why ? std::string(why) : ec.message()) +
                        ". Is it a shared library built for this machine and LibTorch?");
    }
    if (!lib.has(MEMRT_PLUGIN_ENTRY_SYMBOL)) {
      throw PluginError("plugin library " + path.string() + " has no entry symbol '" +
                        MEMRT_PLUGIN_ENTRY_SYMBOL + "': it is not a memrt plugin, or it lacks "
                        "MEMRT_PLUGIN(Class, name, version, description) in one of its sources.");
    }
    auto entry = lib.get<const memrt_plugin_info*()>(MEMRT_PLUGIN_ENTRY_SYMBOL);
    const memrt_plugin_info* info = entry();
    if (!info) throw PluginError("plugin library " + path.string() + ": entry symbol returned null");
    check_plugin_abi(*info, path.string(), host);
    if (spec.name != info->name) {
      throw PluginError("plugin library " + path.string() + " (config key '" + spec.config_key +
                        "') calls itself '" + info->name + "', but the config names it '" +
                        spec.name + "'; use \"name\": \"" + info->name + "\"");
    }
    loaded_libraries().push_back(lib);

    LoadedPlugin p;
    p.name = info->name;
    p.version = info->version ? info->version : "";
    p.abi_minor = info->abi_minor;
    p.description = info->description ? info->description : "";
    p.library = path.string();
    p.builtin = spec.library.empty();
    p.config_key = spec.config_key;
    p.options = spec.options;
    p.plugin = std::unique_ptr<Plugin, void (*)(Plugin*)>(info->create(), info->destroy);
    if (!p.plugin) throw PluginError("plugin '" + p.name + "': create() returned null");
    p.priority = p.plugin->priority();
    out.plugins_.push_back(std::move(p));
  }
  out.order();
  return out;
}

void PluginHost::add(std::string name, std::string config_key, std::unique_ptr<Plugin> plugin,
                     ConfigNode options) {
  LoadedPlugin p;
  p.name = std::move(name);
  p.library = "(linked in)";
  p.config_key = std::move(config_key);
  p.options = std::move(options);
  p.priority = plugin->priority();
  p.plugin = std::unique_ptr<Plugin, void (*)(Plugin*)>(plugin.release(),
                                                       [](Plugin* q) { delete q; });
  plugins_.push_back(std::move(p));
}

void PluginHost::order() {
  for (size_t i = 0; i < plugins_.size(); ++i) {
    for (size_t j = i + 1; j < plugins_.size(); ++j) {
      if (plugins_[i].name == plugins_[j].name) {
        throw PluginError("two plugins are named '" + plugins_[i].name + "': " +
                          plugins_[i].library + " (config key '" + plugins_[i].config_key +
                          "') and " + plugins_[j].library + " (config key '" +
                          plugins_[j].config_key + "'). Each config section is owned by one "
                          "plugin; remove one of them.");
      }
    }
  }
  for (const LoadedPlugin& a : plugins_) {
    for (const std::string& c : a.plugin->conflicts_with()) {
      for (const LoadedPlugin& b : plugins_) {
        if (b.name == c) {
          throw PluginError("plugin '" + a.name + "' (config key '" + a.config_key +
                            "') cannot run together with plugin '" + b.name + "' (config key '" +
                            b.config_key + "'); remove one of the two from the config.");
        }
      }
    }
  }
  const LoadedPlugin* reducer = nullptr;
  for (const LoadedPlugin& p : plugins_) {
    if (!p.plugin->reduces_gradients()) continue;
    if (reducer) {
      throw PluginError("plugins '" + reducer->name + "' and '" + p.name +
                        "' both reduce gradients across ranks; only one may.");
    }
    reducer = &p;
  }
  std::stable_sort(plugins_.begin(), plugins_.end(),
                   [](const LoadedPlugin& a, const LoadedPlugin& b) { return a.priority < b.priority; });
  if (const char* env = std::getenv("MEMRT_TRACE_HOOKS"); env && std::string(env) == "1") trace_ = true;
}

void PluginHost::configure(const RunInfo& run, ConfigDiagnostics& diag) {
  for (LoadedPlugin& p : plugins_) {
    call(p, "configure", -1, [&](Plugin& q) { q.configure(p.options, diag, run); });
  }
}

bool PluginHost::any_reduces_gradients() const {
  return std::any_of(plugins_.begin(), plugins_.end(),
                     [](const LoadedPlugin& p) { return p.plugin->reduces_gradients(); });
}

std::string plugins_json(const PluginHost& host) {
  ConfigNode list = ConfigNode::array();
  for (const LoadedPlugin& p : host.plugins()) {
    ConfigNode entry = ConfigNode::object();
    entry.set("name", ConfigNode::string(p.name));
    entry.set("version", ConfigNode::string(p.version));
    entry.set("library", ConfigNode::string(p.builtin ? "" : p.library));
    entry.set("config_key", ConfigNode::string(p.config_key));
    entry.set("options", p.options);
    list.push_back(std::move(entry));
  }
  ConfigNode doc = ConfigNode::object();
  doc.set("format", ConfigNode::string("memrt-plugins"));
  doc.set("version", ConfigNode::number(1));
  doc.set("plugins", std::move(list));
  return doc.to_json() + "\n";
}

std::vector<PluginSpec> read_plugins_json(const std::string& path) {
  const ConfigNode doc = parse_json_file(path);
  const ConfigNode* format = doc.find("format");
  const ConfigNode* version = doc.find("version");
  const ConfigNode* list = doc.find("plugins");
  if (!format || !format->is_string() || format->as_string() != "memrt-plugins" || !version ||
      !version->is_number() || version->as_int() != 1 || !list || !list->is_array())
    throw FileError(path, "is not a memrt plugins.json of version 1 ({\"format\": \"memrt-plugins\", "
                          "\"version\": 1, \"plugins\": [...]})");
  std::vector<PluginSpec> out;
  for (const ConfigNode& entry : list->as_array()) {
    const auto text = [&](const char* key) -> std::string {
      const ConfigNode* n = entry.find(key);
      if (!n || !n->is_string()) throw FileError(path, "plugin entry '" + entry.path() + "' has no string '" + key + "'");
      return n->as_string();
    };
    PluginSpec spec;
    spec.name = text("name");
    spec.library = text("library");
    spec.config_key = text("config_key");
    if (const ConfigNode* options = entry.find("options")) spec.options = *options;
    out.push_back(std::move(spec));
  }
  return out;
}

std::string PluginHost::describe() const {
  std::ostringstream os;
  if (plugins_.empty()) return "plugins: none\n";
  os << "plugins (before-phases in this order, after-phases reversed):\n";
  int i = 1;
  for (const LoadedPlugin& p : plugins_) {
    os << "  " << i++ << ". " << p.name;
    if (!p.version.empty()) os << " " << p.version;
    os << "  priority " << p.priority << "  [" << p.config_key << "]  " << p.library << "\n";
  }
  return os.str();
}

void PluginHost::call(const LoadedPlugin& p, const char* phase, int64_t step,
                      const std::function<void(Plugin&)>& fn) const {
  // A plugin built with an older minor has no vtable slot for a later phase: never call it.
  if (p.abi_minor < phase_abi_minor(phase)) return;
  if (trace_) std::cerr << "[hook] " << p.name << "/" << phase << "\n";
  try {
    fn(*p.plugin);
  } catch (const PluginError&) {
    throw;  // already attributed (a nested dispatch)
  } catch (const ConfigError&) {
    throw;  // names the file and key already
  } catch (const std::exception& e) {
    std::string where = "plugin '" + p.name + "' failed in " + phase;
    if (step >= 0) where += " at step " + std::to_string(step);
    throw PluginError(where + ": " + e.what());
  }
}

std::optional<std::set<std::string>> PluginHost::plan_params(std::vector<ParamInfo>& params, const RunInfo& run) {
  std::set<std::string> reads_frozen;
  ParamPlanContext ctx{params, run, reads_frozen};
  each("plan_params", -1, [&](Plugin& q) { q.plan_params(ctx); });
  constexpr uint32_t kReadsFrozenMinor = 20;  // ParamPlanContext::reads_frozen
  for (const LoadedPlugin& p : plugins_)
    if (p.abi_minor < kReadsFrozenMinor) return std::nullopt;
  return reads_frozen;
}

void PluginHost::plan_store(StorePlan& plan, const RunInfo& run,
                            const std::function<void(size_t)>& after_each) {
  StorePlanContext ctx{plan, run};
  for (size_t i = 0; i < plugins_.size(); ++i) {
    plan.set_author(plugins_[i].name);
    call(plugins_[i], "plan_store", -1, [&](Plugin& q) { q.plan_store(ctx); });
    if (after_each) after_each(i);
  }
  plan.set_author("");
}

std::vector<memory::EstimateTerm> PluginHost::estimate_memory(memory::MemoryEstimate& estimate) {
  std::vector<memory::Table> deltas(plugins_.size());
  for (size_t i = 0; i < plugins_.size(); ++i) {
    const memory::Table before = estimate.table;
    call(plugins_[i], "estimate_memory", -1, [&](Plugin& q) { q.estimate_memory(estimate); });
    deltas[i] = estimate.table - before;
  }
  if (estimate.store) {
    // The store's cells follow each plugin's settings; the change is that plugin's term too.
    memory::Table last = estimate.store->bytes();
    plan_store(*estimate.store, *estimate.run, [&](size_t i) {
      const memory::Table now = estimate.store->bytes();
      const memory::Table change = now - last;
      for (memory::Category c : memory::all_categories())
        for (memory::Placement pl : {memory::Placement::kDevice, memory::Placement::kHost}) {
          estimate.table.at(c, pl) += change.at(c, pl);
          deltas[i].at(c, pl) += change.at(c, pl);
        }
      last = now;
    });
    estimate.store->check();
  }
  for (size_t i = 0; i < plugins_.size(); ++i) {
    const memory::Table before = estimate.table;
    call(plugins_[i], "estimate_planned_memory", -1, [&](Plugin& q) { q.estimate_planned_memory(estimate); });
    deltas[i] = deltas[i] + (estimate.table - before);
  }
  std::vector<memory::EstimateTerm> terms;
  for (size_t i = 0; i < plugins_.size(); ++i)
    if (!(deltas[i] == memory::Table())) terms.push_back({plugins_[i].name, deltas[i]});
  return terms;
}

void PluginHost::each(const char* phase, int64_t step, const std::function<void(Plugin&)>& fn) {
  for (LoadedPlugin& p : plugins_) call(p, phase, step, fn);
}

void PluginHost::each_reversed(const char* phase, int64_t step,
                               const std::function<void(Plugin&)>& fn) {
  for (auto it = plugins_.rbegin(); it != plugins_.rend(); ++it) call(*it, phase, step, fn);
}

}  // namespace memrt
