// Reading the JSON files a run writes (memory_report.json, ...) in the end-to-end tests, and
// running a reference script's commands in one batch.
#pragma once

#include <gtest/gtest.h>

#include <rapidjson/document.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <csignal>
#include <cstdio>
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
// `batch` command, tests/engine/oracle_cli.py). It predates the tests' Python server
// (tests/python_server.py), which makes a process's imports free under ctest; run by hand, without
// the server, importing torch, transformers and PEFT takes several seconds, the work itself a
// fraction of that. The process starts with the batch and imports while the test goes on (memrt
// training, mostly); run() hands it the queued commands and waits for it. A batch may run more than
// once, each time in a new process.
class PythonBatch {
 public:
  PythonBatch(const TempDir& dir, const std::string& name, std::string script)
      : file_((dir.path() / (name + ".json")).string()), log_(file_ + ".log"), script_(std::move(script)) {
    start();
  }
  PythonBatch(const PythonBatch&) = delete;
  PythonBatch& operator=(const PythonBatch&) = delete;
  // An empty input ends a process that was never given its commands.
  ~PythonBatch() {
    if (process_) pclose(process_);
  }

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
    if (!process_) start();
    const std::string line = file_ + "\n";
    std::fputs(line.c_str(), process_);
    const int status = pclose(process_);
    process_ = nullptr;
    const int exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    EXPECT_EQ(exit_code, 0) << slurp(log_);
    return exit_code == 0;
  }

 private:
  // The script, waiting for its commands file's name on standard input (`batch -`); bounded in
  // time as memrt_test::run's commands are.
  void start() {
    std::signal(SIGPIPE, SIG_IGN);  // a script that failed to start fails the test in run(), not the test process
    process_ = popen(("timeout -k 5 280 " + std::string(MEMRT_PYTHON) + " " + script_ + " batch - > " + log_ +
                      " 2>&1").c_str(), "w");
    EXPECT_NE(process_, nullptr) << script_;
  }

  std::string file_, log_, script_;
  std::FILE* process_ = nullptr;
  std::vector<std::vector<std::string>> commands_;
};

}  // namespace memrt_test
