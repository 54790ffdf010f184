// Subprocess helpers of the end-to-end tests: run a command bounded in time, temporary folders,
// free loopback ports, reference outputs shared across tests.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace memrt_test {

namespace fs = std::filesystem;

const std::string kLauncher = std::string(MEMRT_BINARY_DIR) + "/bin/launcher";

struct RunResult {
  int exit_code = -1;
  std::string out;  // stdout and stderr together
  double seconds = 0.0;
};

inline std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Runs a shell command line under `timeout`, capturing its output.
inline RunResult run(const std::string& command, int timeout_s = 240) {
  static int counter = 0;
  const fs::path out = fs::temp_directory_path() /
                       ("memrt_launcher_out_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
  const auto t0 = std::chrono::steady_clock::now();
  const int status = std::system(("timeout -k 5 " + std::to_string(timeout_s) + " " + command +
                                  " > " + out.string() + " 2>&1").c_str());
  RunResult r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = slurp(out);
  fs::remove(out);
  return r;
}

inline int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

class TempDir {
 public:
  explicit TempDir(const std::string& name)
      : path_(fs::temp_directory_path() / ("memrt_" + name + "_" + std::to_string(getpid()))) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name) << text;
    return (path_ / name).string();
  }

 private:
  fs::path path_;
};

// A directory one of a reference script's commands makes from nothing (`args`: the command line
// before the directory, e.g. {"make", "llama"}: a model with transformers' own initialisation and
// PEFT adapters for it), made once per build tree, script, interpreter and arguments, and shared
// by the tests that need the same one: each is a Python start (seconds) saved. Tests only read it.
// Made under a temporary name and renamed into place, so a test never sees half of one.
inline std::filesystem::path shared_reference(const std::string& script, const std::vector<std::string>& args) {
  namespace fs = std::filesystem;
  std::string key = std::string(MEMRT_PYTHON) + "\n" + slurp(script);
  std::string name;
  for (const std::string& a : args) {
    key += "\n" + a;
    name += a + "_";
  }
  char hash[17];
  std::snprintf(hash, sizeof(hash), "%016zx", std::hash<std::string>{}(key));
  const fs::path dir = fs::path(MEMRT_BINARY_DIR) / "test_scratch" / "references" / (name + hash);
  if (fs::exists(dir)) return dir;
  const fs::path tmp = dir.string() + ".tmp" + std::to_string(getpid());
  fs::remove_all(tmp);
  fs::create_directories(dir.parent_path());
  std::string command = std::string(MEMRT_PYTHON) + " " + script;
  for (const std::string& a : args) command += " " + a;
  const RunResult r = run(command + " " + tmp.string());
  EXPECT_EQ(r.exit_code, 0) << r.out;
  std::error_code ec;
  fs::rename(tmp, dir, ec);  // fails when another test made it first: that one is the same
  fs::remove_all(tmp, ec);
  return dir;
}

}  // namespace memrt_test
