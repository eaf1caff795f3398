// Line charts as PNG files: the raster (pixels, a bitmap font, clipped and dashed lines), the chart layout
// (ranges, ticks, labels, legend) and the file format (PNG row filters, a deflate encoder, CRC-32, Adler-32).
#include "train/plot.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <system_error>
#include <utility>

#include "tensor/error.h"

namespace mixtape::plot {

// ---- colours and pixels --------------------------------------------------------------------------

Rgb parse_rgb(const std::string& hex) {
  auto digit = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  bool ok = hex.size() == 7 && hex[0] == '#';
  for (size_t i = 1; ok && i < hex.size(); ++i) ok = digit(hex[i]) >= 0;
  check(ok, "plot: colour '", hex, "' is not of the form #rrggbb");
  auto byte = [&](size_t i) { return static_cast<uint8_t>(digit(hex[i]) * 16 + digit(hex[i + 1])); };
  return {byte(1), byte(3), byte(5)};
}

const std::vector<Rgb>& palette() {
  static const std::vector<Rgb> colours = [] {
    std::vector<Rgb> c;
    for (const char* hex : {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                            "#7f7f7f", "#bcbd22", "#17becf"})
      c.push_back(parse_rgb(hex));
    return c;
  }();
  return colours;
}

Image::Image(int width, int height, Rgb background) : width_(width), height_(height) {
  check(width > 0 && height > 0, "plot: an image of ", width, "x", height, " pixels has no pixels");
  rgb_.resize(static_cast<size_t>(width) * static_cast<size_t>(height) * 3);
  for (size_t i = 0; i < rgb_.size(); i += 3) {
    rgb_[i] = background.r;
    rgb_[i + 1] = background.g;
    rgb_[i + 2] = background.b;
  }
}

Rgb Image::at(int x, int y) const {
  check(x >= 0 && x < width_ && y >= 0 && y < height_, "plot: pixel (", x, ", ", y, ") is outside the ",
        width_, "x", height_, " image");
  const uint8_t* p = &rgb_[(static_cast<size_t>(y) * width_ + x) * 3];
  return {p[0], p[1], p[2]};
}

void Image::set(int x, int y, Rgb c) {
  if (x < 0 || x >= width_ || y < 0 || y >= height_) return;
  uint8_t* p = &rgb_[(static_cast<size_t>(y) * width_ + x) * 3];
  p[0] = c.r;
  p[1] = c.g;
  p[2] = c.b;
}

// ---- checksums -----------------------------------------------------------------------------------

uint32_t crc32(const uint8_t* data, size_t size) {
  // One table lookup per byte: entry n is the remainder of the byte n shifted through the 8 polynomial steps.
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[n] = c;
    }
    return t;
  }();
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) c = table[(c ^ data[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t adler32(const uint8_t* data, size_t size) {
  // Two sums mod 65521 (the largest prime below 2^16). 5552 bytes is the longest run after which b cannot
  // have overflowed 32 bits, so the (slow) modulo runs once per run instead of once per byte.
  uint32_t a = 1, b = 0;
  while (size > 0) {
    const size_t n = std::min<size_t>(size, 5552);
    for (size_t i = 0; i < n; ++i) {
      a += data[i];
      b += a;
    }
    a %= 65521;
    b %= 65521;
    data += n;
    size -= n;
  }
  return (b << 16) | a;
}

// ---- deflate (RFC 1951) inside a zlib stream (RFC 1950) --------------------------------------------

namespace {

// Deflate packs bits from the least significant end of each byte (RFC 1951 3.1.1).
class BitWriter {
 public:
  explicit BitWriter(std::string& out) : out_(out) {}
  void put(uint32_t bits, int count) {
    buffer_ |= static_cast<uint64_t>(bits) << count_;
    count_ += count;
    for (; count_ >= 8; count_ -= 8, buffer_ >>= 8) out_.push_back(static_cast<char>(buffer_ & 0xFF));
  }
  // Huffman codes are defined from their most significant bit, so they go in reversed.
  void put_code(uint32_t code, int length) {
    uint32_t reversed = 0;
    for (int i = 0; i < length; ++i) reversed |= ((code >> i) & 1) << (length - 1 - i);
    put(reversed, length);
  }
  void flush() {
    if (count_ > 0) put(0, 8 - count_);
  }

 private:
  std::string& out_;
  uint64_t buffer_ = 0;
  int count_ = 0;
};

// The fixed literal/length code (RFC 1951 3.2.6): literals 0-255, end of block 256, lengths 257-285.
void put_symbol(BitWriter& bits, int symbol) {
  if (symbol < 144) bits.put_code(0x30 + symbol, 8);
  else if (symbol < 256) bits.put_code(0x190 + symbol - 144, 9);
  else if (symbol < 280) bits.put_code(symbol - 256, 7);
  else bits.put_code(0xC0 + symbol - 280, 8);
}

// Length codes 257-285 and distance codes 0-29: a base value plus that many extra bits (RFC 1951 3.2.5).
constexpr std::array<int, 29> kLengthBase = {3,  4,  5,  6,  7,  8,  9,  10, 11,  13,  15,  17,  19,  23, 27,
                                             31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258};
constexpr std::array<int, 29> kLengthExtra = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2,
                                              2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0};
constexpr std::array<int, 30> kDistanceBase = {1,    2,    3,    4,    5,    7,    9,    13,    17,    25,
                                               33,   49,   65,   97,   129,  193,  257,  385,   513,   769,
                                               1025, 1537, 2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577};
constexpr std::array<int, 30> kDistanceExtra = {0, 0, 0, 0, 1, 1, 2, 2,  3,  3,  4,  4,  5,  5,  6,
                                                6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13};

// A back reference: "copy `length` bytes from `distance` bytes back" (lengths 3-258, distances 1-32768).
void put_match(BitWriter& bits, int length, int distance) {
  // The code is the last one whose base is <= the value; its extra bits carry the rest. (258 has its own
  // code, 285: the longest match must not be spelled as 227 + 31 with code 284.)
  const auto l = std::ranges::upper_bound(kLengthBase, length) - kLengthBase.begin() - 1;
  put_symbol(bits, 257 + static_cast<int>(l));
  bits.put(length - kLengthBase[l], kLengthExtra[l]);
  const auto d = std::ranges::upper_bound(kDistanceBase, distance) - kDistanceBase.begin() - 1;
  bits.put_code(static_cast<uint32_t>(d), 5);  // the fixed distance code: 5 bits, the code's own number
  bits.put(distance - kDistanceBase[d], kDistanceExtra[d]);
}

void put_u32_be(std::string& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((v >> shift) & 0xFF));
}

}  // namespace

std::string zlib_compress(const uint8_t* data, size_t size) {
  // CMF 0x78: deflate with a 32 KiB window. FLG 0x01: no dictionary, and CMF * 256 + FLG is a multiple of 31.
  std::string out = {'\x78', '\x01'};
  BitWriter bits(out);
  bits.put(1, 1);  // BFINAL: one block holds everything (a fixed-code block has no size limit)
  bits.put(1, 2);  // BTYPE 01: the fixed Huffman codes, so no code tables to build or send

  // Greedy LZ77: at each position take the longest match among the last kMaxChain earlier positions whose
  // first 3 bytes hash alike. Chains are linked through `previous`, indexed by position mod the window: an
  // entry is overwritten only by a position a full window later, by when its chain is out of reach anyway.
  constexpr int64_t kWindow = 32768, kMinMatch = 3, kMaxMatch = 258;
  constexpr int kHashBits = 15, kMaxChain = 64;
  const int64_t n = static_cast<int64_t>(size);
  std::vector<int64_t> head(size_t{1} << kHashBits, -1), previous(kWindow, -1);
  auto hash = [&](int64_t i) {
    const uint32_t three = data[i] | data[i + 1] << 8 | data[i + 2] << 16;
    return (three * 2654435761u) >> (32 - kHashBits);  // Knuth's multiplicative hash: top bits mix all three
  };
  auto insert = [&](int64_t i) {
    if (i + kMinMatch > n) return;
    const uint32_t h = hash(i);
    previous[i % kWindow] = head[h];
    head[h] = i;
  };
  for (int64_t i = 0; i < n;) {
    int64_t best_length = 0, best_distance = 0;
    if (i + kMinMatch <= n) {
      const int64_t limit = std::min(kMaxMatch, n - i);
      int64_t candidate = head[hash(i)];
      for (int chain = 0; candidate >= 0 && i - candidate <= kWindow && chain < kMaxChain; ++chain) {
        int64_t length = 0;  // may run past i: an overlapping copy (a run) is valid deflate
        while (length < limit && data[candidate + length] == data[i + length]) ++length;
        if (length > best_length) {
          best_length = length;
          best_distance = i - candidate;
          if (length == limit) break;
        }
        candidate = previous[candidate % kWindow];
      }
    }
    if (best_length >= kMinMatch) {
      put_match(bits, static_cast<int>(best_length), static_cast<int>(best_distance));
      for (int64_t k = 0; k < best_length; ++k) insert(i + k);
      i += best_length;
    } else {
      put_symbol(bits, data[i]);
      insert(i++);
    }
  }
  put_symbol(bits, 256);  // end of block
  bits.flush();
  put_u32_be(out, adler32(data, size));
  return out;
}

// ---- PNG (RFC 2083) ------------------------------------------------------------------------------

namespace {

void put_chunk(std::string& png, const char* type, const std::string& data) {
  put_u32_be(png, static_cast<uint32_t>(data.size()));
  const std::string body = type + data;  // the CRC covers the chunk type and its data
  png += body;
  put_u32_be(png, crc32(reinterpret_cast<const uint8_t*>(body.data()), body.size()));
}

// The predictor of filter 4: whichever of left, up, up-left is closest to left + up - up_left.
int paeth(int left, int up, int up_left) {
  const int p = left + up - up_left;
  const int pa = std::abs(p - left), pb = std::abs(p - up), pc = std::abs(p - up_left);
  if (pa <= pb && pa <= pc) return left;
  return pb <= pc ? up : up_left;
}

}  // namespace

std::string encode_png(const Image& image) {
  const size_t stride = static_cast<size_t>(image.width()) * 3;
  const std::vector<uint8_t>& rgb = image.rgb();
  // Each row goes out under the filter (None, Sub, Up, Average, Paeth) whose output bytes, read as signed,
  // have the smallest absolute sum (RFC 2083's heuristic): small residuals make long runs of zeros for
  // deflate, and on a chart's flat background Up turns most rows into nothing but zeros.
  std::vector<uint8_t> filtered;
  filtered.reserve(image.height() * (stride + 1));
  const std::vector<uint8_t> zero_row(stride, 0);
  std::array<std::vector<uint8_t>, 5> candidate;
  for (auto& c : candidate) c.resize(stride);
  for (int y = 0; y < image.height(); ++y) {
    const uint8_t* row = &rgb[y * stride];
    const uint8_t* up = y > 0 ? row - stride : zero_row.data();
    int best = 0;
    long best_sum = -1;
    for (int filter = 0; filter < 5; ++filter) {
      long sum = 0;
      for (size_t i = 0; i < stride; ++i) {
        const int a = i >= 3 ? row[i - 3] : 0, b = up[i], c = i >= 3 ? up[i - 3] : 0;
        const int predicted = filter == 0   ? 0
                              : filter == 1 ? a
                              : filter == 2 ? b
                              : filter == 3 ? (a + b) / 2
                                            : paeth(a, b, c);
        const uint8_t out = static_cast<uint8_t>(row[i] - predicted);
        candidate[filter][i] = out;
        sum += std::abs(static_cast<int8_t>(out));
      }
      if (best_sum < 0 || sum < best_sum) best = filter, best_sum = sum;
    }
    filtered.push_back(static_cast<uint8_t>(best));
    filtered.insert(filtered.end(), candidate[best].begin(), candidate[best].end());
  }
  const std::string compressed = zlib_compress(filtered.data(), filtered.size());

  std::string png = "\x89PNG\r\n\x1a\n";
  std::string header;
  put_u32_be(header, static_cast<uint32_t>(image.width()));
  put_u32_be(header, static_cast<uint32_t>(image.height()));
  header += {'\x08', '\x02', '\x00', '\x00', '\x00'};  // 8 bits, RGB; deflate, adaptive filters, no interlace
  put_chunk(png, "IHDR", header);
  // The stream may be split over any number of IDAT chunks; 64 KiB each keeps every chunk modest.
  constexpr size_t kIdat = 65536;
  for (size_t at = 0; at < compressed.size(); at += kIdat)
    put_chunk(png, "IDAT", compressed.substr(at, kIdat));
  put_chunk(png, "IEND", "");
  return png;
}

void write_png(const Chart& chart, const std::filesystem::path& path) {
  const std::string png = encode_png(render(chart));  // a bad chart fails before the file system is touched
  const std::filesystem::path temporary = path.string() + ".tmp";
  std::string problem;
  {
    errno = 0;
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    if (!out) {
      problem = "cannot create " + temporary.string();
      if (errno) problem += " (" + std::generic_category().message(errno) + ")";
    } else {
      out.write(png.data(), static_cast<std::streamsize>(png.size()));
      out.close();
      if (!out) problem = "error writing " + temporary.string();
    }
  }
  if (problem.empty()) {
    std::error_code ec;
    std::filesystem::rename(temporary, path, ec);
    if (ec) problem = "cannot rename " + temporary.string() + " to it (" + ec.message() + ")";
  }
  if (!problem.empty()) {
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
    fail("plot: cannot write '", path.string(), "': ", problem);
  }
}

// ---- text ----------------------------------------------------------------------------------------

namespace {

constexpr int kAdvance = 6;     // pixels from one character to the next: a 5-pixel glyph and a gap
constexpr int kLineHeight = 10; // a line of text: 7 rows of capitals, 2 of descenders, 1 of space
constexpr int kCapMiddle = 3;   // the row to centre on a tick: the middle of the capitals and digits

// The glyphs of ASCII 32-126 ('#' ink, '.' paper), 16 characters to a band as they stand in the code chart.
// Each is 5 columns wide and 9 rows tall: rows 0-6 hold capitals and digits (lower case from row 2), rows 7-8
// the descenders of g j p q y and the tails of , ; ( ) [ ].
constexpr const char* kFont[6][9] = {
    {  //   ! " # $ % & ' ( ) * + , - . /
     "..... ..#.. .#.#. .#.#. ..#.. ##... .##.. ..#.. ...#. .#... ..... ..... ..... ..... ..... ....#",
     "..... ..#.. .#.#. .#.#. .#### ##..# #..#. ..#.. ..#.. ..#.. ..#.. ..#.. ..... ..... ..... ....#",
     "..... ..#.. .#.#. ##### #.#.. ...#. #.#.. .#... .#... ...#. #.#.# ..#.. ..... ..... ..... ...#.",
     "..... ..#.. ..... .#.#. .###. ..#.. .#... ..... .#... ...#. .###. ##### ..... ##### ..... ..#..",
     "..... ..#.. ..... ##### ..#.# .#... #.#.# ..... .#... ...#. #.#.# ..#.. ..... ..... ..... .#...",
     "..... ..... ..... .#.#. ####. #..## #..#. ..... .#... ...#. ..#.. ..#.. .##.. ..... .##.. #....",
     "..... ..#.. ..... .#.#. ..#.. ...## .##.# ..... ..#.. ..#.. ..... ..... .##.. ..... .##.. #....",
     "..... ..... ..... ..... ..... ..... ..... ..... ...#. .#... ..... ..... ..#.. ..... ..... .....",
     "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .#... ..... ..... ....."
    },
    {  // 0 1 2 3 4 5 6 7 8 9 : ; < = > ?
     ".###. ..#.. .###. ##### ...#. ##### ..##. ##### .###. .###. ..... ..... ...#. ..... .#... .###.",
     "#...# .##.. #...# ...#. ..##. #.... .#... ....# #...# #...# .##.. .##.. ..#.. ..... ..#.. #...#",
     "#..## ..#.. ....# ..#.. .#.#. ####. #.... ...#. #...# #...# .##.. .##.. .#... ##### ...#. ....#",
     "#.#.# ..#.. ...#. ...#. #..#. ....# ####. ..#.. .###. .#### ..... ..... #.... ..... ....# ...#.",
     "##..# ..#.. ..#.. ....# ##### ....# #...# .#... #...# ....# .##.. .##.. .#... ##### ...#. ..#..",
     "#...# ..#.. .#... #...# ...#. #...# #...# .#... #...# ...#. .##.. .##.. ..#.. ..... ..#.. .....",
     ".###. .###. ##### .###. ...#. .###. .###. .#... .###. .##.. ..... ..#.. ...#. ..... .#... ..#..",
     "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .#... ..... ..... ..... .....",
     "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ....."
    },
    {  // @ A B C D E F G H I J K L M N O
     ".###. .###. ####. .###. ###.. ##### ##### .###. #...# .###. ..### #...# #.... #...# #...# .###.",
     "#...# #...# #...# #...# #..#. #.... #.... #...# #...# ..#.. ...#. #..#. #.... ##.## #...# #...#",
     "#.### #...# #...# #.... #...# #.... #.... #.... #...# ..#.. ...#. #.#.. #.... #.#.# ##..# #...#",
     "#.#.# ##### ####. #.... #...# ####. ####. #.### ##### ..#.. ...#. ##... #.... #.#.# #.#.# #...#",
     "#.### #...# #...# #.... #...# #.... #.... #...# #...# ..#.. ...#. #.#.. #.... #...# #..## #...#",
     "#.... #...# #...# #...# #..#. #.... #.... #...# #...# ..#.. #..#. #..#. #.... #...# #...# #...#",
     ".#### #...# ####. .###. ###.. ##### #.... .#### #...# .###. .##.. #...# ##### #...# #...# .###.",
     "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....",
     "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ....."
    },
    {  // P Q R S T U V W X Y Z [ \ ] ^ _
     "####. .###. ####. .#### ##### #...# #...# #...# #...# #...# ##### .###. #.... .###. ..#.. .....",
     "#...# #...# #...# #.... ..#.. #...# #...# #...# #...# #...# ....# .#... #.... ...#. .#.#. .....",
     "#...# #...# #...# #.... ..#.. #...# #...# #...# .#.#. .#.#. ...#. .#... .#... ...#. #...# .....",
     "####. #...# ####. .###. ..#.. #...# #...# #.#.# ..#.. ..#.. ..#.. .#... ..#.. ...#. ..... .....",
     "#.... #.#.# #.#.. ....# ..#.. #...# #...# #.#.# .#.#. ..#.. .#... .#... ...#. ...#. ..... .....",
     "#.... #..#. #..#. ....# ..#.. #...# .#.#. #.#.# #...# ..#.. #.... .#... ....# ...#. ..... .....",
     "#.... .##.# #...# ####. ..#.. .###. ..#.. .#.#. #...# ..#.. ##### .#... ....# ...#. ..... .....",
     "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .###. ..... .###. ..... #####",
     "..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ....."
    },
    {  // ` a b c d e f g h i j k l m n o
     ".#... ..... #.... ..... ....# ..... ..##. ..... #.... ..#.. ...#. #.... .##.. ..... ..... .....",
     "..#.. ..... #.... ..... ....# ..... .#..# ..... #.... ..... ..... #.... ..#.. ..... ..... .....",
     "..... .###. #.##. .###. .##.# .###. .#... .#### #.##. .##.. ..##. #..#. ..#.. ##.#. #.##. .###.",
     "..... ....# ##..# #.... #..## #...# ###.. #...# ##..# ..#.. ...#. #.#.. ..#.. #.#.# ##..# #...#",
     "..... .#### #...# #.... #...# ##### .#... #...# #...# ..#.. ...#. ##... ..#.. #.#.# #...# #...#",
     "..... #...# #...# #...# #...# #.... .#... #...# #...# ..#.. ...#. #.#.. ..#.. #.#.# #...# #...#",
     "..... .#### ####. .###. .#### .###. .#... .#### #...# .###. ...#. #..#. .###. #.#.# #...# .###.",
     "..... ..... ..... ..... ..... ..... ..... ....# ..... ..... #..#. ..... ..... ..... ..... .....",
     "..... ..... ..... ..... ..... ..... ..... .###. ..... ..... .##.. ..... ..... ..... ..... ....."
    },
    {  // p q r s t u v w x y z { | } ~
     "..... ..... ..... ..... .#... ..... ..... ..... ..... ..... ..... ...## ..#.. ##... .....",
     "..... ..... ..... ..... .#... ..... ..... ..... ..... ..... ..... ..#.. ..#.. ..#.. .....",
     "####. .#### #.##. .#### ###.. #...# #...# #...# #...# #...# ##### ..#.. ..#.. ..#.. .#...",
     "#...# #...# ##..# #.... .#... #...# #...# #...# .#.#. #...# ...#. .#... ..#.. ...#. #.#.#",
     "#...# #...# #.... .###. .#... #...# #...# #.#.# ..#.. #...# ..#.. ..#.. ..#.. ..#.. ...#.",
     "#...# #...# #.... ....# .#..# #..## .#.#. #.#.# .#.#. #...# .#... ..#.. ..#.. ..#.. .....",
     "####. .#### #.... ####. ..##. .##.# ..#.. .#.#. #...# .#### ##### ...## ..#.. ##... .....",
     "#.... ....# ..... ..... ..... ..... ..... ..... ..... ....# ..... ..... ..#.. ..... .....",
     "#.... ....# ..... ..... ..... ..... ..... ..... ..... .###. ..... ..... ..... ..... ....."
    },
};

bool ink(char c, int column, int row) {
  int code = static_cast<unsigned char>(c);
  if (code < 32 || code > 126) code = '?';
  return kFont[(code - 32) / 16][row][(code - 32) % 16 * kAdvance + column] == '#';
}

int text_width(const std::string& text) {
  return text.empty() ? 0 : static_cast<int>(text.size()) * kAdvance - 1;
}

// Draws `text` with its top left corner at (x, y). Rotated: turned a quarter counter-clockwise to read
// upwards (a y-axis label), with (x, y) the bottom left corner of the turned text.
void draw_text(Image& image, int x, int y, const std::string& text, Rgb colour, bool rotated = false) {
  for (size_t i = 0; i < text.size(); ++i)
    for (int row = 0; row < 9; ++row)
      for (int column = 0; column < 5; ++column) {
        if (!ink(text[i], column, row)) continue;
        const int along = static_cast<int>(i) * kAdvance + column;
        if (rotated) image.set(x + row, y - along, colour);
        else image.set(x + along, y + row, colour);
      }
}

void draw_text_centred(Image& image, int centre_x, int y, const std::string& text, Rgb colour) {
  draw_text(image, centre_x - text_width(text) / 2, y, text, colour);
}

// ---- lines ---------------------------------------------------------------------------------------

// A rectangle of pixels, edges included.
struct Box {
  int left, top, right, bottom;
};

void fill(Image& image, const Box& clip, int x0, int y0, int x1, int y1, Rgb colour) {
  for (int y = std::max(y0, clip.top); y <= std::min(y1, clip.bottom); ++y)
    for (int x = std::max(x0, clip.left); x <= std::min(x1, clip.right); ++x) image.set(x, y, colour);
}

// Whether the pixel `position` pixels along a line is inked. Patterns 1-4 (dashed, dotted, dash-dot,
// dash-dot-dot) alternate on and off runs of the lengths listed; 0 is solid.
bool dash_on(int dash, long position) {
  static const std::vector<int> patterns[5] = {{}, {12, 7}, {2, 5}, {12, 5, 2, 5}, {12, 4, 2, 4, 2, 4}};
  const std::vector<int>& runs = patterns[dash];
  long period = 0;
  for (int run : runs) period += run;
  if (period == 0) return true;
  position %= period;
  for (size_t i = 0; i < runs.size(); position -= runs[i], ++i)
    if (position < runs[i]) return i % 2 == 0;
  return true;
}

// How one series' polyline is drawn. `position` counts the pixels drawn so far, so the dash pattern runs on
// from one segment to the next instead of restarting at every data point.
struct Pen {
  Rgb colour;
  int width, dash;
  long position = 0;
};

// Liang-Barsky: shortens the segment to its part inside `box`; false if no part is.
bool clip_segment(double& x0, double& y0, double& x1, double& y1, const Box& box) {
  const double dx = x1 - x0, dy = y1 - y0;
  double t0 = 0, t1 = 1;
  // Each edge keeps the points with p * t <= q.
  auto edge = [&](double p, double q) {
    if (p == 0) return q >= 0;
    const double t = q / p;
    if (p < 0) t0 = std::max(t0, t);
    else t1 = std::min(t1, t);
    return t0 <= t1;
  };
  if (!edge(-dx, x0 - box.left) || !edge(dx, box.right - x0) || !edge(-dy, y0 - box.top) ||
      !edge(dy, box.bottom - y0))
    return false;
  x1 = x0 + t1 * dx, y1 = y0 + t1 * dy;
  x0 = x0 + t0 * dx, y0 = y0 + t0 * dy;
  return true;
}

// Bresenham's line from (x0, y0) to (x1, y1), each pixel stamped with a pen.width square, inside `clip` only.
// A segment that continues a polyline skips its first pixel, the last one of the segment before.
void draw_segment(Image& image, const Box& clip, double x0, double y0, double x1, double y1, Pen& pen) {
  // Cut far-away parts first (data far outside a fixed range), keeping a margin for the brush's reach.
  const Box reach{clip.left - 4, clip.top - 4, clip.right + 4, clip.bottom + 4};
  if (!clip_segment(x0, y0, x1, y1, reach)) return;
  int x = static_cast<int>(std::lround(x0)), y = static_cast<int>(std::lround(y0));
  const int x_end = static_cast<int>(std::lround(x1)), y_end = static_cast<int>(std::lround(y1));
  const int dx = std::abs(x_end - x), dy = -std::abs(y_end - y);
  const int step_x = x < x_end ? 1 : -1, step_y = y < y_end ? 1 : -1;
  const int low = -(pen.width - 1) / 2, high = pen.width / 2;  // a 2-pixel brush: the pixel and the next
  bool skip = pen.position > 0;
  for (int error = dx + dy;;) {
    if (!skip && dash_on(pen.dash, pen.position++))
      fill(image, clip, x + low, y + low, x + high, y + high, pen.colour);
    skip = false;
    if (x == x_end && y == y_end) break;
    const int twice = 2 * error;
    if (twice >= dy) error += dy, x += step_x;
    if (twice <= dx) error += dx, y += step_y;
  }
}

}  // namespace

// ---- axes ----------------------------------------------------------------------------------------

std::vector<double> nice_ticks(double lo, double hi) {
  check(std::isfinite(lo) && std::isfinite(hi) && lo < hi && std::isfinite(hi - lo),
        "plot: ticks need a finite range lo < hi, got [", lo, ", ", hi, "]");
  // Try steps from small to large; the first that needs at most 8 ticks needs at least 5: steps below a
  // tenth of the span need more than 8, and each step (1, 2, 2.5, 5, 10 x 10^k) at most doubles the last.
  const int magnitude = static_cast<int>(std::floor(std::log10(hi - lo)));
  for (int k = magnitude - 1; k <= magnitude + 1; ++k)
    for (double m : {1.0, 2.0, 2.5, 5.0}) {
      // Dividing by 10^-k (exact) instead of multiplying by 10^k (inexact for k < 0) makes 0.1 * 3 read 0.3.
      const double scale = std::pow(10.0, std::abs(k));
      auto tick = [&](double i) { return k >= 0 ? i * m * scale : i * m / scale; };
      const double step = tick(1);
      // A range end within rounding of a tick (a sum like 0.1 + 0.2) does not add a tick beyond it.
      const double first = std::floor(lo / step + 1e-9), last = std::ceil(hi / step - 1e-9);
      if (last - first > 7) continue;
      std::vector<double> ticks;
      for (int64_t i = 0; i <= static_cast<int64_t>(last - first); ++i) ticks.push_back(tick(first + i));
      return ticks;
    }
  return {lo, hi};  // not reached
}

namespace {

// One axis in the units it is drawn in (log2(y) on a log2 axis): the range the plot area spans, and the
// ticks inside it with their labels.
struct Axis {
  double lo = 0, hi = 1;
  std::vector<double> ticks;
  std::vector<std::string> labels;
  double fraction(double v) const { return (v - lo) / (hi - lo); }
};

// The fewest decimals that show a tick exactly, to a millionth of the step: "2", "2.5", "0.001".
std::string tick_label(double value, double step) {
  if (std::abs(value) < step * 1e-6) value = 0;  // a tick computed as 1e-17 reads "0", not "-0.00000"
  char text[64];
  if (std::abs(value) < 1e7 && step >= 1e-6) {
    for (int decimals = 0; decimals <= 8; ++decimals) {
      std::snprintf(text, sizeof text, "%.*f", decimals, value);
      if (std::abs(std::strtod(text, nullptr) - value) <= step * 1e-6) return text;
    }
  }
  for (int digits = 1; digits <= 17; ++digits) {  // beyond fixed notation's reach: 1.5e+07, 2.5e-08
    std::snprintf(text, sizeof text, "%.*g", digits, value);
    if (std::abs(std::strtod(text, nullptr) - value) <= step * 1e-6) break;
  }
  return text;
}

// The distance by which a single value (or an automatic end on the wrong side of a fixed one) is widened
// into a range: a tenth of its size, or 1 around zero.
double spread(double v) { return v == 0 ? 1 : std::abs(v) * 0.1; }

// A linear axis over the data's range [data_lo, data_hi] (data_lo > data_hi: no data) and the fixed ends.
Axis linear_axis(const std::string& what, std::optional<double> fixed_lo, std::optional<double> fixed_hi,
                 double data_lo, double data_hi) {
  const bool data = data_lo <= data_hi;
  double lo = fixed_lo.value_or(data ? data_lo : 0), hi = fixed_hi.value_or(data ? data_hi : 1);
  // Equal to within rounding counts as equal: ticks cannot resolve a range of a few ulps.
  if (!(fixed_lo && fixed_hi) && !(hi - lo > 1e-12 * std::max(std::abs(lo), std::abs(hi)))) {
    if (fixed_lo) hi = lo + spread(lo);
    else if (fixed_hi) lo = hi - spread(hi);
    else lo -= spread(lo), hi += spread(hi);
  }
  check(std::isfinite(hi - lo), "plot: ", what, " range [", lo, ", ", hi, "] is too wide to draw");
  Axis axis;
  const std::vector<double> ticks = nice_ticks(lo, hi);
  const double step = ticks.size() > 1 ? ticks[1] - ticks[0] : hi - lo;
  axis.lo = fixed_lo ? lo : std::min(lo, ticks.front());
  axis.hi = fixed_hi ? hi : std::max(hi, ticks.back());
  for (double t : ticks)
    if (t >= axis.lo - 1e-9 * step && t <= axis.hi + 1e-9 * step) {
      axis.ticks.push_back(t);
      axis.labels.push_back(tick_label(t, step));
    }
  return axis;
}

// A log2 axis, in log2 units: whole powers of two around the data, ticks at multiples of 1, 2, 5, 10, ...
Axis log2_axis(std::optional<double> fixed_lo, std::optional<double> fixed_hi, double data_lo,
               double data_hi) {
  const bool data = data_lo <= data_hi;
  Axis axis;
  axis.lo = fixed_lo ? *fixed_lo : data ? std::floor(data_lo) : 0;
  axis.hi = fixed_hi ? *fixed_hi : data ? std::ceil(data_hi) : 1;
  if (!(axis.lo < axis.hi) && !(fixed_lo && fixed_hi)) {
    if (fixed_lo) axis.hi = std::floor(axis.lo) + 1;
    else if (fixed_hi) axis.lo = std::ceil(axis.hi) - 1;
    else axis.lo -= 1, axis.hi += 1;
  }
  // The smallest step with at most 8 ticks; doubles' exponents (-1074 to 1023) bound the search.
  for (double scale = 1;; scale *= 10)
    for (double m : {1, 2, 5}) {
      const double step = m * scale, first = std::ceil(axis.lo / step), last = std::floor(axis.hi / step);
      if (last - first > 7) continue;
      for (double i = first; i <= last; ++i) {
        axis.ticks.push_back(i * step);
        axis.labels.push_back("2^" + std::to_string(static_cast<long>(i * step)));
      }
      return axis;
    }
}

}  // namespace

// ---- the chart -----------------------------------------------------------------------------------

namespace {

constexpr Rgb kWhite{255, 255, 255}, kBlack{0, 0, 0}, kGrid{200, 200, 200};
constexpr int kEdge = 8;           // the blank border around everything
constexpr int kTickLength = 5;     // tick marks point into the plot area, as in gnuplot
constexpr int kLegendSample = 28;  // the length of a legend entry's line sample
constexpr int kLegendPitch = 14;   // from one legend entry to the next

// Names for messages: a panel by its title, else its number; a series by its label, else its place.
std::string panel_name(const Panel& panel, size_t index) {
  return panel.title.empty() ? std::to_string(index + 1) : "'" + panel.title + "'";
}
std::string series_name(const Series& series, size_t index, const std::string& panel) {
  return series.label.empty() ? std::to_string(index + 1) + " of panel " + panel : "'" + series.label + "'";
}

void check_axis(const std::string& panel, char axis, std::optional<double> lo, std::optional<double> hi,
                bool log2) {
  for (const auto& [end, name] : {std::pair{lo, "_min"}, std::pair{hi, "_max"}}) {
    if (!end) continue;
    check(std::isfinite(*end), "plot: panel ", panel, " has ", axis, name, " ", *end,
          "; a fixed axis end must be finite");
    check(!log2 || *end > 0, "plot: panel ", panel, " has ", axis, name, " ", *end,
          "; a log2 axis needs positive values");
  }
  check(!lo || !hi || *lo < *hi, "plot: panel ", panel, " has the empty ", axis, " range [", lo.value_or(0),
        ", ", hi.value_or(0), "]");
}

void validate(const Chart& chart) {
  check(chart.width >= 200 && chart.width <= 8000 && chart.height >= 200 && chart.height <= 8000,
        "plot: the chart is ", chart.width, "x", chart.height, " pixels; each side must be 200-8000");
  check(!chart.panels.empty(), "plot: the chart has no panels");
  for (size_t p = 0; p < chart.panels.size(); ++p) {
    const Panel& panel = chart.panels[p];
    const std::string name = panel_name(panel, p);
    check_axis(name, 'x', panel.x_min, panel.x_max, false);
    check_axis(name, 'y', panel.y_min, panel.y_max, panel.log2_y);
    for (size_t i = 0; i < panel.series.size(); ++i) {
      const Series& s = panel.series[i];
      const std::string series = series_name(s, i, name);
      check(s.x.size() == s.y.size(), "plot: series ", series, " has ", s.x.size(), " x values but ",
            s.y.size(), " y values");
      check(s.dash >= 0 && s.dash <= 4, "plot: series ", series, " has dash ", s.dash,
            "; it must be 0 (solid) to 4");
      check(s.line_width >= 0 && s.line_width <= 4, "plot: series ", series, " has line width ",
            s.line_width, "; it must be 0 (no line) to 4");
      check(s.line_width > 0 || s.points, "plot: series ", series,
            " draws nothing: line width 0 and no points");
    }
  }
}

// Point i of a series in axis units (log2(y) on a log2 axis), or nothing where the line breaks.
std::optional<std::pair<double, double>> point(const Series& s, size_t i, bool log2_y) {
  const double x = s.x[i], y = s.y[i];
  if (!std::isfinite(x) || !std::isfinite(y) || (log2_y && y <= 0)) return std::nullopt;
  return std::pair{x, log2_y ? std::log2(y) : y};
}

struct Axes {
  Axis x, y;
};

Axes make_axes(const Panel& panel, const std::string& name) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  double x_lo = kInf, x_hi = -kInf, y_lo = kInf, y_hi = -kInf;
  for (const Series& s : panel.series)
    for (size_t i = 0; i < s.x.size(); ++i)
      if (const auto p = point(s, i, panel.log2_y)) {
        x_lo = std::min(x_lo, p->first), x_hi = std::max(x_hi, p->first);
        y_lo = std::min(y_lo, p->second), y_hi = std::max(y_hi, p->second);
      }
  Axes axes;
  axes.x = linear_axis("panel " + name + " x", panel.x_min, panel.x_max, x_lo, x_hi);
  if (panel.log2_y) {
    auto log2_of = [](std::optional<double> v) { return v ? std::optional(std::log2(*v)) : std::nullopt; };
    axes.y = log2_axis(log2_of(panel.y_min), log2_of(panel.y_max), y_lo, y_hi);
  } else {
    axes.y = linear_axis("panel " + name + " y", panel.y_min, panel.y_max, y_lo, y_hi);
  }
  return axes;
}

// The series as polylines through its points, broken at the points that cannot be drawn, plus its markers.
void draw_series(Image& image, const Box& frame, const Axes& axes, const Series& s, bool log2_y) {
  Pen pen{s.colour, s.line_width, s.dash};
  double last_x = 0, last_y = 0;
  bool continues = false;
  for (size_t i = 0; i < s.x.size(); ++i) {
    const auto p = point(s, i, log2_y);
    const double x = p ? frame.left + axes.x.fraction(p->first) * (frame.right - frame.left) : NAN;
    const double y = p ? frame.bottom - axes.y.fraction(p->second) * (frame.bottom - frame.top) : NAN;
    if (!std::isfinite(x) || !std::isfinite(y)) {
      continues = false;
      pen.position = 0;
      continue;
    }
    // A polyline's first point is a segment of its own, so a point between two gaps still shows.
    if (s.line_width > 0)
      draw_segment(image, frame, continues ? last_x : x, continues ? last_y : y, x, y, pen);
    if (s.points && x > frame.left - 3 && x < frame.right + 3 && y > frame.top - 3 && y < frame.bottom + 3) {
      const int cx = static_cast<int>(std::lround(x)), cy = static_cast<int>(std::lround(y));
      fill(image, frame, cx - 2, cy - 2, cx + 2, cy + 2, s.colour);
    }
    last_x = x, last_y = y;
    continues = true;
  }
}

// Labels every `stride`-th tick, so that labels `size` pixels long (plus a gap) never touch: on a narrow plot
// area the grid keeps every tick, the labels only as many as fit.
int label_stride(const std::vector<double>& ticks, const Axis& axis, int length, int size) {
  if (ticks.size() < 2) return 1;
  const double spacing = std::abs(axis.fraction(ticks[1]) - axis.fraction(ticks[0])) * length;
  return spacing >= size + 6 ? 1 : static_cast<int>(std::ceil((size + 6) / std::max(spacing, 1.0)));
}

// One panel in the band of rows [band_top, band_bottom], its plot area spanning columns [left, right].
void draw_panel(Image& image, const Panel& panel, const Axes& axes, int left, int right, int band_top,
                int band_bottom) {
  const int top = band_top + (panel.title.empty() ? 6 : kLineHeight + 8);
  // Below the frame: the tick labels, the x label, a gap to the next panel.
  const int below = 7 + kLineHeight + (panel.x_label.empty() ? 0 : 6 + kLineHeight) + 12;
  const int bottom = std::max(top + 20, band_bottom - below);
  const Box frame{left, top, right, bottom};
  const int centre = (left + right) / 2;
  if (!panel.title.empty()) draw_text_centred(image, centre, band_top, panel.title, kBlack);

  // Grid, tick marks and tick labels. The grid is dotted and light so the curves stand out over it.
  int widest = 0;
  for (const std::string& label : axes.x.labels) widest = std::max(widest, text_width(label));
  const int x_stride = label_stride(axes.x.ticks, axes.x, right - left, widest);
  const int y_stride = label_stride(axes.y.ticks, axes.y, bottom - top, kLineHeight);
  for (size_t i = 0; i < axes.x.ticks.size(); ++i) {
    const int x = static_cast<int>(std::lround(left + axes.x.fraction(axes.x.ticks[i]) * (right - left)));
    if (x > left && x < right)
      for (int y = top + 3; y < bottom; y += 3) image.set(x, y, kGrid);
    for (int k = 0; k < kTickLength; ++k) image.set(x, bottom - k, kBlack), image.set(x, top + k, kBlack);
    if (i % x_stride == 0) draw_text_centred(image, x, bottom + 7, axes.x.labels[i], kBlack);
  }
  for (size_t i = 0; i < axes.y.ticks.size(); ++i) {
    const int y = static_cast<int>(std::lround(bottom - axes.y.fraction(axes.y.ticks[i]) * (bottom - top)));
    if (y > top && y < bottom)
      for (int x = left + 3; x < right; x += 3) image.set(x, y, kGrid);
    for (int k = 0; k < kTickLength; ++k) image.set(left + k, y, kBlack), image.set(right - k, y, kBlack);
    const std::string& label = axes.y.labels[i];
    if (i % y_stride == 0) draw_text(image, left - 6 - text_width(label), y - kCapMiddle, label, kBlack);
  }
  fill(image, frame, left, top, right, top, kBlack);
  fill(image, frame, left, bottom, right, bottom, kBlack);
  fill(image, frame, left, top, left, bottom, kBlack);
  fill(image, frame, right, top, right, bottom, kBlack);
  if (!panel.x_label.empty())
    draw_text_centred(image, centre, bottom + 7 + kLineHeight + 6, panel.x_label, kBlack);
  if (!panel.y_label.empty())
    draw_text(image, kEdge, (top + bottom) / 2 + text_width(panel.y_label) / 2, panel.y_label, kBlack, true);

  // Curves go over the frame: a curve along an axis end (a loss scale of 1 at 2^0) stays visible.
  for (const Series& s : panel.series) draw_series(image, frame, axes, s, panel.log2_y);

  // The legend: one row per labelled series, a line sample then the label, as many as the band has room for.
  const Box anywhere{0, 0, image.width() - 1, image.height() - 1};
  int y = top + 2;
  for (const Series& s : panel.series) {
    if (s.label.empty()) continue;
    if (y + kLineHeight > band_bottom) break;
    const int x = right + 14, middle = y + kCapMiddle;
    Pen pen{s.colour, s.line_width, s.dash};
    if (s.line_width > 0) draw_segment(image, anywhere, x, middle, x + kLegendSample - 1, middle, pen);
    const int dot = x + kLegendSample / 2;
    if (s.points) fill(image, anywhere, dot - 2, middle - 2, dot + 2, middle + 2, s.colour);
    draw_text(image, x + kLegendSample + 6, y, s.label, kBlack);
    y += kLegendPitch;
  }
}

}  // namespace

Image render(const Chart& chart) {
  validate(chart);
  std::vector<Axes> axes;
  for (size_t p = 0; p < chart.panels.size(); ++p)
    axes.push_back(make_axes(chart.panels[p], panel_name(chart.panels[p], p)));

  // Margins shared by all panels, so that their plot areas line up: the left one fits the widest y tick
  // label and the turned y label, the right one the longest legend label (or half an x tick label).
  int widest_tick = 0, widest_legend = -1;
  bool y_label = false;
  for (size_t p = 0; p < chart.panels.size(); ++p) {
    for (const std::string& label : axes[p].y.labels) widest_tick = std::max(widest_tick, text_width(label));
    for (const Series& s : chart.panels[p].series)
      if (!s.label.empty()) widest_legend = std::max(widest_legend, text_width(s.label));
    y_label = y_label || !chart.panels[p].y_label.empty();
  }
  const int left = kEdge + (y_label ? kLineHeight + 8 : 0) + widest_tick + 6;
  const int right_margin = widest_legend < 0 ? 24 : 14 + kLegendSample + 6 + widest_legend + kEdge;
  const int right = std::max(left + 20, chart.width - 1 - right_margin);

  Image image(chart.width, chart.height, kWhite);
  int top = kEdge;
  if (!chart.title.empty()) {
    draw_text_centred(image, chart.width / 2, top, chart.title, kBlack);
    top += kLineHeight + 10;
  }
  const int n = static_cast<int>(chart.panels.size());
  const int band = (chart.height - kEdge - top) / n;
  for (int p = 0; p < n; ++p)
    draw_panel(image, chart.panels[p], axes[p], left, right, top + p * band, top + (p + 1) * band - 1);
  return image;
}

}  // namespace mixtape::plot
