// data/tokenizer_config.h — tokenizer_config.json, transformers' tokenizer settings beside a
// tokenizer.json or tokenizer.model, read in one place for the readers of its keys: the BOS and
// EOS tokens (tokenizer.cpp), add_bos_token / add_eos_token (sentencepiece_model.cpp) and
// chat_template (chat_template.cpp).
#pragma once

#include <rapidjson/document.h>

#include <filesystem>
#include <optional>

namespace memrt {

// DIR/tokenizer_config.json.
inline std::filesystem::path tokenizer_config_path(const std::filesystem::path& dir) {
  return dir / "tokenizer_config.json";
}

// tokenizer_config_path(dir), parsed; nullopt when there is no such file. A FileError naming the
// file when it is not a JSON object.
std::optional<rapidjson::Document> read_tokenizer_config(const std::filesystem::path& dir);

}  // namespace memrt
