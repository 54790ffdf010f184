// The LM head and its loss, forward and backward together, as a training step runs them: memrt's
// chunked ops::linear_cross_entropy_sum against the unfused head (ops::linear, the fp32 upcast,
// at::cross_entropy_loss with a sum) in the same process, on the same tokens, weight and targets.
//
//   build/bin/bench_head [TOKENS WIDTH VOCAB DTYPE ROUNDS]   (default 1024 768 32000 bf16 7)
//
// DTYPE is fp32 or bf16. Two cases: the head's weight frozen (LoRA: only the input's gradient) and
// trained (a full fine-tune: both). Each round times both implementations back to back (the order
// alternates), 3 calls each, through memrt's allocator as the launcher installs it (large blocks
// kept and reused, not mapped and faulted in anew each call); figures are medians over the rounds of the per-call time. Prints the
// processor, a table with the ratio unfused / chunked, and one JSON line per implementation and case.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench_timing.h"
#include "memory/tracking_allocator.h"
#include "memrt/ops.h"

using memrt::bench::median;
using memrt::bench::int_arg;
using memrt::bench::ms_per_call;

int main(int argc, char** argv) {
  const int64_t tokens = int_arg(argc, argv, 1, 1024);
  const int64_t width = int_arg(argc, argv, 2, 768);
  const int64_t vocab = int_arg(argc, argv, 3, 32000);
  const at::ScalarType dtype = argc > 4 && std::strcmp(argv[4], "fp32") == 0 ? at::kFloat : at::kBFloat16;
  const int rounds = static_cast<int>(int_arg(argc, argv, 5, 7));
  memrt::memory::install_tracking_allocator();  // as the launcher: large blocks reused, not mapped anew
  at::manual_seed(0);
  const at::Tensor x0 = at::randn({tokens, width}).to(dtype);
  const at::Tensor w0 = (at::randn({vocab, width}) * 0.02).to(dtype);
  const at::Tensor targets = at::randint(vocab, {tokens}, at::kLong);

  auto step = [&](bool chunked, bool weight_trains) {
    return [&, chunked, weight_trains] {
      const at::Tensor x = x0.detach().requires_grad_(true);
      const at::Tensor w = w0.detach().requires_grad_(weight_trains);
      const at::Tensor loss = chunked ? memrt::ops::linear_cross_entropy_sum(x, w, targets)
                                      : at::cross_entropy_loss(memrt::ops::linear(x, w).to(at::kFloat), targets, {},
                                                               at::Reduction::Sum);
      (loss * (1.0 / static_cast<double>(tokens))).backward();
    };
  };
  std::vector<double> t[2][2];  // [chunked][weight trains]: ms per call, per round
  for (int r = 0; r < rounds; ++r)
    for (int trains = 0; trains < 2; ++trains)
      for (int k = 0; k < 2; ++k) {
        const bool chunked = (r + k) % 2 == 0;
        t[chunked][trains].push_back(ms_per_call(step(chunked, trains == 1), 3));
      }
  const char* name = dtype == at::kFloat ? "fp32" : "bf16";
  std::printf("%s\n", memrt::ops::describe_cpu_math().c_str());
  std::printf("LM head + cross-entropy, forward and backward: %lld tokens x %lld -> vocabulary %lld, %s, "
              "%d threads, medians of %d alternating rounds; chunks of %lld tokens\n\n",
              static_cast<long long>(tokens), static_cast<long long>(width), static_cast<long long>(vocab), name,
              at::get_num_threads(), rounds,
              static_cast<long long>(memrt::ops::linear_cross_entropy_chunk_rows(tokens, vocab)));
  std::printf("| head weight | chunked (ms) | unfused (ms) | unfused / chunked |\n|---|---:|---:|---:|\n");
  for (int trains = 0; trains < 2; ++trains)
    std::printf("| %s | %.2f | %.2f | %.2f |\n", trains ? "trained" : "frozen", median(t[1][trains]),
                median(t[0][trains]), median(t[0][trains]) / median(t[1][trains]));
  std::printf("\n");
  for (int chunked = 1; chunked >= 0; --chunked)
    for (int trains = 0; trains < 2; ++trains)
      std::printf("{\"bench\": \"head\", \"impl\": \"%s\", \"weight\": \"%s\", \"dtype\": \"%s\", \"tokens\": %lld, "
                  "\"width\": %lld, \"vocab\": %lld, \"threads\": %d, \"ms\": %.3f}\n",
                  chunked ? "chunked" : "unfused", trains ? "trained" : "frozen", name,
                  static_cast<long long>(tokens), static_cast<long long>(width), static_cast<long long>(vocab),
                  at::get_num_threads(), median(t[chunked][trains]));
  return 0;
}
