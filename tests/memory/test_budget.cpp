// The memory budget's readers (memory/budget.h) on fixture trees as cgroup v2, cgroup v1 and
// /proc/meminfo lay them out — limits set, "max", v1's unlimited value, files missing, values
// malformed — and sizes as users write them (config/load_config.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>

#include "../data/test_util.h"
#include "config/load_config.h"
#include "memory/budget.h"
#include "memrt/error.h"

namespace memrt::memory {
namespace {

using memrt::parse_size;

namespace fs = std::filesystem;
using memrt::test::expect_error;

void write(const fs::path& file, const std::string& text) {
  fs::create_directories(file.parent_path());
  std::ofstream(file) << text;
}

const char* kMeminfo = "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n";

// The binding limit (the smallest), or none: what the checks take when no need differs by limit.
std::optional<MemoryLimit> smallest(const MemoryBudget& b) {
  if (b.limits.empty()) return std::nullopt;
  return *std::min_element(b.limits.begin(), b.limits.end(),
                           [](const MemoryLimit& x, const MemoryLimit& y) { return x.bytes < y.bytes; });
}

TEST(MemoryBudget, CgroupV2LimitsOfTheCgroupAndItsParentsAndMemAvailable) {
  memrt::test::TempDir dir;
  const fs::path root = dir.str();
  write(root / "proc/self/cgroup", "0::/job.slice/run\n");
  write(root / "proc/meminfo", kMeminfo);
  write(root / "sys/fs/cgroup/cgroup.controllers", "cpu memory\n");
  write(root / "sys/fs/cgroup/job.slice/run/memory.max", "max\n");
  write(root / "sys/fs/cgroup/job.slice/run/memory.high", "8589934592\n");
  write(root / "sys/fs/cgroup/job.slice/memory.max", "6442450944\n");  // the parent binds
  const MemoryBudget b = read_budget(root.string());
  ASSERT_EQ(b.limits.size(), 3u);
  EXPECT_EQ(b.limits[0].bytes, 8589934592);
  EXPECT_NE(b.limits[0].source.find("cgroup v2 memory.high"), std::string::npos) << b.limits[0].source;
  EXPECT_EQ(b.limits[2].bytes, 20000000LL * 1024);
  ASSERT_TRUE(smallest(b));
  EXPECT_EQ(smallest(b)->bytes, 6442450944);
  EXPECT_NE(smallest(b)->source.find("job.slice/memory.max"), std::string::npos) << smallest(b)->source;
}

TEST(MemoryBudget, CgroupV1LimitAndItsUnlimitedValue) {
  memrt::test::TempDir dir;
  const fs::path root = dir.str();
  write(root / "proc/self/cgroup", "12:cpu,cpuacct:/docker/abc\n7:memory:/docker/abc\n0::/\n");
  write(root / "proc/meminfo", kMeminfo);
  const fs::path limit = root / "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes";
  write(limit, "4294967296\n");
  MemoryBudget b = read_budget(root.string());
  ASSERT_EQ(b.limits.size(), 2u);
  EXPECT_EQ(smallest(b)->bytes, 4294967296);
  EXPECT_NE(smallest(b)->source.find("cgroup v1 memory.limit_in_bytes"), std::string::npos);
  write(limit, "9223372036854771712\n");  // no limit: 2^63 - 1 rounded down to a page
  b = read_budget(root.string());
  ASSERT_EQ(b.limits.size(), 1u);
  EXPECT_NE(smallest(b)->source.find("MemAvailable"), std::string::npos);
}

TEST(MemoryBudget, MissingFilesAreNoLimitAndMalformedValuesNameTheFile) {
  memrt::test::TempDir dir;
  const fs::path root = dir.str();
  EXPECT_TRUE(read_budget(root.string()).limits.empty());
  EXPECT_FALSE(smallest(read_budget(root.string())));
  write(root / "proc/self/cgroup", "0::/a\n");
  write(root / "sys/fs/cgroup/cgroup.controllers", "memory\n");
  write(root / "sys/fs/cgroup/a/memory.max", "lots\n");
  expect_error<FileError>([&] { read_budget(root.string()); }, {"a/memory.max", "'lots'", "\"max\""});
  write(root / "sys/fs/cgroup/a/memory.max", "max\n");
  write(root / "proc/meminfo", "MemAvailable: many\n");
  expect_error<FileError>([&] { read_budget(root.string()); }, {"meminfo", "MemAvailable", "<n> kB"});
}

TEST(MemoryBudget, SizesAsUsersWriteThem) {
  EXPECT_EQ(parse_size("6442450944"), 6442450944);
  EXPECT_EQ(parse_size("6GiB"), 6442450944);
  EXPECT_EQ(parse_size("6G"), 6442450944);
  EXPECT_EQ(parse_size("6gb"), 6000000000);
  EXPECT_EQ(parse_size("6.5GB"), 6500000000);
  EXPECT_EQ(parse_size("512MiB"), 536870912);
  EXPECT_EQ(parse_size("2 TiB"), 2199023255552);
  for (const char* bad : {"", "six", "6 parsecs", "-1GiB", "0", "1e30GB"}) EXPECT_FALSE(parse_size(bad)) << bad;
}

// This machine's own: /proc/meminfo always has MemAvailable; its cgroup's limit where one is set
// (printed, for the log).
TEST(MemoryBudget, ThisMachinesLimitsAreRead) {
  const MemoryBudget b = read_budget("/");
  bool available = false;
  for (const MemoryLimit& l : b.limits) {
    std::cout << "  " << l.source << ": " << l.bytes << " bytes\n";
    available |= l.source.rfind("MemAvailable", 0) == 0;
    EXPECT_GT(l.bytes, 0) << l.source;
  }
  EXPECT_TRUE(available);
}

}  // namespace
}  // namespace memrt::memory
