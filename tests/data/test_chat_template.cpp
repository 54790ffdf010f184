// Chat templates (data/chat_template.h) against transformers' own renderer, run at test time
// (chat_templates.py): templates in the shape of the Llama-3.1, Qwen3, Mistral, Phi-3 and Gemma
// families and one of whitespace control and expressions, on conversations with system prompts,
// multi-turn, tool calls, reasoning, list content and unicode — byte-equal text, the same
// {% generation %} spans, the same raise_exception errors; and the templates memrt ships by name
// (data/named_chat_templates.cpp) rendering what axolotl's own files of those names render. A
// construct outside the subset is an error naming it and its line.
#include <gtest/gtest.h>

#include <rapidjson/document.h>

#include <fstream>
#include <sstream>
#include <string>

#include "data/chat_template.h"
#include "memrt/error.h"
#include "test_util.h"

using namespace memrt;
using memrt::test::expect_error;

TEST(ChatTemplate, RendersAsTransformersDoes) {
  memrt::test::TempDir dir;
  ASSERT_TRUE(memrt::test::run_reference("chat_templates.py", dir.file("rendered.json")));
  std::ifstream in(dir.file("rendered.json"), std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  rapidjson::Document want;
  want.Parse(text.str().c_str());
  ASSERT_FALSE(want.HasParseError());
  int cases = 0;
  for (const auto& family : want.GetObject()) {
    const std::string name = family.name.GetString();
    SCOPED_TRACE(name);
    // axolotl's named templates: memrt's own of that name renders what axolotl's does.
    const std::string* named = family.value.HasMember("named") ? named_chat_template(family.value["named"].GetString()) : nullptr;
    if (family.value.HasMember("named")) {
      ASSERT_NE(named, nullptr);
    }
    const ChatTemplate t = ChatTemplate::parse(named ? *named : family.value["template"].GetString(), name + ".jinja");
    for (const auto& c : family.value["cases"].GetArray()) {
      SCOPED_TRACE("case " + std::to_string(cases));
      ++cases;
      if (c.HasMember("error")) {
        expect_error<Error>([&] { t.render(c["variables"]); }, {name + ".jinja", c["error"].GetString()});
        continue;
      }
      const ChatTemplate::Rendered r = t.render(c["variables"]);
      EXPECT_EQ(r.text, c["text"].GetString());
      std::vector<std::pair<size_t, size_t>> spans;
      for (const auto& s : c["generation"].GetArray()) spans.emplace_back(s[0].GetUint64(), s[1].GetUint64());
      EXPECT_EQ(r.generation, spans);
    }
  }
  EXPECT_GE(cases, 92);
}

TEST(ChatTemplate, UnsupportedConstructsAreErrorsNamingThem) {
  expect_error<FileError>([] { ChatTemplate::parse("a\n{% include 'x.jinja' %}", "t.jinja"); },
                          {"t.jinja", "line 2", "{% include %}", "not supported"});
  expect_error<FileError>([] { ChatTemplate::parse("{% if x %}never closed", "t.jinja"); }, {"t.jinja", "endif"});
  expect_error<FileError>([] { ChatTemplate::parse("{{ 'open }}", "t.jinja"); }, {"t.jinja", "line 1"});
  const ChatTemplate filter = ChatTemplate::parse("\n\n{{ x | wordwrap }}", "t.jinja");
  rapidjson::Document vars;
  vars.Parse(R"({"x": "a"})");
  expect_error<Error>([&] { filter.render(vars); }, {"t.jinja", "line 3", "filter 'wordwrap'", "not supported"});
  const ChatTemplate method = ChatTemplate::parse("{{ x.casefold() }}", "t.jinja");
  expect_error<Error>([&] { method.render(vars); }, {"t.jinja", "string method 'casefold'"});
  const ChatTemplate undefined = ChatTemplate::parse("{{ nothing.role }}", "t.jinja");
  expect_error<Error>([&] { undefined.render(vars); }, {"t.jinja", "'role' of an undefined value"});
}
