#include "data/records.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <string_view>

#include <rapidjson/document.h>
#include <rapidjson/error/en.h>

#include "data/chat_template.h"
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
  }
  return "?";
}

namespace {

// The texts one record is tokenized from, and where it is in its file ("line 3", "record 3");
// a conversation's one text is its rendering, with the byte spans of its generation blocks.
struct Record {
  std::string where;
  std::vector<std::string> texts;
  std::vector<std::pair<size_t, size_t>> generation;
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

Record read_record(const std::string& path, std::string where, const rapidjson::Value& rec, const RecordOptions& o,
                   const Tokenizer& tok) {
  if (!rec.IsObject())
    throw FileError(path, where + ": expected a JSON object (a " + record_type_name(o.type) + " record)");
  Record r{std::move(where), {}, {}};
  if (o.type == RecordType::kMessages) {  // TRL: apply_chat_template(messages, tools=record's tools)
    rapidjson::Document vars(rapidjson::kObjectType);
    auto& a = vars.GetAllocator();
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
      if (m.HasMember("content") && m["content"].IsString()) {
        const std::string content(m["content"].GetString(), m["content"].GetStringLength());
        if (const std::optional<size_t> bad = first_invalid_utf8(content))
          throw FileError(path, r.where + ": a message's \"content\" is not valid UTF-8 (byte " + std::to_string(*bad) +
                                    "); convert the file (e.g. iconv -t UTF-8)");
      }
    }
    vars.AddMember("messages", rapidjson::Value(list, a), a);
    const auto tools = rec.FindMember("tools");
    vars.AddMember("tools", tools == rec.MemberEnd() ? rapidjson::Value() : rapidjson::Value(tools->value, a), a);
    vars.AddMember("add_generation_prompt", false, a);
    for (const auto& [name, token] : {std::pair<const char*, const std::optional<Tokenizer::SpecialToken>*>{"bos_token", &tok.bos_token()},
                                      {"eos_token", &tok.eos_token()}})
      if (*token) vars.AddMember(rapidjson::StringRef(name), rapidjson::Value((*token)->text.c_str(), a), a);
    ChatTemplate::Rendered rendered;
    try {
      rendered = o.chat_template->render(vars);
    } catch (const Error& e) {
      throw FileError(path, r.where + ": " + e.what());
    }
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
  const MappedFile file(path);
  const char* p = reinterpret_cast<const char*>(file.data());
  const char* end = p + file.size();
  std::vector<Record> records;
  if (ends_with(path, ".json")) {  // one array of records
    rapidjson::Document doc;
    doc.Parse(p, file.size());
    if (doc.HasParseError())
      throw FileError(path, std::string("invalid JSON (") + rapidjson::GetParseError_En(doc.GetParseError()) +
                                " at byte " + std::to_string(doc.GetErrorOffset()) + "); expected an array of records");
    if (!doc.IsArray()) throw FileError(path, "expected a JSON array of records (or a .jsonl file, one per line)");
    for (rapidjson::SizeType i = 0; i < doc.Size(); ++i)
      records.push_back(read_record(path, "record " + std::to_string(i + 1), doc[i], o, tok));
    return records;
  }
  for (int64_t line = 1; p < end; ++line) {
    const char* eol = static_cast<const char*>(std::memchr(p, '\n', static_cast<size_t>(end - p)));
    if (!eol) eol = end;
    const char* first = p;
    while (first < eol && (*first == ' ' || *first == '\t' || *first == '\r')) ++first;
    if (first < eol) {  // blank lines are skipped
      rapidjson::Document doc;
      doc.Parse(first, static_cast<size_t>(eol - first));
      const std::string where = "line " + std::to_string(line);
      if (doc.HasParseError())
        throw FileError(path, where + ": invalid JSON (" + rapidjson::GetParseError_En(doc.GetParseError()) +
                                  "); expected one record per line");
      records.push_back(read_record(path, where, doc, o, tok));
    }
    p = eol + 1;
  }
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

}  // namespace

void tokenize_records(const std::string& path, const Tokenizer& tok, const RecordOptions& o, TokenizedRecords& out,
                      int threads) {
  const bool chat = o.type == RecordType::kMessages;
  if (chat && !o.chat_template) throw Error("tokenize_records: conversations need the model's chat template");
  if (chat && o.assistant_only && !o.chat_template->has_generation())
    throw FileError(path, "assistant_only_loss needs the chat template to mark the assistant's text with "
                          "{% generation %} ... {% endgeneration %} (as TRL requires); this one has no such block: use a "
                          "template that has them, or leave assistant_only_loss out to train on every token");
  if (!chat && !tok.eos_token())
    throw FileError(path, std::string(record_type_name(o.type)) +
                              " records end with the EOS token, and the tokenizer has none: name it as "
                              "tokenizer_config.json's \"eos_token\" beside the tokenizer");
  const std::vector<Record> records = read_records(path, o, tok);
  std::vector<std::string_view> docs;
  for (const Record& r : records)
    for (const std::string& t : r.texts) docs.emplace_back(t);
  std::vector<std::vector<int32_t>> encoded;
  try {  // apply_chat_template tokenizes the rendering without adding special tokens
    ProgressCounter progress("tokenizing " + path + " ", Tokenizer::text_bytes(docs), /*show=*/true);
    encoded = tok.encode_batch(docs, /*add_special_tokens=*/!chat, threads,
                               [&](size_t bytes) { progress.add(static_cast<int64_t>(bytes)); });
  } catch (const std::exception& e) {
    throw FileError(path, std::string("cannot be tokenized: ") + e.what());
  }
  const size_t texts = chat ? 1 : 2;
  for (size_t k = 0; k < records.size(); ++k) {
    std::vector<int32_t> ids;
    std::vector<uint8_t> labels;
    std::vector<int32_t>& first = encoded[texts * k];
    std::vector<int32_t>& second = encoded[texts * k + texts - 1];
    if (chat) {  // every token, or TRL's assistant mask: the tokens from the one holding a span's
                 // first byte to the one holding its last (transformers' char_to_token)
      ids = std::move(first);
      labels.assign(ids.size(), o.assistant_only ? 0 : 1);
      if (o.assistant_only) {
        std::vector<size_t> ends;
        try {
          ends = tok.token_ends(ids, records[k].texts[0]);
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
    if (o.type != RecordType::kAlpaca && static_cast<int64_t>(ids.size()) > o.max_length) {  // TRL's truncate_dataset
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
  }
  out.records += static_cast<int64_t>(records.size());
}

}  // namespace memrt
