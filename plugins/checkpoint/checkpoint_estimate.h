// plugins/checkpoint — the checkpointed activation term of the memory estimate
// (docs/checkpointing.md, "Memory"; docs/memory.md, "Activations").
#pragma once

#include <cstdint>
#include <vector>

#include <memrt/memory.h>

namespace memrt {
namespace checkpoint {

// Which blocks are checkpointed: every n-th, counting from 1 — blocks n-1, 2n-1, ... (n = 1: all).
std::vector<bool> checkpointed_blocks(int64_t n_layer, int64_t every_n_blocks);

// Re-derives `e` (as the plugins before this one left it) for a run whose blocks marked in
// `checkpointed` keep only their input, in host memory when `offload`: the blocks' terms, the
// backward candidates (at the loss; in each block, where a checkpointed one is recomputed), the
// gradients alive at the chosen one, and the activations cell split between device and host.
void estimate_checkpointed(memory::MemoryEstimate& e, const std::vector<bool>& checkpointed,
                           bool offload);

}  // namespace checkpoint
}  // namespace memrt
