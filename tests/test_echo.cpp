// echo(): how a value from outside appears inside an error message.
#include <gtest/gtest.h>

#include <string>

#include "tensor/error.h"

namespace mixtape {
namespace {

TEST(Echo, KeepsPrintableTextAndUtf8AsItIs) {
  EXPECT_EQ(echo("n_layer"), "n_layer");
  EXPECT_EQ(echo("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  EXPECT_EQ(echo(""), "");
}

TEST(Echo, EscapesControlBytesBackslashesAndInvalidUtf8) {
  EXPECT_EQ(echo(std::string("a\nb\tc\rd\0e", 9)), "a\\nb\\tc\\rd\\0e");
  EXPECT_EQ(echo("\x1b[31m"), "\\x1b[31m");  // a terminal escape
  EXPECT_EQ(echo("\x7f"), "\\x7f");
  EXPECT_EQ(echo("a\\b"), "a\\\\b");
  EXPECT_EQ(echo("\xc3"), "\\xc3");              // a lone lead byte
  EXPECT_EQ(echo("\xc3(x"), "\\xc3(x");          // a lead byte without its continuation
  EXPECT_EQ(echo("\x80"), "\\x80");              // a lone continuation byte
  EXPECT_EQ(echo("\xc0\xaf"), "\\xc0\\xaf");     // an overlong '/'
  EXPECT_EQ(echo("\xed\xa0\x80"), "\\xed\\xa0\\x80");  // a UTF-16 surrogate
  EXPECT_EQ(echo("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80");  // past U+10FFFF
}

TEST(Echo, EscapesWellFormedCharactersThatATerminalDoesNotShow) {
  EXPECT_EQ(echo("a\xc2\x9b" "31m"), "a\\xc2\\x9b" "31m");  // U+009B, the C1 form of ESC [
  EXPECT_EQ(echo("\xc2\x80"), "\\xc2\\x80");                // U+0080, the first C1 control
  EXPECT_EQ(echo("\xc2\xa0"), "\xc2\xa0");                    // U+00A0, past them: kept
  EXPECT_EQ(echo("x\xe2\x80\xae" "cba"), "x\\xe2\\x80\\xae" "cba");  // U+202E, right-to-left override
  EXPECT_EQ(echo("\xe2\x80\xa8"), "\\xe2\\x80\\xa8");          // U+2028, line separator
  EXPECT_EQ(echo("\xe2\x81\xa6"), "\\xe2\\x81\\xa6");          // U+2066, left-to-right isolate
  EXPECT_EQ(echo("\xe2\x81\xaa"), "\xe2\x81\xaa");          // U+206A, past them: kept
  EXPECT_EQ(echo("\xe2\x80\xa7"), "\xe2\x80\xa7");          // U+2027, before them: kept
}

TEST(Echo, CutsLongValuesAndSaysTheirLength) {
  const std::string zeros(1'000'000, '0');
  EXPECT_EQ(echo(zeros), std::string(100, '0') + "... (1000000 bytes in all)");
  EXPECT_EQ(echo(std::string(100, 'x')), std::string(100, 'x'));  // exactly the limit: whole
  EXPECT_EQ(echo(std::string(101, 'x')), std::string(100, 'x') + "... (101 bytes in all)");
  EXPECT_EQ(echo("abcdef", 3), "abc... (6 bytes in all)");
  // The cut falls between characters: an escape or a multi-byte character is never split.
  EXPECT_EQ(echo("ab\ncd", 3), "ab... (5 bytes in all)");
  EXPECT_EQ(echo("ab\xc3\xa9xyz", 3), "ab\xc3\xa9... (7 bytes in all)");
}

}  // namespace
}  // namespace mixtape
