// plugins/checkpoint — the checkpointed activation term (see checkpoint_estimate.h).
#include "checkpoint_estimate.h"

#include <algorithm>

#include <string>

#include <memrt/plugin.h>

namespace memrt {
namespace checkpoint {
std::vector<bool> checkpointed_blocks(int64_t n_layer, int64_t every_n_blocks) {
  std::vector<bool> out(static_cast<size_t>(n_layer), false);
  for (int64_t i = 0; i < n_layer; ++i) out[static_cast<size_t>(i)] = (i + 1) % every_n_blocks == 0;
  return out;
}

void estimate_checkpointed(memory::MemoryEstimate& e, const std::vector<bool>& checkpointed,
                           bool offload) {
  using memory::Category;
  using memory::Placement;
  const RunInfo& run = *e.run;
  const ModelShape& s = run.shape;
  memory::ActivationEstimate& a = e.activations;
  const int64_t L = static_cast<int64_t>(a.per_block.size());
  if (L == 0) return;
  const int64_t b = static_cast<int64_t>(c10::elementSize(e.compute_dtype));
  const int64_t BT = run.micro_batch_size * run.block_size;
  const int64_t input = BT * s.d_model * b;  // one block's input (B, T, C)
  // What a block keeps when it is not checkpointed (a frozen prefix keeps less: the largest).
  const int64_t plain = *std::max_element(a.per_block.begin(), a.per_block.end());

  // Forward: a checkpointed block keeps nothing itself; its output stays alive as the next
  // block's saved input (or the next block's or the final norm's kept input). So each block's
  // term is its output: B*T*C*b when checkpointed, the full plain term otherwise.
  std::vector<int64_t> kept(static_cast<size_t>(L));
  for (int64_t i = 0; i < L; ++i) kept[i] = checkpointed[i] ? input : plain;
  a.per_block = kept;
  // The first block's input, the embedding's output, is saved by its checkpoint even where no op
  // keeps it (a frozen embedding before a frozen first norm: a LoRA run's). Op by op, the embedding
  // term counts it when something keeps it and is under one such tensor when not (position ids at
  // most); the whole-segment rules are an upper bound that already covers it.
  if (memory::activations_op_by_op(s, e.compute_dtype) && checkpointed[0] && a.embedding < input) a.embedding += input;
  const int64_t kept_total = a.kept();

  // Gradients alive at each candidate: every one when accumulating; otherwise those of the
  // segments whose backward is done, plus the block's own last projection.
  const bool accumulating = run.grad_accum_steps > 1;
  std::vector<int64_t> grads_from(static_cast<size_t>(L + 2), 0);  // [j + 1]: segments > j
  int64_t all_grads = 0, trainable = 0;
  std::vector<int64_t> last_projection(static_cast<size_t>(L), 0);
  for (const memory::ParamEstimate& p : e.params) {
    if (!p.trainable) continue;
    trainable += p.numel;
    all_grads += p.numel * b;
    const int64_t seg = memory::param_segment(p.name, L);
    for (int64_t j = -1; j < seg; ++j) grads_from[static_cast<size_t>(j + 1)] += p.numel * b;
    if (seg >= 0 && seg < L && memory::is_last_projection(p.name, s.arch)) last_projection[seg] += p.numel * b;
  }

  const int64_t block_backward =
      memory::block_backward_bytes(s, run.micro_batch_size, run.block_size, e.compute_dtype);
  const int64_t tied_grad = s.tie_embeddings ? s.vocab_size * s.d_model * b : 0;
  // In backward the head's activations are freed, but not the loss the engine holds (and the
  // total weight nll_loss keeps, an fp16 run's scaled loss): what the plain plan's last-block
  // candidate leaves of the head term.
  const memory::ActivationEstimate unchecked = memory::activation_estimate(run, e.compute_dtype, e.params);
  const int64_t head_kept = block_backward + tied_grad - unchecked.backward_in_last_block;
  const int64_t loss_scalars = a.head - head_kept;
  // Kept before block j: the embedding's term and a packed layout's tables.
  std::vector<int64_t> prefix(static_cast<size_t>(L + 1), a.embedding + a.layout);
  std::vector<int64_t> host_upto(static_cast<size_t>(L + 1), 0);  // saved inputs of blocks <= j-1
  for (int64_t i = 0; i < L; ++i) {
    prefix[i + 1] = prefix[i] + kept[i];
    host_upto[i + 1] = host_upto[i] + (checkpointed[i] ? input : 0);
  }
  // The largest block candidate (the first backward reaches, on a tie), gradients counted as they
  // stay here; and the largest in activations alone, what a plugin that hands each gradient over as
  // it comes (ZeRO-2 and 3, after this one) takes as the block candidate.
  int64_t block_act = 0, block_grads = 0, block_host = 0, most_act = 0;
  bool have_block = false;
  for (int64_t j = L - 1; j >= 0; --j) {
    // Block j's backward: blocks after it and the head are freed, its output's slot holds the
    // incoming gradient. Not checkpointed: its own kept term (that slot included). Checkpointed:
    // the recomputed block's full plain term (its recomputed output included) beside the incoming
    // gradient, and on an accelerator with offload, its input copied back to the device.
    int64_t act = prefix[j] + plain + block_backward + tied_grad + loss_scalars;
    if (checkpointed[j]) {
      act += input;
      if (offload && !run.device.is_cpu()) act += input;
    }
    const int64_t grads = accumulating ? all_grads : grads_from[j + 1] + last_projection[j];
    most_act = std::max(most_act, act);
    if (!have_block || act + grads > block_act + block_grads) {
      block_act = act;
      block_grads = grads;
      block_host = offload ? host_upto[j + 1] : 0;
      have_block = true;
    }
  }
  a.backward_in_last_block = most_act - kept_total;
  a.backward_in_embedding = unchecked.kept() + unchecked.backward_in_embedding - kept_total;

  // At the loss (reached first, so it wins a tie): everything forward kept, every saved input.
  const int64_t loss_grads = accumulating ? all_grads : 0;
  const bool at_loss = kept_total + a.backward_at_loss + loss_grads >= block_act + block_grads;
  int64_t best_act = at_loss ? kept_total + a.backward_at_loss : block_act;
  int64_t best_grads = at_loss ? loss_grads : block_grads;
  int64_t best_host = !offload ? 0 : at_loss ? host_upto[L] : block_host;
  // In the embedding's backward (reached last, so it wins no tie): every block's activations freed,
  // checkpointed or not; every gradient but the embedding's handed over.
  const int64_t embedding_act = unchecked.kept() + unchecked.backward_in_embedding;
  const int64_t embedding_grads = accumulating ? all_grads : grads_from[0];
  if (unchecked.embedding_trains && embedding_act + embedding_grads > best_act + best_grads) {
    best_act = embedding_act;
    best_grads = embedding_grads;
    best_host = 0;
  }
  a.backward_peak = best_act - kept_total;

  e.backward_grad_elements = best_grads / b;
  e.peak_in_backward = best_act + best_grads >= trainable * 4;  // the step: every fp32 gradient
  memory::Table& t = e.table;
  if (e.peak_in_backward) {
    t.at(Category::kGradients) = best_grads;
    t.at(Category::kGradients, Placement::kHost) = 0;
    t.at(Category::kActivations, Placement::kDevice) = best_act - best_host;
    t.at(Category::kActivations, Placement::kHost) = best_host;
  } else {
    t.at(Category::kGradients) = trainable * 4;
    t.at(Category::kActivations, Placement::kDevice) = 0;
    t.at(Category::kActivations, Placement::kHost) = 0;
  }
}

}  // namespace checkpoint
}  // namespace memrt
