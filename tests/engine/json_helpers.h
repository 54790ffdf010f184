// Reading the JSON files a run writes (memory_report.json, ...) in the end-to-end tests, and
// running a reference script's commands in one batch.
#pragma once

#include <gtest/gtest.h>

#include <rapidjson/document.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "run_helpers.h"

namespace memrt_test {

inline rapidjson::Document read_json(const std::filesystem::path& p) {
  rapidjson::Document d;
  d.Parse(slurp(p).c_str());
  EXPECT_FALSE(d.HasParseError()) << p;
  return d;
}

// A test's reference work, queued and then run by a reference script in one Python process (its
// `batch` command, tests/engine/oracle_cli.py): importing torch, transformers and PEFT takes
// several seconds, the work itself a fraction of that.
class PythonBatch {
 public:
  PythonBatch(const TempDir& dir, const std::string& name, std::string script)
      : file_((dir.path() / (name + ".json")).string()), script_(std::move(script)) {}

  // Queues one of the script's commands, as its command line takes it.
  void add(std::vector<std::string> args) { commands_.push_back(std::move(args)); }

  // Runs the queued commands in order; false, with a test failure holding the script's output,
  // when one fails (the later ones do not run).
  bool run() {
    rapidjson::StringBuffer text;
    rapidjson::Writer<rapidjson::StringBuffer> w(text);
    w.StartArray();
    for (const auto& command : commands_) {
      w.StartArray();
      for (const auto& arg : command) w.String(arg.c_str(), static_cast<rapidjson::SizeType>(arg.size()));
      w.EndArray();
    }
    w.EndArray();
    std::ofstream(file_) << text.GetString();
    commands_.clear();
    const RunResult r = memrt_test::run(std::string(MEMRT_PYTHON) + " " + script_ + " batch " + file_);
    EXPECT_EQ(r.exit_code, 0) << r.out;
    return r.exit_code == 0;
  }

 private:
  std::string file_, script_;
  std::vector<std::vector<std::string>> commands_;
};

}  // namespace memrt_test
