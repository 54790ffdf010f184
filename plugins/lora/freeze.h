// LLaMA-Factory's freeze tuning (`finetuning_type: freeze`): which parameters train, decided from
// their names alone, as LLaMA-Factory's _setup_freeze_tuning decides it (model/adapter.py):
//
//   layers   freeze_trainable_layers n > 0: the last n blocks; n < 0: the first -n; with
//            use_llama_pro: every (L / n)-th block, ending with the last (L divisible by n)
//   modules  freeze_trainable_modules: "all", or names of a block's direct children
//            ("self_attn", "mlp", "input_layernorm", ...; GPT-2: "attn", "mlp", "ln_1", "ln_2"),
//            the names found after ".0." (or ".1.") in the parameter names
//   extra    freeze_extra_modules: names of modules outside the blocks ("embed_tokens", "norm",
//            "lm_head"; GPT-2: "wte", "wpe", "ln_f"), each a parameter name's second-last part
//   train    a parameter trains when its name contains ".<layer>.<module>" (".<layer>." for
//            "all") for a chosen layer and module, or contains an extra module's name — a
//            substring test, as LLaMA-Factory's: extra "norm" also trains every block's norms
//
// A module name that matches nothing is an error naming the key and the names available.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace memrt::lora {

struct FreezeOptions {
  std::string file;                         // the config file, for errors
  int64_t trainable_layers = 2;             // freeze_trainable_layers (LLaMA-Factory's default)
  std::vector<std::string> modules{"all"};  // freeze_trainable_modules
  std::vector<std::string> extra;           // freeze_extra_modules
  bool llama_pro = false;                   // use_llama_pro
};

// Whether each of `names` trains, for a model of `num_layers` blocks. Throws memrt::ConfigError
// naming the key for a module that matches nothing or a layer count LLaMA-Pro cannot stride.
std::vector<bool> freeze_trainable(const std::vector<std::string>& names, int64_t num_layers,
                                   const FreezeOptions& options);

}  // namespace memrt::lora
