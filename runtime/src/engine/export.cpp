// `launcher export`: a checkpoint's store consolidated into a Hugging Face directory (engine.h).
#include <filesystem>

#include <ATen/ATen.h>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/store_checkpoint.h"
#include "engine/engine.h"
#include "models/hf_checkpoint.h"
#include "models/model_factory.h"

namespace memrt {

namespace fs = std::filesystem;

std::string export_checkpoint(const std::string& checkpoint, const std::string& out_dir) {
  const std::string dir = fs::exists(fs::path(checkpoint) / "manifest.json")
                              ? checkpoint
                              : checkpoint_dir(checkpoint, "");
  const Manifest m = read_manifest(dir);
  for (const char* name : {"config.json", kStoreLayoutFile}) verify_checkpoint_file(dir, m, name);
  std::shared_ptr<CausalLM> model = build_model(read_hf_config(dir), BuildOptions{});  // fp32

  // Each parameter whole, from the store's shards of every rank: its exact weight (the fp32
  // master where the run kept one).
  RankFiles files(dir, m);
  const SavedStore saved(dir, std::ref(files));
  at::NoGradGuard no_grad;
  int64_t tensors = 0;
  for (auto& item : model->named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    if (saved.contains(name) && !saved.trainable(name) && !saved.frozen_format(name).empty()) {
      throw FileError(saved.path(), "keeps '" + name + "' quantized (\"" + saved.frozen_format(name) +
                                    "\", by the plugin that froze it); export writes full-precision weights and "
                                    "cannot export a quantized base yet");
    }
    if (!saved.contains(name) || saved.shape(name) != item.value().sizes().vec()) {
      throw FileError(saved.path(), "has no parameter '" + name + "' of the shape the model in config.json "
                                    "gives it: the run changed the model's modules (e.g. adapters), "
                                    "which export does not merge");
    }
    saved.read(name, "weight", 0, item.value());
    ++tensors;
  }
  if (tensors != static_cast<int64_t>(saved.param_names().size())) {
    throw FileError(saved.path(), "lists " + std::to_string(saved.param_names().size()) +
                                      " parameters; the model in config.json has " +
                                      std::to_string(tensors) +
                                      ": the run changed the model's modules, which export does not merge");
  }
  save_hf_checkpoint(*model, out_dir);
  return "exported " + dir + " to " + out_dir + ": config.json, model.safetensors (fp32, " +
         std::to_string(count_parameters(*model)) + " parameters in " + std::to_string(tensors) +
         " tensors, from the exact weights saved by " + std::to_string(m.world_size) + " rank(s))";
}

}  // namespace memrt
