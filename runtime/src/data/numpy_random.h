// numpy's default generator, for the permutations the fine-tuning tools draw with it:
// `numpy.random.default_rng(seed).permutation(n)` — what Hugging Face `datasets` shuffles and splits
// with (Dataset.shuffle(seed), train_test_split(seed)), so that memrt holds out the records axolotl's
// val_set_size and LLaMA-Factory's val_size hold out (docs/tokenizers.md, "Held-out records").
//
//   std::vector<int64_t> order = numpy_permutation(1000, 42);  // == default_rng(42).permutation(1000)
//
// The pieces, as numpy 1.17+ defines them: SeedSequence(seed) (its pool of four 32-bit words, mixed
// by its hash), PCG64 seeded from the sequence's first four 64-bit words (XSL-RR output of a 128-bit
// LCG, 32-bit draws taken from a 64-bit one's low then high half), and Generator.shuffle's
// Fisher-Yates with masked rejection sampling (random_interval).
#pragma once
#include <cstdint>
#include <vector>

namespace memrt {

std::vector<int64_t> numpy_permutation(int64_t n, uint64_t seed);

}  // namespace memrt
