// memrt/error.h — the exceptions memrt throws. Library code never exits; errors are values that
// say what went wrong, where (file, key, tensor, plugin, phase, step) and how to fix it, and
// `main` decides how to report them.
#pragma once

#include <stdexcept>
#include <string>

namespace memrt {

// Base of every memrt error. what() is the complete, user-facing message.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A configuration file (ds_config.json, train.yaml, a plugin's options) or a command-line override
// is wrong. The message names the file, the key path, what was expected and how to fix it.
class ConfigError : public Error {
 public:
  ConfigError(std::string file, std::string key_path, std::string message)
      : Error(format(file, key_path, message)), file_(std::move(file)),
        key_path_(std::move(key_path)) {}

  const std::string& file() const noexcept { return file_; }
  const std::string& key_path() const noexcept { return key_path_; }

 private:
  static std::string format(const std::string& file, const std::string& key_path,
                            const std::string& message) {
    std::string s = file.empty() ? std::string("config") : file;
    if (!key_path.empty()) s += ": '" + key_path + "'";
    return s + ": " + message;
  }
  std::string file_;
  std::string key_path_;
};

// A file memrt reads or writes (safetensors, checkpoint, data) is missing, truncated or malformed.
class FileError : public Error {
 public:
  FileError(std::string path, const std::string& message)
      : Error(path + ": " + message), path_(std::move(path)) {}
  const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
};

// A plugin could not be loaded, or one of its hooks failed.
class PluginError : public Error {
 public:
  using Error::Error;
};

// A collective failed or a peer rank died.
class DistributedError : public Error {
 public:
  using Error::Error;
};

}  // namespace memrt
