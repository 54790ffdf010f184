// Fine-tuning records (data/records.h, docs/tokenizers.md "Datasets") against what the tools train
// on, computed at test time with transformers' tokenizer (sft_records.py): axolotl's type: alpaca
// and TRL's prompt-completion records, with and without the prompt's tokens in the loss, on
// tokenizers of the Llama-3 (byte-level, BOS by its post-processor) and Llama-2 (sentencepiece-style
// BPE) kinds; then the samples as the loader batches them, and bad records named by file and line.
#include <gtest/gtest.h>

#include <rapidjson/document.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "config/load_config.h"
#include "data/chat_template.h"
#include "data/dataset.h"
#include "data/llamafactory.h"
#include "data/numpy_random.h"
#include "data/records.h"
#include "data/tokenizer.h"
#include "memrt/error.h"
#include "test_util.h"

using namespace memrt;
using memrt::test::expect_error;
using memrt::test::read_json;

namespace {

template <typename T>
std::vector<std::vector<T>> lists_of(const rapidjson::Value& v) {
  std::vector<std::vector<T>> out;
  for (const auto& row : v.GetArray()) {
    out.emplace_back();
    for (const auto& x : row.GetArray()) out.back().push_back(static_cast<T>(x.GetInt()));
  }
  return out;
}

// The samples of `r` as lists, to compare with the oracle's.
void split(const TokenizedRecords& r, std::vector<std::vector<uint32_t>>& ids, std::vector<std::vector<uint8_t>>& labels) {
  for (size_t k = 0; k + 1 < r.offsets.size(); ++k) {
    ids.emplace_back(r.ids.begin() + r.offsets[k], r.ids.begin() + r.offsets[k + 1]);
    labels.emplace_back(r.labels.begin() + r.offsets[k], r.labels.begin() + r.offsets[k + 1]);
  }
}

// A JSON value as text (YAML reads JSON: the tests write train.yaml files this way).
std::string json_text(const rapidjson::Value& v) {
  rapidjson::StringBuffer text;
  rapidjson::Writer<rapidjson::StringBuffer> w(text);
  v.Accept(w);
  return text.GetString();
}

// The samples of `d` against the oracle's {"ids": [[...]...], "labels": [[0|1...]...]}: their
// tokens, and which of them trained() marks.
void expect_samples(const TokenDataset& d, const rapidjson::Value& want) {
  const auto ids = lists_of<int64_t>(want["ids"]);
  const auto labels = lists_of<int>(want["labels"]);
  ASSERT_EQ(d.num_samples(), static_cast<int64_t>(ids.size())) << d.description();
  for (int64_t k = 0; k < d.num_samples(); ++k) {
    std::vector<int64_t> got(static_cast<size_t>(d.sample_length(k)));
    d.copy_tokens(d.sample_begin(k), d.sample_length(k), got.data());
    EXPECT_EQ(got, ids[static_cast<size_t>(k)]) << "sample " << k;
    std::vector<int> trained;
    for (int64_t i = 0; i < d.sample_length(k); ++i) trained.push_back(d.trained(d.sample_begin(k) + i) ? 1 : 0);
    EXPECT_EQ(trained, labels[static_cast<size_t>(k)]) << "sample " << k;
  }
}

// The run a train.yaml holding `text` (written as dir/`name`) configures, its records read with
// `tokenizer` in samples of `block_size` tokens, cached in dir/cache.
TrainConfig load_records(const memrt::test::TempDir& dir, const std::string& name, const std::string& text,
                         const std::string& tokenizer, int64_t block_size) {
  const std::string path = dir.file(name);
  std::ofstream(path) << text;
  ConfigSources sources;
  sources.train_yaml_path = path;
  TrainConfig cfg = load_train_config(sources);
  cfg.data.tokenizer = tokenizer;
  cfg.data.cache_dir = dir.file("cache");
  cfg.data.block_size = block_size;
  return cfg;
}

struct Fixture {
  memrt::test::TempDir dir;
  bool made = memrt::test::run_reference("hf_tokenizers.py", dir.file("tok")) &&
              memrt::test::run_reference("sft_records.py", dir.str() + " " + dir.file("tok/llama3") + " " +
                                                               dir.file("tok/llama2"));
};

}  // namespace

TEST(Records, TokenizeAsAxolotlAndTrlDo) {
  Fixture f;
  ASSERT_TRUE(f.made);
  for (const char* kind : {"llama3", "llama2"}) {
    const Tokenizer tok = Tokenizer::from_file(f.dir.file(std::string("tok/") + kind + "/tokenizer.json"));
    const rapidjson::Document want = read_json(f.dir.file(std::string("tok/") + kind + "/sft.json"));
    ASSERT_TRUE(tok.eos_token() && tok.bos_token()) << kind;
    for (RecordType type : {RecordType::kAlpaca, RecordType::kPromptCompletion}) {
      for (bool train_on_prompt : {false, true}) {
        const std::string key = std::string(record_type_name(type)) + " " + (train_on_prompt ? "1" : "0");
        SCOPED_TRACE(std::string(kind) + ", " + key);
        const rapidjson::Value& w = want[key.c_str()];
        const std::string data = f.dir.file(type == RecordType::kAlpaca ? "alpaca.jsonl" : "prompt_completion.jsonl");
        RecordOptions o{type, want["max_length"].GetInt64(), train_on_prompt};
        TokenizedRecords got;
        tokenize_records(data, tok, o, got, /*threads=*/2);
        std::vector<std::vector<uint32_t>> ids;
        std::vector<std::vector<uint8_t>> labels;
        split(got, ids, labels);
        EXPECT_EQ(ids, lists_of<uint32_t>(w["ids"]));
        EXPECT_EQ(labels, lists_of<uint8_t>(w["labels"]));
        EXPECT_EQ(got.dropped, w["dropped"].GetInt64());
        EXPECT_EQ(got.truncated, w["truncated"].GetInt64());
        EXPECT_EQ(got.records, type == RecordType::kAlpaca ? 8 : 7);
        if (type == RecordType::kAlpaca) {  // the same records as one JSON array
          TokenizedRecords array;
          tokenize_records(f.dir.file("alpaca.json"), tok, o, array, 1);
          EXPECT_EQ(array.ids, got.ids);
          EXPECT_EQ(array.labels, got.labels);
          EXPECT_EQ(array.offsets, got.offsets);
        }
      }
    }
  }
}

// Conversations (TRL's "messages", with a record's tools) rendered with the model's chat template
// (chat_template.jinja beside the tokenizer) and tokenized as apply_chat_template tokenizes them:
// every token trained, or with assistant_only_loss the tokens of the template's generation blocks
// (return_assistant_tokens_mask); cut to max_length. A template that refuses a conversation, or
// assistant_only_loss without generation blocks, is an error naming the file and line.
TEST(Records, ConversationsTokenizeAsTrlDoes) {
  Fixture f;
  ASSERT_TRUE(f.made);
  const rapidjson::Document want = read_json(f.dir.file("tok/llama3/sft.json"));
  for (bool assistant_only : {false, true}) {
    SCOPED_TRACE(assistant_only ? "assistant_only_loss" : "every token");
    DataConfig cfg;
    cfg.train_files = {f.dir.file("messages.jsonl")};
    cfg.tokenizer = f.dir.file("tok/llama3/tokenizer.json");
    cfg.cache_dir = f.dir.file("cache");
    cfg.block_size = want["max_length"].GetInt64();
    cfg.assistant_only = assistant_only;
    const rapidjson::Value& w = want[assistant_only ? "messages 1" : "messages 0"];
    const auto ids = lists_of<int64_t>(w["ids"]);
    const auto labels = lists_of<int>(w["labels"]);
    const std::shared_ptr<TokenDataset> d = TokenDataset::open(cfg);
    EXPECT_NE(d->description().find("5 records, " + std::to_string(ids.size()) + " samples"), std::string::npos)
        << d->description();
    EXPECT_NE(d->description().find("3 records cut to block_size"), std::string::npos) << d->description();
    ASSERT_EQ(d->num_samples(), static_cast<int64_t>(ids.size()));
    for (int64_t k = 0; k < d->num_samples(); ++k) {
      std::vector<int64_t> got(static_cast<size_t>(d->sample_length(k)));
      d->copy_tokens(d->sample_begin(k), d->sample_length(k), got.data());
      EXPECT_EQ(got, ids[k]) << k;
      std::vector<int> mask;
      for (int64_t i = 0; i < d->sample_length(k); ++i) mask.push_back(d->trained(d->sample_begin(k) + i));
      EXPECT_EQ(mask, labels[k]) << k;
    }
  }
  // The same conversations in sharegpt's shape (from/value, human/gpt): the same samples.
  {
    std::ofstream out(f.dir.file("sharegpt.json"));
    out << R"([{"conversations": [{"from": "human", "value": "Hello!"}, {"from": "gpt", "value": "Hi there."}]},)"
        << R"( {"conversations": [{"from": "system", "value": "You are terse."}, {"from": "human", "value": "2+2?"},)"
        << R"( {"from": "gpt", "value": " 4 "}, {"from": "human", "value": "和 3+3？ 👍🏽"}, {"from": "gpt", "value": "6"}]}])";
  }
  DataConfig sharegpt;
  sharegpt.train_files = {f.dir.file("sharegpt.json")};
  sharegpt.tokenizer = f.dir.file("tok/llama3/tokenizer.json");
  sharegpt.cache_dir = f.dir.file("cache");
  sharegpt.block_size = want["max_length"].GetInt64();
  const std::shared_ptr<TokenDataset> sg = TokenDataset::open(sharegpt);
  const auto first_two = lists_of<int64_t>(want["messages 0"]["ids"]);
  ASSERT_EQ(sg->num_samples(), 2);
  for (int64_t k = 0; k < 2; ++k) {
    std::vector<int64_t> got(static_cast<size_t>(sg->sample_length(k)));
    sg->copy_tokens(sg->sample_begin(k), sg->sample_length(k), got.data());
    EXPECT_EQ(got, first_two[static_cast<size_t>(k)]) << k;
  }
  // A template given as its source in train.yaml (alignment-handbook's chat_template) renders instead
  // of the model's.
  DataConfig given = sharegpt;
  given.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
  given.chat_template_where = "train.yaml: chat_template";
  const std::shared_ptr<TokenDataset> plain = TokenDataset::open(given);
  const std::vector<int32_t> hello =
      Tokenizer::from_file(given.tokenizer).encode("user: Hello!\nassistant: Hi there.\n", /*add_special_tokens=*/false);
  ASSERT_EQ(plain->sample_length(0), static_cast<int64_t>(hello.size()));
  std::vector<int64_t> got(hello.size());
  plain->copy_tokens(plain->sample_begin(0), plain->sample_length(0), got.data());
  EXPECT_EQ(got, std::vector<int64_t>(hello.begin(), hello.end()));
  given.chat_template = "{% for m in messages %}{{ m.role }";
  expect_error<FileError>([&] { TokenDataset::open(given); }, {"train.yaml: chat_template", "line 1"});
  // Mistral's template refuses the tool conversation (line 3), as it does in transformers.
  DataConfig mistral;
  mistral.train_files = {f.dir.file("messages.jsonl")};
  mistral.tokenizer = f.dir.file("tok/llama2/tokenizer.json");
  mistral.cache_dir = f.dir.file("cache");
  mistral.block_size = 256;
  expect_error<FileError>([&] { TokenDataset::open(mistral); },
                          {"messages.jsonl", "line 3", "chat_template.jinja", "roles must alternate"});
  // Its template has no generation blocks: assistant_only_loss cannot be honoured.
  std::ofstream(f.dir.file("one.jsonl")) << R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})" << "\n";
  mistral.train_files = {f.dir.file("one.jsonl")};
  mistral.assistant_only = true;
  expect_error<FileError>([&] { TokenDataset::open(mistral); }, {"one.jsonl", "assistant_only_loss", "{% generation %}"});
  // assistant_only_loss on records that are not conversations.
  mistral.train_files = {f.dir.file("prompt_completion.jsonl")};
  expect_error<FileError>([&] { TokenDataset::open(mistral); }, {"prompt_completion.jsonl", "assistant_only_loss", "conversations"});
}

// Records opened as a dataset: cached with their masks and boundaries (the cache gives the same
// samples), batched as one sample per row, right-padded to the longest with -100 targets, targets
// -100 where the label mask leaves the prediction out; the step's label count is what the loss is
// averaged over.
TEST(Records, BatchPerSampleWithTheirMasks) {
  Fixture f;
  ASSERT_TRUE(f.made);
  const rapidjson::Document want = read_json(f.dir.file("tok/llama3/sft.json"));
  const auto ids = lists_of<int64_t>(want["alpaca 0"]["ids"]);
  const auto labels = lists_of<int>(want["alpaca 0"]["labels"]);
  const int64_t max_length = want["max_length"].GetInt64();
  DataConfig cfg;
  cfg.datasets = {{f.dir.file("alpaca.jsonl"), "alpaca"}};
  cfg.tokenizer = f.dir.file("tok/llama3/tokenizer.json");
  cfg.cache_dir = f.dir.file("cache");
  cfg.block_size = max_length;
  for (const char* from : {"; cached in ", ", from the cache "}) {
    const std::shared_ptr<TokenDataset> d = TokenDataset::open(cfg);
    EXPECT_NE(d->description().find(from), std::string::npos) << d->description();
    EXPECT_NE(d->description().find("8 records, 6 samples"), std::string::npos) << d->description();
    ASSERT_EQ(d->num_samples(), static_cast<int64_t>(ids.size()));
    for (int64_t k = 0; k < d->num_samples(); ++k) {
      ASSERT_EQ(d->sample_length(k), static_cast<int64_t>(ids[k].size()));
      std::vector<int64_t> got(ids[k].size());
      d->copy_tokens(d->sample_begin(k), d->sample_length(k), got.data());
      EXPECT_EQ(got, ids[k]) << k;
      for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(d->trained(d->sample_begin(k) + i), labels[k][i] != 0);
    }
    // Samples 1 and 3 in one batch: each row its sample, padded to the longer of the two.
    const Batch b = sample_batch(*d, {1, 3});
    const int64_t T = std::max(ids[1].size(), ids[3].size());
    ASSERT_EQ(b.inputs.sizes(), (std::vector<int64_t>{2, T}));
    EXPECT_EQ(b.tokens, static_cast<int64_t>(ids[1].size() + ids[3].size()));
    int64_t counted = 0;
    for (int row = 0; row < 2; ++row) {
      const size_t k = row == 0 ? 1 : 3;
      for (int64_t t = 0; t < T; ++t) {
        const bool real = t < static_cast<int64_t>(ids[k].size());
        EXPECT_EQ(b.inputs[row][t].item<int64_t>(), real ? ids[k][t] : 0);
        const bool trained = t + 1 < static_cast<int64_t>(ids[k].size()) && labels[k][t + 1];
        EXPECT_EQ(b.targets[row][t].item<int64_t>(), trained ? ids[k][t + 1] : -100) << row << " " << t;
        counted += trained;
      }
    }
    EXPECT_EQ(counted, d->sample_labels(1) + d->sample_labels(3));
    EXPECT_EQ(sample_batch(*d, {1}, max_length).inputs.size(1), max_length) << "pad_to_sequence_len";
    // A loader of 2 ranks x 1 accumulation x 1 sample: a step's label count covers both ranks' samples.
    DataLoader r0(d, max_length, 1, 1, 0, 2, 7), r1(d, max_length, 1, 1, 1, 2, 7);
    EXPECT_EQ(r0.steps_per_epoch(), 3);
    for (int64_t step = 0; step < 3; ++step) {
      const Batch a = r0.get(step, 0), c = r1.get(step, 0);
      const int64_t n = a.targets.ne(-100).sum().item<int64_t>() + c.targets.ne(-100).sum().item<int64_t>();
      EXPECT_EQ(r0.step_labels(step), n);
      EXPECT_EQ(r1.step_labels(step), n);
      EXPECT_EQ(a.inputs.size(1), a.tokens) << "one sample, not padded";
    }
  }
  // Training on the prompt too is another cache entry, with more labels.
  const int64_t response_only = TokenDataset::open(cfg)->sample_labels(0);
  cfg.train_on_prompt = true;
  const std::shared_ptr<TokenDataset> all = TokenDataset::open(cfg);
  EXPECT_NE(all->description().find("; cached in "), std::string::npos) << all->description();
  EXPECT_EQ(all->sample_labels(0), all->sample_length(0) - 1);
  EXPECT_GT(all->sample_labels(0), response_only);
}

// axolotl's type: chat_template datasets as a user writes them — train.yaml's dataset entry and run
// keys, read by the loader — against axolotl's algorithm run on transformers' apply_chat_template
// (sft_records.py, CHAT_CASES): the default (the assistant's turns, the EOS after each), eot_tokens
// with train_on_eos turn, all and last, roles_to_train, train_on_inputs, a message_field_training
// flag overriding the role, the legacy path, and sharegpt records through message_property_mappings
// and roles with drop_system_message; tool calls and tools given as JSON strings, a system field,
// a conversation too long (dropped) and one with nothing to train (dropped); axolotl's qwen3 template
// by name, split_thinking (each thinking pair, a solution pair, Unicode whitespace stripped as Python
// strips it), field_thinking, chat_template_kwargs in the legacy path's generation prompt, and
// content (and reasoning) given as lists of parts, joined as axolotl joins them; training_detail
// (message_field_training_detail, parts' train and weight) training characters of a message.
TEST(Records, AxolotlChatTemplateDatasetsTokenizeAsAxolotlDoes) {
  Fixture f;
  ASSERT_TRUE(f.made);
  const rapidjson::Document want = read_json(f.dir.file("tok/llama3/sft.json"));
  const rapidjson::Value& cases = want["chat_template cases"];
  ASSERT_EQ(cases.MemberCount(), 17u);
  for (const auto& c : cases.GetObject()) {
    const std::string name = c.name.GetString();
    SCOPED_TRACE(name);
    // train.yaml, written as JSON (which YAML reads): datasets: [{path, type: chat_template, ...}] + run keys.
    rapidjson::Document yaml(rapidjson::kObjectType);
    auto& a = yaml.GetAllocator();
    rapidjson::Value entry(c.value["dataset"], a);
    entry.AddMember("path", rapidjson::Value(f.dir.file(c.value["file"].GetString()).c_str(), a), a);
    entry.AddMember("type", "chat_template", a);
    rapidjson::Value datasets(rapidjson::kArrayType);
    datasets.PushBack(entry, a);
    yaml.AddMember("datasets", datasets, a);
    for (const auto& k : c.value["run"].GetObject()) yaml.AddMember(rapidjson::Value(k.name, a), rapidjson::Value(k.value, a), a);
    const DataConfig cfg = load_records(f.dir, name + ".yaml", json_text(yaml), f.dir.file("tok/llama3/tokenizer.json"),
                                        c.value["max_length"].GetInt64()).data;
    ASSERT_EQ(cfg.datasets.size(), 1u);
    const std::shared_ptr<TokenDataset> d = TokenDataset::open(cfg);
    const rapidjson::Value& w_case = want[("chat_template " + name).c_str()];
    expect_samples(*d, w_case);
    const int64_t dropped = w_case["dropped"].GetInt64();
    if (dropped) {
      EXPECT_NE(d->description().find(std::to_string(dropped) + " records dropped"), std::string::npos)
          << d->description();
    }
  }
}

// numpy.random.default_rng(seed).permutation(n), which Hugging Face datasets shuffles and splits
// with, against numpy itself (numpy_permutations.py): sizes from 0 to past 2^16, seeds of one to
// three 32-bit words.
TEST(NumpyRandom, PermutationIsNumpys) {
  memrt::test::TempDir dir;
  ASSERT_TRUE(memrt::test::run_reference("numpy_permutations.py", dir.file("want.json")));
  const rapidjson::Document want = read_json(dir.file("want.json"));
  ASSERT_GT(want["cases"].Size(), 80u);
  for (const auto& c : want["cases"].GetArray()) {
    const int64_t n = c["n"].GetInt64();
    const uint64_t seed = c["seed"].GetUint64();
    std::vector<int64_t> expected;
    for (const auto& x : c["permutation"].GetArray()) expected.push_back(x.GetInt64());
    EXPECT_EQ(numpy_permutation(n, seed), expected) << "n " << n << ", seed " << seed;
  }
}

// axolotl's val_set_size (with shuffle_merged_datasets) and LLaMA-Factory's val_size, written in a
// train.yaml over axolotl alpaca records some of which are too long to keep: the samples trained on
// and held out, and their order, against the tools' split (sft_records.py, HELD_OUT_CASES: numpy's
// permutation, axolotl's shuffle-filter-take-the-last, LLaMA-Factory's split before processing).
TEST(Records, HeldOutRecordsAreTheToolsOwn) {
  Fixture f;
  ASSERT_TRUE(f.made);
  const rapidjson::Document want = read_json(f.dir.file("tok/llama3/sft.json"));
  const rapidjson::Value& cases = want["held_out cases"];
  ASSERT_EQ(cases.MemberCount(), 5u);
  for (const auto& c : cases.GetObject()) {
    SCOPED_TRACE(c.name.GetString());
    std::string yaml = "datasets:\n  - path: " + f.dir.file("held_out.jsonl") + "\n    type: alpaca\nseed: " +
                       std::to_string(c.value["seed"].GetUint64()) + "\n";
    for (const auto& k : c.value["keys"].GetObject())
      yaml += std::string(k.name.GetString()) + ": " + json_text(k.value) + "\n";
    const TrainConfig cfg = load_records(f.dir, std::string(c.name.GetString()) + ".yaml", yaml,
                                         f.dir.file("tok/llama3/tokenizer.json"), want["max_length"].GetInt64());
    const TokenDataset::Split split = TokenDataset::hold_out(*TokenDataset::open(cfg.data), cfg.data.held_out, cfg.seed);
    for (const auto& [side, d] : {std::pair{"train", split.train}, std::pair{"eval", split.eval}}) {
      SCOPED_TRACE(side);
      expect_samples(*d, c.value[side]);
    }
  }
  // Holding every record out names the key.
  const DataConfig data = load_records(f.dir, "all.yaml",
                                       "datasets:\n  - path: " + f.dir.file("held_out.jsonl") +
                                           "\n    type: alpaca\nval_set_size: 36\n",
                                       f.dir.file("tok/llama3/tokenizer.json"), want["max_length"].GetInt64())
                              .data;
  const auto all = TokenDataset::open(data);
  expect_error<Error>([&] { TokenDataset::hold_out(*all, data.held_out, 42); },
                      {"val_set_size", "36 held out of 36 samples", "none to train on"});
}

// LLaMA-Factory's dataset + dataset_dir (dataset_info.json's files, columns and tags) and its keys —
// template (named, or parsed from the model's chat template), cutoff_len, train_on_prompt,
// mask_history, default_system, enable_thinking, max_samples — read from train.yaml by the loader,
// against what LLaMA-Factory's own parser, converters, templates and supervised processor make of the
// same files with transformers' tokenizer (llamafactory_records.py): 15 named templates on five
// tokenizer kinds, alpaca with history and a system column, sharegpt with observation turns and
// broken records, openai records with tool responses, reasoning turns, a directory dataset, and
// infer_seqlen on a grid; the configs LLaMA-Factory refuses, or where
// it would add a token to the vocabulary, are errors here too. memrt drops the samples with nothing to
// train (LLaMA-Factory keeps them, contributing no loss).
TEST(Records, LlamaFactoryDatasetsTokenizeAsLlamaFactoryDoes) {
  memrt::test::TempDir dir;
  ASSERT_TRUE(memrt::test::run_reference("hf_tokenizers.py", dir.file("tok") + " > /dev/null") &&
              memrt::test::run_reference("llamafactory_records.py", dir.file("lf") + " " + dir.file("tok") +
                                                                        " > /dev/null 2>&1"));
  const rapidjson::Document want = read_json(dir.file("lf/expected.json"));
  const rapidjson::Value& cases = want["cases"];
  ASSERT_EQ(cases.MemberCount(), 30u);
  int errors = 0;
  for (const auto& c : cases.GetObject()) {
    const std::string name = c.name.GetString();
    SCOPED_TRACE(name);
    rapidjson::Document yaml(rapidjson::kObjectType);  // train.yaml, written as JSON (which YAML reads)
    auto& a = yaml.GetAllocator();
    yaml.CopyFrom(c.value["yaml"], a);
    yaml.AddMember("dataset_dir", rapidjson::Value(dir.file("lf/data").c_str(), a), a);
    yaml.AddMember("stage", "sft", a);
    const std::string path = dir.file("lf.yaml");
    std::ofstream(path) << json_text(yaml);
    ConfigSources sources;
    sources.train_yaml_path = path;
    DataConfig cfg = load_train_config(sources).data;
    cfg.tokenizer = dir.file("lf/" + std::string(c.value["kind"].GetString()) + "/tokenizer.json");
    cfg.cache_dir = dir.file("cache");
    if (c.value.HasMember("error")) {  // LLaMA-Factory refuses it (or would add a token): an error naming the file
      ++errors;
      try {
        TokenDataset::open(cfg);
        ADD_FAILURE() << "no error; LLaMA-Factory: " << c.value["error"].GetString();
      } catch (const FileError& e) {
        EXPECT_NE(std::string(e.what()).find(dir.file("lf/data")), std::string::npos) << e.what();
      }
      continue;
    }
    const std::shared_ptr<TokenDataset> d = TokenDataset::open(cfg);
    const auto ids = lists_of<int64_t>(c.value["ids"]);
    const auto labels = lists_of<int>(c.value["labels"]);
    int64_t dropped = c.value["dropped"].GetInt64();
    int64_t k = 0;
    for (size_t j = 0; j < ids.size(); ++j) {
      if (std::find(labels[j].begin() + 1, labels[j].end(), 1) == labels[j].end()) {  // nothing to train
        ++dropped;
        continue;
      }
      ASSERT_LT(k, d->num_samples()) << d->description();
      std::vector<int64_t> got(static_cast<size_t>(d->sample_length(k)));
      d->copy_tokens(d->sample_begin(k), d->sample_length(k), got.data());
      EXPECT_EQ(got, ids[j]) << "sample " << j;
      std::vector<int> trained;
      for (size_t i = 0; i < got.size(); ++i) trained.push_back(d->trained(d->sample_begin(k) + static_cast<int64_t>(i)) ? 1 : 0);
      EXPECT_EQ(trained, labels[j]) << "sample " << j;
      ++k;
    }
    EXPECT_EQ(d->num_samples(), k) << d->description();
    int64_t said = 0;  // the dropped records each file's part of the description counts
    const std::string& description = d->description();
    for (size_t at = description.find(" records dropped"); at != std::string::npos;
         at = description.find(" records dropped", at + 1))
      said += std::stoll(description.substr(description.rfind(' ', at - 1) + 1));
    EXPECT_EQ(said, dropped) << description;
  }
  EXPECT_EQ(errors, 3);
  // infer_seqlen on a grid that crosses each of its branches' boundaries (target * 2 == cutoff, ...)
  ASSERT_EQ(want["infer_seqlen"].Size(), 21u * 21u * 42u);
  for (const auto& row : want["infer_seqlen"].GetArray()) {
    const auto [source, target] = llamafactory_infer_seqlen(row[0].GetInt64(), row[1].GetInt64(), row[2].GetInt64());
    ASSERT_EQ(std::make_pair(source, target), std::make_pair(row[3].GetInt64(), row[4].GetInt64()))
        << "infer_seqlen(" << row[0].GetInt64() << ", " << row[1].GetInt64() << ", " << row[2].GetInt64() << ")";
  }
}

// A template named as axolotl names it (chat_template: chatml) renders the conversations instead of
// the model's own; tokenizer_default_fallback_chatml keeps the model's own where it has one;
// chat_template: jinja reads chat_template_jinja's file; a name memrt does not ship is an error
// naming the key and the names it has.
TEST(Records, NamedTemplatesAndTheModelsOwn) {
  Fixture f;
  ASSERT_TRUE(f.made);
  const Tokenizer tok = Tokenizer::from_file(f.dir.file("tok/llama3/tokenizer.json"));
  auto first_sample = [&](const std::string& yaml) {
    const std::shared_ptr<TokenDataset> d = TokenDataset::open(
        load_records(f.dir, "named.yaml", yaml + "train_file: " + f.dir.file("messages.jsonl") + "\n",
                     f.dir.file("tok/llama3/tokenizer.json"), 256)
            .data);
    std::vector<int64_t> ids(static_cast<size_t>(d->sample_length(0)));
    d->copy_tokens(d->sample_begin(0), d->sample_length(0), ids.data());
    return ids;
  };
  // What a template renders of the file's first conversation, tokenized as apply_chat_template does.
  auto rendered = [&](const ChatTemplate& t) {
    rapidjson::Document vars;
    vars.Parse(R"({"messages": [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi there."}],
                   "tools": null, "add_generation_prompt": false, "bos_token": "<|begin_of_text|>",
                   "eos_token": "<|end_of_text|>"})");
    const std::vector<int32_t> ids = tok.encode(t.render(vars).text, /*add_special_tokens=*/false);
    return std::vector<int64_t>(ids.begin(), ids.end());
  };
  const ChatTemplate chatml = ChatTemplate::parse(*named_chat_template("chatml"), "chatml");
  const std::optional<ChatTemplate> own = load_chat_template(f.dir.file("tok/llama3"));
  ASSERT_TRUE(own);
  EXPECT_EQ(first_sample(""), rendered(*own));
  EXPECT_EQ(first_sample("chat_template: chatml\n"), rendered(chatml));
  EXPECT_NE(rendered(chatml), rendered(*own));
  EXPECT_EQ(first_sample("chat_template: tokenizer_default_fallback_chatml\n"), rendered(*own));
  std::ofstream(f.dir.file("mine.jinja")) << *named_chat_template("chatml");  // axolotl's chat_template: jinja
  EXPECT_EQ(first_sample("chat_template: jinja\nchat_template_jinja: " + f.dir.file("mine.jinja") + "\n"), rendered(chatml));
  expect_error<FileError>([&] { first_sample("chat_template: gemma4\n"); },
                          {"named.yaml: chat_template", "gemma4",
                           "chatml, llama3, phi_3, phi_4, qwen_25, qwen3, gemma3, alpaca, gemma, mistral_v1, phi_35, "
                           "mistral_v7_tekken, cohere, deepseek_v3, mistral_v2v3, mistral_v3_tekken, llama4, exaone, deepseek_v2, "
                           "nemotron_h, metharme, falcon_h1, qwen2_vl, llava, aya, gemma3n",
                           "tokenizer_default"});
}

// dataset_name's split in several files of prompt/completion records: the records of each file in
// turn (the files in datasets' order, DataFiles.SplitsAreTheOnesDatasetsLoads), the samples the
// same as the one file holding them all; a bad record names its own file and line.
TEST(Records, ASplitInSeveralFilesIsEachFilesRecordsInTurn) {
  Fixture f;
  ASSERT_TRUE(f.made);
  std::ifstream in(f.dir.file("prompt_completion.jsonl"));
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line + "\n");
  ASSERT_GE(lines.size(), 4u);
  std::filesystem::create_directories(f.dir.file("pc_dir/data"));
  const std::string first = f.dir.file("pc_dir/data/train-00000-of-00002.jsonl");
  const std::string second = f.dir.file("pc_dir/data/train-00001-of-00002.jsonl");
  std::ofstream(first) << lines[0] << lines[1];
  {
    std::ofstream out(second);
    for (size_t i = 2; i < lines.size(); ++i) out << lines[i];
  }
  TrainConfig split = load_records(f.dir, "split.yaml", "dataset_name: " + f.dir.file("pc_dir") + "\n",
                                   f.dir.file("tok/llama3/tokenizer.json"), 256);
  ASSERT_EQ(split.data.train_files, (std::vector<std::string>{first, second}));
  DataConfig one = split.data;
  one.train_files = {f.dir.file("prompt_completion.jsonl")};
  const std::shared_ptr<TokenDataset> a = TokenDataset::open(split.data), b = TokenDataset::open(one);
  ASSERT_TRUE(a->has_samples());
  EXPECT_EQ(a->num_records(), b->num_records());
  ASSERT_EQ(a->num_samples(), b->num_samples());
  for (int64_t k = 0; k < a->num_samples(); ++k) {
    SCOPED_TRACE("sample " + std::to_string(k));
    ASSERT_EQ(a->sample_length(k), b->sample_length(k));
    EXPECT_EQ(a->sample_record(k), b->sample_record(k));
    for (int64_t i = 0; i < a->sample_length(k); ++i) {
      EXPECT_EQ(a->token(a->sample_begin(k) + i), b->token(b->sample_begin(k) + i));
      EXPECT_EQ(a->trained(a->sample_begin(k) + i), b->trained(b->sample_begin(k) + i));
    }
  }
  std::ofstream(second, std::ios::app) << "{\"prompt\": \"a\"}\n";
  expect_error<FileError>([&] { TokenDataset::open(split.data); },
                          {second + ": line " + std::to_string(lines.size() - 1), "no \"completion\""});
}

// A JSONL train_file of prompt/completion records is read as TRL reads it; records of other shapes
// and bad records are errors naming the file, the line and what to do.
TEST(Records, BadRecordsNameTheFileAndLine) {
  Fixture f;
  ASSERT_TRUE(f.made);
  DataConfig cfg;
  cfg.tokenizer = f.dir.file("tok/llama3/tokenizer.json");
  cfg.cache_dir = f.dir.file("cache");
  cfg.block_size = 256;
  cfg.train_files = {f.dir.file("prompt_completion.jsonl")};
  const std::shared_ptr<TokenDataset> pc = TokenDataset::open(cfg);
  EXPECT_TRUE(pc->has_samples());
  EXPECT_NE(pc->description().find("7 records, 6 samples"), std::string::npos) << pc->description();
  EXPECT_NE(pc->description().find("2 records cut to block_size 256"), std::string::npos) << pc->description();
  struct Case {
    std::string name, text;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"sharegpt.jsonl", "{\"conversations\": [{\"from\": \"human\", \"value\": \"hi\"}, {\"from\": \"bot\", \"value\": \"x\"}]}\n", {"sharegpt.jsonl", "line 1", "\"bot\"", "human/user"}},
      {"chat.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n{\"messages\": [{\"content\": \"x\"}]}\n", {"chat.jsonl", "line 2", "\"role\""}},
      {"alpaca.jsonl", "{\"instruction\": \"a\", \"output\": \"b\"}\n", {"alpaca.jsonl", "type: alpaca", "datasets:"}},
      {"pc.jsonl", "{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"prompt\": \"a\"}\n", {"pc.jsonl", "line 2", "no \"completion\""}},
      {"pc2.jsonl", "{\"prompt\": \"a\", \"completion\": \"b\"}\n\n{\"prompt\": 3, \"completion\": \"b\"}\n", {"pc2.jsonl", "line 3", "\"prompt\" must be a string"}},
      {"pc3.jsonl", "{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"prompt\": \"caf\xE9\", \"completion\": \"b\"}\n", {"pc3.jsonl", "line 2", "not valid UTF-8"}},
      {"pc4.jsonl", "{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"prompt\": \"a\", \"completion\": \"b\"\n", {"pc4.jsonl", "line 2", "invalid JSON"}},
      {"pc5.jsonl", "{\"prompt\": [{\"role\": \"user\", \"content\": \"hi\"}], \"completion\": \"b\"}\n", {"pc5.jsonl", "line 1", "conversational"}},
      {"chat0.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n{\"messages\": []}\n", {"chat0.jsonl", "line 2", "non-empty \"messages\""}},
  };
  for (const Case& c : cases) {
    std::ofstream(f.dir.file(c.name), std::ios::binary) << c.text;
    cfg.train_files = {f.dir.file(c.name)};
    expect_error<FileError>([&] { TokenDataset::open(cfg); }, c.says);
  }
  // alpaca records without their fields; a tokenizer without an EOS token.
  std::ofstream(f.dir.file("bad_alpaca.json")) << "[{\"instruction\": \"a\", \"output\": \"b\"}, {\"output\": \"b\"}]";
  cfg.train_files.clear();
  cfg.datasets = {{f.dir.file("bad_alpaca.json"), "alpaca"}};
  expect_error<FileError>([&] { TokenDataset::open(cfg); }, {"bad_alpaca.json", "record 2", "no \"instruction\""});
  // axolotl chat_template records: the messages' field missing, a message without a role, a tool
  // call's arguments that are not JSON, a content part whose train flag or text is of the wrong
  // kind, a training_detail that is not one, eot_tokens of several tokens, or of the EOS training
  // otherwise than the EOT.
  const std::vector<Case> chats = {
      {"chat1.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n{\"turns\": []}\n", {"chat1.jsonl", "line 2", "\"messages\"", "field_messages"}},
      {"chat2.jsonl", "{\"messages\": [{\"content\": \"hi\"}]}\n", {"chat2.jsonl", "line 1", "no string role", "message_property_mappings"}},
      {"chat3.jsonl", "{\"messages\": [{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"function\": {\"name\": \"f\", \"arguments\": \"{city\"}}]}]}\n",
       {"chat3.jsonl", "line 1", "arguments", "not valid JSON"}},
      {"chat4.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": [{\"text\": \"a\", \"train\": \"yes\"}]}]}\n",
       {"chat4.jsonl", "line 1", "content part's \"train\" must be true or false"}},
      {"chat5.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": [{\"text\": 7}]}]}\n",
       {"chat5.jsonl", "line 1", "content part's \"text\" must be a string"}},
      {"chat7.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n{\"messages\": []}\n",
       {"chat7.jsonl", "line 2", "\"messages\" must be a non-empty list"}},
  };
  for (const Case& c : chats) {
    std::ofstream(f.dir.file(c.name), std::ios::binary) << c.text;
    cfg.datasets = {{f.dir.file(c.name), "chat_template", {}}};
    expect_error<FileError>([&] { TokenDataset::open(cfg); }, c.says);
  }
  {  // message_field_training_detail that is not a list of {begin_offset, end_offset, train}
    std::ofstream(f.dir.file("chat6.jsonl"), std::ios::binary)
        << "{\"messages\": [{\"role\": \"assistant\", \"content\": \"x\", \"detail\": [{\"begin_offset\": 0}]}]}\n";
    ChatTemplateDataset detail;
    detail.message_field_training_detail = "detail";
    cfg.datasets = {{f.dir.file("chat6.jsonl"), "chat_template", detail}};
    expect_error<FileError>([&] { TokenDataset::open(cfg); },
                            {"chat6.jsonl", "line 1", "\"detail\" (message_field_training_detail) must be a list"});
  }
  // LLaMA-Factory records memrt does not render (its tool formats: a record's tools, sharegpt's
  // function_call turns, openai's tool_calls) and an openai role that none of the tags names.
  cfg.llamafactory.template_name = "llama3";
  LlamaFactoryDataset sharegpt, openai;
  sharegpt.formatting = "sharegpt";
  sharegpt.tools = "tools";
  openai.formatting = "openai";
  openai.messages = "messages";
  openai.role_tag = "role";
  openai.content_tag = "content";
  openai.user_tag = "user";
  openai.assistant_tag = "assistant";
  openai.observation_tag = "tool";
  const std::vector<std::pair<Case, LlamaFactoryDataset>> lf = {
      {{"lf1.jsonl", "{\"conversations\": [{\"from\": \"human\", \"value\": \"hi\"}, {\"from\": \"function_call\", \"value\": \"{}\"}]}\n",
        {"lf1.jsonl", "line 1", "\"function_call\" turn", "tool formats"}}, sharegpt},
      {{"lf2.jsonl", "{\"conversations\": [], \"tools\": \"[{\\\"name\\\": \\\"f\\\"}]\"}\n", {"lf2.jsonl", "line 1", "has tools", "\"tools\" column"}},
       sharegpt},
      {{"lf3.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": null, "
                     "\"tool_calls\": [{\"function\": {\"name\": \"f\"}}]}]}\n",
        {"lf3.jsonl", "line 1", "\"assistant\" turn with \"tool_calls\"", "function call"}}, openai},
      {{"lf4.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n{\"messages\": [{\"role\": \"developer\", \"content\": \"x\"}]}\n",
        {"lf4.jsonl", "line 2", "\"developer\"", "observation_tag \"tool\"", "dataset_info.json"}}, openai},
      {{"lf5.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": null}, {\"role\": \"assistant\", \"content\": \"x\"}]}\n",
        {"lf5.jsonl", "line 1", "\"content\" is null"}}, openai},
  };
  for (const auto& [c, d] : lf) {
    std::ofstream(f.dir.file(c.name), std::ios::binary) << c.text;
    cfg.datasets = {{f.dir.file(c.name), "llamafactory", {}, d}};
    expect_error<FileError>([&] { TokenDataset::open(cfg); }, c.says);
  }
  {  // a template: LLaMA-Factory has no such name for, or memrt does not ship
    std::ofstream(f.dir.file("lf6.jsonl"), std::ios::binary)
        << "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"x\"}]}\n";
    cfg.llamafactory.template_name = "llama9";
    cfg.datasets = {{f.dir.file("lf6.jsonl"), "llamafactory", {}, openai}};
    expect_error<FileError>([&] { TokenDataset::open(cfg); },
                            {"template: \"llama9\"", "not a LLaMA-Factory template memrt ships", "llama3", "leave template out"});
  }
  cfg.llamafactory = {};
  cfg.datasets = {{f.dir.file("chat_template.jsonl"), "chat_template", {}}};
  cfg.eot_tokens = std::vector<std::string>{"Cutting Knowledge"};  // in the template, and not one token
  expect_error<FileError>([&] { TokenDataset::open(cfg); }, {"eot_tokens", "\"Cutting Knowledge\"", "must be one"});
  cfg.eot_tokens = std::vector<std::string>{"<|eot_id|>", "<|end_of_text|>"};
  cfg.datasets[0].chat.train_on_eot = "all";
  cfg.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}<|eot_id|>{% endfor %}<|end_of_text|>";
  cfg.chat_template_where = "train.yaml: chat_template";
  expect_error<FileError>([&] { TokenDataset::open(cfg); }, {"EOS token", "train_on_eos (\"turn\")", "train_on_eot (\"all\")"});
  cfg.chat_template.clear();
  cfg.eot_tokens.reset();
  cfg.datasets = {{f.dir.file("alpaca.jsonl"), "alpaca", {}}};
  cfg.tokenizer = f.dir.file("tok/gpt2/tokenizer.json");  // no tokenizer_config.json beside it
  expect_error<FileError>([&] { TokenDataset::open(cfg); }, {"EOS token", "tokenizer_config.json", "eos_token"});
  cfg.tokenizer.clear();
  expect_error<FileError>([&] { TokenDataset::open(cfg); }, {"alpaca.jsonl", "model_name_or_path", "tokenizer.json"});
}
