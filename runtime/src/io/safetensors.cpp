// safetensors reader and writer. See safetensors.h for the format and what is validated.
#include "memrt/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <set>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <rapidjson/document.h>
#include <rapidjson/error/en.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include "io/safetensors_write.h"

#include "memrt/error.h"

namespace memrt {
namespace {

struct DtypeInfo {
  const char* name;
  at::ScalarType dtype;
};

// In safetensors' Dtype enum order (the writer sorts by it, widest first); names with no LibTorch
// dtype (F4, F6_*) are absent and rejected as unsupported.
const DtypeInfo kDtypes[] = {
    {"BOOL", at::kBool},
    {"U8", at::kByte},
    {"I8", at::kChar},
    {"F8_E5M2", at::kFloat8_e5m2},
    {"F8_E4M3", at::kFloat8_e4m3fn},
    {"F8_E8M0", at::kFloat8_e8m0fnu},
    {"F8_E4M3FNUZ", at::kFloat8_e4m3fnuz},
    {"F8_E5M2FNUZ", at::kFloat8_e5m2fnuz},
    {"I16", at::kShort},
    {"U16", at::kUInt16},
    {"F16", at::kHalf},
    {"BF16", at::kBFloat16},
    {"I32", at::kInt},
    {"U32", at::kUInt32},
    {"F32", at::kFloat},
    {"C64", at::kComplexFloat},
    {"F64", at::kDouble},
    {"I64", at::kLong},
    {"U64", at::kUInt64},
};
const char* const kKnownWithoutTorchDtype[] = {"F4", "F6_E2M3", "F6_E3M2"};

int dtype_rank(at::ScalarType t) {
  for (size_t i = 0; i < std::size(kDtypes); ++i)
    if (kDtypes[i].dtype == t) return static_cast<int>(i);
  return -1;
}

std::string errno_text() { return std::strerror(errno); }

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

std::optional<at::ScalarType> safetensors_dtype(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.dtype;
  return std::nullopt;
}

std::optional<std::string> safetensors_dtype_name(at::ScalarType dtype) {
  for (const auto& d : kDtypes)
    if (d.dtype == dtype) return std::string(d.name);
  return std::nullopt;
}

// ---- reading --------------------------------------------------------------------------------

struct SafetensorsFile::Mapping {
  void* addr = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (addr) munmap(addr, size);
  }
};

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  auto fail = [&](const std::string& msg) { return FileError(path, msg); };

  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw fail("cannot open safetensors file: " + errno_text());
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    std::string e = errno_text();
    ::close(fd);
    throw fail("cannot stat: " + e);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw fail("not a regular file; expected a .safetensors file");
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    throw fail("truncated: " + std::to_string(file_size) +
               " bytes, but a safetensors file starts with an 8-byte header length");
  }
  auto mapping = std::make_shared<Mapping>();
  // Private and writable: tensors viewing it may be written (copy-on-write), the file never is.
  void* addr = mmap(nullptr, file_size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  std::string map_error = addr == MAP_FAILED ? errno_text() : "";
  ::close(fd);
  if (addr == MAP_FAILED) throw fail("cannot memory-map: " + map_error);
  mapping->addr = addr;
  mapping->size = file_size;
  const auto* bytes = static_cast<const uint8_t*>(addr);
  // Only the header is read here, with no read-around into the tensors behind it (a reader of some
  // tensors or of slices of them reads just those: the Hugging Face loader); the mapping's advice
  // is the kernel's default again once it is parsed.
  madvise(addr, file_size, MADV_RANDOM);

  const uint64_t header_len = read_u64_le(bytes);
  if (header_len > kSafetensorsMaxHeaderBytes)
    throw fail("header length " + std::to_string(header_len) + " exceeds the limit of " +
               std::to_string(kSafetensorsMaxHeaderBytes) +
               " bytes; the file is corrupt or not a safetensors file");
  if (header_len > file_size - 8)
    throw fail("header length " + std::to_string(header_len) + " runs past the end of the file (" +
               std::to_string(file_size) + " bytes); the file is truncated or not safetensors");
  if (header_len < 2 || bytes[8] != '{')
    throw fail("header does not start with '{'; the file is not a safetensors file");

  madvise(addr, 8 + header_len, MADV_WILLNEED);
  rapidjson::Document doc;
  doc.Parse<rapidjson::kParseValidateEncodingFlag | rapidjson::kParseFullPrecisionFlag>(
      reinterpret_cast<const char*>(bytes + 8), header_len);
  madvise(addr, file_size, MADV_NORMAL);
  if (doc.HasParseError())
    throw fail(std::string("header is not valid UTF-8 JSON: ") +
               rapidjson::GetParseError_En(doc.GetParseError()) + " at header byte " +
               std::to_string(doc.GetErrorOffset()));
  if (!doc.IsObject()) throw fail("header is not a JSON object");

  SafetensorsFile f;
  f.path_ = path;
  f.mapping_ = mapping;
  f.data_ = bytes + 8 + header_len;
  const uint64_t data_size = file_size - 8 - header_len;

  std::set<std::string> seen;
  for (auto it = doc.MemberBegin(); it != doc.MemberEnd(); ++it) {
    std::string name(it->name.GetString(), it->name.GetStringLength());
    if (!seen.insert(name).second) throw fail("tensor '" + name + "' appears twice in the header");
    const auto& v = it->value;
    if (name == "__metadata__") {
      if (!v.IsObject()) throw fail("'__metadata__' must be an object of string -> string");
      for (auto m = v.MemberBegin(); m != v.MemberEnd(); ++m) {
        std::string key(m->name.GetString(), m->name.GetStringLength());
        if (!m->value.IsString())
          throw fail("'__metadata__' value of '" + key +
                     "' is not a string (safetensors metadata is string -> string only)");
        f.metadata_[key] = std::string(m->value.GetString(), m->value.GetStringLength());
      }
      continue;
    }
    auto bad = [&](const std::string& msg) { return fail("tensor '" + name + "': " + msg); };
    if (!v.IsObject()) throw bad("entry is not an object {dtype, shape, data_offsets}");
    for (auto m = v.MemberBegin(); m != v.MemberEnd(); ++m) {
      std::string key(m->name.GetString(), m->name.GetStringLength());
      if (key != "dtype" && key != "shape" && key != "data_offsets")
        throw bad("unknown field '" + key + "' (expected dtype, shape, data_offsets)");
    }
    auto dt = v.FindMember("dtype");
    if (dt == v.MemberEnd() || !dt->value.IsString()) throw bad("missing string field 'dtype'");
    std::string dtype_name = dt->value.GetString();
    auto dtype = safetensors_dtype(dtype_name);
    if (!dtype) {
      bool known = std::find(std::begin(kKnownWithoutTorchDtype), std::end(kKnownWithoutTorchDtype),
                             dtype_name) != std::end(kKnownWithoutTorchDtype);
      throw bad("dtype '" + dtype_name + "' " +
                (known ? "has no LibTorch equivalent and is not supported"
                       : "is not a safetensors dtype (expected F64, F32, F16, BF16, I64, I32, I16, "
                         "I8, U8, BOOL, ...)"));
    }
    auto sh = v.FindMember("shape");
    if (sh == v.MemberEnd() || !sh->value.IsArray()) throw bad("missing array field 'shape'");
    Entry e;
    e.dtype = *dtype;
    uint64_t numel = 1;
    for (const auto& d : sh->value.GetArray()) {
      if (!d.IsUint64() || d.GetUint64() > static_cast<uint64_t>(INT64_MAX))
        throw bad("shape entries must be non-negative integers");
      uint64_t dim = d.GetUint64();
      if (dim != 0 && numel > UINT64_MAX / dim) throw bad("shape product overflows 64 bits");
      numel *= dim;
      e.shape.push_back(static_cast<int64_t>(dim));
    }
    auto off = v.FindMember("data_offsets");
    if (off == v.MemberEnd() || !off->value.IsArray() || off->value.Size() != 2 ||
        !off->value[0].IsUint64() || !off->value[1].IsUint64())
      throw bad("'data_offsets' must be [begin, end], two non-negative integers");
    e.begin = off->value[0].GetUint64();
    e.end = off->value[1].GetUint64();
    if (e.end < e.begin) throw bad("data_offsets end < begin");
    const uint64_t elem = c10::elementSize(e.dtype);
    if (numel > UINT64_MAX / elem) throw bad("byte size overflows 64 bits");
    if (e.end - e.begin != numel * elem)
      throw bad("data_offsets span " + std::to_string(e.end - e.begin) + " bytes, but shape " +
                c10::str(at::IntArrayRef(e.shape)) + " of " + dtype_name + " needs " +
                std::to_string(numel * elem));
    if (e.end > data_size)
      throw bad("data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                "] run past the end of the file (data buffer is " + std::to_string(data_size) +
                " bytes); the file is truncated");
    f.entries_.emplace(name, std::move(e));
    f.order_.push_back(name);
  }

  // The tensors must tile the buffer: no gap, no overlap, nothing left over.
  std::stable_sort(f.order_.begin(), f.order_.end(), [&](const std::string& a, const std::string& b) {
    const Entry& ea = f.entries_.at(a);
    const Entry& eb = f.entries_.at(b);
    return ea.begin != eb.begin ? ea.begin < eb.begin : ea.end < eb.end;
  });
  uint64_t expected = 0;
  for (const auto& name : f.order_) {
    const Entry& e = f.entries_.at(name);
    if (e.begin != expected)
      throw fail("tensor '" + name + "': data_offsets begin at " + std::to_string(e.begin) +
                 " but the previous tensor ends at " + std::to_string(expected) + " (" +
                 (e.begin < expected ? "overlap" : "gap") + "); the header is corrupt");
    expected = e.end;
  }
  if (expected != data_size)
    throw fail(std::to_string(data_size - expected) +
               " bytes after the last tensor are not described by the header; the file is corrupt");
  return f;
}

std::vector<std::string> SafetensorsFile::names() const { return order_; }

const SafetensorsFile::Entry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) throw FileError(path_, "no tensor named '" + name + "'");
  return it->second;
}

uint64_t SafetensorsFile::data_bytes() const {
  return order_.empty() ? 0 : entries_.at(order_.back()).end;
}

void SafetensorsFile::drop_pages(const std::string& name) const {
  const Entry& e = entry(name);
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(data_ + e.begin);
  const auto end = reinterpret_cast<uintptr_t>(data_ + e.end);
  const uintptr_t first = (begin + page - 1) / page * page, last = end / page * page;
  if (first < last) madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

at::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const Entry& e = entry(name);
  auto options = at::TensorOptions().dtype(e.dtype).device(at::kCPU);
  void* ptr = const_cast<uint8_t*>(data_ + e.begin);
  const size_t elem = c10::elementSize(e.dtype);
  if (reinterpret_cast<uintptr_t>(ptr) % elem != 0) {
    at::Tensor copy = at::empty(e.shape, options);  // aligned copy, same shape
    std::memcpy(copy.data_ptr(), ptr, e.end - e.begin);
    return copy;
  }
  std::shared_ptr<Mapping> keep = mapping_;
  return at::from_blob(ptr, e.shape, [keep](void*) mutable { keep.reset(); }, options);
}

// ---- writing --------------------------------------------------------------------------------

namespace {

// Writes via a temporary file in the destination folder, then renames over `path`.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path)
      : path_(std::move(path)), tmp_(path_ + ".tmp." + std::to_string(::getpid())) {
    file_ = std::fopen(tmp_.c_str(), "wb");
    if (!file_) throw FileError(path_, "cannot create " + tmp_ + ": " + errno_text());
  }
  ~AtomicFile() {
    if (file_) {
      std::fclose(file_);
      std::remove(tmp_.c_str());
    }
  }
  void write(const void* data, size_t n) {
    if (n && std::fwrite(data, 1, n, file_) != n)
      throw FileError(path_, "write failed: " + errno_text() + " (disk full?)");
  }
  void commit() {
    bool ok = std::fflush(file_) == 0 && ::fsync(fileno(file_)) == 0;
    std::string e = ok ? "" : errno_text();
    ok = (std::fclose(file_) == 0) && ok;
    file_ = nullptr;
    if (!ok || std::rename(tmp_.c_str(), path_.c_str()) != 0) {
      if (e.empty()) e = errno_text();
      std::remove(tmp_.c_str());
      throw FileError(path_, "cannot finish writing: " + e);
    }
  }

 private:
  std::string path_, tmp_;
  std::FILE* file_ = nullptr;
};

}  // namespace

void write_file_atomic(const std::string& path, const std::string& bytes) {
  AtomicFile f(path);
  f.write(bytes.data(), bytes.size());
  f.commit();
}

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  write_safetensors_as(path, tensors, {}, metadata);
}

void write_safetensors_as(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                          const std::vector<at::ScalarType>& as, const std::map<std::string, std::string>& metadata) {
  TORCH_CHECK(as.empty() || as.size() == tensors.size(), "write_safetensors_as: one dtype per tensor");
  struct Item {
    std::string name;
    at::Tensor tensor;
    int rank;
    at::ScalarType dtype;  // written in
  };
  std::vector<Item> items;
  std::set<std::string> names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    if (name.empty() || name == "__metadata__")
      throw Error("write_safetensors(" + path + "): invalid tensor name '" + name + "'");
    if (!names.insert(name).second)
      throw Error("write_safetensors(" + path + "): tensor '" + name + "' given twice");
    if (!t.defined())
      throw Error("write_safetensors(" + path + "): tensor '" + name + "' is undefined");
    const at::ScalarType dtype = as.empty() || as[i] == at::ScalarType::Undefined ? t.scalar_type() : as[i];
    int rank = dtype_rank(dtype);
    if (rank < 0)
      throw Error("write_safetensors(" + path + "): tensor '" + name + "' has dtype " +
                  std::string(c10::toString(dtype)) + ", which safetensors cannot store");
    items.push_back({name, t, rank, dtype});
  }
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.name < b.name;
  });

  rapidjson::StringBuffer sb;
  rapidjson::Writer<rapidjson::StringBuffer> w(sb);
  w.StartObject();
  if (!metadata.empty()) {
    w.Key("__metadata__");
    w.StartObject();
    for (const auto& [k, v] : metadata) {
      w.Key(k.data(), static_cast<rapidjson::SizeType>(k.size()));
      w.String(v.data(), static_cast<rapidjson::SizeType>(v.size()));
    }
    w.EndObject();
  }
  uint64_t offset = 0;
  for (const auto& it : items) {
    const uint64_t nbytes = static_cast<uint64_t>(it.tensor.numel()) * c10::elementSize(it.dtype);
    w.Key(it.name.data(), static_cast<rapidjson::SizeType>(it.name.size()));
    w.StartObject();
    w.Key("dtype");
    w.String(safetensors_dtype_name(it.dtype)->c_str());
    w.Key("shape");
    w.StartArray();
    for (int64_t d : it.tensor.sizes()) w.Uint64(static_cast<uint64_t>(d));
    w.EndArray();
    w.Key("data_offsets");
    w.StartArray();
    w.Uint64(offset);
    w.Uint64(offset + nbytes);
    w.EndArray();
    w.EndObject();
    offset += nbytes;
  }
  w.EndObject();
  std::string header(sb.GetString(), sb.GetSize());
  header.append((8 - header.size() % 8) % 8, ' ');  // the tensor buffer starts 8-byte aligned

  AtomicFile f(path);
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(header.size() >> (8 * i));
  f.write(len, 8);
  f.write(header.data(), header.size());
  for (const auto& it : items) {  // one converted copy alive at a time
    at::Tensor cpu = it.tensor.detach().to(at::kCPU, it.dtype).contiguous();
    f.write(cpu.data_ptr(), static_cast<size_t>(cpu.numel()) * cpu.element_size());
  }
  f.commit();
}

}  // namespace memrt
