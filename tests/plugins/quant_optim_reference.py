"""Low-bit AdamW on a CPU for tests/plugins/test_quant_optim.cpp, by the test venv's wheels.

usage: quant_optim_reference.py IN.safetensors OUT.safetensors OPTIM STEPS LR BETA1 BETA2 EPS WEIGHT_DECAY
  IN holds param.<i> (fp32, the initial values) and grad.<step>.<i> (fp32, step 0..STEPS-1).
  OPTIM: bnb8 (bitsandbytes.optim.AdamW8bit), ao8, ao4 (torchao.optim.AdamW8bit, AdamW4bit).
  OUT gets, after STEPS steps, param.<i> and per parameter its state. bnb8: state1.<i>, state2.<i>
  (uint8 codes, or fp32 moments under min_8bit_size) and absmax1.<i>, absmax2.<i> (fp32 per block
  of 256). ao8/ao4: exp_avg.<i>, exp_avg_sq.<i> (their codes, or fp32 moments for tensors torchao
  keeps plain) and exp_avg.scale.<i>, exp_avg_sq.scale.<i>.
"""
import logging
import sys
import warnings

logging.disable(logging.WARNING)  # bitsandbytes logs that optional GPU kernel packages are absent
warnings.filterwarnings("ignore")

import bitsandbytes as bnb  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

src, dst, optim = sys.argv[1], sys.argv[2], sys.argv[3]
steps = int(sys.argv[4])
lr, beta1, beta2, eps, wd = (float(a) for a in sys.argv[5:10])
inputs = load_file(src)
count = sum(1 for k in inputs if k.startswith("param."))
params = [torch.nn.Parameter(inputs[f"param.{i}"].clone()) for i in range(count)]
if optim == "bnb8":
    opt = bnb.optim.AdamW8bit(params, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd)
else:
    import torchao.optim  # noqa: E402

    cls = {"ao8": torchao.optim.AdamW8bit, "ao4": torchao.optim.AdamW4bit}[optim]
    opt = cls(params, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd)
for t in range(steps):
    for i, p in enumerate(params):
        p.grad = inputs[f"grad.{t}.{i}"].clone()
    opt.step()
out = {}
for i, p in enumerate(params):
    out[f"param.{i}"] = p.detach()
    state = opt.state[p]
    for key in ("state1", "state2", "absmax1", "absmax2"):  # bitsandbytes
        if key in state:
            out[f"{key}.{i}"] = state[key]
    for key in ("exp_avg", "exp_avg_sq"):  # torchao: an OptimState subclass, or a plain tensor
        if key in state:
            quantized = hasattr(state[key], "codes")
            out[f"{key}.{i}"] = state[key].codes if quantized else state[key]
            if quantized:
                out[f"{key}.scale.{i}"] = state[key].scale
save_file({k: v.contiguous() for k, v in out.items()}, dst)
