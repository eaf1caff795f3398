#pragma once
// A small strict JSON (RFC 8259) reader and writer: enough for safetensors headers and checkpoint metadata.
// Strict means: no comments, no trailing commas, no leading zeros, no control characters or invalid UTF-8
// in strings, no lone surrogates, no duplicate object keys, nothing after the value but whitespace. Every
// error is a mixtape::Error "json: <problem> at byte <offset>", offset counted from the start of the text.
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace mixtape::json {

class Value {
 public:
  enum class Kind { Null, Bool, Integer, Number, String, Array, Object };
  using Array = std::vector<Value>;
  // Members keep the order they had in the text (or were added in): writers control the layout on disk.
  using Object = std::vector<std::pair<std::string, Value>>;

  Value() = default;  // null
  Value(std::nullptr_t) {}
  Value(bool value) : data_(value) {}
  Value(int value) : data_(int64_t{value}) {}
  Value(int64_t value) : data_(value) {}
  Value(double value) : data_(value) {}
  Value(const char* value) : data_(std::string(value)) {}
  Value(std::string value) : data_(std::move(value)) {}
  Value(Array value) : data_(std::move(value)) {}
  Value(Object value) : data_(std::move(value)) {}

  Kind kind() const { return static_cast<Kind>(data_.index()); }
  bool is_null() const { return kind() == Kind::Null; }
  bool is_bool() const { return kind() == Kind::Bool; }
  bool is_integer() const { return kind() == Kind::Integer; }  // a number written without fraction/exponent
  bool is_number() const { return kind() == Kind::Number; }  // any other number (or an integer past int64)
  bool is_string() const { return kind() == Kind::String; }
  bool is_array() const { return kind() == Kind::Array; }
  bool is_object() const { return kind() == Kind::Object; }

  // Accessors throw Error "json: expected <kind>, got <kind>" on the wrong kind.
  bool as_bool() const;
  int64_t as_integer() const;
  double as_number() const;  // integers convert
  const std::string& as_string() const;
  const Array& as_array() const;
  const Object& as_object() const;
  Array& as_array();
  Object& as_object();

  const Value* find(std::string_view key) const;  // objects only; null when absent

  // Compact text (no spaces), non-ASCII written as raw UTF-8, like Python's json.dumps(ensure_ascii=False,
  // separators=(",", ":")) and serde_json.
  std::string dump() const;

 private:
  std::variant<std::nullptr_t, bool, int64_t, double, std::string, Array, Object> data_;
};

const char* kind_name(Value::Kind kind);  // "null", "bool", "integer", "number", "string", "array", "object"

// Parses one JSON value. Nesting deeper than 256 levels is an error (so hostile input cannot overflow the
// stack). Numbers without fraction or exponent that fit int64 are Integer, other numbers are Number.
Value parse(std::string_view text);

// The JSON string literal for text, quotes included. Throws Error if text is not valid UTF-8.
std::string quote(std::string_view text);

// True when text is well-formed UTF-8 (no overlongs, no surrogates, nothing past U+10FFFF).
bool is_valid_utf8(std::string_view text);

}  // namespace mixtape::json
