// Helpers shared by the dist tests: capture a launcher's output in files, set and restore
// environment variables, split text into lines.
#pragma once

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace memrt::test {

// A file that receives a stream's output; read back with text().
class CaptureFile {
 public:
  CaptureFile() {
    path_ = ::testing::TempDir() + "memrt_dist_XXXXXX";
    fd_ = ::mkstemp(path_.data());
    EXPECT_GE(fd_, 0) << "cannot create a temporary file in " << ::testing::TempDir();
  }
  ~CaptureFile() {
    if (fd_ >= 0) ::close(fd_);
    ::unlink(path_.c_str());
  }
  CaptureFile(const CaptureFile&) = delete;
  CaptureFile& operator=(const CaptureFile&) = delete;

  int fd() const { return fd_; }
  std::string text() const {
    std::ifstream f(path_);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }

 private:
  std::string path_;
  int fd_ = -1;
};

inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string l;
  while (std::getline(in, l)) out.push_back(l);
  return out;
}

inline bool contains(const std::string& hay, const std::string& needle) {
  return hay.find(needle) != std::string::npos;
}

// Sets, unsets and restores environment variables for one test.
class EnvGuard {
 public:
  explicit EnvGuard(std::vector<std::string> names) {
    for (const auto& n : names) {
      const char* v = std::getenv(n.c_str());
      saved_[n] = v ? std::optional<std::string>(v) : std::nullopt;
      ::unsetenv(n.c_str());
    }
  }
  ~EnvGuard() {
    for (const auto& [n, v] : saved_) {
      if (v) {
        ::setenv(n.c_str(), v->c_str(), 1);
      } else {
        ::unsetenv(n.c_str());
      }
    }
  }
  EnvGuard(const EnvGuard&) = delete;
  EnvGuard& operator=(const EnvGuard&) = delete;

  void set(const std::string& n, const std::string& v) {
    if (!saved_.count(n)) {
      const char* old = std::getenv(n.c_str());
      saved_[n] = old ? std::optional<std::string>(old) : std::nullopt;
    }
    ::setenv(n.c_str(), v.c_str(), 1);
  }

 private:
  std::map<std::string, std::optional<std::string>> saved_;
};

// Every variable the rendezvous reads.
inline std::vector<std::string> dist_variables() {
  return {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
          "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
          "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MEMRT_DIST_TIMEOUT",
          "GLOO_SOCKET_IFNAME"};
}

}  // namespace memrt::test
