"""The independent reference for `launcher eval`: transformers (with PEFT, and bitsandbytes for a
4-bit base) computing the loss of a held-out file as Hugging Face users compute it. It shares no
code with memrt.

    peft_eval.py make gpt2|llama DIR
        writes a small model with transformers' own random initialisation to DIR (config.json,
        model.safetensors; vocabulary 256 for byte-level text, context 32, 2 blocks of width 64) and
        PEFT LoRA adapters for it (PeftModel.save_pretrained), DIR/lora, DIR/rslora, DIR/layers,
        DIR/dora (use_dora: DoRA's magnitude vector) and,
        for GPT-2, DIR/bias_all and DIR/bias_lora_only, for Llama DIR/saved: r 4, alpha 8 (rslora:
        use_rslora, scaling alpha / sqrt(r); layers: layers_to_transform [1], the second block
        alone; bias_*: PEFT's bias modes "all" and "lora_only"; saved: modules_to_save lm_head and
        embed_tokens), lora_dropout 0.1 (evaluation must not apply it), every projection (GPT-2:
        c_attn, c_proj, c_fc; Llama: q/k/v/o and gate/up/down), B, DoRA's magnitude, the trained
        biases and the modules trained in full moved by normal noise (std 0.02) so that what the
        adapter saves counts
    peft_eval.py loss DIR FILE BLOCK OUT [--nf4 [--dequantize] [--save SAVE]] [ADAPTER ...]
        the mean next-token loss of FILE's bytes: consecutive windows of BLOCK tokens (the remainder
        dropped), each window's model(input_ids=w, labels=w).loss with the model in eval mode,
        averaged over the windows (each predicts BLOCK - 1 tokens: the mean over every predicted
        token). Once for the model alone, then once per ADAPTER (PeftModel.from_pretrained on a
        fresh copy, its adapters trainable). --nf4: DIR loaded in 4 bits by bitsandbytes (NF4, double quantization, fp32
        compute: QLoRA's BitsAndBytesConfig); --dequantize: then every 4-bit linear replaced by an
        nn.Linear of its weight as bitsandbytes' dequantize_4bit returns it (the exact computation on
        the 4-bit weights, where bitsandbytes' CPU 4-bit matmul approximates); --save: where that
        4-bit model is saved
        (save_pretrained: a bnb-4bit directory). Writes {"losses": [model, adapters...],
        "windows": ..., "tokens": ..., "lines": [print_trainable_parameters' line per adapter]} to OUT.
    peft_eval.py merged4 DIR ADAPTER MERGED OUT [fp32|bf16]
        DIR loaded in 4 bits as `loss --nf4` does, ADAPTER on it: each adapted layer's weight as
        bitsandbytes dequantizes it plus PEFT's get_delta_weight, every other tensor as loaded,
        against the plain model in MERGED (`launcher export --merge`; with bf16, the reference
        rounded to bf16 against `--merge --dtype bf16`'s): writes {"tensors": count, "worst": the
        largest |MERGED - reference| over the tensor's largest |reference|, "dtypes": MERGED's} to OUT.
    peft_eval.py merged DIR ADAPTER MERGED OUT
        DIR's fp32 model with ADAPTER, PEFT's merge_and_unload() (modules_to_save: the trained copy in
        place of the original), against the plain model in MERGED; writes OUT as merged4 does.
    peft_eval.py compare_init DIR INIT GOT OUT
        the adapter PEFT's get_peft_model initialises on DIR's fp32 Llama with init_lora_weights INIT
        ("pissa", "olora": A0, B0 from the base weights; r 4, alpha 8, every projection) against the
        second half of the adapter in GOT, a PiSSA / OLoRA adapter converted to a plain LoRA of rank
        8 (A = [A_trained; A0], B = [B_trained, -B0]): writes {"tensors": count, "worst": the largest
        |GOT's half - PEFT's| over the largest |PEFT's|, "config": GOT's adapter_config.json} to OUT
    peft_eval.py batch FILE | -
        the commands FILE (or the file named on standard input) lists, in this one process (oracle_cli.py)
"""
import json
import os
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (AutoModelForCausalLM, BitsAndBytesConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM)

from oracle_cli import main


def make(kind, directory):
    torch.manual_seed(1234)
    gpt2 = kind == "gpt2"
    if gpt2:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                           n_inner=256))
    else:  # bitsandbytes' CPU 4-bit kernels need every input width a multiple of its block (64)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=192,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=32, tie_word_embeddings=False))
    model.save_pretrained(directory, safe_serialization=True)
    targets = ["c_attn", "c_proj", "c_fc"] if gpt2 else ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"]
    for name in ("lora", "rslora", "layers", "dora") + (("bias_all", "bias_lora_only") if gpt2 else ("saved",)):
        bias = name[5:] if name.startswith("bias_") else "none"
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=targets, fan_in_fan_out=gpt2,
                            use_rslora=name == "rslora", use_dora=name == "dora", layers_to_transform=[1] if name == "layers" else None,
                            bias=bias, modules_to_save=["lm_head", "embed_tokens"] if name == "saved" else None,
                            task_type="CAUSAL_LM")
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32), config)
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n or "lora_magnitude" in n or (p.requires_grad and ("bias" in n or "modules_to_save" in n)):
                    p.add_(torch.randn_like(p) * 0.02)
        peft_model.save_pretrained(os.path.join(directory, name))


def nf4_config():
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32)


def merged4(directory, adapter_dir, merged_dir, out, dtype="fp32"):
    import bitsandbytes as bnb
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, quantization_config=nf4_config(),
                                                 device_map="cpu")
    model = PeftModel.from_pretrained(model, adapter_dir)
    want = {}
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            w = module.base_layer.weight
            base = bnb.functional.dequantize_4bit(w.data, w.quant_state).float()
            want[name.replace("base_model.model.", "") + ".weight"] = base + module.get_delta_weight("default")
    for name, p in model.named_parameters():
        key = name.replace("base_model.model.", "")
        if "lora_" not in key and ".base_layer." not in key:
            want[key] = p.detach().float()
    compare_merged(want, merged_dir, out, dtype)


def merged(directory, adapter_dir, merged_dir, out):
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32), adapter_dir)
    want = {k: v.detach() for k, v in model.merge_and_unload().state_dict().items()}
    compare_merged(want, merged_dir, out, "fp32")


def compare_init(directory, init, got_dir, out):
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=init, task_type="CAUSAL_LM",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32), config)
    want = get_peft_model_state_dict(peft_model)
    got = load_file(os.path.join(got_dir, "adapter_model.safetensors"))
    assert set(got) == set(want), f"keys differ: {sorted(set(got) ^ set(want))}"
    worst = 0.0
    for key, w in want.items():
        half = got[key][4:] if "lora_A" in key else -got[key][:, 4:]
        assert half.shape == w.shape, f"{key}: {tuple(got[key].shape)} has no second half of {tuple(w.shape)}"
        worst = max(worst, ((half - w).abs().max() / w.abs().max()).item())
    with open(out, "w") as f:
        json.dump({"tensors": len(want), "worst": worst,
                   "config": json.load(open(os.path.join(got_dir, "adapter_config.json")))}, f)


def compare_merged(want, merged_dir, out, dtype):
    from safetensors.torch import load_file
    got = load_file(os.path.join(merged_dir, "model.safetensors"))
    assert set(got) == set(want), f"keys differ: {sorted(set(got) ^ set(want))}"
    want = {k: v.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]) for k, v in want.items()}
    worst = max(((got[k].float() - want[k].float()).abs().max() / want[k].float().abs().max()).item() for k in want)
    with open(out, "w") as f:
        json.dump({"tensors": len(want), "worst": worst, "dtypes": sorted({str(t.dtype) for t in got.values()})}, f)


def loss(directory, text_file, block, out, *rest):
    rest = list(rest)
    nf4 = "--nf4" in rest
    dequantize = "--dequantize" in rest
    save = rest[rest.index("--save") + 1] if "--save" in rest else ""
    adapters = [a for i, a in enumerate(rest) if not a.startswith("--") and (i == 0 or rest[i - 1] != "--save")]
    block = int(block)
    kwargs = {"dtype": torch.float32}
    if nf4:
        kwargs["quantization_config"] = nf4_config()
        kwargs["device_map"] = "cpu"
    data = torch.tensor(list(open(text_file, "rb").read()), dtype=torch.long)
    windows = data.numel() // block
    losses, lines = [], []
    for adapter_dir in [""] + adapters:
        model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
        if save and not adapter_dir:
            model.save_pretrained(save)
        if dequantize:
            import bitsandbytes as bnb
            for name, module in list(model.named_modules()):
                if isinstance(module, bnb.nn.Linear4bit):
                    w = module.weight
                    plain = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
                    with torch.no_grad():
                        plain.weight.copy_(bnb.functional.dequantize_4bit(w.data, w.quant_state).float())
                        if module.bias is not None:
                            plain.bias.copy_(module.bias)
                    parent, _, child = name.rpartition(".")
                    setattr(model.get_submodule(parent), child, plain)
        if adapter_dir:
            model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
            trainable, total = model.get_nb_trainable_parameters()
            lines.append(f"trainable params: {trainable:,d} || all params: {total:,d} || "
                         f"trainable%: {100 * trainable / total:.4f}")
        model.eval()
        total = 0.0
        with torch.no_grad():
            for w in range(windows):
                ids = data[w * block:(w + 1) * block].unsqueeze(0)
                total += model(input_ids=ids, labels=ids).loss.double().item()
        losses.append(total / windows)
    with open(out, "w") as f:
        json.dump({"losses": losses, "windows": windows, "tokens": windows * (block - 1), "lines": lines}, f)


if __name__ == "__main__":
    main({"make": make, "loss": loss, "merged": merged, "merged4": merged4, "compare_init": compare_init}, __doc__, sys.argv[1:])
