// A Hugging Face tokenizer.json, encoding text to exactly the ids the `tokenizers` library gives
// (docs/tokenizers.md): added tokens, normalizer, pre-tokenizer, BPE model, post-processor and
// decoder, of the kinds the GPT-2, Llama-3, Qwen2 (byte-level BPE), Llama-2 and Mistral (BPE with
// byte fallback, Metaspace) families use. A stage of another kind is an error naming its place in
// the file, never a different encoding. A sentencepiece `tokenizer.model` (a directory without a
// tokenizer.json) encodes through libsentencepiece, with BOS/EOS as tokenizer_config.json says.
//
//   const Tokenizer tok = Tokenizer::from_file(dir + "/tokenizer.json");
//   std::vector<int32_t> ids = tok.encode("Hello world", /*add_special_tokens=*/true);
//   std::string text = tok.decode(ids);
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace memrt {

// The offset of the first byte of `text` that does not begin a well-formed UTF-8 sequence, if any
// (what encode() refuses).
std::optional<size_t> first_invalid_utf8(std::string_view text);

class Tokenizer {
 public:
  // memrt::FileError naming the file and the JSON path of what is malformed or not supported.
  // A path ending in ".model" is a sentencepiece model: encode() as SentencePieceProcessor's
  // EncodeAsIds, with add_special_tokens the BOS and EOS tokenizer_config.json beside it asks for
  // (add_bos_token, default true; add_eos_token, default false: transformers' LlamaTokenizer).
  static Tokenizer from_file(const std::string& tokenizer_json);
  static Tokenizer from_json(const std::string& text, const std::string& where);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // `tokenizers`' Tokenizer.encode(text, add_special_tokens).ids. Thread-safe. memrt::Error when
  // `text` is not valid UTF-8 (naming the byte offset).
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
  // encode() of each document, on `threads` threads, each taking a contiguous run of documents of
  // about the same number of bytes (`tokenizers`' encode_batch). The first error is rethrown.
  // `encoded`, when set, is called on the worker threads with each document's size in bytes once it
  // is encoded (a progress bar's count: data/progress.h).
  std::vector<std::vector<int32_t>> encode_batch(const std::vector<std::string_view>& docs, bool add_special_tokens,
                                                 int threads,
                                                 const std::function<void(size_t)>& encoded = nullptr) const;
  // The bytes of `docs`: what encode_batch's `encoded` calls add up to.
  static int64_t text_bytes(const std::vector<std::string_view>& docs);
  // `tokenizers`' offsets of `ids` = encode(text, false) (return_offsets_mapping), in bytes of
  // `text`: token i covers [starts[i], ends[i]) — whole characters (a token holding part of one
  // covers all of it, as tokenizers' character offsets do), an added token with the whitespace it
  // strips, and the spaces a token begins or ends with trimmed where the post-processor's ByteLevel
  // says trim_offsets. Where has_offsets(text); memrt::Error otherwise, or when the tokens do not
  // spell `text`.
  struct Offsets {
    std::vector<size_t> starts, ends;
  };
  Offsets token_offsets(const std::vector<int32_t>& ids, std::string_view text) const;
  // Whether token_offsets maps `text`'s tokens: a byte-level tokenizer that adds no prefix space and
  // removes nothing (a Split with behavior Removed), on text its normalizer leaves as it is.
  bool has_offsets(std::string_view text) const;
  // `tokenizers`' decode(ids, skip_special_tokens).
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;

  // The largest id of the vocabulary and the added tokens, plus one.
  int64_t vocab_size() const;
  std::optional<int32_t> token_to_id(const std::string& token) const;
  // The token's string as the vocabulary spells it (byte-level: GPT-2's byte alphabet).
  std::string id_to_token(int32_t id) const;
  // The BOS and EOS tokens as transformers' tokenizer.bos_token / eos_token: tokenizer_config.json
  // beside the file names them ("bos_token": "<s>" or {"content": "<s>", ...}); where it does not,
  // a sentencepiece model's own <s> and </s>, a tokenizer.json none. FileError naming
  // tokenizer_config.json when it is malformed or names a token the vocabulary lacks.
  struct SpecialToken {
    std::string text;
    int32_t id = 0;
  };
  const std::optional<SpecialToken>& bos_token() const { return bos_; }
  const std::optional<SpecialToken>& eos_token() const { return eos_; }
  // e.g. "BPE, 128256 tokens (256 added), byte-level, Split + ByteLevel, TemplateProcessing,
  // decoder ByteLevel".
  std::string describe() const;

  struct Impl;
  struct SentencePiece;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  explicit Tokenizer(std::unique_ptr<SentencePiece> sp);
  std::unique_ptr<Impl> impl_;        // tokenizer.json
  std::unique_ptr<SentencePiece> sp_;  // or a sentencepiece model
  std::optional<SpecialToken> bos_, eos_;
  void read_special_tokens(const std::string& tokenizer_file);
};

}  // namespace memrt
