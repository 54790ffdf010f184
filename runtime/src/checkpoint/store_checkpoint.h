// The parameter store's part of a training-state checkpoint (docs/checkpoints.md, "The store"):
// saved as shards of flat buffers with a layout file, loadable on any number of ranks.
//
// What is saved of each group: "weight" — the parameters' exact values, i.e. the fp32 master when
// the group has one, else the compute buffer — and each tensor of its optimizer state format
// (exp_avg, ...; a quantized format's codes and scales). Whatever a buffer's extent in the run
// (full or partition), the checkpoint splits it evenly: of N saving ranks, rank r writes elements
// [r * padded / N, (r + 1) * padded / N) of every saved buffer (a state tensor of one value per v
// elements: values [r * padded / N / v, ...)) as "store/<group>/<buffer>", so replicated buffers
// are written once in all and every rank writes an equal share. Frozen parameters are written
// whole, with the module buffers their layout names, as "store/frozen/<tensor name>", each by one
// rank chosen by its name (spread, so no rank writes the whole frozen base) — unless they came from
// a base model's directory (BaseSource): then none is written, "base" records the directory and
// its fingerprint, each frozen entry has "rank": null, and readers take them from that directory
// (resume: the run's own model, built from it; export: rebuilt from it). A frozen parameter that
// ZeRO-3 partitions (StorePlan::frozen_partition) is written by every rank, its share
// [r * c, (r + 1) * c) of the flat elements, c = ceil(numel / N) ("rank": "shares"). Rank 0 writes store.json,
// the layout (abridged; the main job's):
//
//   {"format": "memrt-store", "version": 4, "world_size": N, "state": ["exp_avg", "exp_avg_sq"],
//    "groups": [{"name": "decay", "numel": 3257856, "padded": 3257856,
//                "buffers": {"weight": "F32", "exp_avg": "F32", "exp_avg_sq": "F32"},
//                "state_format": {"name": "fp32", "block": 1, "blocks_per_tensor": false,
//                                 "per_value": {"exp_avg": 1, "exp_avg_sq": 1}},
//                "params": [{"name": "transformer.wte.weight", "shape": [256, 256],
//                            "offset": 0}, ...]}, ...],
//    "frozen": [{"name": ..., "shape": [...], "dtype": "BF16", "rank": 1, "format": "",
//                "buffers": [{"name": ..., "dtype": "F32", "shape": [...]}]}],
//    "base": null | {"dir": ..., "config_sha256": ..., "files": [{"name": "model.safetensors",
//                                                                 "bytes": ..., "sample_sha256": ...}]}}
//
// Version 3 has no "shares"; version 2 no "base" (every frozen parameter saved). Version 1 (before state formats) has no "state_format" (one F32 or BF16 tensor per state name)
// and saved every frozen parameter, alone, in rank 0's file.
//
// Loading matches parameters by name, so another world size, alignment, group composition or
// precision re-partitions on load: each rank copies the elements it holds from whichever shards
// have them (memory-mapped, read by range).
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "checkpoint/base_source.h"
#include "memrt/safetensors.h"
#include "memrt/comm.h"
#include "memrt/param_store.h"

namespace memrt {

inline constexpr char kStoreLayoutFile[] = "store.json";

// store.json for the store (as rank 0 writes it; the same on every rank). `base`: the directory the
// frozen parameters were read from, which the checkpoint then leaves them in (nullptr: saved).
std::string store_layout_json(const ParamStore& store, const BaseSource* base = nullptr);

// This rank's tensors of the checkpoint: its share of every saved buffer, and the frozen parameters
// spread to it (none with a `base`). Views of the store: write them before it changes.
std::vector<std::pair<std::string, at::Tensor>> store_shard_tensors(const ParamStore& store,
                                                                    const BaseSource* base = nullptr);

// A saved store: its layout, and any parameter's elements read from the rank files' shards.
class SavedStore {
 public:
  // Reads `dir`/store.json; rank_file(r) gives rank r's opened (and verified) file on demand.
  // FileError naming store.json on malformed content.
  SavedStore(const std::string& dir, std::function<const SafetensorsFile&(int rank)> rank_file);

  const std::string& path() const { return path_; }  // store.json
  int world_size() const { return world_size_; }
  const std::vector<std::string>& state_names() const { return state_names_; }
  // Parameters by name: trainable ones (in a group) and frozen ones.
  bool contains(const std::string& param) const { return params_.count(param) != 0; }
  std::vector<std::string> param_names() const;
  bool trainable(const std::string& param) const;
  const std::vector<int64_t>& shape(const std::string& param) const;
  // Copies values [first, first + dst.numel()) of `param`'s flat `buffer` ("weight", or a tensor
  // of a trainable parameter's state format, whose values may each cover several elements) into
  // `dst` (contiguous, any dtype and device: converted as copy_ does). FileError naming the rank
  // file and tensor when a shard is missing or has the wrong size.
  void read(const std::string& param, const std::string& buffer, int64_t first, at::Tensor dst) const;
  // `param`'s "weight" or one of a frozen parameter's module buffers, whole, in the dtype and shape
  // it was saved in.
  at::Tensor read_whole(const std::string& param, const std::string& buffer) const;
  // `param`'s "weight" whole as read_whole gives it, but a read-only view of the memory-mapped rank
  // file (or base model file) where its elements lie in one: `launcher export` holds nothing of a
  // parameter until it writes it. A copy where they do not (a parameter across two ranks' shares).
  at::Tensor view_weight(const std::string& param) const;
  // A trainable parameter's group's state format (tensor dtypes as saved); empty for a frozen one.
  const StateFormat& state_format(const std::string& param) const;
  // A frozen parameter's layout as saved: its format ("" plain) and its module buffers' names,
  // each readable whole as read(param, buffer, 0, dst).
  const std::string& frozen_format(const std::string& param) const;
  std::vector<std::string> frozen_buffers(const std::string& param) const;

  // The base directory the frozen parameters were left in, if the checkpoint left them there.
  const std::optional<BaseSource>& base() const { return base_; }
  bool from_base(const std::string& param) const { return params_.at(param).rank == kInBase; }
  // Where read() takes a frozen parameter left in the base from: its "weight" or module buffer,
  // whole (rebuilt from the base as its run built it). Without one, reading it is a FileError.
  using BaseTensors = std::function<at::Tensor(const std::string& param, const std::string& buffer)>;
  void read_base_from(BaseTensors tensors) { base_tensors_ = std::move(tensors); }

 private:
  struct Buffer {  // a frozen parameter's module buffer
    std::string name, dtype;
    std::vector<int64_t> shape;
    int64_t numel = 1;
  };
  static constexpr int kInBase = -1;  // left in the base model's directory
  static constexpr int kShares = -2;  // every saving rank wrote its share (ZeRO-3)
  struct Param {
    std::vector<int64_t> shape;
    int64_t numel = 0;
    int group = -1;  // -1: frozen
    int64_t offset = 0;
    std::string dtype;  // frozen: the saved tensor's safetensors dtype
    int rank = 0;       // frozen: the rank file holding its tensors; kInBase, kShares
    std::string format;
    std::vector<Buffer> buffers;
  };
  struct Group {
    std::string name;
    int64_t padded = 0;
    int64_t numel = 0;
    std::map<std::string, std::string> dtypes;  // saved buffer -> safetensors dtype
    StateFormat format;
    int64_t per_value(const std::string& buffer) const;  // 0: no such buffer
  };
  // Rank `rank`'s tensor `name`, flat, checked to hold `numel` values of safetensors `dtype`.
  at::Tensor shard(int rank, const std::string& name, int64_t numel, const std::string& dtype) const;
  std::string path_;  // store.json
  std::function<const SafetensorsFile&(int)> rank_file_;
  int world_size_ = 1;
  std::vector<std::string> state_names_;
  std::vector<Group> groups_;
  std::map<std::string, Param> params_;
  std::optional<BaseSource> base_;
  BaseTensors base_tensors_;
};

// The store's own frozen tensors as SavedStore::read_base_from takes them (a checkpoint's plugins
// reading it while the run that wrote it holds them).
SavedStore::BaseTensors frozen_tensors_of(const ParamStore& store);

// What load_store reads of each buffer.
enum class LoadShare {
  kHeld,       // everything this rank holds: full buffers whole, frozen parameters (one process)
  kPartition,  // of every buffer only this rank's partition (plan.partition), and of the frozen
               // parameters those the name spreads to this rank: a rank reads 1/N of the
               // checkpoint (on the saving world size, its own file); complete_loaded_store()
               // fills in the rest
};

// Fills `store` from `saved`, parameters matched by name. Another world size, alignment or group
// layout loads; a parameter missing on either side, another shape or another optimizer state is a
// FileError naming store.json and saying what to do. Frozen parameters left in the base are not
// read: the caller built `store` from that base (and compared saved.base()'s fingerprint). Returns
// the number of parameters loaded.
int64_t load_store(ParamStore& store, const SavedStore& saved, LoadShare share = LoadShare::kHeld);

// After load_store(..., kPartition) on every rank: all-gathers each full-extent buffer's partitions
// (compute copies; masters and state where they are replicated) and broadcasts each frozen
// parameter's tensors from the rank that read them (none left in the base: every rank has those).
void complete_loaded_store(ParamStore& store, const SavedStore& saved, Communicator& comm);

}  // namespace memrt
