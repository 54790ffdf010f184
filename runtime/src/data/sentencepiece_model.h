// Tokenizer's sentencepiece backend (data/tokenizer.h): a tokenizer.model read by Debian's
// libsentencepiece, kept out of tokenizer.h so that only tokenizer.cpp and sentencepiece_model.cpp
// see its header.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <sentencepiece_processor.h>

#include "data/tokenizer.h"

namespace memrt {

struct Tokenizer::SentencePiece {
  std::string path;
  sentencepiece::SentencePieceProcessor processor;
  bool add_bos = true, add_eos = false;  // transformers' LlamaTokenizer defaults
};

// FileError naming the file when it is not a sentencepiece model, or tokenizer_config.json beside
// it is malformed.
std::unique_ptr<Tokenizer::SentencePiece> open_sentencepiece(const std::string& path);
std::vector<int32_t> sentencepiece_encode(const Tokenizer::SentencePiece& sp, std::string_view text, bool add_special_tokens);
std::string sentencepiece_decode(const Tokenizer::SentencePiece& sp, const std::vector<int32_t>& ids, bool skip_special_tokens);
int64_t sentencepiece_size(const Tokenizer::SentencePiece& sp);
std::optional<int32_t> sentencepiece_piece_id(const Tokenizer::SentencePiece& sp, const std::string& piece);
std::string sentencepiece_piece(const Tokenizer::SentencePiece& sp, int32_t id);
std::string sentencepiece_describe(const Tokenizer::SentencePiece& sp);

}  // namespace memrt
