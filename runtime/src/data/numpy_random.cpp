#include "data/numpy_random.h"

#include <array>
#include <utility>

namespace memrt {
namespace {

__extension__ typedef unsigned __int128 u128;  // GCC and Clang on 64-bit targets

// SeedSequence(seed).generate_state(4, uint64): the seed's 32-bit words hashed into a pool of
// four, the pool mixed, then drawn out through a second hash.
std::array<uint64_t, 4> seed_sequence_state(uint64_t seed) {
  std::vector<uint32_t> entropy;
  do {
    entropy.push_back(static_cast<uint32_t>(seed));
    seed >>= 32;
  } while (seed);
  uint32_t hash_const = 0x43b0d7e5;
  auto hashmix = [&](uint32_t v) {
    v ^= hash_const;
    hash_const *= 0x931e8875;
    v *= hash_const;
    return v ^ (v >> 16);
  };
  auto mix = [](uint32_t x, uint32_t y) {
    const uint32_t r = 0xca01f9dd * x - 0x4973f715 * y;
    return r ^ (r >> 16);
  };
  std::array<uint32_t, 4> pool{};
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = hashmix(i < entropy.size() ? entropy[i] : 0);
  for (size_t src = 0; src < pool.size(); ++src)
    for (size_t dst = 0; dst < pool.size(); ++dst)
      if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src]));
  for (size_t src = pool.size(); src < entropy.size(); ++src)
    for (uint32_t& word : pool) word = mix(word, hashmix(entropy[src]));
  std::array<uint64_t, 4> state{};
  uint32_t out_const = 0x8b51f9dd;
  for (size_t i = 0; i < 2 * state.size(); ++i) {  // little-endian pairs of 32-bit words
    uint32_t v = pool[i % pool.size()] ^ out_const;
    out_const *= 0x58f38ded;
    v *= out_const;
    v ^= v >> 16;
    state[i / 2] |= static_cast<uint64_t>(v) << (32 * (i % 2));
  }
  return state;
}

class Pcg64 {
 public:
  explicit Pcg64(uint64_t seed) {
    const std::array<uint64_t, 4> s = seed_sequence_state(seed);
    const u128 init = (static_cast<u128>(s[0]) << 64) | s[1], seq = (static_cast<u128>(s[2]) << 64) | s[3];
    inc_ = (seq << 1) | 1;  // pcg_setseq_128_srandom_r
    step();
    state_ += init;
    step();
  }
  uint64_t next64() {
    step();
    const uint64_t x = static_cast<uint64_t>(state_ >> 64) ^ static_cast<uint64_t>(state_);
    const unsigned rot = static_cast<unsigned>(state_ >> 122);
    return (x >> rot) | (x << ((64 - rot) & 63));
  }
  uint32_t next32() {
    if (has_half_) {
      has_half_ = false;
      return half_;
    }
    const uint64_t v = next64();
    has_half_ = true;
    half_ = static_cast<uint32_t>(v >> 32);
    return static_cast<uint32_t>(v);
  }

 private:
  void step() {
    static const u128 kMultiplier = (static_cast<u128>(0x2360ED051FC65DA4ull) << 64) | 0x4385DF649FCCF645ull;
    state_ = state_ * kMultiplier + inc_;
  }
  u128 state_ = 0, inc_ = 0;
  bool has_half_ = false;
  uint32_t half_ = 0;
};

// random_interval: uniform in [0, max], by rejection on the smallest all-ones mask covering max.
uint64_t random_interval(Pcg64& g, uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max;
  for (int shift : {1, 2, 4, 8, 16, 32}) mask |= mask >> shift;
  for (;;) {
    const uint64_t v = (max <= 0xffffffffull ? g.next32() : g.next64()) & mask;
    if (v <= max) return v;
  }
}

}  // namespace

std::vector<int64_t> numpy_permutation(int64_t n, uint64_t seed) {
  std::vector<int64_t> order(static_cast<size_t>(n > 0 ? n : 0));
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  Pcg64 g(seed);
  for (size_t i = order.size(); i-- > 1;) std::swap(order[i], order[random_interval(g, i)]);
  return order;
}

}  // namespace memrt
