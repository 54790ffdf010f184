"""Loads a Hugging Face directory with `transformers` (as a user would) and writes the fp32 logits
of token ids to a safetensors file, for memrt's export test.

    hf_logits.py DIR IDS OUT      IDS: comma-separated token ids (one sequence)
"""
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
model.eval()
ids = torch.tensor([[int(t) for t in sys.argv[2].split(",")]])
with torch.no_grad():
    logits = model(ids).logits.contiguous()
save_file({"logits": logits}, sys.argv[3])
