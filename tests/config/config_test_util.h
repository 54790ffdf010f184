// Helpers for the config tests: scratch files and error assertions.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "config/load_config.h"
#include "memrt/error.h"

namespace memrt::test {

// A scratch folder under the build tree, one per test, emptied first.
inline std::filesystem::path scratch_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::filesystem::path dir = std::filesystem::path(MEMRT_BINARY_DIR) / "test_scratch" / "config" /
                              (std::string(info->test_suite_name()) + "." + info->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

inline std::string write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path) << text;
  return path.string();
}

// Runs `fn`, expects a ConfigError whose message contains every one of `parts`; returns it.
inline std::string expect_config_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
    return msg;
  }
  ADD_FAILURE() << "no ConfigError thrown";
  return {};
}

inline std::string source(const char* rel) { return std::string(MEMRT_SOURCE_DIR) + "/" + rel; }

}  // namespace memrt::test
