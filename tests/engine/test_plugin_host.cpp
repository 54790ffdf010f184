// The plugin loader: each failure has its own message naming what failed and both sides of a
// mismatch; order is by priority, after-phases reversed; hook exceptions name plugin/phase/step.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "plugin/plugin_host.h"

namespace memrt {
namespace {

namespace fs = std::filesystem;

PluginSpec spec(const std::string& name, const std::string& library, const std::string& key) {
  PluginSpec s;
  s.name = name;
  s.library = library;
  s.config_key = key;
  return s;
}

std::string load_error(const std::vector<PluginSpec>& specs, const HostAbi& host = HostAbi()) {
  try {
    PluginHost::load(specs, host);
  } catch (const PluginError& e) {
    return e.what();
  }
  return "(no error)";
}

#define EXPECT_HAS(haystack, needle) EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
    << "expected to find \"" << (needle) << "\" in: " << (haystack)

TEST(PluginHost, LoadsAWellFormedPlugin) {
  PluginHost host = PluginHost::load({spec("fixture_good", FIXTURE_GOOD, "plugins[0]")});
  ASSERT_EQ(host.plugins().size(), 1u);
  const LoadedPlugin& p = host.plugins()[0];
  EXPECT_EQ(p.name, "fixture_good");
  EXPECT_EQ(p.version, "1.2.3");
  EXPECT_EQ(p.priority, 700);
  EXPECT_TRUE(fs::path(p.library).is_absolute());
  EXPECT_HAS(host.describe(), "fixture_good 1.2.3  priority 700  [plugins[0]]");
}

TEST(PluginHost, ConfigNameMustMatchTheLibrarysName) {
  std::string e = load_error({spec("guard", FIXTURE_GOOD, "plugins[0]")});
  EXPECT_HAS(e, "calls itself 'fixture_good', but the config names it 'guard'");
  EXPECT_HAS(e, "\"name\": \"fixture_good\"");
}

TEST(PluginHost, MissingLibraryIsNamed) {
  std::string e = load_error({spec("x", "no/such/libx.so", "plugins[2]")});
  EXPECT_HAS(e, "no/such/libx.so not found");
  EXPECT_HAS(e, "plugins[2]");
}

TEST(PluginHost, MissingBuiltinSaysItIsNotInThisBuild) {
  std::string e = load_error({spec("no_such_builtin", "", "no_such_section")});
  EXPECT_HAS(e, "built-in plugin 'no_such_builtin'");
  EXPECT_HAS(e, "claimed by config key 'no_such_section'");
  EXPECT_HAS(e, "libmemrt_no_such_builtin.so does not exist");
}

TEST(PluginHost, FileThatIsNotALibrary) {
  fs::path f = fs::temp_directory_path() / ("memrt_not_a_library_" + std::to_string(getpid()) + ".so");
  std::ofstream(f) << "just text\n";
  std::string e = load_error({spec("x", f.string(), "plugins[0]")});
  fs::remove(f);
  EXPECT_HAS(e, "could not be loaded");
  EXPECT_HAS(e, f.string());
}

TEST(PluginHost, LibraryWithoutEntrySymbol) {
  std::string e = load_error({spec("x", FIXTURE_NO_ENTRY, "plugins[0]")});
  EXPECT_HAS(e, "has no entry symbol 'memrt_plugin_entry'");
  EXPECT_HAS(e, "MEMRT_PLUGIN(");
}

TEST(PluginHost, AbiMajorMismatchNamesBothSides) {
  std::string e = load_error({spec("fixture_abi", FIXTURE_BAD_ABI, "plugins[0]")});
  EXPECT_HAS(e, "plugin ABI 99.0");
  EXPECT_HAS(e, "host's ABI " + std::to_string(MEMRT_PLUGIN_ABI_MAJOR) + "." +
                    std::to_string(MEMRT_PLUGIN_ABI_MINOR));
}

TEST(PluginHost, TorchVersionMismatchNamesBothSides) {
  std::string e = load_error({spec("fixture_torch", FIXTURE_OTHER_TORCH, "plugins[0]")});
  EXPECT_HAS(e, "built against LibTorch 1.13.1");
  EXPECT_HAS(e, std::string("host runs LibTorch ") + TORCH_VERSION);
}

memrt_plugin_info good_info() {
  return {sizeof(memrt_plugin_info), MEMRT_PLUGIN_ABI_MAJOR, MEMRT_PLUGIN_ABI_MINOR, TORCH_VERSION,
          MEMRT_CXX11_ABI, MEMRT_TORCH_HAS_CUDA, "p", "1", "",
          []() -> Plugin* { return nullptr; }, [](Plugin*) {}};
}

TEST(PluginAbi, NewerMinorIsRefused) {
  memrt_plugin_info info = good_info();
  info.abi_minor = MEMRT_PLUGIN_ABI_MINOR + 1;
  try {
    check_plugin_abi(info, "libp.so", HostAbi());
    FAIL() << "accepted a plugin needing a newer ABI";
  } catch (const PluginError& e) {
    EXPECT_HAS(e.what(), "this host provides only");
  }
}

TEST(PluginAbi, OlderMinorIsAccepted) {
  HostAbi host;
  host.abi_minor = MEMRT_PLUGIN_ABI_MINOR + 3;
  EXPECT_NO_THROW(check_plugin_abi(good_info(), "libp.so", host));
}

TEST(PluginAbi, CudaAndCxxAbiMismatches) {
  memrt_plugin_info info = good_info();
  info.cuda = !MEMRT_TORCH_HAS_CUDA;
  EXPECT_THROW(
      {
        try {
          check_plugin_abi(info, "libp.so", HostAbi());
        } catch (const PluginError& e) {
          EXPECT_HAS(e.what(), "CUDA");
          throw;
        }
      },
      PluginError);
  info = good_info();
  info.cxx11_abi = !MEMRT_CXX11_ABI;
  EXPECT_THROW(
      {
        try {
          check_plugin_abi(info, "libp.so", HostAbi());
        } catch (const PluginError& e) {
          EXPECT_HAS(e.what(), "_GLIBCXX_USE_CXX11_ABI");
          throw;
        }
      },
      PluginError);
}

TEST(PluginHost, TwoPluginsWithOneName) {
  std::string e = load_error({spec("fixture_good", FIXTURE_GOOD, "plugins[0]"),
                              spec("fixture_good", FIXTURE_GOOD, "plugins[1]")});
  EXPECT_HAS(e, "two plugins are named 'fixture_good'");
  EXPECT_HAS(e, "plugins[0]");
  EXPECT_HAS(e, "plugins[1]");
}

TEST(PluginHost, DeclaredConflictNamesBoth) {
  std::string e = load_error({spec("fixture_good", FIXTURE_GOOD, "plugins[0]"),
                              spec("fixture_conflict", FIXTURE_CONFLICT, "plugins[1]")});
  EXPECT_HAS(e, "plugin 'fixture_conflict' (config key 'plugins[1]') cannot run together with "
                "plugin 'fixture_good' (config key 'plugins[0]')");
}

// A plugin that records its calls into a shared log.
class Recorder : public Plugin {
 public:
  Recorder(std::string name, int prio, std::vector<std::string>* log) : name_(std::move(name)), prio_(prio), log_(log) {}
  int priority() const override { return prio_; }
  void record(const std::string& phase) { log_->push_back(name_ + "/" + phase); }

 private:
  std::string name_;
  int prio_;
  std::vector<std::string>* log_;
};

TEST(PluginHost, OrderIsByPriorityAndAfterPhasesReverse) {
  std::vector<std::string> log;
  PluginHost host;
  host.add("late", "plugins[0]", std::make_unique<Recorder>("late", 900, &log));
  host.add("early", "plugins[1]", std::make_unique<Recorder>("early", 100, &log));
  host.add("middle", "plugins[2]", std::make_unique<Recorder>("middle", 500, &log));
  host.order();
  host.each("before_forward", 0, [](Plugin& p) { static_cast<Recorder&>(p).record("before_forward"); });
  host.each_reversed("after_forward", 0,
                     [](Plugin& p) { static_cast<Recorder&>(p).record("after_forward"); });
  EXPECT_EQ(log, (std::vector<std::string>{"early/before_forward", "middle/before_forward",
                                           "late/before_forward", "late/after_forward",
                                           "middle/after_forward", "early/after_forward"}));
}

// fixture_abi21 is compiled against a copy of the ABI 2.1 header: its vtable ends before
// plan_params (2.2). The host loads it, calls it in 2.1's phases and never in plan_params — a call
// there would jump past the end of its vtable.
TEST(PluginAbi, APluginBuiltWithAnOlderMinorIsNeverCalledInALaterPhase) {
  EXPECT_EQ(phase_abi_minor("plan_params"), 2u);
  EXPECT_EQ(phase_abi_minor("estimate_planned_memory"), 4u);
  EXPECT_EQ(phase_abi_minor("estimate_memory"), 0u);
  PluginHost host = PluginHost::load({spec("fixture_abi21", FIXTURE_ABI21, "plugins[0]")});
  ASSERT_EQ(host.plugins().size(), 1u);
  EXPECT_EQ(host.plugins()[0].abi_minor, 1u);
  RunInfo run;
  std::vector<ParamInfo> params = {{"w", {4}, at::kFloat, true, true}};
  host.set_trace(true);
  testing::internal::CaptureStderr();
  const std::optional<std::set<std::string>> reads = host.plan_params(params, run);
  memory::MemoryEstimate e;
  e.run = &run;
  host.estimate_memory(e);
  const std::string trace = testing::internal::GetCapturedStderr();
  EXPECT_EQ(trace, "[hook] fixture_abi21/estimate_memory\n");
  EXPECT_EQ(e.table.at(memory::Category::kOther), 1) << "2.1's phases are still called";
  EXPECT_TRUE(params[0].trainable);
  EXPECT_FALSE(reads) << "a plugin before 2.20 cannot name the frozen weights its on_block_ready reads";
}

// A plugin of this minor is called in plan_params: what it plans is what the host keeps, and the
// frozen weights it names are those the host reads whole for it (ParamPlanContext::reads_frozen).
class Freezer : public Plugin {
 public:
  void plan_params(ParamPlanContext& ctx) override {
    for (ParamInfo& p : ctx.params) p.trainable = p.name != "frozen";
    ctx.params.push_back({"added", {2, 3}, at::kFloat, true, false});
    ctx.reads_frozen.insert("frozen");
  }
};

TEST(PluginHost, PlanParamsEditsTheList) {
  PluginHost host;
  host.add("freezer", "plugins[0]", std::make_unique<Freezer>());
  host.order();
  RunInfo run;
  std::vector<ParamInfo> params = {{"frozen", {4}, at::kFloat, true, true},
                                   {"kept", {4}, at::kFloat, true, true}};
  const std::optional<std::set<std::string>> reads = host.plan_params(params, run);
  ASSERT_EQ(params.size(), 3u);
  EXPECT_EQ(reads, (std::set<std::string>{"frozen"}));
  EXPECT_FALSE(params[0].trainable);
  EXPECT_TRUE(params[1].trainable);
  EXPECT_EQ(params[2].name, "added");
}

class Thrower : public Plugin {};

TEST(PluginHost, HookExceptionNamesPluginPhaseAndStep) {
  PluginHost host;
  host.add("thrower", "plugins[0]", std::make_unique<Thrower>());
  host.order();
  try {
    host.each("after_forward", 3, [](Plugin&) { throw std::runtime_error("boom"); });
    FAIL() << "no error";
  } catch (const PluginError& e) {
    EXPECT_STREQ(e.what(), "plugin 'thrower' failed in after_forward at step 3: boom");
  }
}

}  // namespace
}  // namespace memrt
