// The memory a run may use (see budget.h).
#include "memory/budget.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "memrt/error.h"

namespace memrt::memory {
namespace {

namespace fs = std::filesystem;

// The file's first line, trimmed; none when it cannot be read.
std::optional<std::string> first_line(const fs::path& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  const auto space = [](unsigned char c) { return std::isspace(c) != 0; };
  line.erase(line.begin(), std::find_if_not(line.begin(), line.end(), space));
  line.erase(std::find_if_not(line.rbegin(), line.rend(), space).base(), line.end());
  return line;
}

// A cgroup limit file: bytes, or "max" (none). v1 writes "no limit" as 2^63 - 1 rounded down to a
// page: anything from 2^62 on is none.
std::optional<int64_t> limit_file(const fs::path& path) {
  const std::optional<std::string> text = first_line(path);
  if (!text || *text == "max") return std::nullopt;
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(*text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text->size() || v < 0)
    throw FileError(path.string(), "holds '" + *text + "', not a number of bytes or \"max\"");
  if (v >= (int64_t{1} << 62)) return std::nullopt;
  return static_cast<int64_t>(v);
}

// The cgroup paths of this process: (v2 unified path, v1 memory controller path).
std::pair<std::optional<std::string>, std::optional<std::string>> cgroup_paths(const fs::path& root) {
  std::ifstream in(root / "proc/self/cgroup");
  std::optional<std::string> v2, v1;
  std::string line;
  while (std::getline(in, line)) {
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (line.compare(0, a, "0") == 0 && controllers.empty()) {
      v2 = path;
    } else {
      std::stringstream list(controllers);
      for (std::string c; std::getline(list, c, ',');)
        if (c == "memory") v1 = path;
    }
  }
  return {v2, v1};
}

}  // namespace

MemoryBudget read_budget(const std::string& root_dir) {
  const fs::path root(root_dir);
  MemoryBudget out;
  auto add = [&](const fs::path& file, const std::string& what) {
    if (const std::optional<int64_t> v = limit_file(file)) out.limits.push_back({*v, what + " (" + file.string() + ")"});
  };
  const auto [v2, v1] = cgroup_paths(root);
  const fs::path unified = root / "sys/fs/cgroup";
  // This cgroup and each one above it up to the mount's root: a parent's limit binds its children,
  // and in a container with its own cgroup namespace the root is the container's cgroup. (The
  // host's root cgroup has no limit files: none.)
  auto walk = [&](const fs::path& mount, const std::string& path, std::initializer_list<const char*> files,
                  const std::string& what) {
    for (fs::path dir = fs::path(path).relative_path();; dir = dir.parent_path()) {
      for (const char* f : files) add(mount / dir / f, what + " " + f);
      if (dir.empty()) break;
    }
  };
  if (v2 && fs::exists(unified / "cgroup.controllers")) {
    walk(unified, *v2, {"memory.max", "memory.high"}, "cgroup v2");
  } else if (v1) {
    walk(root / "sys/fs/cgroup/memory", *v1, {"memory.limit_in_bytes"}, "cgroup v1");
  }
  std::ifstream meminfo(root / "proc/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    long long kb = -1;
    std::string unit;
    if (!(fields >> kb >> unit) || kb < 0 || unit != "kB")
      throw FileError((root / "proc/meminfo").string(), "has a MemAvailable line '" + line + "' that is not '<n> kB'");
    out.limits.push_back({static_cast<int64_t>(kb) * 1024, "MemAvailable (" + (root / "proc/meminfo").string() + ")"});
  }
  return out;
}

}  // namespace memrt::memory
