// Every real ds_config in ../shared/data/ds_configs, carried through to the plugins: those the
// config loader accepts load their built-in plugins, whose configure() either accepts the
// options or rejects them with a memrt error naming a key of that file — never a crash, never
// another exception. (tests/config/test_real_configs.cpp covers the loader alone.)
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include "config/load_config.h"
#include "engine/engine.h"
#include "plugin/plugin_host.h"
#include "run_helpers.h"

namespace memrt {
namespace {

namespace fs = std::filesystem;

void collect_keys(const ConfigNode& n, std::set<std::string>& out) {
  if (n.is_object()) {
    for (const auto& [k, v] : n.members()) {
      out.insert(k);
      collect_keys(v, out);
    }
  } else if (n.is_array()) {
    for (const auto& v : n.as_array()) collect_keys(v, out);
  }
}

TEST(RealConfigsWithPlugins, EveryFileLoadsOrNamesAKey) {
  const fs::path dir = fs::path(MEMRT_SOURCE_DIR) / ".." / "shared" / "data" / "ds_configs";
  if (!fs::is_directory(dir)) GTEST_SKIP() << dir << " is absent";
  const fs::path scratch = fs::temp_directory_path() / ("memrt_real_plugins_" + std::to_string(getpid()));
  fs::create_directories(scratch);
  std::ofstream(scratch / "train.yaml") << "max_steps: 10\n";
  // The files the loader accepts and a plugin's configure refuses, with the key it names (the
  // loader's verdicts are pinned in tests/config/test_real_configs.cpp).
  const std::map<std::string, std::string> refused_by_a_plugin = {
      {"deepspeedai__DeepSpeedExamples__training__DeepSpeed-ZenFlow__finetuning__zf_config.json",
       "zero_optimization.zenflow"},
  };

  int files = 0, loaded = 0, refused = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".json") continue;
    ++files;
    const std::string name = entry.path().filename().string();
    SCOPED_TRACE(name);
    ConfigSources src;
    src.ds_config_path = entry.path().string();
    src.train_yaml_path = (scratch / "train.yaml").string();
    const ConfigNode tree = parse_json_file(src.ds_config_path);
    std::set<std::string> keys;
    collect_keys(tree, keys);
    TrainConfig cfg;
    try {
      cfg = load_train_config(src);
    } catch (const ConfigError&) {
      continue;  // the loader's verdict
    }
    ++loaded;
    std::string verdict;
    try {
      PluginHost host = PluginHost::load(cfg.plugins);
      ConfigDiagnostics diag;
      host.configure(make_run_info(cfg, 0, 1, 0), diag);
    } catch (const ConfigError& e) {
      verdict = e.key_path();
      std::cout << name << ": " << e.what() << "\n";
    } catch (const Error& e) {  // PluginError, ...: must still name a key of the file
      verdict = "<" + std::string(e.what()) + ">";
      bool names_a_key = false;
      for (const std::string& k : keys) names_a_key |= verdict.find("'" + k) != std::string::npos ||
                                                       verdict.find("." + k) != std::string::npos ||
                                                       verdict.find(k + "'") != std::string::npos;
      EXPECT_TRUE(names_a_key) << "rejected without naming a key of the file: " << e.what();
    }
    const auto it = refused_by_a_plugin.find(name);
    EXPECT_EQ(verdict, it != refused_by_a_plugin.end() ? it->second : std::string());
    refused += !verdict.empty();
  }
  fs::remove_all(scratch);
  EXPECT_EQ(files, 43);
  std::cout << "checked " << files << " ds_configs from " << dir.lexically_normal().string() << ": "
            << loaded << " pass the loader, " << refused << " of them are refused by a plugin\n";
  EXPECT_EQ(loaded, 26);
  EXPECT_EQ(refused, 1);
}

// Trains a small GPT-2 for 3 steps on 2 ranks with every real file of the given ZeRO stages — its
// batch keys set to "auto" (train.yaml decides them; the files were written for other models and
// GPU counts), train.yaml naming only the model, data and batch so that the file decides its
// optimizer, schedule and clipping — or expects it refused naming one of its keys, for a reason
// other than its ZeRO stage. Returns {files, trained}.
std::pair<int, int> train_zero_files(const std::set<int64_t>& stages, const std::string& tag) {
  const fs::path dir = fs::path(MEMRT_SOURCE_DIR) / ".." / "shared" / "data" / "ds_configs";
  const fs::path scratch = fs::temp_directory_path() / ("memrt_real_zero" + tag + "_" + std::to_string(getpid()));
  fs::create_directories(scratch);
  const std::string yaml = (scratch / "train.yaml").string();
  std::ofstream(yaml) << "model: {arch: gpt2, n_layer: 2, n_head: 2, d_model: 64, d_ff: 256, "
                         "vocab_size: 256, n_ctx: 64}\nblock_size: 64\n"
                         "per_device_train_batch_size: 8\ngradient_accumulation_steps: 1\n";
  int files = 0, trained = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".json") continue;
    ConfigNode ds = parse_json_file(entry.path().string());
    const ConfigNode* zero = ds.find("zero_optimization");
    const ConfigNode* stage = zero ? zero->find("stage") : nullptr;
    if (!stage || !stage->is_number() || !stages.count(stage->as_int())) continue;
    ++files;
    SCOPED_TRACE(entry.path().filename().string());
    for (const char* k : {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"})
      if (ds.contains(k)) ds.set(k, ConfigNode::string("auto"));
    const fs::path file = scratch / entry.path().filename();
    std::ofstream(file) << ds.to_json();
    std::set<std::string> keys;
    collect_keys(ds, keys);
    const memrt_test::RunResult r = memrt_test::run(
        "env OMP_NUM_THREADS=1 " + memrt_test::kLauncher + " --num_procs 2 --master_port " +
        std::to_string(memrt_test::free_port()) + " --deepspeed " + file.string() + " " + yaml +
        " --max_steps=3 --output_dir=" + (scratch / "out").string());
    if (r.exit_code == 0) {
      EXPECT_NE(r.out.find("done: 3 steps"), std::string::npos) << r.out;
      ++trained;
      continue;
    }
    std::string error = r.out.substr(r.out.find("error:") == std::string::npos ? 0 : r.out.find("error:"));
    error = error.substr(0, error.find('\n'));
    bool names_a_key = false;
    for (const std::string& k : keys) names_a_key |= error.find(k) != std::string::npos;
    EXPECT_TRUE(names_a_key) << "refused without naming a key of the file: " << error;
    EXPECT_EQ(error.find("'zero_optimization.stage'"), std::string::npos) << "refused for its stage: " << error;
    std::cout << entry.path().filename().string() << ": " << error << "\n";
  }
  fs::remove_all(scratch);
  return {files, trained};
}

TEST(RealConfigsWithPlugins, ZeroStageOneAndTwoFilesTrainOnTwoRanksOrNameAKey) {
  if (!fs::is_directory(fs::path(MEMRT_SOURCE_DIR) / ".." / "shared" / "data" / "ds_configs")) GTEST_SKIP();
  const auto [files, trained] = train_zero_files({1, 2}, "12");
  EXPECT_EQ(files, 15);
  std::cout << trained << " of " << files << " ZeRO-1/2 files trained on 2 ranks\n";
  // The six refused name curriculum_learning, optimizer.params.max_grad_norm, tensor_parallel
  // (two files), cuda_visible_devices and zero_optimization.zenflow.
  EXPECT_EQ(trained, 9);
}

TEST(RealConfigsWithPlugins, ZeroStageThreeFilesTrainOnTwoRanksOrNameAKey) {
  if (!fs::is_directory(fs::path(MEMRT_SOURCE_DIR) / ".." / "shared" / "data" / "ds_configs")) GTEST_SKIP();
  const auto [files, trained] = train_zero_files({3}, "3");
  EXPECT_EQ(files, 13);
  std::cout << trained << " of " << files << " ZeRO-3 files trained on 2 ranks\n";
  // The two refused name torch_autocast and stage3_max_live_parameters ("auto", which Hugging
  // Face does not fill).
  EXPECT_EQ(trained, 11);
}

}  // namespace
}  // namespace memrt
