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
