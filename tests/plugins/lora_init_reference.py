"""PEFT's adapter initialisation, for tests/plugins/test_lora_linear.cpp: the draws PEFT makes for
each init_lora_weights memrt builds, from the default generator seeded just before the adapter is
made.

usage: lora_init_reference.py IN.safetensors OUT.safetensors
  For each input <c>.W (out, in), <c> = init.<value: true|false|gaussian|orthogonal>.<r>.<seed>: an
  nn.Linear(in, out) holding W, torch.manual_seed(seed), then peft.get_peft_model with
  LoraConfig(r, lora_alpha=2r, init_lora_weights=value, target_modules=["proj"]). Outputs <c>.A
  (r, in) and <c>.B (out, r), the adapter as PEFT initialised it.
"""
import logging
import sys
import warnings

logging.disable(logging.WARNING)
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


class One(torch.nn.Module):
    def __init__(self, W):
        super().__init__()
        self.proj = torch.nn.Linear(W.shape[1], W.shape[0], bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(W)

    def forward(self, x):
        return self.proj(x)


VALUES = {"true": True, "false": False, "gaussian": "gaussian", "orthogonal": "orthogonal"}
inputs = load_file(sys.argv[1])
out = {}
for name, W in sorted(inputs.items()):
    case = name[: -len(".W")]
    _, value, r, seed = case.split(".")
    model = One(W)
    torch.manual_seed(int(seed))
    peft = get_peft_model(model, LoraConfig(r=int(r), lora_alpha=2 * int(r), init_lora_weights=VALUES[value],
                                            target_modules=["proj"]))
    layer = peft.base_model.model.proj
    out[case + ".A"] = layer.lora_A["default"].weight.detach()
    out[case + ".B"] = layer.lora_B["default"].weight.detach()
save_file({k: v.contiguous() for k, v in out.items()}, sys.argv[2])
