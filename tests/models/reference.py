"""Independent reference for memrt's model and safetensors tests (plain torch + safetensors).

Written from the published architecture descriptions (GPT-2: Radford et al. 2019 and Hugging
Face's GPT2LMHeadModel layout with Conv1D weights stored (in, out); Llama: Touvron et al. 2023 and
Hugging Face's LlamaForCausalLM: RMSNorm, SwiGLU, rotary embeddings with rotate_half, grouped-query
attention), in float64 with explicit attention, explicit GELU-tanh and explicit RMSNorm; it shares
no code with memrt's C++.

Commands:
  reference.py models OUT       write HF checkpoint directories and golden logits/loss under OUT
  reference.py dtypes FILE      write every dtype, an empty and a 0-d tensor, with metadata
  reference.py sharded DIR      write DIR as a sharded HF-style directory of arbitrary tensors
  reference.py verify FILE      check a file memrt wrote: values, metadata and byte-identity
                                with safetensors.torch.save of the same tensors
  reference.py verify_hf DIR    check a directory save_hf_checkpoint wrote loads with HF names
"""
import json
import math
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save, save_file

# --------------------------------------------------------------------------------------------
# Deterministic tensors both sides can build: values exactly representable in every dtype.


def dtype_table():
    return {
        "f64": torch.float64, "f32": torch.float32, "f16": torch.float16,
        "bf16": torch.bfloat16, "i64": torch.int64, "i32": torch.int32, "i16": torch.int16,
        "i8": torch.int8, "u8": torch.uint8, "bool": torch.bool,
        "f8_e4m3": torch.float8_e4m3fn, "f8_e5m2": torch.float8_e5m2,
        "u16": torch.uint16, "u32": torch.uint32, "u64": torch.uint64,
    }


def pattern(name, dtype):
    """(3, 4) tensor: arange(12) - 4 (arange(12) for unsigned, arange % 3 == 0 for bool)."""
    base = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    if dtype == torch.bool:
        return base % 3 == 0
    if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        return base.to(dtype)
    if dtype.is_floating_point:
        return ((base - 4).to(torch.float64) * 0.5).to(dtype)
    return (base - 4).to(dtype)


def write_dtypes(path):
    tensors = {name: pattern(name, dt) for name, dt in dtype_table().items()}
    tensors["empty"] = torch.zeros((0, 3), dtype=torch.float32)
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.float32)
    save_file(tensors, path, metadata={"format": "pt", "note": "written by the python package"})


def write_sharded(directory):
    os.makedirs(directory, exist_ok=True)
    a = {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
         "a.bias": torch.tensor([1.5, -2.0], dtype=torch.float32)}
    b = {"b.weight": torch.arange(4, dtype=torch.bfloat16).reshape(2, 2)}
    save_file(a, os.path.join(directory, "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(b, os.path.join(directory, "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 6 * 4 + 2 * 4 + 4 * 2},
             "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                            "a.bias": "model-00001-of-00002.safetensors",
                            "b.weight": "model-00002-of-00002.safetensors"}}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)


def verify(path):
    """memrt wrote `path` with tensors dtype_table patterns + empty + scalar and this metadata."""
    metadata = {"format": "pt", "writer": "memrt", "unicode": "h\u00e9llo \"quoted\""}
    expected = {name: pattern(name, dt) for name, dt in dtype_table().items()}
    expected["empty"] = torch.zeros((0, 3), dtype=torch.float32)
    expected["scalar"] = torch.tensor(2.5, dtype=torch.float32)
    with safe_open(path, framework="pt") as f:
        got_meta = f.metadata()
        names = set(f.keys())
        if got_meta != metadata:
            fail(f"metadata {got_meta} != {metadata}")
        if names != set(expected):
            fail(f"names {sorted(names)} != {sorted(expected)}")
        for name, want in expected.items():
            t = f.get_tensor(name)
            if t.dtype != want.dtype or t.shape != want.shape:
                fail(f"{name}: {t.dtype} {tuple(t.shape)} != {want.dtype} {tuple(want.shape)}")
            if not torch.equal(t.to(torch.float64) if t.dtype != torch.bool else t,
                               want.to(torch.float64) if want.dtype != torch.bool else want):
                fail(f"{name}: values differ")
    # The reference writer lays out and pads exactly like memrt's.
    with open(path, "rb") as f:
        ours = f.read()
    theirs = save(expected, metadata=metadata)
    header_len = int.from_bytes(ours[:8], "little")
    if header_len % 8 != 0:
        fail(f"header length {header_len} is not a multiple of 8")
    ours_header = json.loads(ours[8:8 + header_len])
    theirs_len = int.from_bytes(theirs[:8], "little")
    theirs_header = json.loads(theirs[8:8 + theirs_len])
    if ours_header != theirs_header:
        fail(f"header differs from safetensors.torch.save:\n{ours_header}\n{theirs_header}")
    if ours[8 + header_len:] != theirs[8 + theirs_len:]:
        fail("tensor bytes differ from safetensors.torch.save")
    print("ok")


def verify_hf(directory):
    """save_hf_checkpoint wrote `directory` from the 'gpt2' golden model (see write_models)."""
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    files = sorted(p for p in os.listdir(directory) if p.endswith(".safetensors"))
    tensors = {}
    for p in files:
        with safe_open(os.path.join(directory, p), framework="pt") as f:
            if f.metadata() != {"format": "pt"}:
                fail(f"{p}: metadata {f.metadata()}")
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
    if len(files) > 1:
        with open(os.path.join(directory, "model.safetensors.index.json")) as f:
            index = json.load(f)
        if set(index["weight_map"]) != set(tensors):
            fail("index weight_map does not list exactly the tensors in the shards")
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        if index["metadata"]["total_size"] != total:
            fail(f"total_size {index['metadata']['total_size']} != {total}")
    original = load_dir(os.path.join(os.path.dirname(directory.rstrip("/")), "gpt2"))
    if config["model_type"] != "gpt2" or config["n_embd"] != 32 or config["n_inner"] != 48:
        fail(f"config.json: {config}")
    if set(tensors) != set(original):
        fail(f"names differ: {sorted(set(tensors) ^ set(original))}")
    for k, t in original.items():
        if not torch.equal(tensors[k], t):
            fail(f"{k}: differs from the checkpoint it was loaded from")
    print("ok")


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def load_dir(directory):
    tensors = {}
    for p in os.listdir(directory):
        if p.endswith(".safetensors") and p != "golden.safetensors":
            with safe_open(os.path.join(directory, p), framework="pt") as f:
                for k in f.keys():
                    tensors[k] = f.get_tensor(k)
    return tensors

# --------------------------------------------------------------------------------------------
# Reference models, float64, explicit math.


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def rms_norm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def causal_attention(q, k, v):
    """q (B, H, T, D), k and v (B, H, T, D) -> (B, H, T, D), softmax(q k^T / sqrt(D)) v."""
    T, D = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def split_heads(x, n):
    B, T, C = x.shape
    return x.reshape(B, T, n, C // n).transpose(1, 2)


def merge_heads(x):
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)


def gpt2_forward(w, cfg, tokens):
    L, H, eps = cfg["n_layer"], cfg["n_head"], cfg["layer_norm_epsilon"]
    T = tokens.shape[1]
    g = lambda k: w[k].to(torch.float64)
    h = g("transformer.wte.weight")[tokens] + g("transformer.wpe.weight")[:T]
    for i in range(L):
        p = f"transformer.h.{i}."
        a = layer_norm(h, g(p + "ln_1.weight"), g(p + "ln_1.bias"), eps)
        qkv = a @ g(p + "attn.c_attn.weight") + g(p + "attn.c_attn.bias")  # Conv1D: x W, W (in, out)
        q, k, v = qkv.split(qkv.shape[-1] // 3, dim=-1)
        y = merge_heads(causal_attention(split_heads(q, H), split_heads(k, H), split_heads(v, H)))
        h = h + y @ g(p + "attn.c_proj.weight") + g(p + "attn.c_proj.bias")
        m = layer_norm(h, g(p + "ln_2.weight"), g(p + "ln_2.bias"), eps)
        m = gelu_tanh(m @ g(p + "mlp.c_fc.weight") + g(p + "mlp.c_fc.bias"))
        h = h + m @ g(p + "mlp.c_proj.weight") + g(p + "mlp.c_proj.bias")
    h = layer_norm(h, g("transformer.ln_f.weight"), g("transformer.ln_f.bias"), eps)
    return h @ g("transformer.wte.weight").T


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def llama_forward(w, cfg, tokens):
    L, H, KV = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    C = cfg["hidden_size"]
    D = C // H
    T = tokens.shape[1]
    g = lambda k: w[k].to(torch.float64)
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)                                 # (T, D)
    cos, sin = angles.cos(), angles.sin()
    h = g("model.embed_tokens.weight")[tokens]
    for i in range(L):
        p = f"model.layers.{i}."
        a = rms_norm(h, g(p + "input_layernorm.weight"), eps)
        q = split_heads(a @ g(p + "self_attn.q_proj.weight").T, H)
        k = split_heads(a @ g(p + "self_attn.k_proj.weight").T, KV)
        v = split_heads(a @ g(p + "self_attn.v_proj.weight").T, KV)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # query head j reads key/value head j // (H / KV)
        k = k.repeat_interleave(H // KV, dim=1)
        v = v.repeat_interleave(H // KV, dim=1)
        y = merge_heads(causal_attention(q, k, v))
        h = h + y @ g(p + "self_attn.o_proj.weight").T
        m = rms_norm(h, g(p + "post_attention_layernorm.weight"), eps)
        gate = m @ g(p + "mlp.gate_proj.weight").T
        up = m @ g(p + "mlp.up_proj.weight").T
        h = h + (gate * torch.sigmoid(gate) * up) @ g(p + "mlp.down_proj.weight").T
    h = rms_norm(h, g("model.norm.weight"), eps)
    head = "model.embed_tokens.weight" if cfg["tie_word_embeddings"] else "lm_head.weight"
    return h @ g(head).T


def mean_cross_entropy(logits, targets):
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return -logp.gather(-1, targets[..., None]).mean()


def random_weights(names_shapes, gen, std=0.08, dtype=torch.float32):
    w = {}
    for name, shape in names_shapes:
        if name.endswith("norm.weight") or ".ln_" in name and name.endswith(".weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
        elif name.endswith(".bias"):
            t = 0.05 * torch.randn(shape, generator=gen, dtype=torch.float64)
        else:
            t = std * torch.randn(shape, generator=gen, dtype=torch.float64)
        w[name] = t.to(dtype)
    return w


def gpt2_names(cfg):
    C, F, V, L = cfg["n_embd"], cfg["n_inner"], cfg["vocab_size"], cfg["n_layer"]
    out = [("transformer.wte.weight", (V, C)), ("transformer.wpe.weight", (cfg["n_positions"], C))]
    for i in range(L):
        p = f"transformer.h.{i}."
        out += [(p + "ln_1.weight", (C,)), (p + "ln_1.bias", (C,)),
                (p + "attn.c_attn.weight", (C, 3 * C)), (p + "attn.c_attn.bias", (3 * C,)),
                (p + "attn.c_proj.weight", (C, C)), (p + "attn.c_proj.bias", (C,)),
                (p + "ln_2.weight", (C,)), (p + "ln_2.bias", (C,)),
                (p + "mlp.c_fc.weight", (C, F)), (p + "mlp.c_fc.bias", (F,)),
                (p + "mlp.c_proj.weight", (F, C)), (p + "mlp.c_proj.bias", (C,))]
    return out + [("transformer.ln_f.weight", (C,)), ("transformer.ln_f.bias", (C,))]


def llama_names(cfg):
    C, F, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    KV = cfg["num_key_value_heads"] * (C // cfg["num_attention_heads"])
    out = [("model.embed_tokens.weight", (V, C))]
    for i in range(L):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (C, C)), (p + "self_attn.k_proj.weight", (KV, C)),
                (p + "self_attn.v_proj.weight", (KV, C)), (p + "self_attn.o_proj.weight", (C, C)),
                (p + "mlp.gate_proj.weight", (F, C)), (p + "mlp.up_proj.weight", (F, C)),
                (p + "mlp.down_proj.weight", (C, F)), (p + "input_layernorm.weight", (C,)),
                (p + "post_attention_layernorm.weight", (C,))]
    out.append(("model.norm.weight", (C,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (V, C)))
    return out


def write_golden(directory, forward, weights, cfg, gen, batch=2, seq=12):
    tokens = torch.randint(0, cfg["vocab_size"], (batch, seq + 1), generator=gen)
    logits = forward(weights, cfg, tokens[:, :-1])
    loss = mean_cross_entropy(logits, tokens[:, 1:])
    save_file({"tokens": tokens, "logits": logits.to(torch.float32).contiguous(),
               "loss": loss.to(torch.float32)}, os.path.join(directory, "golden.safetensors"))


def write_models(out):
    gen = torch.Generator().manual_seed(1234)

    # GPT-2, tied head, one model.safetensors, fp32.
    d = os.path.join(out, "gpt2")
    os.makedirs(d, exist_ok=True)
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 61,
           "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_inner": 48,
           "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
           "tie_word_embeddings": True}
    w = random_weights(gpt2_names(cfg), gen)
    save_file(w, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=2)
    write_golden(d, gpt2_forward, w, cfg, gen)

    # Llama, GQA (4 heads, 2 kv heads), untied head, sharded in two files, fp32.
    d = os.path.join(out, "llama")
    os.makedirs(d, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 67,
           "hidden_size": 32, "intermediate_size": 56, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
           "rms_norm_eps": 1e-5, "rope_theta": 500.0, "tie_word_embeddings": False,
           "hidden_act": "silu", "rope_scaling": None}
    w = random_weights(llama_names(cfg), gen)
    first = {k: v for k, v in w.items() if k.startswith("model.embed") or ".layers.0." in k}
    second = {k: v for k, v in w.items() if k not in first}
    files = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    for name, part in files.items():
        save_file(part, os.path.join(d, name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * 4 for t in w.values())},
             "weight_map": {k: n for n, part in files.items() for k in part}}
    json.dump(index, open(os.path.join(d, "model.safetensors.index.json"), "w"), indent=2)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=2)
    write_golden(d, llama_forward, w, cfg, gen)

    # Llama, multi-query (1 kv head), tied head, weights stored as bf16 (converted on load).
    d = os.path.join(out, "llama_tied_bf16")
    os.makedirs(d, exist_ok=True)
    cfg = dict(cfg, num_key_value_heads=1, tie_word_embeddings=True, rope_theta=10000.0,
               rms_norm_eps=1e-6)
    w = random_weights(llama_names(cfg), gen, dtype=torch.bfloat16)
    save_file(w, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=2)
    write_golden(d, llama_forward, w, cfg, gen)
    print("ok")


if __name__ == "__main__":
    cmd, arg = sys.argv[1], sys.argv[2]
    {"models": write_models, "dtypes": write_dtypes, "sharded": write_sharded,
     "verify": verify, "verify_hf": verify_hf}[cmd](arg)
