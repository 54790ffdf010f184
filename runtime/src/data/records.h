// Fine-tuning records (docs/tokenizers.md, "Datasets"): JSONL or JSON files of instruction records
// or conversations, each tokenized into one sample with a label mask, exactly as the tool whose keys
// name the file tokenizes it — axolotl's `datasets: [{path, type: alpaca | chat_template}]`, TRL's
// prompt-completion and conversational (`messages`, rendered with the model's chat template) datasets.
//
//   TokenizedRecords out;
//   tokenize_records("train.jsonl", tokenizer, {RecordType::kAlpaca, 2048, false}, out, threads);
//   // sample k: out.ids[out.offsets[k] .. out.offsets[k+1]), trained where out.labels[i] == 1
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <rapidjson/document.h>

#include "config/train_config.h"

namespace memrt {

class ChatTemplate;
class Tokenizer;

enum class RecordType {
  kAlpaca,            // instruction, input (optional), output: axolotl's type: alpaca
  kPromptCompletion,  // prompt, completion: TRL's prompt-completion dataset
  kMessages,          // messages (and tools): TRL's conversational dataset, through the chat template
  kChatTemplate,      // conversations: axolotl's type: chat_template, each turn's tokens found by rendering
  kLlamaFactory,      // a LLaMA-Factory dataset through its template, each slot's text tokenized alone
};

// "alpaca", "prompt_completion", "messages", "chat_template", "llamafactory".
const char* record_type_name(RecordType type);

struct RecordOptions {
  RecordType type = RecordType::kAlpaca;
  int64_t max_length = 2048;     // sequence_len / max_length: tokens per sample at most
  bool train_on_prompt = false;  // axolotl's train_on_inputs; TRL's completion_only_loss: false
  // kMessages: the model's chat template (required), and TRL's assistant_only_loss: only what the
  // template's {% generation %} blocks write is trained (else every token).
  const ChatTemplate* chat_template = nullptr;
  bool assistant_only = false;
  // kChatTemplate: the dataset's keys, and the tokens that end a turn (unset: the EOS token).
  ChatTemplateDataset chat{};
  std::optional<std::vector<std::string>> eot_tokens{};
  const rapidjson::Value* chat_template_kwargs = nullptr;  // more template variables (an object), or none
  // kLlamaFactory: the dataset's columns and tags, the run's template and keys
  // (data/llamafactory.h), and how many of the file's first records are read (-1: all).
  LlamaFactoryDataset llamafactory{};
  LlamaFactoryOptions llamafactory_options{};
  int64_t max_samples = -1;
};

// Samples in file order, each whole: a record too long for max_length is dropped (axolotl) or cut
// to its first max_length tokens (TRL), and counted.
struct TokenizedRecords {
  std::vector<uint32_t> ids;
  std::vector<uint8_t> labels;       // per token: 1 where the loss counts its prediction
  std::vector<int64_t> offsets{0};   // sample k is [offsets[k], offsets[k + 1])
  std::vector<int64_t> sample_records;  // sample k is of record sample_records[k] (counting every file's)
  int64_t records = 0, dropped = 0, truncated = 0;
  std::vector<std::string> notes;  // what the tool would warn about, e.g. an eot_token the template never writes
};

// The variables transformers' apply_chat_template renders with: `messages`, `tools` (null when
// none), add_generation_prompt, and the tokenizer's bos_token and eos_token texts where it has them.
rapidjson::Document chat_template_variables(const Tokenizer& tok, const rapidjson::Value& messages,
                                            const rapidjson::Value* tools, bool add_generation_prompt);

// Calls fn(where, record) for each record of `path` in file order: a JSONL file's lines (blank ones
// skipped; where = "line 3"), or a .json file's array (where = "record 3"). FileError naming the
// file (and line) for invalid JSON.
void for_each_json_record(const std::string& path,
                          const std::function<void(std::string where, const rapidjson::Value& record)>& fn);

// Appends the samples of `path` (JSONL: one object per line; .json: an array of objects) to `out`,
// tokenizing on `threads` threads. memrt::FileError naming the file and line (or record) of a
// record without the fields its type needs, with a field of the wrong kind, or not UTF-8, or that the
// chat template refuses (its raise_exception); naming tokenizer_config.json when the type needs an
// EOS token it does not name; and when assistant_only is asked of a template without
// {% generation %} blocks.
void tokenize_records(const std::string& path, const Tokenizer& tokenizer, const RecordOptions& options,
                      TokenizedRecords& out, int threads);

}  // namespace memrt
