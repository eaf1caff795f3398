// Strict JSON over nlohmann::json: its SAX parser reads the text while a driver adds what RFC 8259 leaves
// open (depth, leading zeros, number range), places each value in the text, and turns nlohmann's parse
// errors into mixtape's messages, located by where the text stands when the parser fails. The driver hands
// the values to a Handler: the Builder makes an ordered_json of them (refusing duplicate keys), other
// handlers keep what they need. The writer walks the value itself so that numbers keep mixtape's format;
// strings are escaped by nlohmann.
#include "io/json.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <unordered_set>
#include <utility>
#include <vector>

#include "tensor/error.h"

namespace mixtape::json {

namespace {

constexpr size_t kMaxDepth = 256;

// Length of the well-formed UTF-8 sequence a lead byte starts (0 for a byte that starts none), and the
// allowed range of its second byte (RFC 3629 table 3: no overlong forms, no UTF-16 surrogates D800..DFFF,
// nothing above U+10FFFF).
size_t utf8_lead_length(unsigned char lead, unsigned char& low, unsigned char& high) {
  low = 0x80, high = 0xBF;
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead == 0xE0) return low = 0xA0, 3;
  if (lead >= 0xE1 && lead <= 0xEC) return 3;
  if (lead == 0xED) return high = 0x9F, 3;
  if (lead >= 0xEE && lead <= 0xEF) return 3;
  if (lead == 0xF0) return low = 0x90, 4;
  if (lead >= 0xF1 && lead <= 0xF3) return 4;
  if (lead == 0xF4) return high = 0x8F, 4;
  return 0;
}

// Length of the well-formed UTF-8 sequence starting at text[pos], or 0 if there is none.
size_t utf8_sequence_length(std::string_view text, size_t pos) {
  auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  unsigned char low, high;
  const size_t length = utf8_lead_length(byte(pos), low, high);
  if (length <= 1) return length;
  if (pos + length > text.size()) return 0;
  if (byte(pos + 1) < low || byte(pos + 1) > high) return 0;
  for (size_t i = 2; i < length; ++i)
    if (byte(pos + i) < 0x80 || byte(pos + i) > 0xBF) return 0;
  return length;
}

std::string describe_byte(unsigned char c) {
  char buffer[16];
  if (c >= 0x20 && c < 0x7F) std::snprintf(buffer, sizeof buffer, "'%c'", c);
  else std::snprintf(buffer, sizeof buffer, "byte 0x%02x", c);
  return buffer;
}

template <class... Parts>
[[noreturn]] void parse_fail(size_t at, const Parts&... parts) {
  fail("json: ", parts..., " at byte ", at);
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// How far nlohmann's lexer has read: `pulled` is one past the last byte it took, `at_end` whether it has
// asked for a byte past the text. The lexer reads no byte beyond a string, literal or bracket, and exactly
// one beyond a number (which it puts back), unless the text ends.
//
// The lexer keeps a copy of every byte it reads since the last string or number started (brackets, commas,
// colons, literals and whitespace included), so a run of whitespace outside strings reaches it as its first
// byte only: megabytes of padding cost no memory (`skipped` counts the bytes it never saw). Following where
// each string, number or literal starts also lets the token limit refuse an overlong one before the lexer
// has copied all of it, and refuse more than that many bytes without a string or number ("[null,null,...]",
// "[[],[],...]"), which the lexer would copy whole.
struct Progress {
  Progress(std::string_view text, size_t max_token)
      : text(text.data()), end(text.data() + text.size()), pulled(text.data()), max_token(max_token) {}

  // Takes the byte at `at`; returns where the lexer's next byte is.
  const char* take(const char* at) {
    pulled = at + 1;
    follow_token(at);
    const char* next = at + 1;
    if (token == Token::Outside && is_space(*at)) {
      while (next != end && is_space(*next)) ++next;
      skipped += static_cast<size_t>(next - (at + 1));
    }
    return next;
  }

  const char* text;
  const char* end;
  const char* pulled;
  size_t max_token;
  size_t skipped = 0;
  bool at_end = false;

 private:
  void follow_token(const char* at) {
    const char c = *at;
    switch (token) {
      case Token::Outside:
        if (c == '"') {
          token = Token::InString, token_start = at;
        } else if (is_space(c) || c == '[' || c == ']' || c == '{' || c == '}' || c == ',' || c == ':') {
          token_start = nullptr;
        } else if (token_start == nullptr) {
          token_start = at;
        }
        // The lexer's copy starts over where a string or a number starts; a number's own bytes are bounded
        // as a token, the rest of the copy here.
        if (token_start == at) in_number = c == '-' || (c >= '0' && c <= '9');
        else if (token_start == nullptr) in_number = false;
        if (c == '"' || in_number) {
          copied = 0;
        } else if (++copied > max_token) {
          parse_fail(static_cast<size_t>(at - text), "more than ", max_token,
                     " bytes of JSON without a string or a number (the reader's limit)");
        }
        break;
      case Token::InString:
        if (c == '\\') token = Token::AfterBackslash;
        else if (c == '"') token = Token::Outside;
        break;
      case Token::AfterBackslash: token = Token::InString; break;
    }
    if (token_start != nullptr && static_cast<size_t>(pulled - token_start) > max_token)
      parse_fail(static_cast<size_t>(token_start - text), "a string or number longer than ", max_token,
                 " bytes (the reader's limit)");
    if (token == Token::Outside && c == '"') token_start = nullptr;  // the closing quote ended the string
  }

  enum class Token { Outside, InString, AfterBackslash } token = Token::Outside;
  const char* token_start = nullptr;  // of the string or other token being read; null between tokens
  size_t copied = 0;  // bytes outside strings the lexer has copied since a string or number last started
  bool in_number = false;  // the token being read outside strings is a number
};

// The text as nlohmann reads it, reporting each byte it takes into a Progress.
class TrackedIterator {
 public:
  using iterator_category = std::forward_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  TrackedIterator(const char* at, Progress* progress) : at_(at), progress_(progress) {}
  reference operator*() const { return *at_; }
  TrackedIterator& operator++() {
    at_ = progress_->take(at_);
    return *this;
  }
  TrackedIterator operator++(int) {
    TrackedIterator before = *this;
    ++*this;
    return before;
  }
  bool operator==(const TrackedIterator& other) const {
    const bool equal = at_ == other.at_;
    progress_->at_end = progress_->at_end || equal;
    return equal;
  }
  bool operator!=(const TrackedIterator& other) const { return !(*this == other); }

 private:
  const char* at_;
  Progress* progress_;
};

// What the grammar allows at the end of what the builder has seen; a parse error is described by it and the
// first byte after it (past one ',' or ':' the grammar allows there, which nlohmann reads without an event).
enum class Expect { Value, ValueOrClose, Key, KeyOrClose, Colon, AfterValue };

// Drives a Handler from nlohmann's SAX events, adding what RFC 8259 leaves open (depth, leading zeros,
// number range) and each value's place in the text.
class Driver {
 public:
  Driver(std::string_view text, const Progress& progress, Handler& handler)
      : text_(text), progress_(progress), handler_(handler) {}

  void expect_end() const {
    const size_t pos = skip_whitespace(end_);
    if (pos < text_.size())
      parse_fail(pos, "unexpected ", describe_byte(static_cast<unsigned char>(text_[pos])), " after the value");
  }

  bool null() { return literal(nullptr, 4); }
  bool boolean(bool value) { return literal(value, value ? 4 : 5); }
  bool number_integer(int64_t value) { return integer(value); }
  bool number_unsigned(uint64_t value) {
    // Past int64 an integer is a double, as when it is written with an exponent.
    if (value <= static_cast<uint64_t>(INT64_MAX)) return integer(static_cast<int64_t>(value));
    return integer(static_cast<double>(value));
  }
  // `value` is nlohmann's strtod of the token, which holds the C library's decimal point (',' under some
  // locales) in place of '.', so it is right in every locale. strtod rounds a number too small for a double
  // to 0 (1e-400), which is out of range unless the number is 0; an overflow (1e999) is nlohmann's error 406.
  bool number_float(double value, const std::string& token) {
    const size_t end = number_end();
    const std::string_view digits = std::string_view(token).substr(0, token.find_first_of("eE"));
    const bool zero = digits.find_first_of("123456789") == std::string_view::npos;
    if (!std::isfinite(value) || (value == 0 && !zero)) parse_fail(end - token.size(), "number out of range");
    return add(value, end - token.size(), end);
  }
  bool string(std::string& value) {
    const size_t end = pulled();
    return add(std::move(value), string_start(end), end);
  }
  bool binary(Json::binary_t&) { return false; }  // JSON text has no binary values

  bool start_object(size_t) {
    open(false);
    handler_.begin_object(pulled() - 1);
    return true;
  }
  bool start_array(size_t) {
    open(true);
    handler_.begin_array(pulled() - 1);
    return true;
  }
  bool end_object() {
    close();
    handler_.end_object(end_);
    return true;
  }
  bool end_array() {
    close();
    handler_.end_array(end_);
    return true;
  }

  bool key(std::string& key) {
    end_ = pulled();
    expect_ = Expect::Colon;
    handler_.key(std::move(key), string_start(end_));
    return true;
  }

  bool parse_error(size_t read, const std::string&, const nlohmann::detail::exception& error) {
    describe(read + progress_.skipped, error);
  }

 private:
  size_t pulled() const { return static_cast<size_t>(progress_.pulled - text_.data()); }
  size_t number_end() const { return progress_.at_end ? text_.size() : pulled() - 1; }

  // A JSON integer never has a leading zero: nlohmann ends the number "0" (or "-0") where a digit follows.
  size_t integer_end() const {
    const size_t end = number_end();
    if (end < text_.size() && text_[end] >= '0' && text_[end] <= '9')
      parse_fail(end >= 2 && text_[end - 2] == '-' ? end - 2 : end - 1, "leading zero in number");
    return end;
  }

  // An integer's token is its digits and a '-'.
  bool integer(Json value) {
    const size_t end = integer_end();
    size_t begin = end;
    while (begin > 0 && (text_[begin - 1] == '-' || (text_[begin - 1] >= '0' && text_[begin - 1] <= '9'))) --begin;
    return add(std::move(value), begin, end);
  }

  bool literal(Json value, size_t length) {
    const size_t end = pulled();
    return add(std::move(value), end - length, end);
  }

  // The opening quote of the string that ends before `end`: the last '"' not escaped by a backslash.
  size_t string_start(size_t end) const {
    size_t quote = end - 1;
    while (true) {
      quote = text_.rfind('"', quote - 1);
      size_t backslashes = 0;
      while (backslashes < quote && text_[quote - 1 - backslashes] == '\\') ++backslashes;
      if (backslashes % 2 == 0) return quote;
    }
  }

  bool add(Json value, size_t begin, size_t end) {
    end_ = end;
    expect_ = Expect::AfterValue;
    handler_.scalar(std::move(value), begin, end);
    return true;
  }

  void open(bool array) {
    if (open_.size() >= kMaxDepth) parse_fail(pulled() - 1, "nesting deeper than ", kMaxDepth, " levels");
    open_.push_back(array);
    end_ = pulled();
    expect_ = array ? Expect::ValueOrClose : Expect::KeyOrClose;
  }

  void close() {
    open_.pop_back();
    end_ = pulled();
    expect_ = Expect::AfterValue;
  }

  size_t skip_whitespace(size_t pos) const {
    while (pos < text_.size() && is_space(text_[pos])) ++pos;
    return pos;
  }

  // The parser stopped having read `read` bytes (counting one for the end of the text).
  [[noreturn]] void describe(size_t read, const nlohmann::detail::exception& error) const {
    const bool in_array = !open_.empty() && open_.back();
    Expect expect = expect_;
    size_t pos = skip_whitespace(end_);
    const auto at = [&](char c) { return pos < text_.size() && text_[pos] == c; };
    if (expect == Expect::AfterValue && !open_.empty() && at(',')) {
      pos = skip_whitespace(pos + 1);
      expect = in_array ? Expect::Value : Expect::Key;
    } else if (expect == Expect::Colon && at(':')) {
      pos = skip_whitespace(pos + 1);
      expect = Expect::Value;
    }
    if (pos >= text_.size()) {
      const char* wanted[] = {"a value", "a value or ']'", "a key", "a key or '}'", "':'",
                              in_array ? "',' or ']'" : "',' or '}'"};
      parse_fail(pos, "unexpected end of input, expected ", wanted[static_cast<int>(expect)]);
    }
    const char c = text_[pos];
    const std::string got = describe_byte(static_cast<unsigned char>(c));
    switch (expect) {
      case Expect::Value:
      case Expect::ValueOrClose:
        if (c == '"') describe_string(read - 1, error);
        if (c == '-' || (c >= '0' && c <= '9')) describe_number(pos, read - 1, error);
        if (c == 't') parse_fail(pos, "invalid literal, expected 'true'");
        if (c == 'f') parse_fail(pos, "invalid literal, expected 'false'");
        if (c == 'n') parse_fail(pos, "invalid literal, expected 'null'");
        parse_fail(pos, "unexpected ", got, ", expected a value");
      case Expect::Key:
      case Expect::KeyOrClose:
        if (c == '"') describe_string(read - 1, error);
        parse_fail(pos, "unexpected ", got, " in object, expected a string key");
      case Expect::Colon: parse_fail(pos, "unexpected ", got, " after object key, expected ':'");
      case Expect::AfterValue:
        if (open_.empty()) parse_fail(pos, "unexpected ", got, " after the value");
        if (in_array) parse_fail(pos, "unexpected ", got, " in array, expected ',' or ']'");
        parse_fail(pos, "unexpected ", got, " in object, expected ',' or '}'");
    }
    parse_fail(pos, echo(error.what()));  // nlohmann's message quotes the text it read
  }

  // An error inside a string; nlohmann stopped at the byte `stop` (the text's size for its end).
  [[noreturn]] void describe_string(size_t stop, const nlohmann::detail::exception& error) const {
    const std::string_view message = error.what();
    const auto says = [&](std::string_view what) { return message.find(what) != std::string_view::npos; };
    const bool end = stop >= text_.size();
    if (says("missing closing quote")) parse_fail(stop, "unexpected end of input, expected '\"' to close the string");
    if (says("control character"))
      parse_fail(stop, "unescaped control character ", describe_byte(static_cast<unsigned char>(text_[stop])), " in string");
    if (says("forbidden character after backslash")) {
      if (end) parse_fail(stop, "unexpected end of input, expected an escape character");
      const unsigned char after = static_cast<unsigned char>(text_[stop]);
      if (after >= 0x20 && after < 0x7F) parse_fail(stop - 1, "invalid escape '\\", text_[stop], "' in string");
      parse_fail(stop - 1, "invalid escape in string: '\\' followed by ", describe_byte(after));
    }
    if (says("must be followed by 4 hex digits")) {
      if (end) parse_fail(stop, "unexpected end of input, expected a hex digit");
      parse_fail(stop, "invalid hex digit ", describe_byte(static_cast<unsigned char>(text_[stop])), " in \\u escape");
    }
    if (says("must follow U+D800..U+DBFF"))  // stop is the last hex digit of the escape
      parse_fail(stop - 5, "lone low surrogate \\u", text_.substr(stop - 3, 4), " in string");
    if (says("must be followed by U+DC00..U+DFFF")) {
      // nlohmann stopped at the last hex digit of an escape that is no low surrogate, at the byte after
      // the high surrogate's escape, or at the byte after a '\' that follows it.
      const size_t high = stop >= 11 && text_[stop - 5] == '\\' ? stop - 11 : text_[stop - 1] == '\\' ? stop - 7
                                                                                                       : stop - 6;
      parse_fail(high, "high surrogate \\u", text_.substr(high + 2, 4), " not followed by a low surrogate");
    }
    if (says("ill-formed UTF-8 byte")) {
      const size_t lead = utf8_lead_before(stop);
      parse_fail(lead, "invalid UTF-8 (", describe_byte(static_cast<unsigned char>(text_[lead])), ") in string");
    }
    parse_fail(stop, echo(error.what()));
  }

  // The start of the UTF-8 sequence that fails at `stop`: the lead byte at most 3 bytes back whose sequence
  // would reach `stop`, or stop itself (a byte that starts no sequence).
  size_t utf8_lead_before(size_t stop) const {
    for (size_t back = 1; back <= 3 && back <= stop; ++back) {
      const unsigned char byte = static_cast<unsigned char>(text_[stop - back]);
      if (byte >= 0x80 && byte <= 0xBF) continue;  // a continuation byte
      unsigned char low, high;
      return utf8_lead_length(byte, low, high) > back ? stop - back : stop;
    }
    return stop;
  }

  // An error inside the number that starts at `start`; nlohmann stopped at the byte `stop`.
  [[noreturn]] void describe_number(size_t start, size_t stop, const nlohmann::detail::exception& error) const {
    const std::string_view message = error.what();
    const auto says = [&](std::string_view what) { return message.find(what) != std::string_view::npos; };
    if (says("expected digit after '-'")) parse_fail(stop, "expected a digit in number");
    if (says("expected digit after '.'")) parse_fail(stop, "expected a digit after '.' in number");
    if (says("after exponent")) parse_fail(stop, "expected a digit in the exponent of number");
    if (error.id == 406) parse_fail(start, "number out of range");  // an overflow to infinity
    parse_fail(stop, echo(error.what()));
  }

  std::string_view text_;
  const Progress& progress_;
  Handler& handler_;
  std::vector<bool> open_;  // the arrays (true) and objects being read, outermost first
  size_t end_ = 0;          // one past the last byte of what the driver has seen
  Expect expect_ = Expect::Value;
};

// Builds the Json of a whole text.
class Builder final : public Handler {
 public:
  Json take() { return std::move(root_); }

  void scalar(Json value, size_t, size_t) override { place(std::move(value)); }
  void begin_object(size_t) override { open_.push_back({place(Json::object()), {}}); }
  void begin_array(size_t) override { open_.push_back({place(Json::array()), {}}); }
  void end_object(size_t) override { open_.pop_back(); }
  void end_array(size_t) override { open_.pop_back(); }
  void key(std::string key, size_t begin) override {
    if (!open_.back().keys.insert(key).second) duplicate_key(key, begin);
    key_ = std::move(key);
  }

 private:
  struct Open {
    Json* value;
    std::unordered_set<std::string> keys;  // of an object
  };

  Json* place(Json value) {
    if (open_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    Json& parent = *open_.back().value;
    if (parent.is_array()) {
      parent.get_ref<Json::array_t&>().push_back(std::move(value));
      return &parent.back();
    }
    return &append_member(parent, std::move(key_), std::move(value));  // key() refused a duplicate
  }

  Json root_;
  std::vector<Open> open_;  // the arrays and objects being built, outermost first
  std::string key_;         // of the object member whose value comes next
};

// nlohmann escapes '"', '\\' and control characters as mixtape's format has them (\n, \u001f, ...) and
// copies other UTF-8 as it is; invalid UTF-8 is refused first, with the byte that starts no sequence.
void check_utf8(std::string_view text) {
  for (size_t pos = 0; pos < text.size();) {
    const size_t length = utf8_sequence_length(text, pos);
    if (length == 0)
      fail("json: string is not valid UTF-8 (", describe_byte(static_cast<unsigned char>(text[pos])), " at byte ",
           pos, ")");
    pos += length;
  }
}

void dump_to(const Json& value, std::string& out) {
  switch (value.type()) {
    case Json::value_t::null: out += "null"; break;
    case Json::value_t::boolean: out += value.get<bool>() ? "true" : "false"; break;
    case Json::value_t::number_integer: out += std::to_string(value.get<int64_t>()); break;
    case Json::value_t::number_unsigned: out += std::to_string(value.get<uint64_t>()); break;
    case Json::value_t::number_float: {
      const double number = value.get<double>();
      check(std::isfinite(number), "json: cannot write the non-finite number ", number);
      // 17 significant digits: reads back as the same double. to_chars writes what "%.17g" writes in the C
      // locale, in every locale (snprintf writes the locale's decimal point).
      char buffer[32];
      const auto written = std::to_chars(buffer, buffer + sizeof buffer, number, std::chars_format::general, 17);
      out.append(buffer, written.ptr);
      break;
    }
    case Json::value_t::string:
      check_utf8(value.get_ref<const std::string&>());
      out += value.dump();
      break;
    case Json::value_t::array: {
      out += '[';
      bool first = true;
      for (const Json& item : value.get_ref<const Json::array_t&>()) {
        if (!first) out += ',';
        first = false;
        dump_to(item, out);
      }
      out += ']';
      break;
    }
    case Json::value_t::object: {
      out += '{';
      bool first = true;
      for (const auto& [key, member] : value.get_ref<const Json::object_t&>()) {
        if (!first) out += ',';
        first = false;
        out += quote(key);
        out += ':';
        dump_to(member, out);
      }
      out += '}';
      break;
    }
    default: fail("json: cannot write a JSON ", kind_name(value));
  }
}

[[noreturn]] void wrong_kind(const char* expected, const Json& got) {
  fail("json: expected ", expected, ", got ", kind_name(got));
}

}  // namespace

void parse(std::string_view text, Handler& handler, const Limits& limits) {
  Progress progress(text, limits.max_token_bytes);
  Driver driver(text, progress, handler);
  // nlohmann skips a UTF-8 byte order mark; strict JSON has none (and its first byte starts no value).
  if (!text.empty() && static_cast<unsigned char>(text[0]) == 0xEF)
    parse_fail(0, "unexpected ", describe_byte(0xEF), ", expected a value");
  Json::sax_parse(TrackedIterator(text.data(), &progress), TrackedIterator(text.data() + text.size(), &progress),
                  &driver);
  // nlohmann ends the text at a NUL byte outside strings.
  driver.expect_end();
}

Json parse(std::string_view text) {
  Builder builder;
  parse(text, builder);
  return builder.take();
}

void duplicate_key(std::string_view key, size_t at) {
  // Keys come from parsed text, so they are UTF-8; a cut falls between characters.
  size_t cut = 0;
  for (size_t characters = 0; cut < key.size() && characters < kEchoLimit; ++characters)
    cut += std::max<size_t>(utf8_sequence_length(key, cut), 1);
  std::string shown = quote(key.substr(0, cut));
  if (cut < key.size()) shown += "... (" + std::to_string(key.size()) + " bytes in all)";
  parse_fail(at, "duplicate key ", shown);
}

std::string excerpt(std::string_view value_text, size_t limit) {
  // Enough bytes for `limit` characters of up to 4 bytes each, and one more to know whether to cut.
  const size_t wanted = 4 * limit + 1;
  std::string compact;
  bool in_string = false, escaped = false;
  size_t pos = 0;
  for (; pos < value_text.size() && compact.size() < wanted; ++pos) {
    const char c = value_text[pos];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      continue;
    }
    compact += c;
  }
  std::string shown = echo(compact, limit);
  const bool cut = shown != echo(compact, SIZE_MAX);
  if (cut || pos < value_text.size()) {
    const std::string suffix = "... (" + std::to_string(compact.size()) + " bytes in all)";
    if (cut) shown.resize(shown.size() - suffix.size());
    shown += "... (" + std::to_string(value_text.size()) + " bytes in all)";
  }
  return shown;
}

std::string dump(const Json& value) {
  std::string out;
  dump_to(value, out);
  return out;
}

const char* kind_name(const Json& value) {
  switch (value.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return "bool";
    case Json::value_t::number_integer: return "integer";
    case Json::value_t::number_unsigned:
      return value.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX) ? "integer" : "number";
    case Json::value_t::number_float: return "number";
    case Json::value_t::string: return "string";
    case Json::value_t::array: return "array";
    case Json::value_t::object: return "object";
    case Json::value_t::binary: return "binary";
    case Json::value_t::discarded: return "discarded";
  }
  return "?";
}

bool as_bool(const Json& value) {
  if (!value.is_boolean()) wrong_kind("bool", value);
  return value.get<bool>();
}

int64_t as_integer(const Json& value) {
  const bool integer = value.is_number_integer() &&
                       (!value.is_number_unsigned() || value.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX));
  if (!integer) wrong_kind("integer", value);
  return value.get<int64_t>();
}

double as_number(const Json& value) {
  if (!value.is_number()) wrong_kind("number", value);
  return value.get<double>();
}

const std::string& as_string(const Json& value) {
  if (!value.is_string()) wrong_kind("string", value);
  return value.get_ref<const std::string&>();
}

const Json::array_t& as_array(const Json& value) {
  if (!value.is_array()) wrong_kind("array", value);
  return value.get_ref<const Json::array_t&>();
}

const Json::object_t& as_object(const Json& value) {
  if (!value.is_object()) wrong_kind("object", value);
  return value.get_ref<const Json::object_t&>();
}

const Json* find(const Json& object, std::string_view key) {
  for (const auto& [name, value] : as_object(object))
    if (name == key) return &value;
  return nullptr;
}

Json& append_member(Json& object, std::string key, Json value) {
  if (!object.is_object()) wrong_kind("object", object);
  Json::object_t::Container& members = object.get_ref<Json::object_t&>();
  return members.emplace_back(std::move(key), std::move(value)).second;
}

bool is_valid_utf8(std::string_view text) {
  for (size_t pos = 0; pos < text.size();) {
    const size_t length = utf8_sequence_length(text, pos);
    if (length == 0) return false;
    pos += length;
  }
  return true;
}

std::string quote(std::string_view text) {
  check_utf8(text);
  return Json(std::string(text)).dump();
}

}  // namespace mixtape::json
