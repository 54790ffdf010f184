#include "adam_state.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include <memrt/error.h>

namespace memrt::quant {

void plan_low_bit_state(StorePlan& plan, const std::function<bool(int64_t numel)>& keeps_32bit,
                        const StateFormat& plain, const StateFormat& quantized) {
  const std::vector<StoreGroup> groups = plan.groups();  // add_group changes the list
  std::set<std::string> small_groups;
  for (const StoreGroup& g : groups) {
    std::set<std::string> small;
    for (int slot : g.slots) {
      const ParamSlot& s = plan.slots()[static_cast<size_t>(slot)];
      if (keeps_32bit(s.numel)) small.insert(s.param.name);
    }
    if (small.empty()) continue;
    const std::string name = g.name + "_32bit";
    plan.add_group({name, [small](const ParamInfo& p) { return small.count(p.name) > 0; }, g.weight_decay, g.lr_scale});
    small_groups.insert(name);
  }
  const auto is_small = [small_groups](const StoreGroup& g) { return small_groups.count(g.name) > 0; };
  const bool any_large =
      std::any_of(plan.groups().begin(), plan.groups().end(), [&](const StoreGroup& g) { return !is_small(g); });
  if (!small_groups.empty())
    plan.set_state_format(plain, GroupSelector("groups of tensors kept in 32-bit state (" + plain.name + ")", is_small));
  if (any_large)
    plan.set_state_format(quantized, GroupSelector("groups of " + quantized.name + " state",
                                                   [is_small](const StoreGroup& g) { return !is_small(g); }));
}

Fp32Range::Fp32Range(const StepRange& r, const char* who) {
  if (!r.compute.is_cpu())
    throw Error(std::string(who) + ": parameter '" + r.param->name + "' is on " + r.compute.device().str() +
                "; this memrt's low-bit step runs on the CPU only (offload_optimizer puts it there)");
  const at::ScalarType t = r.grad.scalar_type();
  if ((t != at::kFloat && t != at::kBFloat16 && t != at::kHalf) || !r.grad.is_contiguous() || r.grad.numel() != r.n)
    throw Error(std::string(who) + ": the gradient of '" + r.param->name + "' is " + c10::toString(t) +
                ", " + std::to_string(r.grad.numel()) + " elements" + (r.grad.is_contiguous() ? "" : ", strided") +
                "; the step reads " + std::to_string(r.n) + " contiguous fp32, bf16 or fp16 values");
  p = r.master.defined() ? r.master : r.compute.to(at::kFloat);
  grad = GradIn{r.grad.data_ptr(), t, r.grad_factor};
}

void Fp32Range::finish(const StepRange& r) const {
  if (!p.is_same(r.compute)) r.compute.copy_(p);
}

}  // namespace memrt::quant
