// Loads plugin libraries, checks their handshake, orders them, and dispatches phases with every
// failure attributed to the plugin, phase and step that raised it.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "config/train_config.h"
#include "memrt/plugin.h"

namespace memrt {

// One loaded plugin: its library stays loaded for the life of the process (code, vtables and
// deleters of a plugin must never dangle — see Boost.DLL's "missuses").
struct LoadedPlugin {
  std::string name;
  std::string version;
  std::string description;
  std::string library;     // absolute path of the shared library
  bool builtin = false;    // found in builtin_plugin_dir() by its name
  std::string config_key;  // what claimed it in the config ("fp16", "plugins[0]")
  int priority = 0;
  uint32_t abi_minor = MEMRT_PLUGIN_ABI_MINOR;  // the SDK minor it was built with
  ConfigNode options;      // its config subtree (what configure() receives)
  std::unique_ptr<Plugin, void (*)(Plugin*)> plugin{nullptr, nullptr};
};

// What the host was built with, compared against every plugin's memrt_plugin_info.
struct HostAbi {
  uint32_t abi_major = MEMRT_PLUGIN_ABI_MAJOR;
  uint32_t abi_minor = MEMRT_PLUGIN_ABI_MINOR;
  std::string torch_version = TORCH_VERSION;
  int cxx11_abi = MEMRT_CXX11_ABI;
  int cuda = MEMRT_TORCH_HAS_CUDA;
};

// The ABI minor that added `phase` (0 for the phases of 2.0): PluginHost never calls a phase on a
// plugin built with an older minor.
uint32_t phase_abi_minor(const char* phase);

// Checks one plugin's handshake against the host; throws PluginError naming both sides.
void check_plugin_abi(const memrt_plugin_info& info, const std::string& library, const HostAbi& host);

// The folder holding the built-in plugins: <dir of libmemrt>/memrt/plugins, or $MEMRT_PLUGIN_DIR.
std::string builtin_plugin_dir();

class PluginHost;

// plugins.json, saved in every checkpoint (docs/checkpoints.md): the loaded plugins in order — name,
// version, library ("" for a built-in, found again by name), config_key and options (the config
// subtree configure() received) — so that `launcher export` loads and configures them as the run did.
std::string plugins_json(const PluginHost& host);
// The specs a plugins.json lists, in its order; memrt::FileError naming the file when malformed.
std::vector<PluginSpec> read_plugins_json(const std::string& path);

class PluginHost {
 public:
  PluginHost() = default;
  PluginHost(PluginHost&&) = default;
  PluginHost& operator=(PluginHost&&) = default;

  // Loads and instantiates every spec (built-ins from builtin_plugin_dir()), then orders them.
  // Throws PluginError for: library not found, not loadable, entry symbol missing, ABI/LibTorch
  // mismatch, two plugins with one name, declared conflicts, two plugins reducing gradients.
  static PluginHost load(const std::vector<PluginSpec>& specs, const HostAbi& host = HostAbi());

  // Adds an already constructed plugin (tests, plugins linked into the executable); call order()
  // after the last one.
  void add(std::string name, std::string config_key, std::unique_ptr<Plugin> plugin,
           ConfigNode options = {});

  // The configure phase: every plugin, in order, receives its own options and rejects what it does
  // not know (ConfigError naming the file and key).
  void configure(const RunInfo& run, ConfigDiagnostics& diag);
  // Stable sort by priority; validates conflicts. Called by load().
  void order();

  const std::vector<LoadedPlugin>& plugins() const { return plugins_; }
  bool empty() const { return plugins_.empty(); }
  bool any_reduces_gradients() const;
  // The resolved order as printed at start.
  std::string describe() const;

  // Calls fn(plugin) in priority order (or reversed), skipping plugins built with a minor older
  // than the phase's (phase_abi_minor). An exception from a plugin becomes a
  // PluginError "plugin 'x' failed in <phase> at step S: <what>"; `step` < 0 omits the step.
  void each(const char* phase, int64_t step, const std::function<void(Plugin&)>& fn);
  void each_reversed(const char* phase, int64_t step, const std::function<void(Plugin&)>& fn);

  // Every plugin's plan_params(), in priority order, on `params` (memrt/plugin.h). Returns the
  // frozen parameters the plugins' on_block_ready reads (ParamPlanContext::reads_frozen), or none
  // where a plugin built before ABI 2.20 is loaded: it cannot say, so it may read any of them.
  std::optional<std::set<std::string>> plan_params(std::vector<ParamInfo>& params, const RunInfo& run);

  // Every plugin's plan_store(), in priority order, each named as the author of its settings
  // (two plugins setting one axis differently is an error naming both); after_each(i), if
  // given, runs after plugin i's.
  void plan_store(StorePlan& plan, const RunInfo& run,
                  const std::function<void(size_t)>& after_each = {});

  // Every plugin's estimate_memory(), in priority order, on `estimate`; then every plugin's
  // plan_store() on estimate.store, the store's cells of the table following each. Returns one
  // term per plugin that changed the table in either phase.
  std::vector<memory::EstimateTerm> estimate_memory(memory::MemoryEstimate& estimate);

  // fn(plugin) for one plugin, with the same error attribution.
  void call(const LoadedPlugin& p, const char* phase, int64_t step,
            const std::function<void(Plugin&)>& fn) const;

  // Prints "<plugin>/<phase>" for every hook call (MEMRT_TRACE_HOOKS=1 or set_trace(true)).
  void set_trace(bool on) { trace_ = on; }

 private:
  std::vector<LoadedPlugin> plugins_;
  bool trace_ = false;
};

}  // namespace memrt
