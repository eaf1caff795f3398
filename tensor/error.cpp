#include "tensor/error.h"

#include <cstdio>

namespace mixtape {

namespace {

// Length of the well-formed UTF-8 sequence at text[pos] (RFC 3629: no overlong forms, no surrogates, nothing
// past U+10FFFF), or 0 if none starts there.
size_t utf8_length_at(std::string_view text, size_t pos) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(pos);
  unsigned char low = 0x80, high = 0xBF;
  size_t length;
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) length = 2;
  else if (lead == 0xE0) length = 3, low = 0xA0;
  else if (lead >= 0xE1 && lead <= 0xEC) length = 3;
  else if (lead == 0xED) length = 3, high = 0x9F;
  else if (lead >= 0xEE && lead <= 0xEF) length = 3;
  else if (lead == 0xF0) length = 4, low = 0x90;
  else if (lead >= 0xF1 && lead <= 0xF3) length = 4;
  else if (lead == 0xF4) length = 4, high = 0x8F;
  else return 0;
  if (pos + length > text.size() || byte(pos + 1) < low || byte(pos + 1) > high) return 0;
  for (size_t i = 2; i < length; ++i)
    if (byte(pos + i) < 0x80 || byte(pos + i) > 0xBF) return 0;
  return length;
}

// Well-formed characters a terminal or an editor does not show as themselves: the C1 controls U+0080-U+009F
// (U+009B starts a terminal escape like ESC [), the line and paragraph separators U+2028-U+2029 and the
// bidirectional controls U+202A-U+202E and U+2066-U+2069 (they reorder the text that follows them).
bool hidden_character(std::string_view text, size_t pos, size_t length) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[pos + i]); };
  if (length == 2) return byte(0) == 0xC2 && byte(1) <= 0x9F;
  if (length != 3 || byte(0) != 0xE2) return false;
  return (byte(1) == 0x80 && byte(2) >= 0xA8 && byte(2) <= 0xAE) ||
         (byte(1) == 0x81 && byte(2) >= 0xA6 && byte(2) <= 0xA9);
}

std::string byte_escapes(std::string_view bytes) {
  std::string out;
  char escape[8];
  for (unsigned char c : bytes) {
    std::snprintf(escape, sizeof escape, "\\x%02x", c);
    out += escape;
  }
  return out;
}

// The printable form of the character (or lone byte) at text[pos], `length` bytes of it (0: a byte that
// starts no UTF-8 sequence).
std::string printable(std::string_view text, size_t pos, size_t length) {
  const unsigned char c = static_cast<unsigned char>(text[pos]);
  if (length > 1)
    return hidden_character(text, pos, length) ? byte_escapes(text.substr(pos, length))
                                               : std::string(text.substr(pos, length));
  switch (c) {
    case '\\': return "\\\\";
    case '\n': return "\\n";
    case '\t': return "\\t";
    case '\r': return "\\r";
    case '\0': return "\\0";
    default: break;
  }
  if (length == 1 && c >= 0x20 && c != 0x7F) return std::string(1, static_cast<char>(c));
  return byte_escapes(text.substr(pos, 1));
}

}  // namespace

std::string echo(std::string_view text, size_t limit) {
  std::string out;
  size_t characters = 0;
  for (size_t pos = 0; pos < text.size();) {
    const size_t length = utf8_length_at(text, pos);
    const std::string shown = printable(text, pos, length);
    const size_t width = length > 1 && shown.size() == length ? 1 : shown.size();  // a character shows as one
    if (characters + width > limit) return out + "... (" + std::to_string(text.size()) + " bytes in all)";
    out += shown;
    characters += width;
    pos += length == 0 ? 1 : length;
  }
  return out;
}

}  // namespace mixtape
