// The strict JSON reader's event interface (json::Handler), its token limit, and how JSON from outside
// appears in error messages (json::excerpt, duplicate keys). The JSON grammar itself is specified in
// tests/test_safetensors.cpp.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "io/json.h"
#include "tests/test_util.h"

namespace mixtape {
namespace {

// The message of the Error `action` throws, or "" when it throws none.
template <class Action>
std::string error_of(Action action) {
  try {
    action();
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

// Writes each event as one line: its kind, the value or key, and the text it covers.
class Recorder final : public json::Handler {
 public:
  explicit Recorder(std::string_view text) : text_(text) {}
  std::vector<std::string> events;

  void scalar(Json value, size_t begin, size_t end) override {
    events.push_back("scalar " + json::dump(value) + " " + std::string(text_.substr(begin, end - begin)));
  }
  void begin_object(size_t begin) override { events.push_back("{ at " + std::to_string(begin)); }
  void key(std::string key, size_t begin) override {
    events.push_back("key " + key + " at " + std::to_string(begin));
  }
  void end_object(size_t end) override { events.push_back("} ends " + std::to_string(end)); }
  void begin_array(size_t begin) override { events.push_back("[ at " + std::to_string(begin)); }
  void end_array(size_t end) override { events.push_back("] ends " + std::to_string(end)); }

 private:
  std::string_view text_;
};

// Takes every event and keeps nothing.
class Ignorer final : public json::Handler {
 public:
  void scalar(Json, size_t, size_t) override {}
  void begin_object(size_t) override {}
  void key(std::string, size_t) override {}
  void end_object(size_t) override {}
  void begin_array(size_t) override {}
  void end_array(size_t) override {}
};

TEST(JsonHandler, SeesEachValueWithItsTextAsWritten) {
  const std::string text = " {\"a\" : [1, -20, 2.50, 1e2, \"x\\\"y\", true, null], \"b\":{}} ";
  Recorder recorder(text);
  json::parse(text, recorder);
  const std::vector<std::string> expected = {
      "{ at 1",
      "key a at 2",
      "[ at 8",
      "scalar 1 1",
      "scalar -20 -20",
      "scalar 2.5 2.50",  // the value as a double, the text as written
      "scalar 100 1e2",
      "scalar \"x\\\"y\" \"x\\\"y\"",
      "scalar true true",
      "scalar null null",
      "] ends 47",
      "key b at 49",
      "{ at 53",
      "} ends 55",
      "} ends 56",
  };
  EXPECT_EQ(recorder.events, expected);
}

TEST(JsonHandler, AStringAtTheStartOfTheTextStartsAtByte0) {
  // The text is a view whose first byte follows a backslash in memory: it escapes nothing.
  const std::string memory = "\\\"a\\\\\"";
  const std::string_view text = std::string_view(memory).substr(1);  // "a\\"
  Recorder recorder(text);
  json::parse(text, recorder);
  EXPECT_EQ(recorder.events, std::vector<std::string>{"scalar \"a\\\\\" \"a\\\\\""});
}

TEST(JsonHandler, TheParserLeavesDuplicateKeysToTheHandler) {
  const std::string text = "{\"k\":1,\"k\":2}";
  Recorder recorder(text);
  EXPECT_NO_THROW(json::parse(text, recorder));
  EXPECT_EQ(recorder.events[3], "key k at 7");
  // json::parse(text) building a Json refuses it, as a handler does with duplicate_key().
  EXPECT_ERROR_MENTIONS(json::parse(text), "json: duplicate key \"k\" at byte 7");
}

TEST(JsonHandler, SyntaxErrorsAreTheParsersWithTheSameOffsets) {
  Ignorer ignorer;
  EXPECT_ERROR_MENTIONS(json::parse("[1, 2,]", ignorer), "json: unexpected ']', expected a value at byte 6");
  EXPECT_ERROR_MENTIONS(json::parse("{\"a\":01}", ignorer), "json: leading zero in number at byte 5");
}

// Runs of whitespace reach nlohmann's lexer as one byte (it would keep a copy of all of them): every offset
// still counts each byte of the text.
TEST(Json, ErrorsAfterLongWhitespaceCountEveryByte) {
  const std::string pad(1000, ' ');
  struct Case {
    std::string text, problem;
    size_t offset;
  };
  const std::vector<Case> cases = {
      {"[" + pad + "\"a\nb\"]", "unescaped control character", 1003},
      {"[" + pad + "\"\xFF\"]", "invalid UTF-8", 1002},
      {"[" + pad + "\"\\x\"]", "invalid escape", 1002},
      {"[" + pad + "1.]", "expected a digit after '.'", 1003},
      {"[" + pad + "1e]", "expected a digit in the exponent", 1003},
      {"[" + pad + "01]", "leading zero", 1001},
      {"[" + pad + "1" + pad + "2]", "expected ',' or ']'", 2002},
      {"[" + pad + "1" + pad + "," + pad + "]", "expected a value", 3003},
      {"{" + pad + "\"a\"" + pad + "1}", "expected ':'", 2004},
      {"[1]" + pad + "x", "after the value", 1003},
      {"[" + pad + "\"abc", "to close the string", 1005},
      {"[" + pad + "1e999]", "number out of range", 1001},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.problem);
    EXPECT_ERROR_MENTIONS(json::parse(c.text), "json: ", c.problem, "at byte " + std::to_string(c.offset));
  }
  EXPECT_EQ(json::as_string(json::parse(pad + "\"a" + pad + "b\"" + pad)), "a" + pad + "b");  // kept in strings
}

TEST(Json, TokenLimitRefusesALongStringOrNumberAtItsStart) {
  Ignorer ignorer;
  const json::Limits limits{10};
  // Counted as written: quotes and escapes included, whitespace around not.
  EXPECT_NO_THROW(json::parse("[   \"12345678\"   , 1234567890, \"\\n\\n\\n\\n\"]", ignorer, limits));
  EXPECT_ERROR_MENTIONS(json::parse("[1, \"123456789\"]", ignorer, limits),
                        "json: a string or number longer than 10 bytes (the reader's limit) at byte 4");
  EXPECT_ERROR_MENTIONS(json::parse("{\"\\\\\\\\\\\\\\\\\\\\\":1}", ignorer, limits), "at byte 1");  // a key
  EXPECT_ERROR_MENTIONS(json::parse("[12345678901]", ignorer, limits), "longer than 10 bytes", "at byte 1");
  EXPECT_ERROR_MENTIONS(json::parse("[-1.5e+00001]", ignorer, limits), "longer than 10 bytes", "at byte 1");
  // Refused while the token is read, not after: a string that never ends is refused all the same.
  EXPECT_ERROR_MENTIONS(json::parse("\"" + std::string(1000, 'a'), ignorer, limits), "longer than 10 bytes");
  // Without limits (the default) any length is read.
  EXPECT_NO_THROW(json::parse("\"" + std::string(100000, 'a') + "\"", ignorer));
}

TEST(Json, ExcerptShowsAValueAsWrittenCompactAndBounded) {
  EXPECT_EQ(json::excerpt("[1, 2.0,\n  \"a b\",\ttrue]"), "[1,2.0,\"a b\",true]");
  EXPECT_EQ(json::excerpt("176000.0"), "176000.0");
  EXPECT_EQ(json::excerpt("\"caf\xC3\xA9\""), "\"caf\xC3\xA9\"");
  // Printable whatever it is given (echo(): control bytes and invalid UTF-8 escaped, a backslash doubled).
  EXPECT_EQ(json::excerpt("\"a\x01\xFF\\n\""), "\"a\\x01\\xff\\\\n\"");

  std::string zeros = "[0";
  for (int i = 1; i < 1'000'000; ++i) zeros += ",0";
  zeros += "]";
  std::string first_100_characters = "[";
  for (int i = 0; i < 49; ++i) first_100_characters += "0,";
  first_100_characters += "0";
  ASSERT_EQ(first_100_characters.size(), 100u);
  EXPECT_EQ(json::excerpt(zeros), first_100_characters + "... (2000001 bytes in all)");
  // The count is of the text as given, spaces included, also where the cut comes inside the compact text.
  EXPECT_EQ(json::excerpt("[" + std::string(200, ' ') + "1]", 3), "[1]");
  EXPECT_EQ(json::excerpt("[1,   2,   3]", 4), "[1,2... (13 bytes in all)");
}

TEST(Json, AnInvalidEscapeNamesAnUnprintableByteByItsValue) {
  EXPECT_ERROR_MENTIONS(json::parse("\"\\x\""), "json: invalid escape '\\x' in string at byte 1");
  for (const std::string& after : {std::string("\n"), std::string("\xC3"), std::string(1, '\0')}) {
    const std::string message = error_of([&] { json::parse("\"\\" + after + "\""); });
    char byte[8];
    std::snprintf(byte, sizeof byte, "0x%02x", static_cast<unsigned char>(after[0]));
    EXPECT_NE(message.find("json: invalid escape in string: '\\' followed by byte " + std::string(byte) + " at byte 1"),
              std::string::npos)
        << message;
    EXPECT_EQ(message.find(after[0]), std::string::npos) << "the byte itself is not in the message";
  }
}

TEST(Json, DuplicateKeyErrorCutsALongKey) {
  const std::string key(1'000'000, 'k');
  const std::string message = error_of([&] { json::parse("{\"" + key + "\":1,\"" + key + "\":2}"); });
  EXPECT_LT(message.size(), 300u) << message.substr(0, 300);
  EXPECT_NE(message.find("json: duplicate key \"" + std::string(100, 'k') + "\"... (1000000 bytes in all) at byte 1000006"),
            std::string::npos)
      << message;
  // A short key is written whole, as a JSON string.
  EXPECT_ERROR_MENTIONS(json::parse("{\"a\\n\":1,\"a\\n\":2}"), "duplicate key \"a\\n\" at byte 9");
}

}  // namespace
}  // namespace mixtape
