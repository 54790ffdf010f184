#include "data/records.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string_view>
#include <tuple>

#include <rapidjson/document.h>
#include <rapidjson/error/en.h>

#include "data/chat_template.h"
#include "data/utf8.h"
#include "data/llamafactory.h"
#include "data/mapped_file.h"
#include "data/tokenizer.h"
#include "data/progress.h"
#include "memrt/error.h"

namespace memrt {

const char* record_type_name(RecordType type) {
  switch (type) {
    case RecordType::kAlpaca:
      return "alpaca";
    case RecordType::kPromptCompletion:
      return "prompt_completion";
    case RecordType::kMessages:
      return "messages";
    case RecordType::kChatTemplate:
      return "chat_template";
    case RecordType::kLlamaFactory:
      return "llamafactory";
  }
  return "?";
}

rapidjson::Document chat_template_variables(const Tokenizer& tok, const rapidjson::Value& messages,
                                            const rapidjson::Value* tools, bool add_generation_prompt) {
  rapidjson::Document vars(rapidjson::kObjectType);
  auto& a = vars.GetAllocator();
  vars.AddMember("messages", rapidjson::Value(messages, a), a);
  vars.AddMember("tools", tools ? rapidjson::Value(*tools, a) : rapidjson::Value(), a);
  vars.AddMember("add_generation_prompt", add_generation_prompt, a);
  for (const auto& [name, token] : {std::pair<const char*, const std::optional<Tokenizer::SpecialToken>*>{"bos_token", &tok.bos_token()},
                                    {"eos_token", &tok.eos_token()}})
    if (*token) vars.AddMember(rapidjson::StringRef(name), rapidjson::Value((*token)->text.c_str(), a), a);
  return vars;
}

void for_each_json_record(const std::string& path,
                          const std::function<void(std::string where, const rapidjson::Value& record)>& fn) {
  const MappedFile file(path);
  const char* p = reinterpret_cast<const char*>(file.data());
  const char* end = p + file.size();
  if (path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0) {  // one array of records
    rapidjson::Document doc;
    doc.Parse(p, file.size());
    if (doc.HasParseError())
      throw FileError(path, std::string("invalid JSON (") + rapidjson::GetParseError_En(doc.GetParseError()) +
                                " at byte " + std::to_string(doc.GetErrorOffset()) + "); expected an array of records");
    if (!doc.IsArray()) throw FileError(path, "expected a JSON array of records (or a .jsonl file, one per line)");
    for (rapidjson::SizeType i = 0; i < doc.Size(); ++i) fn("record " + std::to_string(i + 1), doc[i]);
    return;
  }
  for (int64_t line = 1; p < end; ++line) {
    const char* eol = static_cast<const char*>(std::memchr(p, '\n', static_cast<size_t>(end - p)));
    if (!eol) eol = end;
    const char* first = p;
    while (first < eol && (*first == ' ' || *first == '\t' || *first == '\r')) ++first;
    if (first < eol) {  // blank lines are skipped
      rapidjson::Document doc;
      doc.Parse(first, static_cast<size_t>(eol - first));
      std::string where = "line " + std::to_string(line);
      if (doc.HasParseError())
        throw FileError(path, where + ": invalid JSON (" + rapidjson::GetParseError_En(doc.GetParseError()) +
                                  "); expected one record per line");
      fn(std::move(where), doc);
    }
    p = eol + 1;
  }
}

namespace {

// An axolotl chat_template turn that find_turn looks for: whether it trains, and where it is — the
// bytes of the conversation's rendering it spans (its locator's diff), or where the tokenizer maps no
// offsets, the index in its record's texts of the conversation rendered up to it with a dummy message
// in its place (the next text: up to it as it is; its token diff).
// axolotl's training_detail: characters [begin, end] (end included) of a message's text, trained or not.
struct Detail {
  int64_t begin = 0, end = 0;
  bool train = false;
};

struct Turn {
  bool trains = false;
  std::optional<std::pair<size_t, size_t>> span;
  size_t dummy = 0;
  // Where its content's (or its reasoning's) training_detail says which tokens train: the details,
  // the index in the record's texts of that text alone, and the reasoning's span in the rendering.
  std::vector<Detail> detail, reasoning_detail;
  size_t content_text = 0, reasoning_text = 0;
  std::optional<std::pair<size_t, size_t>> reasoning_span;
};

// The texts one record is tokenized from, and where it is in its file ("line 3", "record 3");
// a conversation's first text is its rendering, with the byte spans of its generation blocks.
// axolotl's chat_template: the rendering and the turns it locates; on its legacy path (nothing
// chosen to train by role, turn or EOS), the prompt rendered with the generation prompt, then the whole.
struct Record {
  std::string where;
  std::vector<std::string> texts;
  std::vector<std::pair<size_t, size_t>> generation;
  std::vector<Turn> turns;
  bool legacy = false;
};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The fields `type` reads, in the order tokenize() takes them.
std::string field(const std::string& path, const std::string& where, const rapidjson::Value& rec, const char* name,
                  RecordType type, bool required) {
  const auto it = rec.FindMember(name);
  const char* needs = type == RecordType::kAlpaca ? "\"instruction\", \"output\" and optionally \"input\""
                                                  : "\"prompt\" and \"completion\"";  // (messages: read below)
  if (it == rec.MemberEnd() || it->value.IsNull()) {
    if (!required) return "";
    throw FileError(path, where + ": the record has no \"" + name + "\" field; " + record_type_name(type) +
                              " records need " + needs);
  }
  if (!it->value.IsString()) {
    const bool conversational = it->value.IsArray();
    throw FileError(path, where + ": \"" + name + "\" must be a string" +
                              (conversational ? " (a list of messages is a conversational record: chat templates are "
                                                "not supported yet, docs/tokenizers.md)"
                                              : ""));
  }
  std::string s(it->value.GetString(), it->value.GetStringLength());
  if (const std::optional<size_t> bad = first_invalid_utf8(s))
    throw FileError(path, where + ": \"" + name + "\" is not valid UTF-8 (byte " + std::to_string(*bad) +
                              "); the tokenizer takes UTF-8 text: convert the file (e.g. iconv -t UTF-8)");
  return s;
}

// axolotl's AlpacaPrompter (prompt_style instruct).
std::string alpaca_prompt(const std::string& instruction, const std::string& input) {
  if (input.empty())
    return "Below is an instruction that describes a task. Write a response that appropriately completes the "
           "request.\n\n### Instruction:\n" + instruction + "\n\n### Response:\n";
  return "Below is an instruction that describes a task, paired with an input that provides further context. Write "
         "a response that appropriately completes the request.\n\n### Instruction:\n" + instruction +
         "\n\n### Input:\n" + input + "\n\n### Response:\n";
}

// A message's text content must be UTF-8, as the tokenizer takes it.
void check_content(const std::string& path, const std::string& where, const rapidjson::Value& m) {
  const auto c = m.FindMember("content");
  if (c == m.MemberEnd() || !c->value.IsString()) return;
  const std::string content(c->value.GetString(), c->value.GetStringLength());
  if (const std::optional<size_t> bad = first_invalid_utf8(content))
    throw FileError(path, where + ": a message's \"content\" is not valid UTF-8 (byte " + std::to_string(*bad) +
                              "); convert the file (e.g. iconv -t UTF-8)");
}

// The chat template's rendering of `messages` as transformers' apply_chat_template renders it:
// tools (when given), add_generation_prompt, the BOS and EOS texts, axolotl's real_last_index
// (when non-zero, as axolotl passes it) and its chat_template_kwargs. The template's errors name
// the record.
ChatTemplate::Rendered render(const std::string& path, const std::string& where, const RecordOptions& o,
                              const Tokenizer& tok, const rapidjson::Value& messages, const rapidjson::Value* tools,
                              bool add_generation_prompt, int64_t real_last_index) {
  rapidjson::Document vars = chat_template_variables(tok, messages, tools, add_generation_prompt);
  auto& a = vars.GetAllocator();
  if (o.chat_template_kwargs)
    for (const auto& [name, value] : o.chat_template_kwargs->GetObject()) {
      vars.RemoveMember(name);
      vars.AddMember(rapidjson::Value(name, a), rapidjson::Value(value, a), a);
    }
  if (real_last_index) vars.AddMember("real_last_index", real_last_index, a);
  try {
    return o.chat_template->render(vars);
  } catch (const Error& e) {
    throw FileError(path, where + ": " + e.what());
  }
}

// A JSON value given as a string where the template wants the object (tool calls' arguments,
// tools' parameters), parsed as axolotl parses it.
void parse_json_string(const std::string& path, const std::string& where, rapidjson::Value& v, const char* what,
                       rapidjson::Document::AllocatorType& a) {
  if (!v.IsString()) return;
  rapidjson::Document parsed(&a);
  parsed.Parse(v.GetString(), v.GetStringLength());
  if (parsed.HasParseError())
    throw FileError(path, where + ": " + what + " is a string that is not valid JSON (" +
                              rapidjson::GetParseError_En(parsed.GetParseError()) + "); write it as a JSON object");
  v.CopyFrom(parsed, a);
}

// axolotl's split_thinking of an assistant's content: the text inside its first thinking pair (by
// the first opening and the first closing tag, the pairs tried in order) stripped, and the content
// what follows the closing tag, left-stripped — or, where that holds <|begin_of_solution|> and
// <|end_of_solution|>, the stripped text between them. nullopt: no pair in the content.
std::optional<std::pair<std::string, std::string>> split_thinking(const std::string& content) {
  static const std::pair<std::string, std::string> kThinking[] = {
      {"<think>", "</think>"}, {"<reasoning>", "</reasoning>"}, {"<|begin_of_thought|>", "<|end_of_thought|>"}};
  const std::string solution_open = "<|begin_of_solution|>", solution_close = "<|end_of_solution|>";
  auto slice = [](const std::string& s, size_t from, size_t to) { return to > from ? s.substr(from, to - from) : ""; };
  for (const auto& [open, close] : kThinking) {
    const size_t o = content.find(open), c = content.find(close);
    if (o == std::string::npos || c == std::string::npos) continue;
    const std::string thinking = python_strip(slice(content, o + open.size(), c), true, true);
    std::string rest = python_strip(content.substr(c + close.size()), true, false);
    const size_t so = rest.find(solution_open), sc = rest.find(solution_close);
    if (so != std::string::npos && sc != std::string::npos)
      rest = python_strip(slice(rest, so + solution_open.size(), sc), true, true);
    return std::make_pair(thinking, rest);
  }
  return std::nullopt;
}

// axolotl's _convert_content_parts: a list of content parts as one string, each object part's first
// truthy "text", "content" or "value" (a string) in order; other parts add nothing. Where a part
// says "train" (or "weight": trained unless 0), each part's text is a training_detail of its
// characters (a part without "train" or "weight" trains); nullopt otherwise.
std::optional<std::vector<Detail>> join_content_parts(const std::string& path, const std::string& where,
                                                      rapidjson::Value& content, rapidjson::Document::AllocatorType& a) {
  if (!content.IsArray()) return std::nullopt;
  auto truthy = [](const rapidjson::Value& v) {
    return !(v.IsNull() || (v.IsBool() && !v.GetBool()) || (v.IsNumber() && v.GetDouble() == 0) ||
             (v.IsString() && v.GetStringLength() == 0) || (v.IsArray() && v.Empty()) ||
             (v.IsObject() && v.MemberCount() == 0));
  };
  std::string text;
  std::vector<Detail> details;
  bool explicit_training = false;
  for (const auto& part : content.GetArray()) {
    if (!part.IsObject()) continue;
    std::string piece;
    for (const char* key : {"text", "content", "value"}) {
      const auto it = part.FindMember(key);
      if (it == part.MemberEnd() || !truthy(it->value)) continue;
      if (!it->value.IsString())
        throw FileError(path, where + ": a content part's \"" + key + "\" must be a string");
      piece.assign(it->value.GetString(), it->value.GetStringLength());
      break;
    }
    bool train = true;
    const auto flag = part.FindMember("train"), weight = part.FindMember("weight");
    if (flag != part.MemberEnd() && !flag->value.IsNull()) {
      if (!flag->value.IsBool()) throw FileError(path, where + ": a content part's \"train\" must be true or false");
      train = flag->value.GetBool();
      explicit_training = true;
    } else if (weight != part.MemberEnd() && !weight->value.IsNull()) {
      if (!weight->value.IsNumber()) throw FileError(path, where + ": a content part's \"weight\" must be a number");
      train = weight->value.GetDouble() != 0;
      explicit_training = true;
    }
    if (!piece.empty()) {
      const int64_t begin = code_points(text);
      details.push_back({begin, begin + code_points(piece) - 1, train});
    }
    text += piece;
  }
  content.SetString(text.c_str(), static_cast<rapidjson::SizeType>(text.size()), a);
  if (!explicit_training) return std::nullopt;
  return details;
}

// A message's message_field_training_detail: a list of {begin_offset, end_offset, train}.
std::vector<Detail> read_details(const std::string& path, const std::string& where, const rapidjson::Value& v,
                                 const std::string& key) {
  const std::string expected = ": \"" + key + "\" (message_field_training_detail) must be a list of "
                               "{\"begin_offset\": N, \"end_offset\": N, \"train\": true|false}";
  if (!v.IsArray()) throw FileError(path, where + expected);
  std::vector<Detail> out;
  for (const auto& d : v.GetArray()) {
    if (!d.IsObject() || !d.HasMember("begin_offset") || !d["begin_offset"].IsInt64() || !d.HasMember("end_offset") ||
        !d["end_offset"].IsInt64() || !d.HasMember("train") || !d["train"].IsBool())
      throw FileError(path, where + expected);
    out.push_back({d["begin_offset"].GetInt64(), d["end_offset"].GetInt64(), d["train"].GetBool()});
  }
  return out;
}

// axolotl's _diff_char_span: the part of `full` that differs from `other`, compared from the front,
// then from the back no further than the front's match — in bytes, at character boundaries, as
// Python compares characters.
std::pair<size_t, size_t> differing_span(std::string_view full, std::string_view other) {
  auto continuation = [&full](size_t i) { return i < full.size() && is_continuation(full[i]); };
  const size_t limit = std::min(full.size(), other.size());
  size_t begin = 0;
  while (begin < limit && full[begin] == other[begin]) ++begin;
  while (begin > 0 && continuation(begin)) --begin;
  size_t suffix = 0;
  while (suffix < limit - begin && full[full.size() - 1 - suffix] == other[other.size() - 1 - suffix]) ++suffix;
  size_t end = full.size() - suffix;
  while (continuation(end)) ++end;
  return {begin, end};
}

// axolotl's ChatTemplateStrategy (type: chat_template): the record's messages as the template's
// turns (message_property_mappings, roles, the system field, drop_system_message, split_thinking,
// tool calls' arguments parsed, lists of content parts joined), rendered whole; each turn that trains (or whose EOS/EOT may) located
// as find_turn locates it: by its locator — the whole conversation rendered with each of two
// placeholders in the turn's place, the turn the widest span where a rendering differs from the
// conversation's — where the tokenizer maps offsets (a fast tokenizer's, in axolotl), else by its
// token diff, the conversation rendered up to the turn with "[[dummy_message]]" in its place and as
// it is.
Record read_axolotl_conversation(const std::string& path, Record r, const rapidjson::Value& rec,
                                 const RecordOptions& o, const Tokenizer& tok) {
  const ChatTemplateDataset& c = o.chat;
  const char* field = c.field_messages.c_str();
  const auto messages = rec.FindMember(field);
  if (messages == rec.MemberEnd() || messages->value.IsNull())
    throw FileError(path, r.where + ": the record has no \"" + c.field_messages + "\" list of messages (the dataset's "
                              "field_messages names the field that holds them)");
  if (!messages->value.IsArray() || messages->value.Empty())
    throw FileError(path, r.where + ": \"" + c.field_messages + "\" must be a non-empty list of messages");
  const std::vector<std::pair<std::string, std::string>> defaults = {
      {"role", "role"}, {"content", "content"}, {c.template_thinking_key, c.field_thinking}};
  const auto& mappings = c.property_mappings.empty() ? defaults : c.property_mappings;
  const std::vector<std::pair<std::string, std::string>> default_roles = {
      {"human", "user"}, {"user", "user"}, {"assistant", "assistant"}, {"gpt", "assistant"}, {"system", "system"},
      {"tool", "tool"}};
  const auto& roles = c.roles.empty() ? default_roles : c.roles;
  auto template_role = [&](const std::string& role) {
    for (const auto& [from, to] : roles)
      if (from == role) return to;
    return role;
  };
  rapidjson::Document doc(rapidjson::kObjectType);
  auto& a = doc.GetAllocator();
  // What of a turn is trained, beyond its role: message_field_training, and training_detail (the
  // message's field, or its content parts' flags) of its content and of its reasoning.
  struct Training {
    std::optional<bool> turn;
    std::optional<std::vector<Detail>> content, reasoning;
  };
  std::vector<Training> training;
  // transform_message: the mapped keys, the role renamed, then the message's other keys; then
  // get_conversation_thread's training keys and its content parts joined.
  auto transform = [&](const rapidjson::Value& m) {
    if (!m.IsObject()) throw FileError(path, r.where + ": every message must be a JSON object");
    rapidjson::Value out(rapidjson::kObjectType);
    auto set = [&](const std::string& key, const rapidjson::Value& v) {
      rapidjson::Value copy(v, a);
      if (out.HasMember(key.c_str())) out[key.c_str()] = copy;
      else out.AddMember(rapidjson::Value(key.c_str(), a), copy, a);
    };
    for (const auto& [key, from] : mappings) {
      const auto it = m.FindMember(from.c_str());
      if (it != m.MemberEnd() && !it->value.IsNull()) set(key, it->value);
    }
    if (!out.HasMember("role") || !out["role"].IsString())
      throw FileError(path, r.where + ": a message has no string role (message_property_mappings' \"role\" names "
                                      "the field that holds it)");
    out["role"].SetString(template_role(out["role"].GetString()).c_str(), a);
    if (c.split_thinking && std::string(out["role"].GetString()) == "assistant" && out.HasMember("content") &&
        out["content"].IsString())
      if (auto parts = split_thinking(out["content"].GetString())) {
        const auto& [thinking, answer] = *parts;
        set(c.template_thinking_key, rapidjson::Value(thinking.c_str(), a));
        out["content"].SetString(answer.c_str(), a);
      }
    for (const auto& [name, value] : m.GetObject()) {
      const std::string key(name.GetString(), name.GetStringLength());
      const bool mapped = std::any_of(mappings.begin(), mappings.end(), [&](const auto& kv) { return kv.second == key; });
      if (!mapped && !value.IsNull() && key != c.message_field_training && key != c.message_field_training_detail)
        set(key, value);
    }
    Training t;
    const auto flag = c.message_field_training.empty() ? m.MemberEnd() : m.FindMember(c.message_field_training.c_str());
    if (flag != m.MemberEnd() && !flag->value.IsNull()) {
      if (!flag->value.IsBool())
        throw FileError(path, r.where + ": \"" + c.message_field_training + "\" (message_field_training) must be "
                                  "true or false");
      t.turn = flag->value.GetBool();
    }
    const auto detail =
        c.message_field_training_detail.empty() ? m.MemberEnd() : m.FindMember(c.message_field_training_detail.c_str());
    if (detail != m.MemberEnd() && !detail->value.IsNull())
      t.content = read_details(path, r.where, detail->value, c.message_field_training_detail);
    if (out.HasMember("content"))
      if (auto parts = join_content_parts(path, r.where, out["content"], a)) t.content = std::move(parts);
    if (out.HasMember(c.template_thinking_key.c_str()))
      t.reasoning = join_content_parts(path, r.where, out[c.template_thinking_key.c_str()], a);
    training.push_back(std::move(t));
    check_content(path, r.where, out);
    if (out.HasMember("tool_calls") && out["tool_calls"].IsArray())
      for (auto& call : out["tool_calls"].GetArray())
        if (call.IsObject() && call.HasMember("function") && call["function"].IsObject() &&
            call["function"].HasMember("arguments"))
          parse_json_string(path, r.where, call["function"]["arguments"], "a tool call's \"arguments\"", a);
    return out;
  };
  rapidjson::Value said(rapidjson::kArrayType);  // the messages as turns
  for (const auto& m : messages->value.GetArray()) said.PushBack(transform(m), a);
  // The record's system field opens the conversation when its first message is not a system one.
  const auto system = rec.FindMember(c.field_system.c_str());
  rapidjson::Value turns(rapidjson::kArrayType);
  if (system != rec.MemberEnd() && !system->value.IsNull() && std::string(said[0]["role"].GetString()) != "system") {
    rapidjson::Value turn(rapidjson::kObjectType);
    turn.AddMember("role", "system", a);
    turn.AddMember("content", rapidjson::Value(system->value, a), a);
    turns.PushBack(turn, a);
    training.insert(training.begin(), Training{});
  }
  for (auto& turn : said.GetArray()) turns.PushBack(turn, a);  // moved
  if (c.drop_system_message && std::string(turns[0]["role"].GetString()) == "system") {
    turns.Erase(turns.Begin());
    training.erase(training.begin());
    if (turns.Empty()) throw FileError(path, r.where + ": the conversation holds only its system message");
  }
  rapidjson::Value tools;
  const auto t = rec.FindMember(c.field_tools.c_str());
  if (t != rec.MemberEnd() && !t->value.IsNull()) {
    if (!t->value.IsArray())
      throw FileError(path, r.where + ": \"" + c.field_tools + "\" must be a list of tools (field_tools)");
    tools.CopyFrom(t->value, a);
    for (auto& tool : tools.GetArray())
      if (tool.IsObject() && tool.HasMember("function") && tool["function"].IsObject() &&
          tool["function"].HasMember("parameters"))
        parse_json_string(path, r.where, tool["function"]["parameters"], "a tool's \"parameters\"", a);
  }
  const rapidjson::Value* tools_or_none = tools.IsArray() && !tools.Empty() ? &tools : nullptr;
  auto prefix = [&](size_t n) {
    rapidjson::Value v(rapidjson::kArrayType);
    for (size_t i = 0; i < n; ++i) v.PushBack(rapidjson::Value(turns[static_cast<rapidjson::SizeType>(i)], a), a);
    return v;
  };
  const std::string eot_mode = c.train_on_eot.value_or(c.train_on_eos);
  const size_t n = turns.Size();
  r.legacy = c.roles_to_train.empty() && c.train_on_eos.empty() && eot_mode.empty() && c.message_field_training.empty() &&
             c.message_field_training_detail.empty();
  if (r.legacy) {  // the conversation but its last turn with the generation prompt, then the whole
    r.texts = {render(path, r.where, o, tok, prefix(n - 1), nullptr, true, 0).text,
               render(path, r.where, o, tok, turns, nullptr, false, 0).text};
    return r;
  }
  r.texts = {render(path, r.where, o, tok, turns, tools_or_none, false, 0).text};
  const bool locate = tok.has_offsets(r.texts[0]);
  const char* thinking = c.template_thinking_key.c_str();
  // _build_dummy_turn: the turn with a placeholder for its content — keeping its reasoning for a
  // span of the content alone — or, for a span of its reasoning, for that.
  enum class Part { kTurn, kContent, kReasoning };
  auto placeholder = [&](const rapidjson::Value& turn, const char* text, Part part) {
    rapidjson::Value dummy(rapidjson::kObjectType);
    dummy.AddMember("role", rapidjson::Value(turn["role"], a), a);
    if (part == Part::kReasoning) {
      dummy.AddMember("content", turn.HasMember("content") ? rapidjson::Value(turn["content"], a) : rapidjson::Value(""), a);
      if (turn.HasMember(thinking)) dummy.AddMember(rapidjson::Value(thinking, a), rapidjson::Value(text, a), a);
    } else {
      dummy.AddMember("content", rapidjson::StringRef(text), a);
      if (part == Part::kContent && turn.HasMember(thinking))
        dummy.AddMember(rapidjson::Value(thinking, a), rapidjson::Value(turn[thinking], a), a);
    }
    return dummy;
  };
  auto locate_turn = [&](size_t i, Part part) {
    std::optional<std::pair<size_t, size_t>> span;
    for (const char* text : {"[[dummy_message]]", "zzdummymessagezz"}) {  // edges no template glues to both
      rapidjson::Value with = prefix(n);
      with[static_cast<rapidjson::SizeType>(i)] = placeholder(turns[static_cast<rapidjson::SizeType>(i)], text, part);
      const std::string other = render(path, r.where, o, tok, with, tools_or_none, false, 0).text;
      const auto [begin, end] = differing_span(r.texts[0], other);
      span = span ? std::pair{std::min(span->first, begin), std::max(span->second, end)} : std::pair{begin, end};
    }
    return span;
  };
  for (size_t i = 0; i < n; ++i) {
    const rapidjson::Value& said_turn = turns[static_cast<rapidjson::SizeType>(i)];
    const std::string role = said_turn["role"].GetString();
    const Training& said_training = training[i];
    bool trains = o.train_on_prompt;
    for (const std::string& name : c.roles_to_train) trains = trains || template_role(name) == role;
    const auto& content = said_training.content;
    const auto& reasoning = said_training.reasoning;
    const bool content_detail = content && !content->empty(), reasoning_detail = reasoning && !reasoning->empty();
    if (said_training.turn)
      trains = *said_training.turn;
    else if (content || reasoning)
      trains = content_detail || reasoning_detail;
    if (!trains && c.train_on_eos != "all" && eot_mode != "all") continue;
    if ((content_detail || reasoning_detail) && !locate)
      throw FileError(path, r.where + ": training_detail marks characters of a message, which memrt maps to tokens "
                                      "through the tokenizer's offsets, and " + tok.describe() + " has none for this "
                                      "conversation (a byte-level tokenizer that adds no prefix space has them)");
    if (locate) {
      Turn turn;
      turn.trains = trains;
      turn.span = locate_turn(i, content_detail || reasoning_detail ? Part::kContent : Part::kTurn);
      auto alone = [&](const char* key, size_t& index) {  // the text, tokenized alone
        if (!said_turn.HasMember(key) || !said_turn[key].IsString())
          throw FileError(path, r.where + ": training_detail needs the message's \"" + key + "\" to be text");
        index = r.texts.size();
        r.texts.emplace_back(said_turn[key].GetString(), said_turn[key].GetStringLength());
      };
      if (trains && content_detail) {
        turn.detail = *content;
        alone("content", turn.content_text);
      }
      if (trains && reasoning_detail && said_turn.HasMember(thinking)) {
        turn.reasoning_detail = *reasoning;
        alone(thinking, turn.reasoning_text);
        turn.reasoning_span = locate_turn(i, Part::kReasoning);
      }
      r.turns.push_back(std::move(turn));
      continue;
    }
    rapidjson::Value with_dummy = prefix(i);
    with_dummy.PushBack(placeholder(said_turn, "[[dummy_message]]", Part::kTurn), a);
    const auto last = static_cast<int64_t>(n) - 1;
    Turn turn;
    turn.trains = trains;
    turn.dummy = r.texts.size();
    r.turns.push_back(std::move(turn));
    r.texts.push_back(render(path, r.where, o, tok, with_dummy, tools_or_none, false, last).text);
    r.texts.push_back(render(path, r.where, o, tok, prefix(i + 1), tools_or_none, false, last).text);
  }
  return r;
}

Record read_record(const std::string& path, std::string where, const rapidjson::Value& rec, const RecordOptions& o,
                   const Tokenizer& tok) {
  if (!rec.IsObject())
    throw FileError(path, where + ": expected a JSON object (a " + record_type_name(o.type) + " record)");
  Record r;
  r.where = std::move(where);
  if (o.type == RecordType::kChatTemplate) return read_axolotl_conversation(path, std::move(r), rec, o, tok);
  if (o.type == RecordType::kMessages) {  // TRL: apply_chat_template(messages, tools=record's tools)
    rapidjson::Document copy;
    auto& a = copy.GetAllocator();
    auto messages = rec.FindMember("messages");
    rapidjson::Value converted(rapidjson::kArrayType);
    if (messages == rec.MemberEnd() && rec.HasMember("conversations")) {
      // sharegpt: {"from", "value"} turns, their roles renamed as axolotl and LLaMA-Factory rename them
      const rapidjson::Value& turns = rec["conversations"];
      if (!turns.IsArray())
        throw FileError(path, r.where + ": \"conversations\" must be a list of {\"from\", \"value\"}");
      for (const auto& t : turns.GetArray()) {
        if (!t.IsObject() || !t.HasMember("from") || !t["from"].IsString() || !t.HasMember("value"))
          throw FileError(path, r.where + ": every sharegpt turn needs a string \"from\" and a \"value\"");
        const std::string from = t["from"].GetString();
        const char* role = from == "human" || from == "user" ? "user"
                           : from == "gpt" || from == "assistant" ? "assistant"
                           : from == "system" ? "system"
                           : from == "tool" || from == "observation" ? "tool" : nullptr;
        if (!role)
          throw FileError(path, r.where + ": the sharegpt role \"" + from +
                                    "\" is not one memrt maps (human/user, gpt/assistant, system, tool/observation)");
        rapidjson::Value m(rapidjson::kObjectType);
        m.AddMember("role", rapidjson::StringRef(role), a);
        m.AddMember("content", rapidjson::Value(t["value"], a), a);
        converted.PushBack(m, a);
      }
    }
    const rapidjson::Value& list = messages != rec.MemberEnd() ? messages->value : converted;
    if (!list.IsArray() || list.Empty())
      throw FileError(path, r.where + ": a conversation needs a non-empty \"messages\" list of {\"role\", \"content\"}");
    for (const auto& m : list.GetArray()) {
      if (!m.IsObject() || !m.HasMember("role") || !m["role"].IsString())
        throw FileError(path, r.where + ": every message needs a string \"role\" (and its \"content\")");
      check_content(path, r.where, m);
    }
    const auto tools = rec.FindMember("tools");
    ChatTemplate::Rendered rendered =
        render(path, r.where, o, tok, list, tools == rec.MemberEnd() ? nullptr : &tools->value, false, 0);
    r.texts = {std::move(rendered.text)};
    r.generation = std::move(rendered.generation);
    return r;
  }
  if (o.type == RecordType::kAlpaca) {
    const std::string instruction = field(path, r.where, rec, "instruction", o.type, true);
    const std::string input = field(path, r.where, rec, "input", o.type, false);
    r.texts = {alpaca_prompt(instruction, input), field(path, r.where, rec, "output", o.type, true)};
  } else {  // TRL: the EOS token's text ends the completion unless it already does
    const std::string prompt = field(path, r.where, rec, "prompt", o.type, true);
    std::string completion = field(path, r.where, rec, "completion", o.type, true);
    if (tok.eos_token() && !ends_with(completion, tok.eos_token()->text)) completion += tok.eos_token()->text;
    r.texts = {prompt, prompt + completion};
  }
  return r;
}

std::vector<Record> read_records(const std::string& path, const RecordOptions& o, const Tokenizer& tok) {
  std::vector<Record> records;
  for_each_json_record(path, [&](std::string where, const rapidjson::Value& rec) {
    records.push_back(read_record(path, std::move(where), rec, o, tok));
  });
  return records;
}

// axolotl's PromptTokenizingStrategy._tokenize: the text with the special tokens, cut to max_length,
// EOS appended where it is not last and there is room, a leading BOS dropped on request.
std::vector<int32_t> axolotl_tokenize(std::vector<int32_t> ids, const Tokenizer& tok, int64_t max_length, bool add_eos,
                                      bool strip_bos) {
  if (static_cast<int64_t>(ids.size()) > max_length) ids.resize(static_cast<size_t>(max_length));
  if (add_eos && !ids.empty() && ids.back() != tok.eos_token()->id && static_cast<int64_t>(ids.size()) < max_length)
    ids.push_back(tok.eos_token()->id);
  if (strip_bos && !ids.empty() && tok.bos_token() && ids.front() == tok.bos_token()->id) ids.erase(ids.begin());
  return ids;
}

// axolotl's find_turn on a turn's two renderings, tokenized: the tokens [start, end) where they
// differ, compared from the front and from the back; (-1, -1) where they do not, or empty.
std::pair<int64_t, int64_t> find_turn(const std::vector<int32_t>& dummy, const std::vector<int32_t>& full) {
  if (dummy.empty() || full.empty()) return {-1, -1};
  const size_t n = std::min(dummy.size(), full.size());
  int64_t start = -1, end = -1;
  for (size_t i = 0; i < n && start < 0; ++i)
    if (dummy[i] != full[i]) start = static_cast<int64_t>(i);
  for (size_t i = 0; i < n && end < 0; ++i)
    if (dummy[dummy.size() - 1 - i] != full[full.size() - 1 - i]) end = static_cast<int64_t>(full.size() - i);
  if (start < 0 || end < 0 || end <= start) return {-1, -1};
  return {start, end};
}

// axolotl's _find_turn_from_text on a turn's span of the rendering: the tokens from the one whose
// offsets end past the span's start to the first that starts at or past its end; (-1, -1) for an
// empty span. (A span past the last token's trimmed end, where axolotl turns to its token diff,
// reads as not found: only a token whose trailing spaces trim_offsets cuts can end there.)
std::pair<int64_t, int64_t> find_turn(const Tokenizer::Offsets& offsets, std::pair<size_t, size_t> span) {
  const auto [begin, end] = span;
  if (end <= begin) return {-1, -1};
  const auto start = std::upper_bound(offsets.ends.begin(), offsets.ends.end(), begin) - offsets.ends.begin();
  const auto stop = std::lower_bound(offsets.starts.begin(), offsets.starts.end(), end) - offsets.starts.begin();
  if (static_cast<size_t>(start) >= offsets.ends.size() || stop <= start) return {-1, -1};
  return {start, stop};
}

// axolotl's get_offsets_for_train_detail: which tokens of `text`, tokenized alone as `ids`, lie whole
// inside a detail that trains — each token spanning the characters from its offset to the next
// token's, and each detail first widened to the tokens it touches (adjust_train_details).
std::vector<uint8_t> detail_tokens(const Tokenizer& tok, const std::vector<int32_t>& ids, const std::string& text,
                                   const std::vector<Detail>& details) {
  const auto n = static_cast<int64_t>(ids.size());
  std::vector<uint8_t> trained(ids.size(), 0);
  if (n == 0) return trained;
  const Tokenizer::Offsets offsets = tok.token_offsets(ids, text);
  std::vector<int64_t> begin(ids.size()), end(ids.size());  // characters, end included
  for (int64_t i = 0; i < n; ++i)
    begin[static_cast<size_t>(i)] = code_points(std::string_view(text).substr(0, offsets.starts[static_cast<size_t>(i)]));
  for (int64_t i = 0; i + 1 < n; ++i) end[static_cast<size_t>(i)] = begin[static_cast<size_t>(i) + 1] - 1;
  end.back() = code_points(text) - 1;
  auto at = [](const std::vector<int64_t>& v, int64_t i) { return v[static_cast<size_t>(i)]; };
  for (const Detail& d : details) {
    int64_t first = 0, last = n - 1;
    while (first < n && at(begin, first) < d.begin) ++first;
    if (first > 0 && at(end, first - 1) > d.begin) --first;
    while (last >= 0 && at(end, last) > d.end) --last;
    if (last < n - 1 && at(begin, last + 1) < d.end) ++last;
    if (first > last || !d.train) continue;
    const int64_t from = at(begin, first), to = at(end, last);
    for (int64_t i = 0; i < n; ++i)
      if (at(begin, i) >= from && at(end, i) <= to) trained[static_cast<size_t>(i)] = 1;
  }
  return trained;
}

// axolotl's find_first_eot_token / find_first_eos_token: the first of `ids` from `from` on that is one
// of `targets`, -1 for none — as Python's range(from, len) reads it: from -1 (a turn not found)
// looks at the last token first, and finding it there reads as not found.
int64_t find_first(const std::vector<int32_t>& ids, int64_t from, const std::vector<int32_t>& targets) {
  auto is_target = [&](int32_t id) { return std::find(targets.begin(), targets.end(), id) != targets.end(); };
  if (from < 0 && !ids.empty() && is_target(ids.back())) return -1;
  for (size_t i = static_cast<size_t>(std::max<int64_t>(from, 0)); i < ids.size(); ++i)
    if (is_target(ids[i])) return static_cast<int64_t>(i);
  return -1;
}

// axolotl's _validate_eot_and_eos_tokens: the ids of the tokens that end a turn — the EOS token by
// default; given ones that the template never writes are left out (axolotl warns), each of the
// others must be one token, and the EOS among them must train as the EOT does.
std::vector<int32_t> turn_end_tokens(const std::string& path, const Tokenizer& tok, const RecordOptions& o,
                                     std::vector<std::string>& notes) {
  const std::optional<Tokenizer::SpecialToken>& eos = tok.eos_token();
  std::vector<std::string> names = o.eot_tokens ? *o.eot_tokens : std::vector<std::string>{};
  if (!o.eot_tokens && eos) names = {eos->text};
  std::vector<int32_t> ids;
  if (eos && names.size() == 1 && names[0] == eos->text) return {eos->id};
  bool has_eos = false;
  for (const std::string& name : names) {
    if (o.chat_template->source().find(name) == std::string::npos) {
      notes.push_back("eot_tokens: the chat template never writes \"" + name + "\", so it ends no turn (as in axolotl)");
      continue;
    }
    const std::vector<int32_t> one = tok.encode(name, /*add_special_tokens=*/false);
    if (one.size() != 1)
      throw FileError(path, "eot_tokens: \"" + name + "\" is " + std::to_string(one.size()) +
                                " tokens for this tokenizer; a token that ends a turn must be one (an added token of "
                                "tokenizer.json)");
    ids.push_back(one[0]);
    has_eos = has_eos || (eos && name == eos->text);
  }
  const std::string eot_mode = o.chat.train_on_eot.value_or(o.chat.train_on_eos);
  if (has_eos && o.chat.train_on_eos != eot_mode)
    throw FileError(path, "the EOS token is one of eot_tokens, and train_on_eos (\"" + o.chat.train_on_eos +
                              "\") and train_on_eot (\"" + eot_mode + "\") differ: give them the same value");
  return ids;
}

// axolotl's ChatTemplateStrategy._tokenize_single_prompt, on the tokenized texts of read_axolotl_conversation:
// the conversation's ids, trained where a trained turn's tokens are, and the EOT/EOS token ending each
// turn (within 3 tokens of it) as train_on_eot/train_on_eos say.
void axolotl_labels(const std::string& path, const Record& rec, const std::vector<std::vector<int32_t>>& encoded,
                    size_t first, const RecordOptions& o, const Tokenizer& tok, const std::vector<int32_t>& eot,
                    const std::vector<int32_t>& eos, std::vector<int32_t>& ids, std::vector<uint8_t>& labels) {
  if (rec.legacy) {  // the prompt's ids, then the whole's past them; trained past the prompt
    const std::vector<int32_t>& prompt = encoded[first];
    const std::vector<int32_t>& full = encoded[first + 1];
    ids = prompt;
    if (full.size() > prompt.size()) ids.insert(ids.end(), full.begin() + static_cast<std::ptrdiff_t>(prompt.size()), full.end());
    labels.assign(ids.size(), 1);
    if (!o.train_on_prompt) std::fill(labels.begin(), labels.begin() + static_cast<std::ptrdiff_t>(prompt.size()), 0);
    return;
  }
  ids = encoded[first];
  labels.assign(ids.size(), 0);
  const std::string eot_mode = o.chat.train_on_eot.value_or(o.chat.train_on_eos);
  int64_t last_eot = -1, last_eos = -1;
  const auto n = static_cast<int64_t>(ids.size());
  std::optional<Tokenizer::Offsets> offsets;  // of the rendering's tokens, for the turns located in it
  for (const Turn& turn : rec.turns) {
    if (turn.span && !offsets) {
      try {
        offsets = tok.token_offsets(ids, rec.texts[0]);
      } catch (const Error& e) {
        throw FileError(path, rec.where + ": " + e.what());
      }
    }
    const auto [start, end] = turn.span ? find_turn(*offsets, *turn.span)
                                        : find_turn(encoded[first + turn.dummy], encoded[first + turn.dummy + 1]);
    // training_detail: the text's own tokens that train, laid from where its span starts
    auto train_detail = [&](int64_t from, size_t text, const std::vector<Detail>& detail) {
      try {
        const std::vector<uint8_t> trained = detail_tokens(tok, encoded[first + text], rec.texts[text], detail);
        for (size_t i = 0; i < trained.size() && from + static_cast<int64_t>(i) < n; ++i)
          if (trained[i]) labels[static_cast<size_t>(from) + i] = 1;
      } catch (const Error& e) {
        throw FileError(path, rec.where + ": training_detail: " + e.what());
      }
    };
    if (turn.trains && start >= 0) {
      if (!turn.detail.empty())
        train_detail(start, turn.content_text, turn.detail);
      else if (turn.reasoning_detail.empty())
        for (int64_t i = start; i < std::min(end, n); ++i) labels[static_cast<size_t>(i)] = 1;
    }
    if (turn.trains && !turn.reasoning_detail.empty())
      if (const auto [from, to] = find_turn(*offsets, *turn.reasoning_span); from >= 0)
        train_detail(from, turn.reasoning_text, turn.reasoning_detail);
    for (auto [targets, mode, last] : {std::tuple{&eot, &eot_mode, &last_eot}, std::tuple{&eos, &o.chat.train_on_eos, &last_eos}}) {
      const int64_t at = find_first(ids, end, *targets);
      if (at < 0 || std::abs(at - end) > 3) continue;
      *last = at;
      if (*mode == "all" || (*mode == "turn" && turn.trains)) labels[static_cast<size_t>(at)] = 1;
    }
  }
  for (auto [mode, last] : {std::pair{&eot_mode, last_eot}, std::pair{&o.chat.train_on_eos, last_eos}})
    if (*mode == "last" && last >= 0) labels[static_cast<size_t>(last)] = 1;
}

}  // namespace

void tokenize_records(const std::string& path, const Tokenizer& tok, const RecordOptions& o, TokenizedRecords& out,
                      int threads) {
  if (o.type == RecordType::kLlamaFactory) return tokenize_llamafactory(path, tok, o, out, threads);
  const bool chat = o.type == RecordType::kMessages || o.type == RecordType::kChatTemplate;
  if (chat && !o.chat_template) throw Error("tokenize_records: conversations need the model's chat template");
  if (o.type == RecordType::kMessages && o.assistant_only && !o.chat_template->has_generation())
    throw FileError(path, "assistant_only_loss needs the chat template to mark the assistant's text with "
                          "{% generation %} ... {% endgeneration %} (as TRL requires); this one has no such block: use a "
                          "template that has them, or leave assistant_only_loss out to train on every token");
  if (!chat && !tok.eos_token())
    throw FileError(path, std::string(record_type_name(o.type)) +
                              " records end with the EOS token, and the tokenizer has none: name it as "
                              "tokenizer_config.json's \"eos_token\" beside the tokenizer");
  const std::vector<int32_t> eot = o.type == RecordType::kChatTemplate ? turn_end_tokens(path, tok, o, out.notes)
                                                                      : std::vector<int32_t>{};
  std::vector<int32_t> eos;  // the EOS token's id, where the tokenizer has one
  if (tok.eos_token()) eos.push_back(tok.eos_token()->id);
  const std::vector<Record> records = read_records(path, o, tok);
  std::vector<std::string_view> docs;
  std::vector<size_t> first_text;  // record k's texts are docs[first_text[k]...]
  for (const Record& r : records) {
    first_text.push_back(docs.size());
    for (const std::string& t : r.texts) docs.emplace_back(t);
  }
  std::vector<std::vector<int32_t>> encoded;
  try {  // apply_chat_template tokenizes the rendering without adding special tokens
    ProgressCounter progress("tokenizing " + path + " ", Tokenizer::text_bytes(docs), /*show=*/true);
    encoded = tok.encode_batch(docs, /*add_special_tokens=*/!chat, threads,
                               [&](size_t bytes) { progress.add(static_cast<int64_t>(bytes)); });
  } catch (const std::exception& e) {
    throw FileError(path, std::string("cannot be tokenized: ") + e.what());
  }
  for (size_t k = 0; k < records.size(); ++k) {
    std::vector<int32_t> ids;
    std::vector<uint8_t> labels;
    std::vector<int32_t>& first = encoded[first_text[k]];
    std::vector<int32_t>& second = encoded[first_text[k] + records[k].texts.size() - 1];
    if (o.type == RecordType::kChatTemplate) {
      axolotl_labels(path, records[k], encoded, first_text[k], o, tok, eot, eos, ids, labels);
      if (static_cast<int64_t>(ids.size()) > o.max_length) {  // axolotl drops what does not fit
        ++out.dropped;
        continue;
      }
    } else if (chat) {  // every token, or TRL's assistant mask: the tokens from the one holding a span's
                        // first byte to the one holding its last (transformers' char_to_token)
      ids = std::move(first);
      labels.assign(ids.size(), o.assistant_only ? 0 : 1);
      if (o.assistant_only) {
        std::vector<size_t> ends;
        try {
          ends = tok.token_offsets(ids, records[k].texts[0]).ends;
        } catch (const Error& e) {
          throw FileError(path, records[k].where + ": assistant_only_loss: " + e.what());
        }
        auto token_at = [&](size_t byte) {
          return static_cast<size_t>(std::upper_bound(ends.begin(), ends.end(), byte) - ends.begin());
        };
        for (const auto& [b, e] : records[k].generation) {
          if (e <= b) continue;
          for (size_t t = token_at(b), last = token_at(e - 1); t <= last && t < labels.size(); ++t) labels[t] = 1;
        }
      }
    } else if (o.type == RecordType::kAlpaca) {  // InstructionPromptTokenizingStrategy.tokenize_prompt
      ids = axolotl_tokenize(std::move(first), tok, o.max_length, /*add_eos=*/false, /*strip_bos=*/false);
      labels.assign(ids.size(), o.train_on_prompt ? 1 : 0);
      const std::vector<int32_t> response = axolotl_tokenize(std::move(second), tok, o.max_length, true, true);
      ids.insert(ids.end(), response.begin(), response.end());
      labels.resize(ids.size(), 1);
      if (static_cast<int64_t>(ids.size()) > o.max_length) {  // axolotl drops what does not fit
        ++out.dropped;
        continue;
      }
    } else {  // SFTTrainer's tokenize, then truncate_dataset
      ids = std::move(second);
      const size_t prompt = std::min(first.size(), ids.size());
      labels.assign(ids.size(), 1);
      if (!o.train_on_prompt) std::fill(labels.begin(), labels.begin() + static_cast<std::ptrdiff_t>(prompt), 0);
    }
    if ((o.type == RecordType::kPromptCompletion || o.type == RecordType::kMessages) &&
        static_cast<int64_t>(ids.size()) > o.max_length) {  // TRL's truncate_dataset
      ids.resize(static_cast<size_t>(o.max_length));
      labels.resize(ids.size());
      ++out.truncated;
    }
    // A sample needs one prediction to train on (axolotl drops the others too).
    bool trains = false;
    for (size_t i = 1; i < labels.size() && !trains; ++i) trains = labels[i] != 0;
    if (!trains) {
      ++out.dropped;
      continue;
    }
    for (int32_t id : ids) out.ids.push_back(static_cast<uint32_t>(id));
    out.labels.insert(out.labels.end(), labels.begin(), labels.end());
    out.offsets.push_back(static_cast<int64_t>(out.ids.size()));
    out.sample_records.push_back(out.records + static_cast<int64_t>(k));
  }
  out.records += static_cast<int64_t>(records.size());
}

}  // namespace memrt
