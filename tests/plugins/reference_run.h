// What the plugin tests that hold a kernel to a Python library share: running the library's
// reference script on safetensors inputs, and comparing within the rounding of another summation order.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "../data/test_util.h"
#include "memrt/safetensors.h"

namespace memrt::test {

// Runs tests/plugins/<script> IN.safetensors OUT.safetensors with the test venv's Python on
// `inputs` (written into `dir`); returns every tensor it wrote, by name.
inline std::map<std::string, at::Tensor> run_reference(const std::string& script,
                                                       const std::vector<std::pair<std::string, at::Tensor>>& inputs,
                                                       const TempDir& dir) {
  write_safetensors(dir.file("in.safetensors"), inputs);
  const std::string cmd = std::string(MEMRT_PYTHON) + " " + MEMRT_SOURCE_DIR + "/tests/plugins/" + script + " " +
                          dir.file("in.safetensors") + " " + dir.file("out.safetensors");
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::map<std::string, at::Tensor> out;
  const SafetensorsFile f = SafetensorsFile::open(dir.file("out.safetensors"));
  for (const std::string& name : f.names()) out[name] = f.tensor(name).clone();
  return out;
}

// Equal within the rounding of a matrix product accumulated in another order: `ulps` units of
// `precision`'s epsilon (bf16 or fp32) relative to the largest value.
inline void expect_close(const at::Tensor& got, const at::Tensor& want, at::ScalarType precision, double ulps,
                         const std::string& what) {
  ASSERT_TRUE(want.defined()) << what << ": the reference wrote none";
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double eps = precision == at::kBFloat16 ? 1.0 / 128 : 1.0 / (1 << 23);
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  const double scale = w.abs().max().item<double>();
  const double worst = (g - w).abs().max().item<double>();
  EXPECT_LE(worst, ulps * eps * scale) << what << ": largest difference " << worst << " against values up to " << scale;
}

}  // namespace memrt::test
