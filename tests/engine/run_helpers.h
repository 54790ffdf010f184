// Subprocess helpers of the end-to-end tests: run a command bounded in time, temporary folders,
// free loopback ports.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

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

}  // namespace memrt_test
