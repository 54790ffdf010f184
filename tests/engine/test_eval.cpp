// Evaluation as users run it: `launcher eval` and train.yaml's eval_file + eval_steps, against
// transformers, PEFT and bitsandbytes computing the same held-out loss (tests/engine/peft_eval.py,
// run at test time); and the errors a wrong evaluation config gets.
#include <gtest/gtest.h>

#include <rapidjson/document.h>

#include <cmath>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "json_helpers.h"
#include "run_helpers.h"
#include "torch_reference.h"

namespace {

using namespace memrt_test;
namespace fs = std::filesystem;

int batch_outputs = 0;  // numbers the files queue_losses names
const char* kDs = R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1})";

// Held-out text of 3,235 bytes: 101 windows of 32 tokens, 3 bytes left over (dropped).
constexpr int64_t kWindows = 101;
std::string eval_text(const TempDir& dir) {
  std::string text;
  for (int i = 0; i < 60; ++i)
    text += "Line " + std::to_string(i * 37 % 101) + ": the quick brown fox jumps over the lazy dog.\n";
  EXPECT_EQ(text.size(), 3235u);
  return dir.write("eval.txt", text);
}

// A batch of peft_eval.py's commands, run in one Python process.
PythonBatch peft_batch(const TempDir& dir, const std::string& name) {
  return {dir, name, std::string(MEMRT_SOURCE_DIR) + "/tests/engine/peft_eval.py"};
}

// Queues transformers' initialisation of a small GPT-2 or Llama in dir/KIND, with PEFT's adapters
// KIND/lora and KIND/rslora (peft_eval.py make).
fs::path queue_model(PythonBatch& batch, const TempDir& dir, const std::string& kind) {
  const fs::path model = dir.path() / kind;
  batch.add({"make", kind, model.string()});
  return model;
}

// Queues PEFT's losses on the eval text (peft_eval.py loss; `args`: its flags and adapters): the
// model alone, then with each adapter. Returns the file read_losses reads once the batch has run.
std::string queue_losses(PythonBatch& batch, const TempDir& dir, const fs::path& model, std::vector<std::string> args) {
  const std::string out = (dir.path() / ("peft_losses" + std::to_string(++batch_outputs) + ".json")).string();
  args.insert(args.begin(), {"loss", model.string(), (dir.path() / "eval.txt").string(), "32", out});
  batch.add(std::move(args));
  return out;
}

// The losses queue_losses' command wrote; `lines`, when given, receives
// print_trainable_parameters' line for each adapter.
std::vector<double> read_losses(const std::string& file, std::vector<std::string>* lines = nullptr) {
  std::vector<double> losses;
  if (!fs::exists(file)) return losses;
  const rapidjson::Document d = read_json(file);
  EXPECT_EQ(d["windows"].GetInt64(), kWindows);
  for (const auto& v : d["losses"].GetArray()) losses.push_back(v.GetDouble());
  if (lines)
    for (const auto& v : d["lines"].GetArray()) lines->push_back(v.GetString());
  return losses;
}

// The model and its adapters, shared by the tests (read only).
fs::path make_model(const std::string& kind) {
  return shared_reference(std::string(MEMRT_SOURCE_DIR) + "/tests/engine/peft_eval.py", {"make", kind});
}

// PEFT's losses alone, in their own batch.
std::vector<double> peft_losses(const TempDir& dir, const fs::path& model, std::vector<std::string> args) {
  PythonBatch batch = peft_batch(dir, "losses");
  const std::string file = queue_losses(batch, dir, model, std::move(args));
  batch.run();
  return read_losses(file);
}

// `launcher eval` of train.yaml `yaml` (+ the eval file): output_dir/eval.json.
rapidjson::Document launcher_eval(const TempDir& dir, const std::string& name, const std::string& yaml,
                                  const std::string& args = "", const std::string& says = "",
                                  const std::string& ds = kDs) {
  const RunResult r = run(kLauncher + " eval " + args + " --deepspeed " + dir.write(name + ".json", ds) + " " +
                          dir.write(name + ".yaml", yaml + "block_size: 32\neval_file: " +
                                                        (dir.path() / "eval.txt").string() + "\n") +
                          " --output_dir=" + (dir.path() / name).string());
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("eval of the model at step 0 | eval_loss"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(says), std::string::npos) << says << "\n" << r.out;
  rapidjson::Document d = read_json(dir.path() / name / "eval.json");
  EXPECT_EQ(d["windows"].GetInt64(), kWindows) << name;
  EXPECT_EQ(d["tokens"].GetInt64(), kWindows * 31) << name;
  EXPECT_NEAR(d["perplexity"].GetDouble(), std::exp(d["loss"].GetDouble()), 1e-9 * d["perplexity"].GetDouble());
  return d;
}

double relative(double a, double b) { return std::abs(a / b - 1.0); }

// A training run of `model` with train.yaml `keys` (block_size 32 and the eval file added), from
// dir/train.yaml and dir/ds.json into dir/run: the launcher's output.
RunResult train_run(const TempDir& dir, const fs::path& model, const std::string& keys) {
  const std::string yaml = dir.write("train.yaml", "model_name_or_path: " + model.string() + "\n" + keys +
                                                       "block_size: 32\neval_file: " +
                                                       (dir.path() / "eval.txt").string() + "\n");
  return run(kLauncher + " --deepspeed " + dir.write("ds.json", kDs) + " " + yaml + " --output_dir=" +
             (dir.path() / "run").string());
}

}  // namespace

// A GPT-2 saved by transformers, alone and with PEFT's LoRA and rsLoRA adapters (every projection,
// Conv1D's fan_in_fan_out, dropout that evaluation must not apply, layers_to_transform):
// `launcher eval` gives PEFT's loss within 1e-5, and prints PEFT's print_trainable_parameters line.
TEST(Eval, GptTwoWithPeftAdaptersAsInPeft) {
  TempDir dir("eval_gpt2");
  eval_text(dir);
  PythonBatch peft = peft_batch(dir, "peft");
  const fs::path model = queue_model(peft, dir, "gpt2");
  std::vector<std::string> adapters;
  for (const char* a : {"lora", "rslora", "layers", "bias_all", "bias_lora_only", "dora"}) adapters.push_back((model / a).string());
  const std::string losses_file = queue_losses(peft, dir, model, adapters);
  ASSERT_TRUE(peft.run());
  std::vector<std::string> lines;
  const std::vector<double> want = read_losses(losses_file, &lines);
  ASSERT_EQ(want.size(), 7u);
  ASSERT_EQ(lines.size(), 6u);
  EXPECT_GT(relative(want[1], want[0]), 1e-4) << "the adapter changes the loss";
  EXPECT_GT(relative(want[2], want[1]), 1e-4) << "rsLoRA's scaling changes it again";
  const std::string base = "model_name_or_path: " + model.string() + "\n";
  EXPECT_LT(relative(launcher_eval(dir, "base", base)["loss"].GetDouble(), want[0]), 1e-5);
  EXPECT_LT(relative(launcher_eval(dir, "lora", base + "adapter_name_or_path: " + (model / "lora").string() + "\n",
                                   "", lines[0])["loss"].GetDouble(), want[1]), 1e-5);
  // Under ZeRO-3 on 2 ranks (no optimizer is built to evaluate: each block's adapters are gathered
  // for its forward and released after it), the same loss. 2 windows a forward: the ranks' shares
  // of the 101 windows, 50 and 51, take 25 and 26 forwards, and the collectives inside each forward
  // line up only because the first rank runs one more, ignoring its targets.
  EXPECT_LT(relative(launcher_eval(dir, "lora_zero3", base + "adapter_name_or_path: " + (model / "lora").string() + "\n",
                                   "--num_procs 2 --master_port " + std::to_string(free_port()), "",
                                   R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, )"
                                   R"("stage3_param_persistence_threshold": 0}})")["loss"].GetDouble(), want[1]), 1e-5);
  EXPECT_LT(relative(launcher_eval(dir, "rslora", base + "lora_model_dir: " + (model / "rslora").string() + "\n")
                         ["loss"].GetDouble(), want[2]), 1e-5);
  // layers_to_transform: from PEFT's file, and as axolotl's key with the same targets (B zero there,
  // so the model's loss; the count is PEFT's).
  EXPECT_GT(relative(want[3], want[1]), 1e-4) << "one block's adapters are not both blocks'";
  EXPECT_LT(relative(launcher_eval(dir, "layers", base + "lora_model_dir: " + (model / "layers").string() + "\n", "",
                                   lines[2])["loss"].GetDouble(), want[3]), 1e-5);
  const std::string keys = "adapter: lora\nlora_r: 4\nlora_alpha: 8\nlora_target_modules: [c_attn, c_proj, c_fc]\n";
  EXPECT_LT(relative(launcher_eval(dir, "layers_key", base + keys + "peft_layers_to_transform: [1]\n", "", lines[2])
                         ["loss"].GetDouble(), want[0]), 1e-5);
  const RunResult bad = run(kLauncher + " eval --deepspeed " + dir.write("bad.json", kDs) + " " +
                            dir.write("bad.yaml", base + keys + "layers_to_transform: 2\nblock_size: 32\n") + " --eval_file=" +
                            (dir.path() / "eval.txt").string() + " --output_dir=" + (dir.path() / "bad").string());
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("layers_to_transform"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("the model's blocks are 0..1"), std::string::npos) << bad.out;

  // PEFT's bias modes: the biases the adapter saved are the model's (all of them, or the targets').
  EXPECT_GT(relative(want[4], want[1]), 1e-4) << "the saved biases change the loss";
  EXPECT_LT(relative(launcher_eval(dir, "bias_all", base + "lora_model_dir: " + (model / "bias_all").string() + "\n", "",
                                   lines[3])["loss"].GetDouble(), want[4]), 1e-5);
  EXPECT_LT(relative(launcher_eval(dir, "bias_lora_only",
                                   base + "lora_model_dir: " + (model / "bias_lora_only").string() + "\n", "", lines[4])
                         ["loss"].GetDouble(), want[5]), 1e-5);
  // DoRA: the magnitude vector and the column norm of W + scaling · B A, on GPT-2's Conv1D.
  EXPECT_GT(relative(want[6], want[1]), 1e-4) << "DoRA is not LoRA";
  EXPECT_LT(relative(launcher_eval(dir, "dora", base + "lora_model_dir: " + (model / "dora").string() + "\n", "",
                                   lines[5])["loss"].GetDouble(), want[6]), 1e-5);
}

// `launcher export --merge` of a QLoRA checkpoint: a plain fp32 model whose adapted weights are the
// 4-bit base as bitsandbytes dequantizes it plus PEFT's get_delta_weight (within 1e-6), every other
// tensor as trained; it evaluates as the QLoRA model it came from. `--dtype bf16` writes the same
// rounded to bf16.
TEST(Eval, QLoraMergedExportIsTheDequantizedBasePlusTheAdapters) {
  TempDir dir("eval_merge4");
  eval_text(dir);
  PythonBatch peft = peft_batch(dir, "peft");  // imports while memrt trains
  const fs::path model = make_model("llama");
  const fs::path out = dir.path() / "run";
  const RunResult r = train_run(dir, model, "adapter_name_or_path: " + (model / "lora").string() +
                                                "\nload_in_4bit: true\nbnb_4bit_compute_dtype: float32\nmax_steps: 1\n"
                                                "save_steps: 1\nlearning_rate: 1.0e-2\n");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const double qlora = read_json(out / "eval.json")["loss"].GetDouble();
  const fs::path merged = dir.path() / "merged";
  const RunResult e = run(kLauncher + " export " + (out / "global_step1").string() + " " + merged.string() + " --merge");
  ASSERT_EQ(e.exit_code, 0) << e.out;
  EXPECT_EQ(slurp(merged / "config.json").find("quantization_config"), std::string::npos) << "a plain model";
  // --dtype bf16: every tensor bf16, the reference rounded to bf16 (within one rounding: the fp32
  // merges differ by 1e-6, which can tip a value over a rounding boundary), torch_dtype saying so.
  const fs::path merged_bf16 = dir.path() / "merged_bf16";
  const RunResult e16 = run(kLauncher + " export " + (out / "global_step1").string() + " " + merged_bf16.string() +
                            " --merge --dtype bf16");
  ASSERT_EQ(e16.exit_code, 0) << e16.out;
  EXPECT_NE(slurp(merged_bf16 / "config.json").find("\"torch_dtype\": \"bfloat16\""), std::string::npos);
  const std::string compared = (dir.path() / "compared.json").string(), compared16 = (dir.path() / "compared16.json").string();
  peft.add({"merged4", model.string(), (out / "global_step1").string(), merged.string(), compared});
  peft.add({"merged4", model.string(), (out / "global_step1").string(), merged_bf16.string(), compared16, "bf16"});
  ASSERT_TRUE(peft.run());
  const rapidjson::Document d = read_json(compared);
  EXPECT_EQ(d["tensors"].GetInt(), 21);
  EXPECT_LT(d["worst"].GetDouble(), 1e-6);
  EXPECT_LT(relative(launcher_eval(dir, "merged", "model_name_or_path: " + merged.string() + "\n")["loss"].GetDouble(),
                     qlora), 1e-5);
  const rapidjson::Document d16 = read_json(compared16);
  EXPECT_EQ(d16["tensors"].GetInt(), 21);
  EXPECT_LE(d16["worst"].GetDouble(), 1.0 / 256);
  ASSERT_EQ(d16["dtypes"].Size(), 1u);
  EXPECT_STREQ(d16["dtypes"][0].GetString(), "torch.bfloat16");
  const RunResult bad = run(kLauncher + " export " + (out / "global_step1").string() + " " +
                            (dir.path() / "x").string() + " --dtype int8");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("--dtype int8 is not one of fp32, bf16, fp16"), std::string::npos) << bad.out;
}

// `launcher export --merge` of a LoRA checkpoint on a Llama's fp32 base is PEFT's merge_and_unload()
// of the checkpoint's adapter (within 1e-6): every projection adapted with lm_head and
// embed_tokens trained in full (modules_to_save: the trained copies in place of the originals),
// and DoRA (each row scaled to its magnitude).
TEST(Eval, LlamaMergedExportIsPeftsMergeAndUnload) {
  TempDir dir("eval_merge_llama");
  eval_text(dir);
  PythonBatch peft = peft_batch(dir, "peft");  // imports while memrt trains
  const fs::path model = make_model("llama");
  std::vector<std::string> compared;
  for (const std::string name : {"saved", "dora"}) {
    const fs::path out = dir.path() / name, merged = dir.path() / (name + "_merged");
    const std::string yaml = dir.write(name + ".yaml", "model_name_or_path: " + model.string() +
                                                           "\nadapter_name_or_path: " + (model / name).string() +
                                                           "\nblock_size: 32\nmax_steps: 1\nsave_steps: 1\n"
                                                           "learning_rate: 1.0e-2\n");
    const RunResult r = run(kLauncher + " --deepspeed " + dir.write(name + ".json", kDs) + " " + yaml +
                            " --output_dir=" + out.string());
    ASSERT_EQ(r.exit_code, 0) << r.out;
    const RunResult e = run(kLauncher + " export " + (out / "global_step1").string() + " " + merged.string() + " --merge");
    ASSERT_EQ(e.exit_code, 0) << e.out;
    compared.push_back((dir.path() / (name + "_compared.json")).string());
    peft.add({"merged", model.string(), (out / "global_step1").string(), merged.string(), compared.back()});
  }
  ASSERT_TRUE(peft.run());
  for (const std::string& file : compared) {
    SCOPED_TRACE(file);
    const rapidjson::Document d = read_json(file);
    EXPECT_EQ(d["tensors"].GetInt(), 21);
    EXPECT_LT(d["worst"].GetDouble(), 1e-6);
  }
}

// PiSSA and OLoRA (init_lora_weights "pissa" / "olora") on a Llama's projections: the adapter a run
// saves is PEFT's conversion to a plain LoRA on the original model — r 8, alpha 16, init true,
// its second half A0 and -B0 as PEFT's get_peft_model initialises them (within 1e-5 of their
// largest value) — which PEFT, on the original model, evaluates to the loss the run's eval_file gave
// at its end (1e-5); `export --merge` is PEFT's merge_and_unload of it (1e-6). The run's peak,
// A0 and B0 kept as adapters, is its estimate to the byte.
TEST(Eval, PissaAndOloraStartAsPeftAndSaveAPlainLora) {
  TempDir dir("eval_pissa");
  eval_text(dir);
  PythonBatch peft = peft_batch(dir, "peft");  // imports while memrt trains
  const fs::path model = make_model("llama");
  struct Job {
    std::string init, losses, compared_init, compared_merge;
  };
  std::vector<Job> jobs;
  for (const std::string init : {"pissa", "olora"}) {
    const fs::path out = dir.path() / init, merged = dir.path() / (init + "_merged");
    const RunResult r = run(kLauncher + " --deepspeed " + dir.write(init + ".json", kDs) + " " +
                            dir.write(init + ".yaml", "model_name_or_path: " + model.string() +
                                                          "\nuse_peft: true\nlora_r: 4\nlora_alpha: 8\n"
                                                          "lora_target_modules: all-linear\ninit_lora_weights: " +
                                                          init + "\nblock_size: 32\nmax_steps: 2\nsave_steps: 2\n"
                                                          "learning_rate: 1.0e-2\neval_file: " +
                                                          (dir.path() / "eval.txt").string() + "\n") +
                            " --output_dir=" + out.string());
    ASSERT_EQ(r.exit_code, 0) << r.out;
    expect_peak_as_estimated(out);
    const fs::path step2 = out / "global_step2";
    const RunResult e = run(kLauncher + " export " + step2.string() + " " + merged.string() + " --merge");
    ASSERT_EQ(e.exit_code, 0) << e.out;
    Job job{init, queue_losses(peft, dir, model, {step2.string()}), (dir.path() / (init + "_init.json")).string(),
            (dir.path() / (init + "_merged.json")).string()};
    peft.add({"compare_init", model.string(), init, step2.string(), job.compared_init});
    peft.add({"merged", model.string(), step2.string(), merged.string(), job.compared_merge});
    jobs.push_back(job);
  }
  ASSERT_TRUE(peft.run());
  for (const Job& job : jobs) {
    SCOPED_TRACE(job.init);
    const rapidjson::Document d = read_json(job.compared_init);
    EXPECT_EQ(d["tensors"].GetInt(), 28);
    EXPECT_LT(d["worst"].GetDouble(), 1e-5);
    EXPECT_EQ(d["config"]["r"].GetInt(), 8);
    EXPECT_EQ(d["config"]["lora_alpha"].GetDouble(), 16.0);
    EXPECT_TRUE(d["config"]["init_lora_weights"].IsTrue());
    const std::vector<double> want = read_losses(job.losses);
    ASSERT_EQ(want.size(), 2u);
    EXPECT_GT(relative(want[1], want[0]), 1e-3) << "two steps moved the adapters";
    EXPECT_LT(relative(read_json(dir.path() / job.init / "eval.json")["loss"].GetDouble(), want[1]), 1e-5);
    const rapidjson::Document m = read_json(job.compared_merge);
    EXPECT_EQ(m["tensors"].GetInt(), 21);
    EXPECT_LT(m["worst"].GetDouble(), 1e-6);
  }
}

// lora_modules_to_save (HF/TRL, axolotl; LLaMA-Factory's additional_target) trains lm_head and the
// token embedding in full beside the adapters: the run's peak is its estimate to the byte, and the
// checkpoint's adapter file — the modules included — loads in PEFT with `launcher eval`'s loss.
TEST(Eval, ModulesToSaveTrainAsEstimatedAndReloadInPeft) {
  TempDir dir("eval_saved");
  eval_text(dir);
  const fs::path model = make_model("llama");
  const fs::path out = dir.path() / "run";
  const RunResult r = train_run(dir, model, "adapter: lora\nlora_r: 4\nlora_target_linear: true\n"
                                            "additional_target: lm_head,embed_tokens\nmax_steps: 2\n"
                                            "learning_rate: 1.0e-2\nsave_steps: 2\n");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("(30 trainable tensors)"), std::string::npos) << "28 adapters, lm_head, embed_tokens\n" << r.out;
  expect_peak_as_estimated(out);
  const double trained = read_json(out / "eval.json")["loss"].GetDouble();
  const std::vector<double> peft = peft_losses(dir, model, {(out / "global_step2").string()});
  ASSERT_EQ(peft.size(), 2u);
  EXPECT_LT(relative(trained, peft[1]), 1e-5);

  // A tied embedding cannot train apart from the head: an error naming the key.
  const RunResult tied = run(kLauncher + " --deepspeed " + dir.write("ds2.json", kDs) + " " +
                             dir.write("tied.yaml", "model: {arch: gpt2, n_layer: 1, n_head: 2, d_model: 32, d_ff: 64, "
                                                    "vocab_size: 256, n_ctx: 32}\nblock_size: 32\nuse_peft: true\n"
                                                    "lora_modules_to_save: [lm_head]\n") +
                             " --output_dir=" + (dir.path() / "tied").string());
  EXPECT_NE(tied.exit_code, 0);
  EXPECT_NE(tied.out.find("lora_modules_to_save"), std::string::npos) << tied.out;
  EXPECT_NE(tied.out.find("ties lm_head to the token embedding"), std::string::npos) << tied.out;
}

// Training on from an adapter with PEFT's bias: all, the biases train with the adapters, the run's
// peak is its estimate to the byte (without dropout, whose term is an upper bound), and the
// checkpoint's adapter — biases included — loads in PEFT with `launcher eval`'s loss.
TEST(Eval, BiasModeTrainsAsEstimatedAndReloadsInPeft) {
  TempDir dir("eval_bias");
  eval_text(dir);
  const fs::path model = make_model("gpt2");
  const fs::path out = dir.path() / "run";
  const RunResult r = train_run(dir, model, "lora_model_dir: " + (model / "bias_all").string() +
                                                "\nlora_dropout: 0.0\nmax_steps: 2\nlearning_rate: 1.0e-2\nsave_steps: 2\n");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("(29 trainable tensors)"), std::string::npos) << "16 adapters, 13 biases\n" << r.out;
  expect_peak_as_estimated(out);
  const double trained = read_json(out / "eval.json")["loss"].GetDouble();
  const std::vector<double> peft = peft_losses(dir, model, {(out / "global_step2").string(), (model / "bias_all").string()});
  ASSERT_EQ(peft.size(), 3u);
  EXPECT_LT(relative(trained, peft[1]), 1e-5);
  EXPECT_GT(relative(peft[1], peft[2]), 1e-4) << "training moved the adapter";
}

// A Llama with PEFT's adapters (modules_to_save too), on its fp32 base and on a 4-bit one: QLoRA's NF4 with double
// quantization and fp32 compute, quantized as the model loads and read from the directory
// bitsandbytes saved, against transformers + bitsandbytes + PEFT within 2e-5 — a bound that tells
// the 4-bit base from the full one. Two ranks share the windows and agree with one. The trainable
// parameters are counted as PEFT counts them, a 4-bit weight by the elements it stands for.
TEST(Eval, LlamaAndQLoraAsInPeftAndBitsandbytes) {
  TempDir dir("eval_llama");
  eval_text(dir);
  PythonBatch peft = peft_batch(dir, "peft");
  const fs::path model = queue_model(peft, dir, "llama");
  const std::string lora = (model / "lora").string(), rslora = (model / "rslora").string();
  const std::string saved = (model / "saved").string(), dora = (model / "dora").string();
  const fs::path saved4 = dir.path() / "llama_bnb4";
  const std::string full = queue_losses(peft, dir, model, {lora, rslora, saved, dora});
  const std::string nf4 = queue_losses(peft, dir, model, {"--nf4", "--save", saved4.string(), lora, dora});
  // QDoRA's reference: PEFT's DoRA on the 4-bit weights as bitsandbytes dequantizes them.
  const std::string dequantized = queue_losses(peft, dir, model, {"--nf4", "--dequantize", dora});
  ASSERT_TRUE(peft.run());
  std::vector<std::string> lines, lines4;
  const std::vector<double> want = read_losses(full, &lines), want4 = read_losses(nf4, &lines4);
  ASSERT_EQ(lines.size(), 4u);
  ASSERT_EQ(lines4.size(), 2u);
  ASSERT_EQ(want.size(), 5u);
  ASSERT_EQ(want4.size(), 3u);
  EXPECT_GT(relative(want4[1], want[1]), 2e-5) << "4-bit rounding moves the loss by more than the bound";

  const std::string base = "model_name_or_path: " + model.string() + "\n";
  EXPECT_LT(relative(launcher_eval(dir, "lora", base + "adapter_name_or_path: " + lora + "\n", "", lines[0])["loss"]
                         .GetDouble(), want[1]), 1e-5);
  const double two_ranks = launcher_eval(dir, "lora2", base + "adapter_name_or_path: " + lora + "\n",
                                         "--num_procs 2 --master_port " + std::to_string(free_port()))["loss"]
                               .GetDouble();
  EXPECT_LT(relative(two_ranks, want[1]), 1e-5);
  EXPECT_LT(relative(launcher_eval(dir, "rslora", base + "adapter_name_or_path: " + rslora + "\n")["loss"].GetDouble(),
                     want[2]), 1e-5);
  // modules_to_save: lm_head and embed_tokens as the adapter saved them.
  EXPECT_GT(relative(want[3], want[1]), 3e-5) << "the saved modules change the loss by more than the bound";
  EXPECT_LT(relative(launcher_eval(dir, "saved", base + "adapter_name_or_path: " + saved + "\n")["loss"].GetDouble(),
                     want[3]), 1e-5);
  EXPECT_LT(relative(launcher_eval(dir, "dora", base + "adapter_name_or_path: " + dora + "\n", "", lines[3])["loss"]
                         .GetDouble(), want[4]), 1e-5);
  const std::string qlora = "adapter: qlora\nlora_model_dir: " + lora +
                            "\nload_in_4bit: true\nbnb_4bit_quant_type: nf4\nbnb_4bit_use_double_quant: true\n"
                            "bnb_4bit_compute_dtype: float32\n";
  EXPECT_LT(relative(launcher_eval(dir, "qlora", base + qlora, "", lines4[0])["loss"].GetDouble(), want4[1]), 2e-5);
  // QDoRA: DoRA's norm over the 4-bit weight as bitsandbytes dequantizes it, against PEFT's DoRA on
  // those dequantized weights (PEFT + bitsandbytes' own QDoRA on a CPU lands ~2e-4 away from both:
  // measured, not explained; see docs/lora.md).
  const std::vector<double> want_dq = read_losses(dequantized);
  ASSERT_EQ(want_dq.size(), 2u);
  const std::string qdora = "adapter: qlora\nlora_model_dir: " + dora +
                            "\nload_in_4bit: true\nbnb_4bit_quant_type: nf4\nbnb_4bit_use_double_quant: true\n"
                            "bnb_4bit_compute_dtype: float32\n";
  EXPECT_LT(relative(launcher_eval(dir, "qdora", base + qdora, "", lines4[1])["loss"].GetDouble(), want_dq[1]), 1e-5);
  EXPECT_LT(relative(launcher_eval(dir, "qlora_saved", "model_name_or_path: " + saved4.string() + "\n" + qlora)["loss"]
                         .GetDouble(), want4[1]), 2e-5);
}

// eval_file + eval_steps while training: eval_loss in metrics.jsonl at every eval_steps and at the
// end, eval.json the last; `launcher eval --resume` of the saved checkpoint gives the same loss
// and leaves metrics.jsonl as it was; the adapter the run saved (output_dir/adapter/), loaded by
// PEFT, gives it too.
TEST(Eval, PeriodicEvalLauncherEvalAndPeftAgree) {
  TempDir dir("eval_periodic");
  eval_text(dir);
  const fs::path model = make_model("gpt2");
  const fs::path out = dir.path() / "run";
  const RunResult r = train_run(dir, model, "use_peft: true\nlora_r: 4\nlora_target_modules: all-linear\n"
                                            "max_steps: 5\nlogging_steps: 1\nlearning_rate: 1.0e-2\nsave_steps: 5\n"
                                            "eval_steps: 2\n");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("eval     2/5 | eval_loss"), std::string::npos) << r.out;
  EXPECT_EQ(losses(out).size(), 5u);
  EXPECT_EQ(metric(out, "eval_loss").size(), 3u) << "steps 2, 4 and the last";
  const std::vector<double> steps = metric(out, "step");
  ASSERT_EQ(steps.size(), 8u);
  const std::vector<double> evals = metric(out, "eval_loss");
  ASSERT_EQ(evals.size(), 3u);
  EXPECT_LT(evals.back(), evals.front()) << "training lowers the held-out loss";
  const rapidjson::Document last = read_json(out / "eval.json");
  EXPECT_EQ(last["step"].GetInt64(), 5);
  EXPECT_EQ(last["loss"].GetDouble(), evals.back());

  const std::string history = slurp(out / "metrics.jsonl");
  const RunResult e = run(kLauncher + " eval --deepspeed " + (dir.path() / "ds.json").string() + " " +
                          (dir.path() / "train.yaml").string() + " --output_dir=" + out.string() + " --resume");
  ASSERT_EQ(e.exit_code, 0) << e.out;
  EXPECT_NE(e.out.find("eval of the model at step 5"), std::string::npos) << e.out;
  EXPECT_EQ(read_json(out / "eval.json")["loss"].GetDouble(), evals.back());
  EXPECT_EQ(slurp(out / "metrics.jsonl"), history);

  // output_dir/adapter/: the newest checkpoint's adapter, as Hugging Face Trainer leaves it.
  EXPECT_EQ(slurp(out / "adapter" / "adapter_model.safetensors"), slurp(out / "global_step5" / "adapter_model.safetensors"));
  const std::vector<double> peft = peft_losses(dir, model, {(out / "adapter").string()});
  ASSERT_EQ(peft.size(), 2u);
  EXPECT_LT(relative(evals.back(), peft[1]), 1e-5);
}

// `launcher eval` of a checkpoint trained in bf16 with fp32 masters and AdamW under ZeRO-2 builds a
// store of the weights alone: no masters, gradients or optimizer state are planned or allocated
// (its peak is below what those took in training), and it gives the training's own final eval_loss
// bit for bit on one rank — the compute copy read from the checkpoint rounds as the step's
// write-back did — and within rounding on two ranks, each reading its partition.
TEST(Eval, LauncherEvalOfACheckpointKeepsTheWeightsAlone) {
  TempDir dir("eval_weights_only");
  const std::string text = eval_text(dir);
  const std::string yaml = dir.write("train.yaml",
      "model: {arch: gpt2, n_layer: 2, n_head: 2, d_model: 64, d_ff: 256, vocab_size: 256, n_ctx: 32}\n"
      "block_size: 32\ntrain_file: " + text + "\neval_file: " + text + "\nmax_steps: 3\nsave_steps: 3\n");
  const std::string ds = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, )"
                                              R"("bf16": {"enabled": true}, "zero_optimization": {"stage": 2}})");
  const fs::path out = dir.path() / "run";
  const RunResult r = run(kLauncher + " --deepspeed " + ds + " " + yaml + " --output_dir=" + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const double trained = read_json(out / "eval.json")["loss"].GetDouble();
  const rapidjson::Document report = read_json(out / "memory_report.json");
  const auto& measured = report["ranks"][0]["measured"]["categories"];
  int64_t optimizer_side = 0;
  for (const char* cat : {"master_weights", "optimizer_state"}) optimizer_side += measured[cat]["device"].GetInt64();
  ASSERT_GT(optimizer_side, 0);

  for (int ranks : {1, 2}) {
    const RunResult e = run(kLauncher + " eval --num_procs " + std::to_string(ranks) + " --master_port " +
                            std::to_string(free_port()) + " --deepspeed " + ds + " " + yaml + " --output_dir=" +
                            out.string() + " --resume");
    ASSERT_EQ(e.exit_code, 0) << e.out;
    const std::string store = e.out.substr(e.out.find("parameter store:"));
    const std::string groups = store.substr(0, store.find("model: "));
    EXPECT_NE(groups.find("compute bf16 full"), std::string::npos) << groups;
    for (const char* absent : {"master", "grad", "state"}) EXPECT_EQ(groups.find(absent), std::string::npos) << groups;
    const size_t at = e.out.find("memory: peak ");
    ASSERT_NE(at, std::string::npos) << e.out;
    const double peak = std::stod(e.out.substr(at + 13)) * 1e6;
    EXPECT_LT(peak, static_cast<double>(optimizer_side)) << e.out;
    const double loss = read_json(out / "eval.json")["loss"].GetDouble();
    if (ranks == 1) {
      EXPECT_EQ(loss, trained);
    } else {
      EXPECT_LT(relative(loss, trained), 1e-6);
    }
  }
}

// A model directory with a tokenizer.json (Llama-3 kind, trained by `tokenizers` at test time): the
// train and eval files are tokenized with it, the run says so, evaluation covers exactly the
// windows of its tokens (as many as Hugging Face's run_clm tokenization of the eval file makes), and
// the tokens are cached in dataset_prepared_path; on a terminal each file draws a progress bar while it
// is tokenized.
TEST(Eval, TheModelsTokenizerTokenizesTrainAndEvalFiles) {
  TempDir dir("eval_tokenizer");
  const fs::path tok = dir.path() / "tok";
  const RunResult made = run(std::string(MEMRT_PYTHON) + " " + MEMRT_SOURCE_DIR + "/tests/data/hf_tokenizers.py " +
                             tok.string());
  ASSERT_EQ(made.exit_code, 0) << made.out;
  const std::string model =
      "model: {arch: llama, n_layer: 1, n_head: 2, n_kv_head: 2, d_model: 32, d_ff: 64, vocab_size: 1300, n_ctx: 32}\n"
      "block_size: 32\nmax_steps: 1\nsave_steps: 1\n";
  ASSERT_EQ(run(kLauncher + " --deepspeed " + dir.write("ds.json", kDs) + " " + dir.write("init.yaml", model) +
                " --output_dir=" + (dir.path() / "init").string()).exit_code, 0);
  const fs::path base = dir.path() / "base";
  ASSERT_EQ(run(kLauncher + " export " + (dir.path() / "init").string() + " " + base.string()).exit_code, 0);
  fs::copy_file(tok / "llama3" / "tokenizer.json", base / "tokenizer.json");
  const fs::path out = dir.path() / "run";
  // On a terminal (util-linux's `script` gives the run one), each file's tokenization draws a bar.
  const RunResult r = run("script -qec '" + kLauncher + " --deepspeed " + (dir.path() / "ds.json").string() + " " +
                          dir.write("train.yaml", "model_name_or_path: " + base.string() + "\nblock_size: 32\n"
                                                  "dataset_prepared_path: " + (dir.path() / "prepared").string() + "\n"
                                                  "max_steps: 2\ntrain_file: " + (tok / "data.txt").string() +
                                                  "\neval_file: " + (tok / "data.jsonl").string() + "\n") +
                          " --output_dir=" + out.string() + "' /dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("tokens of " + (base / "tokenizer.json").string() + ": BPE"), std::string::npos) << r.out;
  for (const char* file : {"data.txt", "data.jsonl"})
    EXPECT_NE(r.out.find("tokenizing " + (tok / file).string() + " [##############################] 100%"), std::string::npos)
        << r.out;
  const int64_t eval_tokens = static_cast<int64_t>(read_json(tok / "llama3" / "expected.json")["jsonl_ids"].Size());
  EXPECT_EQ(read_json(out / "eval.json")["windows"].GetInt64(), eval_tokens / 32);
  // Both files tokenized once, into axolotl's dataset_prepared_path: llm.c token files and their notes.
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir.path() / "prepared")) entries += e.path().extension() == ".bin";
  EXPECT_EQ(entries, 2);
}

// Hugging Face's eval_strategy: epoch evaluates at each epoch's last step; axolotl's evals_per_epoch
// every ceil(steps per epoch / n) steps (the eval_steps it derives); both once more at the end.
TEST(Eval, EpochStrategiesEvaluateWhereHuggingFaceAndAxolotlDo) {
  TempDir dir("eval_epochs");
  const std::string text = eval_text(dir);  // trained on and evaluated: 24 steps an epoch
  const std::string model =
      "model: {arch: gpt2, n_layer: 1, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 256, n_ctx: 32}\nblock_size: 32\n"
      "train_file: " + text + "\neval_file: " + text + "\nnum_train_epochs: 2\nlogging_steps: 1\n";
  auto eval_steps = [&](const std::string& name, const std::string& keys) {
    const fs::path out = dir.path() / name;
    const RunResult r = run(kLauncher + " --deepspeed " + dir.write("ds.json", kDs) + " " +
                            dir.write(name + ".yaml", model + keys) + " --output_dir=" + out.string());
    EXPECT_EQ(r.exit_code, 0) << r.out;
    std::vector<int64_t> steps;
    std::istringstream lines(slurp(out / "metrics.jsonl"));
    for (std::string line; std::getline(lines, line);) {
      rapidjson::Document d;
      d.Parse(line.c_str());
      if (d.IsObject() && d.HasMember("eval_loss")) steps.push_back(d["step"].GetInt64());
    }
    return std::make_pair(steps, static_cast<int64_t>(losses(out).size()) / 2);
  };
  const auto [per_epoch, epoch] = eval_steps("epoch", "eval_strategy: epoch\n");
  ASSERT_GT(epoch, 3);
  EXPECT_EQ(per_epoch, (std::vector<int64_t>{epoch, 2 * epoch}));
  const auto [five, epoch5] = eval_steps("five", "evals_per_epoch: 5\n");
  ASSERT_EQ(epoch5, epoch);
  ASSERT_NE(epoch % 5, 0) << "rounding up and down differ";
  const int64_t every = (epoch + 4) / 5;
  std::vector<int64_t> want;
  for (int64_t s = every; s <= 2 * epoch; s += every) want.push_back(s);
  if (want.back() != 2 * epoch) want.push_back(2 * epoch);
  EXPECT_EQ(five, want);
}

// Evaluation asked for without the file to evaluate is a note (the training is the same) or, from
// `launcher eval`, an error naming the key; a file that cannot be evaluated is an error naming it.
TEST(Eval, AWrongEvalConfigIsAnErrorNamingTheKey) {
  TempDir dir("eval_errors");
  const std::string ds = dir.write("ds.json", kDs);
  const std::string tiny = dir.write("tiny.txt", "too short");
  const std::string model =
      "model: {arch: gpt2, n_layer: 1, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 256, n_ctx: 32}\nblock_size: 32\n";
  struct Case {
    std::string command, yaml;
    bool fails;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"eval", "", true, {"eval_file", "is not set", "--eval_file=FILE"}},
      {"", "eval_steps: 10\n", false, {"warning", "eval_steps", "no eval_file is set: nothing is evaluated"}},
      {"", "eval_strategy: epoch\n", false, {"warning", "eval_strategy", "no eval_file is set"}},
      {"", "eval_file: " + tiny + "\neval_strategy: sometimes\n", true, {"eval_strategy", "\"sometimes\"", "\"steps\""}},
      {"", "eval_file: " + (dir.path() / "missing.txt").string() + "\n", true, {"eval_file", "missing.txt", "not a file"}},
      {"eval", "eval_file: " + tiny + "\n", true, {"tiny.txt", "9 tokens", "fewer than one evaluation window"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const fs::path out = dir.path() / ("case" + std::to_string(i));
    const RunResult r = run(kLauncher + " " + cases[i].command + " --deepspeed " + ds + " " +
                            dir.write("case" + std::to_string(i) + ".yaml", model + cases[i].yaml) +
                            " --max_steps=1 --output_dir=" + out.string());
    EXPECT_EQ(r.exit_code != 0, cases[i].fails) << cases[i].yaml << r.out;
    for (const std::string& s : cases[i].says) EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
    if (!cases[i].fails) {
      EXPECT_FALSE(fs::exists(out / "eval.json")) << cases[i].yaml;
    }
  }
}
