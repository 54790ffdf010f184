// TokenDataset and DataLoader: every file format (files made here), every error, and the sampling
// rule — disjoint ranks, full coverage of an epoch, determinism from the seed, reshuffled epochs,
// and the same samples per step for 1 and 2 ranks with the same global batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>

#include "data/dataset.h"
#include "memrt/error.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace memrt;
using memrt::test::expect_error;
using memrt::test::TempDir;

namespace {

void write_bytes(const std::string& path, const void* data, size_t n) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
}

void write_text(const std::string& path, const std::string& s) { write_bytes(path, s.data(), s.size()); }

// llm.c's layout: 256 little-endian int32 (magic, version, count, zeros), then the tokens.
template <typename T>
void write_llmc(const std::string& path, int32_t magic, int32_t version, const std::vector<T>& toks,
                int32_t count_override = -1) {
  std::vector<int32_t> header(256, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = count_override >= 0 ? count_override : static_cast<int32_t>(toks.size());
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(header.data()), 1024);
  f.write(reinterpret_cast<const char*>(toks.data()), static_cast<std::streamsize>(toks.size() * sizeof(T)));
}

std::vector<int64_t> all_tokens(const TokenDataset& d) {
  std::vector<int64_t> out(static_cast<size_t>(d.num_tokens()));
  d.copy_tokens(0, d.num_tokens(), out.data());
  return out;
}

// A dataset of `n` byte tokens with recognisable content.
std::shared_ptr<TokenDataset> byte_dataset(const TempDir& dir, int64_t n) {
  std::string s;
  for (int64_t i = 0; i < n; ++i) s.push_back(static_cast<char>('a' + i % 26));
  std::string path = dir.file("bytes_" + std::to_string(n) + ".txt");
  write_text(path, s);
  return TokenDataset::open_text({path});
}

}  // namespace

// ---- formats -------------------------------------------------------------------------------------

TEST(TokenDataset, BuiltinCorpusIsLargeEnglishText) {
  auto d = TokenDataset::open(DataConfig{});
  EXPECT_GE(d->num_tokens(), 200 * 1024);
  EXPECT_EQ(d->vocab_size(), 256);
  EXPECT_NE(d->description().find("built-in corpus"), std::string::npos);
  std::vector<int64_t> head(80);
  d->copy_tokens(0, 80, head.data());
  std::string s(head.begin(), head.end());
  EXPECT_EQ(s.substr(0, 9), "Genesis 1");
  EXPECT_NE(s.find("In the beginning God created"), std::string::npos);
  // Mostly lower-case letters and spaces, as English prose is.
  auto all = all_tokens(*d);
  int64_t letters = std::count_if(all.begin(), all.end(), [](int64_t c) { return (c >= 'a' && c <= 'z') || c == ' '; });
  EXPECT_GT(static_cast<double>(letters) / static_cast<double>(all.size()), 0.8);
}

TEST(TokenDataset, ByteLevelTextEveryByteIsAToken) {
  TempDir dir;
  std::string text = "Hello, world\n\xc3\xa9t\xc3\xa9\n";  // UTF-8 bytes stay separate tokens
  write_text(dir.file("a.txt"), text);
  DataConfig cfg;
  cfg.train_files = {dir.file("a.txt")};
  auto d = TokenDataset::open(cfg);
  ASSERT_EQ(d->num_tokens(), static_cast<int64_t>(text.size()));
  EXPECT_EQ(d->vocab_size(), 256);
  auto toks = all_tokens(*d);
  for (size_t i = 0; i < text.size(); ++i) EXPECT_EQ(toks[i], static_cast<unsigned char>(text[i]));
  EXPECT_NE(d->description().find("byte-level"), std::string::npos);
}

TEST(TokenDataset, LlmcHeaderUint16) {
  TempDir dir;
  std::vector<uint16_t> toks = {50256, 15496, 11, 995, 0, 7};
  write_llmc(dir.file("gpt2.bin"), 20240520, 1, toks);
  DataConfig cfg;
  cfg.train_files = {dir.file("gpt2.bin")};
  auto d = TokenDataset::open(cfg);
  ASSERT_EQ(d->num_tokens(), 6);
  EXPECT_EQ(d->bytes_per_token(), 2);
  EXPECT_EQ(d->vocab_size(), 50257);
  EXPECT_EQ(all_tokens(*d), std::vector<int64_t>({50256, 15496, 11, 995, 0, 7}));
  EXPECT_NE(d->description().find("llm.c"), std::string::npos);
}

TEST(TokenDataset, LlmcHeaderUint32Versions) {
  TempDir dir;
  std::vector<uint32_t> toks = {128000, 9906, 1917, 70000, 3};
  write_llmc(dir.file("v2.bin"), 20240520, 2, toks);
  auto d = TokenDataset::open_bin(dir.file("v2.bin"));
  EXPECT_EQ(d->bytes_per_token(), 4);
  EXPECT_EQ(d->vocab_size(), 128001);
  EXPECT_EQ(all_tokens(*d), std::vector<int64_t>({128000, 9906, 1917, 70000, 3}));
  write_llmc(dir.file("llama3.bin"), 20240801, 7, toks);  // llm.c's llama-3 descriptor
  EXPECT_EQ(all_tokens(*TokenDataset::open_bin(dir.file("llama3.bin"))), all_tokens(*d));
}

TEST(TokenDataset, RawUint16AndU32Suffix) {
  TempDir dir;
  std::vector<uint16_t> t16 = {1, 2, 65535, 4};
  write_bytes(dir.file("raw.bin"), t16.data(), t16.size() * 2);
  auto d16 = TokenDataset::open_bin(dir.file("raw.bin"));
  EXPECT_EQ(all_tokens(*d16), std::vector<int64_t>({1, 2, 65535, 4}));
  EXPECT_EQ(d16->vocab_size(), 65536);
  std::vector<uint32_t> t32 = {1, 100000, 3};
  write_bytes(dir.file("raw.u32.bin"), t32.data(), t32.size() * 4);
  DataConfig cfg;
  cfg.train_files = {dir.file("raw.u32.bin")};
  auto d32 = TokenDataset::open(cfg);
  EXPECT_EQ(d32->bytes_per_token(), 4);
  EXPECT_EQ(all_tokens(*d32), std::vector<int64_t>({1, 100000, 3}));
  EXPECT_EQ(d32->vocab_size(), 100001);
}

TEST(TokenDataset, JsonlTextFieldsJoinedByNewline) {
  TempDir dir;
  write_text(dir.file("d.jsonl"),
             "{\"text\": \"first doc\", \"id\": 1}\n"
             "\n"
             "{\"meta\": {}, \"text\": \"caf\\u00e9\\nline\"}\r\n"
             "  {\"text\": \"\"}  \n"
             "{\"text\": \"last\"}");  // no final newline
  DataConfig cfg;
  cfg.train_files = {dir.file("d.jsonl")};
  auto d = TokenDataset::open(cfg);
  auto toks = all_tokens(*d);
  std::string got(toks.begin(), toks.end());
  EXPECT_EQ(got, "first doc\ncaf\xc3\xa9\nline\n\nlast\n");
  EXPECT_EQ(d->vocab_size(), 256);
  EXPECT_NE(d->description().find("4 documents"), std::string::npos);
  // TRL's dataset_text_field: another field holds the documents; a line without it names the field.
  write_text(dir.file("c.jsonl"), "{\"content\": \"one\", \"text\": \"not this\"}\n{\"content\": \"two\"}\n");
  cfg.train_files = {dir.file("c.jsonl")};
  cfg.text_field = "content";
  toks = all_tokens(*TokenDataset::open(cfg));
  EXPECT_EQ(std::string(toks.begin(), toks.end()), "one\ntwo\n");
  cfg.train_files = {dir.file("d.jsonl")};
  expect_error<FileError>([&] { TokenDataset::open(cfg); },
                          {"d.jsonl", "line 1", "no \"content\" field", "dataset_text_field is \"content\""});
}

// ---- errors --------------------------------------------------------------------------------------

TEST(TokenDatasetErrors, MissingFileNamesIt) {
  DataConfig cfg;
  cfg.train_files = {"no/such/file.txt"};
  expect_error<FileError>([&] { TokenDataset::open(cfg); }, {"no/such/file.txt", "cannot open", "train_file"});
  cfg.train_files = {"no/such/file.bin"};
  expect_error<FileError>([&] { TokenDataset::open(cfg); }, {"no/such/file.bin"});
  cfg.train_files = {"no/such/file.jsonl"};
  expect_error<FileError>([&] { TokenDataset::open(cfg); }, {"no/such/file.jsonl"});
}

TEST(TokenDatasetErrors, DirectoryIsNotAFile) {
  TempDir dir;
  fs::create_directories(dir.file("sub"));
  expect_error<FileError>([&] { TokenDataset::open_text({dir.file("sub")}); }, {"sub", "not a regular file"});
}

TEST(TokenDatasetErrors, EmptyAndTinyFiles) {
  TempDir dir;
  write_text(dir.file("empty.txt"), "");
  expect_error<FileError>([&] { TokenDataset::open_text({dir.file("empty.txt")}); }, {"empty.txt", "0 bytes"});
  write_text(dir.file("empty.bin"), "");
  expect_error<FileError>([&] { TokenDataset::open_bin(dir.file("empty.bin")); }, {"empty.bin", "0 tokens"});
  write_text(dir.file("blank.jsonl"), "\n\n");
  expect_error<FileError>([&] { TokenDataset::open_jsonl({dir.file("blank.jsonl")}); }, {"blank.jsonl", "no text"});
}

TEST(TokenDatasetErrors, JsonlLineWithoutTextNamesTheLine) {
  TempDir dir;
  write_text(dir.file("a.jsonl"), "{\"text\": \"ok\"}\n{\"body\": \"x\"}\n");
  expect_error<FileError>([&] { TokenDataset::open_jsonl({dir.file("a.jsonl")}); },
                          {"a.jsonl", "line 2", "no \"text\" field"});
}

TEST(TokenDatasetErrors, JsonlInvalidJsonNamesTheLine) {
  TempDir dir;
  write_text(dir.file("b.jsonl"), "{\"text\": \"ok\"}\n\n{\"text\": \"unterminated}\n");
  expect_error<FileError>([&] { TokenDataset::open_jsonl({dir.file("b.jsonl")}); }, {"b.jsonl", "line 3", "invalid JSON"});
}

TEST(TokenDatasetErrors, JsonlWrongTypes) {
  TempDir dir;
  write_text(dir.file("c.jsonl"), "[\"text\"]\n");
  expect_error<FileError>([&] { TokenDataset::open_jsonl({dir.file("c.jsonl")}); }, {"c.jsonl", "line 1", "JSON object"});
  write_text(dir.file("d.jsonl"), "{\"text\": \"a\"}\n{\"text\": 5}\n");
  expect_error<FileError>([&] { TokenDataset::open_jsonl({dir.file("d.jsonl")}); }, {"d.jsonl", "line 2", "must be a string"});
}

TEST(TokenDatasetErrors, LlmcTruncatedOrUnknownVersion) {
  TempDir dir;
  std::vector<uint16_t> toks = {1, 2, 3, 4};
  write_llmc(dir.file("trunc.bin"), 20240520, 1, toks, /*count_override=*/10);
  expect_error<FileError>([&] { TokenDataset::open_bin(dir.file("trunc.bin")); },
                          {"trunc.bin", "10 tokens", "truncated"});
  write_llmc(dir.file("v9.bin"), 20240520, 9, toks);
  expect_error<FileError>([&] { TokenDataset::open_bin(dir.file("v9.bin")); }, {"v9.bin", "version 9", "expected version 1"});
}

TEST(TokenDatasetErrors, RawBinOddSize) {
  TempDir dir;
  write_text(dir.file("odd.bin"), "abc");
  expect_error<FileError>([&] { TokenDataset::open_bin(dir.file("odd.bin")); }, {"odd.bin", "3 bytes", "uint16"});
  write_text(dir.file("odd.u32.bin"), "abcdef");
  expect_error<FileError>([&] { TokenDataset::open_bin(dir.file("odd.u32.bin")); }, {"odd.u32.bin", "uint32"});
}

TEST(DataLoaderErrors, TooFewSamplesForOneGlobalBatch) {
  TempDir dir;
  auto d = byte_dataset(dir, 100);  // 100 / 9 = 11 samples of 8+1 tokens
  EXPECT_NO_THROW(DataLoader(d, 8, 11, 1, 0, 1, 1));
  expect_error<Error>([&] { DataLoader(d, 8, 3, 2, 0, 2, 1); },
                      {"11 samples", "global batch of 12", "smaller block_size"});
}

TEST(DataLoaderErrors, ArgumentsOutOfRange) {
  TempDir dir;
  auto d = byte_dataset(dir, 1000);
  EXPECT_THROW(DataLoader(d, 0, 1, 1, 0, 1, 1), Error);
  EXPECT_THROW(DataLoader(d, 8, 1, 1, 2, 2, 1), Error);  // rank == world size
  EXPECT_THROW(DataLoader(d, 8, 1, 0, 0, 1, 1), Error);
  DataLoader loader(d, 8, 2, 3, 0, 1, 1);
  EXPECT_THROW(loader.get(0, 3), Error);
  EXPECT_THROW(loader.get(-1, 0), Error);
}

// ---- sampling ------------------------------------------------------------------------------------

TEST(DataLoader, BatchShapesAndShiftedTargets) {
  TempDir dir;
  auto d = byte_dataset(dir, 5000);
  const int64_t T = 16, B = 4;
  DataLoader loader(d, T, B, 2, 0, 1, 7);
  EXPECT_EQ(loader.samples(), 5000 / (T + 1));
  EXPECT_EQ(loader.steps_per_epoch(), (5000 / (T + 1)) / (B * 2));
  Batch batch = loader.get(3, 1);
  ASSERT_EQ(batch.inputs.sizes(), at::IntArrayRef({B, T}));
  ASSERT_EQ(batch.targets.sizes(), at::IntArrayRef({B, T}));
  EXPECT_EQ(batch.inputs.scalar_type(), at::kLong);
  auto idx = loader.sample_indices(3, 1);
  auto toks = all_tokens(*d);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      int64_t start = idx[static_cast<size_t>(b)] * (T + 1);
      EXPECT_EQ(batch.inputs[b][t].item<int64_t>(), toks[static_cast<size_t>(start + t)]);
      EXPECT_EQ(batch.targets[b][t].item<int64_t>(), toks[static_cast<size_t>(start + t + 1)]);
    }
}

TEST(DataLoader, RanksDisjointAndEpochCovered) {
  TempDir dir;
  auto d = byte_dataset(dir, 20000);
  const int world = 3, accum = 2, B = 5, T = 10;
  std::vector<DataLoader> loaders;
  for (int r = 0; r < world; ++r) loaders.emplace_back(d, T, B, accum, r, world, 123);
  const int64_t spe = loaders[0].steps_per_epoch();
  const int64_t samples = loaders[0].samples();
  ASSERT_EQ(spe, samples / (world * accum * B));
  ASSERT_GT(samples % (world * accum * B), 0) << "test wants a dropped remainder";
  std::set<int64_t> epoch_seen;
  for (int64_t s = 0; s < spe; ++s) {
    std::set<int64_t> step_seen;
    for (int r = 0; r < world; ++r)
      for (int m = 0; m < accum; ++m)
        for (int64_t i : loaders[static_cast<size_t>(r)].sample_indices(s, m)) {
          EXPECT_TRUE(step_seen.insert(i).second) << "sample " << i << " twice in step " << s;
          EXPECT_TRUE(epoch_seen.insert(i).second) << "sample " << i << " twice in epoch 0";
          EXPECT_GE(i, 0);
          EXPECT_LT(i, samples);
        }
    EXPECT_EQ(step_seen.size(), static_cast<size_t>(world * accum * B));
  }
  // Every sample but the dropped remainder is visited once per epoch.
  EXPECT_EQ(static_cast<int64_t>(epoch_seen.size()), spe * world * accum * B);
}

TEST(DataLoader, DeterministicFromSeedAndPure) {
  TempDir dir;
  auto d = byte_dataset(dir, 20000);
  DataLoader a(d, 10, 4, 2, 1, 2, 99), b(d, 10, 4, 2, 1, 2, 99), c(d, 10, 4, 2, 1, 2, 100);
  // Asked in a different order (b jumps epochs back and forth): same answers.
  const int64_t spe = a.steps_per_epoch();
  std::vector<int64_t> steps = {0, 1, spe + 2, 3 * spe, 2};
  std::vector<std::vector<int64_t>> from_a;
  for (int64_t s : steps) from_a.push_back(a.sample_indices(s, 1));
  for (size_t k = steps.size(); k-- > 0;) EXPECT_EQ(b.sample_indices(steps[k], 1), from_a[k]);
  EXPECT_TRUE(at::equal(a.get(5, 0).inputs, b.get(5, 0).inputs));
  int differ = 0;
  for (int64_t s = 0; s < 5; ++s) differ += a.sample_indices(s, 0) != c.sample_indices(s, 0);
  EXPECT_GT(differ, 0) << "another seed must give another order";
}

TEST(DataLoader, EpochsReshuffle) {
  TempDir dir;
  auto d = byte_dataset(dir, 11 * 64);  // 64 samples of 10+1
  DataLoader loader(d, 10, 4, 1, 0, 1, 5);
  ASSERT_EQ(loader.steps_per_epoch(), 16);
  auto epoch_order = [&](int64_t e) {
    std::vector<int64_t> order;
    for (int64_t s = 0; s < 16; ++s)
      for (int64_t i : loader.sample_indices(e * 16 + s, 0)) order.push_back(i);
    return order;
  };
  auto e0 = epoch_order(0), e1 = epoch_order(1), e2 = epoch_order(2);
  EXPECT_NE(e0, e1);
  EXPECT_NE(e1, e2);
  for (auto* e : {&e0, &e1, &e2}) {  // each a permutation of all 64 samples
    std::vector<int64_t> sorted = *e;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < 64; ++i) EXPECT_EQ(sorted[static_cast<size_t>(i)], i);
  }
  // Not the identity either.
  std::vector<int64_t> identity(64);
  for (int64_t i = 0; i < 64; ++i) identity[static_cast<size_t>(i)] = i;
  EXPECT_NE(e0, identity);
}

TEST(DataLoader, OneRankEqualsTwoRanksWithSameGlobalBatch) {
  TempDir dir;
  auto d = byte_dataset(dir, 30000);
  const int64_t B = 3, T = 12;
  DataLoader one(d, T, B, 4, 0, 1, 42);  // 1 rank x 4 micro-batches
  DataLoader r0(d, T, B, 2, 0, 2, 42);   // 2 ranks x 2 micro-batches
  DataLoader r1(d, T, B, 2, 1, 2, 42);
  ASSERT_EQ(one.steps_per_epoch(), r0.steps_per_epoch());
  for (int64_t s = 0; s < 2 * one.steps_per_epoch() + 3; s += 7) {
    std::multiset<int64_t> u1, u2;
    for (int m = 0; m < 4; ++m)
      for (int64_t i : one.sample_indices(s, m)) u1.insert(i);
    for (int m = 0; m < 2; ++m) {
      for (int64_t i : r0.sample_indices(s, m)) u2.insert(i);
      for (int64_t i : r1.sample_indices(s, m)) u2.insert(i);
      // Micro-step m of the 2-rank run is micro-steps 2m (rank 0) and 2m+1 (rank 1) of 1 rank.
      EXPECT_EQ(r0.sample_indices(s, m), one.sample_indices(s, 2 * m));
      EXPECT_EQ(r1.sample_indices(s, m), one.sample_indices(s, 2 * m + 1));
    }
    EXPECT_EQ(u1, u2) << "step " << s;
  }
}

TEST(DataLoader, PermutationMatchesIndependentPython) {
  // The order is part of the format of a run (resume must see the same data), so it is pinned to
  // the documented algorithm (docs/data-and-optim.md), computed here by an independent Python.
  const std::string script =
      "M=(1<<64)-1\n"
      "def mix(z):\n"
      "  z=((z^(z>>30))*0xbf58476d1ce4e5b9)&M\n"
      "  z=((z^(z>>27))*0x94d049bb133111eb)&M\n"
      "  return z^(z>>31)\n"
      "def perm(n,seed,epoch):\n"
      "  st=[mix((seed+0x9e3779b97f4a7c15)&M)^((epoch*0xd1b54a32d192ed03)&M)]\n"
      "  def nxt():\n"
      "    st[0]=(st[0]+0x9e3779b97f4a7c15)&M\n"
      "    return mix(st[0])\n"
      "  o=list(range(n))\n"
      "  for i in range(n-1,0,-1):\n"
      "    b=i+1; th=((1<<64)-b)%b\n"
      "    r=nxt()\n"
      "    while r<th: r=nxt()\n"
      "    j=r%b; o[i],o[j]=o[j],o[i]\n"
      "  return o\n"
      "print(' '.join(map(str,perm(50,42,0)+perm(50,42,3)+perm(7,2**63+5,1))))\n";
  TempDir dir;
  write_text(dir.file("perm.py"), script);
  std::string cmd = std::string(MEMRT_PYTHON) + " " + dir.file("perm.py") + " > " + dir.file("perm.out");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(dir.file("perm.out"));
  std::vector<int64_t> expected;
  for (int64_t v; in >> v;) expected.push_back(v);
  std::vector<int64_t> got = epoch_permutation(50, 42, 0);
  auto e3 = epoch_permutation(50, 42, 3);
  auto big_seed = epoch_permutation(7, (uint64_t{1} << 63) + 5, 1);
  got.insert(got.end(), e3.begin(), e3.end());
  got.insert(got.end(), big_seed.begin(), big_seed.end());
  EXPECT_EQ(got, expected);
  EXPECT_TRUE(epoch_permutation(0, 1, 0).empty());
  EXPECT_EQ(epoch_permutation(1, 1, 0), std::vector<int64_t>({0}));
}
