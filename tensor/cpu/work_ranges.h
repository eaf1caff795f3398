#pragma once
// Deals the indices [0, n) out to the threads of a parallel region, so that a thread the machine slows down
// leaves no tail for the others to wait on.
//
// Each thread starts on its even share and takes it from the front a chunk at a time; a thread whose share
// has run out takes the back half of the unstarted indices of the thread with the most left, and goes on
// with those as its own (from which another may take in turn). Chunks of at most `most` shrink to half of what
// is left near the end of a range, down to `least`, so that the chunk a thread is busy with when the others
// run dry is short; a kernel whose every chunk has a cost of its own (gemm16 streams all of B per chunk) keeps
// `least` at a whole block where that cost would show.
//
// Why: with even static shares a thread that the machine slows down (a busy neighbour on a virtual machine)
// leaves the others idle at the end of every product. A shared counter of shrinking chunks (OpenMP's guided
// schedule) balances as well, but interleaves the threads' chunks and ends in many one-tile chunks; this keeps
// each thread on its own rows until one runs dry. (Xeon without AMX, gemm16: with even shares the thread done
// first sat idle for 9-15% of the other's time, with the counter 1.2%; the counter and this scheme 5-6% each in
// a much busier hour, where this scheme's step was level with the counter's.)
//
// Each range is one 64-bit word, [first, end) as two 32-bit halves, so that its owner (from the front) and a
// thief (from the back) each take with one compare-and-swap. The indices are all the word guards: relaxed
// ordering suffices, and the parallel region's closing barrier publishes what the chunks computed.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "tensor/error.h"

namespace mixtape::cpu {

class WorkRanges {
 public:
  // The indices [0, n) for up to `threads` threads, in chunks of `least` to `most` (fewer where fewer are
  // left); every range starts empty. Checked here, outside the parallel region (an exception must not leave
  // one).
  WorkRanges(int64_t n, int threads, int64_t most, int64_t least = 1)
      : n_(n), threads_(threads), most_(most), least_(least) {
    check(n >= 0 && n < (int64_t{1} << 31), "WorkRanges: ", n, " indices; expected 0 to 2^31 - 1");
    check(threads >= 1, "WorkRanges: ", threads, " threads; expected at least 1");
    check(least >= 1 && least <= most, "WorkRanges: chunks of ", least, " to ", most,
          "; expected 1 <= least <= most");
    ranges_ = std::make_unique<Range[]>(static_cast<size_t>(threads));
  }

  // Gives `thread` of a team of `team` its even share. Every thread of the team calls it before any calls
  // next(): a barrier must lie between.
  void start(int thread, int team) {
    check(team >= 1 && team <= threads_ && thread >= 0 && thread < team, "WorkRanges::start: thread ", thread,
          " of a team of ", team, "; room for ", threads_);
    ranges_[thread].word.store(pack(n_ * thread / team, n_ * (thread + 1) / team), std::memory_order_relaxed);
  }

  // The next chunk [first, first + count) for `thread`: from its own range, else from the back half it takes
  // of another's (the chunk comes straight from what was taken and the rest becomes this thread's range, so
  // that no other thread can take it all away first). False when it finds none to take: any index not yet
  // dealt is then held by a thread that will deal it to itself.
  bool next(int thread, int64_t& first, int64_t& count) {
    check(thread >= 0 && thread < threads_, "WorkRanges::next: thread ", thread, "; room for ", threads_);
    for (;;) {
      if (take_front(ranges_[thread].word, first, count)) return true;
      int victim = -1;
      int64_t most_left = 0;
      for (int t = 0; t < threads_; ++t) {
        const int64_t left = size(ranges_[t].word.load(std::memory_order_relaxed));
        if (t != thread && left > most_left) {
          most_left = left;
          victim = t;
        }
      }
      if (victim < 0) return false;
      int64_t begin = 0, taken = 0;
      if (!take_back_half(ranges_[victim].word, begin, taken)) continue;
      first = begin;
      count = chunk(taken);
      ranges_[thread].word.store(pack(begin + count, begin + taken), std::memory_order_relaxed);
      return true;
    }
  }

 private:
  struct alignas(64) Range {
    std::atomic<uint64_t> word{0};
  };

  static uint64_t pack(int64_t first, int64_t end) {
    return static_cast<uint64_t>(first) << 32 | static_cast<uint64_t>(end);
  }
  static int64_t first_of(uint64_t w) { return static_cast<int64_t>(w >> 32); }
  static int64_t end_of(uint64_t w) { return static_cast<int64_t>(w & 0xffffffffu); }
  static int64_t size(uint64_t w) { return std::max<int64_t>(end_of(w) - first_of(w), 0); }

  // The chunk taken from a range with `left` indices: half of them (rounded up), within [least, most], and
  // never more than are left.
  int64_t chunk(int64_t left) const {
    return std::clamp<int64_t>((left + 1) / 2, std::min(least_, left), std::min(most_, left));
  }

  bool take_front(std::atomic<uint64_t>& word, int64_t& first, int64_t& count) const {
    uint64_t w = word.load(std::memory_order_relaxed);
    do {
      const int64_t left = size(w);
      if (left == 0) return false;
      first = first_of(w);
      count = chunk(left);
    } while (!word.compare_exchange_weak(w, pack(first + count, end_of(w)), std::memory_order_relaxed));
    return true;
  }

  // The back half (rounded up) of what is left.
  static bool take_back_half(std::atomic<uint64_t>& word, int64_t& first, int64_t& count) {
    uint64_t w = word.load(std::memory_order_relaxed);
    do {
      const int64_t left = size(w);
      if (left == 0) return false;
      count = (left + 1) / 2;
      first = end_of(w) - count;
    } while (!word.compare_exchange_weak(w, pack(first_of(w), first), std::memory_order_relaxed));
    return true;
  }

  int64_t n_;
  int threads_;
  int64_t most_, least_;
  std::unique_ptr<Range[]> ranges_;
};

}  // namespace mixtape::cpu
