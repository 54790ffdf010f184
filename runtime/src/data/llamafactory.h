// LLaMA-Factory's datasets (docs/tokenizers.md, "Datasets"): the templates a run names with
// `template:`, LLaMA-Factory's parse_template of a model's own chat template, and its converters
// (alpaca, sharegpt, openai) and supervised processor on memrt's tokenizer — the ids and labels
// LLaMA-Factory 0.9.5 makes of a dataset_info.json dataset.
//
//   RecordOptions o;  // type kLlamaFactory, the dataset's columns, the run's template and keys
//   tokenize_llamafactory("data/alpaca_en_demo.json", tok, o, out, threads);  // as tokenize_records
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "data/records.h"

namespace memrt {

class ChatTemplate;
class Tokenizer;

// A template as LLaMA-Factory registers it (template.py's register_template, its defaults filled
// in): each role's slots, the system prompt it falls back to, and its stop words.
struct LlamaFactoryTemplate {
  struct Slot {
    enum Kind { kText, kBos, kEos, kToken } kind = kText;
    std::string text;  // kText: with "{{content}}" (the user's also "{{idx}}"); kToken: the token
  };
  using Slots = std::vector<Slot>;
  std::string name;
  Slots user, assistant, system, observation, prefix;
  std::string default_system;
  std::vector<std::string> stop_words;
  bool replace_eos = false;           // the EOS token becomes stop_words[0]
  bool system_in_first_user = false;  // Llama2Template: the system text opens the first user turn
  bool reasoning = false;             // ReasoningTemplate: an empty thought where an answer has none
};

// The template LLaMA-Factory registers as `name`; nullptr for one memrt does not ship.
const LlamaFactoryTemplate* llamafactory_template(const std::string& name);
// The names llamafactory_template knows, comma-separated.
std::string llamafactory_template_names();

// LLaMA-Factory's parse_template: the slots `chat_template` renders for a system, a user and an
// assistant message, the template's default system prompt where it writes one, and its prefix
// (the tokenizer's decoding of encode("")). memrt::Error when the template refuses those messages
// or leaves a slot without its content.
LlamaFactoryTemplate parse_llamafactory_template(const ChatTemplate& chat_template, const Tokenizer& tok);

// LLaMA-Factory's infer_seqlen: the {source, target} lengths kept of a turn of `source` prompt and
// `target` response tokens within `cutoff` tokens (the response kept whole when it is under half).
std::pair<int64_t, int64_t> llamafactory_infer_seqlen(int64_t source, int64_t target, int64_t cutoff);

// tokenize_records of a kLlamaFactory source: its records converted as its formatting says,
// rendered through the template named by o.llamafactory_options (else parsed from o.chat_template,
// else LLaMA-Factory's "empty"), each slot's text tokenized alone, cut to o.max_length as
// infer_seqlen cuts and labelled as SupervisedDatasetProcessor labels. memrt::FileError naming the
// file and record for a record of the wrong shape, and naming the template for one memrt cannot
// follow (an EOS token the tokenizer lacks).
void tokenize_llamafactory(const std::string& path, const Tokenizer& tok, const RecordOptions& o,
                           TokenizedRecords& out, int threads);

}  // namespace memrt
