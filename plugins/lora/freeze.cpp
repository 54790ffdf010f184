#include "freeze.h"

#include <memrt/error.h>

#include <algorithm>
#include <regex>
#include <set>

namespace memrt::lora {
namespace {

std::string join(const std::set<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

bool contains(const std::string& hay, const std::string& needle) {
  return hay.find(needle) != std::string::npos;
}

}  // namespace

std::vector<bool> freeze_trainable(const std::vector<std::string>& names, int64_t num_layers,
                                   const FreezeOptions& o) {
  std::vector<int64_t> layers;
  if (o.llama_pro) {
    if (o.trainable_layers <= 0 || num_layers % o.trainable_layers != 0)
      throw ConfigError(o.file, "freeze_trainable_layers",
                        "is " + std::to_string(o.trainable_layers) + ", but use_llama_pro needs a "
                        "positive divisor of the model's " + std::to_string(num_layers) + " layers");
    const int64_t stride = num_layers / o.trainable_layers;
    for (int64_t i = stride - 1; i < num_layers; i += stride) layers.push_back(i);
  } else if (o.trainable_layers > 0) {
    for (int64_t i = std::max<int64_t>(0, num_layers - o.trainable_layers); i < num_layers; ++i) layers.push_back(i);
  } else {
    for (int64_t i = 0; i < std::min(-o.trainable_layers, num_layers); ++i) layers.push_back(i);
  }

  // The modules a block has (after ".0.", or ".1." where a model's first block differs) and the
  // modules outside the blocks (a name without ".<digits>.": its second-last part).
  std::set<std::string> hidden, outer;
  const std::regex layer_id(R"(\.\d+\.)");
  for (const std::string& n : names) {
    for (const char* first : {".0.", ".1."}) {
      const size_t at = n.find(first);
      if (at == std::string::npos) continue;
      const std::string rest = n.substr(at + 3);
      hidden.insert(rest.substr(0, rest.find('.')));
      break;
    }
    const size_t last = n.rfind('.');
    if (last != std::string::npos && last > 0 && !std::regex_search(n, layer_id)) {
      const size_t before = n.rfind('.', last - 1);  // npos: the module is the name's first part
      const size_t from = before == std::string::npos ? 0 : before + 1;
      outer.insert(n.substr(from, last - from));
    }
  }

  std::vector<std::string> patterns;
  for (const std::string& m : o.modules) {
    if (m != "all" && !hidden.count(m))
      throw ConfigError(o.file, "freeze_trainable_modules",
                        "names module \"" + m + "\", which the model's blocks do not have; choose "
                        "\"all\" or from: " + join(hidden));
    for (int64_t i : layers) patterns.push_back("." + std::to_string(i) + "." + (m == "all" ? "" : m));
  }
  for (const std::string& m : o.extra) {
    if (!outer.count(m))
      throw ConfigError(o.file, "freeze_extra_modules",
                        "names module \"" + m + "\", which is not a module outside the blocks; "
                        "choose from: " + join(outer));
    patterns.push_back(m);
  }
  std::vector<bool> out;
  for (const std::string& n : names)
    out.push_back(std::any_of(patterns.begin(), patterns.end(),
                              [&](const std::string& p) { return contains(n, p); }));
  return out;
}

}  // namespace memrt::lora
