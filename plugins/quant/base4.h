// plugins/quant/base4.h — a model's 4-bit frozen base (load_in_4bit): which weights become NF4/FP4,
// how they are planned, quantized as each block is built, and laid out in the store
// (docs/quant.md, "4-bit frozen weights").
//
//   plan_params     every 2-D weight inside the blocks (the projections: GPT-2's c_attn, c_proj,
//                   c_fc, Llama's q/k/v/o, gate/up/down) becomes its packed codes: uint8
//                   [ceil(n/2), 1], frozen, and its layer's bias is frozen with it. Embeddings,
//                   norms and lm_head keep their dtype and trainability (bitsandbytes quantizes
//                   Linear layers only, never lm_head).
//   on_block_ready  each such projection is quantized and replaced by a Linear4bit: the block's
//                   full-precision weights are freed before the next block is built.
//   plan_store      each one's frozen layout (linear4bit_layout): codes and scales as quant_state.
//   memory          the tile scratch every Linear4bit shares, claimed and estimated as `other`.
//   export_model    each one as transformers saves a bitsandbytes model (the format read_bnb4bit
//                   reads), and config.json's quantization_config.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <memrt/model.h>
#include <memrt/param_store.h>

#include "linear4bit.h"

namespace memrt {
struct ExportContext;
}

namespace memrt::quant {

struct Base4Options {
  Map4 type = Map4::kNf4;     // bnb_4bit_quant_type
  bool double_quant = true;   // bnb_4bit_use_double_quant
  std::optional<at::ScalarType> compute_dtype;  // bnb_4bit_compute_dtype; unset: the run's
};

// A projection weight as transformers saves a bitsandbytes 4-bit model: `name` uint8 [ceil(n/2), 1],
// name.absmax, name.quant_map, name.quant_state.bitsandbytes__<nf4|fp4> (the JSON of
// QuantState.as_dict: quant_type, blocksize, shape, dtype, and with double quantization
// nested_blocksize, nested_offset) and, with it, name.nested_absmax and name.nested_quant_map.
// Checked against `shape` (out, in) and `options` (the maps bit for bit, the block sizes memrt
// uses: 64 and 256); each mismatch a memrt::FileError naming the file and tensor.
Quantized4 read_bnb4bit(const CheckpointReader& checkpoint, const std::string& name,
                        const std::vector<int64_t>& shape, const Base4Options& options);

class Base4 {
 public:
  explicit Base4(Base4Options options) : options_(options) {}

  // Replaces every block projection's weight by its packed codes and freezes its bias (both of the
  // host's calls: on the shapes, where it records each weight's (out, in), and on the built model,
  // already quantized); names each weight and bias in `reads_frozen`, as quantize reads them.
  void plan_params(std::vector<ParamInfo>& params, std::set<std::string>& reads_frozen);
  // Installs a Linear4bit for each of block `block`'s planned projections: read as stored where
  // `checkpoint` (may be nullptr) holds it in bitsandbytes' 4-bit format (read_bnb4bit), else
  // quantized from the weight the block was built with.
  void quantize(Block& block, const CheckpointReader* checkpoint);
  void plan_store(StorePlan& plan) const;
  // `launcher export`: every planned weight the checkpoint saved in this format, written as
  // read_bnb4bit reads it, marked handled; and quantization_config as BitsAndBytesConfig writes it.
  // With --merge (ExportContext::merge), each written dequantized instead (bitsandbytes'
  // dequantize_4bit, fp32, Hugging Face's layout) and no quantization_config: a plain model that a
  // later plugin folds its adapters into.
  void export_model(ExportContext& ctx) const;
  // The tile scratch every Linear4bit shares (fp32 or 16-bit tiles, whichever is larger).
  int64_t scratch_bytes() const;

 private:
  Base4Options options_;
  std::map<std::string, std::vector<int64_t>> shapes_;  // quantized weight -> (out, in)
  std::shared_ptr<const TileScratch> scratch_;
};

}  // namespace memrt::quant
