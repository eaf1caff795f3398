// Strict JSON: a recursive-descent reader over the raw bytes and a compact writer. See json.h for the rules.
#include "io/json.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <unordered_set>

#include "tensor/error.h"

namespace mixtape::json {

namespace {

constexpr int kMaxDepth = 256;

// Length of the well-formed UTF-8 sequence starting at text[pos], or 0 if there is none (RFC 3629 table 3:
// no overlong forms, no UTF-16 surrogates D800..DFFF, nothing above U+10FFFF).
size_t utf8_sequence_length(std::string_view text, size_t pos) {
  auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(pos);
  if (lead < 0x80) return 1;
  size_t length = 0;
  unsigned char low = 0x80, high = 0xBF;  // the allowed range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) length = 2;
  else if (lead == 0xE0) length = 3, low = 0xA0;
  else if (lead >= 0xE1 && lead <= 0xEC) length = 3;
  else if (lead == 0xED) length = 3, high = 0x9F;
  else if (lead >= 0xEE && lead <= 0xEF) length = 3;
  else if (lead == 0xF0) length = 4, low = 0x90;
  else if (lead >= 0xF1 && lead <= 0xF3) length = 4;
  else if (lead == 0xF4) length = 4, high = 0x8F;
  else return 0;
  if (pos + length > text.size()) return 0;
  if (byte(pos + 1) < low || byte(pos + 1) > high) return 0;
  for (size_t i = 2; i < length; ++i)
    if (byte(pos + i) < 0x80 || byte(pos + i) > 0xBF) return 0;
  return length;
}

void append_utf8(std::string& out, uint32_t code_point) {
  if (code_point < 0x80) {
    out += static_cast<char>(code_point);
  } else if (code_point < 0x800) {
    out += static_cast<char>(0xC0 | (code_point >> 6));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  } else if (code_point < 0x10000) {
    out += static_cast<char>(0xE0 | (code_point >> 12));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (code_point >> 18));
    out += static_cast<char>(0x80 | ((code_point >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  }
}

std::string describe_byte(unsigned char c) {
  char buffer[16];
  if (c >= 0x20 && c < 0x7F) std::snprintf(buffer, sizeof buffer, "'%c'", c);
  else std::snprintf(buffer, sizeof buffer, "byte 0x%02x", c);
  return buffer;
}

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  Value parse_document() {
    skip_whitespace();
    Value value = parse_value(0);
    skip_whitespace();
    if (pos_ != text_.size()) error(pos_, "unexpected ", describe_byte(peek()), " after the value");
    return value;
  }

 private:
  template <class... Parts>
  [[noreturn]] void error(size_t at, const Parts&... parts) {
    fail("json: ", parts..., " at byte ", at);
  }

  bool at_end() const { return pos_ >= text_.size(); }
  unsigned char peek() const { return static_cast<unsigned char>(text_[pos_]); }

  void skip_whitespace() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) ++pos_;
  }

  void expect_more(const char* what) {
    if (at_end()) error(pos_, "unexpected end of input, expected ", what);
  }

  Value parse_value(int depth) {
    expect_more("a value");
    switch (peek()) {
      case '{': return parse_object(depth);
      case '[': return parse_array(depth);
      case '"': return Value(parse_string());
      case 't': parse_literal("true"); return Value(true);
      case 'f': parse_literal("false"); return Value(false);
      case 'n': parse_literal("null"); return Value(nullptr);
      default:
        if (peek() == '-' || (peek() >= '0' && peek() <= '9')) return parse_number();
        error(pos_, "unexpected ", describe_byte(peek()), ", expected a value");
    }
  }

  void parse_literal(std::string_view literal) {
    if (text_.substr(pos_, literal.size()) != literal)
      error(pos_, "invalid literal, expected '", literal, "'");
    pos_ += literal.size();
  }

  void enter(int depth) {
    if (depth >= kMaxDepth) error(pos_, "nesting deeper than ", kMaxDepth, " levels");
  }

  Value parse_array(int depth) {
    enter(depth);
    ++pos_;  // '['
    Value::Array items;
    skip_whitespace();
    expect_more("a value or ']'");
    if (peek() == ']') {
      ++pos_;
      return Value(std::move(items));
    }
    while (true) {
      skip_whitespace();
      items.push_back(parse_value(depth + 1));
      skip_whitespace();
      expect_more("',' or ']'");
      if (peek() == ']') {
        ++pos_;
        return Value(std::move(items));
      }
      if (peek() != ',') error(pos_, "unexpected ", describe_byte(peek()), " in array, expected ',' or ']'");
      ++pos_;
    }
  }

  Value parse_object(int depth) {
    enter(depth);
    ++pos_;  // '{'
    Value::Object members;
    std::unordered_set<std::string> keys;
    skip_whitespace();
    expect_more("a key or '}'");
    if (peek() == '}') {
      ++pos_;
      return Value(std::move(members));
    }
    while (true) {
      skip_whitespace();
      expect_more("a key");
      if (peek() != '"')
        error(pos_, "unexpected ", describe_byte(peek()), " in object, expected a string key");
      const size_t key_start = pos_;
      std::string key = parse_string();
      if (!keys.insert(key).second) error(key_start, "duplicate key ", quote(key));
      skip_whitespace();
      expect_more("':'");
      if (peek() != ':') error(pos_, "unexpected ", describe_byte(peek()), " after object key, expected ':'");
      ++pos_;
      skip_whitespace();
      Value value = parse_value(depth + 1);
      members.emplace_back(std::move(key), std::move(value));
      skip_whitespace();
      expect_more("',' or '}'");
      if (peek() == '}') {
        ++pos_;
        return Value(std::move(members));
      }
      if (peek() != ',') error(pos_, "unexpected ", describe_byte(peek()), " in object, expected ',' or '}'");
      ++pos_;
    }
  }

  uint32_t parse_hex4() {
    uint32_t value = 0;
    for (int i = 0; i < 4; ++i) {
      expect_more("a hex digit");
      const unsigned char c = peek();
      uint32_t digit;
      if (c >= '0' && c <= '9') digit = c - '0';
      else if (c >= 'a' && c <= 'f') digit = c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') digit = c - 'A' + 10;
      else error(pos_, "invalid hex digit ", describe_byte(c), " in \\u escape");
      value = value * 16 + digit;
      ++pos_;
    }
    return value;
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    while (true) {
      expect_more("'\"' to close the string");
      const unsigned char c = peek();
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c < 0x20) error(pos_, "unescaped control character ", describe_byte(c), " in string");
      if (c == '\\') {
        const size_t escape_start = pos_;
        ++pos_;
        expect_more("an escape character");
        const unsigned char e = peek();
        ++pos_;
        switch (e) {
          case '"': out += '"'; break;
          case '\\': out += '\\'; break;
          case '/': out += '/'; break;
          case 'b': out += '\b'; break;
          case 'f': out += '\f'; break;
          case 'n': out += '\n'; break;
          case 'r': out += '\r'; break;
          case 't': out += '\t'; break;
          case 'u': {
            uint32_t code_point = parse_hex4();
            if (code_point >= 0xDC00 && code_point <= 0xDFFF)
              error(escape_start, "lone low surrogate \\u", text_.substr(escape_start + 2, 4), " in string");
            if (code_point >= 0xD800 && code_point <= 0xDBFF) {
              // A high surrogate must be followed by an escaped low surrogate; together they encode
              // U+10000 + (high - D800) * 0x400 + (low - DC00).
              if (text_.substr(pos_, 2) != "\\u")
                error(escape_start, "high surrogate \\u", text_.substr(escape_start + 2, 4),
                      " not followed by a low surrogate");
              pos_ += 2;
              const uint32_t low = parse_hex4();
              if (low < 0xDC00 || low > 0xDFFF)
                error(escape_start, "high surrogate \\u", text_.substr(escape_start + 2, 4),
                      " not followed by a low surrogate");
              code_point = 0x10000 + ((code_point - 0xD800) << 10) + (low - 0xDC00);
            }
            append_utf8(out, code_point);
            break;
          }
          default: error(escape_start, "invalid escape '\\", static_cast<char>(e), "' in string");
        }
        continue;
      }
      const size_t length = utf8_sequence_length(text_, pos_);
      if (length == 0) error(pos_, "invalid UTF-8 (", describe_byte(c), ") in string");
      out.append(text_.substr(pos_, length));
      pos_ += length;
    }
  }

  Value parse_number() {
    const size_t start = pos_;
    auto digit = [&] { return !at_end() && peek() >= '0' && peek() <= '9'; };
    if (peek() == '-') ++pos_;
    if (!digit()) error(pos_, "expected a digit in number");
    if (peek() == '0') {
      ++pos_;
      if (digit()) error(start, "leading zero in number");
    } else {
      while (digit()) ++pos_;
    }
    bool integral = true;
    if (!at_end() && peek() == '.') {
      integral = false;
      ++pos_;
      if (!digit()) error(pos_, "expected a digit after '.' in number");
      while (digit()) ++pos_;
    }
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      integral = false;
      ++pos_;
      if (!at_end() && (peek() == '+' || peek() == '-')) ++pos_;
      if (!digit()) error(pos_, "expected a digit in the exponent of number");
      while (digit()) ++pos_;
    }
    const char* first = text_.data() + start;
    const char* last = text_.data() + pos_;
    if (integral) {
      int64_t value = 0;
      const auto [end, status] = std::from_chars(first, last, value);
      if (status == std::errc() && end == last) return Value(value);
      // Out of int64 range: kept as a (rounded) Number, so a caller asking for an integer gets a clear error.
    }
    double value = 0;
    const auto [end, status] = std::from_chars(first, last, value);
    if (status == std::errc::result_out_of_range) error(start, "number out of range");
    if (status != std::errc() || end != last) error(start, "invalid number");
    return Value(value);
  }

  std::string_view text_;
  size_t pos_ = 0;
};

void dump_to(const Value& value, std::string& out) {
  switch (value.kind()) {
    case Value::Kind::Null: out += "null"; break;
    case Value::Kind::Bool: out += value.as_bool() ? "true" : "false"; break;
    case Value::Kind::Integer: out += std::to_string(value.as_integer()); break;
    case Value::Kind::Number: {
      const double number = value.as_number();
      check(std::isfinite(number), "json: cannot write the non-finite number ", number);
      char buffer[32];
      // 17 significant digits: reads back as the same double.
      std::snprintf(buffer, sizeof buffer, "%.17g", number);
      out += buffer;
      break;
    }
    case Value::Kind::String: out += quote(value.as_string()); break;
    case Value::Kind::Array: {
      out += '[';
      bool first = true;
      for (const Value& item : value.as_array()) {
        if (!first) out += ',';
        first = false;
        dump_to(item, out);
      }
      out += ']';
      break;
    }
    case Value::Kind::Object: {
      out += '{';
      bool first = true;
      for (const auto& [key, member] : value.as_object()) {
        if (!first) out += ',';
        first = false;
        out += quote(key);
        out += ':';
        dump_to(member, out);
      }
      out += '}';
      break;
    }
  }
}

}  // namespace

const char* kind_name(Value::Kind kind) {
  switch (kind) {
    case Value::Kind::Null: return "null";
    case Value::Kind::Bool: return "bool";
    case Value::Kind::Integer: return "integer";
    case Value::Kind::Number: return "number";
    case Value::Kind::String: return "string";
    case Value::Kind::Array: return "array";
    case Value::Kind::Object: return "object";
  }
  return "?";
}

namespace {
[[noreturn]] void wrong_kind(Value::Kind expected, Value::Kind got) {
  fail("json: expected ", kind_name(expected), ", got ", kind_name(got));
}
}  // namespace

bool Value::as_bool() const {
  if (!is_bool()) wrong_kind(Kind::Bool, kind());
  return std::get<bool>(data_);
}
int64_t Value::as_integer() const {
  if (!is_integer()) wrong_kind(Kind::Integer, kind());
  return std::get<int64_t>(data_);
}
double Value::as_number() const {
  if (is_integer()) return static_cast<double>(std::get<int64_t>(data_));
  if (!is_number()) wrong_kind(Kind::Number, kind());
  return std::get<double>(data_);
}
const std::string& Value::as_string() const {
  if (!is_string()) wrong_kind(Kind::String, kind());
  return std::get<std::string>(data_);
}
const Value::Array& Value::as_array() const {
  if (!is_array()) wrong_kind(Kind::Array, kind());
  return std::get<Array>(data_);
}
const Value::Object& Value::as_object() const {
  if (!is_object()) wrong_kind(Kind::Object, kind());
  return std::get<Object>(data_);
}
Value::Array& Value::as_array() {
  if (!is_array()) wrong_kind(Kind::Array, kind());
  return std::get<Array>(data_);
}
Value::Object& Value::as_object() {
  if (!is_object()) wrong_kind(Kind::Object, kind());
  return std::get<Object>(data_);
}

const Value* Value::find(std::string_view key) const {
  for (const auto& [name, value] : as_object())
    if (name == key) return &value;
  return nullptr;
}

std::string Value::dump() const {
  std::string out;
  dump_to(*this, out);
  return out;
}

Value parse(std::string_view text) { return Parser(text).parse_document(); }

bool is_valid_utf8(std::string_view text) {
  for (size_t pos = 0; pos < text.size();) {
    const size_t length = utf8_sequence_length(text, pos);
    if (length == 0) return false;
    pos += length;
  }
  return true;
}

std::string quote(std::string_view text) {
  std::string out = "\"";
  for (size_t pos = 0; pos < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[pos]);
    if (c >= 0x80) {
      const size_t length = utf8_sequence_length(text, pos);
      if (length == 0) fail("json: string is not valid UTF-8 (", describe_byte(c), " at byte ", pos, ")");
      out.append(text.substr(pos, length));
      pos += length;
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buffer[8];
          std::snprintf(buffer, sizeof buffer, "\\u%04x", c);
          out += buffer;
        } else {
          out += static_cast<char>(c);
        }
    }
    ++pos;
  }
  out += '"';
  return out;
}

}  // namespace mixtape::json
