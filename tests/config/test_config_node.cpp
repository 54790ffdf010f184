// ConfigNode, the JSON/YAML readers, key paths, nearest_key and ConfigReader.
#include <gtest/gtest.h>

#include "config_test_util.h"
#include "memrt/config_node.h"

using namespace memrt;
using memrt::test::expect_config_error;

TEST(Json, CommentsAndTrailingCommasAreAllowed) {
  const ConfigNode n = parse_json_text(R"({
    // a comment
    "a": 1, /* another */
    "b": [1, 2, 3,],
    "c": {"d": "x",},
  })", "t.json");
  EXPECT_EQ(n.find("a")->as_int(), 1);
  EXPECT_EQ(n.find("b")->as_array().size(), 3u);
  EXPECT_EQ(n.at_path("c.d")->as_string(), "x");
  EXPECT_EQ(n.at_path("c.d")->file(), "t.json");
  EXPECT_EQ(n.at_path("c.d")->path(), "c.d");
  EXPECT_EQ(n.at_path("b[2]")->path(), "b[2]");
}

TEST(Json, KeyOrderIsKept) {
  const ConfigNode n = parse_json_text(R"({"z": 1, "a": 2, "m": 3})", "t.json");
  ASSERT_EQ(n.members().size(), 3u);
  EXPECT_EQ(n.members()[0].first, "z");
  EXPECT_EQ(n.members()[2].first, "m");
}

TEST(Json, DuplicateKeyNamesFileLineAndKey) {
  expect_config_error([] { parse_json_text("{\n \"a\": {\"x\": 1,\n \"x\": 2}\n}", "dup.json"); },
                      {"dup.json", "'a.x'", "duplicate key", "line 3"});
}

TEST(Json, SyntaxErrorNamesLineAndColumn) {
  expect_config_error([] { parse_json_text("{\n  \"a\": 1\n  \"b\": 2\n}", "bad.json"); },
                      {"bad.json", "line 3", "invalid JSON"});
}

TEST(Json, NanAndTrailingGarbageAreErrors) {
  expect_config_error([] { parse_json_text("{\"a\": NaN}", "nan.json"); }, {"nan.json", "line 1"});
  expect_config_error([] { parse_json_text("{\"a\": 1} {\"b\": 2}", "two.json"); }, {"two.json", "invalid JSON"});
}

TEST(Json, MissingFileIsAConfigErrorNamingIt) {
  expect_config_error([] { parse_json_file("no/such/ds_config.json"); }, {"no/such/ds_config.json", "cannot open"});
}

TEST(Yaml, ScalarsAreTyped) {
  const ConfigNode n = parse_yaml_text(R"(
lr: 2e-4
lr2: 1.0e-4
steps: 200
neg: -1
big: 2e8
yes_flag: yes
no_flag: no
t: true
F: False
empty:
tilde: ~
quoted_num: "5"
single: '2e-4'
name: cosine
version: 1.2.3
)", "t.yaml");
  EXPECT_TRUE(n.find("lr")->is_number());
  EXPECT_DOUBLE_EQ(n.find("lr")->as_double(), 2e-4);
  EXPECT_DOUBLE_EQ(n.find("lr2")->as_double(), 1e-4);
  EXPECT_EQ(n.find("steps")->as_int(), 200);
  EXPECT_EQ(n.find("neg")->as_int(), -1);
  EXPECT_EQ(n.find("big")->as_int(), 200000000);
  EXPECT_TRUE(n.find("yes_flag")->as_bool());
  EXPECT_FALSE(n.find("no_flag")->as_bool());
  EXPECT_TRUE(n.find("t")->as_bool());
  EXPECT_FALSE(n.find("F")->as_bool());
  EXPECT_TRUE(n.find("empty")->is_null());
  EXPECT_TRUE(n.find("tilde")->is_null());
  EXPECT_TRUE(n.find("quoted_num")->is_string());
  EXPECT_TRUE(n.find("single")->is_string());
  EXPECT_EQ(n.find("name")->as_string(), "cosine");
  EXPECT_TRUE(n.find("version")->is_string());
}

TEST(Yaml, MultiLineScalarsListsAndNestedMaps) {
  const ConfigNode n = parse_yaml_text(R"(
model_name_or_path:
  Qwen/Qwen2.5-0.5B
learning_rate:
  0.0001
modules: [q_proj, v_proj]
block:
  - path: a
    type: alpaca
  - path: b
kwargs:
  use_reentrant: false
text: |
  line one
  line two
folded: >
  one
  two
)", "t.yaml");
  EXPECT_EQ(n.find("model_name_or_path")->as_string(), "Qwen/Qwen2.5-0.5B");
  EXPECT_DOUBLE_EQ(n.find("learning_rate")->as_double(), 1e-4);
  EXPECT_EQ(n.at_path("modules[1]")->as_string(), "v_proj");
  EXPECT_EQ(n.at_path("block[0].type")->as_string(), "alpaca");
  EXPECT_EQ(n.at_path("block[1].path")->path(), "block[1].path");
  EXPECT_FALSE(n.at_path("kwargs.use_reentrant")->as_bool());
  EXPECT_EQ(n.find("text")->as_string(), "line one\nline two\n");
  EXPECT_EQ(n.find("folded")->as_string(), "one two\n");
}

TEST(Yaml, DuplicateKeysAndSyntaxErrorsNameTheFile) {
  expect_config_error([] { parse_yaml_text("a: 1\nb: 2\na: 3\n", "dup.yaml"); }, {"dup.yaml", "'a'", "duplicate"});
  expect_config_error([] { parse_yaml_text("a: [1, 2\nb: 3\n", "bad.yaml"); }, {"bad.yaml", "invalid YAML", "line"});
}

TEST(Yaml, ValueParsesOneOverride) {
  EXPECT_EQ(parse_yaml_value("20", "command line", "max_steps").as_int(), 20);
  EXPECT_TRUE(parse_yaml_value("true", "command line", "bf16").as_bool());
  EXPECT_EQ(parse_yaml_value("[a, b]", "command line", "x").as_array().size(), 2u);
  const ConfigNode s = parse_yaml_value("output/run1", "command line", "output_dir");
  EXPECT_EQ(s.as_string(), "output/run1");
  EXPECT_EQ(s.file(), "command line");
  EXPECT_EQ(s.path(), "output_dir");
}

TEST(TypedReads, IntegersWrittenAsFloatsOrExponents) {
  EXPECT_EQ(ConfigNode::number(2e8).as_int(), 200000000);
  EXPECT_EQ(ConfigNode::number(3.0).as_int(), 3);
  EXPECT_EQ(parse_json_text("{\"a\": 5e8}", "x").find("a")->as_int(), 500000000);
  expect_config_error([] { ConfigNode::number(2.5, "f.json", "k").as_int(); }, {"f.json", "'k'", "integer", "2.5"});
  expect_config_error([] { ConfigNode::number(1e19, "f.json", "k").as_int(); }, {"'k'", "out of the 64-bit range"});
  expect_config_error([] { ConfigNode::number(-1e19, "f.json", "k").as_int(); }, {"out of the 64-bit range"});
}

TEST(TypedReads, WrongTypeNamesFileKeyExpectedAndFound) {
  const ConfigNode n = parse_json_text(R"({"a": {"b": "abc"}})", "ds.json");
  const std::string msg = expect_config_error([&] { n.at_path("a.b")->as_int(); },
                                              {"ds.json", "'a.b'", "expected an integer", "a string (\"abc\")"});
  expect_config_error([&] { n.find("a")->as_bool(); }, {"'a'", "expected a boolean", "an object"});
  expect_config_error([&] { n.find("a")->as_string(); }, {"expected a string"});
  expect_config_error([&] { n.find("a")->as_array(); }, {"expected an array"});
}

TEST(TypedReads, UnresolvedAutoSaysSoAndWhatToWrite) {
  const ConfigNode n = ConfigNode::string("auto", "ds.json", "zero_optimization.sub_group_size");
  EXPECT_TRUE(n.is_auto());
  expect_config_error([&] { n.as_int(); }, {"ds.json", "'zero_optimization.sub_group_size'", "\"auto\" could not be resolved",
                                            "write an integer instead"});
  expect_config_error([&] { n.as_bool(); }, {"\"auto\" could not be resolved", "write a boolean"});
}

TEST(Paths, AtPathAndJoin) {
  const ConfigNode n = parse_json_text(R"({"plugins": [{"name": "a"}, {"options": {"factor": 4}}],
                                           "zero_optimization": {"offload_optimizer": {"device": "cpu"}}})", "ds.json");
  EXPECT_EQ(n.at_path("zero_optimization.offload_optimizer.device")->as_string(), "cpu");
  EXPECT_EQ(n.at_path("plugins[1].options.factor")->as_int(), 4);
  EXPECT_EQ(n.at_path("plugins[1].options.factor")->path(), "plugins[1].options.factor");
  EXPECT_EQ(n.at_path("plugins[2]"), nullptr);
  EXPECT_EQ(n.at_path("zero_optimization.nope"), nullptr);
  EXPECT_EQ(n.at_path("plugins.name"), nullptr);
  EXPECT_EQ(join_key_path("a.b", "c"), "a.b.c");
  EXPECT_EQ(join_key_path("", "c"), "c");
}

TEST(Nodes, BuildMutateSerialise) {
  ConfigNode o = ConfigNode::object();
  o.set("b", ConfigNode::number(2e8));
  o.set("a", ConfigNode::number(0.001));
  o.set("s", ConfigNode::string("x\"y"));
  ConfigNode arr = ConfigNode::array();
  arr.push_back(ConfigNode::boolean(true));
  arr.push_back(ConfigNode::null());
  o.set("arr", arr);
  o.set("b", ConfigNode::number(3));  // replace keeps the position
  EXPECT_EQ(o.to_json(0), R"({"b": 3, "a": 0.001, "s": "x\"y", "arr": [true, null]})");
  EXPECT_TRUE(o.erase("a"));
  EXPECT_FALSE(o.erase("a"));
  EXPECT_FALSE(o.contains("a"));
  EXPECT_EQ(ConfigNode::number(1e-4).to_json(), "0.0001");
  EXPECT_EQ(ConfigNode::number(0.1).to_json(), "0.1");
  EXPECT_EQ(ConfigNode::string("abc").describe(), "a string (\"abc\")");
  EXPECT_EQ(ConfigNode::number(3).describe(), "a number (3)");
  // to_json output parses back to the same tree.
  const ConfigNode back = parse_json_text(o.to_json(), "x");
  EXPECT_EQ(back.to_json(), o.to_json());
}

// A number written with a fraction stays a float through to_json, as Python's json keeps it
// (transformers' BitsAndBytesConfig refuses an llm_int8_threshold of 6 where 6.0 is expected).
TEST(Nodes, NumbersWrittenAsFloatsStayFloats) {
  EXPECT_EQ(ConfigNode::real(6.0).to_json(), "6.0");
  EXPECT_EQ(ConfigNode::number(6.0).to_json(), "6");
  EXPECT_EQ(ConfigNode::real(1e-5).to_json(), "1e-05");
  EXPECT_EQ(parse_json_text(R"({"a": 6.0, "b": 6, "c": 1e2, "d": -0.5})", "t.json").to_json(0),
            R"({"a": 6.0, "b": 6, "c": 100.0, "d": -0.5})");
  EXPECT_EQ(parse_yaml_text("a: 6.0\nb: 6\nc: 1.0e-3\n", "t.yaml").to_json(0), R"({"a": 6.0, "b": 6, "c": 0.001})");
  EXPECT_EQ(parse_json_text("6.0", "t.json").as_int(), 6);  // still integral where an integer is read
}

TEST(NearestKey, EditDistanceCaseInsensitive) {
  const std::vector<std::string> keys = {"gradient_clipping", "gradient_accumulation_steps", "train_batch_size",
                                         "steps_per_print", "offload_optimizer"};
  EXPECT_EQ(nearest_key("gradient_clip", keys), "gradient_clipping");
  EXPECT_EQ(nearest_key("Gradient_Clipping", keys), "gradient_clipping");
  EXPECT_EQ(nearest_key("train_batch_sise", keys), "train_batch_size");
  EXPECT_EQ(nearest_key("gradient_accumulation_steps ", keys), "gradient_accumulation_steps");  // trailing space
  EXPECT_EQ(nearest_key("offload", keys), "offload_optimizer");
  EXPECT_EQ(nearest_key("completely_different", keys), "");
  EXPECT_EQ(nearest_key("lr", keys), "");
}

TEST(Reader, GetOptionalRequiredChild) {
  ConfigDiagnostics diag;
  const ConfigNode n = parse_json_text(R"({"factor": 4, "name": "x", "sub": {"k": 1}, "nul": null})", "p.json");
  ConfigReader r(n, diag);
  EXPECT_DOUBLE_EQ(r.get<double>("factor", 1.0), 4.0);
  EXPECT_EQ(r.get<int>("absent", 7), 7);
  EXPECT_EQ(r.get<int>("nul", 9), 9);  // null -> default
  EXPECT_EQ(r.optional<std::string>("name").value(), "x");
  EXPECT_FALSE(r.optional<int>("other").has_value());
  EXPECT_NE(r.child("sub"), nullptr);
  r.finish();
  EXPECT_TRUE(diag.warnings.empty());
  ConfigReader r2(n, diag);
  expect_config_error([&] { r2.required<int>("missing_key"); }, {"p.json", "'missing_key'", "required"});
  expect_config_error([&] { r2.get<int>("name", 0); }, {"'name'", "expected an integer"});
}

TEST(Reader, IgnoreWarnsOnceRejectThrows) {
  ConfigDiagnostics diag;
  const ConfigNode n = parse_json_text(R"({"wall_clock_breakdown": true, "nvme_path": "/x", "a": 1})", "ds.json");
  ConfigReader r(n, diag);
  r.get<int>("a", 0);
  r.ignore("wall_clock_breakdown", "no timers");
  r.ignore("not_present", "nothing");
  ASSERT_EQ(diag.warnings.size(), 1u);
  EXPECT_NE(diag.warnings[0].find("ds.json: 'wall_clock_breakdown'"), std::string::npos);
  EXPECT_NE(diag.warnings[0].find("no timers"), std::string::npos);
  expect_config_error([&] { r.reject("nvme_path", "use offload device \"cpu\""); },
                      {"ds.json", "'nvme_path'", "not supported", "use offload device \"cpu\""});
}

TEST(Reader, RejectIfTrueAcceptsWhatMemrtDoesAndNamesTheKeyOtherwise) {
  ConfigDiagnostics diag;
  const ConfigNode n = parse_json_text(
      R"({"off": false, "unset": null, "chosen": "auto", "on": true, "typo": "yes"})", "ds.json");
  ConfigReader r(n, diag);
  for (const char* key : {"off", "unset", "chosen", "absent"}) r.reject_if_true(key, "use X");
  expect_config_error([&] { r.reject_if_true("on", "use X"); }, {"ds.json", "'on'", "not supported", "use X"});
  expect_config_error([&] { r.reject_if_true("typo", "use X"); }, {"ds.json", "'typo'", "expected a boolean"});
  r.finish();  // every key was read
  EXPECT_TRUE(diag.warnings.empty());
}

TEST(Reader, FinishNamesTheUnknownKeyAndTheNearest) {
  ConfigDiagnostics diag;
  const ConfigNode n = parse_json_text(R"({"opt": {"factr": 2}})", "ds.json");
  ConfigReader r(*n.find("opt"), diag);
  r.get<double>("factor", 1.0);
  r.get<int>("window", 1);
  expect_config_error([&] { r.finish(); }, {"ds.json", "'opt.factr'", "did you mean 'factor'?"});
}

TEST(Reader, FinishListsValidKeysWhenNothingIsNear) {
  ConfigDiagnostics diag;
  const ConfigNode n = parse_json_text(R"({"zzzzzzzz": 2})", "ds.json");
  ConfigReader r(n, diag);
  r.get<double>("factor", 1.0);
  r.get<int>("window", 1);
  expect_config_error([&] { r.finish(); }, {"'zzzzzzzz'", "valid keys here: factor, window"});
}

TEST(Reader, TrailingSpaceKeyIsExplained) {
  ConfigDiagnostics diag;
  const ConfigNode n = parse_json_text(R"({"gradient_accumulation_steps ": 2})", "ds.json");
  ConfigReader r(n, diag);
  r.get<int>("gradient_accumulation_steps", 1);
  expect_config_error([&] { r.finish(); }, {"'gradient_accumulation_steps '", "did you mean 'gradient_accumulation_steps'?",
                                            "spaces or letter case"});
}

TEST(Reader, NullIsEmptyAndNonObjectIsAnError) {
  ConfigDiagnostics diag;
  ConfigReader r(ConfigNode::null(), diag);
  EXPECT_EQ(r.get<int>("x", 3), 3);
  r.finish();
  expect_config_error([&] { ConfigReader bad(ConfigNode::number(1, "ds.json", "fp16"), diag); },
                      {"ds.json", "'fp16'", "expected an object"});
}
