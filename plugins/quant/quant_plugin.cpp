// plugins/quant — 4-bit / 8-bit quantization (bitsandbytes keys, 8-bit optimizers).
//
// Not implemented yet: the host loads this plugin when train.yaml asks for quant, and it refuses
// with a message saying so, rather than training something other than what was asked for.
#include <memrt/plugin.h>

namespace {

class QuantPlugin final : public memrt::Plugin {
 public:
  void configure(const memrt::ConfigNode& options, memrt::ConfigDiagnostics& /*diag*/,
                 const memrt::RunInfo& /*run*/) override {
    throw options.error("4-bit / 8-bit quantization (bitsandbytes keys, 8-bit optimizers) is not implemented yet in this memrt version (plugins/quant); "
                        "train without it (load_in_4bit: false and an optim such as adamw_torch)");
  }
};

}  // namespace

MEMRT_PLUGIN(QuantPlugin, "quant", "0.1.0", "4-bit / 8-bit quantization (bitsandbytes keys, 8-bit optimizers) (not implemented yet)")
