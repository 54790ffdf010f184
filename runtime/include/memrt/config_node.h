// memrt/config_node.h — configuration values that remember where they came from, and a strict
// reader for one config object. The host reads ds_config.json, train.yaml and command-line
// overrides into ConfigNode trees; each plugin receives its own subtree and reads it with
// ConfigReader, so every plugin rejects unknown keys the same way the host does:
//
//   void configure(const memrt::ConfigNode& cfg, memrt::ConfigDiagnostics& diag) {
//     memrt::ConfigReader r(cfg, diag);
//     factor_ = r.get<double>("factor", 4.0);        // absent -> default; wrong type -> error
//     r.ignore("comment", "documentation only");     // known, harmless: one warning line
//     r.reject("nvme_path", "use offload device \"cpu\"");  // known, cannot honour: error
//     r.finish();   // anything unread: error naming file, key path and the nearest valid key
//   }
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "memrt/error.h"

namespace memrt {

class ConfigNode {
 public:
  enum class Kind { Null, Bool, Number, String, Array, Object };
  using Member = std::pair<std::string, ConfigNode>;

  ConfigNode() = default;  // null, no source

  // ---- builders (parsers, command-line overrides, "auto" resolution) ----
  static ConfigNode null(std::string file = {}, std::string path = {});
  static ConfigNode boolean(bool v, std::string file = {}, std::string path = {});
  static ConfigNode number(double v, std::string file = {}, std::string path = {});
  // A number written with a fraction or exponent ("6.0", "1e-5"): to_json keeps it a float ("6.0"),
  // as Python's json does for the configs transformers reads (which may require a float).
  static ConfigNode real(double v, std::string file = {}, std::string path = {});
  static ConfigNode string(std::string v, std::string file = {}, std::string path = {});
  static ConfigNode array(std::string file = {}, std::string path = {});
  static ConfigNode object(std::string file = {}, std::string path = {});

  // ---- where it came from ----
  Kind kind() const noexcept { return kind_; }
  const std::string& file() const noexcept { return file_; }  // e.g. "configs/ds_config.json"
  const std::string& path() const noexcept { return path_; }  // e.g. "zero_optimization.stage"

  bool is_null() const noexcept { return kind_ == Kind::Null; }
  bool is_bool() const noexcept { return kind_ == Kind::Bool; }
  bool is_number() const noexcept { return kind_ == Kind::Number; }
  bool is_real() const noexcept { return kind_ == Kind::Number && real_; }
  bool is_string() const noexcept { return kind_ == Kind::String; }
  bool is_array() const noexcept { return kind_ == Kind::Array; }
  bool is_object() const noexcept { return kind_ == Kind::Object; }
  bool is_auto() const noexcept { return kind_ == Kind::String && str_ == "auto"; }

  // ---- typed reads: a wrong type is a ConfigError naming file, path, expected and found ----
  bool as_bool() const;
  int64_t as_int() const;  // integral numbers, including ones written 2e8 or 3.0
  double as_double() const;
  const std::string& as_string() const;
  const std::vector<ConfigNode>& as_array() const;
  // A list of names: an array of strings, or one comma-separated string (LLaMA-Factory's and
  // PEFT's spelling: "q_proj, v_proj"), each name trimmed, empty ones dropped.
  std::vector<std::string> as_names() const;
  const std::vector<Member>& members() const;  // objects keep the file's key order

  bool contains(std::string_view key) const;
  const ConfigNode* find(std::string_view key) const;  // nullptr when absent or not an object
  ConfigNode* find(std::string_view key);
  // A descendant by key path: "zero_optimization.offload_optimizer.device",
  // "plugins[1].options.factor". nullptr when any step is absent or of the wrong kind.
  const ConfigNode* at_path(std::string_view key_path) const;

  // ---- mutation ----
  ConfigNode& set(const std::string& key, ConfigNode value);  // object: insert or replace
  bool erase(std::string_view key);
  void push_back(ConfigNode value);                          // array

  // A throwable error about this node.
  ConfigError error(const std::string& message) const { return ConfigError(file_, path_, message); }
  // "a string (\"abc\")", "a number (3)", "an object", ... for messages.
  std::string describe() const;
  // Serialises as JSON (integral numbers without a fraction, unless written with one: real()).
  std::string to_json(int indent = 2) const;

 private:
  Kind kind_ = Kind::Null;
  bool bool_ = false;
  double num_ = 0.0;
  std::string str_;
  std::vector<ConfigNode> items_;
  std::vector<Member> members_;
  std::string file_;
  std::string path_;
  bool real_ = false;  // ABI 2.8: last, so older plugins' inline accessors read the members before it
};

// JSON as DeepSpeed accepts it in practice: comments and trailing commas are allowed; duplicate
// keys, NaN and anything after the document are errors naming the file and line.
ConfigNode parse_json_file(const std::string& path);
ConfigNode parse_json_text(const std::string& text, const std::string& file_label);
// YAML (block and flow style). An empty value (`key:`) is null.
ConfigNode parse_yaml_file(const std::string& path);
ConfigNode parse_yaml_text(const std::string& text, const std::string& file_label);
// One value as a YAML scalar or flow collection ("20" -> number, "true" -> bool, "[a, b]" -> array),
// as used for command-line overrides; `path` becomes the node's key path.
ConfigNode parse_yaml_value(const std::string& text, const std::string& file_label,
                            const std::string& path);

// Child path: join_key_path("a.b", "c") == "a.b.c"; join_key_path("", "c") == "c".
std::string join_key_path(const std::string& parent, std::string_view key);

// The candidate closest to `key` by edit distance (case-insensitive), or "" if nothing is close.
std::string nearest_key(std::string_view key, const std::vector<std::string>& candidates);

// Warnings raised while reading configs, printed once by the host at start.
struct ConfigDiagnostics {
  std::vector<std::string> warnings;
  // One warning line about `n`: "<file>: '<key path>' <text>".
  void note(const ConfigNode& n, std::string_view text);
};

// Reads one object strictly. Every key present must be read (get/optional/required/child),
// ignored or rejected before finish(); finish() throws for the rest.
class ConfigReader {
 public:
  // `object` may be null (treated as empty); anything else that is not an object is an error.
  ConfigReader(const ConfigNode& object, ConfigDiagnostics& diag);

  template <class T>
  T get(std::string_view key, T default_value) {
    const ConfigNode* n = take(key);
    return n && !n->is_null() ? convert<T>(*n) : default_value;
  }
  template <class T>
  std::optional<T> optional(std::string_view key) {
    const ConfigNode* n = take(key);
    if (!n || n->is_null()) return std::nullopt;
    return convert<T>(*n);
  }
  template <class T>
  T required(std::string_view key) {
    const ConfigNode* n = take(key);
    if (!n || n->is_null()) throw missing(key);
    return convert<T>(*n);
  }
  // The child node (any kind), or nullptr when absent. Marks the key as read.
  const ConfigNode* child(std::string_view key) { return take(key); }

  // Known and harmless but not honoured: accepted with one warning line naming the key.
  void ignore(std::string_view key, std::string_view why);
  // Known but its meaning cannot be honoured: an error naming the key and what to use instead.
  void reject(std::string_view key, std::string_view instead);
  // Known, and memrt does what `false` means: absent, null, "auto" or false are fine; true is an
  // error naming the key and what to use instead.
  void reject_if_true(std::string_view key, std::string_view instead);
  // Keys read (or declared) so far, for "did you mean".
  const std::vector<std::string>& known_keys() const noexcept { return known_; }
  // Unknown keys left over: a ConfigError naming the first, with the nearest known key.
  void finish();

  const ConfigNode& node() const noexcept { return *node_; }

 private:
  const ConfigNode* take(std::string_view key);
  ConfigError missing(std::string_view key) const;
  std::string child_path(std::string_view key) const;

  template <class T>
  static T convert(const ConfigNode& n) {
    if constexpr (std::is_same_v<T, bool>) return n.as_bool();
    else if constexpr (std::is_same_v<T, std::string>) return n.as_string();
    else if constexpr (std::is_floating_point_v<T>) return static_cast<T>(n.as_double());
    else if constexpr (std::is_integral_v<T>) return static_cast<T>(n.as_int());
    else return T::from_config(n);
  }

  const ConfigNode* node_;
  ConfigDiagnostics* diag_;
  std::vector<std::string> known_;
  std::vector<std::string> seen_;
};

}  // namespace memrt
