"""Hugging Face checkpoints saved quantized by bitsandbytes, as transformers writes them, for
tests/engine/test_quant.cpp.

usage: bnb4bit_checkpoint.py OUT_DIR

Writes under OUT_DIR:
  fp/           a small Llama in fp32 (transformers' save_pretrained)
  nf4/          fp/ loaded with BitsAndBytesConfig(load_in_4bit, nf4, double quantization) and saved
  fp4/          the same with fp4 and no double quantization
  gpt2_fp/      a small GPT-2 in fp32 (its projections are Conv1D, which transformers transposes
                into Linear4bit's (out, in) before quantizing)
  gpt2_nf4/     gpt2_fp/ with nf4 and double quantization
  nf4_badmap/   nf4/ with one quant_map entry changed
  nf4_gptq/     nf4/ whose config.json says quant_method "gptq"
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import BitsAndBytesConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def quantized(cls, src: Path, dst: Path, quant_type: str, double_quant: bool) -> None:
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.float32)
    model = cls.from_pretrained(src, quantization_config=config, device_map="cpu", dtype=torch.float32)
    model.save_pretrained(dst, safe_serialization=True)


def main() -> None:
    out = Path(sys.argv[1])
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out / "fp", safe_serialization=True)
    quantized(LlamaForCausalLM, out / "fp", out / "nf4", "nf4", True)
    quantized(LlamaForCausalLM, out / "fp", out / "fp4", "fp4", False)

    # No dropout: the runs' memory is then estimated op by op, to the byte (with dropout, memrt's
    # estimate of a partly frozen model is an upper bound: docs/memory.md).
    gpt2 = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    GPT2LMHeadModel(gpt2).save_pretrained(out / "gpt2_fp", safe_serialization=True)
    quantized(GPT2LMHeadModel, out / "gpt2_fp", out / "gpt2_nf4", "nf4", True)

    shutil.copytree(out / "nf4", out / "nf4_badmap")
    weights = out / "nf4_badmap" / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.up_proj.weight.quant_map"][3] += 0.125
    save_file(tensors, weights, metadata={"format": "pt"})

    shutil.copytree(out / "nf4", out / "nf4_gptq")
    config_json = out / "nf4_gptq" / "config.json"
    hf = json.loads(config_json.read_text())
    hf["quantization_config"]["quant_method"] = "gptq"
    config_json.write_text(json.dumps(hf, indent=2))


if __name__ == "__main__":
    main()
