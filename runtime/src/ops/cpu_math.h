// What this processor offers LibTorch's CPU math, and the matmul path memrt picks from it
// (memrt/ops.h). Split into facts read from the machine and a pure choice over them, so the
// choice is tested for processors we do not have.
#pragma once

#include <string>

#include "memrt/ops.h"

namespace memrt::ops {

struct CpuFacts {
  std::string name;          // /proc/cpuinfo's model name (cpuinfo's when absent)
  bool intel = false;        // /proc/cpuinfo's vendor_id is GenuineIntel: MKL runs at full speed
  // Instruction sets, as cpuinfo (LibTorch's own detector) reports them.
  bool avx2 = false;
  bool avx512_core = false;  // AVX-512 F, BW, VL and DQ: oneDNN's avx512_core
  bool avx512_bf16 = false;
  bool avx512_fp16 = false;
  bool amx_bf16 = false;
  bool amx_fp16 = false;
  bool avx2_vnni_2 = false;  // AVX-NE-CONVERT with AVX-VNNI-INT8: oneDNN's avx2_vnni_2
  std::string onednn_cap;    // ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) as set, upper case; "" if unset
  std::string aten_isa;      // the ISA ATen's vectorised kernels were dispatched to: AVX512, AVX2, ...
  std::string blas;          // e.g. "MKL 2024.2, oneDNN 3.12.0"
};

CpuFacts read_cpu_facts();

struct MatmulPlan {
  MatmulPath bf16 = MatmulPath::kNative;
  MatmulPath fp16 = MatmulPath::kNative;
  std::string bf16_how, fp16_how;  // what runs them, for the start-up line
};

// LibTorch sends a 16-bit GEMM to oneDNN when oneDNN's effective ISA supports the dtype (ideep's
// has_bf16_type_support / has_fp16_type_support); otherwise to a scalar loop.
MatmulPlan choose_matmul_plan(const CpuFacts& facts);

std::string describe(const CpuFacts& facts, const MatmulPlan& plan);

// The kFp32Arithmetic kernels behind memrt::ops::linear and causal_attention (no dropout),
// callable whatever this processor's plan is (the tests run them on every machine).
at::Tensor linear_fp32_arithmetic(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);
at::Tensor causal_attention_fp32_arithmetic(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

}  // namespace memrt::ops
