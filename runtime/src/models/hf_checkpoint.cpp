// Hugging Face checkpoint directories: config.json, model.safetensors and sharded indexes.
#include "models/hf_checkpoint.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <rapidjson/document.h>
#include <rapidjson/error/en.h>
#include <rapidjson/prettywriter.h>
#include <rapidjson/stringbuffer.h>

#include "io/safetensors_write.h"
#include "memrt/error.h"

namespace memrt {
namespace fs = std::filesystem;
namespace {

const char* kSingleFile = "model.safetensors";
const char* kIndexFile = "model.safetensors.index.json";

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileError(path, "cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

rapidjson::Document parse_json(const std::string& path) {
  std::string text = read_text(path);
  rapidjson::Document doc;
  doc.Parse(text.data(), text.size());
  if (doc.HasParseError())
    throw FileError(path, std::string("invalid JSON: ") +
                              rapidjson::GetParseError_En(doc.GetParseError()) + " at byte " +
                              std::to_string(doc.GetErrorOffset()));
  if (!doc.IsObject()) throw FileError(path, "expected a JSON object");
  return doc;
}

// Typed reads of config.json keys, with transformers' defaults for absent (or null) keys.
class JsonConfig {
 public:
  JsonConfig(const rapidjson::Document& doc, std::string file) : doc_(doc), file_(std::move(file)) {}

  const rapidjson::Value* find(const char* key) const {
    auto it = doc_.FindMember(key);
    return it == doc_.MemberEnd() || it->value.IsNull() ? nullptr : &it->value;
  }
  int64_t integer(const char* key, int64_t def) const {
    const rapidjson::Value* v = find(key);
    if (!v) return def;
    if (!v->IsNumber() || std::floor(v->GetDouble()) != v->GetDouble())
      throw ConfigError(file_, key, "expected an integer");
    return static_cast<int64_t>(v->GetDouble());
  }
  double number(const char* key, double def) const {
    const rapidjson::Value* v = find(key);
    if (!v) return def;
    if (!v->IsNumber()) throw ConfigError(file_, key, "expected a number");
    return v->GetDouble();
  }
  bool boolean(const char* key, bool def) const {
    const rapidjson::Value* v = find(key);
    if (!v) return def;
    if (!v->IsBool()) throw ConfigError(file_, key, "expected true or false");
    return v->GetBool();
  }
  std::string string(const char* key, const std::string& def) const {
    const rapidjson::Value* v = find(key);
    if (!v) return def;
    if (!v->IsString()) throw ConfigError(file_, key, "expected a string");
    return v->GetString();
  }
  const std::string& file() const { return file_; }

 private:
  const rapidjson::Document& doc_;
  std::string file_;
};

std::string base_prefix(const ModelShape& shape) {
  return shape.arch == "gpt2" ? "transformer." : "model.";
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Buffers transformers writes or once wrote that are not parameters, and that it ignores on load.
bool ignorable_buffer(const ModelShape& shape, const std::string& name) {
  if (shape.arch == "gpt2") return ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias");
  return ends_with(name, ".rotary_emb.inv_freq");
}

std::string shape_str(at::IntArrayRef s) { return c10::str(s); }

// madvise over the pages holding `bytes` bytes at `data` (in a file's mapping). Advice: a failure
// changes nothing but how the kernel reads ahead.
void advise(const void* data, size_t bytes, int advice) {
  if (bytes == 0) return;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(data), first = begin / page * page;
  ::madvise(reinterpret_cast<void*>(first), begin + bytes - first, advice);
}

// `mapped` (a contiguous view of a mapped file, or any view of one: its whole storage span) is
// about to be read: its pages are asked for ahead (MADV_WILLNEED, one large read), so that the
// copy's page faults find them in the page cache and read nothing around them — the loader reads
// exactly what it copies (SafetensorsFile::open reads the header alone).
at::Tensor will_read(const at::Tensor& mapped) {
  if (mapped.numel() == 0) return mapped;
  if (mapped.is_contiguous())
    advise(mapped.data_ptr(), mapped.nbytes(), MADV_WILLNEED);
  else
    advise(mapped.storage().data(), mapped.storage().nbytes(), MADV_WILLNEED);
  return mapped;
}

}  // namespace

// ---- config.json ------------------------------------------------------------------------------

ModelShape read_hf_config(const std::string& dir) {
  const std::string file = (fs::path(dir) / "config.json").string();
  if (!fs::exists(file))
    throw FileError(file, "not found; a Hugging Face checkpoint directory holds config.json and "
                          "model.safetensors (or model.safetensors.index.json with its shards)");
  rapidjson::Document doc = parse_json(file);
  JsonConfig c(doc, file);
  const std::string type = c.string("model_type", "");
  ModelShape s;
  if (type == "gpt2") {
    s.arch = "gpt2";
    s.vocab_size = c.integer("vocab_size", 50257);
    s.n_ctx = c.integer("n_positions", 1024);
    s.d_model = c.integer("n_embd", 768);
    s.n_layer = c.integer("n_layer", 12);
    s.n_head = c.integer("n_head", 12);
    s.n_kv_head = s.n_head;
    s.d_ff = c.integer("n_inner", 4 * s.d_model);
    s.norm_eps = c.number("layer_norm_epsilon", 1e-5);
    s.tie_embeddings = c.boolean("tie_word_embeddings", true);
    // Dropout as the file says (GPT2Config writes all three; 0.1 in OpenAI's checkpoints). A key
    // that is absent means no dropout (Hugging Face's class default would be 0.1).
    s.embd_pdrop = c.number("embd_pdrop", 0.0);
    s.attn_pdrop = c.number("attn_pdrop", 0.0);
    s.resid_pdrop = c.number("resid_pdrop", 0.0);
    const std::string act = c.string("activation_function", "gelu_new");
    if (act != "gelu_new" && act != "gelu_pytorch_tanh")
      throw ConfigError(file, "activation_function",
                        "\"" + act + "\" is not supported; memrt's GPT-2 uses \"gelu_new\" (GELU, "
                        "tanh approximation)");
    if (!c.boolean("scale_attn_weights", true))
      throw ConfigError(file, "scale_attn_weights", "false is not supported (memrt scales "
                                                    "attention by 1/sqrt(head_dim))");
    if (c.boolean("scale_attn_by_inverse_layer_idx", false))
      throw ConfigError(file, "scale_attn_by_inverse_layer_idx", "true is not supported");
    if (c.boolean("add_cross_attention", false))
      throw ConfigError(file, "add_cross_attention", "cross-attention is not supported");
  } else if (type == "llama") {
    s.arch = "llama";
    s.vocab_size = c.integer("vocab_size", 32000);
    s.d_model = c.integer("hidden_size", 4096);
    s.d_ff = c.integer("intermediate_size", 11008);
    s.n_layer = c.integer("num_hidden_layers", 32);
    s.n_head = c.integer("num_attention_heads", 32);
    s.n_kv_head = c.integer("num_key_value_heads", s.n_head);
    s.n_ctx = c.integer("max_position_embeddings", 2048);
    s.norm_eps = c.number("rms_norm_eps", 1e-6);
    s.rope_theta = c.number("rope_theta", 10000.0);
    s.tie_embeddings = c.boolean("tie_word_embeddings", false);
    s.attn_pdrop = c.number("attention_dropout", 0.0);
    const std::string act = c.string("hidden_act", "silu");
    if (act != "silu")
      throw ConfigError(file, "hidden_act", "\"" + act + "\" is not supported; memrt's Llama uses "
                                            "\"silu\" (SwiGLU)");
    if (c.find("rope_scaling"))
      throw ConfigError(file, "rope_scaling",
                        "RoPE scaling (linear, dynamic, yarn, llama3) is not supported; only plain "
                        "rotary embeddings with rope_theta (remove the key or set it to null)");
    if (const rapidjson::Value* rp = c.find("rope_parameters")) {  // transformers >= 5
      auto type_it = rp->IsObject() ? rp->FindMember("rope_type") : rp->MemberEnd();
      if (!rp->IsObject() || (type_it != rp->MemberEnd() &&
                              !(type_it->value.IsString() &&
                                std::string(type_it->value.GetString()) == "default")))
        throw ConfigError(file, "rope_parameters",
                          "only {\"rope_type\": \"default\", \"rope_theta\": ...} is supported");
      auto theta = rp->FindMember("rope_theta");
      if (theta != rp->MemberEnd()) {
        if (!theta->value.IsNumber())
          throw ConfigError(file, "rope_parameters.rope_theta", "expected a number");
        s.rope_theta = theta->value.GetDouble();
      }
    }
    if (c.boolean("attention_bias", false))
      throw ConfigError(file, "attention_bias", "biases in attention are not supported");
    if (c.boolean("mlp_bias", false))
      throw ConfigError(file, "mlp_bias", "biases in the MLP are not supported");
    if (s.n_head > 0 && s.d_model % s.n_head == 0) {
      const int64_t hd = c.integer("head_dim", s.d_model / s.n_head);
      if (hd != s.d_model / s.n_head)
        throw ConfigError(file, "head_dim",
                          std::to_string(hd) + " != hidden_size / num_attention_heads (" +
                              std::to_string(s.d_model / s.n_head) + "); not supported");
    }
  } else {
    throw ConfigError(file, "model_type",
                      (type.empty() ? std::string("missing")
                                    : "\"" + type + "\" is not supported") +
                          "; memrt builds \"gpt2\" and \"llama\" models");
  }
  try {
    validate_shape(s);
  } catch (const ConfigError& e) {
    throw ConfigError(file, "", e.what());
  }
  return s;
}

std::string hf_config_json(const ModelShape& s, double init_std) {
  rapidjson::StringBuffer sb;
  rapidjson::PrettyWriter<rapidjson::StringBuffer> w(sb);
  w.SetIndent(' ', 2);
  auto key_int = [&](const char* k, int64_t v) { w.Key(k); w.Int64(v); };
  auto key_num = [&](const char* k, double v) { w.Key(k); w.Double(v); };
  auto key_str = [&](const char* k, const char* v) { w.Key(k); w.String(v); };
  auto key_bool = [&](const char* k, bool v) { w.Key(k); w.Bool(v); };
  w.StartObject();
  w.Key("architectures");
  w.StartArray();
  w.String(s.arch == "gpt2" ? "GPT2LMHeadModel" : "LlamaForCausalLM");
  w.EndArray();
  if (s.arch == "gpt2") {
    key_str("model_type", "gpt2");
    key_int("vocab_size", s.vocab_size);
    key_int("n_positions", s.n_ctx);
    key_int("n_embd", s.d_model);
    key_int("n_layer", s.n_layer);
    key_int("n_head", s.n_head);
    key_int("n_inner", s.d_ff);
    key_str("activation_function", "gelu_new");
    key_num("layer_norm_epsilon", s.norm_eps);
    // Written even when 0: transformers' own default is 0.1.
    key_num("resid_pdrop", s.resid_pdrop);
    key_num("embd_pdrop", s.embd_pdrop);
    key_num("attn_pdrop", s.attn_pdrop);
  } else {
    key_str("model_type", "llama");
    key_int("vocab_size", s.vocab_size);
    key_int("hidden_size", s.d_model);
    key_int("intermediate_size", s.d_ff);
    key_int("num_hidden_layers", s.n_layer);
    key_int("num_attention_heads", s.n_head);
    key_int("num_key_value_heads", s.n_kv_head);
    key_int("head_dim", s.head_dim());
    key_int("max_position_embeddings", s.n_ctx);
    key_num("rms_norm_eps", s.norm_eps);
    key_num("rope_theta", s.rope_theta);
    w.Key("rope_scaling");
    w.Null();
    key_str("hidden_act", "silu");
    key_bool("attention_bias", false);
    key_bool("mlp_bias", false);
    key_num("attention_dropout", s.attn_pdrop);
  }
  key_bool("tie_word_embeddings", s.tie_embeddings);
  key_num("initializer_range", init_std);
  key_str("torch_dtype", "float32");
  w.EndObject();
  return std::string(sb.GetString(), sb.GetSize()) + "\n";
}

// ---- reading weights --------------------------------------------------------------------------

HfWeights HfWeights::open(const std::string& dir) {
  HfWeights w;
  w.dir_ = dir;
  const fs::path single = fs::path(dir) / kSingleFile;
  const fs::path index = fs::path(dir) / kIndexFile;
  if (fs::exists(single)) {
    w.files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(single.string())));
    for (const auto& name : w.files_[0]->names()) {
      w.by_name_[name] = w.files_[0].get();
      w.file_of_[name] = single.string();
    }
    return w;
  }
  if (!fs::exists(index))
    throw FileError(dir, std::string("no ") + kSingleFile + " and no " + kIndexFile +
                             "; expected a Hugging Face checkpoint directory with safetensors "
                             "weights (.bin pickles are not read: convert them to safetensors)");
  const std::string index_path = index.string();
  rapidjson::Document doc = parse_json(index_path);
  auto map = doc.FindMember("weight_map");
  if (map == doc.MemberEnd() || !map->value.IsObject())
    throw FileError(index_path, "missing object 'weight_map' {tensor name: shard file}");
  std::map<std::string, const SafetensorsFile*> shards;
  for (auto it = map->value.MemberBegin(); it != map->value.MemberEnd(); ++it) {
    const std::string name = it->name.GetString();
    if (!it->value.IsString())
      throw FileError(index_path, "weight_map['" + name + "'] is not a file name");
    const std::string shard = it->value.GetString();
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..")
      throw FileError(index_path, "weight_map['" + name + "'] = '" + shard +
                                      "' is not a file name in the checkpoint directory");
    auto found = shards.find(shard);
    if (found == shards.end()) {
      const std::string shard_path = (fs::path(dir) / shard).string();
      if (!fs::exists(shard_path))
        throw FileError(shard_path, "shard listed in " + index_path + " (for tensor '" + name +
                                        "') does not exist");
      w.files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(shard_path)));
      found = shards.emplace(shard, w.files_.back().get()).first;
    }
    if (!found->second->contains(name))
      throw FileError(found->second->path(), "tensor '" + name + "' is listed for this shard in " +
                                                 index_path + " but the shard does not hold it");
    if (w.by_name_.count(name))
      throw FileError(index_path, "tensor '" + name + "' listed twice in weight_map");
    w.by_name_[name] = found->second;
    w.file_of_[name] = found->second->path();
  }
  // Every tensor of every shard must be in the index.
  for (const auto& f : w.files_)
    for (const auto& name : f->names())
      if (!w.by_name_.count(name) || w.by_name_[name] != f.get())
        throw FileError(f->path(), "tensor '" + name + "' is not listed for this shard in " +
                                       index_path);
  return w;
}

std::string HfWeights::key_of(const std::string& hf_name) const {
  return !strip_prefix_.empty() && hf_name.rfind(strip_prefix_, 0) == 0 ? hf_name.substr(strip_prefix_.size())
                                                                        : hf_name;
}

HfWeights::Located HfWeights::locate(const std::string& hf_name) const {
  const std::string key = key_of(hf_name);
  auto it = by_name_.find(key);
  if (it == by_name_.end())
    throw FileError(dir_, "tensor '" + key + "' is missing from the checkpoint");
  return {it->second, key};
}

void HfWeights::check(const ModelShape& shape, const std::vector<ParamSpec>& specs,
                      const std::set<std::string>& replaced) {
  // Base-model checkpoints (GPT2Model.save_pretrained) name tensors without the prefix.
  const std::string prefix = base_prefix(shape);
  bool any_prefixed = false;
  for (const auto& [name, file] : by_name_) any_prefixed |= name.rfind(prefix, 0) == 0;
  strip_prefix_ = any_prefixed || by_name_.empty() ? "" : prefix;

  std::set<std::string> expected;
  plugin_reads_.clear();
  std::vector<std::string> plugin_prefixes;  // "<key>." of the tensors a plugin reads
  for (const ParamSpec& spec : specs) {
    Located loc = locate(spec.name);
    expected.insert(loc.key);
    const auto& e = loc.file->entry(loc.key);
    if (replaced.count(spec.name) && !at::isFloatingType(e.dtype)) {
      plugin_reads_.insert(spec.name);
      plugin_prefixes.push_back(loc.key + ".");
      continue;
    }
    std::vector<int64_t> want = spec.shape;
    if (spec.transposed_on_disk) std::swap(want[0], want[1]);
    if (e.shape != want)
      throw FileError(loc.file->path(), "tensor '" + loc.key + "' has shape " + shape_str(e.shape) +
                                            " but the model (config.json) needs " +
                                            shape_str(want) +
                                            (spec.transposed_on_disk ? " (Conv1D: (in, out))" : ""));
    if (!at::isFloatingType(e.dtype))
      throw FileError(loc.file->path(),
                      "tensor '" + loc.key + "' has dtype " +
                          *safetensors_dtype_name(e.dtype) +
                          "; model weights must be floating point (F32, F16, BF16, F64)");
  }
  const auto companion = [&](const std::string& name) {
    for (const std::string& owner : plugin_prefixes)
      if (name.rfind(owner, 0) == 0) return true;
    return false;
  };
  for (const auto& [name, file] : by_name_) {
    if (expected.count(name) || ignorable_buffer(shape, name) || companion(name)) continue;
    const std::string full = strip_prefix_ + name;
    if (shape.tie_embeddings && (name == "lm_head.weight")) {
      const std::string emb = shape.arch == "gpt2" ? "transformer.wte.weight" : "model.embed_tokens.weight";
      Located e = locate(emb);
      at::Tensor head = will_read(file->tensor(name));
      at::Tensor table = will_read(e.file->tensor(e.key));
      if (head.sizes() != table.sizes() || !at::equal(head.to(at::kFloat), table.to(at::kFloat)))
        throw FileError(file->path(),
                        "tensor 'lm_head.weight' differs from '" + e.key +
                            "', but config.json has tie_word_embeddings true; set it to false to "
                            "load an untied head");
      continue;
    }
    throw FileError(file->path(), "unexpected tensor '" + name + "': the model described by "
                                  "config.json (" + shape.arch + ", " +
                                  std::to_string(shape.n_layer) + " layers" +
                                  (shape.tie_embeddings ? ", tied lm_head" : "") +
                                  ") has no such parameter");
  }
}

at::Tensor HfWeights::mapped(const ParamSpec& spec) const {
  Located loc = locate(spec.name);
  at::Tensor t = loc.file->tensor(loc.key);
  return spec.transposed_on_disk ? t.t() : t;
}

at::Tensor HfWeights::tensor(const ParamSpec& spec) const { return will_read(mapped(spec)); }

at::Tensor HfWeights::read(const ParamSpec& spec, const std::optional<ElementRange>& keep) const {
  const at::Tensor stored = mapped(spec);
  const bool in_place = stored.is_contiguous();  // else a transposed view: every page holds some of any row
  const at::Tensor span = keep && in_place ? stored.view(-1).narrow(0, keep->begin, keep->size()) : stored;
  will_read(span);
  if (!keep || in_place) return span;
  const int64_t row = stored.numel() / stored.size(0);  // the rows holding the slice, copied
  const int64_t first = keep->begin / row, last = (keep->end + row - 1) / row;
  return stored.narrow(0, first, last - first).reshape(-1).narrow(0, keep->begin - first * row, keep->size());
}

bool HfWeights::contains(const std::string& name) const { return by_name_.count(key_of(name)) > 0; }

at::Tensor HfWeights::tensor(const std::string& name) const {
  Located loc = locate(name);
  return will_read(loc.file->tensor(loc.key));
}

std::string HfWeights::file_of(const std::string& name) const { return locate(name).file->path(); }

void HfWeights::drop_pages(const ParamSpec& spec) const {
  Located loc = locate(spec.name);
  loc.file->drop_pages(loc.key);
}

// ---- saving -----------------------------------------------------------------------------------

void save_hf_checkpoint(CausalLM& model, const std::string& dir, int64_t max_shard_bytes) {
  auto params = model.named_parameters(/*recurse=*/true);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const ParamSpec& spec : parameter_specs(model.shape())) {
    const at::Tensor* p = params.find(spec.name);
    if (!p)
      throw Error("save_hf_checkpoint(" + dir + "): the model has no parameter '" + spec.name +
                  "' (a plugin replaced it?); merge adapters or dequantize before saving a "
                  "Hugging Face checkpoint");
    at::Tensor t = p->detach();
    tensors.emplace_back(spec.name, spec.transposed_on_disk ? t.t().contiguous() : t);
  }
  save_hf_tensors(dir, hf_config_json(model.shape()), tensors, max_shard_bytes);
}

void save_hf_tensors(const std::string& dir, const std::string& config_json,
                     const std::vector<std::pair<std::string, at::Tensor>>& tensors, int64_t max_shard_bytes,
                     const std::vector<at::ScalarType>& as) {
  TORCH_CHECK(as.empty() || as.size() == tensors.size(), "save_hf_tensors: one dtype per tensor");
  auto written = [&](size_t i) { return as.empty() || as[i] == at::ScalarType::Undefined ? tensors[i].second.scalar_type() : as[i]; };
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw FileError(dir, "cannot create checkpoint directory: " + ec.message());
  const std::map<std::string, std::string> meta{{"format", "pt"}};
  const fs::path single = fs::path(dir) / kSingleFile;
  const fs::path index = fs::path(dir) / kIndexFile;

  // Shards: consecutive tensors, each shard at most max_shard_bytes (or one oversized tensor).
  std::vector<std::vector<size_t>> shards(1);
  int64_t shard_bytes = 0, total_bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t n = tensors[i].second.numel() * static_cast<int64_t>(c10::elementSize(written(i)));
    total_bytes += n;
    if (max_shard_bytes > 0 && !shards.back().empty() && shard_bytes + n > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += n;
  }

  // Weight files of an earlier save in the other layout would shadow or confuse this one.
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string f = entry.path().filename().string();
    const bool old_shard = f.rfind("model-", 0) == 0 && ends_with(f, ".safetensors");
    if (old_shard || f == kIndexFile || (f == kSingleFile && max_shard_bytes > 0 && shards.size() > 1))
      fs::remove(entry.path(), ec);
  }

  write_file_atomic((fs::path(dir) / "config.json").string(), config_json);
  if (shards.size() == 1) {
    write_safetensors_as(single.string(), tensors, as, meta);
    return;
  }
  fs::remove(single, ec);
  rapidjson::StringBuffer sb;
  rapidjson::PrettyWriter<rapidjson::StringBuffer> w(sb);
  w.SetIndent(' ', 2);
  w.StartObject();
  w.Key("metadata");
  w.StartObject();
  w.Key("total_size");
  w.Int64(total_bytes);
  w.EndObject();
  w.Key("weight_map");
  w.StartObject();
  char buf[64];
  for (size_t k = 0; k < shards.size(); ++k) {
    std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
    std::vector<std::pair<std::string, at::Tensor>> part;
    std::vector<at::ScalarType> part_as;
    for (size_t i : shards[k]) {
      part.push_back(tensors[i]);
      part_as.push_back(written(i));
      w.Key(tensors[i].first.c_str());
      w.String(buf);
    }
    write_safetensors_as((fs::path(dir) / buf).string(), part, part_as, meta);
  }
  w.EndObject();
  w.EndObject();
  write_file_atomic(index.string(), std::string(sb.GetString(), sb.GetSize()) + "\n");
}

}  // namespace memrt
