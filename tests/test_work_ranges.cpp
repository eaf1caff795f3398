// How a parallel kernel deals its work out (tensor/cpu/work_ranges.h): every index exactly once, each thread
// first on its own even share from the front, and a thread that runs dry takes the back half of the others'.
#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "tensor/cpu/work_ranges.h"
#include "tensor/error.h"

namespace mixtape::cpu {
namespace {

struct Chunk {
  int thread;
  int64_t first, count;
};

// The chunks each thread of a `team` takes, in order; `stall(chunk, i)` runs as a thread takes its chunk i
// (from 1).
template <class Stall>
std::vector<Chunk> deal(int team, int64_t n, int64_t most, int64_t least, Stall stall) {
  WorkRanges ranges(n, team, most, least);
  std::vector<std::vector<Chunk>> taken(static_cast<size_t>(team));
#pragma omp parallel num_threads(team)
  {
    const int thread = omp_get_thread_num();
    ranges.start(thread, omp_get_num_threads());
#pragma omp barrier
    int64_t first = 0, count = 0;
    while (ranges.next(thread, first, count)) {
      taken[static_cast<size_t>(thread)].push_back({thread, first, count});
      stall(taken[static_cast<size_t>(thread)].back(), taken[static_cast<size_t>(thread)].size());
    }
  }
  std::vector<Chunk> all;
  for (const auto& chunks : taken) all.insert(all.end(), chunks.begin(), chunks.end());
  return all;
}

// Every index of [0, n) in exactly one chunk, and no chunk longer than `most`.
void expect_each_index_once(const std::vector<Chunk>& chunks, int64_t n, int64_t most) {
  std::vector<int> hits(static_cast<size_t>(n), 0);
  for (const Chunk& c : chunks) {
    EXPECT_GE(c.count, 1);
    EXPECT_LE(c.count, most);
    for (int64_t i = c.first; i < c.first + c.count; ++i) {
      ASSERT_TRUE(i >= 0 && i < n) << "chunk [" << c.first << ", " << c.first + c.count << ") of " << n;
      ++hits[static_cast<size_t>(i)];
    }
  }
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(hits[static_cast<size_t>(i)], 1) << "index " << i;
}

TEST(WorkRanges, DealsEveryIndexExactlyOnceOnAnyTeam) {
  // Oversubscribed teams (up to 7 threads on this machine's cores) race for the same ranges.
  for (int team : {1, 2, 3, 7}) {
    for (int64_t n : {0, 1, 5, 171, 1000}) {
      for (int64_t most : {1, 8}) {
        SCOPED_TRACE("team " + std::to_string(team) + ", n " + std::to_string(n) + ", most " + std::to_string(most));
        expect_each_index_once(deal(team, n, most, 1, [](const Chunk&, size_t) {}), n, most);
      }
    }
  }
}

TEST(WorkRanges, OneThreadTakesItsShareFromTheFrontInChunksThatHalveAtTheEnd) {
  // 85 indices, at most 8: 8 while half of what is left (rounded up) is at least 8 (left 85, 77, .., 21),
  // then that half: 7 of 13, 3 of 6, 2 of 3, 1 of 1.
  const std::vector<Chunk> chunks = deal(1, 85, 8, 1, [](const Chunk&, size_t) {});
  std::vector<int64_t> counts, firsts;
  for (const Chunk& c : chunks) {
    counts.push_back(c.count);
    firsts.push_back(c.first);
  }
  EXPECT_EQ(counts, (std::vector<int64_t>{8, 8, 8, 8, 8, 8, 8, 8, 8, 7, 3, 2, 1}));
  int64_t next = 0;
  for (const Chunk& c : chunks) {
    EXPECT_EQ(c.first, next);
    next += c.count;
  }
}

// Waits until `flag` is set (at most 20 s, so that a broken WorkRanges fails the test rather than hangs it).
void wait_for(const std::atomic<bool>& flag) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!flag.load() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

TEST(WorkRanges, ChunksShrinkNoFurtherThanLeast) {
  // 11 indices, 4 to 8 a chunk: half of 11 is 6; half of the 5 left is 3, raised to 4; the 1 left after that.
  // With least = most, whole chunks of 8 and the rest.
  for (auto [least, want] : {std::pair<int64_t, std::vector<int64_t>>{4, {6, 4, 1}}, {8, {8, 3}}, {1, {6, 3, 1, 1}}}) {
    std::vector<int64_t> counts;
    for (const Chunk& c : deal(1, 11, 8, least, [](const Chunk&, size_t) {})) counts.push_back(c.count);
    EXPECT_EQ(counts, want) << "least " << least;
  }
  for (int64_t least : {1, 3, 8}) expect_each_index_once(deal(3, 1000, 8, least, [](const Chunk&, size_t) {}), 1000, 8);
}

TEST(WorkRanges, AThreadThatRunsDryTakesTheBackHalfOfAnother) {
  // Two threads, 100 indices, chunks of at most 4: thread 0 owns [0, 50), thread 1 [50, 100). Thread 1 takes
  // [50, 54) and stalls there; thread 0 waits for that, runs through its share, and must then take the back
  // half of thread 1's unstarted [54, 100), [77, 100), and work through it from the front (4, 4, 4, 4, 4, 2, 1)
  // before thread 1 moves again (the first of them straight from the steal, the rest from its own range).
  if (omp_get_thread_limit() < 2) GTEST_SKIP() << "OMP_THREAD_LIMIT allows one thread";
  std::atomic<bool> one_started{false}, stolen{false};
  int64_t zero_past_50 = 0;
  const std::vector<Chunk> chunks = deal(2, 100, 4, 1, [&](const Chunk& c, size_t i) {
    if (c.thread == 1 && i == 1) {
      one_started = true;
      wait_for(stolen);
    }
    if (c.thread == 0 && i == 1) wait_for(one_started);
    if (c.thread == 0 && c.first >= 50 && (zero_past_50 += c.count) >= 23) stolen = true;
  });
  expect_each_index_once(chunks, 100, 4);
  std::vector<int64_t> zero_firsts_past_50;
  for (const Chunk& c : chunks) {
    if (c.thread == 1) {
      EXPECT_GE(c.first, 50);
    }
    if (c.thread == 0 && c.first < 50) {
      EXPECT_LE(c.first + c.count, 50);
    }
    if (c.thread == 0 && c.first >= 50) zero_firsts_past_50.push_back(c.first);
  }
  ASSERT_GE(zero_firsts_past_50.size(), 7u);
  EXPECT_EQ(std::vector<int64_t>(zero_firsts_past_50.begin(), zero_firsts_past_50.begin() + 7),
            (std::vector<int64_t>{77, 81, 85, 89, 93, 97, 99}));
}

TEST(WorkRanges, BadArgumentsAreErrors) {
  WorkRanges ranges(10, 2, 4);
  EXPECT_THROW(ranges.start(2, 2), Error);
  EXPECT_THROW(ranges.start(0, 3), Error);
  int64_t first = 0, count = 0;
  EXPECT_THROW(ranges.next(5, first, count), Error);
  EXPECT_THROW(ranges.next(-1, first, count), Error);
  EXPECT_THROW(WorkRanges(10, 0, 4), Error);
  EXPECT_THROW(WorkRanges(int64_t{1} << 31, 2, 4), Error);
  EXPECT_THROW(WorkRanges(-1, 2, 4), Error);
  EXPECT_THROW(WorkRanges(10, 2, 0), Error);
  EXPECT_THROW(WorkRanges(10, 2, 4, 5), Error);
  EXPECT_THROW(WorkRanges(10, 2, 4, 0), Error);
}

}  // namespace
}  // namespace mixtape::cpu
