#include "data/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <queue>
#include <sstream>
#include <thread>
#include <unordered_map>

#include <rapidjson/document.h>

#include "data/sentencepiece_model.h"
#include "data/tokenizer_config.h"
#include "data/utf8.h"
#include "memrt/error.h"

namespace memrt {
namespace {

using Json = rapidjson::Value;

// ---- UTF-8 ------------------------------------------------------------------------------------

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// The length of the maximal prefix of a well-formed sequence at s[i] (at least 1): what
// String::from_utf8_lossy replaces by one U+FFFD when the sequence is cut short or malformed.
size_t maximal_subpart(std::string_view s, size_t i) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  const size_t n = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 1;
  size_t k = 1;
  for (; k < n && i + k < s.size(); ++k) {
    const unsigned char b = static_cast<unsigned char>(s[i + k]);
    unsigned char lo = 0x80, hi = 0xBF;
    if (k == 1 && c == 0xE0) lo = 0xA0;
    if (k == 1 && c == 0xED) hi = 0x9F;
    if (k == 1 && c == 0xF0) lo = 0x90;
    if (k == 1 && c == 0xF4) hi = 0x8F;
    if (b < lo || b > hi) break;
  }
  return k;
}

// String::from_utf8_lossy: each maximal invalid subpart becomes U+FFFD.
std::string lossy_utf8(const std::string& bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    const size_t n = utf8_sequence(bytes, i);
    if (n > 0) {
      out.append(bytes, i, n);
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += maximal_subpart(bytes, i);
    }
  }
  return out;
}

// ---- GPT-2's byte alphabet --------------------------------------------------------------------

// Each byte as one printable character: the bytes that are printable in Latin-1 stand for
// themselves, the others for U+0100 upwards in byte order (GPT-2's bytes_to_unicode).
struct ByteAlphabet {
  std::array<std::string, 256> to_char;
  std::unordered_map<uint32_t, uint8_t> to_byte;
  ByteAlphabet() {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      const uint32_t c = printable ? b : next++;
      append_utf8(to_char[b], c);
      to_byte[c] = static_cast<uint8_t>(b);
    }
  }
};

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet a;
  return a;
}

// ---- regular expressions (PCRE2, Unicode properties as the Rust engines read them) -------------

class Regex {
 public:
  Regex(const std::string& pattern, const std::function<FileError(const std::string&)>& fail) {
    int code = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &code, &offset, nullptr);
    if (!re) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(code, message, sizeof message);
      throw fail("the regex " + pattern + " does not compile at offset " + std::to_string(offset) + ": " +
                 reinterpret_cast<const char*>(message));
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);  // where JIT is unavailable, the interpreter runs
    code_.reset(re, pcre2_code_free);
  }

  // fn(begin, end) for each non-empty match of valid UTF-8 `s`, left to right.
  template <typename Fn>
  void for_each_match(std::string_view s, Fn fn) const {
    thread_local std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
        pcre2_match_data_create(1, nullptr), pcre2_match_data_free);
    size_t at = 0;
    while (at <= s.size()) {
      const int rc = pcre2_match(code_.get(), reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), at,
                                 PCRE2_NO_UTF_CHECK, data.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) return;
      if (rc < 0) throw Error("tokenizer: regex match failed (PCRE2 error " + std::to_string(rc) + ")");
      const PCRE2_SIZE* v = pcre2_get_ovector_pointer(data.get());
      if (v[1] > v[0]) {
        fn(v[0], v[1]);
        at = v[1];
      } else {  // an empty match: step over one character
        if (v[0] >= s.size()) return;
        at = v[0] + std::max<size_t>(1, utf8_sequence(s, v[0]));
      }
    }
  }

 private:
  std::shared_ptr<pcre2_code> code_;
};

// GPT-2's pre-tokenization regex (tokenizers' ByteLevel with use_regex).
constexpr char kGpt2Pattern[] = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---- JSON access with the path in every message -------------------------------------------------

struct Reader {
  std::string file;
  FileError fail(const std::string& path, const std::string& what) const { return FileError(file, path + ": " + what); }
  const Json& member(const Json& v, const std::string& path, const char* key) const {
    if (!v.IsObject() || !v.HasMember(key)) throw fail(path, std::string("has no \"") + key + "\"");
    return v[key];
  }
  std::string string(const Json& v, const std::string& path, const char* key) const {
    const Json& m = member(v, path, key);
    if (!m.IsString()) throw fail(path + "." + key, "is not a string");
    return std::string(m.GetString(), m.GetStringLength());
  }
  bool boolean(const Json& v, const std::string& path, const char* key, bool fallback) const {
    if (!v.IsObject() || !v.HasMember(key) || v[key].IsNull()) return fallback;
    if (!v[key].IsBool()) throw fail(path + "." + key, "is not true or false");
    return v[key].GetBool();
  }
  // fn(item, its path) for each item of the list v[key] (a Sequence's steps).
  template <typename Fn>
  void each(const Json& v, const std::string& path, const char* key, Fn fn) const {
    const Json& list = member(v, path, key);
    if (!list.IsArray()) throw fail(path + "." + key, "is not a list");
    for (rapidjson::SizeType i = 0; i < list.Size(); ++i) fn(list[i], path + "." + key + "[" + std::to_string(i) + "]");
  }
  [[noreturn]] void unsupported(const std::string& path, const std::string& type, const std::string& supported) const {
    throw fail(path + ".type", "is \"" + type + "\", which memrt's tokenizer does not implement (it implements " +
                                   supported + "); docs/tokenizers.md lists what is supported");
  }
};

std::string pattern_of(const Reader& r, const Json& v, const std::string& path, bool* is_regex) {
  const Json& p = r.member(v, path, "pattern");
  if (p.IsObject() && p.HasMember("Regex") && p["Regex"].IsString()) {
    *is_regex = true;
    return p["Regex"].GetString();
  }
  if (p.IsObject() && p.HasMember("String") && p["String"].IsString()) {
    *is_regex = false;
    return p["String"].GetString();
  }
  throw r.fail(path + ".pattern", "is neither {\"Regex\": ...} nor {\"String\": ...}");
}

// A literal string as a PCRE2 pattern.
std::string quote(const std::string& s) { return "\\Q" + s + "\\E"; }

}  // namespace

// ---- the tokenizer ------------------------------------------------------------------------------

struct Tokenizer::Impl {
  // Normalizer steps, in order.
  struct Normalize {
    enum Kind { kNfc, kNfkc, kNfd, kNfkd, kPrepend, kReplace } kind;
    std::string text;              // Prepend: the prefix; Replace: the content
    std::shared_ptr<Regex> regex;  // Replace
  };
  // Pre-tokenizer steps, in order; ByteLevel, which maps the bytes, last.
  enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
  struct Split {
    std::shared_ptr<Regex> regex;
    Behavior behavior;
  };
  struct AddedToken {
    int32_t id;
    std::string content;
    bool special, normalized, lstrip, rstrip;
  };
  struct Merge {
    int32_t rank, id;
  };

  std::string file;
  // Tells this tokenizer's cached words from another's (which may reuse a freed one's address).
  const uint64_t serial = next_serial();
  static uint64_t next_serial() {
    static std::atomic<uint64_t> n{0};
    return ++n;
  }
  std::vector<Normalize> normalizers;
  std::vector<Split> splits;  // the steps before ByteLevel
  bool byte_level = false, add_prefix_space = false;
  std::shared_ptr<Regex> byte_level_regex;  // ByteLevel's use_regex: GPT-2's, isolating
  // Metaspace (sentencepiece-style): spaces become `replacement`, prepended as prepend_scheme says.
  enum class Prepend { kAlways, kFirst, kNever };
  bool metaspace = false, metaspace_split = false;
  std::string replacement;
  Prepend prepend = Prepend::kAlways;
  std::vector<std::string> pre_names;
  // The BPE model.
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> tokens;  // by id (added tokens too); "" where no token has the id
  std::unordered_map<uint64_t, Merge> merges;
  std::array<int32_t, 256> byte_ids{};  // each byte's character's id, -1 if none
  std::optional<int32_t> unk;
  bool fuse_unk = false, ignore_merges = false, byte_fallback = false;
  std::array<int32_t, 256> fallback_ids{};  // "<0xNN>" tokens (byte_fallback), -1 if none
  // Added tokens: matched on the raw text (special or normalized: false) or on normalized text.
  std::vector<AddedToken> added;
  std::array<std::vector<int>, 256> raw_by_first, normalized_by_first;  // longest first
  std::vector<bool> is_special;  // by id
  // Post-processing (add_special_tokens): the single-sequence template, -1 standing for the text.
  std::vector<int32_t> single_template;
  bool has_template = false;
  // The post-processor's ByteLevel: offsets trimmed of the spaces a token begins or ends with
  // (trim_offsets), but for the one a first token's add_prefix_space put there.
  bool trim_offsets = false, trim_keeps_prefix_space = false;
  std::string post_name = "none", decoder_name = "none";
  // The decoder: steps over the tokens' strings, in order (tokenizers' decode_chain).
  struct Decode {
    enum Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
    std::string from, to;  // Replace: literal pattern -> content; Strip: the character; Metaspace: replacement
    int64_t start = 0, stop = 0;  // Strip
    bool prepend_first = false;   // Metaspace: the first token loses its replacements
  };
  std::vector<Decode> decoders;
  bool has_decoder = false;

  static uint64_t pair(int32_t a, int32_t b) { return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b); }

  void read(const std::string& text);
  void read_normalizer(const Reader& r, const Json& v, const std::string& path);
  void read_pre_tokenizer(const Reader& r, const Json& v, const std::string& path);
  void read_model(const Reader& r, const Json& v);
  void read_added(const Reader& r, const Json& v);
  void read_post_processor(const Reader& r, const Json& v, const std::string& path);
  void read_decoder(const Reader& r, const Json& v, const std::string& path);

  std::string normalize(std::string s) const;
  // `s` holds no added token; `at_start`: it begins the encoded text (Metaspace's "first").
  void encode_text(std::string_view s, bool at_start, std::vector<int32_t>& out) const;
  void bpe(std::string_view word, std::vector<int32_t>& out) const;
  // Splits s on the added tokens of `by_first`: fn(piece) for text between them, token(id) for each.
  template <typename Text, typename Token>
  void split_added(std::string_view s, const std::array<std::vector<int>, 256>& by_first, Text text, Token token) const;
};

void Tokenizer::Impl::read(const std::string& text) {
  const Reader r{file};
  rapidjson::Document d;
  d.Parse(text.c_str(), text.size());
  if (d.HasParseError() || !d.IsObject()) throw FileError(file, "is not a JSON object (a Hugging Face tokenizer.json)");
  read_model(r, r.member(d, "tokenizer.json", "model"));
  if (d.HasMember("added_tokens")) read_added(r, d["added_tokens"]);
  if (d.HasMember("normalizer") && !d["normalizer"].IsNull()) read_normalizer(r, d["normalizer"], "normalizer");
  if (d.HasMember("pre_tokenizer") && !d["pre_tokenizer"].IsNull()) read_pre_tokenizer(r, d["pre_tokenizer"], "pre_tokenizer");
  if (d.HasMember("post_processor") && !d["post_processor"].IsNull()) read_post_processor(r, d["post_processor"], "post_processor");
  if (d.HasMember("decoder") && !d["decoder"].IsNull()) read_decoder(r, d["decoder"], "decoder");
  if (d.HasMember("truncation") && !d["truncation"].IsNull())
    throw r.fail("truncation", "is set; memrt cuts samples itself (sequence_len): save the tokenizer without truncation");
}

void Tokenizer::Impl::read_normalizer(const Reader& r, const Json& v, const std::string& path) {
  const std::string type = r.string(v, path, "type");
  if (type == "Sequence") {
    r.each(v, path, "normalizers", [&](const Json& step, const std::string& at) { read_normalizer(r, step, at); });
  } else if (type == "NFC" || type == "NFKC" || type == "NFD" || type == "NFKD") {
    normalizers.push_back({type == "NFC" ? Normalize::kNfc : type == "NFKC" ? Normalize::kNfkc
                           : type == "NFD" ? Normalize::kNfd : Normalize::kNfkd, "", nullptr});
  } else if (type == "Prepend") {
    normalizers.push_back({Normalize::kPrepend, r.string(v, path, "prepend"), nullptr});
  } else if (type == "Replace") {
    bool is_regex = false;
    const std::string p = pattern_of(r, v, path, &is_regex);
    auto fail = [&](const std::string& what) { return r.fail(path + ".pattern", what); };
    normalizers.push_back({Normalize::kReplace, r.string(v, path, "content"),
                           std::make_shared<Regex>(is_regex ? p : quote(p), fail)});
  } else {
    r.unsupported(path, type, "Sequence, NFC, NFKC, NFD, NFKD, Prepend, Replace");
  }
}

void Tokenizer::Impl::read_pre_tokenizer(const Reader& r, const Json& v, const std::string& path) {
  const std::string type = r.string(v, path, "type");
  if (byte_level || metaspace)
    throw r.fail(path, std::string("follows the ") + (byte_level ? "ByteLevel" : "Metaspace") +
                           " step; memrt implements it as the last pre-tokenizer");
  if (type == "Sequence") {
    r.each(v, path, "pretokenizers", [&](const Json& step, const std::string& at) { read_pre_tokenizer(r, step, at); });
    return;
  }
  pre_names.push_back(type);
  auto fail = [&](const std::string& what) { return r.fail(path + ".pattern", what); };
  if (type == "Split") {
    bool is_regex = false;
    const std::string p = pattern_of(r, v, path, &is_regex);
    if (r.boolean(v, path, "invert", false)) throw r.fail(path + ".invert", "is true, which memrt does not implement");
    static const std::map<std::string, Behavior> kBehaviors = {
        {"Removed", Behavior::kRemoved}, {"Isolated", Behavior::kIsolated},
        {"MergedWithPrevious", Behavior::kMergedWithPrevious}, {"MergedWithNext", Behavior::kMergedWithNext},
        {"Contiguous", Behavior::kContiguous}};
    const std::string b = r.string(v, path, "behavior");
    const auto it = kBehaviors.find(b);
    if (it == kBehaviors.end()) throw r.fail(path + ".behavior", "is \"" + b + "\", not one of tokenizers' behaviors");
    splits.push_back({std::make_shared<Regex>(is_regex ? p : quote(p), fail), it->second});
  } else if (type == "ByteLevel") {
    byte_level = true;
    add_prefix_space = r.boolean(v, path, "add_prefix_space", true);
    if (r.boolean(v, path, "use_regex", true)) byte_level_regex = std::make_shared<Regex>(kGpt2Pattern, fail);
  } else if (type == "Metaspace") {
    metaspace = true;
    replacement = r.string(v, path, "replacement");
    metaspace_split = r.boolean(v, path, "split", true);
    if (v.HasMember("prepend_scheme") && v["prepend_scheme"].IsString()) {
      const std::string scheme = v["prepend_scheme"].GetString();
      if (scheme != "always" && scheme != "first" && scheme != "never")
        throw r.fail(path + ".prepend_scheme", "is \"" + scheme + "\", not always, first or never");
      prepend = scheme == "always" ? Prepend::kAlways : scheme == "first" ? Prepend::kFirst : Prepend::kNever;
    } else {  // files before tokenizers 0.15: add_prefix_space
      prepend = r.boolean(v, path, "add_prefix_space", true) ? Prepend::kAlways : Prepend::kNever;
    }
  } else {
    r.unsupported(path, type, "Sequence, Split, ByteLevel, Metaspace");
  }
}

void Tokenizer::Impl::read_model(const Reader& r, const Json& m) {
  const std::string type = r.string(m, "model", "type");
  if (type != "BPE") r.unsupported("model", type, "BPE");
  if (m.HasMember("dropout") && !m["dropout"].IsNull() && !(m["dropout"].IsNumber() && m["dropout"].GetDouble() == 0.0))
    throw r.fail("model.dropout", "is set; BPE dropout is for training a tokenizer, not for encoding data");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (m.HasMember(key) && !m[key].IsNull() && !(m[key].IsString() && m[key].GetStringLength() == 0))
      throw r.fail(std::string("model.") + key, "is set, which memrt's byte-level BPE does not implement");
  byte_fallback = r.boolean(m, "model", "byte_fallback", false);
  fuse_unk = r.boolean(m, "model", "fuse_unk", false);
  ignore_merges = r.boolean(m, "model", "ignore_merges", false);
  const Json& vocab_json = r.member(m, "model", "vocab");
  if (!vocab_json.IsObject()) throw r.fail("model.vocab", "is not an object of token -> id");
  for (auto it = vocab_json.MemberBegin(); it != vocab_json.MemberEnd(); ++it) {
    if (!it->value.IsInt() || it->value.GetInt() < 0) throw r.fail("model.vocab", "gives a token a non-integer id");
    const int32_t id = it->value.GetInt();
    std::string token(it->name.GetString(), it->name.GetStringLength());
    if (static_cast<size_t>(id) >= tokens.size()) tokens.resize(static_cast<size_t>(id) + 1);
    tokens[static_cast<size_t>(id)] = token;
    vocab.emplace(std::move(token), id);
  }
  if (m.HasMember("unk_token") && m["unk_token"].IsString()) {
    const auto it = vocab.find(m["unk_token"].GetString());
    if (it == vocab.end()) throw r.fail("model.unk_token", "is not in the vocabulary");
    unk = it->second;
  }
  const Json& list = r.member(m, "model", "merges");
  if (!list.IsArray()) throw r.fail("model.merges", "is not a list");
  for (rapidjson::SizeType i = 0; i < list.Size(); ++i) {
    std::string a, b;
    const Json& e = list[i];
    if (e.IsString()) {  // "a b" (tokenizers before 0.20)
      const std::string s(e.GetString(), e.GetStringLength());
      const size_t space = s.find(' ', 1);
      if (space == std::string::npos) throw r.fail("model.merges[" + std::to_string(i) + "]", "is not \"a b\"");
      a = s.substr(0, space);
      b = s.substr(space + 1);
    } else if (e.IsArray() && e.Size() == 2 && e[0].IsString() && e[1].IsString()) {  // ["a", "b"]
      a = e[0].GetString();
      b = e[1].GetString();
    } else {
      throw r.fail("model.merges[" + std::to_string(i) + "]", "is neither \"a b\" nor [\"a\", \"b\"]");
    }
    const auto ia = vocab.find(a), ib = vocab.find(b), ic = vocab.find(a + b);
    if (ia == vocab.end() || ib == vocab.end() || ic == vocab.end())
      throw r.fail("model.merges[" + std::to_string(i) + "]", "merges \"" + a + "\" and \"" + b +
                                                            "\", which (or whose result) the vocabulary lacks");
    merges.emplace(pair(ia->second, ib->second), Merge{static_cast<int32_t>(i), ic->second});
  }
  const ByteAlphabet& alphabet = byte_alphabet();
  for (int b = 0; b < 256; ++b) {
    const auto it = vocab.find(alphabet.to_char[static_cast<size_t>(b)]);
    byte_ids[static_cast<size_t>(b)] = it == vocab.end() ? -1 : it->second;
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", static_cast<unsigned>(b));
    const auto f = vocab.find(name);
    fallback_ids[static_cast<size_t>(b)] = f == vocab.end() ? -1 : f->second;
  }
}

void Tokenizer::Impl::read_added(const Reader& r, const Json& list) {
  if (!list.IsArray()) throw r.fail("added_tokens", "is not a list");
  for (rapidjson::SizeType i = 0; i < list.Size(); ++i) {
    const std::string path = "added_tokens[" + std::to_string(i) + "]";
    const Json& t = list[i];
    const Json& id = r.member(t, path, "id");
    if (!id.IsInt() || id.GetInt() < 0) throw r.fail(path + ".id", "is not a non-negative integer");
    const bool special = r.boolean(t, path, "special", false);
    // Matched in the raw text unless "normalized" (tokenizers' AddedToken::from: !special).
    AddedToken a{id.GetInt(), r.string(t, path, "content"), special, r.boolean(t, path, "normalized", !special),
                 r.boolean(t, path, "lstrip", false), r.boolean(t, path, "rstrip", false)};
    if (r.boolean(t, path, "single_word", false))
      throw r.fail(path + ".single_word", "is true, which memrt's tokenizer does not implement");
    if (a.content.empty()) throw r.fail(path + ".content", "is empty");
    if (static_cast<size_t>(a.id) >= tokens.size()) tokens.resize(static_cast<size_t>(a.id) + 1);
    tokens[static_cast<size_t>(a.id)] = a.content;
    added.push_back(std::move(a));
  }
  is_special.assign(tokens.size(), false);
  for (int k = 0; k < static_cast<int>(added.size()); ++k) {
    const AddedToken& a = added[static_cast<size_t>(k)];
    is_special[static_cast<size_t>(a.id)] = a.special;
    auto& index = a.normalized ? normalized_by_first : raw_by_first;
    index[static_cast<unsigned char>(a.content[0])].push_back(k);
  }
  for (auto* index : {&raw_by_first, &normalized_by_first})
    for (std::vector<int>& v : *index)
      std::stable_sort(v.begin(), v.end(), [&](int x, int y) {
        return added[static_cast<size_t>(x)].content.size() > added[static_cast<size_t>(y)].content.size();
      });
}

void Tokenizer::Impl::read_post_processor(const Reader& r, const Json& v, const std::string& path) {
  const std::string type = r.string(v, path, "type");
  if (type == "Sequence") {
    r.each(v, path, "processors", [&](const Json& step, const std::string& at) { read_post_processor(r, step, at); });
    return;
  }
  if (type == "ByteLevel") {  // offsets only
    trim_offsets = r.boolean(v, path, "trim_offsets", true);
    trim_keeps_prefix_space = r.boolean(v, path, "add_prefix_space", true);
    return;
  }
  if (type != "TemplateProcessing") r.unsupported(path, type, "Sequence, ByteLevel, TemplateProcessing");
  if (has_template) throw r.fail(path, "is a second TemplateProcessing");
  has_template = true;
  post_name = "TemplateProcessing";
  const Json& single = r.member(v, path, "single");
  const Json& specials = r.member(v, path, "special_tokens");
  if (!single.IsArray()) throw r.fail(path + ".single", "is not a list");
  for (rapidjson::SizeType i = 0; i < single.Size(); ++i) {
    const std::string at = path + ".single[" + std::to_string(i) + "]";
    const Json& piece = single[i];
    if (piece.IsObject() && piece.HasMember("Sequence")) {
      if (r.string(piece["Sequence"], at + ".Sequence", "id") != "A") throw r.fail(at, "is not the sequence $A");
      single_template.push_back(-1);
    } else if (piece.IsObject() && piece.HasMember("SpecialToken")) {
      const std::string name = r.string(piece["SpecialToken"], at + ".SpecialToken", "id");
      const Json& s = r.member(specials, path + ".special_tokens", name.c_str());
      const Json& ids = r.member(s, path + ".special_tokens." + name, "ids");
      if (!ids.IsArray()) throw r.fail(path + ".special_tokens." + name + ".ids", "is not a list");
      for (const Json& id : ids.GetArray()) {
        if (!id.IsInt()) throw r.fail(path + ".special_tokens." + name + ".ids", "holds a non-integer");
        single_template.push_back(id.GetInt());
      }
    } else {
      throw r.fail(at, "is neither {\"Sequence\": ...} nor {\"SpecialToken\": ...}");
    }
  }
}

void Tokenizer::Impl::read_decoder(const Reader& r, const Json& v, const std::string& path) {
  const std::string type = r.string(v, path, "type");
  has_decoder = true;
  if (type == "Sequence") {
    r.each(v, path, "decoders", [&](const Json& step, const std::string& at) { read_decoder(r, step, at); });
    return;
  }
  decoder_name = decoder_name == "none" ? type : decoder_name + " + " + type;
  Decode d{Decode::kFuse, "", "", 0, 0, false};
  if (type == "ByteLevel") {
    d.kind = Decode::kByteLevel;
  } else if (type == "Replace") {
    bool is_regex = false;
    d.kind = Decode::kReplace;
    d.from = pattern_of(r, v, path, &is_regex);
    if (is_regex) throw r.fail(path + ".pattern", "is a regex; memrt's Replace decoder takes a string");
    d.to = r.string(v, path, "content");
  } else if (type == "ByteFallback") {
    d.kind = Decode::kByteFallback;
  } else if (type == "Fuse") {
    d.kind = Decode::kFuse;
  } else if (type == "Strip") {
    d.kind = Decode::kStrip;
    d.from = r.string(v, path, "content");
    for (const char* key : {"start", "stop"})
      if (!r.member(v, path, key).IsInt64() || r.member(v, path, key).GetInt64() < 0)
        throw r.fail(path + "." + key, "is not a non-negative integer");
    d.start = v["start"].GetInt64();
    d.stop = v["stop"].GetInt64();
  } else if (type == "Metaspace") {
    d.kind = Decode::kMetaspace;
    d.from = r.string(v, path, "replacement");
    const std::string scheme = v.HasMember("prepend_scheme") && v["prepend_scheme"].IsString() ? v["prepend_scheme"].GetString()
                               : r.boolean(v, path, "add_prefix_space", true) ? "always" : "never";
    d.prepend_first = scheme != "never";
  } else {
    r.unsupported(path, type, "Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace");
  }
  decoders.push_back(std::move(d));
}

std::string Tokenizer::Impl::normalize(std::string s) const {
  for (const Normalize& n : normalizers) {
    switch (n.kind) {
      case Normalize::kPrepend:
        if (!s.empty()) s = n.text + s;
        break;
      case Normalize::kReplace: {
        std::string out;
        size_t last = 0;
        n.regex->for_each_match(s, [&](size_t b, size_t e) {
          out.append(s, last, b - last);
          out += n.text;
          last = e;
        });
        out.append(s, last, std::string::npos);
        s = std::move(out);
        break;
      }
      default: {
        const int options = n.kind == Normalize::kNfc    ? UTF8PROC_STABLE | UTF8PROC_COMPOSE
                            : n.kind == Normalize::kNfkc ? UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT
                            : n.kind == Normalize::kNfd  ? UTF8PROC_STABLE | UTF8PROC_DECOMPOSE
                                                         : UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
        utf8proc_uint8_t* out = nullptr;
        const utf8proc_ssize_t n_out = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                                    static_cast<utf8proc_ssize_t>(s.size()), &out,
                                                    static_cast<utf8proc_option_t>(options));
        if (n_out < 0) throw Error(std::string("tokenizer: Unicode normalization failed: ") + utf8proc_errmsg(n_out));
        s.assign(reinterpret_cast<const char*>(out), static_cast<size_t>(n_out));
        std::free(out);
      }
    }
  }
  return s;
}

template <typename Text, typename Token>
void Tokenizer::Impl::split_added(std::string_view s, const std::array<std::vector<int>, 256>& by_first, Text text,
                                  Token token) const {
  size_t from = 0;  // start of the text not yet handed out
  for (size_t i = 0; i < s.size();) {
    const AddedToken* hit = nullptr;
    for (int k : by_first[static_cast<unsigned char>(s[i])]) {  // longest first
      const AddedToken& a = added[static_cast<size_t>(k)];
      if (s.compare(i, a.content.size(), a.content) == 0) {
        hit = &a;
        break;
      }
    }
    if (!hit) {
      ++i;
      continue;
    }
    size_t begin = i, end = i + hit->content.size();
    if (hit->lstrip) {  // the whitespace before it is the token's
      while (begin > from) {
        size_t c = begin - 1;
        while (c > from && is_continuation(s[c])) --c;
        if (!is_whitespace(code_point(s, c, begin - c))) break;
        begin = c;
      }
    }
    if (hit->rstrip) {
      while (end < s.size()) {
        const size_t n = utf8_sequence(s, end);
        if (n == 0 || !is_whitespace(code_point(s, end, n))) break;
        end += n;
      }
    }
    if (begin > from) text(s.substr(from, begin - from));
    token(hit->id);
    from = i = end;
  }
  if (from < s.size()) text(s.substr(from));
}

void Tokenizer::Impl::encode_text(std::string_view s, bool at_start, std::vector<int32_t>& out) const {
  // Pre-tokenize: each Split step cuts every piece, as tokenizers' behaviors define.
  std::vector<std::string> pieces{std::string(s)};
  for (const Split& split : splits) {
    std::vector<std::string> next;
    for (const std::string& p : pieces) {
      size_t last = 0;
      std::string pending;  // MergedWithNext: a match waiting for what follows; Contiguous: a run
      bool in_run = false;
      split.regex->for_each_match(p, [&](size_t b, size_t e) {
        const std::string gap = p.substr(last, b - last), match = p.substr(b, e - b);
        switch (split.behavior) {
          case Behavior::kRemoved:
            if (!gap.empty()) next.push_back(gap);
            break;
          case Behavior::kIsolated:
            if (!gap.empty()) next.push_back(gap);
            next.push_back(match);
            break;
          case Behavior::kMergedWithPrevious:
            next.push_back(gap + match);
            break;
          case Behavior::kMergedWithNext:
            if (!pending.empty() || !gap.empty()) next.push_back(pending + gap);
            pending = match;
            break;
          case Behavior::kContiguous:
            if (!gap.empty()) {
              if (in_run) next.push_back(pending);
              next.push_back(gap);
              pending.clear();
            }
            pending += match;
            in_run = true;
            break;
        }
        last = e;
      });
      const std::string tail = p.substr(last);
      if (split.behavior == Behavior::kMergedWithNext) {
        if (!pending.empty() || !tail.empty()) next.push_back(pending + tail);
      } else if (split.behavior == Behavior::kContiguous) {
        if (in_run) next.push_back(pending);
        if (!tail.empty()) next.push_back(tail);
      } else if (!tail.empty()) {
        next.push_back(tail);
      }
    }
    pieces = std::move(next);
  }
  if (metaspace) {  // each piece: spaces to the replacement, which is prepended; split before each one
    for (size_t k = 0; k < pieces.size(); ++k) {
      std::string& p = pieces[k];
      if (p.empty()) continue;
      std::string m;
      for (char c : p) {
        if (c == ' ')
          m += replacement;
        else
          m += c;
      }
      const bool first = k == 0 && at_start;
      if ((prepend == Prepend::kAlways || (prepend == Prepend::kFirst && first)) && m.compare(0, replacement.size(), replacement) != 0)
        m.insert(0, replacement);
      if (!metaspace_split) {
        bpe(m, out);
        continue;
      }
      size_t from = 0;  // MergedWithNext: each replacement begins a word
      for (size_t at = m.find(replacement, 1); at != std::string::npos; at = m.find(replacement, at + replacement.size())) {
        if (at > from) bpe(std::string_view(m).substr(from, at - from), out);
        from = at;
      }
      bpe(std::string_view(m).substr(from), out);
    }
    return;
  }
  // ByteLevel, on each piece: a space in front (add_prefix_space), GPT-2's regex (use_regex), then
  // the bytes of each word to BPE.
  for (std::string& p : pieces) {
    if (p.empty()) continue;
    if (add_prefix_space && p[0] != ' ') p.insert(p.begin(), ' ');
    if (!byte_level_regex) {
      bpe(p, out);
      continue;
    }
    size_t last = 0;
    byte_level_regex->for_each_match(p, [&](size_t b, size_t e) {
      if (b > last) bpe(std::string_view(p).substr(last, b - last), out);
      bpe(std::string_view(p).substr(b, e - b), out);
      last = e;
    });
    if (last < p.size()) bpe(std::string_view(p).substr(last), out);
  }
}

void Tokenizer::Impl::bpe(std::string_view word, std::vector<int32_t>& out) const {
  // Natural text repeats its words: each thread keeps the last ones it encoded.
  struct Cache {
    uint64_t owner = 0;
    std::unordered_map<std::string, std::vector<int32_t>> words;
  };
  thread_local Cache cache;
  if (cache.owner != serial || cache.words.size() > 10000) {
    cache.words.clear();
    cache.owner = serial;
  }
  std::string key(word);
  if (const auto hit = cache.words.find(key); hit != cache.words.end()) {
    out.insert(out.end(), hit->second.begin(), hit->second.end());
    return;
  }
  std::vector<int32_t> ids;
  const ByteAlphabet& alphabet = byte_alphabet();
  if (ignore_merges) {
    std::string mapped;
    if (byte_level) {
      for (unsigned char c : word) mapped += alphabet.to_char[c];
    } else {
      mapped = std::string(word);
    }
    if (const auto it = vocab.find(mapped); it != vocab.end()) ids.push_back(it->second);
  }
  if (ids.empty()) {
    // One symbol per byte; then tokenizers' merge loop: the pair of lowest rank (leftmost among
    // equals) merges, until no pair of the word is a merge.
    struct Symbol {
      int32_t id;
      int prev, next;
    };
    std::vector<Symbol> sym;
    sym.reserve(word.size());
    auto add = [&](int32_t id) {
      if (!sym.empty()) sym.back().next = static_cast<int>(sym.size());
      sym.push_back({id, static_cast<int>(sym.size()) - 1, -1});
    };
    auto unknown = [&](std::string_view what) {
      if (!unk) throw Error("tokenizer " + file + ": " + std::string(what) + " has no token and the model has no unk_token");
      if (!(fuse_unk && !sym.empty() && sym.back().id == *unk)) add(*unk);
    };
    if (byte_level) {  // one symbol per byte, as GPT-2's alphabet spells it
      for (unsigned char c : word) {
        const int32_t id = byte_ids[c];
        if (id >= 0) {
          add(id);
          continue;
        }
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02X", static_cast<unsigned>(c));
        unknown(std::string("the byte ") + hex);
      }
    } else {  // one symbol per character; one not in the vocabulary as its bytes' <0xNN> tokens
      for (size_t i = 0; i < word.size();) {
        const size_t n = std::max<size_t>(1, utf8_sequence(word, i));
        const std::string_view c = word.substr(i, n);
        i += n;
        if (const auto it = vocab.find(std::string(c)); it != vocab.end()) {
          add(it->second);
          continue;
        }
        bool all = byte_fallback;
        for (size_t k = 0; k < c.size() && all; ++k) all = fallback_ids[static_cast<unsigned char>(c[k])] >= 0;
        if (all) {
          for (unsigned char b : c) add(fallback_ids[b]);
        } else {
          unknown("the character '" + std::string(c) + "'");
        }
      }
    }
    struct Candidate {
      int32_t rank;
      int pos;
      int32_t id;
      bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
    auto consider = [&](int pos) {
      if (pos < 0 || sym[static_cast<size_t>(pos)].next < 0) return;
      const auto it = merges.find(pair(sym[static_cast<size_t>(pos)].id, sym[static_cast<size_t>(sym[static_cast<size_t>(pos)].next)].id));
      if (it != merges.end()) queue.push({it->second.rank, pos, it->second.id});
    };
    for (int i = 0; i + 1 < static_cast<int>(sym.size()); ++i) consider(i);
    std::vector<bool> gone(sym.size(), false);
    while (!queue.empty()) {
      const Candidate c = queue.top();
      queue.pop();
      Symbol& left = sym[static_cast<size_t>(c.pos)];
      if (gone[static_cast<size_t>(c.pos)] || left.next < 0) continue;
      const auto it = merges.find(pair(left.id, sym[static_cast<size_t>(left.next)].id));
      if (it == merges.end() || it->second.id != c.id) continue;  // stale: a neighbour merged first
      const int right = left.next;
      gone[static_cast<size_t>(right)] = true;
      left.id = c.id;
      left.next = sym[static_cast<size_t>(right)].next;
      if (left.next >= 0) sym[static_cast<size_t>(left.next)].prev = c.pos;
      consider(left.prev);
      consider(c.pos);
    }
    for (int i = sym.empty() ? -1 : 0; i >= 0; i = sym[static_cast<size_t>(i)].next) ids.push_back(sym[static_cast<size_t>(i)].id);
  }
  out.insert(out.end(), ids.begin(), ids.end());
  cache.words.emplace(std::move(key), std::move(ids));
}

// ---- public ---------------------------------------------------------------------------------------

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(std::unique_ptr<SentencePiece> sp) : sp_(std::move(sp)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_json(const std::string& text, const std::string& where) {
  auto impl = std::make_unique<Impl>();
  impl->file = where;
  impl->read(text);
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_file(const std::string& tokenizer_json) {
  if (tokenizer_json.size() > 6 && tokenizer_json.compare(tokenizer_json.size() - 6, 6, ".model") == 0) {
    Tokenizer tok(open_sentencepiece(tokenizer_json));
    tok.read_special_tokens(tokenizer_json);
    return tok;
  }
  std::ifstream in(tokenizer_json, std::ios::binary);
  if (!in) throw FileError(tokenizer_json, "cannot be read (a Hugging Face tokenizer.json)");
  std::stringstream text;
  text << in.rdbuf();
  Tokenizer tok = from_json(text.str(), tokenizer_json);
  tok.read_special_tokens(tokenizer_json);
  return tok;
}

std::optional<rapidjson::Document> read_tokenizer_config(const std::filesystem::path& dir) {
  const std::filesystem::path config = tokenizer_config_path(dir);
  std::ifstream in(config, std::ios::binary);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  rapidjson::Document d;
  d.Parse(text.str().c_str());
  if (d.HasParseError() || !d.IsObject()) throw FileError(config.string(), "is not a JSON object");
  return d;
}

void Tokenizer::read_special_tokens(const std::string& tokenizer_file) {
  namespace fs = std::filesystem;
  auto set = [&](std::optional<SpecialToken>& out, const std::string& text, const std::string& where) {
    const std::optional<int32_t> id = token_to_id(text);
    if (!id) throw FileError(where, "names the token \"" + text + "\", which " + tokenizer_file + " does not hold");
    out = SpecialToken{text, *id};
  };
  if (sp_) {  // the model's own, unless tokenizer_config.json says otherwise
    const auto& p = sp_->processor;
    if (p.bos_id() >= 0) bos_ = SpecialToken{p.IdToPiece(p.bos_id()), p.bos_id()};
    if (p.eos_id() >= 0) eos_ = SpecialToken{p.IdToPiece(p.eos_id()), p.eos_id()};
  }
  const fs::path config = tokenizer_config_path(fs::path(tokenizer_file).parent_path());
  const std::optional<rapidjson::Document> read = read_tokenizer_config(fs::path(tokenizer_file).parent_path());
  if (!read) return;
  const rapidjson::Document& d = *read;
  for (auto [key, out] : {std::pair<const char*, std::optional<SpecialToken>*>{"bos_token", &bos_}, {"eos_token", &eos_}}) {
    if (!d.HasMember(key)) continue;
    const rapidjson::Value& v = d[key];
    if (v.IsNull()) {
      out->reset();
    } else if (v.IsString()) {
      set(*out, v.GetString(), config.string() + ": " + key);
    } else if (v.IsObject() && v.HasMember("content") && v["content"].IsString()) {
      set(*out, v["content"].GetString(), config.string() + ": " + key);
    } else {
      throw FileError(config.string(), std::string(key) + ": expected a token's text or {\"content\": ...}");
    }
  }
}

std::optional<size_t> first_invalid_utf8(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const size_t n = utf8_sequence(text, i);
    if (n == 0) return i;
    i += n;
  }
  return std::nullopt;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  if (const std::optional<size_t> bad = first_invalid_utf8(text))
    throw Error("tokenizer: the text is not valid UTF-8 at byte " + std::to_string(*bad));
  if (sp_) return sentencepiece_encode(*sp_, text, add_special_tokens);
  const Impl& t = *impl_;
  std::vector<int32_t> ids;
  // Added tokens matched on the raw text first, then, in the normalized text between them, those
  // matched after normalization; what remains is normalized, pre-tokenized and encoded.
  t.split_added(
      text, t.raw_by_first,
      [&](std::string_view piece) {
        const bool piece_first = piece.data() == text.data();
        const std::string normalized = t.normalize(std::string(piece));
        t.split_added(
            normalized, t.normalized_by_first,
            [&](std::string_view rest) { t.encode_text(rest, piece_first && rest.data() == normalized.data(), ids); },
            [&](int32_t id) { ids.push_back(id); });
      },
      [&](int32_t id) { ids.push_back(id); });
  if (!add_special_tokens || !t.has_template) return ids;
  std::vector<int32_t> out;
  out.reserve(ids.size() + t.single_template.size());
  for (int32_t x : t.single_template) {
    if (x < 0)
      out.insert(out.end(), ids.begin(), ids.end());
    else
      out.push_back(x);
  }
  return out;
}

int64_t Tokenizer::text_bytes(const std::vector<std::string_view>& docs) {
  int64_t bytes = 0;
  for (std::string_view d : docs) bytes += static_cast<int64_t>(d.size());
  return bytes;
}

std::vector<std::vector<int32_t>> Tokenizer::encode_batch(const std::vector<std::string_view>& docs,
                                                          bool add_special_tokens, int threads,
                                                          const std::function<void(size_t)>& encoded) const {
  std::vector<std::vector<int32_t>> out(docs.size());
  size_t total = 0;
  for (std::string_view d : docs) total += d.size() + 1;
  const size_t n = std::max<size_t>(1, std::min<size_t>(static_cast<size_t>(std::max(threads, 1)), docs.size()));
  std::vector<size_t> first(n + 1, docs.size());  // thread t: docs [first[t], first[t + 1])
  first[0] = 0;
  size_t bytes = 0, t = 1;
  for (size_t i = 0; i < docs.size() && t < n; ++i) {
    while (t < n && bytes >= total * t / n) first[t++] = i;
    bytes += docs[i].size() + 1;
  }
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> pool;
  for (size_t k = 0; k < n; ++k) {
    pool.emplace_back([&, k] {
      try {
        for (size_t i = first[k]; i < first[k + 1]; ++i) {
          out[i] = encode(docs[i], add_special_tokens);
          if (encoded) encoded(docs[i].size());
        }
      } catch (...) {
        errors[k] = std::current_exception();
      }
    });
  }
  for (std::thread& th : pool) th.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  if (sp_) return sentencepiece_decode(*sp_, ids, skip_special_tokens);
  const Impl& t = *impl_;
  std::vector<std::string> tokens;
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= t.tokens.size() || t.tokens[static_cast<size_t>(id)].empty())
      throw Error("tokenizer " + t.file + ": no token has id " + std::to_string(id));
    if (skip_special_tokens && static_cast<size_t>(id) < t.is_special.size() && t.is_special[static_cast<size_t>(id)])
      continue;
    tokens.push_back(t.tokens[static_cast<size_t>(id)]);
  }
  if (!t.has_decoder) {  // tokenizers without a decoder: the tokens joined by spaces
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
    return out;
  }
  const ByteAlphabet& alphabet = byte_alphabet();
  for (const Impl::Decode& d : t.decoders) {
    std::vector<std::string> next;
    switch (d.kind) {
      case Impl::Decode::kByteLevel: {
        // Each character back to its byte (a token with a character outside the alphabet, an added
        // token's text, as it is); all of it one string, invalid UTF-8 replaced.
        std::string bytes;
        for (const std::string& token : tokens) {
          std::string mapped;
          bool all = true;
          for (size_t i = 0; i < token.size() && all;) {
            const size_t n = std::max<size_t>(1, utf8_sequence(token, i));
            const auto it = alphabet.to_byte.find(code_point(token, i, n));
            all = it != alphabet.to_byte.end();
            if (all) mapped += static_cast<char>(it->second);
            i += n;
          }
          bytes += all ? mapped : token;
        }
        next.push_back(lossy_utf8(bytes));
        break;
      }
      case Impl::Decode::kReplace:
        for (const std::string& token : tokens) {
          std::string r;
          for (size_t at = 0; at < token.size();) {
            if (!d.from.empty() && token.compare(at, d.from.size(), d.from) == 0) {
              r += d.to;
              at += d.from.size();
            } else {
              r += token[at++];
            }
          }
          next.push_back(std::move(r));
        }
        break;
      case Impl::Decode::kByteFallback: {
        // Runs of <0xNN> tokens become their bytes when those are UTF-8, else one U+FFFD each.
        std::string bytes;
        size_t run = 0;
        auto flush = [&] {
          if (run == 0) return;
          bool valid = true;
          for (size_t i = 0; i < bytes.size() && valid;) {
            const size_t n = utf8_sequence(bytes, i);
            valid = n > 0;
            i += n;
          }
          if (valid) {
            next.push_back(bytes);
          } else {
            for (size_t k = 0; k < run; ++k) next.push_back("\xEF\xBF\xBD");
          }
          bytes.clear();
          run = 0;
        };
        for (const std::string& token : tokens) {
          unsigned value = 0;
          if (token.size() == 6 && token.compare(0, 3, "<0x") == 0 && token[5] == '>' &&
              std::sscanf(token.c_str() + 3, "%2x", &value) == 1 && std::isxdigit(static_cast<unsigned char>(token[3])) &&
              std::isxdigit(static_cast<unsigned char>(token[4]))) {
            bytes += static_cast<char>(value);
            ++run;
          } else {
            flush();
            next.push_back(token);
          }
        }
        flush();
        break;
      }
      case Impl::Decode::kFuse: {
        std::string all;
        for (const std::string& token : tokens) all += token;
        next.push_back(std::move(all));
        break;
      }
      case Impl::Decode::kStrip:
        for (std::string token : tokens) {
          for (int64_t k = 0; k < d.start && token.compare(0, d.from.size(), d.from) == 0; ++k) token.erase(0, d.from.size());
          for (int64_t k = 0; k < d.stop && token.size() >= d.from.size() &&
                              token.compare(token.size() - d.from.size(), d.from.size(), d.from) == 0;
               ++k)
            token.erase(token.size() - d.from.size());
          next.push_back(std::move(token));
        }
        break;
      case Impl::Decode::kMetaspace:  // the replacement is a space, except in the first token (dropped)
        for (size_t i = 0; i < tokens.size(); ++i) {
          std::string r;
          for (size_t at = 0; at < tokens[i].size();) {
            if (tokens[i].compare(at, d.from.size(), d.from) == 0) {
              if (!(i == 0 && d.prepend_first)) r += ' ';
              at += d.from.size();
            } else {
              r += tokens[i][at++];
            }
          }
          next.push_back(std::move(r));
        }
        break;
    }
    tokens = std::move(next);
  }
  std::string out;
  for (const std::string& token : tokens) out += token;
  return out;
}

bool Tokenizer::has_offsets(std::string_view text) const {
  if (sp_ || !impl_->byte_level || impl_->add_prefix_space) return false;
  for (const Impl::Split& split : impl_->splits)
    if (split.behavior == Impl::Behavior::kRemoved) return false;  // the tokens would not spell the text
  return impl_->normalizers.empty() || impl_->normalize(std::string(text)) == text;
}

Tokenizer::Offsets Tokenizer::token_offsets(const std::vector<int32_t>& ids, std::string_view text) const {
  if (!has_offsets(text))
    throw Error("token offsets: memrt maps them for byte-level tokenizers that add no prefix space and remove no "
                "text, on text their normalizer leaves as it is (this one is " + describe() + ")");
  const Impl& t = *impl_;
  std::unordered_map<int32_t, const Impl::AddedToken*> added;
  for (const Impl::AddedToken& a : t.added) added[a.id] = &a;
  // The byte length of the whitespace character (Rust's is_whitespace; with `g`, GPT-2's 'Ġ' too)
  // at s[i], 0 if none.
  auto space = [](std::string_view s, size_t i, bool g) -> size_t {
    const size_t n = i < s.size() ? utf8_sequence(s, i) : 0;
    if (!n) return 0;
    const uint32_t c = code_point(s, i, n);
    return is_whitespace(c) || (g && c == 0x120) ? n : 0;
  };
  auto continuation = [&](size_t i) { return i < text.size() && is_continuation(text[i]); };
  Offsets out;
  out.starts.reserve(ids.size());
  out.ends.reserve(ids.size());
  size_t at = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    size_t begin = at;
    size_t lead = 0, trail = 0;  // the token's leading and trailing spaces, in bytes of `text` (trim_offsets)
    if (const auto a = added.find(ids[i]); a != added.end()) {  // with the whitespace it strips
      const Impl::AddedToken& token = *a->second;
      auto matches = [&] { return text.compare(at, token.content.size(), token.content) == 0; };
      for (size_t n; token.lstrip && !matches() && (n = space(text, at, false));) at += n;
      if (!matches()) break;  // reported below
      at += token.content.size();
      for (size_t n; token.rstrip && (n = space(text, at, false));) at += n;
      // Its string is the text it matched: the spaces that text begins and ends with.
      for (size_t n; begin + lead < at && (n = space(text, begin + lead, true));) lead += n;
      for (size_t k = at; k > begin;) {
        size_t c = k - 1;
        while (c > begin && continuation(c)) --c;
        if (space(text, c, true) != k - c) break;
        trail += k - c;
        k = c;
      }
    } else {  // one byte of `text` per character of GPT-2's alphabet
      const std::string& token = id_to_token(ids[i]);
      const auto chars = static_cast<size_t>(code_points(token));
      for (size_t k = 0; k + 1 < token.size() && token.compare(k, 2, "\xC4\xA0") == 0; k += 2) ++lead;
      for (size_t k = token.size(); k >= 2 && token.compare(k - 2, 2, "\xC4\xA0") == 0; k -= 2) ++trail;
      at += chars;
    }
    if (at > text.size()) break;
    size_t end = at;
    // tokenizers' offsets are in characters: a token holding part of one holds all of it
    while (begin > 0 && continuation(begin)) --begin;
    while (continuation(end)) ++end;
    if (t.trim_offsets) {  // tokenizers' ByteLevel process_offsets
      if (lead == 1 && (i == 0 || begin == 0) && t.trim_keeps_prefix_space) lead = 0;
      begin = std::min(begin + lead, end);
      end = std::max(end - trail, begin);
    }
    out.starts.push_back(begin);
    out.ends.push_back(end);
  }
  if (out.ends.size() != ids.size() || at != text.size())
    throw Error("token offsets: the tokens do not spell the text (" + std::to_string(text.size()) + " bytes)");
  return out;
}

int64_t Tokenizer::vocab_size() const {
  return sp_ ? sentencepiece_size(*sp_) : static_cast<int64_t>(impl_->tokens.size());
}

std::optional<int32_t> Tokenizer::token_to_id(const std::string& token) const {
  if (sp_) return sentencepiece_piece_id(*sp_, token);
  for (const Impl::AddedToken& a : impl_->added)
    if (a.content == token) return a.id;
  const auto it = impl_->vocab.find(token);
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (sp_) return sentencepiece_piece(*sp_, id);
  if (id < 0 || static_cast<size_t>(id) >= impl_->tokens.size()) throw Error("tokenizer: no token has id " + std::to_string(id));
  return impl_->tokens[static_cast<size_t>(id)];
}

std::string Tokenizer::describe() const {
  if (sp_) return sentencepiece_describe(*sp_);
  const Impl& t = *impl_;
  std::string pre;
  for (const std::string& n : t.pre_names) pre += (pre.empty() ? "" : " + ") + n;
  return "BPE, " + std::to_string(vocab_size()) + " tokens (" + std::to_string(t.added.size()) + " added), " +
         (t.byte_level ? "byte-level, " : t.byte_fallback ? "byte fallback, " : "") +
         (t.normalizers.empty() ? "" : "normalized, ") + (pre.empty() ? "no pre-tokenizer" : pre) + ", " + t.post_name +
         ", decoder " + t.decoder_name;
}

}  // namespace memrt
