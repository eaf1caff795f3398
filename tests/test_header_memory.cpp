// The memory load_safetensors takes follows what a file describes, not how large its header is: a header
// padded to the format's limit (~99 MB of whitespace, of tiny metadata keys, of a long array) costs about
// its own size. Each load runs in a child process whose peak resident memory (wait4's ru_maxrss), less its
// peak before the load, is compared with a bound of 1.5 x the header + 32 MiB; the figure is recorded as
// the test's property extra_peak_kib (--gtest_output=xml).
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "io/safetensors.h"

#if defined(__SANITIZE_ADDRESS__)
#define MIXTAPE_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MIXTAPE_TEST_ASAN 1
#endif
#endif

namespace mixtape {
namespace {

namespace fs = std::filesystem;

constexpr size_t kHeaderBytes = 99'000'000;  // near the format's limit of 100,000,000

struct LoadOutcome {
  bool loaded = false;
  std::string error;         // the Error's message when not loaded
  size_t tensors = 0;        // when loaded
  long extra_peak_kib = 0;   // the child's peak resident memory past its peak before the load
};

// Loads `file` in a child process and reports what happened and the memory it took.
LoadOutcome load_in_child(const std::string& file) {
  int channel[2];
  EXPECT_EQ(::pipe(channel), 0);
  const pid_t child = ::fork();
  if (child < 0) {
    ADD_FAILURE() << "fork failed";
    return {};
  }
  if (child == 0) {
    ::close(channel[0]);
    // The peak so far (the resident memory the child starts with) comes first, on a line of its own.
    struct rusage before {};
    ::getrusage(RUSAGE_SELF, &before);
    std::string report = std::to_string(before.ru_maxrss) + "\n";
    int status = 0;
    try {
      report += std::to_string(load_safetensors(file).tensors.size());
    } catch (const std::exception& error) {
      report += error.what();
      status = 1;
    }
    const ssize_t written = ::write(channel[1], report.data(), report.size());
    _exit(written == static_cast<ssize_t>(report.size()) ? status : 2);
  }
  ::close(channel[1]);
  std::string report;
  char buffer[4096];
  for (ssize_t got; (got = ::read(channel[0], buffer, sizeof buffer)) > 0;) report.append(buffer, got);
  ::close(channel[0]);
  int status = 0;
  struct rusage usage {};
  EXPECT_EQ(::wait4(child, &status, 0, &usage), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) <= 1) << "child status " << status;
  LoadOutcome outcome;
  const size_t line_end = report.find('\n');
  if (line_end == std::string::npos) {
    ADD_FAILURE() << "the child reported nothing";
    return outcome;
  }
  outcome.extra_peak_kib = usage.ru_maxrss - std::stol(report.substr(0, line_end));
  report.erase(0, line_end + 1);
  outcome.loaded = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (outcome.loaded) outcome.tensors = std::stoul(report);
  else outcome.error = report;
  return outcome;
}

// The bound of the specification: 1.5 x the header plus a constant, in KiB. The child's code pages count
// as they are touched again, which the constant covers.
void expect_peak_within_bound(const LoadOutcome& outcome, size_t header_bytes) {
  ::testing::Test::RecordProperty("extra_peak_kib", std::to_string(outcome.extra_peak_kib));
#ifdef MIXTAPE_TEST_ASAN
  GTEST_SKIP() << "AddressSanitizer's shadow memory inflates resident memory; the bound is checked without it";
#endif
  const long bound_kib = static_cast<long>(header_bytes * 3 / 2 / 1024) + 32 * 1024;
  EXPECT_LE(outcome.extra_peak_kib, bound_kib) << "a header of " << header_bytes << " bytes";
}

class HeaderMemory : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "mixtape_header_memory_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    file_ = (dir_ / "padded.safetensors").string();
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  // Writes a file whose header is `head`, then piece(0), piece(1), ... while they fit, then spaces up to
  // `header_bytes` with `tail`; then `data`. Written a block at a time: the test holds no copy of the header.
  void write_file(size_t header_bytes, const std::string& head, const std::function<std::string(size_t)>& piece,
                  const std::string& tail, const std::string& data = "") {
    std::ofstream out(file_, std::ios::binary | std::ios::trunc);
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((header_bytes >> (8 * i)) & 0xFF));
    out << head;
    size_t written = head.size();
    std::string block;
    for (size_t i = 0;; ++i) {
      const std::string next = piece(i);
      if (written + next.size() + tail.size() > header_bytes) break;
      block += next;
      written += next.size();
      if (block.size() >= (1 << 20)) out << block, block.clear();
    }
    out << block << std::string(header_bytes - written - tail.size(), ' ') << tail << data;
    ASSERT_TRUE(out.good());
    out.close();
    ASSERT_EQ(fs::file_size(file_), 8 + header_bytes + data.size());
  }

  // piece(i) is always `text` repeated to about 4 KB.
  static std::function<std::string(size_t)> repeat(const std::string& text) {
    std::string block;
    while (block.size() < 4096) block += text;
    return [block](size_t) { return block; };
  }

  fs::path dir_;
  std::string file_;
};

TEST_F(HeaderMemory, WhitespacePaddingCostsNothing) {
  write_file(kHeaderBytes, "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", repeat(" "), "",
             std::string(4, '\0'));
  const LoadOutcome outcome = load_in_child(file_);
  EXPECT_TRUE(outcome.loaded) << outcome.error;
  EXPECT_EQ(outcome.tensors, 1u);
  expect_peak_within_bound(outcome, kHeaderBytes);
}

TEST_F(HeaderMemory, TinyMetadataKeysAreRefusedAtTheLimitCheaply) {
  // "0":"","1":"",... : ~12 bytes each, millions of them.
  const auto keys = [](size_t i) {  // 256 keys a piece
    std::string text;
    for (size_t key = 256 * i; key < 256 * (i + 1); ++key) text.append("\"").append(std::to_string(key)).append("\":\"\",");
    return text;
  };
  write_file(kHeaderBytes, "{\"__metadata__\":{", keys, "\"last\":\"\"}}");
  const LoadOutcome outcome = load_in_child(file_);
  EXPECT_FALSE(outcome.loaded);
  EXPECT_NE(outcome.error.find("__metadata__ has more than 65536 keys (the reader's limit)"), std::string::npos)
      << outcome.error;
  expect_peak_within_bound(outcome, kHeaderBytes);
}

TEST_F(HeaderMemory, AHeaderThatIsALongArrayIsRefusedCheaply) {
  write_file(kHeaderBytes, "[", repeat("0,"), "0]");
  const LoadOutcome outcome = load_in_child(file_);
  EXPECT_FALSE(outcome.loaded);
  EXPECT_NE(outcome.error.find("the header is a JSON array, not an object"), std::string::npos) << outcome.error;
  expect_peak_within_bound(outcome, kHeaderBytes);
}

// The JSON parser copies what it reads between two strings or numbers: a header of brackets and literals
// alone is refused once that copy would pass the token limit, not read whole.
TEST_F(HeaderMemory, LiteralsAndBracketsWithoutAStringOrNumberAreRefusedCheaply) {
  write_file(kHeaderBytes, "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"note\":[",
             repeat("null,[],{},true,"), "null]}}", std::string(4, '\0'));
  const LoadOutcome outcome = load_in_child(file_);
  EXPECT_FALSE(outcome.loaded);
  EXPECT_NE(outcome.error.find("more than 16777216 bytes of JSON without a string or a number (the reader's limit)"),
            std::string::npos)
      << outcome.error;
  expect_peak_within_bound(outcome, kHeaderBytes);
}

TEST_F(HeaderMemory, ALongArrayInAMemberTheReaderSkipsCostsNothing) {
  // 6 MB (3 million values) keeps the test fast; the reader's cost per value is the same at 99 MB.
  const size_t header_bytes = 6'000'000;
  write_file(header_bytes, "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"note\":[", repeat("0,"),
             "0]}}",
             std::string(4, '\0'));
  const LoadOutcome outcome = load_in_child(file_);
  EXPECT_TRUE(outcome.loaded) << outcome.error;
  EXPECT_EQ(outcome.tensors, 1u);
  expect_peak_within_bound(outcome, header_bytes);
}

}  // namespace
}  // namespace mixtape
