// safetensors checkpoints and the JSON reader/writer under them. Layout references are bytes written out by
// hand from the format's specification (github.com/huggingface/safetensors), not produced by the code under
// test; corruption tests build broken files byte by byte and require an Error naming the file and problem.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cfloat>
#include <clocale>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "io/json.h"
#include "io/safetensors.h"
#include "tests/test_util.h"

namespace mixtape {
namespace {

namespace fs = std::filesystem;

// ============================================================================ JSON

TEST(Json, ParsesNestedObjectsArraysNumbersAndLiterals) {
  const Json value =
      json::parse(" {\"a\": [1, -2, 3.5, true, false, null, {\"b\": []}], \"c\": {}, \"d\": \"x\"} \n");
  ASSERT_TRUE(value.is_object());
  const auto& members = json::as_object(value);
  ASSERT_EQ(members.size(), 3u);
  EXPECT_EQ(members.begin()[0].first, "a");  // order kept as written
  EXPECT_EQ(members.begin()[1].first, "c");
  EXPECT_EQ(members.begin()[2].first, "d");
  const auto& a = json::as_array(*json::find(value, "a"));
  ASSERT_EQ(a.size(), 7u);
  EXPECT_EQ(json::as_integer(a[0]), 1);
  EXPECT_EQ(json::as_integer(a[1]), -2);
  EXPECT_STREQ(json::kind_name(a[2]), "number");
  EXPECT_EQ(json::as_number(a[2]), 3.5);
  EXPECT_TRUE(json::as_bool(a[3]));
  EXPECT_FALSE(json::as_bool(a[4]));
  EXPECT_TRUE(a[5].is_null());
  EXPECT_TRUE(json::as_array(*json::find(a[6], "b")).empty());
  EXPECT_TRUE(json::as_object(*json::find(value, "c")).empty());
  EXPECT_EQ(json::as_string(*json::find(value, "d")), "x");
  EXPECT_EQ(json::find(value, "missing"), nullptr);
  EXPECT_ERROR_MENTIONS(json::as_integer(*json::find(value, "d")), "expected integer", "got string");
  EXPECT_ERROR_MENTIONS(json::as_number(a[3]), "expected number", "got bool");
  EXPECT_ERROR_MENTIONS(json::find(a[0], "x"), "expected object", "got integer");
}

TEST(Json, NamesEachKind) {
  const Json value = json::parse(R"([null, true, 1, 1.5, "s", [], {}])");
  std::vector<std::string> kinds;
  for (const Json& item : json::as_array(value)) kinds.push_back(json::kind_name(item));
  EXPECT_EQ(kinds, (std::vector<std::string>{"null", "bool", "integer", "number", "string", "array", "object"}));
  // Built in code: an unsigned count is an integer while it fits int64.
  EXPECT_STREQ(json::kind_name(Json(uint64_t{7})), "integer");
  EXPECT_EQ(json::as_integer(Json(uint64_t{7})), 7);
  EXPECT_STREQ(json::kind_name(Json(uint64_t{1} << 63)), "number");
  EXPECT_ERROR_MENTIONS(json::as_integer(Json(uint64_t{1} << 63)), "expected integer", "got number");
}

TEST(Json, IntegersFitInt64AndOtherNumbersAreDoubles) {
  EXPECT_EQ(json::as_integer(json::parse("9223372036854775807")), INT64_MAX);
  EXPECT_EQ(json::as_integer(json::parse("-9223372036854775808")), INT64_MIN);
  EXPECT_EQ(json::as_integer(json::parse("-0")), 0);
  // One past int64: still a number, but not an integer, so callers wanting a count reject it.
  EXPECT_STREQ(json::kind_name(json::parse("9223372036854775808")), "number");
  EXPECT_STREQ(json::kind_name(json::parse("-9223372036854775809")), "number");
  EXPECT_EQ(json::as_number(json::parse("1e3")), 1000.0);
  EXPECT_STREQ(json::kind_name(json::parse("1e3")), "number");
  EXPECT_EQ(json::as_number(json::parse("-1.25E-2")), -0.0125);
  EXPECT_ERROR_MENTIONS(json::parse("1e400"), "number out of range at byte 0");
  EXPECT_ERROR_MENTIONS(json::parse("[1e-400]"), "number out of range at byte 1");  // underflow to zero
  EXPECT_ERROR_MENTIONS(json::parse("[0.5e-400]"), "number out of range at byte 1");
  EXPECT_ERROR_MENTIONS(json::parse("[-1.5e999]"), "number out of range at byte 1");
  // Zero written with any exponent is zero, and a subnormal is a number (not an underflow).
  EXPECT_EQ(json::as_number(json::parse("0.000e-999")), 0.0);
  EXPECT_TRUE(std::signbit(json::as_number(json::parse("-0.0E+5"))));
  EXPECT_EQ(json::as_number(json::parse("4.9406564584124654e-324")), 4.9406564584124654e-324);
  EXPECT_EQ(json::as_number(json::parse("2.2250738585072009e-308")), 2.2250738585072009e-308);
}

TEST(Json, DecodesEveryEscapeIncludingSurrogatePairs) {
  const std::string text = R"("\" \\ \/ \b \f \n \r \t \u0041 \u00e9 \u20AC \ud83d\ude00 \uD834\uDD1E")";
  const std::string expected =
      "\" \\ / \b \f \n \r \t A \xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80 \xF0\x9D\x84\x9E";
  EXPECT_EQ(json::as_string(json::parse(text)), expected);
  // Raw UTF-8 passes through unchanged.
  EXPECT_EQ(json::as_string(json::parse("\"caf\xC3\xA9 \xF0\x9F\x98\x80\"")), "caf\xC3\xA9 \xF0\x9F\x98\x80");
}

TEST(Json, RejectsMalformedTextNamingTheProblemAndByteOffset) {
  struct Case {
    std::string text, problem;
    size_t offset;
  };
  const std::vector<Case> cases = {
      {"", "unexpected end of input", 0},
      {"[1,]", "expected a value", 3},
      {"{\"a\":1,}", "expected a string key", 7},
      {"{\"a\" 1}", "expected ':'", 5},
      {"{\"a\":1 \"b\":2}", "expected ',' or '}'", 7},
      {"[1 2]", "expected ',' or ']'", 3},
      {"01", "leading zero", 0},
      {"-", "expected a digit", 1},
      {"1.", "expected a digit after '.'", 2},
      {"1e", "expected a digit in the exponent", 2},
      {"tru", "invalid literal", 0},
      {"nan", "invalid literal", 0},
      {"'a'", "expected a value", 0},
      {"[1] x", "after the value", 4},
      {"\"abc", "to close the string", 4},
      {"\"a\nb\"", "unescaped control character", 2},
      {"\"\\x\"", "invalid escape", 1},
      {"\"\\u12G4\"", "invalid hex digit", 5},
      {"\"ab\\udc00\"", "lone low surrogate", 3},
      {"\"\\ud800\"", "not followed by a low surrogate", 1},
      {"\"\\ud800\\u0041\"", "not followed by a low surrogate", 1},
      {"\"\xFF\"", "invalid UTF-8", 1},
      {"\"\xC0\xAF\"", "invalid UTF-8", 1},          // overlong '/'
      {"\"\xED\xA0\x80\"", "invalid UTF-8", 1},      // an encoded surrogate
      {"\"\xE2\x82\"", "invalid UTF-8", 1},          // truncated sequence
      {"{\"k\":1,\"k\":2}", "duplicate key \"k\"", 7},
      {"[{\"a\":{\"a\":1,\"a\":2}}]", "duplicate key \"a\"", 13},
      {"{\"\\u00e9\":1,\"\xC3\xA9\":2}", "duplicate key \"\xC3\xA9\"", 12},  // the same key, escaped or not
      {"{\"a\\\"\":1,\"a\\\"\":2}", "duplicate key \"a\\\"\"", 9},
      {"[", "unexpected end of input, expected a value or ']'", 1},
      {"[1,", "unexpected end of input, expected a value", 3},
      {"[1", "unexpected end of input, expected ',' or ']'", 2},
      {"{", "unexpected end of input, expected a key or '}'", 1},
      {"{\"a\":1,", "unexpected end of input, expected a key", 7},
      {"{\"a\"", "unexpected end of input, expected ':'", 4},
      {"{\"a\":1", "unexpected end of input, expected ',' or '}'", 6},
      {"\"\\", "unexpected end of input, expected an escape character", 2},
      {"\"\\u12", "unexpected end of input, expected a hex digit", 5},
      {"\"\\ud800\\u00zz\"", "invalid hex digit 'z' in \\u escape", 11},
      {"\"\\uD800\\uDBFF\"", "high surrogate \\uD800 not followed by a low surrogate", 1},
      {"-01", "leading zero in number", 0},
      {"[1 true]", "unexpected 't' in array, expected ',' or ']'", 3},
      {"{\"a\":tru}", "invalid literal, expected 'true'", 5},
      {"/* c */ 1", "unexpected '/', expected a value", 0},
      {"\xEF\xBB\xBF{}", "unexpected byte 0xef, expected a value", 0},  // no byte order mark
      {std::string("{}\0", 3), "unexpected byte 0x00 after the value", 2},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    EXPECT_ERROR_MENTIONS(json::parse(c.text), "json: ", c.problem, "at byte " + std::to_string(c.offset));
  }
}

TEST(Json, LimitsNestingDepthInsteadOfOverflowingTheStack) {
  EXPECT_NO_THROW(json::parse(std::string(256, '[') + std::string(256, ']')));
  EXPECT_ERROR_MENTIONS(json::parse(std::string(100000, '[')), "json: nesting deeper than 256 levels at byte 256");
  // Objects count as levels too; the error names the first bracket past the limit.
  EXPECT_ERROR_MENTIONS(json::parse(std::string(256, '[') + "{\"a\":1}" + std::string(256, ']')),
                        "nesting deeper than 256 levels at byte 256");
  EXPECT_ERROR_MENTIONS(json::parse("{\"a\": " + std::string(300, '[')), "nesting deeper than 256 levels at byte 261");
}

TEST(Json, WriterEscapesAndRoundTrips) {
  EXPECT_EQ(json::quote("a\"b\\c\n\t\x01\x1f/\xC3\xA9\x7f"), "\"a\\\"b\\\\c\\n\\t\\u0001\\u001f/\xC3\xA9\x7f\"");
  EXPECT_ERROR_MENTIONS(json::quote("ok\xFF"), "json: string is not valid UTF-8 (byte 0xff at byte 2)");
  EXPECT_ERROR_MENTIONS(json::dump(Json("\xE2\x82")), "not valid UTF-8 (byte 0xe2 at byte 0)");
  Json object = Json::object();
  object["s"] = "x\"\n\xF0\x9F\x98\x80";
  object["i"] = int64_t{-42};
  object["d"] = 0.1;
  object["a"] = Json::array({true, nullptr});
  object["e"] = Json::object();
  const std::string text = json::dump(object);
  EXPECT_EQ(text, "{\"s\":\"x\\\"\\n\xF0\x9F\x98\x80\",\"i\":-42,\"d\":0.10000000000000001,\"a\":[true,null],"
                  "\"e\":{}}");
  const Json back = json::parse(text);
  EXPECT_EQ(json::as_string(*json::find(back, "s")), "x\"\n\xF0\x9F\x98\x80");
  EXPECT_EQ(json::as_integer(*json::find(back, "i")), -42);
  EXPECT_EQ(json::as_number(*json::find(back, "d")), 0.1);  // 17 digits read back as the same double
  EXPECT_EQ(json::dump(back), text);
}

TEST(Json, WritesNumbersWithSeventeenDigitsAndRefusesNonFiniteOnes) {
  EXPECT_EQ(json::dump(Json::array({1.0, -0.0, 1e300, 5e-324, 0.5, int64_t{7}, uint64_t{1} << 63, -3})),
            "[1,-0,1.0000000000000001e+300,4.9406564584124654e-324,0.5,7,9223372036854775808,-3]");
  EXPECT_ERROR_MENTIONS(json::dump(Json::array({NAN})), "json: cannot write the non-finite number nan");
  EXPECT_ERROR_MENTIONS(json::dump(Json(-INFINITY)), "json: cannot write the non-finite number -inf");
}

// The text "%.17g" writes in the C locale, which json::dump writes for a double.
std::string c_locale_17g(double x) {
  char buffer[40];
  std::snprintf(buffer, sizeof buffer, "%.17g", x);
  return buffer;
}

// Doubles over the whole range: special values and finite bit patterns from a fixed seed.
std::vector<double> many_doubles() {
  std::vector<double> values = {0.0, -0.0, 1.0, -1.0, 0.1, 1.5, 1e21, 1e22, 123456789012345678.0, 1e-5, 1e-4,
                                9.9999999999999995e-05, 1e16, 1e17, 4.9406564584124654e-324, DBL_MAX, -DBL_MAX,
                                DBL_MIN, DBL_EPSILON, 2.5, 0.3, 100, 1e300};
  std::mt19937_64 bits(2024);
  while (values.size() < 200000) {
    const uint64_t b = bits();
    double x;
    std::memcpy(&x, &b, sizeof x);
    if (std::isfinite(x)) values.push_back(x);
  }
  std::mt19937_64 small(7);  // short decimals and integers, where "%g" drops zeros and switches forms
  for (int i = 0; i < 20000; ++i)
    values.push_back(static_cast<double>(static_cast<int64_t>(small() % 2000001) - 1000000) /
                     std::pow(10.0, static_cast<double>(small() % 30)));
  return values;
}

TEST(Json, WritesEveryDoubleAsPercent17gInTheCLocale) {
  ASSERT_STREQ(std::localeconv()->decimal_point, ".");  // the tests run in the C locale
  for (double x : many_doubles()) {
    const std::string expected = c_locale_17g(x);
    ASSERT_EQ(json::dump(Json(x)), expected) << "bits of " << expected;
  }
}

// LC_NUMERIC switched to a locale whose decimal point is ',' while alive (an installed one, or one built by
// localedef into a temporary directory named by LOCPATH), restored afterwards; name() is empty when there is
// none to be had.
class CommaDecimalLocale {
 public:
  CommaDecimalLocale() : saved_(std::setlocale(LC_NUMERIC, nullptr)) {
    if (const char* locpath = std::getenv("LOCPATH")) saved_locpath_ = locpath;
    for (const char* name : {"de_DE.UTF-8", "de_DE.utf8", "fr_FR.UTF-8", "fr_FR.utf8", "nl_NL.UTF-8", "ru_RU.UTF-8"})
      if (use(name)) return;
    std::string pattern = (fs::temp_directory_path() / "mixtape_locale_XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) return;
    built_ = pattern;
    const std::string command = "localedef -c -i de_DE -f UTF-8 '" + built_ + "/de_DE.UTF-8' >/dev/null 2>&1";
    if (std::system(command.c_str()) == -1) return;
    ::setenv("LOCPATH", built_.c_str(), 1);
    use("de_DE.UTF-8");
  }
  ~CommaDecimalLocale() {
    std::setlocale(LC_NUMERIC, saved_.c_str());
    if (saved_locpath_) ::setenv("LOCPATH", saved_locpath_->c_str(), 1);
    else ::unsetenv("LOCPATH");
    std::error_code ignored;
    if (!built_.empty()) fs::remove_all(built_, ignored);
  }
  CommaDecimalLocale(const CommaDecimalLocale&) = delete;
  CommaDecimalLocale& operator=(const CommaDecimalLocale&) = delete;

  const std::string& name() const { return name_; }

 private:
  bool use(const char* name) {
    if (std::setlocale(LC_NUMERIC, name) == nullptr) return false;
    if (std::string(std::localeconv()->decimal_point) == ",") return name_ = name, true;
    std::setlocale(LC_NUMERIC, saved_.c_str());
    return false;
  }

  std::string saved_;
  std::optional<std::string> saved_locpath_;
  std::string built_;  // the temporary directory of a locale built here
  std::string name_;
};

TEST(Json, ReadsAndWritesNumbersTheSameUnderACommaDecimalLocale) {
  const std::vector<double> values = many_doubles();
  std::vector<std::string> expected;
  for (double x : values) expected.push_back(c_locale_17g(x));
  const std::string text = "[1.5,-0.25,1e3,2.5E-3,0.1,1.0000000000000001e+300]";
  const Json in_c_locale = json::parse(text);

  const CommaDecimalLocale comma;
  if (comma.name().empty())
    GTEST_SKIP() << "no locale with a decimal comma is installed and localedef could not build de_DE.UTF-8; "
                    "WritesEveryDoubleAsPercent17gInTheCLocale checks the writer's format";
  char printed[16];
  std::snprintf(printed, sizeof printed, "%.1f", 1.5);
  ASSERT_STREQ(printed, "1,5") << comma.name() << " is in effect";

  const Json parsed = json::parse(text);
  EXPECT_EQ(parsed, in_c_locale);
  EXPECT_EQ(json::as_number(parsed[0]), 1.5);
  EXPECT_EQ(json::as_number(parsed[4]), 0.1);
  // JSON's decimal point is '.' whatever the locale.
  EXPECT_ERROR_MENTIONS(json::parse("1,5"), "json: unexpected ',' after the value at byte 1");
  EXPECT_EQ(json::as_array(json::parse("[1,5]")).size(), 2u);
  EXPECT_ERROR_MENTIONS(json::parse("[1e-400]"), "json: number out of range at byte 1");
  EXPECT_ERROR_MENTIONS(json::parse("1.5e999"), "json: number out of range at byte 0");
  EXPECT_EQ(json::as_number(json::parse("0.0e-999")), 0.0);
  EXPECT_EQ(json::dump(parsed), "[1.5,-0.25,1000,0.0025000000000000001,0.10000000000000001,"
                                "1.0000000000000001e+300]");
  for (size_t i = 0; i < values.size(); ++i) ASSERT_EQ(json::dump(Json(values[i])), expected[i]);
}

TEST(Json, AppendMemberAddsAtTheEndWithoutSearching) {
  Json object = Json::object();
  json::append_member(object, "b", 1);
  Json& added = json::append_member(object, "a", Json::array());
  added.push_back(2);
  EXPECT_EQ(json::dump(object), "{\"b\":1,\"a\":[2]}");
  EXPECT_EQ(json::as_integer(*json::find(object, "b")), 1);
  Json array = Json::array();
  EXPECT_ERROR_MENTIONS(json::append_member(array, "x", 1), "json: expected object, got array");
}

// ============================================================================ safetensors helpers

// A fresh directory per test, removed afterwards.
class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "mixtape_safetensors_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::permissions(dir_, fs::perms::owner_all, ignored);
    fs::remove_all(dir_, ignored);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::vector<std::string> directory_listing() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir_)) names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
  fs::path dir_;
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good());
}

// The 8-byte little-endian length, spelled out byte by byte.
std::string le64(uint64_t value) {
  std::string bytes;
  for (int i = 0; i < 8; ++i) bytes += static_cast<char>((value >> (8 * i)) & 0xFF);
  return bytes;
}

// A whole file: length, header as given (no padding added), data.
std::string file_bytes(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

// The little-endian bytes of float values, from their IEEE-754 bit patterns.
std::string f32_bytes(std::initializer_list<uint32_t> bit_patterns) {
  std::string bytes;
  for (uint32_t bits : bit_patterns)
    for (int i = 0; i < 4; ++i) bytes += static_cast<char>((bits >> (8 * i)) & 0xFF);
  return bytes;
}

std::string tensor_bytes(const Tensor& t) {
  const Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.numel() * dtype_size(c.dtype()));
}

// ============================================================================ round trips

TEST_F(Safetensors, RoundTripsAllSixDtypesScalarsEmptyTensorsAndMetadata) {
  StateDict state;
  state.tensors["f32"] = Tensor::randn({3, 4}, 1, DType::F32);
  state.tensors["f16"] = Tensor::randn({5}, 2, DType::F16);
  state.tensors["bf16"] = Tensor::randn({2, 3, 2}, 3, DType::BF16);
  state.tensors["f64"] = Tensor::randn({7}, 4, DType::F64);
  state.tensors["i32"] = Tensor::from_vector(std::vector<int32_t>{INT32_MIN, -1, 0, INT32_MAX}, {2, 2});
  state.tensors["i64"] = Tensor::from_vector(std::vector<int64_t>{INT64_MIN, -1, INT64_MAX}, {3});
  state.tensors["scalar"] = Tensor::scalar(2.5, DType::F64);
  state.tensors["empty"] = Tensor::empty({0, 3}, DType::BF16);
  state.tensors["empty.1d"] = Tensor::empty({0}, DType::I32);
  state.tensors["transposed"] = Tensor::randn({3, 5}, 5, DType::F32).mT();  // saved contiguous
  state.tensors["transformer.h.0.ln_1.weight"] = Tensor::ones({8});
  state.metadata["config"] = "{\"n_layer\": 4, \"path\": \"C:\\\\x\"}";
  state.metadata["vocab"] = "\n\t\"\\ \x01\x1f caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80";
  state.metadata["unicode key \xE6\x97\xA5\xE6\x9C\xAC"] = "";
  state.metadata[""] = "empty key";

  const std::string file = path("model.safetensors");
  save_safetensors(file, state);
  const StateDict back = load_safetensors(file);

  EXPECT_EQ(back.metadata, state.metadata);
  ASSERT_EQ(back.tensors.size(), state.tensors.size());
  for (const auto& [name, tensor] : state.tensors) {
    SCOPED_TRACE(name);
    ASSERT_EQ(back.tensors.count(name), 1u);
    const Tensor& loaded = back.tensors.at(name);
    EXPECT_EQ(loaded.dtype(), tensor.dtype());
    EXPECT_EQ(loaded.shape(), tensor.shape());
    EXPECT_TRUE(loaded.is_contiguous());
    EXPECT_EQ(tensor_bytes(loaded), tensor_bytes(tensor));  // bit-exact, NaN payloads and -0 included
  }
  EXPECT_EQ(back.tensors.at("scalar").dim(), 0);
  EXPECT_EQ(back.tensors.at("scalar").item(), 2.5);
  EXPECT_EQ(directory_listing(), std::vector<std::string>{"model.safetensors"});  // no temp file left
}

TEST_F(Safetensors, EmptyStateDictRoundTrips) {
  const std::string file = path("empty.safetensors");
  save_safetensors(file, StateDict{});
  // "{}" padded with six spaces to 8 bytes, and no data.
  EXPECT_EQ(read_bytes(file), le64(8) + "{}      ");
  const StateDict back = load_safetensors(file);
  EXPECT_TRUE(back.tensors.empty());
  EXPECT_TRUE(back.metadata.empty());
}

// ============================================================================ layout, byte for byte

TEST_F(Safetensors, WritesTheReferenceLayoutByteForByte) {
  StateDict state;
  state.tensors["a"] = Tensor::from_vector(std::vector<float>{1.0f, 2.0f}, {2});
  const std::string file = path("a.safetensors");
  save_safetensors(file, state);
  // What Python's safetensors.torch.save_file({"a": torch.tensor([1.0, 2.0])}) writes: compact JSON of 54
  // bytes padded with 2 spaces to 56 (a multiple of 8), then 1.0f = 0x3f800000 and 2.0f = 0x40000000.
  const std::string header = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}  ";
  ASSERT_EQ(header.size(), 56u);
  const std::string expected = std::string("\x38\0\0\0\0\0\0\0", 8) + header +
                               std::string("\x00\x00\x80\x3f\x00\x00\x00\x40", 8);
  EXPECT_EQ(read_bytes(file), expected);
}

TEST_F(Safetensors, OrdersTensorsLikeTheReferenceWriterAndPutsMetadataFirst) {
  // The reference orders by dtype (I64 before F16) then name, so "b" (I64) precedes "a" (F16) and every
  // tensor starts at a multiple of its element size.
  StateDict state;
  state.tensors["a"] = Tensor::from_vector(std::vector<float>{1.0f, -2.0f, 0.5f}, {3}, DType::F16);
  state.tensors["b"] = Tensor::from_vector(std::vector<int64_t>{258}, {1});
  state.metadata["format"] = "pt";
  const std::string file = path("ab.safetensors");
  save_safetensors(file, state);
  const std::string header =
      "{\"__metadata__\":{\"format\":\"pt\"},"
      "\"b\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]},"
      "\"a\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[8,14]}}     ";  // 139 + 5 spaces
  ASSERT_EQ(header.size(), 144u);
  // 258 = 0x0102 as int64 LE; f16 1.0 = 0x3c00, -2.0 = 0xc000, 0.5 = 0x3800.
  const std::string data =
      std::string("\x02\x01\0\0\0\0\0\0", 8) + std::string("\x00\x3c\x00\xc0\x00\x38", 6);
  EXPECT_EQ(read_bytes(file), le64(144) + header + data);
}

TEST_F(Safetensors, LoadsAHandMadeFileInTheReferenceLayout) {
  const std::string file = path("reference.safetensors");
  const std::string header = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}  ";
  write_bytes(file, file_bytes(header, f32_bytes({0x3f800000, 0x40000000})));
  const StateDict state = load_safetensors(file);
  ASSERT_EQ(state.tensors.size(), 1u);
  const Tensor& a = state.tensors.at("a");
  EXPECT_EQ(a.dtype(), DType::F32);
  EXPECT_EQ(a.shape(), (Shape{2}));
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{1.0f, 2.0f}));
  EXPECT_TRUE(state.metadata.empty());
}

TEST_F(Safetensors, LoadsOtherWritersLayoutsUnpaddedPrettyPrintedAndInAnyKeyOrder) {
  // Keys in any order, whitespace anywhere, metadata last, tensors listed out of offset order, extra keys
  // in an entry ignored (as the reference reader does), no padding.
  const std::string header =
      "{\n  \"y\": {\"data_offsets\": [4, 12], \"shape\": [1, 2], \"dtype\": \"F32\", \"note\": 1},\n"
      "  \"x\": {\"dtype\": \"I32\", \"shape\": [], \"data_offsets\": [0, 4]},\n"
      "  \"__metadata__\": {\"step\": \"7\"}\n}";
  const std::string file = path("pretty.safetensors");
  write_bytes(file, file_bytes(header, std::string("\x05\0\0\0", 4) + f32_bytes({0xbf800000, 0x3e800000})));
  const StateDict state = load_safetensors(file);
  EXPECT_EQ(state.tensors.at("x").dim(), 0);
  EXPECT_EQ(state.tensors.at("x").item(), 5);
  EXPECT_EQ(state.tensors.at("y").to_vector<float>(), (std::vector<float>{-1.0f, 0.25f}));
  EXPECT_EQ(state.metadata.at("step"), "7");
}

// ============================================================================ corruption

class SafetensorsCorrupt : public Safetensors {
 protected:
  // Writes bytes to a file and expects loading it to fail naming the file and every part.
  template <class... Parts>
  void expect_load_error(const std::string& bytes, const Parts&... parts) {
    const std::string file = path("bad.safetensors");
    write_bytes(file, bytes);
    EXPECT_ERROR_MENTIONS(load_safetensors(file), "load_safetensors", file, parts...);
  }
  // A file with one F32 tensor "x" described by entry (the JSON object text) and the given data size.
  void expect_entry_error(const std::string& entry, size_t data_size, const std::string& problem) {
    SCOPED_TRACE(entry);
    expect_load_error(file_bytes("{\"x\":" + entry + "}", std::string(data_size, '\0')), problem);
  }
};

TEST_F(SafetensorsCorrupt, MissingFileOrDirectoryIsAnError) {
  const std::string missing = path("missing.safetensors");
  EXPECT_ERROR_MENTIONS(load_safetensors(missing), missing, "cannot open", "No such file or directory");
  EXPECT_ERROR_MENTIONS(load_safetensors(dir_.string()), dir_.string(), "not a regular file");
}

TEST_F(SafetensorsCorrupt, AFifoIsRefusedAtOnceNotWaitedOn) {
  // Opening a FIFO for reading waits for a writer: the loader opens without waiting and refuses it.
  const std::string fifo = path("fifo.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  EXPECT_ERROR_MENTIONS(load_safetensors(fifo), fifo, "not a regular file");
}

TEST_F(SafetensorsCorrupt, ShortFilesAndBadHeaderLengths) {
  expect_load_error("", "the file is 0 bytes, shorter than the 8-byte header length");
  expect_load_error(std::string("\x02\0\0\0", 4), "the file is 4 bytes");
  expect_load_error(le64(100) + "{}", "header length 100 is larger than the 2 bytes after the length field");
  expect_load_error(le64(100'000'001) + "{}", "header length 100000001 exceeds the limit of 100000000 bytes");
  expect_load_error(le64(UINT64_MAX) + "{}", "exceeds the limit");
}

TEST_F(SafetensorsCorrupt, InvalidJsonGivesItsOffset) {
  expect_load_error(file_bytes("{\"x\":{\"dtype\":\"F32\",}}", ""), "invalid JSON header", "at byte 20");
  expect_load_error(file_bytes("{\"x\":\"\xFF\"}", ""), "invalid JSON header", "invalid UTF-8", "at byte 6");
  expect_load_error(file_bytes(std::string("{}\0\0", 4), ""), "invalid JSON header", "at byte 2");
  expect_load_error(file_bytes("[]", ""), "the header is a JSON array, not an object");
}

TEST_F(SafetensorsCorrupt, DuplicateKeysAreRejected) {
  const std::string entry = "{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}";
  expect_load_error(file_bytes("{\"x\":" + entry + ",\"x\":" + entry + "}", std::string(4, '\0')),
                    "duplicate key \"x\"");
  expect_load_error(file_bytes("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", ""), "duplicate key \"k\"");
}

TEST_F(SafetensorsCorrupt, EntriesMissingFieldsOrWithBadTypes) {
  expect_entry_error("{\"shape\":[1],\"data_offsets\":[0,4]}", 4, "tensor 'x' lacks \"dtype\"");
  expect_entry_error("{\"dtype\":\"F32\",\"data_offsets\":[0,4]}", 4, "tensor 'x' lacks \"shape\"");
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[1]}", 4, "tensor 'x' lacks \"data_offsets\"");
  expect_entry_error("[1]", 0, "header entry of tensor 'x' is a JSON array, expected an object");
  expect_entry_error("{\"dtype\":32,\"shape\":[1],\"data_offsets\":[0,4]}", 4, "dtype of tensor 'x' is 32");
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":4,\"data_offsets\":[0,4]}", 4, "shape of tensor 'x' is 4");
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}", 4,
                     "data_offsets of tensor 'x' is [0], expected [begin, end]");
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":{}}", 4,
                     "data_offsets of tensor 'x'");
}

TEST_F(SafetensorsCorrupt, UnsupportedDtypesAreNamed) {
  expect_entry_error("{\"dtype\":\"F8_E4M3\",\"shape\":[4],\"data_offsets\":[0,4]}", 4,
                     "not supported: dtype F8_E4M3 in tensor 'x'");
  expect_entry_error("{\"dtype\":\"BOOL\",\"shape\":[4],\"data_offsets\":[0,4]}", 4,
                     "not supported: dtype BOOL in tensor 'x'");
  expect_entry_error("{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}", 4,
                     "not supported: dtype f32 in tensor 'x'");  // names are case-sensitive
}

TEST_F(SafetensorsCorrupt, ShapesMustBeNonNegativeIntegers) {
  const std::string tail = ",\"data_offsets\":[0,4]}";
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[-1]" + tail, 4, "shape of tensor 'x' has the entry -1");
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[1.5]" + tail, 4, "shape of tensor 'x' has the entry 1.5");
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[1e0]" + tail, 4,
                     "shape of tensor 'x' has the entry 1e0 (written with a fraction or an exponent");
  // More dimensions than any tensor has (a hostile header's millions of 1s): refused before being copied.
  std::string ones = "1";
  for (int i = 0; i < 64; ++i) ones += ",1";
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[" + ones + "]" + tail, 4,
                     "shape of tensor 'x' has 65 dimensions, more than the 64 this reader accepts");
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[\"1\"]" + tail, 4,
                     "shape of tensor 'x' has the entry \"1\"");
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[null]" + tail, 4, "expected a non-negative integer");
  // Extents whose product overflows must not wrap around to a size that matches the offsets.
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296]" + tail, 4,
                     "too large");
  expect_entry_error("{\"dtype\":\"F64\",\"shape\":[2305843009213693952]" + tail, 4, "too large");
}

TEST_F(SafetensorsCorrupt, OffsetsMustMatchTheTensorAndStayInTheDataRegion) {
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}", 4,
                     "tensor 'x' has data_offsets [0, 4] (4 bytes) but F32 [2] needs 8 bytes");
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,8]}", 8,
                     "(8 bytes) but F32 [1] needs 4 bytes");
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]}", 8, "end before they begin");
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}", 4,
                     "data_offsets of tensor 'x' has the entry -4");
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 4,
                     "data_offsets [0, 8] of tensor 'x' are outside the data region of 4 bytes");
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}", 6,
                     "the data region is 6 bytes but the tensors end at byte 4 (trailing bytes)");
}

TEST_F(SafetensorsCorrupt, OverlapsAndGapsAreRejected) {
  auto entry = [](const char* name, int begin, int end) {
    return std::string("\"") + name + "\":{\"dtype\":\"I32\",\"shape\":[" +
           std::to_string((end - begin) / 4) + "],\"data_offsets\":[" + std::to_string(begin) + "," +
           std::to_string(end) + "]}";
  };
  expect_load_error(file_bytes("{" + entry("a", 0, 8) + "," + entry("b", 4, 12) + "}", std::string(12, '\0')),
                    "tensor 'b' at data_offsets [4, 12] overlaps the tensor before it, which ends at 8");
  expect_load_error(file_bytes("{" + entry("a", 0, 8) + "," + entry("b", 0, 8) + "}", std::string(8, '\0')),
                    "overlaps");
  expect_load_error(file_bytes("{" + entry("a", 0, 4) + "," + entry("b", 8, 12) + "}", std::string(12, '\0')),
                    "gap in the data: no tensor covers bytes [4, 8) before tensor 'b'");
  expect_load_error(file_bytes("{" + entry("a", 4, 8) + "}", std::string(8, '\0')),
                    "no tensor covers bytes [0, 4)");
  // An empty tensor inside another one is an overlap too; at a boundary it is fine.
  expect_load_error(file_bytes("{" + entry("a", 0, 8) + "," + entry("e", 4, 4) + "}", std::string(8, '\0')),
                    "tensor 'e' at data_offsets [4, 4] overlaps");
  const std::string fine = path("fine.safetensors");
  write_bytes(fine, file_bytes("{" + entry("a", 0, 8) + "," + entry("e", 8, 8) + "}", std::string(8, '\0')));
  EXPECT_EQ(load_safetensors(fine).tensors.at("e").numel(), 0);
}

TEST_F(SafetensorsCorrupt, MetadataValuesMustBeStrings) {
  expect_load_error(file_bytes("{\"__metadata__\":{\"step\":7}}", ""),
                    "__metadata__ value of 'step' is a JSON integer (7), expected a string");
  expect_load_error(file_bytes("{\"__metadata__\":{\"a\":\"ok\",\"b\":null}}", ""),
                    "value of 'b' is a JSON null");
  expect_load_error(file_bytes("{\"__metadata__\":[\"a\"]}", ""), "__metadata__ is a JSON array");
}

// ============================================================================ what errors repeat

// The message of the Error loading `bytes` throws, or "" when the load succeeds.
std::string load_error(const std::string& file, const std::string& bytes) {
  write_bytes(file, bytes);
  try {
    load_safetensors(file);
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

// "[0,0,...,0]" of n zeros: 2n + 1 bytes.
std::string zeros_array(size_t n) {
  std::string text = "[0";
  for (size_t i = 1; i < n; ++i) text += ",0";
  return text + "]";
}

TEST_F(SafetensorsCorrupt, NumbersAreRepeatedAsWritten) {
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,176000.0]}", 4,
                     "data_offsets of tensor 'x' has the entry 176000.0 (written with a fraction or an exponent, "
                     "or beyond int64), expected a non-negative integer");
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[4.0E0],\"data_offsets\":[0,16]}", 16,
                     "shape of tensor 'x' has the entry 4.0E0 (written with");
  expect_entry_error("{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,9223372036854775808]}", 4,
                     "has the entry 9223372036854775808 (written with a fraction or an exponent, or beyond int64)");
}

TEST_F(SafetensorsCorrupt, LongValuesAreCutInMessages) {
  const std::string file = path("bad.safetensors");
  const std::string zeros = zeros_array(200'000);  // 400,001 bytes
  const std::string first_100 = zeros.substr(0, 100);
  struct Case {
    std::string header, says;
  };
  const std::vector<Case> cases = {
      {"{\"x\":{\"dtype\":" + zeros + ",\"shape\":[1],\"data_offsets\":[0,4]}}",
       "dtype of tensor 'x' is " + first_100 + "... (400001 bytes in all), expected a string"},
      {"{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":" + zeros + "}}",
       "data_offsets of tensor 'x' is " + first_100 + "... (400001 bytes in all), expected [begin, end]"},
      {"{\"x\":{\"dtype\":\"F32\",\"shape\":{\"a\":" + zeros + "},\"data_offsets\":[0,4]}}",
       "shape of tensor 'x' is {\"a\":" + zeros.substr(0, 95) + "... (400007 bytes in all), expected an array"},
      {"{\"__metadata__\":{\"k\":" + zeros + "}}",
       "__metadata__ value of 'k' is a JSON array (" + first_100 + "... (400001 bytes in all)), expected a string"},
      {"{\"x\":{\"dtype\":\"" + std::string(200'000, 'F') + "\",\"shape\":[1],\"data_offsets\":[0,4]}}",
       "not supported: dtype " + std::string(100, 'F') + "... (200000 bytes in all) in tensor 'x'"},
      {"{\"" + std::string(200'000, 'n') + "\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}",
       "tensor '" + std::string(100, 'n') + "... (200000 bytes in all)' has data_offsets [0, 4]"},
      {"{\"__metadata__\":{\"" + std::string(200'000, 'k') + "\":1}}",
       "__metadata__ value of '" + std::string(100, 'k') + "... (200000 bytes in all)' is a JSON integer (1)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.says);
    const std::string message = load_error(file, file_bytes(c.header, std::string(4, '\0')));
    EXPECT_LT(message.size(), 500u) << message.substr(0, 500);
    EXPECT_NE(message.find(c.says), std::string::npos) << message.substr(0, 500);
  }
  // A shape too large to hold is repeated within bounds too.
  std::string huge = "[4294967296";
  for (int i = 0; i < 40; ++i) huge += ",4294967296";
  huge += "]";
  const std::string message = load_error(
      file, file_bytes("{\"x\":{\"dtype\":\"F32\",\"shape\":" + huge + ",\"data_offsets\":[0,4]}}", ""));
  EXPECT_NE(message.find("shape " + huge.substr(0, 100) + "... (" + std::to_string(huge.size()) +
                         " bytes in all) of tensor 'x' is too large"),
            std::string::npos)
      << message;
}

TEST_F(SafetensorsCorrupt, NamesAndKeysAreRepeatedPrintable) {
  // "\u0000" and "\n" decode to a NUL byte and a newline in the name: the message shows them escaped.
  const std::string message = load_error(
      path("bad.safetensors"),
      file_bytes("{\"a\\u0000b\\nc\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", std::string(4, '\0')));
  EXPECT_NE(message.find("tensor 'a\\0b\\nc' has data_offsets [0, 4]"), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos);
  EXPECT_EQ(message.find('\0'), std::string::npos);
  expect_load_error(file_bytes("{\"__metadata__\":{\"\\u001b[31m\":null}}", ""),
                    "__metadata__ value of '\\x1b[31m' is a JSON null (null)");
  expect_entry_error("{\"dtype\":\"F\\t32\",\"shape\":[1],\"data_offsets\":[0,4]}", 4,
                     "not supported: dtype F\\t32 in tensor 'x'");
}

TEST_F(SafetensorsCorrupt, AFileOfAnotherKindIsNamedSo) {
  expect_load_error("Hello world, this is a text file.\n",
                    "is not a safetensors file: it starts with the bytes 'Hello wo' (a safetensors file starts "
                    "with an 8-byte little-endian header length, then '{')");
  expect_load_error(std::string("\x80\x02}q\0(X\n\0\0\0", 11) + std::string(100, 'x'),  // a pickle
                    "is not a safetensors file: it starts with the bytes '\\x80\\x02}q\\0(X\\n'");
  // A length that is merely wrong, before a header that starts as one does, is named as such.
  expect_load_error(le64(100) + "{}", "header length 100 is larger than the 2 bytes after the length field");
}

// ============================================================================ the reader's limits

// A header with n metadata keys "0", "1", ... with empty values.
std::string metadata_header(size_t n) {
  std::string header = "{\"__metadata__\":{";
  for (size_t i = 0; i < n; ++i) header += (i ? ",\"" : "\"") + std::to_string(i) + "\":\"\"";
  return header + "}}";
}

TEST_F(SafetensorsCorrupt, MetadataOf65536KeysLoadsAndOneMoreIsRefused) {
  const std::string file = path("keys.safetensors");
  write_bytes(file, file_bytes(metadata_header(65'536), ""));
  EXPECT_EQ(load_safetensors(file).metadata.size(), 65'536u);
  expect_load_error(file_bytes(metadata_header(65'537), ""),
                    "': __metadata__ has more than 65536 keys (the reader's limit)");
}

TEST_F(SafetensorsCorrupt, MetadataOfMoreThan32MiBIsRefused) {
  // Three values of 11 MiB: each within the 16 MiB a string may have, together past 32 MiB.
  const std::string value = "\"" + std::string(11 << 20, 'v') + "\"";
  const std::string header = "{\"__metadata__\":{\"a\":" + value + ",\"b\":" + value + ",\"c\":" + value + "}}";
  expect_load_error(file_bytes(header, ""),
                    "': __metadata__ holds more than 33554432 bytes of keys and values (the reader's limit)");
}

TEST_F(SafetensorsCorrupt, AStringOrNumberOfMoreThan16MiBIsRefused) {
  const std::string value(16 << 20, 'v');  // 16 MiB + 2 quotes
  expect_load_error(file_bytes("{\"__metadata__\":{\"k\":\"" + value + "\"}}", ""),
                    "invalid JSON header", "json: a string or number longer than 16777216 bytes (the reader's limit) at byte 21");
  expect_load_error(file_bytes("{\"x\":{\"note\":" + std::string((16 << 20) + 1, '1') + "}}", ""),
                    "longer than 16777216 bytes (the reader's limit) at byte 13");
}

TEST_F(SafetensorsCorrupt, MoreThan131072TensorEntriesAreRefused) {
  std::string header = "{";
  for (size_t i = 0; i <= 131'072; ++i)
    header += (i ? ",\"" : "\"") + std::to_string(i) + "\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}";
  header += "}";
  expect_load_error(file_bytes(header, ""), "': the header has more than 131072 tensor entries (the reader's limit)");
}

TEST_F(SafetensorsCorrupt, ExtraMembersOfEntriesAreSkippedWithinLimits) {
  const std::string fields = "\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]";
  const std::string file = path("extra.safetensors");
  write_bytes(file, file_bytes("{\"x\":{\"note\":{\"a\":[1,{\"b\":null}]},\"n\":2," + fields + "}}",
                               std::string(4, '\0')));
  EXPECT_EQ(load_safetensors(file).tensors.at("x").numel(), 1);
  // Their keys are kept only to refuse a duplicate, so they are bounded in length and number.
  expect_load_error(file_bytes("{\"x\":{\"note\":{\"a\":1,\"a\":2}," + fields + "}}", std::string(4, '\0')),
                    "duplicate key \"a\"");
  expect_load_error(file_bytes("{\"x\":{" + fields + ",\"dtype\":\"F32\"}}", std::string(4, '\0')),
                    "duplicate key \"dtype\"");
  expect_load_error(file_bytes("{\"x\":{\"" + std::string(257, 'k') + "\":1," + fields + "}}", std::string(4, '\0')),
                    "in the entry of tensor 'x' is longer than 256 bytes (the reader's limit for keys besides "
                    "dtype, shape and data_offsets)");
  std::string many = "{\"x\":{\"note\":{";
  for (size_t i = 0; i < 65'536; ++i) many.append("\"").append(std::to_string(i)).append("\":0,");
  many += "\"last\":0}," + fields + "}}";
  expect_load_error(file_bytes(many, std::string(4, '\0')),
                    "the tensor entries hold more than 65536 keys besides dtype, shape and data_offsets (the "
                    "reader's limit)");
}

// A good file cut at every length, and every header byte overwritten: each must be an Error (or, for a
// harmless edit, a successful load), never a crash. Run this under the ASan build too.
TEST_F(SafetensorsCorrupt, EveryTruncationIsAnErrorNeverACrash) {
  StateDict state;
  state.tensors["w"] = Tensor::randn({3, 5}, 11, DType::F32);
  state.tensors["b"] = Tensor::randn({5}, 12, DType::BF16);
  state.tensors["s"] = Tensor::scalar(3, DType::I64);
  state.metadata["note"] = "truncate me";
  const std::string good_file = path("good.safetensors");
  save_safetensors(good_file, state);
  const std::string good = read_bytes(good_file);
  ASSERT_GT(good.size(), 100u);
  const std::string file = path("cut.safetensors");
  for (size_t length = 0; length < good.size(); ++length) {
    SCOPED_TRACE("length " + std::to_string(length));
    write_bytes(file, good.substr(0, length));
    EXPECT_ERROR_MENTIONS(load_safetensors(file), "load_safetensors", file);
  }
  write_bytes(file, good + "x");
  EXPECT_ERROR_MENTIONS(load_safetensors(file), file, "trailing bytes");
}

TEST_F(SafetensorsCorrupt, OverwrittenHeaderBytesNeverCrash) {
  StateDict state;
  state.tensors["w"] = Tensor::randn({2, 3}, 13, DType::F16);
  state.tensors["i"] = Tensor::from_vector(std::vector<int32_t>{1, 2}, {2});
  state.metadata["k"] = "v";
  const std::string good_file = path("good.safetensors");
  save_safetensors(good_file, state);
  const std::string good = read_bytes(good_file);
  const size_t header_end = 8 + static_cast<unsigned char>(good[0]);
  const std::string file = path("flipped.safetensors");
  int errors = 0, loads = 0;
  for (size_t pos = 0; pos < header_end; ++pos) {
    for (unsigned char replacement : std::string("\x00\x7f\xff\"9-]}\\", 9)) {
      std::string bytes = good;
      if (static_cast<unsigned char>(bytes[pos]) == replacement) continue;
      bytes[pos] = static_cast<char>(replacement);
      write_bytes(file, bytes);
      try {
        load_safetensors(file);
        ++loads;  // e.g. a digit changed inside a metadata string
      } catch (const Error& error) {
        ++errors;
        EXPECT_NE(std::string(error.what()).find(file), std::string::npos) << error.what();
      }
    }
  }
  EXPECT_GT(errors, 0);
}

// ============================================================================ saving

TEST_F(Safetensors, SaveRejectsUnsaveableStateBeforeTouchingTheDisk) {
  const std::string file = path("x.safetensors");
  StateDict reserved;
  reserved.tensors["__metadata__"] = Tensor::ones({1});
  EXPECT_ERROR_MENTIONS(save_safetensors(file, reserved), file, "'__metadata__'", "reserved");
  StateDict undefined;
  undefined.tensors["w"] = Tensor();
  EXPECT_ERROR_MENTIONS(save_safetensors(file, undefined), file, "tensor 'w' is undefined");
  StateDict bad_name;
  bad_name.tensors["w\xFF"] = Tensor::ones({1});
  EXPECT_ERROR_MENTIONS(save_safetensors(file, bad_name), file, "not valid UTF-8");
  StateDict bad_metadata;
  bad_metadata.metadata["k"] = "\xC0\xAF";
  EXPECT_ERROR_MENTIONS(save_safetensors(file, bad_metadata), file, "metadata", "not valid UTF-8");
  EXPECT_TRUE(directory_listing().empty());
}

TEST_F(Safetensors, SaveReplacesAnExistingFile) {
  const std::string file = path("ckpt.safetensors");
  StateDict first, second;
  first.tensors["a"] = Tensor::ones({100});
  second.tensors["b"] = Tensor::zeros({2}, DType::I64);
  save_safetensors(file, first);
  save_safetensors(file, second);
  const StateDict back = load_safetensors(file);
  ASSERT_EQ(back.tensors.size(), 1u);
  EXPECT_EQ(back.tensors.count("b"), 1u);
  EXPECT_EQ(directory_listing(), std::vector<std::string>{"ckpt.safetensors"});
}

TEST_F(Safetensors, SaveReplacesOnlyARegularFileAndWritesThroughASymbolicLink) {
  StateDict state;
  state.tensors["a"] = Tensor::ones({3});
  // A directory (or a device, a FIFO) in the way is not replaced by a checkpoint.
  const std::string directory = path("taken");
  fs::create_directory(directory);
  EXPECT_ERROR_MENTIONS(save_safetensors(directory, state), directory, "exists and is not a regular file",
                        "a directory");
  EXPECT_TRUE(fs::is_directory(directory));
  EXPECT_ERROR_MENTIONS(save_safetensors("/dev/null", state), "'/dev/null' exists and is not a regular file",
                        "a device");
  // Through a link the file it points to is replaced, and the link stays a link.
  const std::string target = path("real.safetensors"), link = path("latest.safetensors");
  save_safetensors(target, StateDict{});
  fs::create_symlink("real.safetensors", link);
  save_safetensors(link, state);
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(load_safetensors(target).tensors.count("a"), 1u);
  EXPECT_EQ(directory_listing(), (std::vector<std::string>{"latest.safetensors", "real.safetensors", "taken"}));
}

TEST_F(Safetensors, SaveWritesThroughADanglingLinkAndAChainOfLinks) {
  StateDict state;
  state.tensors["a"] = Tensor::ones({3});
  // A link whose target does not exist yet: the target is created (weakly_canonical stopped at the link,
  // and the checkpoint replaced it with a regular file), the link stays.
  fs::create_directory(path("dir"));
  const std::string dangling = path("dangling.safetensors");
  fs::create_symlink("dir/new.safetensors", dangling);
  EXPECT_EQ(write_destination(dangling), path("dir/new.safetensors"));
  save_safetensors(dangling, state);
  EXPECT_TRUE(fs::is_symlink(dangling));
  EXPECT_EQ(load_safetensors(path("dir/new.safetensors")).tensors.count("a"), 1u);
  // A link to a link (relative targets are read from each link's own directory).
  const std::string chain = path("dir/chain.safetensors");
  fs::create_symlink("../dangling.safetensors", chain);
  EXPECT_EQ(fs::weakly_canonical(write_destination(chain)), fs::weakly_canonical(path("dir/new.safetensors")));
  // A dangling link into a directory that does not exist: the probe finds it before any write.
  const std::string nowhere = path("nowhere.safetensors");
  fs::create_symlink("no/such/dir/x.safetensors", nowhere);
  const SaveTarget target = save_target(nowhere, /*try_create=*/true);
  EXPECT_NE(target.problem.find("cannot create a file there"), std::string::npos) << target.problem;
  EXPECT_NE(target.problem.find("No such file or directory"), std::string::npos) << target.problem;
  // A loop of links is an error naming the path, not a hang.
  const std::string loop_a = path("loop_a"), loop_b = path("loop_b");
  fs::create_symlink("loop_b", loop_a);
  fs::create_symlink("loop_a", loop_b);
  EXPECT_ERROR_MENTIONS(write_destination(loop_a), loop_a, "more than 40 links");
  EXPECT_ERROR_MENTIONS(save_safetensors(loop_a, state), loop_a, "cannot be resolved");
}

TEST_F(Safetensors, SaveIntoAMissingDirectoryFailsNamingThePathAndReason) {
  const std::string file = path("no/such/dir/ckpt.safetensors");
  StateDict state;
  state.tensors["a"] = Tensor::ones({2});
  EXPECT_ERROR_MENTIONS(save_safetensors(file, state), "save_safetensors", file, "No such file or directory");
  EXPECT_TRUE(directory_listing().empty());
}

TEST_F(Safetensors, FailedWriteLeavesTheOldFileIntactAndNoTempFile) {
  const std::string file = path("ckpt.safetensors");
  StateDict old_state;
  old_state.tensors["old"] = Tensor::arange(0, 10);
  save_safetensors(file, old_state);
  const std::string old_bytes = read_bytes(file);

  // Make the write itself fail half way: a file size limit turns write() into EFBIG (with SIGXFSZ ignored).
  StateDict big;
  big.tensors["big"] = Tensor::zeros({64 * 1024});  // 256 KiB
  struct rlimit saved;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  const auto saved_handler = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit limited = saved;
  limited.rlim_cur = 16 * 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  bool threw = false;
  std::string message;
  try {
    save_safetensors(file, big);
  } catch (const Error& error) {
    threw = true;
    message = error.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  ::signal(SIGXFSZ, saved_handler);

  ASSERT_TRUE(threw);
  EXPECT_NE(message.find(file), std::string::npos) << message;
  EXPECT_NE(message.find(std::strerror(EFBIG)), std::string::npos) << message;
  EXPECT_EQ(read_bytes(file), old_bytes);
  EXPECT_EQ(directory_listing(), std::vector<std::string>{"ckpt.safetensors"});
  EXPECT_EQ(load_safetensors(file).tensors.at("old").numel(), 10);
}

TEST_F(Safetensors, UnwritableDirectoryLeavesTheOldFileIntact) {
  if (::geteuid() == 0) GTEST_SKIP() << "root ignores directory permissions";
  const std::string file = path("ckpt.safetensors");
  StateDict state;
  state.tensors["old"] = Tensor::ones({3});
  save_safetensors(file, state);
  const std::string old_bytes = read_bytes(file);
  fs::permissions(dir_, fs::perms::owner_read | fs::perms::owner_exec);
  state.tensors["old"] = Tensor::zeros({3});
  EXPECT_ERROR_MENTIONS(save_safetensors(file, state), file, "Permission denied");
  fs::permissions(dir_, fs::perms::owner_all);
  EXPECT_EQ(read_bytes(file), old_bytes);
  EXPECT_EQ(directory_listing(), std::vector<std::string>{"ckpt.safetensors"});
}

TEST_F(Safetensors, TempFileInTheWayIsAnErrorAndIsNotRemoved) {
  // A directory squatting on the temp name makes creating or naming the temp file fail; the save must report
  // it and leave both the old file and the squatter alone (it only removes what it created).
  const std::string file = path("ckpt.safetensors");
  StateDict state;
  state.tensors["old"] = Tensor::ones({3});
  save_safetensors(file, state);
  const std::string old_bytes = read_bytes(file);
  const std::string temp = file + ".tmp." + std::to_string(::getpid());
  fs::create_directory(temp);
  EXPECT_ERROR_MENTIONS(save_safetensors(file, state), file, "the temp file '" + temp + "'");
  EXPECT_EQ(read_bytes(file), old_bytes);
  EXPECT_TRUE(fs::is_directory(temp));
}

// ============================================================================ temp files of killed saves

// A pid that no process has: a child's, once it has exited and been reaped.
pid_t pid_of_a_dead_process() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  return child;
}

TEST_F(Safetensors, SaveRemovesTheTempFilesThatDeadProcessesLeftAndNothingElse) {
  const std::string file = path("ckpt.safetensors");
  const std::string dead = std::to_string(pid_of_a_dead_process());
  const std::string alive = std::to_string(::getppid());
  ASSERT_EQ(::kill(std::stoi(dead), 0), -1);
  const std::vector<std::string> kept = {
      "ckpt.safetensors.tmp." + alive,         // a save in progress in a live process
      "other.safetensors.tmp." + dead,         // another checkpoint's
      "ckpt.safetensors.tmp.0" + dead,         // not a pid as a process writes it
      "ckpt.safetensors.tmp." + dead + ".bak",  // more than the pattern
      "ckpt.safetensors.tmp.",                 // no pid
      "notes.txt",
  };
  for (const std::string& name : kept) write_bytes(path(name), "x");
  write_bytes(path("ckpt.safetensors.tmp." + dead), "a checkpoint cut short");
  const std::string dead_directory = std::to_string(pid_of_a_dead_process());
  fs::create_directory(path("ckpt.safetensors.tmp." + dead_directory));  // not a regular file

  StateDict state;
  state.tensors["w"] = Tensor::ones({4});
  save_safetensors(file, state);
  std::vector<std::string> expected = kept;
  expected.push_back("ckpt.safetensors");
  expected.push_back("ckpt.safetensors.tmp." + dead_directory);
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(directory_listing(), expected);
  EXPECT_EQ(load_safetensors(file).tensors.count("w"), 1u);
}

TEST_F(Safetensors, SaveThroughALinkRemovesTheStaleTempFilesOfTheLinkedFile) {
  fs::create_directory(path("runs"));
  fs::create_symlink("runs/real.safetensors", path("latest.safetensors"));
  const std::string stale = "real.safetensors.tmp." + std::to_string(pid_of_a_dead_process());
  write_bytes(path("runs/" + stale), "cut short");
  save_safetensors(path("latest.safetensors"), StateDict{});
  EXPECT_FALSE(fs::exists(path("runs/" + stale)));
  EXPECT_TRUE(fs::is_regular_file(path("runs/real.safetensors")));
}

// Whether the file system of `directory` makes unnamed files (O_TMPFILE).
bool makes_unnamed_files(const fs::path& directory) {
  const int fd = ::open(directory.c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

TEST_F(Safetensors, AProcessKilledDuringASaveLeavesOnlyTheOldCheckpoint) {
  const std::string file = path("ckpt.safetensors");
  StateDict old_state, big;
  old_state.tensors["old"] = Tensor::arange(0, 10);
  save_safetensors(file, old_state);
  const std::string old_bytes = read_bytes(file);
  big.tensors["big"] = Tensor::zeros({64 * 1024});  // 256 KiB

  // A child saves under a file size limit of 16 KiB with SIGXFSZ at its default action: the kernel kills it
  // in the middle of its write, as `kill -9` would.
  const pid_t child = ::fork();
  if (child == 0) {
    struct rlimit limit = {16 * 1024, 16 * 1024}, no_core = {0, 0};
    ::setrlimit(RLIMIT_CORE, &no_core);
    ::signal(SIGXFSZ, SIG_DFL);
    ::setrlimit(RLIMIT_FSIZE, &limit);
    try {
      save_safetensors(file, big);
    } catch (...) {
    }
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGXFSZ) << "wait status " << status;
  EXPECT_EQ(read_bytes(file), old_bytes);
  // The unnamed temp file went with the process; a named one (a file system without O_TMPFILE) stays until
  // the next save.
  if (makes_unnamed_files(dir_)) {
    EXPECT_EQ(directory_listing(), std::vector<std::string>{"ckpt.safetensors"});
  }

  save_safetensors(file, big);
  EXPECT_EQ(directory_listing(), std::vector<std::string>{"ckpt.safetensors"});
  EXPECT_EQ(load_safetensors(file).tensors.at("big").numel(), 64 * 1024);
}

TEST_F(Safetensors, AFileAtThisProcesssOwnTempNameIsReplacedByTheSave) {
  // A process of the same pid, dead, left it: the name is this save's to take, whatever its route.
  const std::string file = path("ckpt.safetensors");
  save_safetensors(file, StateDict{});
  write_bytes(file + ".tmp." + std::to_string(::getpid()), "a checkpoint cut short");
  StateDict state;
  state.tensors["w"] = Tensor::ones({2});
  save_safetensors(file, state);
  EXPECT_EQ(directory_listing(), std::vector<std::string>{"ckpt.safetensors"});
  EXPECT_EQ(load_safetensors(file).tensors.count("w"), 1u);
}

}  // namespace
}  // namespace mixtape
