#include "data/llamafactory.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <string_view>
#include <utility>

#include "data/chat_template.h"
#include "data/progress.h"
#include "data/tokenizer.h"
#include "memrt/error.h"

namespace memrt {

namespace {

using Slot = LlamaFactoryTemplate::Slot;
using Slots = LlamaFactoryTemplate::Slots;

Slot text(std::string t) { return {Slot::kText, std::move(t)}; }
const Slot kBos{Slot::kBos, {}};
const Slot kEos{Slot::kEos, {}};

// register_template: `set` writes what the registration gives; the rest takes its defaults.
template <typename Set>
LlamaFactoryTemplate make(const char* name, Set set) {
  LlamaFactoryTemplate t;
  t.name = name;
  set(t);
  if (t.user.empty()) t.user = {text("{{content}}")};
  if (t.assistant.empty()) t.assistant = {text("{{content}}"), kEos};
  if (t.system.empty()) t.system = {text("{{content}}")};
  if (t.observation.empty()) t.observation = t.user;  // format_observation or format_user
  return t;
}

// ChatML's turns, as chatml, qwen, qwen3 and qwen3_nothink write them; `observation` is the tool
// result's turn.
void chatml_turns(LlamaFactoryTemplate& t, const char* observation) {
  t.user = {text("<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n")};
  t.assistant = {text("{{content}}<|im_end|>\n")};
  t.system = {text("<|im_start|>system\n{{content}}<|im_end|>\n")};
  t.observation = {text(observation)};
  t.replace_eos = true;
}

const char* const kQwenObservation =
    "<|im_start|>user\n<tool_response>\n{{content}}\n</tool_response><|im_end|>\n<|im_start|>assistant\n";

void gemma_turns(LlamaFactoryTemplate& t) {
  t.user = {text("<start_of_turn>user\n{{content}}<end_of_turn>\n<start_of_turn>model\n")};
  t.assistant = {text("{{content}}<end_of_turn>\n")};
  t.system = {text("{{content}}\n\n")};
  t.observation = {text("<start_of_turn>tool\n{{content}}<end_of_turn>\n<start_of_turn>model\n")};
  t.prefix = {kBos};
  t.stop_words = {"<end_of_turn>"};
  t.replace_eos = true;
  t.system_in_first_user = true;
}

// The templates of LLaMA-Factory's template.py that memrt ships, as registered there (their tool
// formatters aside: tools are refused).
const std::vector<LlamaFactoryTemplate>& templates() {
  static const std::vector<LlamaFactoryTemplate> all = {
      make("alpaca",
           [](LlamaFactoryTemplate& t) {
             t.user = {text("### Instruction:\n{{content}}\n\n### Response:\n")};
             t.assistant = {text("{{content}}"), kEos, text("\n\n")};
             t.default_system =
                 "Below is an instruction that describes a task. Write a response that appropriately completes the "
                 "request.\n\n";
           }),
      make("chatml",
           [](LlamaFactoryTemplate& t) {
             chatml_turns(t, "<|im_start|>tool\n{{content}}<|im_end|>\n<|im_start|>assistant\n");
             t.stop_words = {"<|im_end|>", "<|im_start|>"};
           }),
      make("default",
           [](LlamaFactoryTemplate& t) {
             t.user = {text("Human: {{content}}"), kEos, text("\nAssistant:")};
             t.assistant = {text("{{content}}"), kEos, text("\n")};
             t.system = {text("System: {{content}}"), kEos, text("\n")};
           }),
      make("empty", [](LlamaFactoryTemplate& t) { t.assistant = {text("{{content}}")}; }),
      make("gemma", gemma_turns),
      make("gemma3", gemma_turns),
      make("llama2",
           [](LlamaFactoryTemplate& t) {
             t.user = {kBos, text("[INST] {{content}} [/INST]")};
             t.system = {text("<<SYS>>\n{{content}}\n<</SYS>>\n\n")};
             t.system_in_first_user = true;
           }),
      make("llama3",
           [](LlamaFactoryTemplate& t) {
             t.user = {text("<|start_header_id|>user<|end_header_id|>\n\n{{content}}<|eot_id|>"
                            "<|start_header_id|>assistant<|end_header_id|>\n\n")};
             t.assistant = {text("{{content}}<|eot_id|>")};
             t.system = {text("<|start_header_id|>system<|end_header_id|>\n\n{{content}}<|eot_id|>")};
             t.observation = {text("<|start_header_id|>ipython<|end_header_id|>\n\n{{content}}<|eot_id|>"
                                   "<|start_header_id|>assistant<|end_header_id|>\n\n")};
             t.prefix = {kBos};
             t.stop_words = {"<|eot_id|>", "<|eom_id|>"};
             t.replace_eos = true;
           }),
      make("mistral",
           [](LlamaFactoryTemplate& t) {
             t.user = {text("[INST] {{content}}[/INST]")};
             t.assistant = {text(" {{content}}"), kEos};
             t.system = {text("{{content}}\n\n")};
             t.observation = {text("[TOOL_RESULTS] {\"content\": {{content}}}[/TOOL_RESULTS]")};
             t.prefix = {kBos};
             t.system_in_first_user = true;
           }),
      make("phi",
           [](LlamaFactoryTemplate& t) {
             t.user = {text("<|user|>\n{{content}}<|end|>\n<|assistant|>\n")};
             t.assistant = {text("{{content}}<|end|>\n")};
             t.system = {text("<|system|>\n{{content}}<|end|>\n")};
             t.stop_words = {"<|end|>"};
             t.replace_eos = true;
           }),
      make("phi4",
           [](LlamaFactoryTemplate& t) {
             t.user = {text("<|im_start|>user<|im_sep|>{{content}}<|im_end|><|im_start|>assistant<|im_sep|>")};
             t.assistant = {text("{{content}}<|im_end|>")};
             t.system = {text("<|im_start|>system<|im_sep|>{{content}}<|im_end|>")};
             t.stop_words = {"<|im_end|>"};
             t.replace_eos = true;
           }),
      make("qwen",
           [](LlamaFactoryTemplate& t) {
             chatml_turns(t, kQwenObservation);
             t.default_system = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";
             t.stop_words = {"<|im_end|>"};
           }),
      make("qwen3",
           [](LlamaFactoryTemplate& t) {
             chatml_turns(t, kQwenObservation);
             t.stop_words = {"<|im_end|>"};
             t.reasoning = true;
           }),
      make("qwen3_nothink",
           [](LlamaFactoryTemplate& t) {
             chatml_turns(t, kQwenObservation);
             t.stop_words = {"<|im_end|>"};
           }),
      make("vicuna",
           [](LlamaFactoryTemplate& t) {
             t.user = {text("USER: {{content}} ASSISTANT:")};
             t.default_system =
                 "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                 "helpful, detailed, and polite answers to the user's questions.";
           }),
  };
  return all;
}

// ReasoningTemplate's thought words: an answer's thought is what lies between them.
const std::string kThinkOpen = "<think>\n", kThinkClose = "\n</think>\n\n";

enum class Role { kUser, kAssistant, kObservation };

struct Message {
  Role role = Role::kUser;
  std::string content;
};

// A record as LLaMA-Factory's converters align it: `prompt` then `response`; empty both when the
// record is broken (a role out of turn, an odd count).
struct Example {
  std::string where;
  std::vector<Message> prompt, response;
  std::string system;
};

// The string a record holds under `column`: nullopt where the column is unset, or the record lacks it
// or holds null (a datasets column of another record); FileError when it is not a string or not UTF-8.
std::optional<std::string> string_at(const std::string& path, const std::string& where, const rapidjson::Value& v,
                                     const std::string& what) {
  if (v.IsNull()) return std::nullopt;
  if (!v.IsString()) throw FileError(path, where + ": " + what + " must be a string");
  std::string s(v.GetString(), v.GetStringLength());
  if (const std::optional<size_t> bad = first_invalid_utf8(s))
    throw FileError(path, where + ": " + what + " is not valid UTF-8 (byte " + std::to_string(*bad) +
                              "); convert the file (e.g. iconv -t UTF-8)");
  return s;
}

const rapidjson::Value* column(const rapidjson::Value& rec, const std::string& name) {
  if (name.empty()) return nullptr;
  const auto it = rec.FindMember(name.c_str());
  return it == rec.MemberEnd() || it->value.IsNull() ? nullptr : &it->value;
}

std::optional<std::string> column_string(const std::string& path, const std::string& where,
                                         const rapidjson::Value& rec, const std::string& name) {
  const rapidjson::Value* v = column(rec, name);
  return v ? string_at(path, where, *v, "\"" + name + "\"") : std::nullopt;
}

// The record's tools (the dataset's "tools" column), which LLaMA-Factory renders with its tool
// formatters (not built).
void refuse_tools(const std::string& path, const std::string& where, const rapidjson::Value& rec,
                  const LlamaFactoryDataset& d) {
  const rapidjson::Value* tools = column(rec, d.tools);
  if (tools && !(tools->IsString() && tools->GetStringLength() == 0) && !(tools->IsArray() && tools->Empty()))
    throw FileError(path, where + ": the record has tools (\"" + d.tools + "\"), and memrt does not render "
                              "LLaMA-Factory's tool formats yet; remove them, or the dataset's \"tools\" column");
}

// AlpacaDatasetConverter.
Example alpaca(const std::string& path, std::string where, const rapidjson::Value& rec, const LlamaFactoryDataset& d) {
  Example e;
  e.where = std::move(where);
  if (const rapidjson::Value* history = column(rec, d.history); history && history->IsArray()) {
    for (const auto& pair : history->GetArray()) {
      if (!pair.IsArray() || pair.Size() != 2)
        throw FileError(path, e.where + ": every entry of \"" + d.history + "\" must be a [prompt, response] pair");
      e.prompt.push_back({Role::kUser, *string_at(path, e.where, pair[0], "a prompt of \"" + d.history + "\"")});
      e.prompt.push_back({Role::kAssistant, *string_at(path, e.where, pair[1], "a response of \"" + d.history + "\"")});
    }
  }
  std::string query;
  for (const std::string* name : {&d.prompt, &d.query}) {
    const std::optional<std::string> part = column_string(path, e.where, rec, *name);
    if (part && !part->empty()) query += (query.empty() ? "" : "\n") + *part;
  }
  e.prompt.push_back({Role::kUser, query});
  if (const rapidjson::Value* response = column(rec, d.response); response && response->IsString())
    e.response.push_back({Role::kAssistant, *string_at(path, e.where, *response, "\"" + d.response + "\"")});
  e.system = column_string(path, e.where, rec, d.system).value_or("");
  return e;
}

// The message list of a sharegpt or openai record, read with the dataset's tags: the messages after a
// leading system message, which (else the record's system column) is the system prompt.
struct Conversation {
  const std::string& path;
  const std::string& where;
  const LlamaFactoryDataset& d;
  std::vector<const rapidjson::Value*> messages;
  std::string system;

  Conversation(const std::string& path, const std::string& where, const rapidjson::Value& rec,
               const LlamaFactoryDataset& d)
      : path(path), where(where), d(d) {
    const rapidjson::Value* list = column(rec, d.messages);
    if (!list || !list->IsArray())
      throw FileError(path, where + ": \"" + d.messages + "\" must be a list of messages (the dataset's \"messages\" "
                                    "column, in dataset_info.json)");
    for (const auto& m : list->GetArray()) messages.push_back(&m);
    if (!d.system_tag.empty() && !messages.empty() && role(*messages[0]) == d.system_tag) {
      system = content(*messages[0]);
      messages.erase(messages.begin());
    } else {
      system = column_string(path, where, rec, d.system).value_or("");
    }
  }
  std::string role(const rapidjson::Value& m) const {
    const auto r = m.IsObject() ? m.FindMember(d.role_tag.c_str()) : rapidjson::Value::ConstMemberIterator();
    if (!m.IsObject() || r == m.MemberEnd() || !r->value.IsString())
      throw FileError(path, where + ": every message needs a string \"" + d.role_tag + "\" (the dataset's role_tag)");
    return r->value.GetString();
  }
  std::string content(const rapidjson::Value& m) const {
    const auto c = m.FindMember(d.content_tag.c_str());
    if (c == m.MemberEnd())
      throw FileError(path, where + ": a message has no \"" + d.content_tag + "\" (the dataset's content_tag)");
    std::optional<std::string> text = string_at(path, where, c->value, "a message's \"" + d.content_tag + "\"");
    if (!text) throw FileError(path, where + ": a message's \"" + d.content_tag + "\" is null; it must be a string");
    return std::move(*text);
  }
  static bool is(const std::string& tag, const std::string& role) { return !tag.empty() && tag == role; }
  // `turn`: e.g. `a "function_call" turn`.
  void refuse_function_call(const std::string& turn) const {
    throw FileError(path, where + ": " + turn + " is a function call, and memrt does not render LLaMA-Factory's "
                                  "tool formats yet; remove the record or its calls");
  }
  // The converters' end: user and observation turns at even positions, assistant turns at odd ones,
  // an even count; else the record is broken (both empty).
  static void align(Example& e, std::vector<Message> aligned) {
    for (size_t i = 0; i < aligned.size(); ++i)
      if ((aligned[i].role == Role::kAssistant) != (i % 2 == 1)) return;  // "Invalid role tag"
    if (aligned.size() % 2 != 0) return;                                  // "Invalid message count"
    if (!aligned.empty()) {
      e.response.push_back(std::move(aligned.back()));
      aligned.pop_back();
    }
    e.prompt = std::move(aligned);
  }
};

// SharegptDatasetConverter.
Example sharegpt(const std::string& path, std::string where, const rapidjson::Value& rec, const LlamaFactoryDataset& d) {
  Example e;
  e.where = std::move(where);
  const Conversation c(path, e.where, rec, d);
  e.system = c.system;
  std::vector<Message> aligned;
  for (size_t i = 0; i < c.messages.size(); ++i) {
    const std::string role = c.role(*c.messages[i]);
    const bool odd = c.is(d.user_tag, role) || c.is(d.observation_tag, role);
    const bool even = c.is(d.assistant_tag, role) || c.is(d.function_tag, role);
    if (!(i % 2 == 0 ? odd : even)) return e;  // broken: checked as it goes, before a later function call
    if (c.is(d.function_tag, role)) c.refuse_function_call("a \"" + role + "\" turn");
    aligned.push_back({c.is(d.user_tag, role) ? Role::kUser : c.is(d.assistant_tag, role) ? Role::kAssistant
                                                                                          : Role::kObservation,
                       c.content(*c.messages[i])});
  }
  Conversation::align(e, std::move(aligned));
  return e;
}

// OpenAIDatasetConverter: consecutive observations (tool responses) are one turn, joined as LLaMA-Factory
// joins them (a trailing run is dropped, as it drops it); the roles are checked after that; and the
// system prompt says "detailed thinking off" unless it says "detailed thinking on" or "off" already
// (LLaMA-Factory's openai converter writes Nemotron's switch into every record without tools).
Example openai(const std::string& path, std::string where, const rapidjson::Value& rec, const LlamaFactoryDataset& d) {
  Example e;
  e.where = std::move(where);
  const Conversation c(path, e.where, rec, d);
  std::vector<Message> aligned;
  std::vector<std::string> tool_responses;
  bool broken = false;
  for (const rapidjson::Value* m : c.messages) {
    const std::string role = c.role(*m);
    if (c.is(d.function_tag, role)) c.refuse_function_call("a \"" + role + "\" turn");
    if (c.is(d.assistant_tag, role)) {
      const auto calls = m->FindMember("tool_calls");
      if (calls != m->MemberEnd() && !calls->value.IsNull() && !(calls->value.IsArray() && calls->value.Empty()))
        c.refuse_function_call("an \"" + role + "\" turn with \"tool_calls\"");
    }
    const std::string content = c.content(*m);
    if (c.is(d.observation_tag, role)) {
      tool_responses.push_back(content);
      continue;
    }
    if (!tool_responses.empty()) {
      std::string joined = tool_responses[0];
      for (size_t k = 1; k < tool_responses.size(); ++k) joined += "\n</tool_response>\n<tool_response>\n" + tool_responses[k];
      aligned.push_back({Role::kObservation, std::move(joined)});
      tool_responses.clear();
    }
    if (c.is(d.user_tag, role)) {
      aligned.push_back({Role::kUser, content});
    } else if (c.is(d.assistant_tag, role)) {
      aligned.push_back({Role::kAssistant, content});
    } else if (c.is(d.system_tag, role)) {
      broken = true;  // a system message after the first: its role is out of turn wherever it is
    } else {
      throw FileError(path, e.where + ": a message's role \"" + role + "\" is none of the dataset's tags (user_tag \"" +
                                d.user_tag + "\", assistant_tag \"" + d.assistant_tag + "\", observation_tag \"" +
                                d.observation_tag + "\", system_tag \"" + d.system_tag + "\"); set its tags in "
                                "dataset_info.json");
    }
  }
  const std::string off = "detailed thinking off";
  e.system = c.system.empty() ? off
             : c.system.find("detailed thinking on") != std::string::npos || c.system.find(off) != std::string::npos
                 ? c.system
                 : c.system + "\n" + off;
  if (!broken) Conversation::align(e, std::move(aligned));
  return e;
}

// StringFormatter.apply: each text slot with its placeholders replaced, the first of each, in order.
Slots apply(const Slots& slots, const std::vector<std::pair<const char*, std::string>>& values) {
  Slots out = slots;
  for (Slot& s : out) {
    if (s.kind != Slot::kText) continue;
    for (const auto& [name, value] : values) {
      const std::string placeholder = std::string("{{") + name + "}}";
      const size_t at = s.text.find(placeholder);
      if (at != std::string::npos) s.text.replace(at, placeholder.size(), value);
    }
  }
  return out;
}

// ReasoningTemplate.remove_thought: every <think>\n...\n</think>\n\n taken out, then the leading newlines.
std::string remove_thought(const std::string& s) {
  std::string out;
  size_t pos = 0;
  for (size_t open; (open = s.find(kThinkOpen, pos)) != std::string::npos;) {
    const size_t close = s.find(kThinkClose, open + kThinkOpen.size());
    if (close == std::string::npos) break;
    out.append(s, pos, open - pos);
    pos = close + kThinkClose.size();
  }
  out.append(s, pos, std::string::npos);
  return out.substr(std::min(out.find_first_not_of('\n'), out.size()));
}

// A message's tokens before tokenization: texts (tokenized alone, without special tokens) and ids.
struct Piece {
  int32_t id = -1;   // >= 0: this token
  size_t text = 0;   // else the index of its text
};

struct Encoder {
  const LlamaFactoryTemplate& t;
  const Tokenizer& tok;
  std::optional<int32_t> bos, eos;
  std::vector<std::string>& texts;

  void add(std::vector<Piece>& pieces, const Slots& elements) const {
    for (const Slot& s : elements) {
      if (s.kind == Slot::kText) {
        if (s.text.empty()) continue;
        pieces.push_back({-1, texts.size()});
        texts.push_back(s.text);
      } else if (s.kind == Slot::kToken) {
        const std::optional<int32_t> id = tok.token_to_id(s.text);
        if (!id) throw Error("LLaMA-Factory template " + t.name + " writes the token " + s.text + ", which the tokenizer lacks");
        pieces.push_back({*id, 0});
      } else if (const std::optional<int32_t>& id = s.kind == Slot::kBos ? bos : eos) {
        pieces.push_back({*id, 0});
      }
    }
  }

  // Template._encode (Llama2Template's with system_in_first_user): each message's pieces.
  std::vector<std::vector<Piece>> encode(const std::vector<Message>& messages, const std::string& system) const {
    std::vector<std::vector<Piece>> out;
    for (size_t i = 0; i < messages.size(); ++i) {
      std::vector<Piece> pieces;
      std::string system_text;
      if (i == 0) {
        add(pieces, t.prefix);
        if (!system.empty()) {
          const Slots s = apply(t.system, {{"content", system}});
          if (t.system_in_first_user)
            system_text = s.front().text;  // format_system.apply(...)[0]
          else
            add(pieces, s);
        }
      }
      const Message& m = messages[i];
      if (m.role == Role::kUser)
        add(pieces, t.system_in_first_user ? apply(t.user, {{"content", system_text + m.content}})
                                           : apply(t.user, {{"content", m.content}, {"idx", std::to_string(i / 2)}}));
      else
        add(pieces, apply(m.role == Role::kAssistant ? t.assistant : t.observation, {{"content", m.content}}));
      out.push_back(std::move(pieces));
    }
    return out;
  }

  // encode_multiturn (ReasoningTemplate's for a reasoning template): the messages' pieces, in turns.
  std::vector<std::vector<Piece>> encode_turns(std::vector<Message> messages, const std::string& system,
                                               const LlamaFactoryOptions& o) const {
    const bool discard_history_thoughts = o.mask_history;  // and not preserve_thinking (never set)
    if (t.reasoning) {
      for (size_t i = 1; i < messages.size(); i += 2)
        if (!o.enable_thinking || (discard_history_thoughts && i + 2 < messages.size()))
          messages[i].content = remove_thought(messages[i].content);
    }
    std::vector<std::vector<Piece>> encoded = encode(messages, system);
    if (!t.reasoning) return encoded;
    for (size_t i = discard_history_thoughts ? messages.size() - 2 : 0; i + 1 < messages.size(); i += 2) {
      const std::string& answer = messages[i + 1].content;
      if (answer.find("<think>") != std::string::npos || answer.find("</think>") != std::string::npos) continue;
      const Piece thought{-1, texts.size()};  // get_thought_word_ids
      texts.push_back(kThinkOpen + kThinkClose);
      if (o.enable_thinking)
        encoded[i + 1].insert(encoded[i + 1].begin(), thought);
      else
        encoded[i].push_back(thought);
    }
    return encoded;
  }
};

// The tokens one turn contributes (source then target), cut and labelled.
struct Turn {
  std::vector<int32_t> source, target;
};

// SupervisedDatasetProcessor._encode_data_example on the turns' ids: the sample and its labels;
// `cut` when a turn was shortened or left out.
void supervised(std::vector<Turn> turns, const RecordOptions& o, std::vector<int32_t>& ids,
                std::vector<uint8_t>& labels, bool& cut) {
  const bool mask_history = o.llamafactory_options.mask_history;
  if (mask_history) std::reverse(turns.begin(), turns.end());  // the last turns first
  int64_t total = 0;
  cut = false;
  for (size_t k = 0; k < turns.size(); ++k) {
    if (total >= o.max_length) {
      cut = true;
      break;
    }
    Turn& turn = turns[k];
    const auto [source, target] = llamafactory_infer_seqlen(static_cast<int64_t>(turn.source.size()),
                                               static_cast<int64_t>(turn.target.size()), o.max_length - total);
    cut = cut || source < static_cast<int64_t>(turn.source.size()) || target < static_cast<int64_t>(turn.target.size());
    turn.source.resize(static_cast<size_t>(source));
    turn.target.resize(static_cast<size_t>(target));
    total += source + target;
    std::vector<int32_t> turn_ids = turn.source;
    turn_ids.insert(turn_ids.end(), turn.target.begin(), turn.target.end());
    std::vector<uint8_t> turn_labels(turn.source.size(), o.train_on_prompt ? 1 : 0);
    turn_labels.resize(turn_ids.size(), mask_history && k != 0 ? 0 : 1);
    if (mask_history) {  // reversed: in front of the later turns
      ids.insert(ids.begin(), turn_ids.begin(), turn_ids.end());
      labels.insert(labels.begin(), turn_labels.begin(), turn_labels.end());
    } else {
      ids.insert(ids.end(), turn_ids.begin(), turn_ids.end());
      labels.insert(labels.end(), turn_labels.begin(), turn_labels.end());
    }
  }
}

// The template a run's options choose: template: NAME, else the model's chat template parsed,
// else "empty" (LLaMA-Factory warns "use `empty` template").
LlamaFactoryTemplate run_template(const std::string& path, const Tokenizer& tok, const RecordOptions& o,
                                  std::vector<std::string>& notes) {
  const LlamaFactoryOptions& lf = o.llamafactory_options;
  LlamaFactoryTemplate t;
  if (!lf.template_name.empty()) {
    const LlamaFactoryTemplate* named = llamafactory_template(lf.template_name);
    if (!named)
      throw FileError(path, "template: \"" + lf.template_name + "\" is not a LLaMA-Factory template memrt ships (" +
                                llamafactory_template_names() + "); leave template out to use the model's own chat "
                                                                "template, as LLaMA-Factory parses it");
    t = *named;
  } else if (o.chat_template) {
    try {
      t = parse_llamafactory_template(*o.chat_template, tok);
    } catch (const Error& e) {
      throw FileError(path, std::string("with no template: key, LLaMA-Factory parses the model's chat template, and "
                                        "it cannot: ") + e.what() + "; name a template (template: llama3, ...)");
    }
  } else {
    t = *llamafactory_template("empty");
    notes.push_back("no template: and the model has no chat template: LLaMA-Factory's \"empty\" template");
  }
  if (lf.default_system) t.default_system = *lf.default_system;
  return t;
}

// Python's str of `s` as code points (UTF-8 decoded; `s` is valid UTF-8).
std::vector<std::string_view> code_points(std::string_view s) {
  std::vector<std::string_view> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

}  // namespace

std::pair<int64_t, int64_t> llamafactory_infer_seqlen(int64_t source, int64_t target, int64_t cutoff) {
  int64_t max_target;
  if (target * 2 < cutoff)
    max_target = cutoff;
  else if (source * 2 < cutoff)
    max_target = cutoff - source;
  else  // Python's int() of the float product
    max_target = static_cast<int64_t>(static_cast<double>(cutoff) *
                                      (static_cast<double>(target) / static_cast<double>(source + target)));
  const int64_t new_target = std::min(max_target, target);
  const int64_t new_source = std::min(std::max<int64_t>(cutoff - new_target, 0), source);
  return {new_source, new_target};
}

const LlamaFactoryTemplate* llamafactory_template(const std::string& name) {
  for (const LlamaFactoryTemplate& t : templates())
    if (t.name == name) return &t;
  return nullptr;
}

std::string llamafactory_template_names() {
  std::string names;
  for (const LlamaFactoryTemplate& t : templates()) names += (names.empty() ? "" : ", ") + t.name;
  return names;
}

LlamaFactoryTemplate parse_llamafactory_template(const ChatTemplate& chat_template, const Tokenizer& tok) {
  // apply_chat_template(messages, add_generation_prompt, tokenize=False), past the prefix.
  const std::string prefix = tok.decode(tok.encode("", /*add_special_tokens=*/true));
  auto render = [&](std::vector<std::pair<const char*, const char*>> messages, bool add_generation_prompt) {
    rapidjson::Document list(rapidjson::kArrayType);
    for (const auto& [role, content] : messages) {
      rapidjson::Value m(rapidjson::kObjectType);
      m.AddMember("role", rapidjson::StringRef(role), list.GetAllocator());
      m.AddMember("content", rapidjson::StringRef(content), list.GetAllocator());
      list.PushBack(m, list.GetAllocator());
    }
    const rapidjson::Document vars = chat_template_variables(tok, list, nullptr, add_generation_prompt);
    const std::string text = chat_template.render(vars).text;
    return text.substr(std::min(prefix.size(), text.size()));
  };
  const std::string system_slot = render({{"system", "{{content}}"}}, false);
  const std::string user_slot_empty_system = render({{"system", ""}, {"user", "{{content}}"}}, true);
  std::string user_slot = render({{"user", "{{content}}"}}, true);
  std::string assistant_slot = render({{"user", "{{content}}"}, {"assistant", "{{content}}"}}, false);
  assistant_slot = assistant_slot.substr(std::min(user_slot.size(), assistant_slot.size()));
  LlamaFactoryTemplate t;
  t.name = "(parsed from the model's chat template)";
  t.reasoning = assistant_slot.find("<think>") != std::string::npos;
  for (const char* tag : {"<think>", "</think>"})
    for (size_t at; (at = assistant_slot.find(tag)) != std::string::npos;) assistant_slot.erase(at, std::strlen(tag));
  assistant_slot.erase(0, std::min(assistant_slot.find_first_not_of('\n'), assistant_slot.size()));
  if (user_slot.size() > user_slot_empty_system.size()) {  // find_diff, by code points as Python compares
    const std::vector<std::string_view> shorter = code_points(user_slot_empty_system), longer = code_points(user_slot);
    size_t i = 0;
    for (const std::string_view c : longer) {
      if (i < shorter.size() && shorter[i] == c)
        ++i;
      else if (i < shorter.size())
        t.default_system += c;
    }
    std::string sole_system = system_slot;
    if (const size_t at = sole_system.find("{{content}}"); at != std::string::npos)
      sole_system.replace(at, 11, t.default_system);
    user_slot = user_slot.substr(std::min(sole_system.size(), user_slot.size()));
  }
  for (const auto& [slot, what] : {std::pair<const std::string*, const char*>{&system_slot, "system"},
                                   {&user_slot, "user"}, {&assistant_slot, "assistant"}})
    if (slot->find("{{") == std::string::npos)
      throw Error(std::string("the chat template writes no content in the ") + what + " slot (\"" + *slot + "\")");
  t.user = {text(user_slot)};
  t.assistant = {text(assistant_slot)};
  t.system = {text(system_slot)};
  t.observation = {text(user_slot)};
  if (!prefix.empty()) t.prefix = {text(prefix)};
  return t;
}

void tokenize_llamafactory(const std::string& path, const Tokenizer& tok, const RecordOptions& o,
                           TokenizedRecords& out, int threads) {
  const LlamaFactoryTemplate t = run_template(path, tok, o, out.notes);
  // fix_special_tokens: the EOS token is the first stop word with replace_eos, else the tokenizer's,
  // else <|endoftext|>; LLaMA-Factory adds it when the tokenizer lacks it (and resizes the model).
  std::optional<int32_t> eos = tok.eos_token() ? std::optional<int32_t>(tok.eos_token()->id) : std::nullopt;
  std::string eos_name = t.replace_eos && !t.stop_words.empty() ? t.stop_words[0] : eos ? "" : "<|endoftext|>";
  if (!eos_name.empty()) {
    eos = tok.token_to_id(eos_name);
    if (!eos)
      throw FileError(path, "template " + t.name + " ends a sequence with " + eos_name + ", which the tokenizer does "
                            "not have; LLaMA-Factory would add it as a new token (resize_vocab): use a template made for "
                            "this model, or add the token to tokenizer.json");
  }
  const LlamaFactoryDataset& d = o.llamafactory;
  std::vector<Example> examples;
  for_each_json_record(path, [&](std::string where, const rapidjson::Value& rec) {
    if (o.max_samples >= 0 && static_cast<int64_t>(examples.size()) >= o.max_samples) return;
    if (!rec.IsObject()) throw FileError(path, where + ": expected a JSON object (a " + d.formatting + " record)");
    refuse_tools(path, where, rec, d);
    examples.push_back(d.formatting == "sharegpt" ? sharegpt(path, std::move(where), rec, d)
                       : d.formatting == "openai" ? openai(path, std::move(where), rec, d)
                                                  : alpaca(path, std::move(where), rec, d));
  });
  std::vector<std::string> texts;
  const std::optional<int32_t> bos = tok.bos_token() ? std::optional<int32_t>(tok.bos_token()->id) : std::nullopt;
  const Encoder encoder{t, tok, bos, eos, texts};
  std::vector<std::vector<std::vector<Piece>>> encoded(examples.size());  // per record, per message
  for (size_t k = 0; k < examples.size(); ++k) {
    Example& e = examples[k];
    if (e.prompt.size() % 2 != 1 || e.response.size() != 1) continue;  // "Dropped invalid example"
    std::vector<Message> messages = std::move(e.prompt);
    messages.push_back(std::move(e.response[0]));
    try {
      encoded[k] = encoder.encode_turns(std::move(messages), e.system.empty() ? t.default_system : e.system,
                                        o.llamafactory_options);
    } catch (const Error& err) {
      throw FileError(path, e.where + ": " + err.what());
    }
  }
  std::vector<std::vector<int32_t>> ids_of;
  try {
    const std::vector<std::string_view> docs(texts.begin(), texts.end());
    ProgressCounter progress("tokenizing " + path + " ", Tokenizer::text_bytes(docs), /*show=*/true);
    ids_of = tok.encode_batch(docs, /*add_special_tokens=*/false, threads,
                              [&](size_t bytes) { progress.add(static_cast<int64_t>(bytes)); });
  } catch (const std::exception& e) {
    throw FileError(path, std::string("cannot be tokenized: ") + e.what());
  }
  auto ids = [&](const std::vector<Piece>& pieces) {
    std::vector<int32_t> v;
    for (const Piece& p : pieces) {
      if (p.id >= 0)
        v.push_back(p.id);
      else
        v.insert(v.end(), ids_of[p.text].begin(), ids_of[p.text].end());
    }
    return v;
  };
  for (size_t k = 0; k < encoded.size(); ++k) {
    const std::vector<std::vector<Piece>>& messages = encoded[k];
    if (messages.empty()) {
      ++out.dropped;
      continue;
    }
    std::vector<Turn> turns;
    for (size_t i = 0; i + 1 < messages.size(); i += 2) turns.push_back({ids(messages[i]), ids(messages[i + 1])});
    std::vector<int32_t> sample;
    std::vector<uint8_t> labels;
    bool cut = false;
    supervised(std::move(turns), o, sample, labels, cut);
    bool trains = false;  // a sample needs one prediction to train on
    for (size_t i = 1; i < labels.size() && !trains; ++i) trains = labels[i] != 0;
    if (!trains) {
      ++out.dropped;
      continue;
    }
    out.truncated += cut;
    for (int32_t id : sample) out.ids.push_back(static_cast<uint32_t>(id));
    out.labels.insert(out.labels.end(), labels.begin(), labels.end());
    out.offsets.push_back(static_cast<int64_t>(out.ids.size()));
    out.sample_records.push_back(out.records + static_cast<int64_t>(k));
  }
  out.records += static_cast<int64_t>(examples.size());
}

}  // namespace memrt
