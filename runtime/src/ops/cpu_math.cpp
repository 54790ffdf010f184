#include "ops/cpu_math.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>

#include <ATen/Version.h>
#include <ATen/cpu/Utils.h>

namespace memrt::ops {
namespace {

std::string upper(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::toupper(c); });
  return s;
}

std::string first_match(const std::string& text, const std::string& pattern) {
  std::smatch m;
  return std::regex_search(text, m, std::regex(pattern)) ? m[1].str() : std::string();
}

// oneDNN's ISA levels in its own order of dispatch (cpu_isa_traits.hpp): a cap admits every
// level up to and including itself. avx2_vnni_2 and avx512_core are different branches; a cap
// at either end admits the other only if it ranks above it here, which matches oneDNN for every
// cap a user would set (AVX2..., AVX512_CORE..., AVX10...).
const char* const kIsaOrder[] = {
    "SSE41",           "AVX",                "AVX2",
    "AVX2_VNNI",       "AVX2_VNNI_2",        "AVX512_CORE",
    "AVX512_CORE_VNNI", "AVX512_CORE_BF16",  "AVX512_CORE_FP16",
    "AVX10_1_512",     "AVX512_CORE_AMX",    "AVX10_1_512_AMX",
    "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
    "AVX10_2_512_AMX_2"};

// Rank of an ISA level; an unset, ALL/DEFAULT or unknown cap ranks above every level (oneDNN
// ignores values it does not know).
int isa_rank(const std::string& isa) {
  const int n = static_cast<int>(std::size(kIsaOrder));
  for (int i = 0; i < n; ++i)
    if (isa == kIsaOrder[i]) return i;
  return n;
}

bool cap_admits(const std::string& cap, const char* level) { return isa_rank(cap) >= isa_rank(level); }

}  // namespace

const char* to_string(MatmulPath path) {
  return path == MatmulPath::kNative ? "native" : "fp32 arithmetic";
}

CpuFacts read_cpu_facts() {
  CpuFacts f;
  const auto caps = at::cpu::get_cpu_capabilities();
  auto flag = [&](const char* key) {
    auto it = caps.find(key);
    return it != caps.end() && it->second.isBool() && it->second.toBool();
  };
  f.avx2 = flag("avx2");
  f.avx512_core = flag("avx512_f") && flag("avx512_bw") && flag("avx512_vl") && flag("avx512_dq");
  f.avx512_bf16 = flag("avx512_bf16");
  f.avx512_fp16 = flag("avx512_fp16");
  f.amx_bf16 = flag("amx_bf16");
  f.amx_fp16 = flag("amx_fp16");
  f.avx2_vnni_2 = flag("avx_ne_convert") && flag("avx_vnni_int8");

  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line) && !line.empty();) {  // the first processor
    if (line.find(':') == std::string::npos) continue;
    if (line.rfind("model name", 0) == 0) f.name = line.substr(line.find(':') + 2);
    if (line.rfind("vendor_id", 0) == 0) f.intel = line.find("GenuineIntel") != std::string::npos;
  }
  if (f.name.empty()) {
    auto it = caps.find("cpu_name");
    f.name = it != caps.end() && it->second.isString() ? it->second.toStringRef() : "unknown CPU";
  }
  for (const char* var : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}) {
    if (const char* v = std::getenv(var); v && *v) {
      f.onednn_cap = upper(v);
      break;
    }
  }
  f.aten_isa = at::get_cpu_capability();
  const std::string mkl = first_match(at::get_mkl_version(), R"(Version ([0-9.]+))");
  const std::string dnnl = first_match(at::get_mkldnn_version(), R"(v([0-9.]+))");
  f.blas = (mkl.empty() ? std::string("no MKL") : "MKL " + mkl) +
           (dnnl.empty() ? std::string(", no oneDNN") : ", oneDNN " + dnnl);
  return f;
}

MatmulPlan choose_matmul_plan(const CpuFacts& f) {
  const std::string& cap = f.onednn_cap;
  const std::string capped = cap.empty() ? "" : " (ONEDNN_MAX_CPU_ISA=" + cap + ")";
  MatmulPlan plan;

  // bf16: oneDNN runs it from avx512_core up (emulated below AVX512_BF16) or on avx2_vnni_2. On an
  // Intel processor without AMX, MKL's fp32 GEMM is the faster of the two (308-362 against 198
  // GFLOP/s on a Xeon with AVX512-BF16 and no AMX: bench/RESULTS.md), so bf16 takes it there; on
  // AMD, where MKL's fp32 GEMM is slow (121 against oneDNN's 366 in bf16 on a Zen 4), oneDNN.
  const bool bf16_512 = f.avx512_core && cap_admits(cap, "AVX512_CORE");
  const bool bf16_vnni2 = f.avx2_vnni_2 && cap_admits(cap, "AVX2_VNNI_2");
  const bool amx = f.amx_bf16 && cap_admits(cap, "AVX512_CORE_AMX");
  if ((bf16_512 || bf16_vnni2) && (amx || !f.intel)) {
    const bool native = f.avx512_bf16 && cap_admits(cap, "AVX512_CORE_BF16");
    plan.bf16_how = std::string("oneDNN (") +
                    (amx ? "AMX-BF16" : native ? "AVX512-BF16" : bf16_512 ? "AVX-512, converted" : "AVX2-VNNI-2") +
                    ")";
  } else if (bf16_512 || bf16_vnni2) {
    plan.bf16 = MatmulPath::kFp32Arithmetic;
    plan.bf16_how = "fp32 GEMM on bf16 storage: on an Intel processor without AMX" + capped +
                    " MKL's fp32 GEMM outruns oneDNN's bf16 one";
  } else {
    plan.bf16 = MatmulPath::kFp32Arithmetic;
    plan.bf16_how = "fp32 GEMM on bf16 storage: oneDNN has no bf16 GEMM without AVX-512" + capped;
  }

  // fp16: oneDNN needs avx512_core_fp16 (AVX512-FP16) or avx2_vnni_2.
  const bool fp16_512 = (f.avx512_fp16 || f.amx_fp16) && cap_admits(cap, "AVX512_CORE_FP16");
  const bool fp16_vnni2 = f.avx2_vnni_2 && cap_admits(cap, "AVX2_VNNI_2");
  if (fp16_512 || fp16_vnni2) {
    const bool amx_fp16 = f.amx_fp16 && cap_admits(cap, "AVX512_CORE_AMX_FP16");
    plan.fp16_how = std::string("oneDNN (") +
                    (amx_fp16 ? "AMX-FP16" : fp16_512 ? "AVX512-FP16" : "AVX2-VNNI-2") + ")";
  } else {
    plan.fp16 = MatmulPath::kFp32Arithmetic;
    plan.fp16_how = "fp32 GEMM on fp16 storage: no AVX512-FP16 here" + capped +
                    ", where LibTorch's fp16 GEMM is a scalar loop";
  }
  return plan;
}

std::string describe(const CpuFacts& f, const MatmulPlan& plan) {
  std::ostringstream os;
  os << "cpu: " << f.name << "; ATen kernels " << f.aten_isa << ", " << f.blas
     << "; matmul fp32: " << (f.blas.rfind("MKL", 0) == 0 ? "MKL" : "LibTorch's BLAS")
     << ", bf16: " << plan.bf16_how << ", fp16: " << plan.fp16_how;
  return os.str();
}

bool cpu_supports(CpuKernels kernels) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)  // where the kernels are compiled
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  if (kernels == CpuKernels::kAvx512) return avx512;
  if (kernels == CpuKernels::kAvx2) return avx2;
#else
  if (kernels == CpuKernels::kAvx512 || kernels == CpuKernels::kAvx2) return false;
#endif
  return true;
}

const char* to_string(CpuKernels kernels) {
  switch (kernels) {
    case CpuKernels::kBest: return "best";
    case CpuKernels::kAvx512: return "AVX-512F";
    case CpuKernels::kAvx2: return "AVX2+F16C";
    case CpuKernels::kPortable: return "portable";
  }
  return "?";
}

}  // namespace memrt::ops
