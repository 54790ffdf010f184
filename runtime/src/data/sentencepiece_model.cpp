#include "data/sentencepiece_model.h"

#include <filesystem>

#include <rapidjson/document.h>

#include "data/tokenizer_config.h"
#include "memrt/error.h"

namespace memrt {

namespace {

// tokenizer_config.json's add_bos_token / add_eos_token, where the file and the keys exist.
void read_special_flags(Tokenizer::SentencePiece& sp) {
  const std::filesystem::path dir = std::filesystem::path(sp.path).parent_path();
  const std::optional<rapidjson::Document> read = read_tokenizer_config(dir);
  if (!read) return;
  const rapidjson::Document& d = *read;
  const std::filesystem::path config = tokenizer_config_path(dir);
  for (auto [key, flag] : {std::pair<const char*, bool*>{"add_bos_token", &sp.add_bos}, {"add_eos_token", &sp.add_eos}}) {
    if (!d.HasMember(key) || d[key].IsNull()) continue;
    if (!d[key].IsBool()) throw FileError(config.string(), std::string(key) + ": is not true or false");
    *flag = d[key].GetBool();
  }
}

}  // namespace

std::unique_ptr<Tokenizer::SentencePiece> open_sentencepiece(const std::string& path) {
  auto sp = std::make_unique<Tokenizer::SentencePiece>();
  sp->path = path;
  const sentencepiece::util::Status status = sp->processor.Load(path);
  if (!status.ok()) throw FileError(path, "is not a sentencepiece model: " + status.ToString());
  read_special_flags(*sp);
  return sp;
}

std::vector<int32_t> sentencepiece_encode(const Tokenizer::SentencePiece& sp, std::string_view text,
                                          bool add_special_tokens) {
  std::vector<int> ids;
  const sentencepiece::util::Status status = sp.processor.Encode(text, &ids);
  if (!status.ok()) throw Error("tokenizer " + sp.path + ": " + status.ToString());
  std::vector<int32_t> out;
  out.reserve(ids.size() + 2);
  if (add_special_tokens && sp.add_bos && sp.processor.bos_id() >= 0) out.push_back(sp.processor.bos_id());
  out.insert(out.end(), ids.begin(), ids.end());
  if (add_special_tokens && sp.add_eos && sp.processor.eos_id() >= 0) out.push_back(sp.processor.eos_id());
  return out;
}

std::string sentencepiece_decode(const Tokenizer::SentencePiece& sp, const std::vector<int32_t>& ids,
                                 bool skip_special_tokens) {
  std::vector<int> kept;
  for (int32_t id : ids) {
    if (id < 0 || id >= sp.processor.GetPieceSize())
      throw Error("tokenizer " + sp.path + ": no token has id " + std::to_string(id));
    if (skip_special_tokens && sp.processor.IsControl(id)) continue;
    kept.push_back(id);
  }
  std::string text;
  const sentencepiece::util::Status status = sp.processor.Decode(kept, &text);
  if (!status.ok()) throw Error("tokenizer " + sp.path + ": " + status.ToString());
  return text;
}

int64_t sentencepiece_size(const Tokenizer::SentencePiece& sp) { return sp.processor.GetPieceSize(); }

std::optional<int32_t> sentencepiece_piece_id(const Tokenizer::SentencePiece& sp, const std::string& piece) {
  const int id = sp.processor.PieceToId(piece);
  if (sp.processor.IdToPiece(id) != piece) return std::nullopt;  // PieceToId gives unk for any other
  return id;
}

std::string sentencepiece_piece(const Tokenizer::SentencePiece& sp, int32_t id) {
  if (id < 0 || id >= sp.processor.GetPieceSize()) throw Error("tokenizer " + sp.path + ": no token has id " + std::to_string(id));
  return sp.processor.IdToPiece(id);
}

std::string sentencepiece_describe(const Tokenizer::SentencePiece& sp) {
  return "sentencepiece, " + std::to_string(sp.processor.GetPieceSize()) + " pieces" +
         (sp.add_bos ? ", BOS" : "") + (sp.add_eos ? ", EOS" : "");
}

}  // namespace memrt
