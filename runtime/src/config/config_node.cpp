// ConfigNode, the JSON and YAML readers that build it, and the strict ConfigReader.
#include "memrt/config_node.h"

#include <rapidjson/error/en.h>
#include <rapidjson/reader.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

namespace memrt {

// ---- builders ---------------------------------------------------------------------------------

ConfigNode ConfigNode::null(std::string file, std::string path) {
  ConfigNode n;
  n.file_ = std::move(file);
  n.path_ = std::move(path);
  return n;
}
ConfigNode ConfigNode::boolean(bool v, std::string file, std::string path) {
  ConfigNode n = null(std::move(file), std::move(path));
  n.kind_ = Kind::Bool;
  n.bool_ = v;
  return n;
}
ConfigNode ConfigNode::number(double v, std::string file, std::string path) {
  ConfigNode n = null(std::move(file), std::move(path));
  n.kind_ = Kind::Number;
  n.num_ = v;
  return n;
}
ConfigNode ConfigNode::real(double v, std::string file, std::string path) {
  ConfigNode n = number(v, std::move(file), std::move(path));
  n.real_ = true;
  return n;
}
ConfigNode ConfigNode::string(std::string v, std::string file, std::string path) {
  ConfigNode n = null(std::move(file), std::move(path));
  n.kind_ = Kind::String;
  n.str_ = std::move(v);
  return n;
}
ConfigNode ConfigNode::array(std::string file, std::string path) {
  ConfigNode n = null(std::move(file), std::move(path));
  n.kind_ = Kind::Array;
  return n;
}
ConfigNode ConfigNode::object(std::string file, std::string path) {
  ConfigNode n = null(std::move(file), std::move(path));
  n.kind_ = Kind::Object;
  return n;
}

// ---- typed reads ------------------------------------------------------------------------------

static std::string format_number(double v) {
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) {
    return std::to_string(static_cast<int64_t>(v));
  }
  char buf[64];
  for (int precision = 6; precision <= 17; ++precision) {  // shortest text that reads back exactly
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

std::string ConfigNode::describe() const {
  switch (kind_) {
    case Kind::Null: return "null";
    case Kind::Bool: return std::string("a boolean (") + (bool_ ? "true" : "false") + ")";
    case Kind::Number: return "a number (" + format_number(num_) + ")";
    case Kind::String: return "a string (\"" + str_ + "\")";
    case Kind::Array: return "an array";
    case Kind::Object: return "an object";
  }
  return "?";
}

namespace {
ConfigError wrong_type(const ConfigNode& n, const std::string& expected) {
  if (n.is_auto()) {
    return n.error(
        "\"auto\" could not be resolved here: memrt resolves \"auto\" from train.yaml only for the "
        "keys Hugging Face fills (batch sizes, gradient_clipping, optimizer lr/betas/eps/"
        "weight_decay, scheduler warmup/total steps, fp16/bf16 enabled, ZeRO bucket sizes); "
        "write " + expected + " instead");
  }
  return n.error("expected " + expected + ", found " + n.describe());
}
}  // namespace

bool ConfigNode::as_bool() const {
  if (kind_ != Kind::Bool) throw wrong_type(*this, "a boolean (true or false)");
  return bool_;
}

int64_t ConfigNode::as_int() const {
  if (kind_ != Kind::Number) throw wrong_type(*this, "an integer");
  if (!std::isfinite(num_) || num_ != std::floor(num_)) {
    throw error("expected an integer, found " + describe() + "; write a whole number");
  }
  // 2^63 is exactly representable as a double; every double below it converts safely.
  if (num_ >= 9223372036854775808.0 || num_ < -9223372036854775808.0) {
    throw error("expected an integer, found " + describe() + ", which is out of the 64-bit range");
  }
  return static_cast<int64_t>(num_);
}

double ConfigNode::as_double() const {
  if (kind_ != Kind::Number) throw wrong_type(*this, "a number");
  return num_;
}

const std::string& ConfigNode::as_string() const {
  if (kind_ != Kind::String) throw wrong_type(*this, "a string");
  return str_;
}

const std::vector<ConfigNode>& ConfigNode::as_array() const {
  if (kind_ != Kind::Array) throw wrong_type(*this, "an array");
  return items_;
}

std::vector<std::string> ConfigNode::as_names() const {
  std::vector<std::string> out;
  if (kind_ == Kind::Array) {
    for (const ConfigNode& item : items_) out.push_back(item.as_string());
    return out;
  }
  const std::string& s = as_string();
  for (size_t start = 0; start <= s.size();) {
    size_t comma = s.find(',', start);
    if (comma == std::string::npos) comma = s.size();
    std::string name = s.substr(start, comma - start);
    name.erase(0, name.find_first_not_of(' '));
    name.erase(name.find_last_not_of(' ') + 1);
    if (!name.empty()) out.push_back(std::move(name));
    start = comma + 1;
  }
  return out;
}

const std::vector<ConfigNode::Member>& ConfigNode::members() const {
  if (kind_ != Kind::Object) throw wrong_type(*this, "an object");
  return members_;
}

bool ConfigNode::contains(std::string_view key) const { return find(key) != nullptr; }

const ConfigNode* ConfigNode::find(std::string_view key) const {
  if (kind_ != Kind::Object) return nullptr;
  for (const auto& m : members_) {
    if (m.first == key) return &m.second;
  }
  return nullptr;
}

ConfigNode* ConfigNode::find(std::string_view key) {
  return const_cast<ConfigNode*>(static_cast<const ConfigNode*>(this)->find(key));
}

const ConfigNode* ConfigNode::at_path(std::string_view key_path) const {
  const ConfigNode* n = this;
  size_t i = 0;
  while (n && i < key_path.size()) {
    if (key_path[i] == '.') {
      ++i;
      continue;
    }
    if (key_path[i] == '[') {
      const size_t close = key_path.find(']', i);
      if (close == std::string_view::npos || n->kind_ != Kind::Array) return nullptr;
      const std::string digits(key_path.substr(i + 1, close - i - 1));
      if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) return nullptr;
      const size_t index = std::stoul(digits);
      if (index >= n->items_.size()) return nullptr;
      n = &n->items_[index];
      i = close + 1;
      continue;
    }
    const size_t end = key_path.find_first_of(".[", i);
    const std::string_view key = key_path.substr(i, end == std::string_view::npos ? end : end - i);
    n = n->find(key);
    i = end == std::string_view::npos ? key_path.size() : end;
  }
  return n;
}

ConfigNode& ConfigNode::set(const std::string& key, ConfigNode value) {
  if (kind_ == Kind::Null) kind_ = Kind::Object;
  if (kind_ != Kind::Object) throw wrong_type(*this, "an object");
  if (ConfigNode* existing = find(key)) {
    *existing = std::move(value);
    return *existing;
  }
  members_.emplace_back(key, std::move(value));
  return members_.back().second;
}

bool ConfigNode::erase(std::string_view key) {
  if (kind_ != Kind::Object) return false;
  auto it = std::find_if(members_.begin(), members_.end(), [&](const Member& m) { return m.first == key; });
  if (it == members_.end()) return false;
  members_.erase(it);
  return true;
}

void ConfigNode::push_back(ConfigNode value) {
  if (kind_ == Kind::Null) kind_ = Kind::Array;
  if (kind_ != Kind::Array) throw wrong_type(*this, "an array");
  items_.push_back(std::move(value));
}

// ---- JSON output ------------------------------------------------------------------------------

static void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

static void to_json_impl(const ConfigNode& n, int indent, int depth, std::string& out) {
  const auto newline = [&](int d) {
    if (indent <= 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent * d), ' ');
  };
  switch (n.kind()) {
    case ConfigNode::Kind::Null: out += "null"; break;
    case ConfigNode::Kind::Bool: out += n.as_bool() ? "true" : "false"; break;
    case ConfigNode::Kind::Number: {
      const double v = n.as_double();
      std::string text = std::isfinite(v) ? format_number(v) : "null";
      if (n.is_real() && std::isfinite(v) && text.find_first_of(".e") == std::string::npos) text += ".0";
      out += text;
      break;
    }
    case ConfigNode::Kind::String: json_string(out, n.as_string()); break;
    case ConfigNode::Kind::Array: {
      const auto& items = n.as_array();
      if (items.empty()) {
        out += "[]";
        break;
      }
      out += '[';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += indent > 0 ? "," : ", ";
        newline(depth + 1);
        to_json_impl(items[i], indent, depth + 1, out);
      }
      newline(depth);
      out += ']';
      break;
    }
    case ConfigNode::Kind::Object: {
      const auto& members = n.members();
      if (members.empty()) {
        out += "{}";
        break;
      }
      out += '{';
      for (size_t i = 0; i < members.size(); ++i) {
        if (i) out += indent > 0 ? "," : ", ";
        newline(depth + 1);
        json_string(out, members[i].first);
        out += ": ";
        to_json_impl(members[i].second, indent, depth + 1, out);
      }
      newline(depth);
      out += '}';
      break;
    }
  }
}

std::string ConfigNode::to_json(int indent) const {
  std::string out;
  to_json_impl(*this, indent, 0, out);
  return out;
}

// ---- key paths and nearest keys ---------------------------------------------------------------

std::string join_key_path(const std::string& parent, std::string_view key) {
  if (parent.empty()) return std::string(key);
  return parent + "." + std::string(key);
}

static std::string lower_trimmed(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  std::string out(s.substr(b, e - b));
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

static size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string nearest_key(std::string_view key, const std::vector<std::string>& candidates) {
  const std::string k = lower_trimmed(key);
  if (k.empty()) return {};
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& c : candidates) {
    const std::string lc = lower_trimmed(c);
    size_t d = edit_distance(k, lc);
    // "offload" for "offload_optimizer", "stage3_prefetch_bucket_size" for "prefetch_bucket_size".
    if (k.size() >= 4 && lc.size() >= 4 && (lc.find(k) != std::string::npos || k.find(lc) != std::string::npos)) {
      d = std::min(d, static_cast<size_t>(2));
    }
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  const size_t limit = std::max<size_t>(1, k.size() / 3);
  return best_d <= limit && best_d < k.size() ? best : std::string();
}

// ---- JSON parsing (RapidJSON SAX straight into ConfigNode) --------------------------------------

namespace {

struct LineCol {
  size_t line = 1, column = 1;
};
LineCol line_col(const std::string& text, size_t offset) {
  LineCol lc;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++lc.line;
      lc.column = 1;
    } else {
      ++lc.column;
    }
  }
  return lc;
}

std::string item_path(const std::string& parent, size_t index) {
  return parent + "[" + std::to_string(index) + "]";
}

class JsonBuilder : public rapidjson::BaseReaderHandler<rapidjson::UTF8<>, JsonBuilder> {
 public:
  JsonBuilder(const std::string& file, const rapidjson::StringStream& stream)
      : file_(file), stream_(stream) {}

  bool Null() { return add(ConfigNode::null(file_, next_path())); }
  bool Bool(bool b) { return add(ConfigNode::boolean(b, file_, next_path())); }
  bool Int(int i) { return add(ConfigNode::number(i, file_, next_path())); }
  bool Uint(unsigned u) { return add(ConfigNode::number(u, file_, next_path())); }
  bool Int64(int64_t i) { return add(ConfigNode::number(static_cast<double>(i), file_, next_path())); }
  bool Uint64(uint64_t u) { return add(ConfigNode::number(static_cast<double>(u), file_, next_path())); }
  bool Double(double d) { return add(ConfigNode::real(d, file_, next_path())); }
  bool String(const char* s, rapidjson::SizeType len, bool) {
    return add(ConfigNode::string(std::string(s, len), file_, next_path()));
  }
  bool StartObject() {
    stack_.push_back({ConfigNode::object(file_, next_path()), {}, {}});
    return true;
  }
  bool Key(const char* s, rapidjson::SizeType len, bool) {
    Frame& f = stack_.back();
    std::string key(s, len);
    if (!f.keys.insert(key).second) {
      duplicate_ = key;
      duplicate_path_ = join_key_path(f.node.path(), key);
      duplicate_offset_ = stream_.Tell();
      return false;
    }
    f.key = std::move(key);
    return true;
  }
  bool EndObject(rapidjson::SizeType) { return end(); }
  bool StartArray() {
    stack_.push_back({ConfigNode::array(file_, next_path()), {}, {}});
    return true;
  }
  bool EndArray(rapidjson::SizeType) { return end(); }

  ConfigNode root;
  std::string duplicate_, duplicate_path_;
  size_t duplicate_offset_ = 0;

 private:
  struct Frame {
    ConfigNode node;
    std::string key;
    std::set<std::string> keys;
  };

  std::string next_path() const {
    if (stack_.empty()) return {};
    const Frame& f = stack_.back();
    if (f.node.is_array()) return item_path(f.node.path(), f.node.as_array().size());
    return join_key_path(f.node.path(), f.key);
  }
  bool add(ConfigNode n) {
    if (stack_.empty()) {
      root = std::move(n);
      return true;
    }
    Frame& f = stack_.back();
    if (f.node.is_array()) {
      f.node.push_back(std::move(n));
    } else {
      f.node.set(f.key, std::move(n));
    }
    return true;
  }
  bool end() {
    ConfigNode n = std::move(stack_.back().node);
    stack_.pop_back();
    return add(std::move(n));
  }

  const std::string& file_;
  const rapidjson::StringStream& stream_;
  std::vector<Frame> stack_;
};

std::string read_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw ConfigError(path, "", std::string("cannot open the ") + what +
                                    " file: check the path (relative paths are relative to the "
                                    "current directory)");
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

ConfigNode parse_json_text(const std::string& text, const std::string& file_label) {
  rapidjson::StringStream stream(text.c_str());
  JsonBuilder builder(file_label, stream);
  rapidjson::Reader reader;
  constexpr unsigned kFlags = rapidjson::kParseCommentsFlag | rapidjson::kParseTrailingCommasFlag |
                              rapidjson::kParseFullPrecisionFlag;
  const rapidjson::ParseResult ok = reader.Parse<kFlags>(stream, builder);
  if (!builder.duplicate_.empty()) {
    const LineCol lc = line_col(text, builder.duplicate_offset_);
    throw ConfigError(file_label, builder.duplicate_path_,
                      "duplicate key at line " + std::to_string(lc.line) + ", column " +
                          std::to_string(lc.column) +
                          " (DeepSpeed rejects duplicate keys too): keep one of the two");
  }
  if (!ok) {
    const LineCol lc = line_col(text, ok.Offset());
    throw ConfigError(file_label, "",
                      "invalid JSON at line " + std::to_string(lc.line) + ", column " +
                          std::to_string(lc.column) + ": " +
                          rapidjson::GetParseError_En(ok.Code()) +
                          " (comments and trailing commas are allowed; NaN and Infinity are not)");
  }
  return builder.root;
}

ConfigNode parse_json_file(const std::string& path) {
  return parse_json_text(read_file(path, "JSON"), path);
}

// ---- YAML parsing (yaml-cpp) --------------------------------------------------------------------

namespace {

bool one_of(const std::string& s, std::initializer_list<const char*> words) {
  for (const char* w : words) {
    if (s == w) return true;
  }
  return false;
}

// A YAML number: [-+]? ( .digits | digits ( . digits? )? ) ( [eE] [-+]? digits )?  — the YAML 1.2
// core schema, so `2e-4` is a number (PyYAML's 1.1 rules would make it a string).
bool yaml_number(const std::string& s, double& out) {
  size_t i = 0;
  const size_t n = s.size();
  if (i < n && (s[i] == '+' || s[i] == '-')) ++i;
  size_t int_digits = 0, frac_digits = 0;
  while (i < n && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++int_digits;
  if (i < n && s[i] == '.') {
    ++i;
    while (i < n && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++frac_digits;
  }
  if (int_digits + frac_digits == 0) return false;
  if (i < n && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < n && (s[i] == '+' || s[i] == '-')) ++i;
    size_t exp_digits = 0;
    while (i < n && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++exp_digits;
    if (exp_digits == 0) return false;
  }
  if (i != n) return false;
  out = std::strtod(s.c_str(), nullptr);
  return true;
}

ConfigNode yaml_scalar(const YAML::Node& y, const std::string& file, const std::string& path) {
  const std::string& s = y.Scalar();
  const std::string& tag = y.Tag();
  const bool plain = tag == "?" || tag.empty();
  const auto ends_with = [&](const char* t) {
    const std::string suffix(t);
    return tag.size() >= suffix.size() && tag.compare(tag.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (!plain && !ends_with(":int") && !ends_with(":float") && !ends_with(":bool") && !ends_with(":null")) {
    return ConfigNode::string(s, file, path);  // quoted or !!str
  }
  if (one_of(s, {"", "~", "null", "Null", "NULL"})) return ConfigNode::null(file, path);
  if (one_of(s, {"true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON"})) {
    return ConfigNode::boolean(true, file, path);
  }
  if (one_of(s, {"false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF"})) {
    return ConfigNode::boolean(false, file, path);
  }
  double v = 0;
  if (yaml_number(s, v)) {
    const bool real = s.find_first_of(".eE") != std::string::npos;
    return real ? ConfigNode::real(v, file, path) : ConfigNode::number(v, file, path);
  }
  return ConfigNode::string(s, file, path);
}

ConfigNode from_yaml(const YAML::Node& y, const std::string& file, const std::string& path) {
  switch (y.Type()) {
    case YAML::NodeType::Undefined:
    case YAML::NodeType::Null: return ConfigNode::null(file, path);
    case YAML::NodeType::Scalar: return yaml_scalar(y, file, path);
    case YAML::NodeType::Sequence: {
      ConfigNode a = ConfigNode::array(file, path);
      size_t i = 0;
      for (const auto& item : y) a.push_back(from_yaml(item, file, item_path(path, i++)));
      return a;
    }
    case YAML::NodeType::Map: {
      ConfigNode o = ConfigNode::object(file, path);
      for (const auto& kv : y) {
        if (!kv.first.IsScalar()) {
          throw ConfigError(file, path, "line " + std::to_string(kv.first.Mark().line + 1) +
                                            ": a map key must be a plain scalar");
        }
        const std::string key = kv.first.Scalar();
        const std::string child = join_key_path(path, key);
        if (o.contains(key)) {
          throw ConfigError(file, child, "duplicate key at line " +
                                             std::to_string(kv.first.Mark().line + 1) +
                                             ": keep one of the two");
        }
        o.set(key, from_yaml(kv.second, file, child));
      }
      return o;
    }
  }
  return ConfigNode::null(file, path);
}

}  // namespace

ConfigNode parse_yaml_text(const std::string& text, const std::string& file_label) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(file_label, "",
                      "invalid YAML at line " + std::to_string(e.mark.line + 1) + ", column " +
                          std::to_string(e.mark.column + 1) + ": " + e.msg);
  }
  return from_yaml(root, file_label, "");
}

ConfigNode parse_yaml_file(const std::string& path) {
  return parse_yaml_text(read_file(path, "YAML"), path);
}

ConfigNode parse_yaml_value(const std::string& text, const std::string& file_label,
                            const std::string& path) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(file_label, path, "cannot read the value '" + text + "' as YAML: " + e.msg);
  }
  return from_yaml(root, file_label, path);
}

// ---- ConfigReader -------------------------------------------------------------------------------

static const ConfigNode& empty_object() {
  static const ConfigNode empty = ConfigNode::object();
  return empty;
}

ConfigReader::ConfigReader(const ConfigNode& object, ConfigDiagnostics& diag)
    : node_(&object), diag_(&diag) {
  if (object.is_null()) {
    node_ = &empty_object();
  } else if (!object.is_object()) {
    throw object.error("expected an object (a section of keys), found " + object.describe());
  }
}

std::string ConfigReader::child_path(std::string_view key) const {
  return join_key_path(node_->path(), key);
}

const ConfigNode* ConfigReader::take(std::string_view key) {
  if (std::find(known_.begin(), known_.end(), key) == known_.end()) known_.emplace_back(key);
  const ConfigNode* n = node_->find(key);
  if (n && std::find(seen_.begin(), seen_.end(), key) == seen_.end()) seen_.emplace_back(key);
  return n;
}

ConfigError ConfigReader::missing(std::string_view key) const {
  return ConfigError(node_->file(), child_path(key), "is required but missing");
}

void ConfigDiagnostics::note(const ConfigNode& n, std::string_view text) {
  warnings.push_back((n.file().empty() ? std::string("config") : n.file()) + ": '" + n.path() + "' " +
                     std::string(text));
}

void ConfigReader::ignore(std::string_view key, std::string_view why) {
  if (const ConfigNode* n = take(key); n && !n->is_null()) {  // `key:` (null) sets nothing
    diag_->note(*n, "is accepted but ignored: " + std::string(why));
  }
}

void ConfigReader::reject(std::string_view key, std::string_view instead) {
  if (const ConfigNode* n = take(key)) {
    throw n->error("is not supported by memrt: " + std::string(instead));
  }
}

void ConfigReader::reject_if_true(std::string_view key, std::string_view instead) {
  const ConfigNode* n = take(key);
  if (n && !n->is_null() && !n->is_auto() && n->as_bool()) {
    throw n->error("is not supported by memrt: " + std::string(instead));
  }
}

void ConfigReader::finish() {
  for (const auto& [key, value] : node_->members()) {
    if (std::find(seen_.begin(), seen_.end(), key) != seen_.end()) continue;
    const std::string& file = value.file().empty() ? node_->file() : value.file();
    const std::string path = value.path().empty() ? child_path(key) : value.path();
    const std::string near = nearest_key(key, known_);
    if (!near.empty()) {
      std::string hint = "unknown key; did you mean '" + near + "'?";
      if (lower_trimmed(key) == lower_trimmed(near) && key != near) {
        hint += " (the key differs only in spaces or letter case)";
      }
      throw ConfigError(file, path, hint);
    }
    std::string valid;
    for (const auto& k : known_) valid += (valid.empty() ? "" : ", ") + k;
    throw ConfigError(file, path, "unknown key; valid keys here: " + (valid.empty() ? "(none)" : valid));
  }
}

}  // namespace memrt
