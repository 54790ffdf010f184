#include "data/dataset.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string_view>

#include <rapidjson/document.h>
#include <rapidjson/error/en.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>
#include <unistd.h>

#include "data/chat_template.h"
#include "data/mapped_file.h"
#include "data/numpy_random.h"
#include "data/records.h"
#include "data/tokenizer.h"
#include "data/tokenizer_config.h"
#include "data/progress.h"
#include "memrt/error.h"

namespace memrt {

namespace detail {
// runtime/src/data/corpus/kjv.txt, embedded at build time (embed_corpus.cmake).
extern const unsigned char kBuiltinCorpus[];
extern const std::size_t kBuiltinCorpusSize;
}  // namespace detail

namespace {

// llm.c's token files: 256 int32 of header (magic, version, token count, 0...), then the tokens.
constexpr int64_t kLlmcHeaderInts = 256;
constexpr int64_t kLlmcHeaderBytes = kLlmcHeaderInts * 4;
constexpr int32_t kLlmcMagicGpt2 = 20240520;    // version 1: uint16 tokens, 2: uint32
constexpr int32_t kLlmcMagicLlama3 = 20240801;  // version 7: uint32 tokens

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string kib(int64_t bytes) {
  return std::to_string((bytes + 512) / 1024) + " KiB";
}

// The lines of `text`, each with its newline (the last one may lack it), as Hugging Face datasets'
// text loader gives them with keep_linebreaks (run_clm's default).
void split_lines(std::string_view text, std::vector<std::string_view>& out) {
  for (size_t at = 0; at < text.size();) {
    const size_t nl = text.find('\n', at);
    const size_t end = nl == std::string_view::npos ? text.size() : nl + 1;
    out.push_back(text.substr(at, end - at));
    at = end;
  }
}

// How the log and errors name a dataset's files: the one file, or the first and how many follow it.
std::string files_name(const std::vector<std::string>& paths) {
  if (paths.empty()) return "built-in corpus";
  if (paths.size() == 1) return paths.front();
  return paths.front() + " and " + std::to_string(paths.size() - 1) + " more file" + (paths.size() > 2 ? "s" : "");
}

// fn(text, n, line number) for the `field` of each line of a JSONL file (blank lines skipped),
// valid during the call only; a line that is not an object with a string `field` is a FileError
// naming it.
template <typename Fn>
void for_each_jsonl_text(const std::string& path, const MappedFile& file, const std::string& field, Fn fn) {
  const char* p = reinterpret_cast<const char*>(file.data());
  const char* end = p + file.size();
  int64_t line_no = 0;
  while (p < end) {
    const char* eol = static_cast<const char*>(std::memchr(p, '\n', static_cast<size_t>(end - p)));
    if (!eol) eol = end;
    ++line_no;
    const char* first = p;
    while (first < eol && (*first == ' ' || *first == '\t' || *first == '\r')) ++first;
    if (first < eol) {  // blank lines separate nothing and are skipped
      rapidjson::Document doc;
      doc.Parse(first, static_cast<size_t>(eol - first));
      std::string where = "line " + std::to_string(line_no) + ": ";
      const std::string quoted = "\"" + field + "\"";
      if (doc.HasParseError())
        throw FileError(path, where + "invalid JSON (" +
                                  rapidjson::GetParseError_En(doc.GetParseError()) + " at column " +
                                  std::to_string(doc.GetErrorOffset() + 1 + (first - p)) +
                                  "); expected one object per line such as {" + quoted + ": \"...\"}");
      if (!doc.IsObject())
        throw FileError(path, where + "expected a JSON object with a " + quoted + " field, one per line");
      auto it = doc.FindMember(rapidjson::StringRef(field.data(), field.size()));
      if (it == doc.MemberEnd())
        throw FileError(path, where + "the object has no " + quoted + " field; every line needs {" + quoted +
                                      ": \"...\"} (other fields are ignored" +
                                      (field == "text" ? std::string("; dataset_text_field names another field)")
                                                       : std::string(": dataset_text_field is " + quoted + ")")));
      if (!it->value.IsString())
        throw FileError(path, where + quoted + " must be a string");
      fn(it->value.GetString(), static_cast<size_t>(it->value.GetStringLength()), line_no);
    }
    p = eol + 1;
  }
}

// ---- the tokenized cache (docs/tokenizers.md) --------------------------------------------------

namespace fs = std::filesystem;

constexpr char kCacheFormat[] = "memrt-tokenized-1";

uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

uint64_t fnv1a(uint64_t h, const std::string& s) { return fnv1a(h, s.data(), s.size() + 1); }  // with its NUL

// Bytes [at, at + n) of an open file into the hash.
uint64_t fnv1a_file(uint64_t h, std::ifstream& in, uint64_t at, uint64_t n) {
  std::string buf(static_cast<size_t>(n), '\0');
  in.seekg(static_cast<std::streamoff>(at));
  in.read(buf.data(), static_cast<std::streamsize>(n));
  return fnv1a(h, buf.data(), static_cast<size_t>(in.gcount()));
}

std::string default_cache_dir() {
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return (fs::path(xdg) / "memrt" / "tokenized").string();
  if (const char* home = std::getenv("HOME"); home && *home) return (fs::path(home) / ".cache" / "memrt" / "tokenized").string();
  return "";
}

// The cache entry's name: a hash of the format, the tokenizer (its file, and tokenizer_config.json
// and chat_template.jinja beside it, whole), the data files (absolute path, size, modification time and its first and
// last MiB) and the options that shape the samples: another tokenizer, an edited, touched or copied
// file or another option is another entry.
std::string cache_key(const std::vector<std::string>& paths, const std::string& tokenizer, const std::string& options) {
  uint64_t h = fnv1a(1469598103934665603ull, kCacheFormat);
  for (const fs::path& f : {fs::path(tokenizer), tokenizer_config_path(fs::path(tokenizer).parent_path()),
                            fs::path(tokenizer).parent_path() / "chat_template.jinja"}) {
    std::ifstream in(f, std::ios::binary);
    if (!in) continue;
    h = fnv1a(h, f.filename().string());
    h = fnv1a_file(h, in, 0, static_cast<uint64_t>(fs::file_size(f)));
  }
  for (const std::string& path : paths) {
    if (path.empty()) {
      h = fnv1a(h, "built-in corpus " + std::to_string(detail::kBuiltinCorpusSize));
      continue;
    }
    const uint64_t size = fs::file_size(path);
    const auto mtime = fs::last_write_time(path).time_since_epoch().count();
    h = fnv1a(h, fs::absolute(path).lexically_normal().string() + " " + std::to_string(size) + " " + std::to_string(mtime));
    std::ifstream in(path, std::ios::binary);
    constexpr uint64_t kMiB = uint64_t{1} << 20;
    h = fnv1a_file(h, in, 0, std::min(size, kMiB));
    if (size > kMiB) h = fnv1a_file(h, in, size - std::min(size - kMiB, kMiB), std::min(size - kMiB, kMiB));
  }
  if (!options.empty()) h = fnv1a(h, options);
  char name[32];
  std::snprintf(name, sizeof name, "%016llx", static_cast<unsigned long long>(h));
  return name;
}

rapidjson::Document read_cache_info(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  rapidjson::Document d;
  d.Parse(text.str().c_str());
  if (d.HasParseError() || !d.IsObject() || !d.HasMember("format") || !d["format"].IsString() ||
      std::string(d["format"].GetString()) != kCacheFormat || !d.HasMember("vocab_size") || !d["vocab_size"].IsInt64() ||
      !d.HasMember("documents") || !d["documents"].IsInt64() || !d.HasMember("kind") || !d["kind"].IsString())
    throw FileError(path, "is not a memrt tokenized-cache entry (" + std::string(kCacheFormat) +
                              "): remove it and its .bin, and the data is tokenized again");
  return d;
}

// Records' label masks, sample boundaries and each sample's record, beside the tokens.
struct CachedSamples {
  const std::vector<uint8_t>& labels;
  const std::vector<int64_t>& offsets;
  const std::vector<int64_t>& records;
};

// A whole file written to a temporary name and renamed into place.
void write_file(const std::string& path, const void* data, size_t bytes) {
  const std::string tmp = path + "." + std::to_string(::getpid()) + ".tmp";
  std::ofstream out(tmp, std::ios::binary);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  out.close();
  if (!out) throw FileError(path, "cannot be written");
  fs::rename(tmp, path);
}

// <entry>.bin (llm.c's uint32 token file), for records <entry>.labels (a byte per token),
// <entry>.samples (int64 boundaries) and <entry>.records (each sample's record, int64), and last
// <entry>.json, each written to a temporary name and renamed into place: an entry is whole or absent.
void write_cache(const std::string& entry, const std::vector<uint32_t>& ids, const std::string& kind, int64_t documents,
                 int64_t vocab_size, const std::string& what, const std::string& tokenizer,
                 const std::optional<CachedSamples>& samples = std::nullopt) {
  fs::create_directories(fs::path(entry).parent_path());
  const std::string tmp = "." + std::to_string(::getpid()) + ".tmp";
  if (samples) {
    write_file(entry + ".labels", samples->labels.data(), samples->labels.size());
    write_file(entry + ".samples", samples->offsets.data(), samples->offsets.size() * sizeof(int64_t));
    write_file(entry + ".records", samples->records.data(), samples->records.size() * sizeof(int64_t));
  }
  {
    std::ofstream out(entry + ".bin" + tmp, std::ios::binary);
    std::vector<int32_t> header(256, 0);
    header[0] = 20240520;  // llm.c's magic; version 2: uint32 tokens
    header[1] = 2;
    header[2] = static_cast<int32_t>(ids.size());
    out.write(reinterpret_cast<const char*>(header.data()), static_cast<std::streamsize>(header.size() * 4));
    out.write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 4));
    out.close();
    if (!out) throw FileError(entry + ".bin", "cannot be written");
  }
  fs::rename(entry + ".bin" + tmp, entry + ".bin");
  {
    rapidjson::StringBuffer sb;
    rapidjson::Writer<rapidjson::StringBuffer> w(sb);
    w.StartObject();
    w.Key("format");
    w.String(kCacheFormat);
    w.Key("data");
    w.String(what.c_str());
    w.Key("tokenizer");
    w.String(tokenizer.c_str());
    w.Key("kind");
    w.String(kind.c_str());
    w.Key("documents");
    w.Int64(documents);
    w.Key("tokens");
    w.Int64(static_cast<int64_t>(ids.size()));
    w.Key("vocab_size");
    w.Int64(vocab_size);
    if (samples) {
      w.Key("samples");
      w.Int64(static_cast<int64_t>(samples->offsets.size()) - 1);
    }
    w.EndObject();
    std::ofstream out(entry + ".json" + tmp, std::ios::binary);
    out << sb.GetString() << "\n";
    out.close();
    if (!out) throw FileError(entry + ".json", "cannot be written");
  }
  fs::rename(entry + ".json" + tmp, entry + ".json");
}

// The fields of a JSONL file's first record, which say its shape (TRL detects a dataset's type so).
std::vector<std::string> first_record_fields(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<std::string> fields;
  if (ends_with(path, ".json")) {  // an array of records
    std::stringstream text;
    text << in.rdbuf();
    rapidjson::Document d;
    d.Parse(text.str().c_str());
    if (!d.HasParseError() && d.IsArray() && !d.Empty() && d[0].IsObject())
      for (const auto& m : d[0].GetObject()) fields.emplace_back(m.name.GetString(), m.name.GetStringLength());
    return fields;
  }
  for (std::string line; std::getline(in, line);) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    rapidjson::Document d;
    d.Parse(line.c_str());
    if (!d.HasParseError() && d.IsObject())
      for (const auto& m : d.GetObject()) fields.emplace_back(m.name.GetString(), m.name.GetStringLength());
    break;
  }
  return fields;
}

// The record type a .jsonl / .json train file's first record has ("prompt_completion" or
// "messages", as TRL detects it), or nullptr: not records of those types.
const char* records_type(const std::string& path) {
  if (!ends_with(path, ".jsonl") && !ends_with(path, ".json")) return nullptr;
  const std::vector<std::string> fields = first_record_fields(path);
  auto has = [&](const char* f) { return std::find(fields.begin(), fields.end(), f) != fields.end(); };
  if (has("prompt") && has("completion")) return "prompt_completion";
  if (has("messages") || has("conversations")) return "messages";
  return nullptr;
}

int32_t read_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);  // the files are little-endian, as is every host memrt builds for
  return v;
}

}  // namespace

TokenDataset::~TokenDataset() = default;

std::shared_ptr<TokenDataset> TokenDataset::open(const DataConfig& cfg) {
  const std::vector<std::string>& paths = cfg.train_files;
  const std::string path = paths.empty() ? std::string() : paths.front();  // its name says the format of all
  if (!cfg.datasets.empty()) {
    if (cfg.tokenizer.empty())
      throw FileError(cfg.datasets.front().path, "fine-tuning records are tokenized with the model's tokenizer: set "
                                                 "model_name_or_path to a directory with a tokenizer.json (or tokenizer.model)");
    return open_records(cfg);
  }
  if (ends_with(path, ".bin")) {
    if (paths.size() > 1) throw FileError(paths[1], "follows the token file " + path + "; a .bin file is read alone");
    return open_bin(path);
  }
  if (ends_with(path, ".jsonl") || ends_with(path, ".json")) {  // a record's fields say its shape, as in TRL
    if (const char* type = records_type(path)) {
      DataConfig records = cfg;
      for (const std::string& file : paths) records.datasets.push_back({file, type});  // each file's records in turn
      return open(records);
    }
    const std::vector<std::string> fields = first_record_fields(path);
    auto has = [&](const char* f) { return std::find(fields.begin(), fields.end(), f) != fields.end(); };
    if (has("instruction") && has("output"))
      throw FileError(path, "holds alpaca records (instruction/output): name the file in axolotl's "
                            "datasets: [{path: " + path + ", type: alpaca}] instead of train_file");
    if (ends_with(path, ".json"))
      throw FileError(path, "a .json file holds records (prompt/completion, messages, or alpaca through datasets:); "
                            "text goes in a .txt file or a JSONL file with a \"text\" field per line");
  }
  if (!cfg.tokenizer.empty()) return open_tokenized(paths, cfg.tokenizer, cfg.cache_dir, cfg.text_field);
  if (paths.empty()) return builtin_corpus();
  if (ends_with(path, ".jsonl")) return open_jsonl(paths, cfg.text_field);
  return open_text(paths);
}

bool TokenDataset::yields_samples(const DataConfig& cfg) {
  return !cfg.datasets.empty() || (!cfg.train_files.empty() && records_type(cfg.train_files.front()));
}

std::shared_ptr<TokenDataset> TokenDataset::builtin_corpus() {
  std::shared_ptr<TokenDataset> d(new TokenDataset());
  d->tokens_ = detail::kBuiltinCorpus;
  d->num_tokens_ = static_cast<int64_t>(detail::kBuiltinCorpusSize);
  d->description_ = "built-in corpus (" + kib(d->num_tokens_) +
                    ", byte-level): King James Bible, Genesis, Exodus and Ruth (public domain)";
  return d;
}

std::shared_ptr<TokenDataset> TokenDataset::open_text(const std::vector<std::string>& paths) {
  std::shared_ptr<TokenDataset> d(new TokenDataset());
  if (paths.size() == 1) {  // read in place
    d->file_ = std::make_unique<MappedFile>(paths.front());
    d->tokens_ = d->file_->data();
    d->num_tokens_ = static_cast<int64_t>(d->file_->size());
  } else {  // one stream of their bytes, in order
    for (const std::string& path : paths) {
      const MappedFile file(path);
      d->owned_.append(reinterpret_cast<const char*>(file.data()), file.size());
    }
    d->tokens_ = reinterpret_cast<const uint8_t*>(d->owned_.data());
    d->num_tokens_ = static_cast<int64_t>(d->owned_.size());
  }
  if (d->num_tokens_ < 2)
    throw FileError(files_name(paths), "holds " + std::to_string(d->num_tokens_) +
                                           " bytes; a byte-level text file needs at least 2 (one input and "
                                           "its target), and far more to train on");
  d->description_ = files_name(paths) + " (" + kib(d->num_tokens_) + ", byte-level text)";
  return d;
}

std::shared_ptr<TokenDataset> TokenDataset::open_bin(const std::string& path) {
  std::shared_ptr<TokenDataset> d(new TokenDataset());
  d->file_ = std::make_unique<MappedFile>(path);
  const uint8_t* bytes = d->file_->data();
  const auto size = static_cast<int64_t>(d->file_->size());

  int32_t magic = size >= 4 ? read_i32(bytes) : 0;
  if (size >= kLlmcHeaderBytes && (magic == kLlmcMagicGpt2 || magic == kLlmcMagicLlama3)) {
    int32_t version = read_i32(bytes + 4);
    int32_t count = read_i32(bytes + 8);
    if (magic == kLlmcMagicGpt2 && version == 1) {
      d->bytes_per_token_ = 2;
    } else if ((magic == kLlmcMagicGpt2 && version == 2) ||
               (magic == kLlmcMagicLlama3 && version == 7)) {
      d->bytes_per_token_ = 4;
    } else {
      throw FileError(path, "llm.c token file header with magic " + std::to_string(magic) +
                                " has version " + std::to_string(version) +
                                "; expected version 1 (uint16 tokens) or 2 (uint32) for magic " +
                                std::to_string(kLlmcMagicGpt2) + ", or 7 (uint32) for magic " +
                                std::to_string(kLlmcMagicLlama3));
    }
    int64_t expected = kLlmcHeaderBytes + int64_t{count} * d->bytes_per_token_;
    if (count < 0 || expected != size)
      throw FileError(path, "llm.c header says " + std::to_string(count) + " tokens of " +
                                std::to_string(d->bytes_per_token_) + " bytes, i.e. a file of " +
                                std::to_string(expected) + " bytes, but the file has " +
                                std::to_string(size) + " (truncated or not an llm.c token file)");
    d->tokens_ = bytes + kLlmcHeaderBytes;
    d->num_tokens_ = count;
    d->description_ = path + " (llm.c token file v" + std::to_string(version) + ", uint" +
                      std::to_string(8 * d->bytes_per_token_) + ", " + std::to_string(count) +
                      " tokens)";
  } else {
    d->bytes_per_token_ = ends_with(path, ".u32.bin") ? 4 : 2;
    if (size % d->bytes_per_token_ != 0)
      throw FileError(path, "has " + std::to_string(size) + " bytes, not a whole number of uint" +
                                std::to_string(8 * d->bytes_per_token_) +
                                " tokens (headerless .bin files hold uint16 tokens; name uint32 "
                                "files *.u32.bin, or write llm.c's 256-int32 header)");
    d->tokens_ = bytes + 0;
    d->num_tokens_ = size / d->bytes_per_token_;
    d->description_ = path + " (raw uint" + std::to_string(8 * d->bytes_per_token_) + ", " +
                      std::to_string(d->num_tokens_) + " tokens)";
  }
  if (d->num_tokens_ < 2)
    throw FileError(path, "holds " + std::to_string(d->num_tokens_) +
                              " tokens; at least 2 are needed (one input and its target)");
  d->scan_vocab();
  return d;
}

std::shared_ptr<TokenDataset> TokenDataset::open_jsonl(const std::vector<std::string>& paths,
                                                       const std::string& text_field) {
  std::shared_ptr<TokenDataset> d(new TokenDataset());
  int64_t documents = 0;
  for (const std::string& path : paths) {
    const MappedFile file(path);
    for_each_jsonl_text(path, file, text_field, [&](const char* text, size_t n, int64_t) {
      d->owned_.append(text, n);
      d->owned_.push_back('\n');  // documents are separated by a newline
      ++documents;
    });
  }
  if (d->owned_.size() < 2)
    throw FileError(files_name(paths), "holds no text: expected lines such as {\"" + text_field + "\": \"...\"}");
  d->tokens_ = reinterpret_cast<const uint8_t*>(d->owned_.data());
  d->num_tokens_ = static_cast<int64_t>(d->owned_.size());
  d->description_ = files_name(paths) + " (JSONL, " + std::to_string(documents) + " documents, " +
                    kib(d->num_tokens_) + ", byte-level)";
  return d;
}

std::shared_ptr<TokenDataset> TokenDataset::open_tokenized(const std::vector<std::string>& paths,
                                                           const std::string& tokenizer_json,
                                                           const std::string& cache_dir, const std::string& text_field) {
  const std::string what = files_name(paths);
  const std::string dir = cache_dir.empty() ? default_cache_dir() : cache_dir;
  const bool jsonl = !paths.empty() && ends_with(paths.front(), ".jsonl");
  std::string entry;  // the cache entry, without its extension; "" for none
  try {
    // Another JSONL field is other documents (the default "text" keys as it always has).
    const bool other_field = jsonl && text_field != "text";
    if (!dir.empty())
      entry = (fs::path(dir) / cache_key(paths.empty() ? std::vector<std::string>{""} : paths, tokenizer_json,
                                         other_field ? "text_field " + text_field : ""))
                  .string();
  } catch (const std::exception&) {
    // An unreadable data or tokenizer file: reading it below says what is wrong.
  }
  if (!entry.empty() && fs::exists(entry + ".json") && fs::exists(entry + ".bin")) {  // tokenized before
    const rapidjson::Document info = read_cache_info(entry + ".json");
    std::shared_ptr<TokenDataset> d = open_bin(entry + ".bin");
    d->vocab_size_ = info["vocab_size"].GetInt64();
    d->description_ = what + " (" + info["kind"].GetString() + ", " + std::to_string(info["documents"].GetInt64()) +
                      " documents, " + std::to_string(d->num_tokens_) + " tokens of " + tokenizer_json +
                      ", from the cache " + entry + ".bin)";
    return d;
  }
  const Tokenizer tok = Tokenizer::from_file(tokenizer_json);
  std::vector<std::unique_ptr<MappedFile>> files;  // text documents are views of them
  std::string arena;                                // JSONL documents, unescaped
  std::vector<std::string_view> docs;
  // Each document's file (an index into paths) and line in it; for text files the line is counted.
  std::vector<std::pair<size_t, int64_t>> origin;
  std::string kind;
  if (paths.empty()) {  // the built-in corpus, line by line
    kind = "King James Bible, Genesis, Exodus and Ruth";
    split_lines(std::string_view(reinterpret_cast<const char*>(detail::kBuiltinCorpus), detail::kBuiltinCorpusSize), docs);
    for (size_t i = 0; i < docs.size(); ++i) origin.emplace_back(0, static_cast<int64_t>(i) + 1);
  } else {  // each file's documents in turn, as datasets reads a split's files
    kind = jsonl ? "JSONL" : "text";
    std::vector<std::pair<size_t, size_t>> spans;  // JSONL: where each document is in the arena
    for (size_t f = 0; f < paths.size(); ++f) {
      files.push_back(std::make_unique<MappedFile>(paths[f]));
      const MappedFile& file = *files.back();
      if (jsonl) {
        for_each_jsonl_text(paths[f], file, text_field, [&](const char* text, size_t n, int64_t line) {
          spans.emplace_back(arena.size(), n);
          arena.append(text, n);
          origin.emplace_back(f, line);
        });
      } else {
        const size_t before = docs.size();
        split_lines(std::string_view(reinterpret_cast<const char*>(file.data()), file.size()), docs);
        for (size_t i = before; i < docs.size(); ++i) origin.emplace_back(f, static_cast<int64_t>(i - before) + 1);
      }
    }
    for (const auto& [at, n] : spans) docs.emplace_back(arena.data() + at, n);
  }
  for (size_t i = 0; i < docs.size(); ++i) {
    if (const std::optional<size_t> bad = first_invalid_utf8(docs[i]))
      throw FileError(paths.empty() ? what : paths[origin[i].first],
                      "line " + std::to_string(origin[i].second) + ": the text is not valid UTF-8 (byte " +
                          std::to_string(*bad) + " of " + (jsonl ? "its \"" + text_field + "\"" : std::string("the line")) +
                          "); the tokenizer takes UTF-8 text: convert the file (e.g. iconv -t UTF-8)");
  }
  // Documents encode independently, on the run's threads, and are concatenated in order.
  std::vector<std::vector<int32_t>> encoded;
  try {
    ProgressCounter progress("tokenizing " + (paths.empty() ? std::string("the built-in corpus") : what) + " ",
                             Tokenizer::text_bytes(docs), /*show=*/true);
    encoded = tok.encode_batch(docs, /*add_special_tokens=*/true, at::get_num_threads(),
                               [&](size_t bytes) { progress.add(static_cast<int64_t>(bytes)); });
  } catch (const std::exception& e) {
    throw FileError(paths.empty() ? std::string("the built-in corpus") : what, std::string("cannot be tokenized: ") + e.what());
  }
  std::shared_ptr<TokenDataset> d(new TokenDataset());
  d->tokenized_ = true;
  size_t count = 0;
  for (const std::vector<int32_t>& ids : encoded) count += ids.size();
  d->owned_ids_.reserve(count);
  for (std::vector<int32_t>& ids : encoded) {
    d->owned_ids_.insert(d->owned_ids_.end(), ids.begin(), ids.end());
    std::vector<int32_t>().swap(ids);
  }
  if (d->owned_ids_.size() < 2)
    throw FileError(what, "holds " + std::to_string(d->owned_ids_.size()) +
                              " tokens once tokenized; at least 2 are needed (one input and its target)");
  d->tokens_ = reinterpret_cast<const uint8_t*>(d->owned_ids_.data());
  d->num_tokens_ = static_cast<int64_t>(d->owned_ids_.size());
  d->bytes_per_token_ = 4;
  d->vocab_size_ = tok.vocab_size();
  d->description_ = what + " (" + kind + ", " + std::to_string(docs.size()) + " documents, " +
                    std::to_string(d->num_tokens_) + " tokens of " + tokenizer_json + ": " + tok.describe();
  if (entry.empty()) {
    d->description_ += "; not cached: neither dataset_prepared_path, XDG_CACHE_HOME nor HOME is set)";
    return d;
  }
  try {
    write_cache(entry, d->owned_ids_, kind, static_cast<int64_t>(docs.size()), d->vocab_size_, what, tokenizer_json);
    d->description_ += "; cached in " + entry + ".bin)";
  } catch (const std::exception& e) {
    d->description_ += std::string("; not cached: ") + e.what() + ")";
  }
  return d;
}

namespace {

// A template memrt ships, for the cache's key (a changed template is another entry).
std::string named_source(const std::string& name) {
  const std::string* source = named_chat_template(name);
  return source ? *source : std::string();
}

// The template conversations are rendered with: train.yaml's source, a template memrt ships by name
// (with the fallback, only where the model has none), or the model's own; nullopt for none.
std::optional<ChatTemplate> run_chat_template(const DataConfig& cfg) {
  if (!cfg.chat_template.empty()) return ChatTemplate::parse(cfg.chat_template, cfg.chat_template_where);
  const std::string model = fs::path(cfg.tokenizer).parent_path().string();
  if (cfg.chat_template_name.empty() || cfg.chat_template_fallback) {
    std::optional<ChatTemplate> own = load_chat_template(model);
    if (own || cfg.chat_template_name.empty()) return own;
  }
  const std::string* source = named_chat_template(cfg.chat_template_name);
  if (!source)
    throw FileError(cfg.chat_template_where, "is " + (cfg.chat_template_fallback ? "tokenizer_default_fallback_" : std::string()) +
                                                 cfg.chat_template_name + ", a template memrt does not ship (it has " +
                                                 named_chat_template_names() + "); use tokenizer_default for the "
                                                 "model's own, or give the template (chat_template: jinja with "
                                                 "chat_template_jinja: FILE)");
  return ChatTemplate::parse(*source, "memrt's " + cfg.chat_template_name + " chat template");
}

// What of an axolotl chat_template dataset's keys changes its samples, for the cache's key — and
// the axolotl release whose way of finding turns it follows (0.19: its locator).
std::string describe_chat_options(const RecordOptions& o) {
  const ChatTemplateDataset& c = o.chat;
  std::string s = "{axolotl 0.19 " + c.field_messages + " " + c.field_system + " " + c.field_tools +
                  " train_on_eos " + c.train_on_eos + " train_on_eot " + c.train_on_eot.value_or("(eos)") +
                  " training " + c.message_field_training + " detail " + c.message_field_training_detail +
                  (c.drop_system_message ? " drop_system" : "") +
                  (c.split_thinking ? " split_thinking" : "") + " thinking " + c.template_thinking_key + "=" +
                  c.field_thinking + " mappings";
  for (const auto& [k, v] : c.property_mappings) s += " " + k + "=" + v;
  s += " roles";
  for (const auto& [k, v] : c.roles) s += " " + k + "=" + v;
  s += " train";
  for (const std::string& r : c.roles_to_train) s += " " + r;
  if (o.eot_tokens) {
    s += " eot";
    for (const std::string& t : *o.eot_tokens) s += " " + t;
  }
  return s + "}";
}

// What of a LLaMA-Factory dataset's description and the run's keys changes its samples, for the cache's key.
std::string describe_llamafactory_options(const RecordOptions& o) {
  const LlamaFactoryDataset& d = o.llamafactory;
  const LlamaFactoryOptions& lf = o.llamafactory_options;
  std::string s = "{" + d.formatting;
  for (const std::string* f : {&d.prompt, &d.query, &d.response, &d.history, &d.messages, &d.system, &d.tools, &d.role_tag,
                               &d.content_tag, &d.user_tag, &d.assistant_tag, &d.observation_tag, &d.function_tag,
                               &d.system_tag})
    s += " [" + *f + "]";
  s += " part " + std::to_string(d.part) + " max_samples " + std::to_string(o.max_samples) + " template [" +
       lf.template_name + "]" +
       (lf.mask_history ? " mask_history" : "") + (lf.enable_thinking ? " thinking" : "");
  if (lf.default_system) s += " default_system [" + *lf.default_system + "]";
  return s + "}";
}

}  // namespace

std::shared_ptr<TokenDataset> TokenDataset::open_records(const DataConfig& cfg) {
  const std::vector<DatasetSource>& sources = cfg.datasets;
  const std::string& tokenizer_json = cfg.tokenizer;
  const int64_t block_size = cfg.block_size;
  std::vector<std::string> paths;
  std::string what, options = "records (with their records' indices) block_size " + std::to_string(block_size) +
                              (cfg.train_on_prompt ? " prompt" : "") + (cfg.assistant_only ? " assistant" : "") +
                              (cfg.chat_template.empty() ? "" : " template " + cfg.chat_template) +
                              (cfg.chat_template_kwargs.empty() ? "" : " kwargs " + cfg.chat_template_kwargs) +
                              (cfg.chat_template_name.empty() ? "" : " named template " + cfg.chat_template_name +
                                                                         (cfg.chat_template_fallback ? " fallback " : " ") +
                                                                         named_source(cfg.chat_template_name));
  std::vector<RecordOptions> per_source;
  std::optional<ChatTemplate> chat_template;
  rapidjson::Document kwargs;  // chat_template_kwargs, for the chat_template datasets
  if (!cfg.chat_template_kwargs.empty()) kwargs.Parse(cfg.chat_template_kwargs.c_str());
  for (const DatasetSource& src : sources) {
    RecordOptions o;
    if (src.type == "alpaca") {
      o.type = RecordType::kAlpaca;
    } else if (src.type == "prompt_completion") {
      o.type = RecordType::kPromptCompletion;
    } else if (src.type == "messages" || src.type == "chat_template") {
      o.type = src.type == "messages" ? RecordType::kMessages : RecordType::kChatTemplate;
      if (!chat_template) chat_template = run_chat_template(cfg);
      if (!chat_template)
        throw FileError(src.path, "holds conversations, rendered with the model's chat template, and " +
                                      fs::path(tokenizer_json).parent_path().string() +
                                      " has none (tokenizer_config.json's \"chat_template\", or chat_template.jinja)");
    } else if (src.type == "llamafactory") {
      o.type = RecordType::kLlamaFactory;
      o.llamafactory = src.llamafactory;
      o.llamafactory_options = cfg.llamafactory;
      o.max_samples = src.max_samples;
      if (cfg.llamafactory.template_name.empty() && !chat_template) chat_template = run_chat_template(cfg);
    } else {
      throw FileError(src.path, "has type \"" + src.type +
                                    "\"; memrt reads alpaca, prompt_completion, messages, chat_template and "
                                    "llamafactory records");
    }
    if (cfg.assistant_only && o.type != RecordType::kMessages)
      throw FileError(src.path, std::string("assistant_only_loss applies to conversations (\"messages\"); these are ") +
                                    record_type_name(o.type) + " records (completion_only_loss / train_on_inputs choose their loss)");
    o.max_length = block_size;
    o.train_on_prompt = cfg.train_on_prompt;
    o.assistant_only = cfg.assistant_only;
    o.chat = src.chat;
    o.eot_tokens = cfg.eot_tokens;
    if (o.type == RecordType::kChatTemplate && kwargs.IsObject()) o.chat_template_kwargs = &kwargs;
    per_source.push_back(o);
    paths.push_back(src.path);
    what += (what.empty() ? "" : " + ") + src.path;
    options += std::string(" ") + record_type_name(o.type);
    if (o.type == RecordType::kChatTemplate) options += " " + describe_chat_options(o);
    if (o.type == RecordType::kLlamaFactory) options += " " + describe_llamafactory_options(o);
  }
  for (RecordOptions& o : per_source) o.chat_template = chat_template ? &*chat_template : nullptr;
  const std::string dir = cfg.cache_dir.empty() ? default_cache_dir() : cfg.cache_dir;
  std::string entry;
  try {
    if (!dir.empty()) entry = (fs::path(dir) / cache_key(paths, tokenizer_json, options)).string();
  } catch (const std::exception&) {
    // An unreadable data or tokenizer file: reading it below says what is wrong.
  }
  auto describe = [&](int64_t records, int64_t samples, int64_t tokens, int64_t labels) {
    return what + " (" + std::to_string(records) + " records, " + std::to_string(samples) + " samples, " +
           std::to_string(tokens) + " tokens of " + tokenizer_json + ", " + std::to_string(labels) + " trained";
  };
  if (!entry.empty() && fs::exists(entry + ".json")) {  // tokenized before
    const rapidjson::Document info = read_cache_info(entry + ".json");
    std::shared_ptr<TokenDataset> d = open_bin(entry + ".bin");
    d->vocab_size_ = info["vocab_size"].GetInt64();
    d->labels_file_ = std::make_unique<MappedFile>(entry + ".labels");
    d->labels_ = d->labels_file_->data();
    const MappedFile offsets(entry + ".samples"), records(entry + ".records");
    const auto* o = reinterpret_cast<const int64_t*>(offsets.data());
    d->offsets_.assign(o, o + offsets.size() / sizeof(int64_t));
    const auto* r = reinterpret_cast<const int64_t*>(records.data());
    d->records_.assign(r, r + records.size() / sizeof(int64_t));
    d->num_records_ = info["documents"].GetInt64();
    if (static_cast<int64_t>(d->labels_file_->size()) != d->num_tokens_ || d->offsets_.size() < 2 ||
        d->offsets_.back() != d->num_tokens_ || d->records_.size() + 1 != d->offsets_.size())
      throw FileError(entry + ".json", "is a damaged cache entry: remove it, and the data is tokenized again");
    int64_t labels = 0;
    for (int64_t k = 0; k < d->num_samples(); ++k) labels += d->sample_labels(k);
    d->description_ = describe(info["documents"].GetInt64(), d->num_samples(), d->num_tokens_, labels) +
                      ", from the cache " + entry + ".bin)";
    return d;
  }
  const Tokenizer tok = Tokenizer::from_file(tokenizer_json);
  TokenizedRecords rec;
  std::string counts;
  int64_t samples_left = -1;  // LLaMA-Factory's max_samples: what the dataset being read may still take
  for (size_t i = 0; i < sources.size(); ++i) {
    const int64_t dropped = rec.dropped, truncated = rec.truncated, records = rec.records;
    RecordOptions& o = per_source[i];
    if (o.type == RecordType::kLlamaFactory && o.max_samples >= 0) {  // over the files of its directory
      if (o.llamafactory.part == 0) samples_left = o.max_samples;
      o.max_samples = samples_left;
    }
    tokenize_records(sources[i].path, tok, o, rec, at::get_num_threads());
    if (o.type == RecordType::kLlamaFactory && o.max_samples >= 0) samples_left -= rec.records - records;
    if (rec.dropped > dropped)
      counts += "; " + sources[i].path + ": " + std::to_string(rec.dropped - dropped) + " records dropped (" +
                (per_source[i].type == RecordType::kLlamaFactory
                     ? std::string("invalid as LLaMA-Factory reads them: a role out of turn, an odd count, no response; "
                                   "or nothing to train on)")
                     : "longer than block_size " + std::to_string(block_size) + ", or nothing to train on)");
    if (rec.truncated > truncated)
      counts += "; " + sources[i].path + ": " + std::to_string(rec.truncated - truncated) + " records cut to block_size " +
                std::to_string(block_size);
  }
  for (const std::string& note : rec.notes) counts += "; " + note;
  if (rec.offsets.size() < 2)
    throw FileError(what, "holds no sample to train on (" + std::to_string(rec.records) + " records, " +
                              std::to_string(rec.dropped) + " dropped: longer than block_size " +
                              std::to_string(block_size) + " tokens, or with nothing to train on)");
  std::shared_ptr<TokenDataset> d(new TokenDataset());
  d->tokenized_ = true;
  d->owned_ids_ = std::move(rec.ids);
  d->owned_labels_ = std::move(rec.labels);
  d->offsets_ = std::move(rec.offsets);
  d->records_ = std::move(rec.sample_records);
  d->num_records_ = rec.records;
  d->tokens_ = reinterpret_cast<const uint8_t*>(d->owned_ids_.data());
  d->labels_ = d->owned_labels_.data();
  d->num_tokens_ = static_cast<int64_t>(d->owned_ids_.size());
  d->bytes_per_token_ = 4;
  d->vocab_size_ = tok.vocab_size();
  int64_t labels = 0;
  for (int64_t k = 0; k < d->num_samples(); ++k) labels += d->sample_labels(k);
  d->description_ = describe(rec.records, d->num_samples(), d->num_tokens_, labels) + ": " + tok.describe() + counts;
  if (entry.empty()) {
    d->description_ += "; not cached: neither dataset_prepared_path, XDG_CACHE_HOME nor HOME is set)";
    return d;
  }
  try {
    write_cache(entry, d->owned_ids_, options, rec.records, d->vocab_size_, what, tokenizer_json,
                CachedSamples{d->owned_labels_, d->offsets_, d->records_});
    d->description_ += "; cached in " + entry + ".bin)";
  } catch (const std::exception& e) {
    d->description_ += std::string("; not cached: ") + e.what() + ")";
  }
  return d;
}

std::shared_ptr<TokenDataset> TokenDataset::subset(const std::vector<int64_t>& samples,
                                                  const std::string& description) const {
  std::shared_ptr<TokenDataset> d(new TokenDataset());
  d->tokenized_ = tokenized_;
  for (int64_t k : samples) {
    const int64_t begin = sample_begin(k), n = sample_length(k);
    const size_t at = d->owned_ids_.size();
    d->owned_ids_.resize(at + static_cast<size_t>(n));
    std::memcpy(d->owned_ids_.data() + at, tokens_ + 4 * begin, static_cast<size_t>(n) * 4);  // records: uint32
    d->owned_labels_.insert(d->owned_labels_.end(), labels_ + begin, labels_ + begin + n);
    d->offsets_.push_back(static_cast<int64_t>(at));
    d->records_.push_back(sample_record(k));
  }
  d->offsets_.push_back(static_cast<int64_t>(d->owned_ids_.size()));
  d->tokens_ = reinterpret_cast<const uint8_t*>(d->owned_ids_.data());
  d->labels_ = d->owned_labels_.data();
  d->num_tokens_ = static_cast<int64_t>(d->owned_ids_.size());
  d->bytes_per_token_ = 4;
  d->vocab_size_ = vocab_size_;
  d->num_records_ = num_records_;
  d->description_ = description;
  return d;
}

TokenDataset::Split TokenDataset::hold_out(const TokenDataset& all, const HeldOut& held, uint64_t seed) {
  // Hugging Face datasets' train_test_split: a fraction rounds the held-out count up; a count is
  // itself; each side must keep one.
  auto held_count = [&](int64_t n) {
    const auto k = held.size < 1 ? static_cast<int64_t>(std::ceil(held.size * static_cast<double>(n)))
                                 : static_cast<int64_t>(held.size);
    if (k >= n)
      throw Error(held.key + ": " + std::to_string(k) + " held out of " + std::to_string(n) +
                  (held.tool == HeldOut::Tool::kAxolotl ? " samples" : " records") + " leaves none to train on");
    return k;
  };
  const int64_t n = all.num_records();
  // datasets' shuffle and split: numpy's default_rng; axolotl without shuffle_merged_datasets: file order
  std::vector<int64_t> order(static_cast<size_t>(n));
  if (held.tool == HeldOut::Tool::kAxolotl && !held.shuffle)
    for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  else
    order = numpy_permutation(n, seed);
  std::vector<int64_t> place(static_cast<size_t>(n));  // record -> its place in `order`
  for (int64_t i = 0; i < n; ++i) place[static_cast<size_t>(order[static_cast<size_t>(i)])] = i;
  std::vector<int64_t> samples(static_cast<size_t>(all.num_samples()));  // in `order`
  for (size_t k = 0; k < samples.size(); ++k) samples[k] = static_cast<int64_t>(k);
  std::sort(samples.begin(), samples.end(), [&](int64_t a, int64_t b) {
    return place[static_cast<size_t>(all.sample_record(a))] < place[static_cast<size_t>(all.sample_record(b))];
  });
  // axolotl: the merged records shuffled, the samples that survive its filters split, the last held
  // out. LLaMA-Factory: the records split before they are processed, the first of the permutation
  // held out; each side's samples those its records make.
  std::vector<int64_t> train, eval;
  if (held.tool == HeldOut::Tool::kAxolotl) {
    const int64_t held_out = held_count(static_cast<int64_t>(samples.size()));
    const auto cut = samples.end() - held_out;
    train.assign(samples.begin(), cut);
    eval.assign(cut, samples.end());
  } else {
    const int64_t held_out = held_count(n);
    for (int64_t k : samples) (place[static_cast<size_t>(all.sample_record(k))] < held_out ? eval : train).push_back(k);
  }
  for (const auto* side : {&train, &eval})
    if (side->empty())
      throw Error(held.key + ": the " + (side == &train ? "training" : "held-out") + " records make no sample (" +
                  std::to_string(n) + " records, " + std::to_string(all.num_samples()) + " samples)");
  std::ostringstream of;
  of << " of " << all.description() << "; " << held.key << " " << held.size << ", seed " << seed;
  return {all.subset(train, std::to_string(train.size()) + " samples trained on" + of.str()),
          all.subset(eval, std::to_string(eval.size()) + " samples held out" + of.str())};
}

int64_t TokenDataset::sample_labels(int64_t k) const {
  int64_t n = 0;
  for (int64_t i = sample_begin(k) + 1; i < sample_begin(k + 1); ++i) n += labels_[i] != 0;
  return n;
}

void TokenDataset::scan_vocab() {
  int64_t max_id = 0;
  if (bytes_per_token_ == 2) {
    uint16_t m = 0;
    for (int64_t i = 0; i < num_tokens_; ++i) {
      uint16_t v;
      std::memcpy(&v, tokens_ + 2 * i, 2);
      m = std::max(m, v);
    }
    max_id = m;
  } else {
    uint32_t m = 0;
    for (int64_t i = 0; i < num_tokens_; ++i) {
      uint32_t v;
      std::memcpy(&v, tokens_ + 4 * i, 4);
      m = std::max(m, v);
    }
    max_id = m;
  }
  vocab_size_ = max_id + 1;
}

int64_t TokenDataset::token(int64_t i) const {
  int64_t v;
  copy_tokens(i, 1, &v);
  return v;
}

void TokenDataset::copy_tokens(int64_t begin, int64_t count, int64_t* out) const {
  if (begin < 0 || count < 0 || begin + count > num_tokens_)
    throw Error("TokenDataset: tokens [" + std::to_string(begin) + ", " +
                std::to_string(begin + count) + ") are out of range for " + description_);
  const uint8_t* p = tokens_ + begin * bytes_per_token_;
  switch (bytes_per_token_) {
    case 1:
      for (int64_t i = 0; i < count; ++i) out[i] = p[i];
      break;
    case 2:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        out[i] = v;
      }
      break;
    default:
      for (int64_t i = 0; i < count; ++i) {
        uint32_t v;
        std::memcpy(&v, p + 4 * i, 4);
        out[i] = v;
      }
  }
}

// ---- sampling -----------------------------------------------------------------------------------

namespace {

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Uniform in [0, n), unbiased (rejects the top sliver of the 64-bit range).
uint64_t uniform_below(uint64_t& state, uint64_t n) {
  uint64_t threshold = (0 - n) % n;  // 2^64 mod n
  uint64_t r;
  do r = splitmix64(state);
  while (r < threshold);
  return r % n;
}

}  // namespace

std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  uint64_t state = seed;
  state = splitmix64(state) ^ (static_cast<uint64_t>(epoch) * 0xd1b54a32d192ed03ULL);
  for (int64_t i = n - 1; i > 0; --i) {
    auto j = static_cast<int64_t>(uniform_below(state, static_cast<uint64_t>(i) + 1));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  return order;
}

DataLoader::DataLoader(std::shared_ptr<const TokenDataset> data, int64_t block_size,
                       int64_t micro_batch_size, int64_t grad_accum_steps, int rank, int world_size,
                       uint64_t seed, bool pad_to_block, bool pack)
    : data_(std::move(data)), block_size_(block_size), micro_batch_size_(micro_batch_size),
      grad_accum_steps_(grad_accum_steps), rank_(rank), world_size_(world_size), seed_(seed),
      pad_to_block_(pad_to_block) {
  if (!data_) throw Error("DataLoader: no dataset");
  if (block_size_ < 1 || micro_batch_size_ < 1 || grad_accum_steps_ < 1 || world_size_ < 1 ||
      rank_ < 0 || rank_ >= world_size_)
    throw Error("DataLoader: expected block_size, micro batch size, gradient_accumulation_steps "
                "and world size >= 1 and 0 <= rank < world size; got block_size " +
                std::to_string(block_size_) + ", micro batch " + std::to_string(micro_batch_size_) +
                ", accumulation " + std::to_string(grad_accum_steps_) + ", rank " +
                std::to_string(rank_) + " of " + std::to_string(world_size_));
  samples_ = data_->has_samples() ? data_->num_samples() : data_->num_tokens() / (block_size_ + 1);
  for (int64_t k = 0; k < data_->num_samples(); ++k) {
    if (data_->sample_length(k) > block_size_)
      throw Error(data_->description() + ": sample " + std::to_string(k) + " holds " +
                  std::to_string(data_->sample_length(k)) + " tokens, more than block_size " + std::to_string(block_size_));
    labels_of_.push_back(static_cast<int32_t>(data_->sample_labels(k)));
  }
  if (pack && data_->has_samples()) {  // rows of samples; a row's labels are its samples'
    rows_ = pack_samples(*data_, block_size_);
    std::vector<int32_t> row_labels;
    for (const std::vector<int64_t>& row : rows_) {
      int32_t n = 0;
      for (int64_t k : row) n += labels_of_[static_cast<size_t>(k)];
      row_labels.push_back(n);
    }
    labels_of_ = std::move(row_labels);
    samples_ = static_cast<int64_t>(rows_.size());
  }
  global_batch_ = micro_batch_size_ * grad_accum_steps_ * world_size_;
  steps_per_epoch_ = samples_ / global_batch_;
  if (steps_per_epoch_ < 1) {
    std::ostringstream msg;
    msg << data_->description() << ": ";
    if (data_->has_samples())
      msg << samples_ << " samples";
    else
      msg << data_->num_tokens() << " tokens make " << samples_ << " samples of block_size+1 = " << block_size_ + 1
          << " tokens";
    msg << ", fewer than one global batch of " << global_batch_
        << " (train_batch_size = micro batch " << micro_batch_size_ << " x accumulation "
        << grad_accum_steps_ << " x " << world_size_
        << " ranks); use more data, a smaller block_size or a smaller batch";
    throw Error(msg.str());
  }
}

std::vector<int64_t> DataLoader::sample_indices(int64_t step, int64_t micro) const {
  if (step < 0 || micro < 0 || micro >= grad_accum_steps_)
    throw Error("DataLoader::get: step " + std::to_string(step) + ", micro-batch " +
                std::to_string(micro) + " out of range (expected step >= 0 and 0 <= micro < " +
                std::to_string(grad_accum_steps_) + ")");
  const int64_t slot = micro * world_size_ + rank_;
  return order_slice(step / steps_per_epoch_, (step % steps_per_epoch_) * global_batch_ + slot * micro_batch_size_,
                     micro_batch_size_);
}

std::vector<int64_t> DataLoader::order_slice(int64_t epoch, int64_t first, int64_t count) const {
  std::lock_guard<std::mutex> lock(cache_->mutex);
  if (cache_->epoch != epoch) {
    cache_->order = epoch_permutation(samples_, seed_, epoch);
    cache_->epoch = epoch;
  }
  auto begin = cache_->order.begin() + first;
  return std::vector<int64_t>(begin, begin + count);
}

int64_t DataLoader::step_labels(int64_t step) const {
  if (!data_->has_samples()) return global_batch_ * block_size_;
  int64_t n = 0;
  for (int64_t k : order_slice(step / steps_per_epoch_, (step % steps_per_epoch_) * global_batch_, global_batch_))
    n += labels_of_[static_cast<size_t>(k)];
  return n;
}

namespace {

// Rows of samples as one batch (B, T), T the longest row or `pad_to`; `layout`: positions and
// sample starts too.
Batch rows_batch(const TokenDataset& data, const std::vector<std::vector<int64_t>>& rows, int64_t pad_to, bool layout) {
  const auto B = static_cast<int64_t>(rows.size());
  int64_t T = pad_to;
  for (const std::vector<int64_t>& row : rows) {
    int64_t n = 0;
    for (int64_t k : row) n += data.sample_length(k);
    T = std::max(T, n);
  }
  Batch batch;
  batch.inputs = at::zeros({B, T}, at::kLong);
  batch.targets = at::full({B, T}, -100, at::kLong);
  if (layout) batch.positions = at::zeros({B, T}, at::kLong);
  int64_t* in = batch.inputs.data_ptr<int64_t>();
  int64_t* tg = batch.targets.data_ptr<int64_t>();
  int64_t* pos = layout ? batch.positions.data_ptr<int64_t>() : nullptr;
  for (int64_t b = 0; b < B; ++b) {
    int64_t at = b * T;
    for (int64_t k : rows[static_cast<size_t>(b)]) {
      const int64_t begin = data.sample_begin(k), n = data.sample_length(k);
      data.copy_tokens(begin, n, in + at);
      batch.tokens += n;
      for (int64_t t = 0; t < n; ++t) {
        if (t + 1 < n && data.trained(begin + t + 1)) tg[at + t] = in[at + t + 1];
        if (layout) pos[at + t] = t;
      }
      at += n;
    }
    if (layout)  // the padding, a sample of its own
      for (int64_t t = 0; at + t < (b + 1) * T; ++t) pos[at + t] = t;
  }
  return batch;
}

}  // namespace

Batch sample_batch(const TokenDataset& data, const std::vector<int64_t>& samples, int64_t pad_to) {
  std::vector<std::vector<int64_t>> rows;
  for (int64_t k : samples) rows.push_back({k});
  return rows_batch(data, rows, pad_to, /*layout=*/false);
}

Batch packed_batch(const TokenDataset& data, const std::vector<std::vector<int64_t>>& rows, int64_t width) {
  return rows_batch(data, rows, width, /*layout=*/true);
}

std::vector<std::vector<int64_t>> pack_samples(const TokenDataset& data, int64_t width) {
  const int64_t n = data.num_samples();
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) order[static_cast<size_t>(k)] = k;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return data.sample_length(a) > data.sample_length(b); });
  // A max-tree over the rows' free space (n rows at most, unopened ones empty): the first row with
  // room for a sample is found, and updated, in O(log n).
  int64_t leaves = 1;
  while (leaves < std::max<int64_t>(n, 1)) leaves *= 2;
  std::vector<int64_t> room(static_cast<size_t>(2 * leaves), width);
  std::vector<std::vector<int64_t>> rows;
  for (int64_t k : order) {
    const int64_t len = data.sample_length(k);
    if (len > width) throw Error(data.description() + ": sample " + std::to_string(k) + " is longer than a row");
    size_t node = 1;
    while (node < static_cast<size_t>(leaves)) node = room[2 * node] >= len ? 2 * node : 2 * node + 1;
    const size_t row = node - static_cast<size_t>(leaves);
    if (row >= rows.size()) rows.resize(row + 1);
    rows[row].push_back(k);
    room[node] -= len;
    for (node /= 2; node >= 1; node /= 2) room[node] = std::max(room[2 * node], room[2 * node + 1]);
  }
  return rows;
}

double DataLoader::packing_efficiency() const {
  if (rows_.empty()) return 0.0;
  int64_t tokens = 0;
  for (int64_t k = 0; k < data_->num_samples(); ++k) tokens += data_->sample_length(k);
  return static_cast<double>(tokens) / static_cast<double>(static_cast<int64_t>(rows_.size()) * block_size_);
}

Batch DataLoader::get(int64_t step, int64_t micro) const {
  std::vector<int64_t> indices = sample_indices(step, micro);
  if (!rows_.empty()) {
    std::vector<std::vector<int64_t>> rows;
    for (int64_t r : indices) rows.push_back(rows_[static_cast<size_t>(r)]);
    return packed_batch(*data_, rows, pad_to_block_ ? block_size_ : 0);
  }
  if (data_->has_samples()) return sample_batch(*data_, indices, pad_to_block_ ? block_size_ : 0);
  const int64_t B = micro_batch_size_, T = block_size_;
  at::Tensor window = at::empty({B, T + 1}, at::kLong);  // (B, T+1)
  int64_t* w = window.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    data_->copy_tokens(indices[static_cast<size_t>(b)] * (T + 1), T + 1, w + b * (T + 1));
  Batch batch;
  batch.inputs = window.narrow(1, 0, T).contiguous();   // (B, T)
  batch.targets = window.narrow(1, 1, T).contiguous();  // (B, T)
  batch.tokens = B * T;
  return batch;
}

int64_t eval_windows(const TokenDataset& data, int64_t block_size) {
  if (data.has_samples()) return data.num_samples();
  return block_size > 1 ? data.num_tokens() / block_size : 0;
}

Batch eval_batch(const TokenDataset& data, int64_t block_size, int64_t first, int64_t count) {
  if (first < 0 || count < 0 || first + count > eval_windows(data, block_size))
    throw Error("eval_batch: windows [" + std::to_string(first) + ", " + std::to_string(first + count) +
                ") are not in the " + std::to_string(eval_windows(data, block_size)) + " the data holds");
  if (data.has_samples()) {
    std::vector<int64_t> samples(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) samples[static_cast<size_t>(i)] = first + i;
    return sample_batch(data, samples);
  }
  at::Tensor window = at::empty({count, block_size}, at::kLong);  // (count, block_size)
  data.copy_tokens(first * block_size, count * block_size, window.data_ptr<int64_t>());
  Batch batch;
  batch.inputs = window.narrow(1, 0, block_size - 1).contiguous();  // (count, block_size - 1)
  batch.targets = window.narrow(1, 1, block_size - 1).contiguous();
  batch.tokens = count * (block_size - 1);
  return batch;
}

}  // namespace memrt
