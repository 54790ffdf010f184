#include "data/chat_template.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>

#include "data/tokenizer_config.h"
#include "data/utf8.h"
#include "memrt/error.h"

namespace memrt {

namespace {

// ---- values: Python's, as Jinja sees them ------------------------------------------------------

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // insertion order, as Python's dict
using Args = std::vector<Value>;
using Kwargs = std::vector<std::pair<std::string, Value>>;

struct Value {
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kStr, kList, kDict, kNamespace, kFunc };
  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::shared_ptr<List> list;  // lists and tuples (shared, as Python's references)
  std::shared_ptr<Dict> dict;  // dicts and namespaces
  std::shared_ptr<std::function<Value(Args&, Kwargs&)>> fn;

  static Value none() { return make(Kind::kNone); }
  static Value boolean(bool v) {
    Value x = make(Kind::kBool);
    x.b = v;
    return x;
  }
  static Value integer(int64_t v) {
    Value x = make(Kind::kInt);
    x.i = v;
    return x;
  }
  static Value real(double v) {
    Value x = make(Kind::kFloat);
    x.f = v;
    return x;
  }
  static Value str(std::string v) {
    Value x = make(Kind::kStr);
    x.s = std::move(v);
    return x;
  }
  static Value of_list(List v = {}) {
    Value x = make(Kind::kList);
    x.list = std::make_shared<List>(std::move(v));
    return x;
  }
  static Value of_dict(Dict v = {}, Kind kind = Kind::kDict) {
    Value x = make(kind);
    x.dict = std::make_shared<Dict>(std::move(v));
    return x;
  }
  static Value func(std::function<Value(Args&, Kwargs&)> f) {
    Value x = make(Kind::kFunc);
    x.fn = std::make_shared<std::function<Value(Args&, Kwargs&)>>(std::move(f));
    return x;
  }
  static Value make(Kind k) {
    Value x;
    x.kind = k;
    return x;
  }

  bool defined() const { return kind != Kind::kUndefined; }
  bool is_number() const { return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool; }
  double number() const { return kind == Kind::kFloat ? f : kind == Kind::kInt ? static_cast<double>(i) : b; }
  bool truthy() const {
    switch (kind) {
      case Kind::kUndefined:
      case Kind::kNone:
        return false;
      case Kind::kBool:
        return b;
      case Kind::kInt:
        return i != 0;
      case Kind::kFloat:
        return f != 0;
      case Kind::kStr:
        return !s.empty();
      case Kind::kList:
        return !list->empty();
      case Kind::kDict:
        return !dict->empty();
      default:
        return true;
    }
  }
  const Value* member(const std::string& key) const {
    if (!dict) return nullptr;
    for (const auto& [k, v] : *dict)
      if (k == key) return &v;
    return nullptr;
  }
};

const char* kind_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "undefined";
    case Value::Kind::kNone: return "none";
    case Value::Kind::kBool: return "a boolean";
    case Value::Kind::kInt: return "an integer";
    case Value::Kind::kFloat: return "a float";
    case Value::Kind::kStr: return "a string";
    case Value::Kind::kList: return "a list";
    case Value::Kind::kDict: return "a dict";
    case Value::Kind::kNamespace: return "a namespace";
    case Value::Kind::kFunc: return "a function";
  }
  return "?";
}

Value from_json(const rapidjson::Value& j) {
  if (j.IsNull()) return Value::none();
  if (j.IsBool()) return Value::boolean(j.GetBool());
  if (j.IsInt64()) return Value::integer(j.GetInt64());
  if (j.IsNumber()) return Value::real(j.GetDouble());
  if (j.IsString()) return Value::str(std::string(j.GetString(), j.GetStringLength()));
  if (j.IsArray()) {
    List l;
    for (const auto& x : j.GetArray()) l.push_back(from_json(x));
    return Value::of_list(std::move(l));
  }
  Dict d;
  for (const auto& m : j.GetObject()) d.emplace_back(std::string(m.name.GetString(), m.name.GetStringLength()), from_json(m.value));
  return Value::of_dict(std::move(d));
}

// Python's repr of a float: the shortest text that reads back, with ".0" when it looks integral.
std::string float_text(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, r.ptr);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

std::string repr(const Value& v);

// str(v), as Jinja prints a value.
std::string text(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "";
    case Value::Kind::kNone: return "None";
    case Value::Kind::kBool: return v.b ? "True" : "False";
    case Value::Kind::kInt: return std::to_string(v.i);
    case Value::Kind::kFloat: return float_text(v.f);
    case Value::Kind::kStr: return v.s;
    default: return repr(v);
  }
}

std::string quote_py(const std::string& s) {
  const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    if (c == q || c == '\\') out += '\\';
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else out += c;
  }
  return out + q;
}

std::string repr(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kStr:
      return quote_py(v.s);
    case Value::Kind::kList: {
      std::string out = "[";
      for (size_t k = 0; k < v.list->size(); ++k) out += (k ? ", " : "") + repr((*v.list)[k]);
      return out + "]";
    }
    case Value::Kind::kDict: {
      std::string out = "{";
      for (size_t k = 0; k < v.dict->size(); ++k)
        out += (k ? ", " : "") + quote_py((*v.dict)[k].first) + ": " + repr((*v.dict)[k].second);
      return out + "}";
    }
    case Value::Kind::kNamespace:
      return "<Namespace>";
    case Value::Kind::kFunc:
      return "<function>";
    default:
      return text(v);
  }
}

// json.dumps(v, ensure_ascii=False, indent=indent) with Python's default separators.
void to_json(const Value& v, std::string& out, int indent, int depth) {
  auto newline = [&](int d) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent * d), ' ');
  };
  const char* item_sep = indent < 0 ? ", " : ",";
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      out += "null";
      return;
    case Value::Kind::kBool:
      out += v.b ? "true" : "false";
      return;
    case Value::Kind::kInt:
      out += std::to_string(v.i);
      return;
    case Value::Kind::kFloat:
      out += std::isfinite(v.f) ? float_text(v.f) : std::isnan(v.f) ? "NaN" : v.f > 0 ? "Infinity" : "-Infinity";
      return;
    case Value::Kind::kStr: {
      out += '"';
      for (unsigned char c : v.s) {
        switch (c) {
          case '"': out += "\\\""; break;
          case '\\': out += "\\\\"; break;
          case '\n': out += "\\n"; break;
          case '\r': out += "\\r"; break;
          case '\t': out += "\\t"; break;
          case '\b': out += "\\b"; break;
          case '\f': out += "\\f"; break;
          default:
            if (c < 0x20) {
              char buf[8];
              std::snprintf(buf, sizeof buf, "\\u%04x", c);
              out += buf;
            } else {
              out += static_cast<char>(c);
            }
        }
      }
      out += '"';
      return;
    }
    case Value::Kind::kList:
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += item_sep;
        newline(depth + 1);
        to_json((*v.list)[k], out, indent, depth + 1);
      }
      newline(depth);
      out += ']';
      return;
    case Value::Kind::kDict:
    case Value::Kind::kNamespace:
      if (v.dict->empty()) {
        out += "{}";
        return;
      }
      out += '{';
      for (size_t k = 0; k < v.dict->size(); ++k) {
        if (k) out += item_sep;
        newline(depth + 1);
        to_json(Value::str((*v.dict)[k].first), out, indent, depth + 1);
        out += ": ";
        to_json((*v.dict)[k].second, out, indent, depth + 1);
      }
      newline(depth);
      out += '}';
      return;
    case Value::Kind::kFunc:
      throw Error("tojson: a function is not JSON");
  }
}

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return a.number() == b.number();
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kStr:
      return a.s == b.s;
    case Value::Kind::kList:
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equal((*a.list)[k], (*b.list)[k])) return false;
      return true;
    case Value::Kind::kDict:
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [key, value] : *a.dict) {
        const Value* other = b.member(key);
        if (!other || !equal(value, *other)) return false;
      }
      return true;
    default:
      return a.dict == b.dict && a.fn == b.fn;
  }
}

// ---- the template's text, tags and expression tokens ------------------------------------------

struct Token {
  enum class Type { kName, kString, kInt, kFloat, kOp, kEnd };
  Type type = Type::kEnd;
  std::string text;
  int line = 0;
};

struct Piece {
  enum class Type { kText, kOutput, kStatement };
  Type type;
  std::string text;        // kText
  std::vector<Token> tokens;  // kOutput, kStatement (ending with kEnd)
  int line;
};

class TemplateError : public std::runtime_error {
 public:
  TemplateError(int line, const std::string& what) : std::runtime_error(what), line(line) {}
  int line;
};

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::vector<Token> lex_expression(const std::string& src, size_t begin, size_t end, int line) {
  std::vector<Token> out;
  size_t p = begin;
  while (p < end) {
    const char c = src[p];
    if (is_space(c)) {
      line += c == '\n';
      ++p;
      continue;
    }
    Token t;
    t.line = line;
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t q = p;
      while (q < end && (std::isalnum(static_cast<unsigned char>(src[q])) || src[q] == '_')) ++q;
      t.type = Token::Type::kName;
      t.text = src.substr(p, q - p);
      p = q;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t q = p;
      while (q < end && (std::isdigit(static_cast<unsigned char>(src[q])) || src[q] == '_')) ++q;
      t.type = Token::Type::kInt;
      if (q + 1 < end && src[q] == '.' && std::isdigit(static_cast<unsigned char>(src[q + 1]))) {
        ++q;
        while (q < end && std::isdigit(static_cast<unsigned char>(src[q]))) ++q;
        t.type = Token::Type::kFloat;
      }
      if (q < end && (src[q] == 'e' || src[q] == 'E')) {
        size_t r = q + 1;
        if (r < end && (src[r] == '+' || src[r] == '-')) ++r;
        if (r < end && std::isdigit(static_cast<unsigned char>(src[r]))) {
          while (r < end && std::isdigit(static_cast<unsigned char>(src[r]))) ++r;
          q = r;
          t.type = Token::Type::kFloat;
        }
      }
      t.text = src.substr(p, q - p);
      t.text.erase(std::remove(t.text.begin(), t.text.end(), '_'), t.text.end());
      p = q;
    } else if (c == '\'' || c == '"') {
      std::string s;
      size_t q = p + 1;
      for (; q < end && src[q] != c; ++q) {
        if (src[q] == '\n') ++line;
        if (src[q] != '\\' || q + 1 >= end) {
          s += src[q];
          continue;
        }
        const char e = src[++q];
        switch (e) {
          case 'n': s += '\n'; break;
          case 't': s += '\t'; break;
          case 'r': s += '\r'; break;
          case '0': s += '\0'; break;
          case '\\': s += '\\'; break;
          case '\'': s += '\''; break;
          case '"': s += '"'; break;
          case '\n': break;
          case 'x':
          case 'u':
          case 'U': {
            const size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            if (q + n >= end) throw TemplateError(line, "a \\" + std::string(1, e) + " escape is cut short");
            const uint32_t cp = static_cast<uint32_t>(std::stoul(src.substr(q + 1, n), nullptr, 16));
            q += n;
            if (cp < 0x80) {
              s += static_cast<char>(cp);
            } else if (cp < 0x800) {
              s += static_cast<char>(0xC0 | (cp >> 6));
              s += static_cast<char>(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
              s += static_cast<char>(0xE0 | (cp >> 12));
              s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
              s += static_cast<char>(0x80 | (cp & 0x3F));
            } else {
              s += static_cast<char>(0xF0 | (cp >> 18));
              s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
              s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
              s += static_cast<char>(0x80 | (cp & 0x3F));
            }
            break;
          }
          default:
            s += '\\';
            s += e;
        }
      }
      if (q >= end) throw TemplateError(t.line, "a string literal is not closed");
      t.type = Token::Type::kString;
      t.text = std::move(s);
      p = q + 1;
    } else {
      static const char* const kOps[] = {"//", "**", "==", "!=", "<=", ">=", "(", ")", "[", "]", "{", "}", ",", ":",
                                         ".",  "|",  "+",  "-",  "*",  "/",  "%", "~", "<", ">", "="};
      t.type = Token::Type::kOp;
      for (const char* op : kOps) {
        const size_t n = std::char_traits<char>::length(op);
        if (src.compare(p, n, op) == 0) {
          t.text = op;
          break;
        }
      }
      if (t.text.empty()) throw TemplateError(line, std::string("unexpected character '") + c + "'");
      p += t.text.size();
    }
    out.push_back(std::move(t));
  }
  Token e;
  e.line = line;
  out.push_back(e);
  return out;
}

// Splits the source into text, {{ output }} and {% statement %} pieces, applying the whitespace
// control transformers' environment sets, as Jinja's lexer does: trim_blocks (a block or comment
// tag takes the newline after it), lstrip_blocks (the spaces and tabs before one, when only they
// stand between it and the start of its line), and the tags' own - and +.
std::vector<Piece> split_template(const std::string& src) {
  std::vector<Piece> pieces;
  int line = 1;
  size_t p = 0;
  enum class After { kNothing, kNewline, kWhitespace } after = After::kNothing;
  bool line_starting = true;  // the next text starts a line (the template's start, or a consumed newline)
  for (;;) {
    size_t open = p;
    for (;;) {
      open = src.find('{', open);
      if (open == std::string::npos || open + 1 >= src.size()) {
        open = std::string::npos;
        break;
      }
      const char k = src[open + 1];
      if (k == '{' || k == '%' || k == '#') break;
      ++open;
    }
    const size_t text_end = open == std::string::npos ? src.size() : open;
    std::string t = src.substr(p, text_end - p);
    const int text_line = line;
    line += static_cast<int>(std::count(t.begin(), t.end(), '\n'));
    if (after == After::kWhitespace) {
      size_t k = 0;
      while (k < t.size() && is_space(t[k])) ++k;
      line_starting = k > 0 && t[k - 1] == '\n';
      t.erase(0, k);
    } else if (after == After::kNewline) {
      const size_t n = t.compare(0, 1, "\n") == 0 ? 1 : t.compare(0, 2, "\r\n") == 0 ? 2 : 0;
      line_starting = n > 0;
      t.erase(0, n);
    } else if (p > 0) {
      line_starting = false;
    }
    if (open == std::string::npos) {
      if (!t.empty()) pieces.push_back(Piece{Piece::Type::kText, std::move(t), {}, text_line});
      break;
    }
    const char kind = src[open + 1];
    size_t inner = open + 2;
    const bool strip_before = inner < src.size() && src[inner] == '-';
    const bool keep_before = inner < src.size() && src[inner] == '+';
    if (strip_before || keep_before) ++inner;
    if (strip_before) {
      size_t k = t.size();
      while (k > 0 && is_space(t[k - 1])) --k;
      t.erase(k);
    } else if (kind != '{' && !keep_before) {
      const size_t from = t.rfind('\n') == std::string::npos ? 0 : t.rfind('\n') + 1;
      const bool blanks = std::all_of(t.begin() + static_cast<std::ptrdiff_t>(from), t.end(),
                                      [](char c) { return c == ' ' || c == '\t'; });
      if ((from > 0 || line_starting) && blanks) t.erase(from);
    }
    if (!t.empty()) pieces.push_back(Piece{Piece::Type::kText, std::move(t), {}, text_line});
    const std::string close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    size_t end = src.find(close, inner);
    if (kind != '#') {  // a closing delimiter inside a string literal does not close the tag
      size_t q = inner;
      char quote = 0;
      for (; q + 1 < src.size(); ++q) {
        if (quote) {
          if (src[q] == '\\') ++q;
          else if (src[q] == quote) quote = 0;
        } else if (src[q] == '\'' || src[q] == '"') {
          quote = src[q];
        } else if (src.compare(q, 2, close) == 0) {
          break;
        }
      }
      end = q + 1 < src.size() ? q : std::string::npos;
    }
    if (end == std::string::npos)
      throw TemplateError(line, std::string("a '{") + kind + "' tag is not closed with '" + close + "'");
    size_t body_end = end;
    const bool strip_after = body_end > inner && src[body_end - 1] == '-';
    const bool keep_after = body_end > inner && src[body_end - 1] == '+';
    if (strip_after || keep_after) --body_end;
    const int tag_line = line;
    line += static_cast<int>(std::count(src.begin() + static_cast<std::ptrdiff_t>(open),
                                        src.begin() + static_cast<std::ptrdiff_t>(end), '\n'));
    if (kind != '#')
      pieces.push_back(Piece{kind == '{' ? Piece::Type::kOutput : Piece::Type::kStatement, "",
                             lex_expression(src, inner, body_end, tag_line), tag_line});
    after = strip_after ? After::kWhitespace : !keep_after && kind != '{' ? After::kNewline : After::kNothing;
    p = end + 2;
  }
  return pieces;
}

// ---- syntax -----------------------------------------------------------------------------------

struct Expr {
  enum class Type { kLiteral, kName, kAttr, kItem, kSlice, kCall, kFilter, kTest, kUnary, kBinary, kCond, kList, kDict };
  Type type;
  int line = 0;
  Value literal;
  std::string name;  // kName, kAttr, kFilter, kTest, kUnary/kBinary operator
  std::vector<std::unique_ptr<Expr>> args;  // operands, call and filter arguments, list items
  std::vector<std::pair<std::string, std::unique_ptr<Expr>>> kwargs;
  bool negated = false;  // kTest: "is not"
};
using ExprPtr = std::unique_ptr<Expr>;

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

struct Node {
  enum class Type { kText, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kGeneration, kBreak, kContinue };
  Type type;
  int line = 0;
  std::string text;                      // kText
  ExprPtr expr;                          // kOutput, kFor's iterable, kSet's value
  std::vector<std::pair<ExprPtr, Body>> branches;  // kIf: (condition, body)...; else: null condition
  std::vector<std::string> targets;      // kFor, kSet, kSetBlock: names; kSet on "ns.attr": {"ns", "attr"} with attr set
  bool attribute_target = false;         // kSet: targets[0].targets[1] = value
  ExprPtr filter;                        // kFor's "if"
  Body body, else_body;
  std::string macro_name;                // kMacro
  std::vector<std::pair<std::string, ExprPtr>> params;  // kMacro: name, default (or null)
};

class Parser {
 public:
  Parser(std::vector<Piece> pieces) : pieces_(std::move(pieces)) {}

  bool saw_generation() const { return generation_; }

  Body parse_all() {
    Body body = parse_body({});
    if (at_ < pieces_.size()) throw TemplateError(pieces_[at_].line, "unexpected '" + tag_name(pieces_[at_]) + "'");
    return body;
  }

 private:
  std::vector<Piece> pieces_;
  size_t at_ = 0;
  bool generation_ = false;
  const std::vector<Token>* toks_ = nullptr;
  size_t t_ = 0;

  static std::string tag_name(const Piece& p) { return p.tokens.empty() ? "" : p.tokens[0].text; }

  // Statements until one whose name is in `ends` (left unconsumed) or the end of the template.
  Body parse_body(const std::vector<std::string>& ends) {
    Body body;
    while (at_ < pieces_.size()) {
      Piece& p = pieces_[at_];
      if (p.type == Piece::Type::kText) {
        auto n = std::make_unique<Node>();
        n->type = Node::Type::kText;
        n->text = p.text;
        n->line = p.line;
        body.push_back(std::move(n));
        ++at_;
        continue;
      }
      begin(p);
      if (p.type == Piece::Type::kOutput) {
        auto n = std::make_unique<Node>();
        n->type = Node::Type::kOutput;
        n->line = p.line;
        n->expr = expression();
        finish();
        body.push_back(std::move(n));
        ++at_;
        continue;
      }
      const Token& head = peek();
      if (head.type != Token::Type::kName) throw TemplateError(p.line, "a statement must start with its name");
      if (std::find(ends.begin(), ends.end(), head.text) != ends.end()) return body;
      ++at_;
      body.push_back(statement(p));
    }
    if (!ends.empty()) throw TemplateError(pieces_.empty() ? 1 : pieces_.back().line, "missing {% " + ends.back() + " %}");
    return body;
  }

  // The piece at_ (a statement) must be `name`; consumes it.
  void expect_tag(const std::string& name) {
    if (at_ >= pieces_.size()) throw TemplateError(pieces_.back().line, "missing {% " + name + " %}");
    Piece& p = pieces_[at_];
    begin(p);
    if (take().text != name) throw TemplateError(p.line, "expected {% " + name + " %}");
    finish();
    ++at_;
  }

  std::unique_ptr<Node> statement(Piece& p) {
    const std::string name = take().text;
    auto n = std::make_unique<Node>();
    n->line = p.line;
    if (name == "if") {
      n->type = Node::Type::kIf;
      ExprPtr cond = expression();
      finish();
      for (;;) {
        Body b = parse_body({"elif", "else", "endif"});
        n->branches.emplace_back(std::move(cond), std::move(b));
        Piece& q = pieces_[at_];
        begin(q);
        const std::string which = take().text;
        ++at_;
        if (which == "elif") {
          cond = expression();
          finish();
          continue;
        }
        finish();
        if (which == "else") {
          n->branches.emplace_back(nullptr, parse_body({"endif"}));
          expect_tag("endif");
        }
        break;
      }
    } else if (name == "for") {
      n->type = Node::Type::kFor;
      do n->targets.push_back(take_name());
      while (accept(","));
      if (take_name() != "in") throw TemplateError(p.line, "expected 'in' in a for loop");
      n->expr = conditional(/*allow_if=*/false);
      if (accept_name("if")) n->filter = conditional(false);
      if (accept_name("recursive")) throw TemplateError(p.line, "recursive for loops are not supported");
      finish();
      n->body = parse_body({"else", "endfor"});
      Piece& q = pieces_[at_];
      begin(q);
      const std::string which = take().text;
      finish();
      ++at_;
      if (which == "else") {
        n->else_body = parse_body({"endfor"});
        expect_tag("endfor");
      }
    } else if (name == "set") {
      const std::string first = take_name();
      if (accept(".")) {
        n->targets = {first, take_name()};
        n->attribute_target = true;
      } else {
        n->targets = {first};
        while (accept(",")) n->targets.push_back(take_name());
      }
      if (accept("=")) {
        n->type = Node::Type::kSet;
        n->expr = expression();
        finish();
      } else {
        if (n->targets.size() != 1 || n->attribute_target) throw TemplateError(p.line, "a {% set %} block names one variable");
        finish();
        n->type = Node::Type::kSetBlock;
        n->body = parse_body({"endset"});
        expect_tag("endset");
      }
    } else if (name == "macro") {
      n->type = Node::Type::kMacro;
      n->macro_name = take_name();
      expect("(");
      if (!accept(")")) {
        do {
          std::string param = take_name();
          ExprPtr def = accept("=") ? expression() : nullptr;
          n->params.emplace_back(std::move(param), std::move(def));
        } while (accept(","));
        expect(")");
      }
      finish();
      n->body = parse_body({"endmacro"});
      expect_tag("endmacro");
    } else if (name == "generation") {
      generation_ = true;
      n->type = Node::Type::kGeneration;
      finish();
      n->body = parse_body({"endgeneration"});
      expect_tag("endgeneration");
    } else if (name == "break" || name == "continue") {
      n->type = name == "break" ? Node::Type::kBreak : Node::Type::kContinue;
      finish();
    } else {
      throw TemplateError(p.line, "the statement {% " + name + " %} is not supported by memrt's chat template "
                                  "interpreter (supported: if, for, set, macro, generation, break, continue)");
    }
    return n;
  }

  // ---- expression tokens ----
  void begin(const Piece& p) {
    toks_ = &p.tokens;
    t_ = 0;
  }
  const Token& peek(size_t ahead = 0) const { return (*toks_)[std::min(t_ + ahead, toks_->size() - 1)]; }
  const Token& take() {
    const Token& t = peek();
    if (t.type == Token::Type::kEnd) throw TemplateError(t.line, "the tag ends too early");
    ++t_;
    return t;
  }
  bool is_op(const std::string& op, size_t ahead = 0) const {
    return peek(ahead).type == Token::Type::kOp && peek(ahead).text == op;
  }
  bool is_name(const std::string& n, size_t ahead = 0) const {
    return peek(ahead).type == Token::Type::kName && peek(ahead).text == n;
  }
  bool accept(const std::string& op) {
    if (!is_op(op)) return false;
    ++t_;
    return true;
  }
  bool accept_name(const std::string& n) {
    if (!is_name(n)) return false;
    ++t_;
    return true;
  }
  void expect(const std::string& op) {
    if (!accept(op)) throw TemplateError(peek().line, "expected '" + op + "', found '" + peek().text + "'");
  }
  std::string take_name() {
    const Token& t = take();
    if (t.type != Token::Type::kName) throw TemplateError(t.line, "expected a name, found '" + t.text + "'");
    return t.text;
  }
  void finish() {
    if (peek().type != Token::Type::kEnd) throw TemplateError(peek().line, "unexpected '" + peek().text + "'");
  }

  ExprPtr node(Expr::Type type, int line) {
    auto e = std::make_unique<Expr>();
    e->type = type;
    e->line = line;
    return e;
  }
  ExprPtr binary(const std::string& op, ExprPtr a, ExprPtr b) {
    ExprPtr e = node(Expr::Type::kBinary, a->line);
    e->name = op;
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return e;
  }

  ExprPtr expression() { return conditional(true); }

  ExprPtr conditional(bool allow_if) {
    ExprPtr e = or_expr();
    while (allow_if && is_name("if")) {
      ++t_;
      ExprPtr cond = or_expr();
      ExprPtr other = accept_name("else") ? conditional(true) : nullptr;
      ExprPtr c = node(Expr::Type::kCond, e->line);
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(cond));
      c->args.push_back(std::move(other));
      e = std::move(c);
    }
    return e;
  }
  ExprPtr or_expr() {
    ExprPtr e = and_expr();
    while (accept_name("or")) e = binary("or", std::move(e), and_expr());
    return e;
  }
  ExprPtr and_expr() {
    ExprPtr e = not_expr();
    while (accept_name("and")) e = binary("and", std::move(e), not_expr());
    return e;
  }
  ExprPtr not_expr() {
    if (is_name("not")) {
      const int line = take().line;
      ExprPtr e = node(Expr::Type::kUnary, line);
      e->name = "not";
      e->args.push_back(not_expr());
      return e;
    }
    return compare();
  }
  ExprPtr compare() {
    ExprPtr e = math1();
    for (;;) {
      std::string op;
      if (peek().type == Token::Type::kOp &&
          (is_op("==") || is_op("!=") || is_op("<") || is_op(">") || is_op("<=") || is_op(">="))) {
        op = take().text;
      } else if (is_name("in")) {
        ++t_;
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        t_ += 2;
        op = "not in";
      } else {
        return e;
      }
      e = binary(op, std::move(e), math1());
    }
  }
  ExprPtr math1() {
    ExprPtr e = concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = take().text;
      e = binary(op, std::move(e), concat());
    }
    return e;
  }
  ExprPtr concat() {
    ExprPtr e = math2();
    while (accept("~")) e = binary("~", std::move(e), math2());
    return e;
  }
  ExprPtr math2() {
    ExprPtr e = power();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = take().text;
      e = binary(op, std::move(e), power());
    }
    return e;
  }
  ExprPtr power() {
    ExprPtr e = unary(true);
    while (accept("**")) e = binary("**", std::move(e), unary(true));
    return e;
  }
  ExprPtr unary(bool with_filter) {
    if (is_op("-") || is_op("+")) {
      const Token& t = take();
      ExprPtr e = node(Expr::Type::kUnary, t.line);
      e->name = t.text;
      e->args.push_back(unary(false));
      return with_filter ? filters(std::move(e)) : std::move(e);
    }
    ExprPtr e = postfix(primary());
    return with_filter ? filters(std::move(e)) : std::move(e);
  }
  void call_args(Expr& e) {
    if (accept(")")) return;
    do {
      if (peek().type == Token::Type::kName && is_op("=", 1)) {
        std::string key = take().text;
        ++t_;
        e.kwargs.emplace_back(std::move(key), expression());
      } else {
        e.args.push_back(expression());
      }
    } while (accept(","));
    expect(")");
  }
  ExprPtr postfix(ExprPtr e) {
    for (;;) {
      if (accept(".")) {
        ExprPtr a = node(Expr::Type::kAttr, e->line);
        a->name = take_name();
        a->args.push_back(std::move(e));
        e = std::move(a);
      } else if (is_op("[")) {
        ++t_;
        ExprPtr parts[3];
        bool slice = false;
        for (int k = 0; k < 3; ++k) {
          if (!is_op(":") && !is_op("]")) parts[k] = expression();
          if (k < 2 && accept(":")) {
            slice = true;
            continue;
          }
          break;
        }
        expect("]");
        ExprPtr s = node(slice ? Expr::Type::kSlice : Expr::Type::kItem, e->line);
        s->args.push_back(std::move(e));
        for (ExprPtr& part : parts) s->args.push_back(std::move(part));
        if (!slice) s->args.resize(2);
        e = std::move(s);
      } else if (is_op("(")) {
        ++t_;
        ExprPtr c = node(Expr::Type::kCall, e->line);
        c->args.push_back(std::move(e));
        call_args(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }
  ExprPtr filters(ExprPtr e) {
    for (;;) {
      if (accept("|")) {
        ExprPtr f = node(Expr::Type::kFilter, e->line);
        f->name = take_name();
        f->args.push_back(std::move(e));
        if (accept("(")) call_args(*f);
        e = std::move(f);
      } else if (is_name("is")) {
        ++t_;
        ExprPtr t = node(Expr::Type::kTest, e->line);
        t->negated = accept_name("not");
        t->name = take_name();
        t->args.push_back(std::move(e));
        if (accept("(")) {
          call_args(*t);
        } else {
          const Token& n = peek();
          const bool arg = (n.type == Token::Type::kString || n.type == Token::Type::kInt ||
                            n.type == Token::Type::kFloat || (n.type == Token::Type::kName && n.text != "and" &&
                                                              n.text != "or" && n.text != "else" && n.text != "if"));
          if (arg) t->args.push_back(postfix(primary()));
        }
        e = std::move(t);
      } else {
        return e;
      }
    }
  }
  ExprPtr primary() {
    const Token& t = take();
    ExprPtr e = node(Expr::Type::kLiteral, t.line);
    switch (t.type) {
      case Token::Type::kString: {
        std::string s = t.text;
        while (peek().type == Token::Type::kString) s += take().text;  // adjacent literals join
        e->literal = Value::str(std::move(s));
        return e;
      }
      case Token::Type::kInt:
        e->literal = Value::integer(std::stoll(t.text));
        return e;
      case Token::Type::kFloat:
        e->literal = Value::real(std::stod(t.text));
        return e;
      case Token::Type::kName:
        if (t.text == "true" || t.text == "True") e->literal = Value::boolean(true);
        else if (t.text == "false" || t.text == "False") e->literal = Value::boolean(false);
        else if (t.text == "none" || t.text == "None") e->literal = Value::none();
        else {
          e->type = Expr::Type::kName;
          e->name = t.text;
        }
        return e;
      case Token::Type::kOp:
        if (t.text == "(") {  // a parenthesised expression or a tuple
          if (accept(")")) {
            e->type = Expr::Type::kList;
            return e;
          }
          ExprPtr first = expression();
          if (!is_op(",")) {
            expect(")");
            return first;
          }
          e->type = Expr::Type::kList;
          e->args.push_back(std::move(first));
          while (accept(",")) {
            if (is_op(")")) break;
            e->args.push_back(expression());
          }
          expect(")");
          return e;
        }
        if (t.text == "[") {
          e->type = Expr::Type::kList;
          while (!accept("]")) {
            e->args.push_back(expression());
            if (!accept(",")) {
              expect("]");
              break;
            }
          }
          return e;
        }
        if (t.text == "{") {
          e->type = Expr::Type::kDict;
          while (!accept("}")) {
            e->args.push_back(expression());
            expect(":");
            e->args.push_back(expression());
            if (!accept(",")) {
              expect("}");
              break;
            }
          }
          return e;
        }
        break;
      default:
        break;
    }
    throw TemplateError(t.line, "unexpected '" + t.text + "' in an expression");
  }
};

}  // namespace

struct ChatTemplate::Program {
  std::string where, source;
  Body body;
  bool generation = false;
};

namespace {

// ---- evaluation -------------------------------------------------------------------------------

struct LoopControl {
  enum class Kind { kBreak, kContinue } kind;
};

class Renderer {
 public:
  Renderer(const ChatTemplate::Program& program, ChatTemplate::Rendered& out) : program_(program), out_(out) {
    scopes_.emplace_back();
    define_globals();
  }

  void run(const Body& body) { render(body); }
  std::map<std::string, Value>& globals() { return scopes_.front(); }

 private:
  const ChatTemplate::Program& program_;
  ChatTemplate::Rendered& out_;
  std::vector<std::map<std::string, Value>> scopes_;
  std::string* capture_ = nullptr;  // {% set %} blocks and macros write here instead
  int line_ = 0;

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(program_.where + ": line " + std::to_string(line_) + ": " + what);
  }

  void emit(const std::string& s) {
    if (capture_) *capture_ += s;
    else out_.text += s;
  }

  Value lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      const auto found = it->find(name);
      if (found != it->end()) return found->second;
    }
    return Value();
  }

  void define_globals() {
    auto& g = scopes_.front();
    g["raise_exception"] = Value::func([this](Args& a, Kwargs&) -> Value {
      fail("the template raised an exception: " + (a.empty() ? std::string() : text(a[0])));
    });
    g["range"] = Value::func([this](Args& a, Kwargs&) {
      int64_t start = 0, stop = 0, step = 1;
      if (a.size() == 1) stop = a[0].i;
      else if (a.size() >= 2) {
        start = a[0].i;
        stop = a[1].i;
        if (a.size() == 3) step = a[2].i;
      }
      if (step == 0) fail("range() step must not be zero");
      List l;
      for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) l.push_back(Value::integer(k));
      return Value::of_list(std::move(l));
    });
    g["namespace"] = Value::func([](Args&, Kwargs& kw) {
      Dict d;
      for (auto& [k, v] : kw) d.emplace_back(k, v);
      return Value::of_dict(std::move(d), Value::Kind::kNamespace);
    });
    g["strftime_now"] = Value::func([](Args& a, Kwargs&) {
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof buf, a.empty() ? "" : a[0].s.c_str(), &tm);
      return Value::str(std::string(buf, n));
    });
  }

  // ---- statements ----
  void render(const Body& body) {
    for (const auto& n : body) render(*n);
  }

  void render(const Node& n) {
    line_ = n.line;
    switch (n.type) {
      case Node::Type::kText:
        emit(n.text);
        return;
      case Node::Type::kOutput:
        emit(text(eval(*n.expr)));
        return;
      case Node::Type::kIf:
        for (const auto& [cond, body] : n.branches) {
          if (!cond || eval(*cond).truthy()) {
            render(body);
            return;
          }
        }
        return;
      case Node::Type::kFor:
        render_for(n);
        return;
      case Node::Type::kSet: {
        Value v = eval(*n.expr);
        if (n.attribute_target) {
          Value ns = lookup(n.targets[0]);
          if (ns.kind != Value::Kind::kNamespace) fail("cannot set an attribute of " + std::string(kind_name(ns)) + " (" + n.targets[0] + ")");
          set_member(*ns.dict, n.targets[1], std::move(v));
        } else if (n.targets.size() == 1) {
          scopes_.back()[n.targets[0]] = std::move(v);
        } else {
          unpack(n.targets, v);
        }
        return;
      }
      case Node::Type::kSetBlock: {
        std::string captured;
        std::string* outer = capture_;
        capture_ = &captured;
        render(n.body);
        capture_ = outer;
        scopes_.back()[n.targets[0]] = Value::str(std::move(captured));
        return;
      }
      case Node::Type::kMacro:
        define_macro(n);
        return;
      case Node::Type::kGeneration: {
        if (capture_) {
          render(n.body);
          return;
        }
        const size_t start = out_.text.size();
        render(n.body);
        out_.generation.emplace_back(start, out_.text.size());
        return;
      }
      case Node::Type::kBreak:
        throw LoopControl{LoopControl::Kind::kBreak};
      case Node::Type::kContinue:
        throw LoopControl{LoopControl::Kind::kContinue};
    }
  }

  static void set_member(Dict& d, const std::string& key, Value v) {
    for (auto& [k, old] : d) {
      if (k == key) {
        old = std::move(v);
        return;
      }
    }
    d.emplace_back(key, std::move(v));
  }

  void unpack(const std::vector<std::string>& names, const Value& v) {
    if (names.size() == 1) {
      scopes_.back()[names[0]] = v;
      return;
    }
    if (v.kind != Value::Kind::kList || v.list->size() != names.size())
      fail("cannot unpack " + std::string(kind_name(v)) + " into " + std::to_string(names.size()) + " names");
    for (size_t k = 0; k < names.size(); ++k) scopes_.back()[names[k]] = (*v.list)[k];
  }

  List iterate(const Value& v) {
    switch (v.kind) {
      case Value::Kind::kList:
        return *v.list;
      case Value::Kind::kDict: {
        List keys;
        for (const auto& [k, x] : *v.dict) keys.push_back(Value::str(k));
        return keys;
      }
      case Value::Kind::kStr: {
        List chars;
        for (size_t k = 0; k < v.s.size();) {
          size_t n = 1;
          const auto c = static_cast<unsigned char>(v.s[k]);
          if (c >= 0xF0) n = 4;
          else if (c >= 0xE0) n = 3;
          else if (c >= 0xC0) n = 2;
          chars.push_back(Value::str(v.s.substr(k, n)));
          k += n;
        }
        return chars;
      }
      case Value::Kind::kUndefined:
      case Value::Kind::kNone:
        if (v.kind == Value::Kind::kUndefined) return {};
        [[fallthrough]];
      default:
        fail("cannot iterate over " + std::string(kind_name(v)));
    }
  }

  void render_for(const Node& n) {
    List items = iterate(eval(*n.expr));
    if (n.filter) {  // the loop's own "if" filters before loop.* counts
      List kept;
      for (Value& item : items) {
        scopes_.emplace_back();
        unpack(n.targets, item);
        const bool keep = eval(*n.filter).truthy();
        scopes_.pop_back();
        if (keep) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      render(n.else_body);
      return;
    }
    const auto count = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < count; ++k) {
      scopes_.emplace_back();
      unpack(n.targets, items[static_cast<size_t>(k)]);
      Dict loop = {{"index", Value::integer(k + 1)},
                   {"index0", Value::integer(k)},
                   {"revindex", Value::integer(count - k)},
                   {"revindex0", Value::integer(count - k - 1)},
                   {"first", Value::boolean(k == 0)},
                   {"last", Value::boolean(k == count - 1)},
                   {"length", Value::integer(count)},
                   {"previtem", k > 0 ? items[static_cast<size_t>(k - 1)] : Value()},
                   {"nextitem", k + 1 < count ? items[static_cast<size_t>(k + 1)] : Value()}};
      scopes_.back()["loop"] = Value::of_dict(std::move(loop));
      bool stop = false;
      try {
        render(n.body);
      } catch (const LoopControl& c) {
        stop = c.kind == LoopControl::Kind::kBreak;
      }
      scopes_.pop_back();
      if (stop) break;
    }
  }

  void define_macro(const Node& n) {
    const Node* def = &n;
    scopes_.back()[n.macro_name] = Value::func([this, def](Args& a, Kwargs& kw) {
      scopes_.emplace_back();
      for (size_t k = 0; k < def->params.size(); ++k) {
        const auto& [name, fallback] = def->params[k];
        Value v;
        if (k < a.size()) v = a[k];
        else if (fallback) v = eval(*fallback);
        for (auto& [key, x] : kw)
          if (key == name) v = x;
        scopes_.back()[name] = v;
      }
      std::string captured;
      std::string* outer = capture_;
      capture_ = &captured;
      const int line = line_;
      try {
        render(def->body);
      } catch (...) {
        capture_ = outer;
        scopes_.pop_back();
        throw;
      }
      capture_ = outer;
      scopes_.pop_back();
      line_ = line;
      return Value::str(std::move(captured));
    });
  }

  // ---- expressions ----
  Value eval(const Expr& e) {
    switch (e.type) {
      case Expr::Type::kLiteral:
        return e.literal;
      case Expr::Type::kName:
        return lookup(e.name);
      case Expr::Type::kAttr:
        return attribute(eval(*e.args[0]), e.name);
      case Expr::Type::kItem:
        return item(eval(*e.args[0]), eval(*e.args[1]));
      case Expr::Type::kSlice:
        return slice(eval(*e.args[0]), e.args[1] ? std::optional<int64_t>(eval(*e.args[1]).i) : std::nullopt,
                     e.args[2] ? std::optional<int64_t>(eval(*e.args[2]).i) : std::nullopt,
                     e.args[3] ? std::optional<int64_t>(eval(*e.args[3]).i) : std::nullopt);
      case Expr::Type::kCall: {
        const Value f = eval(*e.args[0]);
        Args args;
        Kwargs kwargs;
        for (size_t k = 1; k < e.args.size(); ++k) args.push_back(eval(*e.args[k]));
        for (const auto& [key, x] : e.kwargs) kwargs.emplace_back(key, eval(*x));
        if (f.kind != Value::Kind::kFunc)
          fail(std::string("cannot call ") + kind_name(f) +
               (e.args[0]->type == Expr::Type::kName ? " (" + e.args[0]->name + ")" : ""));
        return (*f.fn)(args, kwargs);
      }
      case Expr::Type::kFilter: {
        Args args;
        Kwargs kwargs;
        for (size_t k = 0; k < e.args.size(); ++k) args.push_back(eval(*e.args[k]));
        for (const auto& [key, x] : e.kwargs) kwargs.emplace_back(key, eval(*x));
        return filter(e.name, args, kwargs);
      }
      case Expr::Type::kTest: {
        Args args;
        for (size_t k = 0; k < e.args.size(); ++k) args.push_back(eval(*e.args[k]));
        return Value::boolean(test(e.name, args) != e.negated);
      }
      case Expr::Type::kUnary: {
        const Value v = eval(*e.args[0]);
        if (e.name == "not") return Value::boolean(!v.truthy());
        if (!v.is_number()) fail("unary " + e.name + " on " + kind_name(v));
        if (e.name == "+") return v;
        return v.kind == Value::Kind::kFloat ? Value::real(-v.f) : Value::integer(-static_cast<int64_t>(v.number()));
      }
      case Expr::Type::kBinary:
        return binary(e);
      case Expr::Type::kCond:
        if (eval(*e.args[1]).truthy()) return eval(*e.args[0]);
        return e.args[2] ? eval(*e.args[2]) : Value();
      case Expr::Type::kList: {
        List l;
        for (const auto& x : e.args) l.push_back(eval(*x));
        return Value::of_list(std::move(l));
      }
      case Expr::Type::kDict: {
        Dict d;
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) set_member(d, text(eval(*e.args[k])), eval(*e.args[k + 1]));
        return Value::of_dict(std::move(d));
      }
    }
    return Value();
  }

  Value binary(const Expr& e) {
    const std::string& op = e.name;
    if (op == "and") {
      Value a = eval(*e.args[0]);
      return a.truthy() ? eval(*e.args[1]) : a;
    }
    if (op == "or") {
      Value a = eval(*e.args[0]);
      return a.truthy() ? a : eval(*e.args[1]);
    }
    const Value a = eval(*e.args[0]), b = eval(*e.args[1]);
    if (op == "~") return Value::str(text(a) + text(b));
    if (op == "==") return Value::boolean(equal(a, b));
    if (op == "!=") return Value::boolean(!equal(a, b));
    if (op == "in" || op == "not in") return Value::boolean(contains(b, a) == (op == "in"));
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      int c = 0;
      if (a.is_number() && b.is_number()) c = a.number() < b.number() ? -1 : a.number() > b.number() ? 1 : 0;
      else if (a.kind == Value::Kind::kStr && b.kind == Value::Kind::kStr) c = a.s.compare(b.s);
      else fail("cannot compare " + std::string(kind_name(a)) + " and " + kind_name(b) + " with " + op);
      return Value::boolean(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
    }
    if (op == "+") {
      if (a.kind == Value::Kind::kStr && b.kind == Value::Kind::kStr) return Value::str(a.s + b.s);
      if (a.kind == Value::Kind::kList && b.kind == Value::Kind::kList) {
        List l = *a.list;
        l.insert(l.end(), b.list->begin(), b.list->end());
        return Value::of_list(std::move(l));
      }
    }
    if (op == "*" && a.kind == Value::Kind::kStr && b.kind == Value::Kind::kInt) {
      std::string s;
      for (int64_t k = 0; k < b.i; ++k) s += a.s;
      return Value::str(std::move(s));
    }
    if (!a.is_number() || !b.is_number())
      fail("cannot apply " + op + " to " + kind_name(a) + " and " + kind_name(b));
    const bool ints = a.kind != Value::Kind::kFloat && b.kind != Value::Kind::kFloat;
    const double x = a.number(), y = b.number();
    if (op == "/") {
      if (y == 0) fail("division by zero");
      return Value::real(x / y);
    }
    if (op == "//" || op == "%") {
      if (y == 0) fail("division by zero");
      if (ints) {
        const auto p = static_cast<int64_t>(x), q = static_cast<int64_t>(y);
        int64_t d = p / q, m = p % q;
        if (m != 0 && ((m < 0) != (q < 0))) {
          --d;
          m += q;
        }
        return Value::integer(op == "//" ? d : m);
      }
      const double d = std::floor(x / y);
      return Value::real(op == "//" ? d : x - d * y);
    }
    if (op == "**") return ints && y >= 0 ? Value::integer(static_cast<int64_t>(std::llround(std::pow(x, y)))) : Value::real(std::pow(x, y));
    const double r = op == "+" ? x + y : op == "-" ? x - y : x * y;
    return ints ? Value::integer(static_cast<int64_t>(r)) : Value::real(r);
  }

  bool contains(const Value& haystack, const Value& needle) {
    switch (haystack.kind) {
      case Value::Kind::kStr:
        if (needle.kind != Value::Kind::kStr) fail("'in <string>' needs a string on the left");
        return haystack.s.find(needle.s) != std::string::npos;
      case Value::Kind::kList:
        return std::any_of(haystack.list->begin(), haystack.list->end(), [&](const Value& v) { return equal(v, needle); });
      case Value::Kind::kDict:
      case Value::Kind::kNamespace:
        return needle.kind == Value::Kind::kStr && haystack.member(needle.s) != nullptr;
      case Value::Kind::kUndefined:
        return false;
      default:
        fail(std::string("cannot look inside ") + kind_name(haystack) + " with 'in'");
    }
  }

  Value item(const Value& v, const Value& key) {
    if (v.kind == Value::Kind::kList || v.kind == Value::Kind::kStr) {
      if (!key.is_number()) return Value();
      const auto size = static_cast<int64_t>(v.kind == Value::Kind::kList ? v.list->size() : v.s.size());
      int64_t k = static_cast<int64_t>(key.number());
      if (k < 0) k += size;
      if (k < 0 || k >= size) return Value();
      return v.kind == Value::Kind::kList ? (*v.list)[static_cast<size_t>(k)] : Value::str(v.s.substr(static_cast<size_t>(k), 1));
    }
    if (v.kind == Value::Kind::kDict || v.kind == Value::Kind::kNamespace) {
      const Value* m = v.member(text(key));
      return m ? *m : Value();
    }
    if (!v.defined()) fail("cannot index an undefined value");
    return Value();
  }

  Value slice(const Value& v, std::optional<int64_t> start, std::optional<int64_t> stop, std::optional<int64_t> step) {
    List src;
    if (v.kind == Value::Kind::kList) src = *v.list;
    else if (v.kind == Value::Kind::kStr) src = iterate(v);
    else fail(std::string("cannot slice ") + kind_name(v));
    const auto n = static_cast<int64_t>(src.size());
    const int64_t s = step.value_or(1);
    if (s == 0) fail("slice step cannot be zero");
    auto clamp = [&](std::optional<int64_t> x, int64_t dflt) {
      if (!x) return dflt;
      int64_t k = *x < 0 ? *x + n : *x;
      return s > 0 ? std::clamp<int64_t>(k, 0, n) : std::clamp<int64_t>(k, -1, n - 1);
    };
    const int64_t from = clamp(start, s > 0 ? 0 : n - 1), to = clamp(stop, s > 0 ? n : -1);
    List out;
    for (int64_t k = from; s > 0 ? k < to : k > to; k += s) out.push_back(src[static_cast<size_t>(k)]);
    if (v.kind == Value::Kind::kList) return Value::of_list(std::move(out));
    std::string joined;
    for (const Value& c : out) joined += c.s;
    return Value::str(std::move(joined));
  }

  // Attributes: a dict's keys, loop.*, and the str/dict/list methods templates call.
  Value attribute(const Value& v, const std::string& name) {
    if (v.kind == Value::Kind::kDict || v.kind == Value::Kind::kNamespace) {
      if (const Value* m = v.member(name)) return *m;
      if (v.kind == Value::Kind::kDict) {
        if (name == "items")
          return Value::func([v](Args&, Kwargs&) {
            List l;
            for (const auto& [k, x] : *v.dict) l.push_back(Value::of_list({Value::str(k), x}));
            return Value::of_list(std::move(l));
          });
        if (name == "keys" || name == "values")
          return Value::func([v, name](Args&, Kwargs&) {
            List l;
            for (const auto& [k, x] : *v.dict) l.push_back(name == "keys" ? Value::str(k) : x);
            return Value::of_list(std::move(l));
          });
        if (name == "get")
          return Value::func([v](Args& a, Kwargs&) {
            const Value* m = a.empty() ? nullptr : v.member(text(a[0]));
            return m ? *m : a.size() > 1 ? a[1] : Value::none();
          });
      }
      return Value();
    }
    if (v.kind == Value::Kind::kStr) return string_method(v.s, name);
    if (v.kind == Value::Kind::kList && name == "append")
      return Value::func([v](Args& a, Kwargs&) {
        if (!a.empty()) v.list->push_back(a[0]);
        return Value::none();
      });
    if (!v.defined()) fail("'" + name + "' of an undefined value");
    return Value();
  }

  // Python's str.strip(chars) (chars ASCII); without chars, python_strip.
  static std::string strip(const std::string& s, const std::string& chars, bool left, bool right) {
    if (chars.empty()) return python_strip(s, left, right);
    size_t b = 0, e = s.size();
    if (left)
      while (b < e && chars.find(s[b]) != std::string::npos) ++b;
    if (right)
      while (e > b && chars.find(s[e - 1]) != std::string::npos) --e;
    return s.substr(b, e - b);
  }

  Value string_method(const std::string& s, const std::string& name) {
    auto method = [](std::function<Value(Args&)> f) {
      return Value::func([f](Args& a, Kwargs&) { return f(a); });
    };
    auto arg = [](Args& a, size_t k) { return k < a.size() && a[k].kind == Value::Kind::kStr ? a[k].s : std::string(); };
    if (name == "strip" || name == "lstrip" || name == "rstrip")
      return method([s, name, arg](Args& a) {
        return Value::str(strip(s, arg(a, 0), name != "rstrip", name != "lstrip"));
      });
    if (name == "upper" || name == "lower")
      return method([s, name](Args&) {
        std::string r = s;
        for (char& c : r) c = static_cast<char>(name == "upper" ? std::toupper(static_cast<unsigned char>(c))
                                                                : std::tolower(static_cast<unsigned char>(c)));
        return Value::str(r);
      });
    if (name == "startswith" || name == "endswith")
      return method([s, name, this](Args& a) {
        List options = a.empty() ? List{} : a[0].kind == Value::Kind::kList ? *a[0].list : List{a[0]};
        for (const Value& o : options) {
          if (o.kind != Value::Kind::kStr) fail(name + "() takes strings");
          const bool hit = name == "startswith" ? s.compare(0, o.s.size(), o.s) == 0
                                                : s.size() >= o.s.size() && s.compare(s.size() - o.s.size(), o.s.size(), o.s) == 0;
          if (hit) return Value::boolean(true);
        }
        return Value::boolean(false);
      });
    if (name == "split")
      return method([s, arg](Args& a) {
        List parts;
        const std::string sep = arg(a, 0);
        const int64_t max = a.size() > 1 ? a[1].i : -1;
        if (sep.empty()) {  // runs of whitespace
          size_t k = 0;
          while (k < s.size()) {
            while (k < s.size() && is_space(s[k])) ++k;
            if (k >= s.size()) break;
            size_t e = k;
            while (e < s.size() && !is_space(s[e])) ++e;
            parts.push_back(Value::str(s.substr(k, e - k)));
            k = e;
          }
          return Value::of_list(std::move(parts));
        }
        size_t k = 0;
        for (int64_t n = 0; max < 0 || n < max; ++n) {
          const size_t at = s.find(sep, k);
          if (at == std::string::npos) break;
          parts.push_back(Value::str(s.substr(k, at - k)));
          k = at + sep.size();
        }
        parts.push_back(Value::str(s.substr(k)));
        return Value::of_list(std::move(parts));
      });
    if (name == "replace")
      return method([s, arg](Args& a) {
        const std::string from = arg(a, 0), to = arg(a, 1);
        if (from.empty()) return Value::str(s);
        std::string r;
        size_t k = 0;
        for (size_t at; (at = s.find(from, k)) != std::string::npos; k = at + from.size()) r += s.substr(k, at - k) + to;
        return Value::str(r + s.substr(k));
      });
    if (name == "title" || name == "capitalize")
      return method([s, name, this](Args& a) {
        Args args{Value::str(s)};
        Kwargs none;
        (void)a;
        return filter(name, args, none);
      });
    fail("the string method '" + name + "' is not supported by memrt's chat template interpreter");
  }

  bool test(const std::string& name, Args& a) {
    const Value& v = a[0];
    if (name == "defined") return v.defined();
    if (name == "undefined") return !v.defined();
    if (name == "none") return v.kind == Value::Kind::kNone;
    if (name == "string") return v.kind == Value::Kind::kStr;
    if (name == "number") return v.kind == Value::Kind::kInt || v.kind == Value::Kind::kFloat;
    if (name == "integer") return v.kind == Value::Kind::kInt;
    if (name == "float") return v.kind == Value::Kind::kFloat;
    if (name == "boolean") return v.kind == Value::Kind::kBool;
    if (name == "true") return v.kind == Value::Kind::kBool && v.b;
    if (name == "false") return v.kind == Value::Kind::kBool && !v.b;
    if (name == "mapping") return v.kind == Value::Kind::kDict;
    if (name == "sequence") return v.kind == Value::Kind::kList || v.kind == Value::Kind::kStr || v.kind == Value::Kind::kDict;
    if (name == "iterable") return v.kind == Value::Kind::kList || v.kind == Value::Kind::kStr || v.kind == Value::Kind::kDict;
    if (name == "callable") return v.kind == Value::Kind::kFunc;
    if (name == "odd" || name == "even") return v.kind == Value::Kind::kInt && (v.i % 2 != 0) == (name == "odd");
    if (name == "divisibleby") return a.size() > 1 && a[1].i != 0 && v.i % a[1].i == 0;
    if (name == "equalto" || name == "eq" || name == "sameas") return a.size() > 1 && equal(v, a[1]);
    if (name == "ne") return a.size() > 1 && !equal(v, a[1]);
    if (name == "in") return a.size() > 1 && contains(a[1], v);
    fail("the test 'is " + name + "' is not supported by memrt's chat template interpreter");
  }

  Value filter(const std::string& name, Args& a, Kwargs& kw) {
    const Value& v = a[0];
    auto kwarg = [&](const std::string& key, size_t pos) -> const Value* {
      for (auto& [k, x] : kw)
        if (k == key) return &x;
      return pos < a.size() ? &a[pos] : nullptr;
    };
    if (name == "trim") return Value::str(strip(text(v), "", true, true));
    if (name == "length" || name == "count") {
      if (v.kind == Value::Kind::kStr) return Value::integer(static_cast<int64_t>(iterate(v).size()));
      if (v.kind == Value::Kind::kList) return Value::integer(static_cast<int64_t>(v.list->size()));
      if (v.kind == Value::Kind::kDict) return Value::integer(static_cast<int64_t>(v.dict->size()));
      if (!v.defined()) return Value::integer(0);
      fail(std::string("length of ") + kind_name(v));
    }
    if (name == "upper" || name == "lower") return string_method(text(v), name).fn->operator()(a, kw);
    if (name == "capitalize" || name == "title") {
      std::string s = text(v);
      bool start = true;
      for (char& c : s) {
        const auto u = static_cast<unsigned char>(c);
        c = static_cast<char>(start ? std::toupper(u) : name == "capitalize" || std::isalpha(u) ? std::tolower(u) : u);
        start = name == "title" ? !std::isalpha(u) : false;
      }
      return Value::str(s);
    }
    if (name == "string") return Value::str(text(v));
    if (name == "int") {
      if (v.is_number()) return Value::integer(static_cast<int64_t>(v.number()));
      try {
        return Value::integer(std::stoll(text(v)));
      } catch (...) {
        return Value::integer(0);
      }
    }
    if (name == "float") return Value::real(v.is_number() ? v.number() : std::atof(text(v).c_str()));
    if (name == "list") return Value::of_list(iterate(v));
    if (name == "first" || name == "last") {
      List l = iterate(v);
      if (l.empty()) return Value();
      return name == "first" ? l.front() : l.back();
    }
    if (name == "reverse") {
      if (v.kind == Value::Kind::kStr) {
        List chars = iterate(v);
        std::string r;
        for (auto it = chars.rbegin(); it != chars.rend(); ++it) r += it->s;
        return Value::str(r);
      }
      List l = iterate(v);
      std::reverse(l.begin(), l.end());
      return Value::of_list(std::move(l));
    }
    if (name == "join") {
      const Value* sep = kwarg("d", 1);
      std::string r;
      bool first = true;
      for (const Value& x : iterate(v)) {
        if (!first) r += sep ? text(*sep) : "";
        r += text(x);
        first = false;
      }
      return Value::str(r);
    }
    if (name == "default" || name == "d") {
      const Value* fallback = kwarg("default_value", 1);
      const Value* boolean = kwarg("boolean", 2);
      const bool use = boolean && boolean->truthy() ? !v.truthy() : !v.defined();
      return use ? (fallback ? *fallback : Value::str("")) : v;
    }
    if (name == "replace") {
      Args args{a.size() > 1 ? a[1] : Value::str(""), a.size() > 2 ? a[2] : Value::str("")};
      return string_method(text(v), "replace").fn->operator()(args, kw);
    }
    if (name == "tojson") {
      const Value* indent = kwarg("indent", 1);
      std::string out;
      to_json(v, out, indent && indent->kind == Value::Kind::kInt ? static_cast<int>(indent->i) : -1, 0);
      return Value::str(out);
    }
    if (name == "items") return attribute(v, "items").fn->operator()(a, kw);
    if (name == "selectattr" || name == "rejectattr") {
      List out;
      for (const Value& x : iterate(v)) {
        const std::string attr = a.size() > 1 ? text(a[1]) : "";
        Args args{attribute(x, attr)};
        for (size_t k = 3; k < a.size(); ++k) args.push_back(a[k]);
        const bool hit = a.size() > 2 ? test(text(a[2]), args) : args[0].truthy();
        if (hit == (name == "selectattr")) out.push_back(x);
      }
      return Value::of_list(std::move(out));
    }
    if (name == "map") {
      const Value* attr = kwarg("attribute", 99);
      List out;
      for (const Value& x : iterate(v)) {
        if (attr) {
          out.push_back(attribute(x, text(*attr)));
        } else {
          Args args{x};
          Kwargs none;
          out.push_back(filter(a.size() > 1 ? text(a[1]) : "string", args, none));
        }
      }
      return Value::of_list(std::move(out));
    }
    if (name == "abs") return v.kind == Value::Kind::kFloat ? Value::real(std::fabs(v.f)) : Value::integer(std::llabs(v.i));
    fail("the filter '" + name + "' is not supported by memrt's chat template interpreter");
  }
};

}  // namespace

ChatTemplate::ChatTemplate(std::unique_ptr<Program> p) : program_(std::move(p)) {}
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;
ChatTemplate::~ChatTemplate() = default;

ChatTemplate ChatTemplate::parse(const std::string& source, const std::string& where) {
  auto program = std::make_unique<Program>();
  program->where = where;
  program->source = source;
  try {
    // Jinja's keep_trailing_newline=False: the template's last newline is not part of it.
    std::string src = source;
    if (src.size() >= 2 && src.compare(src.size() - 2, 2, "\r\n") == 0) src.resize(src.size() - 2);
    else if (!src.empty() && src.back() == '\n') src.pop_back();
    Parser parser(split_template(src));
    program->body = parser.parse_all();
    program->generation = parser.saw_generation();
  } catch (const TemplateError& e) {
    throw FileError(where, "line " + std::to_string(e.line) + ": " + e.what());
  }
  return ChatTemplate(std::move(program));
}

bool ChatTemplate::has_generation() const { return program_->generation; }

const std::string& ChatTemplate::source() const { return program_->source; }

ChatTemplate::Rendered ChatTemplate::render(const rapidjson::Value& variables) const {
  Rendered out;
  Renderer r(*program_, out);
  if (variables.IsObject())
    for (const auto& m : variables.GetObject())
      r.globals()[std::string(m.name.GetString(), m.name.GetStringLength())] = from_json(m.value);
  try {
    r.run(program_->body);
  } catch (const LoopControl&) {
    throw Error(program_->where + ": {% break %} or {% continue %} outside a loop");
  }
  return out;
}

std::optional<ChatTemplate> load_chat_template(const std::string& dir) {
  const std::filesystem::path jinja = std::filesystem::path(dir) / "chat_template.jinja";
  auto slurp = [](const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  if (std::filesystem::exists(jinja)) return ChatTemplate::parse(slurp(jinja), jinja.string());
  const std::filesystem::path config = tokenizer_config_path(dir);
  const std::optional<rapidjson::Document> read = read_tokenizer_config(dir);
  if (!read) return std::nullopt;
  const rapidjson::Document& d = *read;
  if (!d.HasMember("chat_template") || d["chat_template"].IsNull()) return std::nullopt;
  const rapidjson::Value& t = d["chat_template"];
  const std::string where = config.string() + ": chat_template";
  if (t.IsString()) return ChatTemplate::parse(t.GetString(), where);
  if (t.IsArray()) {
    for (const auto& named : t.GetArray())
      if (named.IsObject() && named.HasMember("name") && named["name"].IsString() &&
          std::string(named["name"].GetString()) == "default" && named.HasMember("template") &&
          named["template"].IsString())
        return ChatTemplate::parse(named["template"].GetString(), where + " (default)");
    throw FileError(config.string(), "chat_template is a list without a {\"name\": \"default\", \"template\": ...}");
  }
  throw FileError(config.string(), "chat_template: expected a template string or a list of {name, template}");
}

namespace {

// The byte length of the whitespace character (as str.isspace() says) that starts at s[at], or 0.
size_t space_at(const std::string& s, size_t at) {
  const size_t n = utf8_sequence(s, at);
  return n && is_python_space(code_point(s, at, n)) ? n : 0;
}

}  // namespace

std::string python_strip(const std::string& s, bool left, bool right) {
  size_t b = 0, e = s.size();
  for (size_t n; left && b < e && (n = space_at(s, b));) b += n;
  if (right) {
    while (e > b) {
      size_t last = e - 1;  // the first byte of the last character
      while (last > b && is_continuation(s[last])) --last;
      if (space_at(s, last) != e - last) break;
      e = last;
    }
  }
  return s.substr(b, e - b);
}

}  // namespace memrt
