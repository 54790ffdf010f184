// The step profile (step_profile.h): LibTorch's profiler on one step, reduced to own times.
#include "engine/step_profile.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>

#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include "memrt/error.h"

namespace memrt {
namespace {

namespace prof = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

ProfilerConfig config() {
  // The FLOPs of a product are computed from its inputs' shapes, so those are recorded.
  return ProfilerConfig(ProfilerState::KINETO, /*report_input_shapes=*/true, /*profile_memory=*/false,
                        /*with_stack=*/false, /*with_flops=*/true);
}

bool is_gemm(const std::string& name) {
  static const std::set<std::string> gemms = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                                              "aten::addbmm", "aten::_addmm_activation"};
  return gemms.count(name) > 0;
}

// A C++ autograd function's backward node is named after its type,
// "torch::autograd::CppNode<memrt::ops::(anonymous namespace)::GeluTanh>": "memrt::ops::GeluTanh (backward)".
std::string readable(std::string name) {
  static const std::string node = "torch::autograd::CppNode<", anon = "(anonymous namespace)::";
  if (name.rfind(node, 0) == 0 && name.back() == '>') name = name.substr(node.size(), name.size() - node.size() - 1) + " (backward)";
  for (size_t at; (at = name.find(anon)) != std::string::npos;) name.erase(at, anon.size());
  return name;
}

struct Span {
  uint64_t start = 0, end = 0;
  size_t event = 0;
  uint64_t children_ns = 0;
};

}  // namespace

StepProfiler::StepProfiler() = default;

StepProfiler::~StepProfiler() {
  if (on_) {
    try {
      prof::disableProfiler();
    } catch (...) {  // the step's own exception is the one the caller sees
    }
  }
}

void StepProfiler::start() {
  if (prof::isProfilerEnabledInMainThread()) {
    throw Error("flops_profiler: LibTorch's profiler is already running in this process (a plugin's?); "
                "turn one of them off");
  }
  const std::set<ActivityType> cpu = {ActivityType::CPU};
  prof::prepareProfiler(config(), cpu);
  prof::enableProfiler(config(), cpu);
  on_ = true;
}

StepProfile StepProfiler::stop(int64_t step, double step_s) {
  on_ = false;
  const std::unique_ptr<prof::ProfilerResult> result = prof::disableProfiler();
  const std::vector<prof::KinetoEvent>& events = result->events();

  // Spans by thread; the step's thread is the one whose outermost spans cover the most time (the
  // BLAS's and OpenMP's workers record nothing of their own, but a backward thread could).
  std::map<uint64_t, std::vector<Span>> by_thread;
  for (size_t i = 0; i < events.size(); ++i) {
    const prof::KinetoEvent& e = events[i];
    if (e.deviceType() != c10::DeviceType::CPU || e.isAsync() || e.endNs() < e.startNs()) continue;
    by_thread[e.startThreadId()].push_back({e.startNs(), e.endNs(), i, 0});
  }
  StepProfile out;
  out.step = step;
  out.step_s = step_s;
  uint64_t best_cover = 0;
  std::vector<Span>* spans = nullptr;
  for (auto& [tid, list] : by_thread) {
    // Parents before their children: by start, the longer first.
    std::sort(list.begin(), list.end(), [](const Span& a, const Span& b) {
      return a.start != b.start ? a.start < b.start : a.end > b.end;
    });
    uint64_t cover = 0, reach = 0;
    for (const Span& s : list) {
      if (s.start >= reach) cover += s.end - s.start;
      reach = std::max(reach, s.end);
    }
    if (cover > best_cover) best_cover = cover, spans = &list;
  }
  if (!spans) return out;

  std::vector<size_t> open;  // indices into *spans, innermost last
  for (size_t k = 0; k < spans->size(); ++k) {
    Span& s = (*spans)[k];
    while (!open.empty() && (*spans)[open.back()].end <= s.start) open.pop_back();
    if (!open.empty()) (*spans)[open.back()].children_ns += s.end - s.start;
    open.push_back(k);
  }
  std::map<std::string, StepProfileRow> rows;
  for (const Span& s : *spans) {
    const prof::KinetoEvent& e = events[s.event];
    const std::string name = readable(e.name());
    StepProfileRow& row = rows[name];
    row.name = name;
    row.calls += 1;
    const uint64_t dur = s.end - s.start;
    row.self_s += 1e-9 * static_cast<double>(dur > s.children_ns ? dur - s.children_ns : 0);
    row.gemm = is_gemm(row.name);
    if (row.gemm) row.flops += static_cast<double>(e.flops());
  }
  for (auto& [name, row] : rows) {
    out.recorded_s += row.self_s;
    if (row.gemm) out.gemm_s += row.self_s, out.gemm_flops += row.flops;
    out.rows.push_back(std::move(row));
  }
  std::sort(out.rows.begin(), out.rows.end(),
            [](const StepProfileRow& a, const StepProfileRow& b) { return a.self_s > b.self_s; });
  return out;
}

std::string format_step_profile(const StepProfile& p, size_t top) {
  std::ostringstream os;
  char line[256];
  const double step = std::max(p.step_s, 1e-12);
  std::snprintf(line, sizeof line,
                "step profile (flops_profiler, step %lld): %.1f ms; matrix products %.1f ms (%.1f%%), "
                "%.1f GFLOP at %.1f GFLOP/s; recorded %.1f%%\n",
                static_cast<long long>(p.step), 1e3 * p.step_s, 1e3 * p.gemm_s, 100.0 * p.gemm_s / step,
                1e-9 * p.gemm_flops, p.gemm_s > 0 ? 1e-9 * p.gemm_flops / p.gemm_s : 0.0,
                100.0 * p.recorded_s / step);
  os << line;
  std::snprintf(line, sizeof line, "  %-60s %7s %10s %7s %10s\n", "operator (own time)", "calls", "ms", "%",
                "GFLOP/s");
  os << line;
  for (size_t i = 0; i < std::min(top, p.rows.size()); ++i) {
    const StepProfileRow& r = p.rows[i];
    std::string rate = r.gemm && r.self_s > 0 ? std::to_string(static_cast<long long>(1e-9 * r.flops / r.self_s)) : "";
    std::snprintf(line, sizeof line, "  %-60.60s %7lld %10.2f %7.1f %10s\n", r.name.c_str(),
                  static_cast<long long>(r.calls), 1e3 * r.self_s, 100.0 * r.self_s / step, rate.c_str());
    os << line;
  }
  if (p.rows.size() > top) {
    double rest = 0.0;
    for (size_t i = top; i < p.rows.size(); ++i) rest += p.rows[i].self_s;
    std::snprintf(line, sizeof line, "  %-60s %7zu %10.2f %7.1f\n", "(the other operators)", p.rows.size() - top,
                  1e3 * rest, 100.0 * rest / step);
    os << line;
  }
  return os.str();
}

std::string step_profile_json(const StepProfile& p) {
  rapidjson::StringBuffer sb;
  rapidjson::Writer<rapidjson::StringBuffer> w(sb);
  auto number = [&w](const char* key, double v) { w.Key(key), w.Double(v); };
  w.StartObject();
  w.Key("step"), w.Int64(p.step);
  number("step_s", p.step_s);
  number("recorded_s", p.recorded_s);
  number("gemm_s", p.gemm_s);
  number("gemm_flops", p.gemm_flops);
  w.Key("ops"), w.StartArray();
  for (const StepProfileRow& r : p.rows) {
    w.StartObject();
    w.Key("name"), w.String(r.name.c_str());
    w.Key("calls"), w.Int64(r.calls);
    number("self_s", r.self_s);
    number("flops", r.flops);
    w.Key("gemm"), w.Bool(r.gemm);
    w.EndObject();
  }
  w.EndArray();
  w.EndObject();
  return sb.GetString();
}

}  // namespace memrt
