// The end-to-end tests' independent reference: tests/engine/torch_reference_train.py (PyTorch,
// transformers and PEFT training the same model on the micro-batches fixture_recorder wrote), and
// reading a run's metrics.jsonl to compare with it.
#pragma once

#include <gtest/gtest.h>

#include <rapidjson/document.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "json_helpers.h"
#include "run_helpers.h"

namespace memrt_test {

// One value per record of a run's metrics.jsonl that has `key` (training steps have "loss",
// evaluations "eval_loss").
inline std::vector<double> metric(const std::filesystem::path& dir, const char* key) {
  std::vector<double> out;
  std::ifstream in(dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    rapidjson::Document d;
    d.Parse(line.c_str());
    if (d.IsObject() && d.HasMember(key)) out.push_back(d[key].GetDouble());
  }
  return out;
}

inline std::vector<double> losses(const std::filesystem::path& dir) { return metric(dir, "loss"); }

inline double worst_relative(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0.0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) worst = std::max(worst, std::abs(a[i] / b[i] - 1.0));
  return worst;
}

// A run's memory_report.json: its peak and every category of it measured as estimated, to the
// byte; returns the adapters' measured bytes.
inline int64_t expect_peak_as_estimated(const std::filesystem::path& out) {
  const rapidjson::Document report = read_json(out / "memory_report.json");
  const auto& rank = report["ranks"][0];
  EXPECT_EQ(rank["measured"]["peak_bytes"].GetInt64(), rank["estimate"]["peak_bytes"].GetInt64());
  for (const auto& c : rank["measured"]["categories"].GetObject())
    EXPECT_EQ(c.value["device"].GetInt64(), rank["estimate"]["categories"][c.name.GetString()]["device"].GetInt64())
        << c.name.GetString();
  return rank["measured"]["categories"]["adapters"]["device"].GetInt64();
}

const std::string kTorchReference = std::string(MEMRT_SOURCE_DIR) + "/tests/engine/torch_reference_train.py";

// A small GPT-2 with transformers' own initialisation (shared by the tests, read only).
inline std::filesystem::path torch_model() { return shared_reference(kTorchReference, {"init"}); }

// A batch of torch_reference_train.py's commands (see PythonBatch).
inline PythonBatch torch_batch(const TempDir& dir, const std::string& name) { return {dir, name, kTorchReference}; }

// Queues PyTorch's 20 steps on the micro-batches fixture_recorder wrote under `prefix` (8 sequences
// of 32 tokens a step, lr 1e-3, weight decay 0.1, clipping 1.0; `trainable`: the name fragments
// that train, all when empty; `lr_groups`: axolotl's, as JSON; `adapter`: a PEFT adapter directory
// whose adapters alone train, saved to `save` after training when given). Returns the file that
// will hold {loss, grad_norm} per step: read it with curves() once the batch has run.
inline std::string torch_train(PythonBatch& batch, const std::filesystem::path& model, const std::string& prefix,
                               int ranks, const std::string& trainable = "", const std::string& lr_groups = "",
                               const std::string& adapter = "", const std::string& save = "") {
  const std::string json = prefix + "torch.json";
  batch.add({"train", model.string(), prefix, std::to_string(ranks), "20", "1", std::to_string(8 / ranks), "32", "1.0e-3",
             "0.1", "1.0", json, trainable, lr_groups.empty() ? "[]" : lr_groups, adapter, save});
  return json;
}

// The {loss, grad_norm} per step a torch_train wrote.
inline std::pair<std::vector<double>, std::vector<double>> curves(const std::string& json) {
  std::pair<std::vector<double>, std::vector<double>> out;
  const rapidjson::Document d = read_json(json);
  if (!d.IsObject()) return out;
  for (const auto& v : d["loss"].GetArray()) out.first.push_back(v.GetDouble());
  for (const auto& v : d["grad_norm"].GetArray()) out.second.push_back(v.GetDouble());
  return out;
}

}  // namespace memrt_test
