"""Fine-tuning records and what the tools train on: the oracle of the records tests in
tests/data/test_tokenizer.cpp.

    sft_records.py OUT_DIR TOKENIZER_DIR...
writes OUT_DIR/alpaca.jsonl, OUT_DIR/alpaca.json (the same records as one JSON array) and
OUT_DIR/prompt_completion.jsonl and OUT_DIR/messages.jsonl; gives each TOKENIZER_DIR (holding a
tokenizer.json from hf_tokenizers.py) a tokenizer_config.json naming its BOS and EOS and a
chat_template.jinja (of tests/data/chat_templates/: llama3 for the Llama-3 kind, with generation
blocks; mistral for the Llama-2 kind), and writes TOKENIZER_DIR/sft.json:
    {"max_length": 256, "<type> <train_on_prompt>": {"ids": [[...]...], "labels": [[0|1...]...],
     "dropped": n, "truncated": n}}
computed with transformers' tokenizer (AutoTokenizer on the directory) as axolotl tokenizes
`type: alpaca` (prompt_tokenizers.InstructionPromptTokenizingStrategy, AlpacaPrompter, sequences
longer than sequence_len dropped) and as TRL's SFTTrainer tokenizes a prompt-completion dataset
(add_eos, tokenize, truncate_dataset; completion_only_loss) and a conversational one
(apply_chat_template with the record's tools, return_assistant_tokens_mask for assistant_only_loss,
truncate_dataset), for the Llama-3 kind (whose template has generation blocks). labels[i] is 1
where the label is the token (not -100).

For the Llama-3 kind it also writes OUT_DIR/chat_template.jsonl, OUT_DIR/sharegpt.jsonl,
OUT_DIR/thinking.jsonl, OUT_DIR/parts.jsonl and OUT_DIR/detail.jsonl and, in sft.json,
"chat_template CASE" for each of CHAT_CASES: axolotl's `type: chat_template` datasets tokenized by
axolotl itself — its ChatTemplateStrategy (prompt_strategies/chat_template.py), made by its
StrategyLoader from the dataset entry and the run's keys (eot_tokens, train_on_inputs,
chat_template: a name, chat_template_kwargs) on transformers' tokenizer — then filtered as axolotl
filters (longer than the sequence length: dropped) and as memrt does (nothing trained past the first
token: dropped; axolotl drops nothing trained at all). "chat_template cases" holds each case's file,
its train.yaml keys (the dataset entry's and the run's) and its sequence length. "held_out cases"
holds, for each of HELD_OUT_CASES (axolotl's val_set_size with shuffle_merged_datasets, LLaMA-
Factory's val_size, and the seed), the samples of OUT_DIR/held_out.jsonl (alpaca records) trained on
and held out, in order (held_out()).
"""
import json
import logging
import math
import os
import sys
import types

import numpy as np
from transformers import AutoTokenizer

MAX_LENGTH = 256
CHAT_MAX_LENGTH = 512  # chat_template cases: room for the tool conversation (~300 tokens)

ALPACA = [
    {"instruction": "Give three tips for staying healthy.", "input": "", "output": "Eat well, sleep, move."},
    {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
    {"instruction": "Summarize.", "input": "你好，世界！今天天气很好。", "output": "天气很好 👍🏽"},
    {"instruction": "No input field at all", "output": "fine"},
    {"instruction": "Ends with the EOS text", "input": None, "output": "done<EOS>"},
    {"instruction": "A long one " + "word " * 300, "input": "", "output": "dropped: it does not fit"},
    {"instruction": "Short", "input": "", "output": "a response that runs long " + "and on " * 80},
    {"instruction": "Tabs\tand\nnewlines", "input": "x = 1\n", "output": "  spaced  out  "},
]

PROMPT_COMPLETION = [
    {"prompt": "The sky is", "completion": " blue."},
    {"prompt": "Q: 2+2?\nA:", "completion": " 4"},
    {"prompt": "Translate 'cat': ", "completion": "猫 🐱"},
    {"prompt": "Already ended", "completion": " here<EOS>"},
    {"prompt": "A long prompt " + "again " * 300, "completion": " cut off"},
    {"prompt": "", "completion": "no prompt at all"},
    {"prompt": "Long completion:", "completion": " yes" * 300},
]

MESSAGES = [
    {"messages": [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi there."}]},
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": " 4 "}, {"role": "user", "content": "和 3+3？ 👍🏽"},
                  {"role": "assistant", "content": "6"}]},
    {"messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "assistant", "content": "21 degrees."}],
     "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]},
    {"messages": [{"role": "user", "content": "Long: " + "blah " * 300}, {"role": "assistant", "content": "cut off"}]},
    {"messages": [{"role": "user", "content": "Say it"}, {"role": "assistant", "content": "It " * 300}]},
]

# axolotl chat_template datasets: "train" overrides a message's role (message_field_training: train).
CHAT_TEMPLATE = [
    {"messages": [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi there."}]},
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": " 4 ", "train": False}, {"role": "user", "content": "和 3+3？ 👍🏽"},
                  {"role": "assistant", "content": "6"}]},
    {"messages": [{"role": "user", "content": "Weather in Paris?", "train": True},
                  {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                  {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "assistant", "content": "21 degrees."}],
     "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": "{\"type\": \"object\"}"}}]},
    {"messages": [{"role": "user", "content": "Long: " + "blah " * 300}, {"role": "assistant", "content": "dropped"}]},
    {"messages": [{"role": "user", "content": "Only the user speaks"}]},
    {"system": "Be kind.", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, friend."}]},
]

SHAREGPT = [
    {"conversations": [{"from": "human", "value": "Name a color."}, {"from": "gpt", "value": "Teal."},
                       {"from": "human", "value": "Another?"}, {"from": "gpt", "value": "Ochre 🎨"}]},
    {"system": "Answer in French.", "conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Bonjour"}]},
    {"conversations": [{"from": "system", "value": "Dropped or kept."}, {"from": "human", "value": "x"},
                       {"from": "gpt", "value": "y"}]},
]

# Reasoning in the assistant's text, for split_thinking: each thinking pair, a solution pair,
# Unicode whitespace (str.strip's), tags in the wrong order, tags in a user turn (never split), and a
# reasoning field of the record's own (field_thinking).
THINKING = [
    {"messages": [{"role": "user", "content": "What is 2+2?"},
                  {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"}]},
    {"messages": [{"role": "user", "content": "First?"}, {"role": "assistant", "content": "<think>one</think>One"},
                  {"role": "user", "content": "Then <think>not split</think>?"},
                  {"role": "assistant", "content": "<reasoning> deep\u3000</reasoning>\u00a0 <|begin_of_solution|> Two "
                                                   "\u2003<|end_of_solution|> tail"}]},
    {"messages": [{"role": "user", "content": "Odd?"}, {"role": "assistant", "content": "</think>odd order<think>rest"}]},
    {"messages": [{"role": "user", "content": "Plan?"},
                  {"role": "assistant", "content": "<|begin_of_thought|>plan<|end_of_thought|>"
                                                   "<|begin_of_solution|>only this<|end_of_solution|>"}]},
    {"messages": [{"role": "user", "content": "Given?"},
                  {"role": "assistant", "content": "Plain answer.", "thoughts": "a thought of its own"}]},
]

# Content as lists of parts (axolotl joins their texts): an image part, "content" and "value"
# parts, an empty text, a part that is not an object, and reasoning given as parts.
PARTS = [
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look "}, {"type": "image"},
                                               {"type": "text", "text": "here."}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}, {"content": "from content, "},
                                               {"value": "from value"}, "a bare string"]},
                  {"role": "assistant", "content": "Plain."}]},
    {"messages": [{"role": "user", "content": "Why?"},
                  {"role": "assistant", "content": [{"text": "Answer."}],
                   "reasoning_content": [{"text": "Because "}, {"text": "so."}]}]},
]

# Characters of a message that train (message_field_training_detail: detail, or parts' train and
# weight flags): spans inside words and across multi-byte characters, an empty list (the turn does
# not train), parts of reasoning.
DETAIL = [
    {"messages": [{"role": "user", "content": "Q?"},
                  {"role": "assistant", "content": "Héllo wörld 👍🏽 this is it.",
                   "detail": [{"begin_offset": 0, "end_offset": 2, "train": False},
                              {"begin_offset": 3, "end_offset": 13, "train": True},
                              {"begin_offset": 16, "end_offset": 24, "train": True}]}]},
    {"messages": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": [{"text": "Let me think...", "train": False},
                                                    {"text": " The answer is 4.", "train": True}]}]},
    {"messages": [{"role": "user", "content": "Go"},
                  {"role": "assistant", "content": [{"text": "A", "weight": 0}, {"text": " B and C", "weight": 1}]},
                  {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Nothing here.", "detail": []},
                  {"role": "user", "content": "Last"}, {"role": "assistant", "content": "All of it."}]},
    {"messages": [{"role": "user", "content": "Why?"},
                  {"role": "assistant", "content": "Done.",
                   "reasoning_content": [{"text": "Step one.", "train": False}, {"text": " Step two.", "train": True}]}]},
]

EOT = {"eot_tokens": ["<|eot_id|>"]}
SHAREGPT_KEYS = {"field_messages": "conversations", "message_property_mappings": {"role": "from", "content": "value"}}
CHAT_CASES = {
    "default": ("chat_template.jsonl", {}, {}),
    "eot": ("chat_template.jsonl", {}, EOT),
    "eot_all": ("chat_template.jsonl", {"train_on_eos": "all"}, EOT),
    "last_and_users": ("chat_template.jsonl", {"train_on_eot": "last", "roles_to_train": ["user", "assistant"]}, EOT),
    "inputs": ("chat_template.jsonl", {}, {**EOT, "train_on_inputs": True}),
    "training_field": ("chat_template.jsonl", {"message_field_training": "train"}, EOT),
    "legacy": ("sharegpt.jsonl", {**SHAREGPT_KEYS, "roles_to_train": [], "train_on_eos": None}, {}),
    "sharegpt": ("sharegpt.jsonl", SHAREGPT_KEYS, EOT),
    "sharegpt_roles": ("sharegpt.jsonl", {**SHAREGPT_KEYS, "roles": {"user": ["human"], "assistant": ["gpt"], "system": ["system"]},
                                          "roles_to_train": ["gpt"], "drop_system_message": True}, EOT),
    # axolotl's qwen3 template by name: think blocks placed by real_last_index in find_turn's renders
    "named_qwen3": ("chat_template.jsonl", {}, {"chat_template": "qwen3"}),
    "split_thinking": ("thinking.jsonl", {"split_thinking": True}, {"chat_template": "qwen3"}),
    "field_thinking": ("thinking.jsonl", {"field_thinking": "thoughts"}, {"chat_template": "qwen3"}),
    "content_parts": ("parts.jsonl", {}, EOT),
    "training_detail": ("detail.jsonl", {"message_field_training_detail": "detail"}, EOT),
    "training_detail_qwen3": ("detail.jsonl", {"message_field_training_detail": "detail"}, {"chat_template": "qwen3"}),
    "content_parts_qwen3": ("parts.jsonl", {}, {"chat_template": "qwen3"}),
    # the generation prompt of the legacy path with the run's chat_template_kwargs
    "legacy_kwargs": ("thinking.jsonl", {"roles_to_train": [], "train_on_eos": None},
                      {"chat_template": "qwen3", "chat_template_kwargs": {"enable_thinking": False}}),
}

# Records to hold some out of (HELD_OUT_CASES: the train.yaml keys and the seed): some too long to
# keep, so that axolotl's split (after its filters) and LLaMA-Factory's (before) differ.
HELD_OUT = [{"instruction": "Item %d" % i + (" is long" + " word" * 300 if i % 9 == 4 else ""), "input": "",
             "output": "answer %d" % i} for i in range(40)]
HELD_OUT_CASES = {
    "axolotl_fraction": ({"val_set_size": 0.15}, 42),
    "axolotl_count": ({"val_set_size": 7}, 3),
    "axolotl_unshuffled": ({"val_set_size": 0.1, "shuffle_merged_datasets": False}, 42),
    "llamafactory_fraction": ({"val_size": 0.2}, 1234),
    "llamafactory_count": ({"val_size": 5.0}, 42),
}

TEMPLATES = {"llama3": "llama3.jinja", "llama2": "mistral.jinja"}

SPECIALS = {"llama3": ("<|begin_of_text|>", "<|end_of_text|>"), "llama2": ("<s>", "</s>")}


def alpaca_prompt(instruction, inp):
    if inp:
        return ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n### Instruction:\n" + instruction +
                "\n\n### Input:\n" + inp + "\n\n### Response:\n")
    return ("Below is an instruction that describes a task. Write a response that appropriately completes the "
            "request.\n\n### Instruction:\n" + instruction + "\n\n### Response:\n")


def axolotl_tokenize(tok, text, add_eos, strip_bos):
    ids = tok(text, truncation=True, max_length=MAX_LENGTH, padding=False)["input_ids"]
    if ids and ids[-1] != tok.eos_token_id and len(ids) < MAX_LENGTH and add_eos:
        ids.append(tok.eos_token_id)
    if ids and ids[0] == tok.bos_token_id and strip_bos:
        ids = ids[1:]
    return ids


def alpaca_sample(tok, r, train_on_inputs):
    """A record's sample (ids, labels), or None where it is dropped."""
    prompt = axolotl_tokenize(tok, alpaca_prompt(r["instruction"], r.get("input") or ""), False, False)
    response = axolotl_tokenize(tok, r["output"], True, True)
    ids = prompt + response
    labels = [int(train_on_inputs)] * len(prompt) + [1] * len(response)
    return None if len(ids) > MAX_LENGTH or not any(labels[1:]) else (ids, labels)


def alpaca(tok, records, train_on_inputs):
    out = {"ids": [], "labels": [], "dropped": 0, "truncated": 0}
    for r in records:
        sample = alpaca_sample(tok, r, train_on_inputs)
        if sample is None:
            out["dropped"] += 1
            continue
        out["ids"].append(sample[0])
        out["labels"].append(sample[1])
    return out


def test_count(size, n):
    """datasets' train_test_split: the held-out count of a fraction (rounded up) or of a count."""
    return math.ceil(size * n) if isinstance(size, float) else size


def held_out(tok, records, keys, seed):
    """The samples axolotl's val_set_size or LLaMA-Factory's val_size trains on and holds out, in
    their order: axolotl's merge_datasets shuffles the records (Dataset.shuffle(seed): the rows in
    the order of numpy's default_rng(seed).permutation), its filters drop, and train_test_split(
    shuffle=False) holds the last out; LLaMA-Factory's split_dataset calls train_test_split(seed) on
    the records (the first of the permutation held out) before processing them."""
    samples = [alpaca_sample(tok, r, False) for r in records]
    perm = [int(i) for i in np.random.default_rng(seed).permutation(len(records))]
    if "val_set_size" in keys:
        size = keys["val_set_size"] if keys["val_set_size"] < 1 else int(keys["val_set_size"])
        order = perm if keys.get("shuffle_merged_datasets", True) else list(range(len(records)))
        kept = [samples[r] for r in order if samples[r] is not None]
        k = test_count(size, len(kept))
        train, held = kept[:len(kept) - k], kept[len(kept) - k:]
    else:
        size = keys["val_size"] if keys["val_size"] < 1 else int(keys["val_size"])
        k = test_count(size, len(records))
        train = [samples[r] for r in perm[k:] if samples[r] is not None]
        held = [samples[r] for r in perm[:k] if samples[r] is not None]
    side = lambda s: {"ids": [ids for ids, _ in s], "labels": [labels for _, labels in s]}
    return {"train": side(train), "eval": side(held)}


def truncated(out, ids, labels):
    """TRL's truncate_dataset (the first MAX_LENGTH tokens); a sample with nothing to train on is dropped."""
    if len(ids) > MAX_LENGTH:
        ids, labels = ids[:MAX_LENGTH], labels[:MAX_LENGTH]
        out["truncated"] += 1
    if not any(labels[1:]):
        out["dropped"] += 1
        return
    out["ids"].append(ids)
    out["labels"].append(labels)


def prompt_completion(tok, records, train_on_prompt):
    out = {"ids": [], "labels": [], "dropped": 0, "truncated": 0}
    for r in records:
        completion = r["completion"]
        if not completion.endswith(tok.eos_token):
            completion += tok.eos_token
        prompt_ids = tok(text=r["prompt"])["input_ids"]
        ids = tok(text=r["prompt"] + completion)["input_ids"]
        truncated(out, ids, [int(train_on_prompt)] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids)))
    return out


def messages(tok, records, assistant_only):
    out = {"ids": [], "labels": [], "dropped": 0, "truncated": 0}
    for r in records:
        enc = tok.apply_chat_template(r["messages"], tools=r.get("tools"), tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=assistant_only)
        ids = list(enc["input_ids"])
        truncated(out, ids, list(enc["assistant_masks"]) if assistant_only else [1] * len(ids))
    return out


def import_axolotl():
    """axolotl's chat_template strategy loader, from the installed wheel. `datasets`, whose Dataset
    name its modules import but these functions do not use, is a stand-in."""
    if "datasets" not in sys.modules:
        sys.modules["datasets"] = types.ModuleType("datasets")
        sys.modules["datasets"].Dataset = None
    from axolotl.prompt_strategies.chat_template import load
    from axolotl.utils.dict import DictDefault
    logging.disable(logging.WARNING)  # its warnings about the data: memrt notes them itself
    return load, DictDefault


def axolotl_chat(tok, records, keys, run, max_length):
    load, DictDefault = import_axolotl()
    cfg = DictDefault({"sequence_len": max_length, "train_on_inputs": run.get("train_on_inputs", False),
                       "eot_tokens": run.get("eot_tokens"), "chat_template": run.get("chat_template", "tokenizer_default"),
                       "chat_template_kwargs": run.get("chat_template_kwargs")})
    strategy = load(tok, cfg, {"type": "chat_template", **keys})
    out = {"ids": [], "labels": [], "dropped": 0, "truncated": 0}
    for r in records:
        sample = strategy.tokenize_prompt(r)
        ids, labels = list(sample["input_ids"]), list(sample["labels"])
        assert all(label in (-100, i) for i, label in zip(ids, labels))
        trained = [int(label != -100) for label in labels]
        # axolotl's filters drop what is longer than sequence_len, and memrt what trains no token past
        # the first (axolotl: no token at all; the first's label is never a target)
        if len(ids) > max_length or not any(trained[1:]):
            out["dropped"] += 1
            continue
        out["ids"].append(ids)
        out["labels"].append(trained)
    return out


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    # The data files spell the EOS text of the first tokenizer (records that already end with it;
    # to the others it is plain text).
    eos_text = SPECIALS[os.path.basename(os.path.normpath(sys.argv[2]))][1]
    fix = lambda records: [{k: (v.replace("<EOS>", eos_text) if isinstance(v, str) else v) for k, v in r.items()}
                           for r in records]
    for tok_dir in sys.argv[2:]:
        kind = os.path.basename(os.path.normpath(tok_dir))
        bos, eos = SPECIALS[kind]
        with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
                       "eos_token": {"__type": "AddedToken", "content": eos, "lstrip": False, "rstrip": False,
                                     "normalized": False, "single_word": False, "special": True}, "model_max_length": 4096}, f)
        template = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates", TEMPLATES[kind])
        with open(template, encoding="utf-8") as f, open(os.path.join(tok_dir, "chat_template.jinja"), "w",
                                                          encoding="utf-8") as g:
            g.write(f.read())
        tok = AutoTokenizer.from_pretrained(tok_dir)
        assert tok.eos_token == eos and tok.bos_token == bos
        expected = {"max_length": MAX_LENGTH}
        for train in (False, True):
            expected["alpaca %d" % train] = alpaca(tok, fix(ALPACA), train)
            expected["prompt_completion %d" % train] = prompt_completion(tok, fix(PROMPT_COMPLETION), train)
            if kind == "llama3":  # (Mistral's template refuses the tool conversation: an error there)
                expected["messages %d" % train] = messages(tok, MESSAGES, train)
        if kind == "llama3":
            expected["held_out cases"] = {name: {"keys": keys, "seed": seed, **held_out(tok, HELD_OUT, keys, seed)}
                                          for name, (keys, seed) in HELD_OUT_CASES.items()}
            data = {"chat_template.jsonl": CHAT_TEMPLATE, "sharegpt.jsonl": SHAREGPT, "thinking.jsonl": THINKING,
                    "parts.jsonl": PARTS, "detail.jsonl": DETAIL}
            expected["chat_template cases"] = {}
            for name, (file, keys, run) in CHAT_CASES.items():
                expected["chat_template cases"][name] = {"file": file, "dataset": keys, "run": run,
                                                         "max_length": CHAT_MAX_LENGTH}
                expected["chat_template " + name] = axolotl_chat(tok, json.loads(json.dumps(data[file])), keys, run,
                                                                 CHAT_MAX_LENGTH)
        with open(os.path.join(tok_dir, "sft.json"), "w") as f:
            json.dump(expected, f)
    with open(os.path.join(out, "alpaca.jsonl"), "w", encoding="utf-8") as f:
        for k, r in enumerate(fix(ALPACA)):
            f.write(json.dumps(r, ensure_ascii=k % 2 == 0) + "\n" + "\n" * (k == 2))
    with open(os.path.join(out, "alpaca.json"), "w", encoding="utf-8") as f:
        json.dump(fix(ALPACA), f, ensure_ascii=False, indent=1)
    with open(os.path.join(out, "messages.jsonl"), "w", encoding="utf-8") as f:
        for r in MESSAGES:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    for name, records in (("chat_template.jsonl", CHAT_TEMPLATE), ("sharegpt.jsonl", SHAREGPT),
                          ("thinking.jsonl", THINKING), ("parts.jsonl", PARTS), ("detail.jsonl", DETAIL),
                          ("held_out.jsonl", HELD_OUT)):
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    with open(os.path.join(out, "prompt_completion.jsonl"), "w", encoding="utf-8") as f:
        for r in fix(PROMPT_COMPLETION):
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
