// A saved store as plugins read it (memrt/plugin.h, SavedParameters).
#pragma once

#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "checkpoint/store_checkpoint.h"
#include "memrt/error.h"
#include "memrt/plugin.h"

namespace memrt {

// The SDK's view of a saved store (memrt/plugin.h, SavedParameters), for plugins' export_model and
// write_checkpoint_files.
class SavedView final : public SavedParameters {
 public:
  explicit SavedView(const SavedStore& saved) : saved_(saved) {}
  std::vector<std::string> names() const override { return saved_.param_names(); }
  bool trainable(const std::string& name) const override { return saved_.trainable(known(name)); }
  const std::string& format(const std::string& name) const override {
    static const std::string kPlain;
    return saved_.trainable(known(name)) ? kPlain : saved_.frozen_format(name);
  }
  at::Tensor read(const std::string& name, const std::string& buffer) const override {
    return saved_.read_whole(known(name), buffer);
  }

 private:
  const std::string& known(const std::string& name) const {
    if (!saved_.contains(name)) throw FileError(saved_.path(), "lists no parameter '" + name + "'");
    return name;
  }
  const SavedStore& saved_;
};

}  // namespace memrt
