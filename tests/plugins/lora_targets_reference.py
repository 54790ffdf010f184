"""Which modules PEFT adapts, for tests/plugins/test_lora_targets.cpp: the wheel of the test venv
(scripts/setup.sh --test pins it) decides what memrt's select_targets must.

usage: lora_targets_reference.py IN.json OUT.json
  IN: a list of cases {"arch": "llama" | "gpt2", "n_layer": N, "target_modules": a list, a string
  or "all-linear", "layers_to_transform": null or a list}. For each, a tiny transformers model of
  that architecture (random weights) is wrapped by peft.get_peft_model(LoraConfig(r=2, ...)).
  OUT: per case {"adapted": the sorted names of the modules holding lora_A} or {"error": PEFT's
  message} when PEFT refuses the config or a matched module.
"""
import json
import logging
import sys
import warnings

logging.disable(logging.WARNING)
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402


def model(arch, n_layer):
    torch.manual_seed(0)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=n_layer,
                                            num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=n_layer, n_head=2, n_positions=32))


def adapted(case):
    try:
        config = LoraConfig(r=2, target_modules=case["target_modules"],
                            layers_to_transform=case.get("layers_to_transform"),
                            fan_in_fan_out=case["arch"] == "gpt2")
        peft_model = get_peft_model(model(case["arch"], case["n_layer"]), config)
    except ValueError as e:
        return {"error": str(e)}
    prefix = "base_model.model."
    names = sorted(name[len(prefix):] for name, module in peft_model.named_modules()
                   if hasattr(module, "lora_A") and name.startswith(prefix))
    return {"adapted": names}


with open(sys.argv[1]) as f:
    cases = json.load(f)
with open(sys.argv[2], "w") as f:
    json.dump([adapted(c) for c in cases], f)
