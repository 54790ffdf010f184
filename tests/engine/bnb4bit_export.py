"""Loads a directory `launcher export` wrote from a 4-bit run with transformers and bitsandbytes, as
a user would, for tests/engine/test_quant.cpp; exits 1 saying what differs.

usage: bnb4bit_export.py DIR TEXT_FILE BLOCK_SIZE

- from_pretrained reports no missing, unexpected or mismatched tensor, and every block projection
  is a bitsandbytes Linear4bit;
- the loaded model's tensors, with each Linear4bit's quant_state packed by bitsandbytes itself
  (QuantState.as_dict(packed=True), what transformers' save_pretrained writes), equal the export's
  byte for byte (names, dtypes, shapes, values, the quant_state JSON), and its quantization_config
  the export's: the export is transformers' own format;
- prints "loss <value>": the mean cross-entropy of the file's first BLOCK_SIZE + 1 bytes (inputs
  its first BLOCK_SIZE, targets its last BLOCK_SIZE), computed in fp32 by the loaded model in
  training mode.
"""
import json
import sys
from pathlib import Path

import bitsandbytes as bnb
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

src, text_file, block = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
model, info = AutoModelForCausalLM.from_pretrained(src, device_map="cpu", dtype=torch.float32,
                                                   output_loading_info=True)
problems = [f"{k}: {v}" for k, v in info.items() if v]
linears = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
if not linears:
    problems.append("no module was loaded as bnb.nn.Linear4bit")

# What bitsandbytes itself writes for each loaded Linear4bit (QuantState.as_dict(packed=True), as
# transformers' save_pretrained stores it), and every other tensor of the loaded model, against the
# export byte for byte.
ours = load_file(src / "model.safetensors")
theirs = {}
for name, module in model.named_modules():
    if isinstance(module, bnb.nn.Linear4bit):
        theirs[f"{name}.weight"] = module.weight.data
        for key, value in module.weight.quant_state.as_dict(packed=True).items():
            theirs[f"{name}.weight.{key}"] = value
        if module.bias is not None:
            theirs[f"{name}.bias"] = module.bias.data
for name, tensor in model.state_dict().items():
    theirs.setdefault(name, tensor)
if getattr(model.config, "tie_word_embeddings", False):
    theirs.pop("lm_head.weight", None)
for name in sorted(set(ours) | set(theirs)):
    if name not in theirs or name not in ours:
        problems.append(f"{name}: only in {'the export' if name in ours else 'the loaded model'}")
    elif ours[name].dtype != theirs[name].dtype or ours[name].shape != theirs[name].shape:
        problems.append(f"{name}: {ours[name].dtype} {tuple(ours[name].shape)} exported, "
                        f"{theirs[name].dtype} {tuple(theirs[name].shape)} loaded")
    elif not torch.equal(ours[name], theirs[name]):
        problems.append(f"{name}: values differ" +
                        (f": {bytes(ours[name].tolist())!r} vs {bytes(theirs[name].tolist())!r}"
                         if ".quant_state." in name else ""))
q_ours = json.loads((src / "config.json").read_text())["quantization_config"]
q_theirs = model.config.quantization_config.to_dict()
if q_ours != q_theirs:
    problems.append(f"quantization_config: {q_ours} exported, {q_theirs} loaded")

# In training mode, the path QLoRA trains through (dequantize_4bit, then the matmul in the compute
# dtype; memrt's exported configs have no dropout). In eval mode bitsandbytes 0.50 repacks the
# weights for its CPU inference kernel, which differs from that by ~1e-5 relative.
model.train()
data = torch.tensor(list(text_file.read_bytes()[: block + 1]))
with torch.no_grad():
    logits = model(data[:-1].view(1, -1)).logits[0].float()
    loss = torch.nn.functional.cross_entropy(logits, data[1:])
print(f"{len(linears)} Linear4bit modules")
for p in problems:
    print("MISMATCH", p)
print(f"loss {loss.item():.9g}")
sys.exit(1 if problems else 0)
