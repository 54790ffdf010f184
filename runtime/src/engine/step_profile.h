// The step profile: DeepSpeed's `flops_profiler`, answered with LibTorch's profiler.
//
// One optimizer step (flops_profiler.profile_step) runs with every ATen operator, autograd node and
// memrt scope (memrt::forward, memrt::backward, memrt::optimizer_step, memrt's own kernels)
// recorded on the thread that trains. Each operator's own time is its recorded time minus that of
// the recorded operators it called; the rows sum to the step's recorded time, so the table says
// where the step went. Matrix products (aten::mm, addmm, bmm, baddbmm) carry their FLOPs, and their
// sum is the step's GEMM time: the rest is what a faster step must take out (issue 28).
//
// Recording costs a few microseconds per operator, about 1% of a main-job step; the step is timed
// with the profiler on. docs/profiling.md has the table's columns and the JSON file's fields.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace memrt {

struct StepProfileRow {
  std::string name;     // the operator's or scope's name, e.g. "aten::mm", "memrt::optimizer_step"
  int64_t calls = 0;
  double self_s = 0.0;  // its own time, summed over calls
  double flops = 0.0;   // matrix products: 2 M N K per call, summed (0 for other operators)
  bool gemm = false;    // a matrix product
};

struct StepProfile {
  int64_t step = 0;          // the optimizer step profiled (1-based, as the log counts)
  double step_s = 0.0;       // its wall time, profiler on
  double recorded_s = 0.0;   // the rows' self times summed (the rest ran outside any recorded scope)
  double gemm_s = 0.0;       // the matrix products' self times summed
  double gemm_flops = 0.0;
  std::vector<StepProfileRow> rows;  // by self time, largest first
};

// Records the operators of the thread that calls start() until stop(). Not reentrant: one per
// process at a time (LibTorch's profiler is global).
class StepProfiler {
 public:
  StepProfiler();
  ~StepProfiler();  // stops recording if stop() was not called (an exception in the step)
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  void start();
  StepProfile stop(int64_t step, double step_s);

 private:
  bool on_ = false;
};

// The table for the log: the step's time, its GEMM share and rate, and the `top` rows by own time.
std::string format_step_profile(const StepProfile& profile, size_t top);
// The whole profile as one JSON object (every row).
std::string step_profile_json(const StepProfile& profile);

}  // namespace memrt
