// Reading the JSON files a run writes (memory_report.json, ...) in the end-to-end tests.
#pragma once

#include <gtest/gtest.h>

#include <rapidjson/document.h>

#include <filesystem>

#include "run_helpers.h"

namespace memrt_test {

inline rapidjson::Document read_json(const std::filesystem::path& p) {
  rapidjson::Document d;
  d.Parse(slurp(p).c_str());
  EXPECT_FALSE(d.HasParseError()) << p;
  return d;
}

}  // namespace memrt_test
