"""An independent reference for memrt's data-parallel training: the same GPT-2, the same
micro-batches and initial weights, trained by PyTorch itself — Hugging Face's GPT2LMHeadModel,
torch.optim.AdamW, torch.nn.utils.clip_grad_norm_, and torch.distributed (Gloo, on loopback)
averaging the ranks' gradients as DDP does. It shares no code with memrt.

    torch_reference_train.py init DIR
        writes a small GPT-2 (2 blocks of width 64, vocabulary 256, context 32, no dropout) with
        transformers' own random initialisation to DIR (config.json, model.safetensors)
    torch_reference_train.py adapter DIR OUT [dora | bias | pissa]
        writes a PEFT LoRA adapter for DIR's GPT-2 to OUT (PeftModel.save_pretrained): r 4, alpha 8,
        c_attn and c_fc, A as PEFT initialises it and B random (normal, std 0.02) so that both train;
        `dora`: use_dora (the magnitude as PEFT initialises it); `bias`: bias "all" (every bias of
        the model trains with the adapters); `pissa`: init_lora_weights "pissa", PEFT's documented
        workflow — the initial adapter saved with init_lora_weights set to True (so that loading it
        does not decompose again) to OUT, the residual model PEFT leaves (unload) to OUT_residual
    torch_reference_train.py convert RESIDUAL ADAPTER INIT OUT
        PEFT's conversion of a PiSSA / OLoRA adapter trained on RESIDUAL's GPT-2 to a plain LoRA
        adapter on the original model: save_pretrained(OUT, path_initial_model_for_weight_conversion=INIT)
    torch_reference_train.py train DIR PREFIX RANKS STEPS ACCUM MICRO T LR WD CLIP OUT [TRAINABLE [LR_GROUPS [ADAPTER [SAVE]]]]
        replays PREFIX<rank r>.bin (memrt's fixture_recorder: per step and micro-step, the
        (MICRO, T) inputs then targets, int64) on RANKS processes with a constant learning rate,
        Hugging Face Trainer's weight-decay rule (no decay for biases and LayerNorm weights) and
        gradient clipping at CLIP; writes {"loss": [...], "grad_norm": [...]} per step to OUT
        (the loss averaged over ranks, each the sum over micro-steps of the mean loss / ACCUM;
        the gradient norm before clipping). With TRAINABLE (comma-separated name fragments, as
        LLaMA-Factory's freeze tuning matches them: ".1.,ln_f"; "" for all), only the parameters
        whose name contains one of them train; the others get requires_grad False. LR_GROUPS, a
        JSON list of axolotl's lr_groups ({"name", "modules", "lr"}), puts the decaying parameters
        whose name contains one of a group's modules (the first listed that matches) in a
        torch.optim param group of that learning rate, as axolotl's trainer does; a JSON object
        {"loraplus_lr_ratio": R} instead builds the optimizer with PEFT's own
        create_loraplus_optimizer (AdamW, weight decay WD). ADAPTER, a PEFT
        adapter directory: the model is PeftModel.from_pretrained(model, ADAPTER, is_trainable=True),
        training its adapters alone; SAVE: where rank 0 saves them after training (save_pretrained)
    torch_reference_train.py compare_merged DIR ADAPTER MERGED OUT
        PEFT's merge_and_unload of ADAPTER on DIR's GPT-2 against the GPT-2 in MERGED: writes
        {"tensors": count, "worst": the largest |MERGED - PEFT's| over the largest |PEFT's|} to OUT
    torch_reference_train.py compare_adapter DIR GOT WANT OUT
        loads the adapter directory GOT onto DIR's GPT-2 with PeftModel.from_pretrained and checks
        that what PEFT then holds (get_peft_model_state_dict: adapters, biases of its bias mode) is
        GOT's tensors, none missed, none left over;
        writes {"loaded": count, "worst": the largest |GOT - WANT| over the largest |WANT|, per
        tensor} to OUT
    torch_reference_train.py decay_names OUT
        writes {model: {"names": [...], "decay": [...]}} for small GPT-2, Llama and Qwen2 models:
        their parameter names and those Hugging Face Trainer's get_decay_parameter_names decays
    torch_reference_train.py batch FILE | -
        the commands FILE (or the file named on standard input) lists, in this one process (oracle_cli.py)

Rank 0 of a `train` runs in this process and the other ranks in processes forked from it (they
inherit its imports), each on one thread.
"""
import datetime
import json
import multiprocessing
import os
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Trainer)

from oracle_cli import main


def init(directory):
    torch.manual_seed(1234)
    config = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2, n_inner=256,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    GPT2LMHeadModel(config).save_pretrained(directory, safe_serialization=True)


def adapter(directory, out, variant=""):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(4321)
    model = GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32)
    if variant == "pissa":
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                            init_lora_weights="pissa", task_type="CAUSAL_LM")
        peft_model = get_peft_model(model, config)
        peft_model.peft_config["default"].init_lora_weights = True
        peft_model.save_pretrained(out)
        peft_model.unload().save_pretrained(out + "_residual", safe_serialization=True)
        return
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                        use_dora=variant == "dora", bias="all" if variant == "bias" else "none",
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.02)
    peft_model.save_pretrained(out)


def convert(residual, adapter_dir, init_dir, out):
    from peft import PeftModel
    model = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(residual, dtype=torch.float32), adapter_dir)
    model.save_pretrained(out, path_initial_model_for_weight_conversion=init_dir)


def compare_adapter(directory, got, want, out):
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    model = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32), got)
    got_tensors = load_file(os.path.join(got, "adapter_model.safetensors"))
    want_tensors = load_file(os.path.join(want, "adapter_model.safetensors"))
    # What PEFT holds after loading, as it would save it again: every tensor of the file, in place.
    loaded = get_peft_model_state_dict(model)
    assert set(loaded) == set(got_tensors), f"PEFT loaded {sorted(set(loaded) ^ set(got_tensors))} differently from {got}"
    for key, t in loaded.items():
        assert torch.equal(t, got_tensors[key]), f"PEFT's {key} does not hold the file's"
    assert set(got_tensors) == set(want_tensors), f"keys differ: {sorted(set(got_tensors) ^ set(want_tensors))}"
    worst, key = max((((got_tensors[k] - want_tensors[k]).abs().max() / want_tensors[k].abs().max()).item(), k)
                     for k in want_tensors)
    with open(out, "w") as f:
        json.dump({"loaded": len(loaded), "worst": worst, "worst_tensor": key}, f)


def compare_merged(directory, adapter_dir, merged_dir, out):
    from peft import PeftModel
    peft_model = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32), adapter_dir)
    want = peft_model.merge_and_unload().state_dict()
    got = GPT2LMHeadModel.from_pretrained(merged_dir, dtype=torch.float32).state_dict()
    assert set(got) == set(want), f"keys differ: {sorted(set(got) ^ set(want))}"
    worst = max(((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-30)).item()
                for k in want if want[k].is_floating_point())
    with open(out, "w") as f:
        json.dump({"tensors": len(want), "worst": worst}, f)


def decay_names(model):
    # Hugging Face Trainer's own rule (its method reads nothing of the trainer).
    return set(Trainer.get_decay_parameter_names(None, model))


def write_decay_names(out):
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    models = {"gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                                    bos_token_id=0, eos_token_id=0)),
              "llama": LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **small)),
              "qwen2": Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **small))}
    with open(out, "w") as f:
        json.dump({k: {"names": [n for n, _ in m.named_parameters()], "decay": sorted(decay_names(m))}
                   for k, m in models.items()}, f)


def param_groups(named, decay, wd, lr_groups):
    """Hugging Face's decay / no-decay groups, and axolotl's lr_groups taken out of the decaying
    parameters (axolotl's OptimizerMixin.create_optimizer_grouped_parameters, for a model without
    embed_tokens or lm_head parameters: GPT-2's are transformer.wte and a tied head)."""
    lookup = {}
    for g in lr_groups:
        for module in g["modules"]:
            lookup[module] = g["name"]
    groups = {"decay": [], "no_decay": []}
    groups.update({g["name"]: [] for g in lr_groups})
    for n, p in named:
        if n in decay:
            matches = [m for m in lookup if m in n]
            groups[lookup[matches[0]] if matches else "decay"].append(p)
        else:
            groups["no_decay"].append(p)
    lrs = {g["name"]: g["lr"] for g in lr_groups}
    out = [{"params": groups["decay"], "weight_decay": wd},
           {"params": groups["no_decay"], "weight_decay": 0.0}]
    out += [{"params": groups[g["name"]], "weight_decay": wd, "lr": lrs[g["name"]]} for g in lr_groups]
    return [g for g in out if g["params"]]


def worker(rank, args, port):
    directory, prefix, ranks, steps, accum, micro, t, lr, wd, clip, out, trainable, lr_groups, adapter_dir, save = args
    torch.set_num_threads(1)
    # A rank that dies leaves the others waiting in a collective: two minutes, not Gloo's thirty.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=120))
    model = GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32)
    if adapter_dir:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
    model.train()
    if trainable:
        for n, p in model.named_parameters():
            p.requires_grad_(any(fragment in n for fragment in trainable))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if isinstance(lr_groups, dict):
        from peft.optimizers import create_loraplus_optimizer
        opt = create_loraplus_optimizer(model, torch.optim.AdamW, lr=lr, loraplus_lr_ratio=lr_groups["loraplus_lr_ratio"],
                                        loraplus_weight_decay=wd, betas=(0.9, 0.999), eps=1e-8)
    else:
        groups = param_groups(named, decay_names(model), wd, lr_groups)
        opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    tokens = np.fromfile(f"{prefix}rank{rank}.bin", dtype="<i8").reshape(steps, accum, 2, micro, t)
    params = [p for _, p in named]
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for m in range(accum):
            inputs = torch.from_numpy(tokens[step, m, 0].copy())
            targets = torch.from_numpy(tokens[step, m, 1].copy())
            logits = model(inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)) / accum
            loss.backward()
            loss_sum += loss.item()
        for p in params:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= ranks
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        total = torch.tensor([loss_sum], dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        losses.append(total.item() / ranks)
        norms.append(norm.item())
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"loss": losses, "grad_norm": norms}, f)
        if save:
            model.save_pretrained(save)
    dist.destroy_process_group()


def train(argv):
    directory, prefix, ranks, steps, accum, micro, t, lr, wd, clip, out = argv[:11]
    trainable = argv[11].split(",") if len(argv) > 11 and argv[11] else []
    lr_groups = json.loads(argv[12]) if len(argv) > 12 else []
    adapter_dir = argv[13] if len(argv) > 13 else ""
    save = argv[14] if len(argv) > 14 else ""
    args = (directory, prefix, int(ranks), int(steps), int(accum), int(micro), int(t), float(lr),
            float(wd), float(clip), out, trainable, lr_groups, adapter_dir, save)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if adapter_dir:
        import peft.optimizers  # noqa: F401 (PEFT, imported only by the runs that use it, before the fork)
    # Forked before this process starts a process group: the other ranks inherit the imports (a
    # spawned process would pay them again) and no Gloo thread.
    others = [multiprocessing.get_context("fork").Process(target=worker, args=(rank, args, port))
              for rank in range(1, args[2])]
    threads = torch.get_num_threads()
    try:
        for p in others:
            p.start()
        worker(0, args, port)
    finally:
        torch.set_num_threads(threads)
        for p in others:
            p.join(timeout=150)
            if p.is_alive():
                p.kill()
    failed = [rank for rank, p in enumerate(others, start=1) if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"ranks {failed} of the reference run failed (exit codes {[others[r - 1].exitcode for r in failed]})")


if __name__ == "__main__":
    main({"init": init, "adapter": adapter, "convert": convert, "compare_merged": compare_merged,
          "compare_adapter": compare_adapter,
          "train": lambda *argv: train(list(argv)), "decay_names": write_decay_names}, __doc__, sys.argv[1:])
