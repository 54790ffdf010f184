// Hugging Face checkpoint directories: config.json + model.safetensors, or sharded as
// model-0000K-of-0000N.safetensors + model.safetensors.index.json ({"metadata": {"total_size"},
// "weight_map": {tensor name: shard file}}). Tensor names are Hugging Face's.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "memrt/safetensors.h"
#include "memrt/model.h"
#include "memrt/model_shape.h"
#include "models/model_factory.h"

namespace memrt {

// The shape described by <dir>/config.json. model_type "gpt2" (activation_function gelu_new) or
// "llama" (hidden_act silu, no rope_scaling, no attention/mlp biases); anything else is a
// memrt::ConfigError naming config.json, the key and what is supported. Absent keys take
// transformers' defaults for that model_type.
ModelShape read_hf_config(const std::string& dir);

// The config.json transformers would write for `shape` (architectures, model_type, sizes).
std::string hf_config_json(const ModelShape& shape, double init_std = 0.02);

// The weights of a checkpoint directory, memory-mapped (nothing is read until used).
class HfWeights final : public CheckpointReader {
 public:
  // Opens model.safetensors, or the shards listed by model.safetensors.index.json.
  static HfWeights open(const std::string& dir);

  // Strict check against the model to be built (call once before tensor()): every spec present with its shape (HF layout)
  // and a floating dtype, no unexpected tensor (the non-parameter buffers transformers itself
  // ignores — GPT-2's attn.bias / attn.masked_bias masks, Llama's rotary_emb.inv_freq — are
  // skipped), a tied lm_head present on disk must equal the embedding. Checkpoints saved from
  // the base model (GPT2Model: "h.0..." without "transformer.") are accepted too.
  // Violations: memrt::FileError naming the tensor and the file.
  // `replaced`: parameters a plugin replaces (memrt/model.h, CheckpointReader). One stored as a
  // non-floating tensor is the plugin's to read — its shape, dtype and companion tensors
  // "<name>.<suffix>" are not checked here, and plugin_reads() says so; one stored in floating
  // point is checked and loaded as any other (the plugin converts it).
  void check(const ModelShape& shape, const std::vector<ParamSpec>& specs,
             const std::set<std::string>& replaced = {});
  bool plugin_reads(const std::string& name) const { return plugin_reads_.count(name) > 0; }

  // CheckpointReader: any tensor by Hugging Face name (base-model files' names resolved as check() found them).
  bool contains(const std::string& name) const override;
  at::Tensor tensor(const std::string& name) const override;
  std::string file_of(const std::string& name) const override;

  // The tensor for `spec`, in the model's layout (transposed view for Conv1D weights), viewing the
  // mapped file in its dtype on disk; copy_ it into the parameter to convert.
  at::Tensor tensor(const ParamSpec& spec) const;
  // What build_model copies into a parameter: the tensor for `spec` in the model's layout or, with
  // `keep`, its elements [keep.begin, keep.end) flat — viewing the mapped file, with the pages they
  // occupy asked of the kernel ahead of the copy (MADV_WILLNEED) so that no page fault reads around
  // them: what is read of the file is what is copied. (A GPT-2 Conv1D weight is transposed on disk:
  // the rows holding a slice are copied, and every page of the tensor read.)
  at::Tensor read(const ParamSpec& spec, const std::optional<ElementRange>& keep = std::nullopt) const;
  // After copying `spec` out: let the kernel drop its file pages (SafetensorsFile::drop_pages).
  void drop_pages(const ParamSpec& spec) const;

  // Every tensor name on disk, and the file holding it.
  const std::map<std::string, std::string>& files_by_name() const { return file_of_; }

 private:
  struct Located {
    const SafetensorsFile* file;
    std::string key;  // the name on disk
  };
  std::string key_of(const std::string& hf_name) const;  // the name on disk (base-model files: no prefix)
  at::Tensor mapped(const ParamSpec& spec) const;        // tensor(spec) without reading ahead
  Located locate(const std::string& hf_name) const;      // FileError when absent

  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> by_name_;
  std::map<std::string, std::string> file_of_;
  std::string strip_prefix_;  // "transformer." / "model." when the file has base-model names
  std::set<std::string> plugin_reads_;
};

// Writes <dir>/config.json and the weights with HF names (GPT-2 Conv1D weights transposed back to
// (in, out); a tied lm_head omitted, as transformers does), metadata {"format": "pt"}.
// max_shard_bytes > 0 splits the weights into model-0000K-of-0000N.safetensors files of at most
// that many bytes (a larger tensor gets a shard of its own) plus model.safetensors.index.json;
// otherwise one model.safetensors. Creates `dir` if needed; every file is written atomically and
// weight files of the other layout left from an earlier save are removed. A parameter a plugin
// replaced (LoRA, NF4) is a memrt::Error: merge it back first.
void save_hf_checkpoint(CausalLM& model, const std::string& dir, int64_t max_shard_bytes = 0);
// The same files from tensors already in Hugging Face's names and layout, in the order given, and
// the text of config.json; each tensor written in as[i] when given (io/safetensors_write.h: converted
// as it is written, one at a time).
void save_hf_tensors(const std::string& dir, const std::string& config_json,
                     const std::vector<std::pair<std::string, at::Tensor>>& tensors, int64_t max_shard_bytes = 0,
                     const std::vector<at::ScalarType>& as = {});

}  // namespace memrt
