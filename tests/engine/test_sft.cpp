// Fine-tuning on records through the launcher (docs/tokenizers.md, "Datasets"): a small Llama saved
// with its own tokenizer, alpaca and prompt/completion records, the loss over the step's trained
// tokens, and the configs users bring from axolotl, LLaMA-Factory and TRL.
#include <gtest/gtest.h>

#include <rapidjson/document.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "json_helpers.h"
#include "run_helpers.h"
#include "torch_reference.h"

namespace {

using namespace memrt_test;
namespace fs = std::filesystem;

std::string ds(int micro, int accumulation) {
  return R"({"train_micro_batch_size_per_gpu": )" + std::to_string(micro) + R"(, "gradient_accumulation_steps": )" +
         std::to_string(accumulation) + "}";
}

// dir/base: a Llama initialised by memrt and exported as a Hugging Face directory, with the Llama-3
// kind tokenizer.json of hf_tokenizers.py, a tokenizer_config.json naming BOS and EOS and a Llama-3.1
// shaped chat_template.jinja (sft_records.py, which also writes dir/alpaca.jsonl,
// dir/prompt_completion.jsonl and dir/messages.jsonl and, in dir/tok/llama3/sft.json, what axolotl
// and TRL make of them).
fs::path make_base(const TempDir& dir, const std::string& shape, const std::string& arch = "llama",
                   const std::string& name = "base") {
  const fs::path tok = dir.path() / "tok";
  const std::string py = std::string(MEMRT_PYTHON) + " " + MEMRT_SOURCE_DIR + "/tests/data/";
  if (!fs::exists(tok)) {
    EXPECT_EQ(run(py + "hf_tokenizers.py " + tok.string()).exit_code, 0);
    const RunResult made = run(py + "sft_records.py " + dir.path().string() + " " + (tok / "llama3").string());
    EXPECT_EQ(made.exit_code, 0) << made.out;
  }
  const std::string init = "model: {arch: " + arch + ", " + shape + ", vocab_size: 1300, n_ctx: 256}\nmax_steps: 1\nsave_steps: 1\n";
  const fs::path made = dir.path() / ("init_" + name);
  EXPECT_EQ(run(kLauncher + " --deepspeed " + dir.write("init.json", ds(1, 1)) + " " +
                dir.write("init_" + name + ".yaml", init) + " --output_dir=" + made.string()).exit_code, 0);
  const fs::path base = dir.path() / name;
  EXPECT_EQ(run(kLauncher + " export " + made.string() + " " + base.string()).exit_code, 0);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"})
    fs::copy_file(tok / "llama3" / f, base / f);
  return base;
}

// Alpaca records whose responses run from 1 to 30 words: micro-batches train on very different
// numbers of tokens.
std::string uneven_records(const TempDir& dir) {
  std::string text;
  for (int i = 0; i < 24; ++i) {
    std::string output;
    for (int w = 0; w < 1 + (i * 17) % 30; ++w) output += (w ? " " : "") + std::string(w % 3 ? "more" : "words");
    text += R"({"instruction": "Say something )" + std::to_string(i) + R"(", "input": ")" + (i % 2 ? "x" : "") +
            R"(", "output": ")" + output + "\"}\n";
  }
  return dir.write("uneven.jsonl", text);
}

}  // namespace

// The loss of a step is the mean over every token it trains on (transformers' num_items_in_batch),
// however the global batch of 4 is split: 4 samples in one micro-batch, 4 micro-batches of 1, or 2
// ranks of 2 micro-batches of 1 give the same losses, step after step, to 1e-6 — with responses of
// very different lengths, where averaging each micro-batch's mean would not.
TEST(Sft, TheLossIsTheMeanOverTheStepsTrainedTokens) {
  TempDir dir("sft_loss");
  const fs::path base = make_base(dir, "n_layer: 1, n_head: 2, n_kv_head: 2, d_model: 32, d_ff: 64");
  const std::string yaml = dir.write("train.yaml", "base_model: " + base.string() + "\nsequence_len: 256\n"
                                                   "dataset_prepared_path: " + (dir.path() / "prepared").string() + "\n"
                                                   "datasets:\n  - path: " + uneven_records(dir) + "\n    type: alpaca\n"
                                                   "max_steps: 3\nlogging_steps: 1\nlearning_rate: 1.0e-2\n"
                                                   "lr_scheduler_type: constant\n");
  struct Split {
    const char* name;
    int ranks, micro, accumulation;
  };
  std::vector<std::vector<double>> got;
  // The 2-rank run tokenizes into a cache of its own: rank 0 writes the one entry, rank 1 maps it.
  const fs::path shared = dir.path() / "prepared_ranks";
  for (const Split& s : {Split{"one", 1, 4, 1}, Split{"four", 1, 1, 4}, Split{"ranks", 2, 1, 2}}) {
    const fs::path out = dir.path() / s.name;
    const RunResult r = run("env OMP_NUM_THREADS=1 " + kLauncher + " --num_procs " + std::to_string(s.ranks) +
                            " --master_port " + std::to_string(free_port()) + " --deepspeed " +
                            dir.write(std::string(s.name) + ".json", ds(s.micro, s.accumulation)) + " " + yaml +
                            " --output_dir=" + out.string() +
                            (s.ranks > 1 ? " --dataset_prepared_path=" + shared.string() : std::string()));
    ASSERT_EQ(r.exit_code, 0) << s.name << "\n" << r.out;
    EXPECT_NE(r.out.find("24 records, 24 samples"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("tokenized its data itself"), std::string::npos) << r.out;
    got.push_back(losses(out));
    ASSERT_EQ(got.back().size(), 3u) << s.name;
  }
  int entries = 0;
  for (const auto& e : fs::directory_iterator(shared)) entries += e.path().extension() == ".bin";
  EXPECT_EQ(entries, 1);
  // Where rank 0 cannot write the cache (on another host, rank 1 would not see it either), rank 1
  // tokenizes the same records itself and says so; the run trains as before.
  {
    dir.write("not_a_dir", "x");
    const fs::path out = dir.path() / "ranks_uncached";
    const RunResult r = run("env OMP_NUM_THREADS=1 " + kLauncher + " --num_procs 2 --master_port " +
                            std::to_string(free_port()) + " --deepspeed " + (dir.path() / "ranks.json").string() + " " +
                            yaml + " --output_dir=" + out.string() + " --max_steps=1 --dataset_prepared_path=" +
                            (dir.path() / "not_a_dir" / "cache").string());
    ASSERT_EQ(r.exit_code, 0) << r.out;
    EXPECT_NE(r.out.find("[rank 1] note: this rank tokenized its data itself"), std::string::npos) << r.out;
    ASSERT_EQ(losses(out).size(), 1u);
    EXPECT_NEAR(losses(out)[0], got[0][0], 1e-6 * got[0][0]);
  }
  for (size_t i = 1; i < got.size(); ++i)
    for (size_t step = 0; step < 3; ++step)
      EXPECT_NEAR(got[i][step], got[0][step], 1e-6 * got[0][step]) << "split " << i << ", step " << step + 1;

  // sample_packing: the same records packed several to a row (test_packing.cpp checks the
  // arithmetic) train, with activation checkpointing recomputing inside the packed layout.
  const fs::path packed = dir.path() / "packed";
  const RunResult p = run(kLauncher + " --deepspeed " + dir.write("packed.json", ds(2, 1)) + " " + yaml +
                          " --sample_packing=true --gradient_checkpointing=true --output_dir=" + packed.string());
  ASSERT_EQ(p.exit_code, 0) << p.out;
  EXPECT_NE(p.out.find("rows of 256 tokens packed"), std::string::npos) << p.out;
  EXPECT_EQ(losses(packed).size(), 3u);
}

// Packed rows are in the estimate (docs/memory.md, "Packed rows"): each micro-batch's positions,
// a Llama's rotary tables gathered at them once for every block, GPT-2's position ids taken from the
// batch, and — where attention runs sample by sample (a head size memrt's kernel does not take) —
// each block's attention output kept beside the joined one. The measured peak equals the estimate
// to the byte, cell by cell: Llama with grouped-query heads, GPT-2, a 24-wide head, activation
// checkpointing, bf16, and a packed run of the same records without packing. With attention
// dropout each sample's (len x len) matrices are kept, under the T x T the estimate counts: an
// upper bound.
TEST(Sft, PackedRunsPeakAtTheirEstimate) {
  TempDir dir("sft_packed_estimate");
  const fs::path llama = make_base(dir, "n_layer: 2, n_head: 4, n_kv_head: 2, d_model: 64, d_ff: 128");
  const fs::path gpt2 = make_base(dir, "n_layer: 2, n_head: 2, d_model: 64, d_ff: 128", "gpt2", "gpt2");
  const fs::path narrow = make_base(dir, "n_layer: 2, n_head: 2, n_kv_head: 1, d_model: 48, d_ff: 96", "llama", "narrow");
  const fs::path dropout =
      make_base(dir, "n_layer: 2, n_head: 2, d_model: 64, d_ff: 128, attn_pdrop: 0.1, resid_pdrop: 0.1", "gpt2", "dropout");
  const std::string records = uneven_records(dir);
  struct Case {
    const char* name;
    fs::path base;
    const char* options;
  };
  for (const Case& c : {Case{"llama", llama, ""}, Case{"gpt2", gpt2, ""}, Case{"narrow_heads", narrow, ""},
                        Case{"llama_checkpointed", llama, " --gradient_checkpointing=true"},
                        Case{"gpt2_checkpointed", gpt2, " --gradient_checkpointing=true"},
                        Case{"llama_bf16", llama, " --bf16=true"}, Case{"llama_unpacked", llama, " --sample_packing=false"},
                        Case{"gpt2_dropout", dropout, ""}}) {
    SCOPED_TRACE(c.name);
    const fs::path out = dir.path() / c.name;
    const std::string yaml = dir.write(std::string(c.name) + ".yaml",
                                       "base_model: " + c.base.string() + "\nsequence_len: 256\npad_to_sequence_len: true\n"
                                       "sample_packing: true\ndataset_prepared_path: " + (dir.path() / "prepared").string() +
                                       "\ndatasets:\n  - path: " + records + "\n    type: alpaca\nmax_steps: 2\n");
    const RunResult r = run(kLauncher + " --deepspeed " + dir.write(std::string(c.name) + ".json", ds(2, 1)) + " " +
                            yaml + c.options + " --output_dir=" + out.string());
    ASSERT_EQ(r.exit_code, 0) << r.out;
    EXPECT_EQ(r.out.find("rows of 256 tokens packed") == std::string::npos, std::string(c.options).find("sample_packing=false") != std::string::npos)
        << r.out;
    const rapidjson::Document report = read_json(out / "memory_report.json");
    const rapidjson::Value& rank = report["ranks"][0];
    if (c.base == dropout) {
      EXPECT_LT(rank["measured"]["peak_bytes"].GetInt64(), rank["estimate"]["peak_bytes"].GetInt64());
      continue;
    }
    const rapidjson::Value& measured = rank["measured"]["categories"];
    const rapidjson::Value& estimate = rank["estimate"]["categories"];
    for (const auto& cell : measured.GetObject())
      for (const char* where : {"device", "host"})
        EXPECT_EQ(cell.value[where].GetInt64(), estimate[cell.name.GetString()][where].GetInt64())
            << cell.name.GetString() << " " << where;
    EXPECT_EQ(rank["measured"]["peak_bytes"].GetInt64(), rank["estimate"]["peak_bytes"].GetInt64());
  }
}

// axolotl's QLoRA YAML shape — base_model with its tokenizer, datasets: [{path, type: alpaca}],
// train_on_inputs: false, sequence_len, pad_to_sequence_len — trains and writes its adapter; TRL's
// shapes — a prompt/completion JSONL as train_file with completion_only_loss, and a conversational
// (messages) one through the model's chat template with assistant_only_loss — train, and
// evaluating each file counts exactly the tokens TRL trains on; LLaMA-Factory's val_size holds
// records out and evaluates them.
TEST(Sft, AxolotlLlamaFactoryAndTrlConfigsTrainOnTheirRecords) {
  TempDir dir("sft_configs");
  const fs::path base = make_base(dir, "n_layer: 2, n_head: 4, n_kv_head: 2, d_model: 64, d_ff: 128");
  const rapidjson::Document want = read_json(dir.path() / "tok" / "llama3" / "sft.json");
  const fs::path axolotl = dir.path() / "axolotl";
  const RunResult a = run(
      kLauncher + " --deepspeed " + dir.write("a.json", ds(2, 1)) + " " +
      dir.write("axolotl.yaml", "base_model: " + base.string() + "\nadapter: qlora\nload_in_4bit: true\n"
                                "lora_r: 8\nlora_alpha: 16\nlora_target_linear: true\nsequence_len: 256\n"
                                "pad_to_sequence_len: true\nsample_packing: false\ntrain_on_inputs: false\n"
                                "dataset_prepared_path: " + (dir.path() / "prepared").string() + "\n"
                                "datasets:\n  - path: " + (dir.path() / "alpaca.jsonl").string() +
                                "\n    type: alpaca\ntest_datasets:\n  - path: " + (dir.path() / "alpaca.jsonl").string() +
                                "\n    type: alpaca\n    split: train\n"
                                "num_epochs: 2\nsave_steps: 3\nlogging_steps: 1\nlearning_rate: 1.0e-2\n") +
      " --output_dir=" + axolotl.string());
  ASSERT_EQ(a.exit_code, 0) << a.out;
  EXPECT_NE(a.out.find("8 records, 6 samples"), std::string::npos) << a.out;
  EXPECT_NE(a.out.find("2 records dropped"), std::string::npos) << a.out;
  EXPECT_EQ(losses(axolotl).size(), 6u) << "6 samples, 2 a step, 2 epochs";
  EXPECT_EQ(read_json(axolotl / "eval.json")["windows"].GetInt64(), 6) << "test_datasets: the 6 samples";
  EXPECT_TRUE(fs::exists(axolotl / "adapter" / "adapter_model.safetensors"));

  // axolotl's type: chat_template on sharegpt records, with the keys its docs spell for them.
  const fs::path axolotl_chat = dir.path() / "axolotl_chat";
  const RunResult ac = run(
      kLauncher + " --deepspeed " + dir.write("ac.json", ds(2, 1)) + " " +
      dir.write("axolotl_chat.yaml", "base_model: " + base.string() + "\nadapter: lora\nlora_r: 8\nlora_alpha: 16\n"
                                     "lora_target_linear: true\nsequence_len: 256\ndataset_prepared_path: " +
                                     (dir.path() / "prepared").string() + "\neot_tokens: [\"<|eot_id|>\"]\n"
                                     "datasets:\n  - path: " + (dir.path() / "sharegpt.jsonl").string() +
                                     "\n    type: chat_template\n    field_messages: conversations\n"
                                     "    message_property_mappings: {role: from, content: value}\n"
                                     "max_steps: 2\nlogging_steps: 1\n") +
      " --output_dir=" + axolotl_chat.string());
  ASSERT_EQ(ac.exit_code, 0) << ac.out;
  int64_t chat_trained = 0;
  for (const auto& sample : want["chat_template sharegpt"]["labels"].GetArray())
    for (const auto& l : sample.GetArray()) chat_trained += l.GetInt();
  EXPECT_NE(ac.out.find("3 records, 3 samples"), std::string::npos) << ac.out;
  EXPECT_NE(ac.out.find(std::to_string(chat_trained) + " trained"), std::string::npos) << chat_trained << "\n" << ac.out;
  EXPECT_EQ(losses(axolotl_chat).size(), 2u);

  // LLaMA-Factory's LoRA example, as its users write it: dataset names in dataset_dir's
  // dataset_info.json (alpaca, and sharegpt with a system column), template: llama3, and its
  // eval_dataset evaluated after the last step.
  std::ofstream(dir.path() / "dataset_info.json")
      << R"({"alpaca_demo": {"file_name": "alpaca.jsonl"},
             "chat_demo": {"file_name": "sharegpt.jsonl", "formatting": "sharegpt", "columns": {"messages": "conversations", "system": "system"}}})";
  const fs::path llamafactory = dir.path() / "llamafactory";
  const RunResult lf = run(
      kLauncher + " --deepspeed " + dir.write("lf.json", ds(2, 1)) + " " +
      dir.write("llamafactory.yaml", "model_name_or_path: " + base.string() + "\nstage: sft\ndo_train: true\n"
                                     "finetuning_type: lora\nlora_rank: 8\nlora_target: all\n"
                                     "dataset: alpaca_demo,chat_demo\neval_dataset: alpaca_demo\ndataset_dir: " + dir.path().string() +
                                     "\ntemplate: llama3\ncutoff_len: 256\nmax_samples: 1000\noverwrite_cache: true\n"
                                     "preprocessing_num_workers: 16\ntokenized_path: " + (dir.path() / "prepared").string() +
                                     "\nlogging_steps: 1\nsave_steps: 3\nplot_loss: true\noverwrite_output_dir: true\n"
                                     "per_device_train_batch_size: 2\ngradient_accumulation_steps: 1\n"
                                     "learning_rate: 1.0e-3\nmax_steps: 3\nlr_scheduler_type: cosine\nwarmup_ratio: 0.1\n"
                                     "report_to: none\n") +
      " --output_dir=" + llamafactory.string());
  ASSERT_EQ(lf.exit_code, 0) << lf.out;
  EXPECT_NE(lf.out.find("11 records, 11 samples"), std::string::npos) << lf.out;
  EXPECT_EQ(losses(llamafactory).size(), 3u);
  EXPECT_TRUE(fs::exists(llamafactory / "adapter" / "adapter_model.safetensors"));
  EXPECT_EQ(read_json(llamafactory / "eval.json")["windows"].GetInt64(), 8) << "eval_dataset: its 8 records";

  // val_size instead of eval_dataset: a quarter of the 11 records (3, rounded up) held out and
  // evaluated, the other 8 trained on (Records.HeldOutRecordsAreTheToolsOwn checks which).
  const fs::path held = dir.path() / "held";
  const RunResult h = run(
      kLauncher + " --deepspeed " + dir.write("held.json", ds(2, 1)) + " " +
      dir.write("held.yaml", "model_name_or_path: " + base.string() + "\nstage: sft\nfinetuning_type: lora\n"
                             "lora_target: all\ndataset: alpaca_demo,chat_demo\nval_size: 0.25\ndataset_dir: " +
                             dir.path().string() + "\ntemplate: llama3\ncutoff_len: 256\ntokenized_path: " +
                             (dir.path() / "prepared").string() + "\nmax_steps: 2\nlogging_steps: 1\n") +
      " --output_dir=" + held.string());
  ASSERT_EQ(h.exit_code, 0) << h.out;
  EXPECT_NE(h.out.find("8 samples trained on"), std::string::npos) << h.out;
  EXPECT_EQ(read_json(held / "eval.json")["windows"].GetInt64(), 3) << h.out;

  const fs::path trl = dir.path() / "trl";
  const std::string pc = (dir.path() / "prompt_completion.jsonl").string();
  const std::string yaml = dir.write("trl.yaml", "model_name_or_path: " + base.string() + "\nuse_peft: true\n"
                                                 "lora_r: 8\nlora_target_modules: all-linear\nmax_length: 256\n"
                                                 "completion_only_loss: true\ndataset_prepared_path: " + (dir.path() / "prepared").string() +
                                                 "\ntrain_file: " + pc + "\neval_file: " + pc +
                                                 "\nmax_steps: 3\nlogging_steps: 1\nlearning_rate: 1.0e-2\n");
  const RunResult t = run(kLauncher + " --deepspeed " + dir.write("t.json", ds(2, 1)) + " " + yaml +
                          " --output_dir=" + trl.string());
  ASSERT_EQ(t.exit_code, 0) << t.out;
  EXPECT_EQ(losses(trl).size(), 3u);
  const rapidjson::Document eval = read_json(trl / "eval.json");
  int64_t completion_tokens = 0;
  for (const auto& sample : want["prompt_completion 0"]["labels"].GetArray())
    for (rapidjson::SizeType i = 1; i < sample.Size(); ++i) completion_tokens += sample[i].GetInt();
  EXPECT_EQ(eval["windows"].GetInt64(), static_cast<int64_t>(want["prompt_completion 0"]["ids"].Size()));
  EXPECT_EQ(eval["tokens"].GetInt64(), completion_tokens);

  const fs::path chat = dir.path() / "chat";
  const std::string messages = (dir.path() / "messages.jsonl").string();
  const RunResult c = run(kLauncher + " --deepspeed " + dir.write("c.json", ds(2, 1)) + " " +
                          dir.write("chat.yaml", "model_name_or_path: " + base.string() + "\nuse_peft: true\n"
                                                 "lora_r: 8\nlora_target_modules: all-linear\nmax_length: 256\n"
                                                 "assistant_only_loss: true\ndataset_prepared_path: " +
                                                 (dir.path() / "prepared").string() + "\ntrain_file: " + messages +
                                                 "\neval_file: " + messages + "\nmax_steps: 2\nlogging_steps: 1\n") +
                          " --output_dir=" + chat.string());
  ASSERT_EQ(c.exit_code, 0) << c.out;
  EXPECT_EQ(losses(chat).size(), 2u);
  int64_t assistant_tokens = 0;
  for (const auto& sample : want["messages 1"]["labels"].GetArray())
    for (rapidjson::SizeType i = 1; i < sample.Size(); ++i) assistant_tokens += sample[i].GetInt();
  const rapidjson::Document chat_eval = read_json(chat / "eval.json");
  EXPECT_EQ(chat_eval["windows"].GetInt64(), static_cast<int64_t>(want["messages 1"]["ids"].Size()));
  EXPECT_EQ(chat_eval["tokens"].GetInt64(), assistant_tokens);
}
