"""bitsandbytes' Linear4bit, training on a CPU, for tests/plugins/test_quant_linear4bit.cpp: the wheel of
the test venv (scripts/setup.sh --test pins it) computes what memrt's 4-bit linear must.

usage: linear4bit_reference.py IN.safetensors OUT.safetensors
  For each case <c> = lin.<nf4|fp4>.<dq0|dq1>.<compute: f32|bf16>.<id>, the inputs <c>.W (out, in) fp32,
  <c>.x (tokens, in) in the model's dtype, <c>.dy (tokens, out) in that dtype and, optionally, <c>.b (out):
  a bnb.nn.Linear4bit(in, out) in training mode holding W quantized (quant_type, blocks of 64,
  compress_statistics=dq1, compute_dtype) and b, run forward on x and backward from dy. Outputs
  <c>.y, <c>.dx, [<c>.db] and the packed weight <c>.packed.
"""
import logging
import sys
import warnings

logging.disable(logging.WARNING)  # bitsandbytes logs that optional GPU kernel packages are absent
warnings.filterwarnings("ignore")

import bitsandbytes as bnb  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

src, dst = sys.argv[1], sys.argv[2]
inputs = load_file(src)
out = {}
cases = sorted({name.rsplit(".", 1)[0] for name in inputs})
for case in cases:
    _, quant_type, dq, compute, _ = case.split(".")
    W = inputs[case + ".W"]
    x = inputs[case + ".x"].clone().requires_grad_(True)
    bias = inputs.get(case + ".b")
    layer = bnb.nn.Linear4bit(
        W.shape[1],
        W.shape[0],
        bias=bias is not None,
        compute_dtype=torch.float32 if compute == "f32" else torch.bfloat16,
        compress_statistics=dq == "dq1",
        quant_type=quant_type,
    )
    layer.weight = bnb.nn.Params4bit(
        W.clone(), requires_grad=False, quant_type=quant_type, compress_statistics=dq == "dq1", blocksize=64
    )
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias.clone())
    layer = layer.to("cpu")  # quantizes the weight
    layer.train()
    y = layer(x)
    y.backward(inputs[case + ".dy"])
    out[case + ".y"] = y.detach()
    out[case + ".dx"] = x.grad
    if bias is not None:
        out[case + ".db"] = layer.bias.grad.float()
    out[case + ".packed"] = layer.weight.data.view(torch.uint8).reshape(-1, 1)
save_file({k: v.contiguous() for k, v in out.items()}, dst)
