// Helpers shared by the models/io tests: scratch folders and the Python reference script.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <unistd.h>

#include <gtest/gtest.h>

namespace memrt_test {
namespace fs = std::filesystem;

// A fresh, empty folder for the running test: <build>/tests/models/scratch/<suite>.<test>.
inline std::string scratch_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path dir = fs::path(MEMRT_BINARY_DIR) / "tests" / "models" / "scratch" /
                 (std::string(info->test_suite_name()) + "." + info->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

inline std::string reference_script() {
  return std::string(MEMRT_SOURCE_DIR) + "/tests/models/reference.py";
}

// Runs `reference.py <command> <arg>` with the venv's Python; returns its exit status and puts
// stdout + stderr in `output`.
inline int run_reference(const std::string& command, const std::string& arg, std::string& output) {
  const std::string log = arg + ".log";
  const std::string cmd = std::string("\"") + MEMRT_PYTHON + "\" \"" + reference_script() + "\" " +
                          command + " \"" + arg + "\" > \"" + log + "\" 2>&1";
  int rc = std::system(cmd.c_str());
  std::ifstream in(log);
  std::ostringstream ss;
  ss << in.rdbuf();
  output = ss.str();
  return rc;
}

// The golden model directories (gpt2, llama, llama_tied_bf16), written once per build tree by
// the reference script and rebuilt when the script changes. Safe under parallel ctest: each
// writer uses its own temporary folder and renames it into place.
inline std::string golden_models_dir() {
  const fs::path root = fs::path(MEMRT_BINARY_DIR) / "tests" / "models" / "golden";
  auto fresh = [&] {
    const fs::path stamp = root / "ok";
    return fs::exists(stamp) && fs::last_write_time(stamp) >= fs::last_write_time(reference_script());
  };
  if (fresh()) return root.string();
  const fs::path tmp = root.string() + ".tmp." + std::to_string(::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  std::string out;
  int rc = run_reference("models", tmp.string(), out);
  if (rc != 0) {
    ADD_FAILURE() << "reference.py models failed:\n" << out;
    return {};
  }
  { std::ofstream(tmp / "ok") << "ok\n"; }
  std::error_code ec;
  if (fresh()) {  // another test process finished first
    fs::remove_all(tmp, ec);
    return root.string();
  }
  fs::remove_all(root, ec);  // stale
  fs::rename(tmp, root, ec);
  if (ec) fs::remove_all(tmp);  // another test process won the race; its copy is equivalent
  return root.string();
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace memrt_test
