// The chat templates a run can name (axolotl's `chat_template: chatml | llama3 | phi_3 | phi_4 |
// qwen_25 | qwen3 | gemma3 | alpaca | gemma | mistral_v1 | phi_35 | mistral_v7_tekken | cohere |
// deepseek_v3 | mistral_v2v3 | mistral_v3_tekken | llama4 | exaone | deepseek_v2 | nemotron_h |
// metharme | falcon_h1 | qwen2_vl | llava | aya | gemma3n`), written
// here to render what axolotl's templates of those names render, byte for byte
// (ChatTemplate.RendersAsTransformersDoes checks them against axolotl's own files).
#include <utility>

#include "data/chat_template.h"

namespace memrt {

namespace {

// Mistral v2/v3 and v3 Tekken (axolotl's mistral_v2v3, mistral_v3_tekken): BOS; [INST] user [/INST]
// turns strictly alternating (tool turns aside); the optional system prompt opens the last user turn
// when that is the last message; the tools before the last user turn; tool calls as JSON with
// 9-character ids, and their results. The two differ in a space after each marker (none in Tekken)
// and in v2/v3 trimming the answer behind a space.
std::string mistral_v3(bool tekken) {
  const std::string sp = tekken ? "" : " ";
  const std::string answer = tekken ? "text(m['content'])" : "' ' + text(m['content']) | trim";
  return std::string() +
         "{% macro text(content) %}{% if content is string %}{{ content }}{% else %}"
         + "{{ content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') }}"
         + "{% endif %}{% endmacro %}{% set first_system = messages[0]['role'] == 'system' %}"
         + "{% set turns = messages[1:] if first_system else messages %}"
         + "{% set users = turns | selectattr('role', 'equalto', 'user') | list %}"
         + "{% set ns = namespace(index=0) %}{% for m in turns %}"
         + "{% if not (m.role in ['tool', 'tool_results'] or (m.tool_calls is defined and m.tool_calls is not "
         + "none)) %}"
         + "{% if (m['role'] == 'user') != (ns.index % 2 == 0) %}"
         + "{{ raise_exception('After the optional system message, conversation roles must alternate "
         + "user/assistant/user/assistant/...') }}"
         + "{% endif %}{% set ns.index = ns.index + 1 %}{% endif %}{% endfor %}{{ bos_token }}"
         + "{% for m in turns %}{% if m['role'] == 'user' %}"
         + "{% if tools is defined and tools is not none and m == users[-1] %}"
         + "{{ '[AVAILABLE_TOOLS]" + sp + "[' }}{% for tool in tools %}"
         + "{{ '{\"type\": \"function\", \"function\": {' }}"
         + "{% for key, val in tool.function.items() if key != 'return' %}"
         + "{{ '\"' + key + '\": ' + ('\"' + val + '\"' if val is string else val | tojson) }}"
         + "{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}"
         + "{{ '}}' + (', ' if not loop.last else ']') }}{% endfor %}{{ '[/AVAILABLE_TOOLS]' }}{% endif %}"
         + "{{ '[INST]" + sp + "' }}{% if loop.last and first_system %}"
         + "{{ text(messages[0]['content']) + '\\n\\n' }}{% endif %}{{ text(m['content']) + '[/INST]' }}"
         + "{% elif m.tool_calls is defined and m.tool_calls is not none %}"
         + "{{ '[TOOL_CALLS]" + sp + "[' }}{% for call in m.tool_calls %}"
         + "{% set call_json = call.function | tojson %}{{ call_json[:-1] }}"
         + "{% if call.id is not defined or call.id | length != 9 %}"
         + "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
         + "{% endif %}"
         + "{{ ', \"id\": \"' + call.id + '\"}' + (', ' if not loop.last else ']' + eos_token) }}"
         + "{% endfor %}{% elif m['role'] == 'assistant' %}{{ " + answer + " + eos_token }}"
         + "{% elif m['role'] in ['tool', 'tool_results'] %}"
         + "{% set content = m.content.content if m.content is mapping and m.content.content is defined else "
         + "m.content %}"
         + "{{ '[TOOL_RESULTS]" + sp + "{\"content\": ' + content | string + ', ' }}"
         + "{% if m.tool_call_id is not defined or m.tool_call_id | length != 9 %}"
         + "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
         + "{% endif %}{{ '\"call_id\": \"' + m.tool_call_id + '\"}[/TOOL_RESULTS]' }}{% else %}"
         + "{{ raise_exception('Only user and assistant roles are supported, with the exception of an initial "
         + "optional system message!') }}"
         + "{% endif %}{% endfor %}";
}

const std::vector<std::pair<std::string, std::string>>& named() {
  static const std::vector<std::pair<std::string, std::string>> templates = [] {
    std::vector<std::pair<std::string, std::string>> t = {
      // ChatML: every turn between <|im_start|>ROLE and <|im_end|>, each on its own line.
      {"chatml",
       "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
       "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"},
      // Llama 3: BOS, then each turn's header and its trimmed text (a list's text parts joined) ended by <|eot_id|>.
      {"llama3",
       "{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
       "{% if m['content'] is string %}{% set text = m['content'] %}"
       "{% else %}{% set text = m['content'] | selectattr('text', 'defined') | map(attribute='text') | join('') %}{% endif %}"
       "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + text | trim + '<|eot_id|>' }}{% endfor %}"
       "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"},
      // Phi-3: BOS; a user turn opens the assistant's; other roles are not written.
      {"phi_3",
       "{{ bos_token }}{% for m in messages %}"
       "{% if m['role'] == 'system' %}{{ '<|system|>\\n' + m['content'] + '<|end|>\\n' }}"
       "{% elif m['role'] == 'user' %}{{ '<|user|>\\n' + m['content'] + '<|end|>\\n<|assistant|>\\n' }}"
       "{% elif m['role'] == 'assistant' %}{{ m['content'] + '<|end|>\\n' }}{% endif %}{% endfor %}"},
      // Phi-4 (axolotl's phi_4: Phi-4-reasoning's turns): a system turn always, its default the
      // reasoning prompt below; user and assistant turns as <|im_start|>ROLE<|im_sep|>...<|im_end|>,
      // the assistant's text and end in a generation block; other roles are not written.
      {"phi_4",
       "{% set first_system = messages and messages[0]['role'] == 'system' %}"
       "{% set turns = messages[1:] if first_system else messages %}"
       "{{ '<|im_start|>system<|im_sep|>' }}{% if first_system %}{{ messages[0]['content'] }}{% else %}{{ '"
       "You are Phi, a language model trained by Microsoft to help users. Your role as an assistant involves"
       " thoroughly exploring questions through a systematic thinking process before providing the final"
       " precise and accurate solutions. This requires engaging in a comprehensive cycle of analysis,"
       " summarizing, exploration, reassessment, reflection, backtracing, and iteration to develop"
       " well-considered thinking process. Please structure your response into two main sections: Thought"
       " and Solution using the specified format: <think> {Thought section} </think> {Solution section}. In"
       " the Thought section, detail your reasoning process in steps. Each step should include detailed"
       " considerations such as analysing questions, summarizing relevant findings, brainstorming new ideas,"
       " verifying the accuracy of the current steps, refining any errors, and revisiting previous steps. In"
       " the Solution section, based on various attempts, explorations, and reflections from the Thought"
       " section, systematically present the final solution that you deem correct. The Solution section"
       " should be logical, accurate, and concise and detail necessary steps needed to reach the conclusion."
       " Now, try to solve the following question through the above guidelines:"
       "' }}{% endif %}{{ '<|im_end|>' }}{% for m in turns %}"
       "{% if m['role'] == 'user' %}{{ '<|im_start|>user<|im_sep|>' + m['content'] + '<|im_end|>' }}"
       "{% elif m['role'] == 'assistant' %}{{ '<|im_start|>assistant<|im_sep|>' }}"
       "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{% endif %}{% endfor %}"
       "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}"},
      // Qwen2.5: ChatML with a default system prompt, the tools' signatures in it, tool calls as
      // <tool_call> JSON and consecutive tool results in one user turn.
      {"qwen_25",
       "{% set system = messages[0]['content'] if messages[0]['role'] == 'system' else "
       "'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}"
       "{% if tools %}{{ '<|im_start|>system\\n' ~ system ~ '\\n\\n# Tools\\n\\nYou may call one or more functions to "
       "assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML "
       "tags:\\n<tools>' }}{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}"
       "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
       "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
       "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
       "{% else %}{{ '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}{% endif %}"
       "{% for m in messages %}"
       "{% if m.role == 'user' or (m.role == 'system' and not loop.first) or (m.role == 'assistant' and not m.tool_calls) %}"
       "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
       "{% elif m.role == 'assistant' %}{{ '<|im_start|>assistant' }}{% if m.content %}{{ '\\n' + m.content }}{% endif %}"
       "{% for call in m.tool_calls %}{% set f = call.function if call.function is defined else call %}"
       "{{ '\\n<tool_call>\\n{\\\"name\\\": \\\"' ~ f.name ~ '\\\", \\\"arguments\\\": ' ~ f.arguments | tojson ~ "
       "'}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
       "{% elif m.role == 'tool' %}{% if loop.first or loop.previtem.role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
       "{{ '\\n<tool_response>\\n' ~ m.content ~ '\\n</tool_response>' }}"
       "{% if loop.last or loop.nextitem.role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}{% endif %}{% endfor %}"
       "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"},
      // Qwen3 (axolotl's qwen3): ChatML, with Qwen2.5's tools and tool turns; an assistant turn after
      // the last real user query shows its reasoning (reasoning_content, else what its text holds
      // in <think></think>) in a think block when it is the last message (real_last_index, when
      // given) or has reasoning; the others show only their answer. The generation prompt opens a
      // think block, an empty closed one with enable_thinking false.
      {"qwen3",
       "{% macro text(c) %}{% if c is string %}{{ c }}{% else %}{% for item in c %}{% if 'text' in item %}"
       "{{ item['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
       "{% if tools %}{{ '<|im_start|>system\\n' }}{% if messages[0].role == 'system' %}"
       "{{ text(messages[0].content) + '\\n\\n' }}{% endif %}"
       "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
       "with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
       "{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}"
       "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
       "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
       "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
       "{% elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' }}"
       "{% endif %}"
       "{% set ns = namespace(multi_step_tool=true, last_query_index=messages | length - 1) %}"
       "{% for m in messages | reverse %}{% if ns.multi_step_tool and m.role == 'user' and not (m.content is string "
       "and m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) %}"
       "{% set ns.multi_step_tool = false %}{% set ns.last_query_index = messages | length - 1 - loop.index0 %}"
       "{% endif %}{% endfor %}"
       "{% set last = real_last_index if real_last_index is defined and real_last_index is not none "
       "else messages | length - 1 %}"
       "{% for m in messages %}"
       "{% if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
       "{{ '<|im_start|>' + m.role + '\\n' + text(m.content) + '<|im_end|>\\n' }}"
       "{% elif m.role == 'assistant' %}{% set content = '' if m.content is none else text(m.content) %}"
       "{% if m.reasoning_content is string %}{% set reasoning = m.reasoning_content %}"
       "{% elif '</think>' in content %}"
       "{% set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
       "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% else %}{% set reasoning = '' %}{% endif %}"
       "{% if loop.index0 > ns.last_query_index and (loop.index0 == last or reasoning) %}"
       "{{ '<|im_start|>' + m.role + '\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
       "{% else %}{{ '<|im_start|>' + m.role + '\\n' + content }}{% endif %}"
       "{% for call in m.tool_calls or [] %}{% if content or not loop.first %}{{ '\\n' }}{% endif %}"
       "{% set f = call.function if call.function else call %}"
       "{{ '<tool_call>\\n{\\\"name\\\": \\\"' ~ f.name ~ '\\\", \\\"arguments\\\": ' ~ "
       "(f.arguments if f.arguments is string else f.arguments | tojson) ~ '}\\n</tool_call>' }}{% endfor %}"
       "{{ '<|im_end|>\\n' }}"
       "{% elif m.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
       "{{ '<|im_start|>user' }}{% endif %}{{ '\\n<tool_response>\\n' + text(m.content) + '\\n</tool_response>' }}"
       "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}{% endif %}"
       "{% endfor %}"
       "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
       "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
       "{% else %}{{ '<think>\\n\\n' }}{% endif %}{% endif %}"},
      // Gemma 3: BOS; the system prompt opens the first turn; user and model (the assistant) must
      // alternate; a list's images as <start_of_image> and its texts trimmed.
      {"gemma3",
       "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
       "{% set system = messages[0]['content'] if messages[0]['content'] is string else "
       "messages[0]['content'] | selectattr('text', 'defined') | map(attribute='text') | join('') %}"
       "{% set prefix = system + '\\n\\n' %}{% set turns = messages[1:] %}"
       "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
       "{% for m in turns %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
       "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
       "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' + (prefix if loop.first else '') }}"
       "{% if m['content'] is string %}{{ m['content'] | trim }}{% elif m['content'] is iterable %}"
       "{% for item in m['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
       "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}"
       "{% else %}{{ raise_exception('Invalid content type') }}{% endif %}{{ '<end_of_turn>\\n' }}{% endfor %}"
       "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"},
      // Alpaca as a chat: BOS, a leading system turn's text as it is, then "### Instruction:" and
      // "### Response:" sections (the response ended by EOS), a blank line between turns; other
      // roles write nothing but the blank line.
      {"alpaca",
       "{{ bos_token }}{% for m in messages %}"
       "{% if loop.first and m['role'] == 'system' %}{{ m['content'] }}"
       "{% elif m['role'] == 'user' %}{{ '### Instruction:\\n' + m['content'] }}"
       "{% elif m['role'] == 'assistant' %}{{ '### Response:\\n' + m['content'] + eos_token }}{% endif %}"
       "{% if not loop.last %}{{ '\\n\\n' }}{% endif %}{% endfor %}"
       "{% if add_generation_prompt %}{{ '\\n\\n### Response:\\n' }}{% endif %}"},
      // Gemma (1 and 2): BOS; no system turn; user and model (the assistant) alternate, each turn's
      // text trimmed (a list's text parts, each trimmed).
      {"gemma",
       "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
       "{% endif %}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
       "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
       "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
       "{% if m['content'] is string %}{{ m['content'] | trim }}"
       "{% else %}{% for part in m['content'] %}{% if 'text' in part %}{{ part['text'] | trim }}{% endif %}"
       "{% endfor %}{% endif %}{{ '<end_of_turn>\\n' }}{% endfor %}"
       "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"},
      // Mistral v1: BOS; [INST] user [/INST] and " answer</s>", strictly alternating after an
      // optional system prompt, which opens the first user turn; a list's text parts joined.
      {"mistral_v1",
       "{% set first_system = messages[0]['role'] == 'system' %}"
       "{% macro text(content) %}{% if content is string %}{{ content }}{% else %}"
       "{{ content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') }}{% endif %}{% endmacro %}"
       "{{ bos_token }}{% for m in (messages[1:] if first_system else messages) %}"
       "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('After the optional system "
       "message, conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
       "{% if m['role'] == 'user' %}{{ ' [INST] ' }}{% if loop.first and first_system %}"
       "{{ text(messages[0]['content']) + '\\n\\n' }}{% endif %}{{ text(m['content']) + ' [/INST]' }}"
       "{% elif m['role'] == 'assistant' %}{{ ' ' + text(m['content']) + eos_token }}"
       "{% else %}{{ raise_exception('Only user and assistant roles are supported, with the exception of an "
       "initial optional system message!') }}{% endif %}{% endfor %}"},
      // Phi-3.5: <|ROLE|> turns ended by <|end|>, each on its own line; an empty system turn is not
      // written, nor are other roles.
      {"phi_35",
       "{% for m in messages %}{% if m['role'] == 'system' and m['content'] %}{{ '<|system|>\\n' + m['content'] + '<|end|>\\n' }}"
       "{% elif m['role'] in ['user', 'assistant'] %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}"
       "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"},
      // Mistral v7 (Tekken; Mistral Small 3): BOS and a system prompt always (the first system
      // turn's, else Mistral's, naming today's date), [INST] user [/INST] and "answer</s>" turns, a
      // later system turn as a system prompt where it stands; images as [IMG].
      {"mistral_v7_tekken",
       "{% set today = strftime_now('%Y-%m-%d') %}{% macro text(content) %}{% if content is string %}"
       "{{ content }}{% else %}"
       "{{ content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') }}"
       "{% endif %}{% endmacro %}{% if messages[0]['role'] == 'system' %}"
       "{% set system = text(messages[0]['content']) %}{% set turns = messages[1:] %}{% else %}"
       "{% set system = \"You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI, a "
       "French startup headquartered in Paris.\\nYour knowledge base was last updated on 2023-10-01. The "
       "current date is \" + today + \".\\n\\nWhen you're not sure about some information, you say that "
       "you don't have the information and don't make up anything.\\nIf the user's question is not clear, "
       "ambiguous, or does not provide enough context for you to accurately answer the question, you do "
       "not try to answer it right away and you rather ask the user to clarify their request (e.g. "
       "\\\"What are some good restaurants around me?\\\" => \\\"Where are you?\\\" or \\\"When is the "
       "next flight to Tokyo\\\" => \\\"Where do you travel from?\\\")\" %}"
       "{% set turns = messages %}{% endif %}"
       "{{ bos_token + '[SYSTEM_PROMPT]' + system + '[/SYSTEM_PROMPT]' }}{% for m in turns %}"
       "{% if m['role'] == 'user' %}{{ '[INST]' }}{% if m['content'] is string %}{{ m['content'] }}"
       "{% else %}{% for block in m['content'] %}{% if block['type'] == 'text' %}{{ block['text'] }}"
       "{% elif block['type'] in ['image', 'image_url'] %}{{ '[IMG]' }}{% else %}"
       "{{ raise_exception('Only text and image blocks are supported in message content!') }}"
       "{% endif %}{% endfor %}{% endif %}{{ '[/INST]' }}{% elif m['role'] == 'system' %}"
       "{{ '[SYSTEM_PROMPT]' + text(m['content']) + '[/SYSTEM_PROMPT]' }}"
       "{% elif m['role'] == 'assistant' %}{{ text(m['content']) + eos_token }}{% else %}"
       "{{ raise_exception('Only user, system and assistant roles are supported!') }}{% endif %}"
       "{% endfor %}"},
      // Cohere (Command R): BOS; an optional system turn, then user and chatbot turns strictly
      // alternating, each text stripped.
      {"cohere",
       "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set turns = messages[1:] %}"
       "{{ '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + messages[0]['content'] + '<|END_OF_TURN_TOKEN|>' }}"
       "{% else %}{% set turns = messages %}{% endif %}{% for m in turns %}"
       "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
       "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
       "{% endif %}{% if m['role'] == 'user' %}"
       "{{ '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + m['content'].strip() + '<|END_OF_TURN_TOKEN|>' }}"
       "{% elif m['role'] == 'assistant' %}"
       "{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' + m['content'].strip() + '<|END_OF_TURN_TOKEN|>' }}"
       "{% endif %}{% endfor %}{% if add_generation_prompt %}"
       "{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% endif %}"},
      // DeepSeek V3: BOS and every system turn's text (joined by blank lines) first; user and
      // assistant turns, an assistant's text after its last </think>; tool calls as fenced JSON
      // between the tool-call markers, consecutive tool results in one block of outputs.
      {"deepseek_v3",
       "{% set ns = namespace(system='', systems=0, tool=false) %}{% for m in messages %}"
       "{% if m['role'] == 'system' %}"
       "{% set ns.system = ns.system + ('\\n\\n' if ns.systems else '') + m['content'] %}"
       "{% set ns.systems = ns.systems + 1 %}{% endif %}{% endfor %}{{ bos_token + ns.system }}"
       "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.tool = false %}"
       "{{ '<｜User｜>' + m['content'] }}{% elif m['role'] == 'assistant' and 'tool_calls' in m %}"
       "{% if ns.tool %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}{% set ns.tool = false %}"
       "{% for call in m['tool_calls'] %}{% if loop.first %}"
       "{{ '<｜Assistant｜>' + ('' if m['content'] is none else m['content']) + '<｜tool▁calls▁begin｜>' }}"
       "{% else %}{{ '\\n' }}{% endif %}"
       "{{ '<｜tool▁call▁begin｜>' + call['type'] + '<｜tool▁sep｜>' + call['function']['name'] + '\\n```json\\n' + call['function']['arguments'] + '\\n```<｜tool▁call▁end｜>' }}"
       "{% endfor %}{{ '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}{% elif m['role'] == 'assistant' %}"
       "{% set content = '' if m['content'] is none else m['content'] %}{% if ns.tool %}"
       "{{ '<｜tool▁outputs▁end｜>' + content + '<｜end▁of▁sentence｜>' }}{% set ns.tool = false %}{% else %}"
       "{{ '<｜Assistant｜>' + content.split('</think>')[-1] + '<｜end▁of▁sentence｜>' }}{% endif %}"
       "{% elif m['role'] == 'tool' %}"
       "{{ ('' if ns.tool else '<｜tool▁outputs▁begin｜>') + '<｜tool▁output▁begin｜>' + m['content'] + '<｜tool▁output▁end｜>' }}"
       "{% set ns.tool = true %}{% endif %}{% endfor %}{% if ns.tool %}{{ '<｜tool▁outputs▁end｜>' }}"
       "{% endif %}{% if add_generation_prompt and not ns.tool %}{{ '<｜Assistant｜>' }}{% endif %}"},
      {"mistral_v2v3", mistral_v3(false)},
      {"mistral_v3_tekken", mistral_v3(true)},
      // Llama 4: BOS; a system turn (its text trimmed; "Environment: ipython" with tools); the tools
      // and their guidance in the first user turn (or, with tools_in_user_message false, in the
      // system turn); <|header_start|>ROLE<|header_end|> turns ended by <|eot|>, images as <|image|>;
      // tool calls as {"name", "parameters"} JSON after <|python_start|>...<|python_end|>; tool
      // results as ipython turns (as JSON).
      {"llama4",
       "{% set tools = custom_tools if custom_tools is defined else tools %}"
       "{% set in_user = tools_in_user_message if tools_in_user_message is defined else true %}"
       "{% set has_tools = tools is defined and tools is not none %}{% macro body(content) %}"
       "{% if content is string %}{{ content }}{% else %}{% for part in content %}"
       "{% if part['type'] == 'image' %}{{ '<|image|>' }}{% elif part['type'] == 'text' %}"
       "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}{% macro trimmed(content) %}"
       "{{ (content if content is string else content | selectattr('text', 'defined') | "
       "map(attribute='text') | join('')) | trim }}"
       "{% endmacro %}"
       "{% set guide = 'Respond in the format {\"name\": function name, \"parameters\": dictionary of "
       "argument name and its value}.Do not use variables.\\n\\n' %}"
       "{{ bos_token }}{% set turns = messages %}{% if messages[0]['role'] == 'system' %}"
       "{% set turns = messages[1:] %}{{ '<|header_start|>system<|header_end|>\\n\\n' }}{% if has_tools %}"
       "{{ 'Environment: ipython\\n' }}{% endif %}{% if has_tools and not in_user %}"
       "{{ 'You have access to the following functions. To call a function, please respond with JSON for "
       "a function call.' + guide }}"
       "{% for t in tools %}{{ t | tojson(indent=4) + '\\n\\n' }}{% endfor %}{% endif %}"
       "{{ trimmed(messages[0]['content']) + '<|eot|>' }}{% endif %}{% if in_user and has_tools %}"
       "{% if turns | length == 0 %}"
       "{{ raise_exception(\"Cannot put tools in the first user message when there's no first user message!\") }}"
       "{% endif %}"
       "{{ '<|header_start|>user<|header_end|>\\n\\nGiven the following functions, please respond with a "
       "JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n' + "
       "guide }}"
       "{% for t in tools %}{{ t | tojson(indent=4) + '\\n\\n' }}{% endfor %}"
       "{{ trimmed(turns[0]['content']) + '<|eot|>' }}{% set turns = turns[1:] %}{% endif %}"
       "{% for m in turns %}{% if not (m.role in ['ipython', 'tool'] or 'tool_calls' in m) %}"
       "{{ '<|header_start|>' + m['role'] + '<|header_end|>\\n\\n' + body(m['content']) + '<|eot|>' }}"
       "{% elif 'tool_calls' in m and m.tool_calls | length > 0 %}"
       "{{ '<|header_start|>assistant<|header_end|>\\n\\n<|python_start|>' + body(m['content']) + "
       "'<|python_end|>' }}"
       "{% for call in m.tool_calls %}"
       "{{ '{\"name\": \"' + call.function.name + '\", \"parameters\": ' + call.function.arguments | tojson + '}' }}"
       "{% endfor %}{{ '<|eot|>' }}{% elif m.role in ['tool', 'ipython'] %}"
       "{{ '<|header_start|>ipython<|header_end|>\\n\\n' + (m.content | tojson if m.content is mapping or "
       "m.content is iterable else m.content) + '<|eot|>' }}"
       "{% endif %}{% endfor %}{% if add_generation_prompt %}"
       "{{ '<|header_start|>assistant<|header_end|>\\n\\n' }}{% endif %}"},
      // EXAONE 3: [|ROLE|] turns, a user's ended by a newline, the others by [|endofturn|]; an empty
      // system turn first when there is none.
      {"exaone",
       "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
       "{{ '[|system|][|endofturn|]\\n' }}{% endif %}"
       "{{ '[|' + m['role'] + '|]' + m['content'] + ('\\n' if m['role'] == 'user' else '[|endofturn|]\\n') }}"
       "{% endfor %}{% if add_generation_prompt %}{{ '[|assistant|]' }}{% endif %}"},
      // DeepSeek V2: BOS; system texts as they are (a blank line after), <｜User｜> and
      // <｜Assistant｜> turns, the assistant's ended by EOS.
      {"deepseek_v2",
       "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
       "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + m['content'] + eos_token }}"
       "{% elif m['role'] == 'system' %}{{ m['content'] + '\\n\\n' }}{% endif %}{% endfor %}"
       "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"},
      // Nemotron-H: ChatML for an optional leading system turn, then user and assistant turns only.
      {"nemotron_h",
       "{% set turns = messages %}{% if messages and messages[0].role == 'system' %}"
       "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
       "{% set turns = messages[1:] %}{% endif %}{% for m in turns %}"
       "{% if m.role in ['user', 'assistant'] %}"
       "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% else %}"
       "{{ raise_exception('Unexpected role: ' + m.role) }}{% endif %}{% endfor %}"
       "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"},
      // Metharme (Pygmalion): BOS, a system prompt always (the role-play one by default), <|user|> and
      // <|model|> texts stripped, then EOS (or the generation prompt).
      {"metharme",
       "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
       "{% set turns = messages[1:] %}{% else %}"
       "{% set system = 'Enter RP mode. You shall reply to the user while staying in character. Your "
       "responses must be detailed, creative, immersive, and drive the scenario forward.' %}"
       "{% set turns = messages %}{% endif %}{{ '<|system|>' + system }}{% for m in turns %}"
       "{% if m['role'] == 'user' %}{{ '<|user|>' + m['content'].strip() }}"
       "{% elif m['role'] == 'assistant' %}{{ '<|model|>' + m['content'].strip() }}{% endif %}{% endfor %}"
       "{{ '<|model|>' if add_generation_prompt else eos_token }}"},
      // Falcon-H1: ChatML; with tools, the system turn (left open, as Falcon's file leaves it) holds
      // the tools' signatures in <tools>, each in brackets, and the tool-call schema.
      {"falcon_h1",
       "{{ bos_token }}{% set first_system = messages[0].role == 'system' %}{% if tools %}"
       "{{ '<|im_start|>system\\n' + (messages[0].content + '\\n\\n' if first_system else '') }}"
       "{{ \"You are a function calling AI model. You are provided with function signature within <tools> "
       "</tools> XML tags. You may call one or more functions to assist with the user query. Don't make "
       "assumptions about what values to plug into functions.\\n<tools>\\n\" }}"
       "{% for tool in tools %}{{ '[' + tool | tojson + ']' }}{% endfor %}"
       "{{ \"\\n</tools>\\nFor each function call, return a json object with function name and arguments "
       "within <tool_call> </tool_call> tags with the following schema:\\n<tool_call>\\n{'arguments': "
       "<args-dict>, 'name': <function-name>}\\n</tool_call>\\n\" }}"
       "{% elif first_system %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
       "{% endif %}{% for m in messages %}{% if m.role != 'system' %}"
       "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
       "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"},
      // Qwen2-VL: ChatML with a default system turn; list content's images and videos as vision pads
      // (numbered with add_vision_id), its texts as they are.
      {"qwen2_vl",
       "{% set counts = namespace(image=0, video=0) %}{% for m in messages %}"
       "{% if loop.first and m['role'] != 'system' %}"
       "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
       "{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['content'] is string %}"
       "{{ m['content'] + '<|im_end|>\\n' }}{% else %}{% for part in m['content'] %}"
       "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
       "{% set counts.image = counts.image + 1 %}{% if add_vision_id %}"
       "{{ 'Picture ' + counts.image | string + ': ' }}{% endif %}"
       "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
       "{% elif part['type'] == 'video' or 'video' in part %}{% set counts.video = counts.video + 1 %}"
       "{% if add_vision_id %}{{ 'Video ' + counts.video | string + ': ' }}{% endif %}"
       "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}{% elif 'text' in part %}{{ part['text'] }}"
       "{% endif %}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
       "{{ '<|im_start|>assistant\\n' }}{% endif %}"},
      // LLaVA: USER: / ASSISTANT: turns, each text followed by a space (a list's images first, as
      // <image> lines), the assistant's text in generation blocks.
      {"llava",
       "{% for m in messages %}{% if m['role'] != 'system' %}{{ m['role'].upper() + ': ' }}{% endif %}"
       "{% if m['content'] is string %}{% if m['role'] != 'assistant' %}{{ m['content'] + ' ' }}{% else %}"
       "{% generation %}{{ m['content'] + ' ' }}{% endgeneration %}{% endif %}{% else %}"
       "{% for part in m['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}"
       "{% endfor %}{% for part in m['content'] | selectattr('type', 'equalto', 'text') %}"
       "{% if m['role'] != 'assistant' %}{{ part['text'] + ' ' }}{% else %}{% generation %}"
       "{{ part['text'] + ' ' }}{% endgeneration %}{% endif %}{% endfor %}{% endif %}{% endfor %}"
       "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"},
    };
    auto source = [&t](const std::string& name) {
      for (const auto& [n, s] : t)
        if (n == name) return s;
      return std::string();
    };
    // Aya: axolotl's aya file is Cohere's, its other default system prompt in a branch never taken.
    t.emplace_back("aya", source("cohere"));
    // Gemma 3n: Gemma 3's, with soft tokens for a list's images and audio.
    std::string gemma3n = source("gemma3");
    const std::string image = "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}";
    gemma3n.replace(gemma3n.find(image), image.size(),
                    "{% if item['type'] == 'audio' %}{{ '<audio_soft_token>' }}"
                    "{% elif item['type'] == 'image' %}{{ '<image_soft_token>' }}");
    t.emplace_back("gemma3n", gemma3n);
    return t;
  }();
  return templates;
}

}  // namespace

const std::string* named_chat_template(const std::string& name) {
  for (const auto& [n, source] : named())
    if (n == name) return &source;
  return nullptr;
}

std::string named_chat_template_names() {
  std::string out;
  for (const auto& [n, source] : named()) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace memrt
