"""numpy's default generator, the oracle of NumpyRandom.PermutationIsNumpys (tests/data/test_records.cpp):

    numpy_permutations.py OUT.json
writes {"cases": [{"n": n, "seed": seed, "permutation": [...]}...]}: numpy.random.default_rng(seed)
.permutation(n) — what Hugging Face datasets shuffles and splits with — for sizes from 0 to past
2^16 (every mask width random_interval uses up to it) and seeds of one, two and three 32-bit words.
"""
import json
import sys

import numpy as np

SEEDS = [0, 1, 42, 1234, 2**31 - 1, 2**32 - 1, 2**32, 2**32 + 5, 2**63 + 7, 2**64 - 1]
SIZES = [0, 1, 2, 3, 10, 255, 256, 257, 1000, 65537]


def main():
    cases = [{"n": n, "seed": seed, "permutation": [int(i) for i in np.random.default_rng(seed).permutation(n)]}
             for seed in SEEDS for n in SIZES if n < 70000 or seed in (0, 42)]
    with open(sys.argv[1], "w") as f:
        json.dump({"cases": cases}, f)


if __name__ == "__main__":
    main()
