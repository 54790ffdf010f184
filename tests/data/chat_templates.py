"""Chat templates rendered by transformers: the oracle of tests/data/test_chat_template.cpp.

    chat_templates.py OUT.json
renders each template of tests/data/chat_templates/ (authored here in the shape of the Llama-3.1,
Qwen3, Mistral, Phi-3 and Gemma templates, plus one exercising whitespace control and expressions)
on a set of conversations with transformers' own renderer (render_jinja_template, as
apply_chat_template renders), with and without add_generation_prompt; and axolotl's templates of the names memrt ships
(AXOLOTL_NAMED: read from the installed axolotl package) as "axolotl:NAME"
with "named": NAME; and writes
    {"<family>": {"template": "...", "cases": [{"variables": {...}, "text": "...",
                  "generation": [[begin, end]...]} or {"variables": {...}, "error": "..."}]}}
where generation holds the UTF-8 byte ranges of {% generation %} blocks (transformers gives
character offsets).
"""
import importlib.util
import json
import os
import sys

from transformers.utils.chat_template_utils import render_jinja_template

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, «now»",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi there. How can I help?"}],
    [{"role": "system", "content": "You are terse.  "},
     {"role": "user", "content": "  What is 2+2?\n"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "和 3+3？ 👍🏽"}, {"role": "assistant", "content": "  6\n\n"}],
    [{"role": "user", "content": "Think first."},
     {"role": "assistant", "content": "<think>\nLet me see.\n</think>\n\nDone: e\u0301 café."}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"},
     {"role": "assistant", "content": "It is 21 °C.", "reasoning_content": "The tool said 21."}],
    [{"role": "user", "content": [{"type": "text", "text": " Look: "}, {"type": "image"}]},
     {"role": "assistant", "content": "A cat.\t"}],
    [{"role": "user", "content": "first"}, {"role": "user", "content": "second in a row"}],
    [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Weather in Paris and Rome?"},
     {"role": "assistant", "content": "Both:", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
         {"name": "get_weather", "arguments": {"city": "Rome"}}]},
     {"role": "tool", "content": "21"}, {"role": "tool", "content": "25"},
     {"role": "assistant", "content": "21 and 25."}, {"role": "system", "content": "A late system note."}],
    [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
     {"role": "user", "content": "Weather in Paris and Rome?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
         {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
     {"role": "tool", "content": "21"}, {"role": "tool", "content": "25"}, {"role": "assistant", "content": "21 and 25."},
     {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "<think>check</think>Yes."},
     {"role": "user", "content": "Again"},
     {"role": "assistant", "content": "Calling.", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
     {"role": "tool", "content": "20"}],
    [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"id": "abc123XYZ", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "tool_call_id": "abc123XYZ", "content": "21"}, {"role": "assistant", "content": " It is 21. "},
     {"role": "user", "content": "Thanks"}],
]

# Which conversations each family takes (its roles and content kinds).
FAMILIES = {
    "llama3": [0, 1, 2, 3],
    "qwen3": [0, 1, 2, 3],
    "mistral": [0, 1, 2, 5],
    "phi3": [0, 1, 2],
    "gemma": [0, 1, 2, 4, 5],
    "chatml_blocks": [0, 1, 2],
}


# axolotl's named templates memrt ships its own of, and the conversations each takes.
AXOLOTL_NAMED = {"chatml": [0, 1, 2, 5], "llama3": [0, 1, 2, 4, 5], "phi_3": [0, 1, 2, 5], "phi_4": [0, 1, 2, 5],
                 "qwen_25": [0, 1, 2, 3, 6], "qwen3": [0, 1, 2, 3, 6], "gemma3": [0, 1, 2, 4, 5],
                 "alpaca": [0, 1, 2, 3, 5], "gemma": [0, 1, 2, 4, 5], "mistral_v1": [0, 1, 2, 3, 4, 5],
                 "phi_35": [0, 1, 2, 3, 5, 6], "mistral_v7_tekken": [0, 1, 2, 3, 4, 5, 6],
                 "cohere": [0, 1, 2, 3, 5], "deepseek_v3": [0, 1, 2, 5, 7],
                 "mistral_v2v3": [0, 1, 2, 3, 4, 5, 8], "mistral_v3_tekken": [0, 1, 2, 3, 4, 5, 8],
                 "llama4": [0, 1, 2, 3, 4, 5, 8], "exaone": [0, 1, 2, 3, 5, 6], "deepseek_v2": [0, 1, 2, 3, 5, 6],
                 "nemotron_h": [0, 1, 2, 3, 5, 6], "metharme": [0, 1, 2, 3, 5, 6], "falcon_h1": [0, 1, 2, 3, 5, 6],
                 "aya": [0, 1, 2, 3, 5], "qwen2_vl": [0, 1, 2, 3, 4, 5, 6], "llava": [0, 1, 2, 3, 4, 5, 6],
                 "gemma3n": [0, 1, 2, 4, 5]}
# The named templates that render tools (given with the tool conversations).
TOOL_NAMED = ("qwen_25", "qwen3", "mistral_v2v3", "mistral_v3_tekken", "llama4", "falcon_h1")


def axolotl_template(name):
    package = importlib.util.find_spec("axolotl").submodule_search_locations[0]
    with open(os.path.join(package, "utils", "chat_templates", "templates", name + ".jinja"), encoding="utf-8") as f:
        return f.read()


def byte_ranges(text, ranges):
    return [[len(text[:b].encode()), len(text[:e].encode())] for b, e in ranges]


def main():
    out = {}
    families = [(family, picks, None) for family, picks in FAMILIES.items()]
    families += [("axolotl:" + name, picks, name) for name, picks in AXOLOTL_NAMED.items()]
    for family, picks, named in families:
        if named:
            template = axolotl_template(named)
        else:
            with open(os.path.join(HERE, family + ".jinja"), encoding="utf-8") as f:
                template = f.read()
        cases = []
        for k in picks:
            for gen in (False, True):
                variables = dict(SPECIAL, messages=CONVERSATIONS[k], add_generation_prompt=gen)
                if family in ("llama3", "qwen3") or named in TOOL_NAMED:
                    variables["tools"] = [TOOL] if k in (3, 6, 8) else None
                if (family == "qwen3" or (named == "qwen3" and k in (1, 3))) and gen:
                    variables["enable_thinking"] = False
                kwargs = {key: v for key, v in variables.items() if key not in ("messages", "tools", "add_generation_prompt")}
                try:
                    rendered, indices = render_jinja_template(
                        conversations=[CONVERSATIONS[k]], tools=variables.get("tools"), chat_template=template,
                        return_assistant_tokens_mask=True, add_generation_prompt=gen, **kwargs)
                    text = rendered[0]
                    cases.append({"variables": variables, "text": text, "generation": byte_ranges(text, indices[0])})
                except Exception as e:  # the template's raise_exception
                    cases.append({"variables": variables, "error": str(e)})
        out[family] = {"template": template, "cases": cases}
        if named:
            out[family]["named"] = named
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
