// The chat templates a run can name (axolotl's `chat_template: chatml | llama3 | phi_3`), written
// here to render what axolotl's templates of those names render, byte for byte
// (ChatTemplate.NamedTemplatesRenderAsAxolotlsDo checks them against axolotl's own files).
#include <utility>

#include "data/chat_template.h"

namespace memrt {

namespace {

const std::vector<std::pair<std::string, std::string>>& named() {
  static const std::vector<std::pair<std::string, std::string>> templates = {
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
  };
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
