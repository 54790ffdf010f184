// Training data: one token stream (byte-level text, pre-tokenized .bin, JSONL, or the built-in
// corpus), or the samples of fine-tuning records with their label masks, and the loader that cuts
// it into samples and hands every rank its micro-batches.
//
// Sampling rule (docs/data-and-optim.md): the stream is cut into non-overlapping windows of
// block_size + 1 tokens (a sample: inputs = its first block_size tokens, targets = its last
// block_size); records are a sample each (inputs = its tokens, targets = the next token where the
// label mask trains it, else -100; padded with -100 targets to the micro-batch's longest sample, or
// to block_size). Each epoch visits every sample once, in a permutation drawn from (seed, epoch).
// Optimizer step s takes the next global batch (train_batch_size samples) of that order; slot
// k = micro * world_size + rank of it, micro_batch_size samples wide, is what `rank` trains on in
// micro-step `micro`. Ranks never share a sample, and the samples of a step do not depend on the
// world size, only on the global batch.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "config/train_config.h"

namespace memrt {

class MappedFile;

// One stream of token ids. A file is memory-mapped and read in place (JSONL, whose text must be
// decoded, and a stream of several text files are the exceptions: copied once into one byte stream).
class TokenDataset {
 public:
  // cfg.train_files empty: the built-in corpus. Otherwise by the first file's name, which names the
  // format of them all: "*.jsonl" is JSONL with a "text" field per line, "*.bin" pre-tokenized
  // tokens (one file; llm.c header detected; headerless files are uint16, or uint32 when named
  // "*.u32.bin"), anything else text; JSONL and JSON files of prompt/completion or messages
  // records are records. Text, JSONL and the built-in corpus are bytes, or with cfg.tokenizer
  // tokenized as run_clm tokenizes them. Several files are one dataset, each file's documents in turn.
  static std::shared_ptr<TokenDataset> open(const DataConfig& cfg);
  // Whether open(cfg) gives samples (records) rather than a stream, read from the config and the
  // first record of a JSONL / JSON train file only: what the memory estimate asks before the data
  // is opened (RunInfo::sample_packing).
  static bool yields_samples(const DataConfig& cfg);

  static std::shared_ptr<TokenDataset> builtin_corpus();
  // The files' bytes, one after another (one file is read in place).
  static std::shared_ptr<TokenDataset> open_text(const std::vector<std::string>& paths);
  static std::shared_ptr<TokenDataset> open_bin(const std::string& path);
  // A JSONL file's documents are each line's `text_field` (TRL's dataset_text_field, "text").
  static std::shared_ptr<TokenDataset> open_jsonl(const std::vector<std::string>& paths,
                                                  const std::string& text_field = "text");
  // The documents of text files (each line with its newline), JSONL files (each `text_field`) or the
  // built-in corpus (no paths), each encoded with add_special_tokens as Hugging Face's run_clm does,
  // concatenated (uint32 tokens; vocab_size() the tokenizer's). Cached in `cache_dir` ("" the
  // default, docs/tokenizers.md "The tokenized cache"): a later open of the same files with the same
  // tokenizer maps the cached tokens; a cache that cannot be written is said in description().
  static std::shared_ptr<TokenDataset> open_tokenized(const std::vector<std::string>& paths,
                                                      const std::string& tokenizer_json,
                                                      const std::string& cache_dir = "",
                                                      const std::string& text_field = "text");
  // The records of cfg.datasets (data/records.h), a sample each, in order, samples longer than
  // block_size dropped or cut as the source's type says, conversations rendered with the chat
  // template of the tokenizer's directory; cached as open_tokenized caches.
  static std::shared_ptr<TokenDataset> open_records(const DataConfig& cfg);

  ~TokenDataset();

  int64_t num_tokens() const { return num_tokens_; }
  // 256 for byte-level data; the largest token id + 1 for .bin files (llm.c's header has no
  // vocabulary size).
  int64_t vocab_size() const { return vocab_size_; }
  int bytes_per_token() const { return bytes_per_token_; }
  // e.g. "built-in corpus (379 KiB, byte-level): ..." — for the start-up log.
  const std::string& description() const { return description_; }
  // Whether opening it encoded text with the tokenizer (no cache entry to map).
  bool tokenized() const { return tokenized_; }

  // Records: the dataset is num_samples() samples, sample k tokens [sample_begin(k), sample_begin(k + 1)),
  // and trained(i) says whether the loss counts token i's prediction. A stream has no samples.
  bool has_samples() const { return !offsets_.empty(); }
  int64_t num_samples() const { return has_samples() ? static_cast<int64_t>(offsets_.size()) - 1 : 0; }
  int64_t sample_begin(int64_t k) const { return offsets_[static_cast<size_t>(k)]; }
  int64_t sample_length(int64_t k) const { return sample_begin(k + 1) - sample_begin(k); }
  bool trained(int64_t i) const { return labels_[i] != 0; }
  // The predictions sample k trains on: its tokens after the first that trained() marks.
  int64_t sample_labels(int64_t k) const;
  // Records: how many the files hold (dropped ones too), and the one sample k was made from
  // (numbered across the files in order).
  int64_t num_records() const { return num_records_; }
  int64_t sample_record(int64_t k) const { return records_[static_cast<size_t>(k)]; }
  // The records `held` holds out of `all`'s (docs/tokenizers.md, "Held-out records"): its samples
  // parted into those the run trains on and those it evaluates, each side a dataset of its own in
  // the order the tool leaves it, drawn with `seed`. memrt::Error naming held.key when a side would
  // be empty.
  struct Split {
    std::shared_ptr<TokenDataset> train, eval;
  };
  static Split hold_out(const TokenDataset& all, const HeldOut& held, uint64_t seed);

  int64_t token(int64_t i) const;
  // Copies tokens [begin, begin + count) into `out` as int64.
  void copy_tokens(int64_t begin, int64_t count, int64_t* out) const;

 private:
  TokenDataset() = default;
  void scan_vocab();

  std::unique_ptr<MappedFile> file_;  // keeps `tokens_` valid for mapped files
  std::string owned_;                 // the byte stream of JSONL files, or of several text files
  std::vector<uint32_t> owned_ids_;   // the tokens of a tokenized file
  std::unique_ptr<MappedFile> labels_file_;  // records: keeps `labels_` valid when cached
  std::vector<uint8_t> owned_labels_;
  const uint8_t* labels_ = nullptr;   // records: one byte per token
  std::vector<int64_t> offsets_;      // records: num_samples() + 1 sample boundaries
  std::vector<int64_t> records_;      // records: each sample's record
  int64_t num_records_ = 0;
  // Records: a dataset of `samples` of this one, in that order (their tokens copied).
  std::shared_ptr<TokenDataset> subset(const std::vector<int64_t>& samples, const std::string& description) const;
  const uint8_t* tokens_ = nullptr;   // num_tokens_ * bytes_per_token_ bytes, little-endian
  int64_t num_tokens_ = 0;
  int bytes_per_token_ = 1;
  int64_t vocab_size_ = 256;
  std::string description_;
  bool tokenized_ = false;
};

// One micro-batch. Both (B, T) int64 on the CPU; targets[b][t] is the token after inputs[b][t],
// or -100 where the loss leaves the prediction out (a record's prompt, padding).
struct Batch {
  at::Tensor inputs, targets;
  int64_t tokens = 0;  // the real (not padding) tokens of inputs
  // Packed rows (docs/tokenizers.md, "Packing"): each token's position in its sample (B, T) int64,
  // 0 where a sample starts (the padding after a row's last sample counts 0, 1, ... as one more);
  // undefined when each row is one sample.
  at::Tensor positions;
};

// Samples `samples` of a dataset with samples, as one batch: (B, T) with T the longest sample's
// length, or `pad_to` when larger; padding is token 0 with target -100 (right-padded, it is never
// attended to by the sample's own causal positions).
Batch sample_batch(const TokenDataset& data, const std::vector<int64_t>& samples, int64_t pad_to = 0);
// Packed rows: row r holds samples rows[r] one after another (each sample's last target -100),
// padded to the longest row, or to `width` when larger; positions restart at each sample and at
// the padding.
Batch packed_batch(const TokenDataset& data, const std::vector<std::vector<int64_t>>& rows, int64_t width);

// First-fit decreasing: the dataset's samples, longest first (ties in dataset order), each in the
// first row of `width` tokens with room. Rows in the order they were opened.
std::vector<std::vector<int64_t>> pack_samples(const TokenDataset& data, int64_t width);

class DataLoader {
 public:
  // Throws memrt::Error when the arguments are out of range or the dataset holds fewer samples
  // than one global batch (micro_batch_size * grad_accum_steps * world_size).
  DataLoader(std::shared_ptr<const TokenDataset> data, int64_t block_size, int64_t micro_batch_size,
             int64_t grad_accum_steps, int rank, int world_size, uint64_t seed, bool pad_to_block = false,
             bool pack = false);

  // Whole samples of block_size+1 tokens, or the dataset's samples, or with `pack` the rows of
  // block_size tokens they are packed into (pack_samples, once; an epoch shuffles the rows).
  int64_t samples() const { return samples_; }
  // Packed: the rows' real tokens over their capacity (rows x block_size); 0 when not packed.
  double packing_efficiency() const;
  int64_t global_batch_size() const { return global_batch_; }
  // Optimizer steps per epoch: samples / global batch (floor; the remainder is dropped).
  int64_t steps_per_epoch() const { return steps_per_epoch_; }

  // Micro-batch `micro` (0..grad_accum_steps-1) of optimizer step `step` (0-based, counting across
  // epochs) for this rank. A pure function of its arguments: resuming needs no loader state.
  Batch get(int64_t step, int64_t micro) const;
  // The sample indices (window i starts at token i * (block_size + 1)) that get() returns.
  std::vector<int64_t> sample_indices(int64_t step, int64_t micro) const;
  // The targets other than -100 in all micro-batches of step `step` on every rank: what the step's
  // loss is averaged over (transformers' num_items_in_batch), the same on every rank.
  int64_t step_labels(int64_t step) const;

 private:
  std::shared_ptr<const TokenDataset> data_;
  int64_t block_size_, micro_batch_size_, grad_accum_steps_;
  int rank_, world_size_;
  uint64_t seed_;
  bool pad_to_block_;
  std::vector<std::vector<int64_t>> rows_;  // packed: each row's samples
  int64_t samples_ = 0, global_batch_ = 0, steps_per_epoch_ = 0;
  std::vector<int32_t> labels_of_;  // records: each sample's (packed: each row's) sample_labels()

  // The order of the epoch last asked for (every rank reads one epoch for many steps in a row).
  struct OrderCache {
    std::mutex mutex;
    int64_t epoch = -1;
    std::vector<int64_t> order;
  };
  std::unique_ptr<OrderCache> cache_ = std::make_unique<OrderCache>();
  // The epoch's order, computed on first use.
  std::vector<int64_t> order_slice(int64_t epoch, int64_t first, int64_t count) const;
};

// Evaluation (`launcher eval`, eval_steps): the stream cut into consecutive windows of block_size
// tokens, the remainder dropped; window i is tokens [i * block_size, (i + 1) * block_size) and
// predicts its own next block_size - 1 tokens, as transformers computes
// model(input_ids=window, labels=window).loss. Records: each sample is a window.
int64_t eval_windows(const TokenDataset& data, int64_t block_size);
// Windows [first, first + count): inputs their first block_size - 1 tokens, targets their last;
// records: sample_batch() of those samples.
Batch eval_batch(const TokenDataset& data, int64_t block_size, int64_t first, int64_t count);

// The permutation of [0, n) that epoch `epoch` visits samples in: a Fisher-Yates shuffle driven by
// splitmix64 seeded from (seed, epoch). The same on every platform.
std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch);

}  // namespace memrt
