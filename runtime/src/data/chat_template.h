// Chat templates as transformers renders them (docs/tokenizers.md, "Chat templates"): an in-tree
// interpreter of the Jinja subset chat templates use, with the environment transformers' renderer
// sets up (trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, `tojson`
// with ensure_ascii off, `{% generation %}` blocks). A construct outside the subset is an error
// naming it and its line when the template is parsed, never a different prompt.
//
//   const ChatTemplate t = ChatTemplate::parse(source, "tokenizer_config.json: chat_template");
//   rapidjson::Document vars;  // {"messages": [...], "add_generation_prompt": false, "bos_token": ...}
//   const ChatTemplate::Rendered r = t.render(vars);  // r.text, r.generation: assistant byte spans
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <rapidjson/document.h>

namespace memrt {

class ChatTemplate {
 public:
  // memrt::FileError naming `where` and the line of a syntax error or of a construct the
  // interpreter does not implement.
  static ChatTemplate parse(const std::string& source, const std::string& where);

  struct Rendered {
    std::string text;
    // [begin, end) byte ranges of `text` written inside {% generation %} blocks, in order.
    std::vector<std::pair<size_t, size_t>> generation;
  };
  // Renders with the template variables of the JSON object `variables`. memrt::Error naming the
  // template and line for what fails at run time: raise_exception's message, an undefined value
  // used as an object, a value of the wrong kind for a filter or an operator.
  Rendered render(const rapidjson::Value& variables) const;
  // Whether the template has {% generation %} blocks (which assistant-only masks need).
  bool has_generation() const;
  // The template's Jinja source, as given to parse().
  const std::string& source() const;

  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;
  ~ChatTemplate();

  struct Program;

 private:
  explicit ChatTemplate(std::unique_ptr<Program> p);
  std::unique_ptr<Program> program_;
};

// Python's str.strip() (left and right), lstrip() (left) or rstrip() (right) without arguments, on
// UTF-8 text: whitespace is every character str.isspace() names, Unicode's (U+00A0, U+3000...) too.
std::string python_strip(const std::string& s, bool left, bool right);

// The chat template of the model directory `dir`, as transformers loads it: chat_template.jinja,
// else tokenizer_config.json's "chat_template" (a string, or the template named "default" in a list
// of {"name", "template"}); nullopt when there is none. FileError naming the file when it is
// malformed or its template does not parse.
std::optional<ChatTemplate> load_chat_template(const std::string& dir);

// The source of the template a run names (axolotl's chat_template: one of
// named_chat_template_names()), as axolotl's template of that name renders; nullptr for a name
// memrt does not ship.
const std::string* named_chat_template(const std::string& name);
// The names named_chat_template knows, comma-separated.
std::string named_chat_template_names();

}  // namespace memrt
