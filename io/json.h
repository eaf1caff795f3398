#pragma once
// JSON for safetensors headers, checkpoint metadata and logs: nlohmann::ordered_json values (members keep the
// order they were written or added in, so writers control the layout on disk), with a strict reader and a
// writer whose text is part of mixtape's file formats.
//
// Strict means (RFC 8259): no comments, no byte order mark, no trailing commas, no leading zeros, no
// control characters or invalid UTF-8 in strings, no lone surrogates, no duplicate object keys, no nesting
// deeper than 256 levels, nothing after the value but whitespace. Every reader error is a mixtape::Error
// "json: <problem> at byte <offset>", offset counted from the start of the text.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "tensor/error.h"

namespace mixtape {

using Json = nlohmann::ordered_json;

namespace json {

// Parses one JSON value. Numbers without fraction or exponent that fit int64 are integers (int64), other
// numbers are doubles (so a count past int64 is not an integer, and callers wanting a count reject it). A
// number that overflows a double, or rounds to 0 though its digits are not all 0, is an Error. The C
// library's locale (LC_NUMERIC) does not change how numbers read, nor how dump writes them.
Json parse(std::string_view text);

// What one parse accepts beyond the grammar and the fixed depth of 256. The parser holds the token it is
// reading (a string or number) several times over, and a copy of everything else it reads between two such
// tokens (brackets, commas, literals), so a reader of untrusted text bounds both.
struct Limits {
  // Of one string (quotes and escapes included) or number, as written, and of the text outside strings
  // between two strings or numbers (a run of whitespace counting one byte).
  size_t max_token_bytes = SIZE_MAX;
};

// The values of a strict parse as they are read, for readers that keep only part of a large text instead
// of a Json of all of it. Offsets count bytes from the start of the text. The parser keeps no keys: a
// handler refuses a duplicate key itself (duplicate_key()). An exception a handler throws ends the parse
// and reaches parse()'s caller unchanged.
class Handler {
 public:
  virtual ~Handler() = default;
  // A null, bool, number or string; text[begin, end) is its token as written (a string's quotes included).
  virtual void scalar(Json value, size_t begin, size_t end) = 0;
  virtual void begin_object(size_t begin) = 0;  // text[begin] is '{'
  virtual void key(std::string key, size_t begin) = 0;  // text[begin] is the key's opening quote
  virtual void end_object(size_t end) = 0;  // text[end - 1] is '}'
  virtual void begin_array(size_t begin) = 0;  // text[begin] is '['
  virtual void end_array(size_t end) = 0;  // text[end - 1] is ']'
};

// Parses one JSON value as parse(text) does, with the same errors, giving its values to handler. Past
// limits it throws Error "json: a string or number longer than N bytes (the reader's limit) at byte <start>"
// or "json: more than N bytes of JSON without a string or a number (the reader's limit) at byte <at>".
void parse(std::string_view text, Handler& handler, const Limits& limits = {});

// Throws the parser's Error for a key its object already has: "json: duplicate key "<key>" at byte <at>",
// the key written as a JSON string and cut after kEchoLimit characters.
[[noreturn]] void duplicate_key(std::string_view key, size_t at);

// The text of one JSON value as written (whitespace outside strings left out), for an error message:
// printable and, past `limit` characters, cut and followed by "... (N bytes in all)", N counting the text as
// given. Stops reading the text where it cuts.
std::string excerpt(std::string_view value_text, size_t limit = kEchoLimit);

// Compact text (no spaces), non-ASCII written as raw UTF-8, like Python's json.dumps(ensure_ascii=False,
// separators=(",", ":")) and serde_json. Doubles are written with 17 significant digits (the text of "%.17g"
// in the C locale: they read back as the same double); a non-finite double or a string that is not UTF-8 is
// an Error. The text is part of file formats: Json::dump writes doubles in another form ("0.1", "1.0" where
// this writes "0.10000000000000001", "1"), so mixtape writes JSON through this function only.
std::string dump(const Json& value);

// "null", "bool", "integer" (an int64, or a uint64 within int64's range), "number" (a double, or a uint64
// past int64, as parse reads one), "string", "array", "object".
const char* kind_name(const Json& value);

// Checked access: Error "json: expected <kind>, got <kind>" on the wrong kind.
bool as_bool(const Json& value);
int64_t as_integer(const Json& value);
double as_number(const Json& value);  // integers convert
const std::string& as_string(const Json& value);
const Json::array_t& as_array(const Json& value);
const Json::object_t& as_object(const Json& value);

const Json* find(const Json& object, std::string_view key);  // objects only; null when absent

// Appends the member key: value to an object without ordered_json's search for an existing key (that search
// makes an object of n members cost n^2), and returns the value in place. The caller guarantees that the
// object has no member named key: a second one would be written twice and found as the first.
Json& append_member(Json& object, std::string key, Json value);

// The JSON string literal for text, quotes included. Throws Error if text is not valid UTF-8.
std::string quote(std::string_view text);

// True when text is well-formed UTF-8 (no overlongs, no surrogates, nothing past U+10FFFF).
bool is_valid_utf8(std::string_view text);

}  // namespace json
}  // namespace mixtape
