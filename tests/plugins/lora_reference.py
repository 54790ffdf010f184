"""PEFT's LoRA layer, for tests/plugins/test_lora_linear.cpp: the wheel of the test venv
(scripts/setup.sh --test pins it) computes what memrt's LoraLinear must.

usage: lora_reference.py IN.safetensors OUT.safetensors
  For each case <c> = lora.<r>.<alpha>.<rslora: 0|1>.<dtype: f32|bf16>.<id>, the inputs <c>.W (out, in),
  optionally <c>.b (out), <c>.A (r, in), <c>.B (out, r), <c>.x (tokens, in) and <c>.dy (tokens, out):
  an nn.Linear(in, out) holding W and b in <dtype>, wrapped by peft.get_peft_model with
  LoraConfig(r, lora_alpha, use_rslora, target_modules=["proj"]) and A, B set as its adapter in fp32
  (PEFT's default: adapters stay fp32 on a 16-bit base when autocast_adapter_dtype), run forward on x
  and backward from dy. Outputs <c>.y, <c>.dx, <c>.dA, <c>.dB.
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
    def __init__(self, W, b):
        super().__init__()
        self.proj = torch.nn.Linear(W.shape[1], W.shape[0], bias=b is not None, dtype=W.dtype)
        with torch.no_grad():
            self.proj.weight.copy_(W)
            if b is not None:
                self.proj.bias.copy_(b)

    def forward(self, x):
        return self.proj(x)


inputs = load_file(sys.argv[1])
out = {}
for case in sorted({name.rsplit(".", 1)[0] for name in inputs}):
    _, r, alpha, rslora, dtype, _ = case.split(".")
    dt = torch.float32 if dtype == "f32" else torch.bfloat16
    model = One(inputs[case + ".W"].to(dt), inputs[case + ".b"].to(dt) if case + ".b" in inputs else None)
    peft = get_peft_model(model, LoraConfig(r=int(r), lora_alpha=float(alpha), use_rslora=rslora == "1",
                                            target_modules=["proj"], lora_dropout=0.0))
    layer = peft.base_model.model.proj
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(inputs[case + ".A"])
        layer.lora_B["default"].weight.copy_(inputs[case + ".B"])
    x = inputs[case + ".x"].to(dt).requires_grad_(True)
    y = peft(x)
    y.backward(inputs[case + ".dy"].to(dt))
    out[case + ".y"] = y.detach()
    out[case + ".dx"] = x.grad
    out[case + ".dA"] = layer.lora_A["default"].weight.grad
    out[case + ".dB"] = layer.lora_B["default"].weight.grad
    out[case + ".adapter_dtype"] = torch.zeros(1, dtype=layer.lora_A["default"].weight.dtype)
save_file({k: v.contiguous() for k, v in out.items()}, sys.argv[2])
