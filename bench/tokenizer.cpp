// tokenizer: memrt's tokenizer.json encoder over the lines of a text file, for bench_tokenizer.py.
//
//   bench_tokenizer TOKENIZER_JSON TEXT_FILE THREADS REPEATS
// prints one JSON line: {"lines", "bytes", "tokens", "checksum", "seconds" (median over REPEATS of
// one Tokenizer::encode_batch of every line on THREADS threads)}.
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "bench_timing.h"
#include "data/tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: bench_tokenizer TOKENIZER_JSON TEXT_FILE THREADS REPEATS\n");
    return 2;
  }
  try {
    const memrt::Tokenizer tok = memrt::Tokenizer::from_file(argv[1]);
    std::vector<std::string> lines;
    std::ifstream in(argv[2], std::ios::binary);
    size_t bytes = 0;
    for (std::string line; std::getline(in, line);) {
      bytes += line.size();
      lines.push_back(std::move(line));
    }
    const int threads = std::stoi(argv[3]), repeats = std::stoi(argv[4]);
    const std::vector<std::string_view> docs(lines.begin(), lines.end());
    std::vector<std::vector<int32_t>> ids;
    auto pass = [&] { ids = tok.encode_batch(docs, /*add_special_tokens=*/false, threads); };
    std::vector<double> seconds;
    for (int r = 0; r < repeats; ++r) seconds.push_back(memrt::bench::ms_per_call(pass, 1) / 1e3);
    uint64_t n = 0, sum = 0;
    for (const std::vector<int32_t>& doc : ids) {
      n += doc.size();
      for (int32_t id : doc) sum += static_cast<uint64_t>(id);
    }
    std::printf("{\"lines\": %zu, \"bytes\": %zu, \"tokens\": %llu, \"checksum\": %llu, \"seconds\": %.6f}\n",
                lines.size(), bytes, static_cast<unsigned long long>(n), static_cast<unsigned long long>(sum),
                memrt::bench::median(seconds));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_tokenizer: %s\n", e.what());
    return 1;
  }
  return 0;
}
