// safetensors: files from the Python package read correctly, files we write are read by it, and
// corrupt or truncated files are rejected with a message naming the problem.
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "memrt/safetensors.h"
#include "memrt/error.h"
#include "test_util.h"

namespace memrt {
namespace {
using namespace memrt_test;

struct DtypeCase {
  const char* name;
  at::ScalarType dtype;
};
// The same table as reference.py's dtype_table().
const DtypeCase kCases[] = {
    {"f64", at::kDouble},   {"f32", at::kFloat},  {"f16", at::kHalf},
    {"bf16", at::kBFloat16}, {"i64", at::kLong},   {"i32", at::kInt},
    {"i16", at::kShort},    {"i8", at::kChar},    {"u8", at::kByte},
    {"bool", at::kBool},    {"f8_e4m3", at::kFloat8_e4m3fn}, {"f8_e5m2", at::kFloat8_e5m2},
    {"u16", at::kUInt16},   {"u32", at::kUInt32}, {"u64", at::kUInt64},
};

// reference.py's pattern(): (3, 4), arange(12) - 4 (halved for floats; unsigned: arange(12);
// bool: arange % 3 == 0), built here in int64/double and compared after widening.
at::Tensor pattern_f64(at::ScalarType dtype) {  // (3, 4) double
  at::Tensor base = at::arange(12, at::kLong).reshape({3, 4});
  if (dtype == at::kBool) return (base.remainder(3) == 0).to(at::kDouble);
  if (dtype == at::kByte || dtype == at::kUInt16 || dtype == at::kUInt32 || dtype == at::kUInt64)
    return base.to(at::kDouble);
  if (at::isFloatingType(dtype)) return (base - 4).to(at::kDouble) * 0.5;
  return (base - 4).to(at::kDouble);
}

at::Tensor widen(const at::Tensor& t) {  // any dtype -> double (via int64 for the unsigned ones)
  if (t.scalar_type() == at::kUInt16 || t.scalar_type() == at::kUInt32 ||
      t.scalar_type() == at::kUInt64) {
    // LibTorch's uint16/32/64 support few kernels; reinterpret the (small, non-negative) values.
    at::Tensor out = at::empty(t.sizes(), at::kDouble);
    auto* o = out.data_ptr<double>();
    const auto* p = static_cast<const uint8_t*>(t.data_ptr());
    const size_t es = t.element_size();
    for (int64_t i = 0; i < t.numel(); ++i) {
      uint64_t v = 0;
      std::memcpy(&v, p + i * es, es);  // little-endian
      o[i] = static_cast<double>(v);
    }
    return out;
  }
  return t.to(at::kDouble);
}

at::Tensor pattern(at::ScalarType dtype) {  // the pattern in `dtype`
  at::Tensor d = pattern_f64(dtype);
  if (dtype == at::kUInt16 || dtype == at::kUInt32 || dtype == at::kUInt64) {
    at::Tensor out = at::empty({3, 4}, at::TensorOptions().dtype(dtype));
    auto* p = static_cast<uint8_t*>(out.data_ptr());
    const size_t es = out.element_size();
    for (int64_t i = 0; i < 12; ++i) {
      uint64_t v = static_cast<uint64_t>(d.reshape({-1})[i].item<double>());
      std::memcpy(p + i * es, &v, es);
    }
    return out;
  }
  return d.to(dtype);
}

TEST(Safetensors, ReadsEveryDtypeWrittenByThePythonPackage) {
  const std::string dir = scratch_dir();
  const std::string path = dir + "/dtypes.safetensors";
  std::string out;
  ASSERT_EQ(run_reference("dtypes", path, out), 0) << out;

  SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("note"), "written by the python package");
  EXPECT_EQ(f.names().size(), std::size(kCases) + 2);
  for (const auto& c : kCases) {
    SCOPED_TRACE(c.name);
    at::Tensor t = f.tensor(c.name);
    EXPECT_EQ(t.scalar_type(), c.dtype);
    EXPECT_EQ(t.sizes(), at::IntArrayRef({3, 4}));
    EXPECT_TRUE(at::equal(widen(t), pattern_f64(c.dtype)));
  }
  at::Tensor empty = f.tensor("empty");
  EXPECT_EQ(empty.sizes(), at::IntArrayRef({0, 3}));
  at::Tensor scalar = f.tensor("scalar");
  EXPECT_EQ(scalar.dim(), 0);
  EXPECT_EQ(scalar.item<float>(), 2.5f);
}

TEST(Safetensors, ReadsShardsWrittenByThePythonPackage) {
  const std::string dir = scratch_dir() + "/sharded";
  std::string out;
  ASSERT_EQ(run_reference("sharded", dir, out), 0) << out;
  SafetensorsFile a = SafetensorsFile::open(dir + "/model-00001-of-00002.safetensors");
  SafetensorsFile b = SafetensorsFile::open(dir + "/model-00002-of-00002.safetensors");
  EXPECT_TRUE(at::equal(a.tensor("a.weight"), at::arange(6, at::kFloat).reshape({2, 3})));
  EXPECT_TRUE(at::equal(a.tensor("a.bias"), at::tensor({1.5f, -2.0f})));
  EXPECT_TRUE(at::equal(b.tensor("b.weight"), at::arange(4, at::kBFloat16).reshape({2, 2})));
  EXPECT_FALSE(a.contains("b.weight"));
}

std::vector<std::pair<std::string, at::Tensor>> every_dtype() {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& c : kCases) tensors.emplace_back(c.name, pattern(c.dtype));
  tensors.emplace_back("empty", at::zeros({0, 3}, at::kFloat));
  tensors.emplace_back("scalar", at::scalar_tensor(2.5, at::kFloat));
  return tensors;
}

TEST(Safetensors, FilesWeWriteAreReadByThePythonPackage) {
  const std::string path = scratch_dir() + "/ours.safetensors";
  const std::map<std::string, std::string> meta{
      {"format", "pt"}, {"writer", "memrt"}, {"unicode", "h\xc3\xa9llo \"quoted\""}};
  write_safetensors(path, every_dtype(), meta);
  std::string out;
  EXPECT_EQ(run_reference("verify", path, out), 0) << out;
}

TEST(Safetensors, RoundTripIsZeroCopyAndOutlivesTheFileObject) {
  const std::string dir = scratch_dir();
  const std::string path = dir + "/rt.safetensors";
  at::Tensor a = at::randn({4, 5});                       // (4, 5)
  at::Tensor b = at::randn({5, 3}).t();                   // (3, 5), not contiguous
  at::Tensor c = at::arange(7, at::kLong);                // (7)
  write_safetensors(path, {{"a", a}, {"b", b}, {"c", c}}, {{"format", "pt"}});
  write_safetensors(path, {{"a", a}, {"b", b}, {"c", c}}, {{"format", "pt"}});  // over itself
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1)
      << "a temporary file was left behind";

  at::Tensor ra, rb, rc;
  {
    SafetensorsFile f = SafetensorsFile::open(path);
    EXPECT_EQ(f.names(), (std::vector<std::string>{"c", "a", "b"}));  // I64 before F32, then name
    ra = f.tensor("a");
    rb = f.tensor("b");
    rc = f.tensor("c");
    // Views into one mapping: the distance between data pointers is the distance of the offsets.
    EXPECT_EQ(static_cast<char*>(rb.data_ptr()) - static_cast<char*>(ra.data_ptr()),
              static_cast<int64_t>(f.entry("b").begin - f.entry("a").begin));
  }  // the SafetensorsFile is gone; the tensors keep the mapping alive
  EXPECT_TRUE(at::equal(ra, a));
  EXPECT_TRUE(at::equal(rb, b));
  EXPECT_TRUE(at::equal(rc, c));
  const std::string before = read_bytes(path);
  ra.add_(1.0);  // copy-on-write: the file does not change
  EXPECT_EQ(read_bytes(path), before);
  // Header padded to 8 bytes with spaces.
  uint64_t n = 0;
  std::memcpy(&n, before.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(before[8 + n - 1] == ' ' || before[8 + n - 1] == '}', true);
}

TEST(Safetensors, DroppedPagesReadBackFromTheFile) {
  const std::string path = scratch_dir() + "/big.safetensors";
  at::Tensor big = at::randn({1024, 1024});  // (1024, 1024) 4 MiB: many whole pages
  at::Tensor small = at::arange(10, at::kFloat);
  write_safetensors(path, {{"big", big}, {"small", small}});
  SafetensorsFile f = SafetensorsFile::open(path);
  at::Tensor view = f.tensor("big");
  EXPECT_TRUE(at::equal(view, big));
  f.drop_pages("big");
  f.drop_pages("small");  // smaller than a page: nothing to drop, still fine
  EXPECT_TRUE(at::equal(view, big));
  EXPECT_TRUE(at::equal(f.tensor("small"), small));
}

TEST(Safetensors, WriteRejectsBadInput) {
  const std::string path = scratch_dir() + "/bad.safetensors";
  at::Tensor t = at::ones({2});
  EXPECT_THROW(write_safetensors(path, {{"x", t}, {"x", t}}), Error);
  EXPECT_THROW(write_safetensors(path, {{"", t}}), Error);
  EXPECT_THROW(write_safetensors(path, {{"__metadata__", t}}), Error);
  EXPECT_THROW(write_safetensors(path, {{"z", at::ones({2}, at::kComplexDouble)}}), Error);
  EXPECT_FALSE(fs::exists(path));
}

// ---- corrupt and truncated files ----------------------------------------------------------------

std::string file_bytes(const std::string& header, const std::string& data) {
  std::string s(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s + header + data;
}

struct Corrupt {
  const char* what;
  std::string bytes;
  std::vector<std::string> message_parts;  // each must appear in the error message
};

std::vector<Corrupt> corrupt_cases() {
  const std::string eight(8, '\x01');
  const std::string ok_header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::string huge(8, '\0');
  huge[7] = 0x10;  // 2^60
  std::string past = file_bytes(ok_header, eight);
  past[0] = static_cast<char>(past[0] + 100);  // header length beyond the file
  return {
      {"empty file", "", {"truncated", "0 bytes"}},
      {"shorter than the length prefix", "\x05\x00\x00", {"truncated"}},
      {"header length too large", huge + "{}", {"exceeds the limit"}},
      {"header length past the end", past, {"runs past the end of the file"}},
      {"not JSON", file_bytes("{\"w\": [1, 2", ""), {"not valid UTF-8 JSON"}},
      {"invalid UTF-8", file_bytes("{\"\xff\xfe\":{}}", ""), {"not valid UTF-8 JSON"}},
      {"header not an object", file_bytes("[1,2,3]", ""), {"does not start with '{'"}},
      {"unknown dtype",
       file_bytes(R"({"w":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", eight),
       {"'w'", "F33", "not a safetensors dtype"}},
      {"dtype without a LibTorch type",
       file_bytes(R"({"w":{"dtype":"F4","shape":[16],"data_offsets":[0,8]}})", eight),
       {"'w'", "F4", "no LibTorch equivalent"}},
      {"shape and byte span disagree",
       file_bytes(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight),
       {"'w'", "needs 12"}},
      {"data truncated", file_bytes(ok_header, "\x01\x02\x03\x04"), {"'w'", "truncated"}},
      {"gap between tensors",
       file_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                  std::string(12, '\0')),
       {"'b'", "gap"}},
      {"overlapping tensors",
       file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                  eight),
       {"'b'", "overlap"}},
      {"bytes after the last tensor", file_bytes(ok_header, eight + "junk"),
       {"4 bytes after the last tensor"}},
      {"metadata value not a string",
       file_bytes(R"({"__metadata__":{"format":{"nested":1}}})", ""),
       {"__metadata__", "'format'", "not a string"}},
      {"duplicate tensor",
       file_bytes(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                  eight),
       {"'w'", "appears twice"}},
      {"negative dimension",
       file_bytes(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight),
       {"'w'", "non-negative"}},
      {"missing dtype", file_bytes(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", eight),
       {"'w'", "dtype"}},
      {"offsets not a pair",
       file_bytes(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", eight),
       {"'w'", "data_offsets"}},
      {"unknown field",
       file_bytes(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", eight),
       {"'w'", "unknown field 'x'"}},
      {"shape overflow",
       file_bytes(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
                  eight),
       {"'w'", "overflows"}},
  };
}

TEST(Safetensors, CorruptFilesAreRejectedWithAMessageNamingTheProblem) {
  const std::string dir = scratch_dir();
  int i = 0;
  for (const Corrupt& c : corrupt_cases()) {
    SCOPED_TRACE(c.what);
    const std::string path = dir + "/corrupt" + std::to_string(i++) + ".safetensors";
    write_bytes(path, c.bytes);
    try {
      SafetensorsFile::open(path);
      ADD_FAILURE() << "accepted";
    } catch (const FileError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      for (const auto& part : c.message_parts) EXPECT_NE(msg.find(part), std::string::npos) << msg;
    }
  }
  EXPECT_GE(i, 8);
}

TEST(Safetensors, EveryTruncationOfAValidFileIsRejected) {
  const std::string dir = scratch_dir();
  const std::string path = dir + "/whole.safetensors";
  write_safetensors(path, {{"a", at::randn({3, 2})}, {"b", at::arange(5, at::kInt)}},
                    {{"format", "pt"}});
  const std::string whole = read_bytes(path);
  for (size_t n = 0; n < whole.size(); ++n) {
    write_bytes(dir + "/cut.safetensors", whole.substr(0, n));
    EXPECT_THROW(SafetensorsFile::open(dir + "/cut.safetensors"), FileError) << n << " bytes";
  }
  EXPECT_NO_THROW(SafetensorsFile::open(path));
}

TEST(Safetensors, MissingFileAndUnknownTensorAreFileErrors) {
  const std::string dir = scratch_dir();
  EXPECT_THROW(SafetensorsFile::open(dir + "/absent.safetensors"), FileError);
  EXPECT_THROW(SafetensorsFile::open(dir), FileError);  // a folder
  write_safetensors(dir + "/one.safetensors", {{"a", at::ones({1})}});
  SafetensorsFile f = SafetensorsFile::open(dir + "/one.safetensors");
  try {
    f.tensor("nope");
    ADD_FAILURE();
  } catch (const FileError& e) {
    EXPECT_NE(std::string(e.what()).find("'nope'"), std::string::npos);
  }
  EXPECT_TRUE(f.metadata().empty());
}

}  // namespace
}  // namespace memrt
