// Asynchronous copies between tiers: issue now, wait later, so compute overlaps the transfers that move
// K/V pages of past chunks to Host RAM or the Disk spill file and back.
//
// Each call returns a Ticket at once; the copy runs on one worker thread. On a CPU build a
// Device<->Host copy is a memcpy done by the worker; on CUDA the same interface maps onto a copy
// stream, a ticket onto an event, wait() onto cudaEventSynchronize.
//
// Guarantees:
// - Jobs run in issue order (FIFO): a from_disk issued after a to_disk of the same slot reads what
//   that to_disk wrote. Consecutive disk jobs of one direction on distinct slots of one file that are
//   waiting in the queue go to the spill file as one batch (one io_uring submission); that changes nothing the
//   caller can observe except speed.
// - Every buffer a job reads or writes must stay valid, and untouched by the caller, until its ticket
//   has been waited on (or wait_all() or the destructor has returned).
// - An error in a job is kept with its ticket and rethrown by wait() as oomless::Error with the
//   original message; other tickets are not affected. Nothing escapes the worker.
// - The destructor runs every job still queued, then joins the worker. Errors of tickets never waited
//   on are dropped there.
// - wait(0) does nothing; waiting twice on a ticket, or on one never issued, is an error.
//
// One thread issues and waits (the training loop); stats() may be read from any thread.
#pragma once
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/tier.h"
#include "memory/spill_file.h"

namespace oomless {

struct OffloadStats {
  uint64_t bytes[kTierCount][kTierCount] = {};  // [from][to], jobs that succeeded
  uint64_t jobs = 0;                             // jobs finished, failed ones included
  uint64_t failed_jobs = 0;
  uint64_t batched_jobs = 0;   // disk jobs that ran in a batch of two or more
  double wait_seconds = 0;     // callers blocked in wait()/wait_all(): compute waiting on transfers
  double busy_seconds = 0;     // the worker moving bytes
};

class Offloader {
 public:
  using Ticket = uint64_t;  // 0 = none

  // `disk`, when given, must outlive the Offloader; without it to_disk/from_disk throw.
  explicit Offloader(SpillFile* disk = nullptr);
  Offloader(const Offloader&) = delete;
  Offloader& operator=(const Offloader&) = delete;
  ~Offloader();

  // n bytes between RAM buffers (neither tier may be Disk); the tiers are recorded for the counters.
  Ticket copy(void* dst, const void* src, size_t n, Tier from, Tier to);
  // n bytes at `offset` within a slot of the spill file (or of `file`, another one that outlives the
  // Offloader); the range is checked against the slot size now, the slot itself when the job runs.
  Ticket to_disk(int64_t slot, const void* src, size_t n, size_t offset = 0, Tier from = Tier::Host,
                 SpillFile* file = nullptr);
  Ticket from_disk(void* dst, int64_t slot, size_t n, size_t offset = 0, Tier to = Tier::Device,
                   SpillFile* file = nullptr);

  void wait(Ticket t);
  bool done(Ticket t) const;  // true too for a ticket already waited on
  // Waits for every ticket not yet waited on, in issue order, and consumes them all; then throws the
  // first failure among them, if any (naming how many others failed).
  void wait_all();

  OffloadStats stats() const;
  void reset_stats();

 private:
  enum class Kind : uint8_t { copy, write, read };
  struct Job {
    Ticket id;
    Kind kind;
    void* dst;
    const void* src;
    size_t n;
    int64_t slot;
    size_t offset;
    Tier from, to;
    SpillFile* file;  // disk jobs
  };
  struct State {
    bool done = false;
    bool claimed = false;  // a wait() has taken it
    std::string error;     // non-empty: the job failed
  };

  Ticket issue(const Job& job);
  void work();
  void run(const std::vector<Job>& batch, std::vector<std::string>& errors);

  SpillFile* disk_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // worker: a job was queued or stop_ set
  std::condition_variable done_cv_;  // waiters: a job finished
  std::deque<Job> queue_;
  std::unordered_map<Ticket, State> states_;  // tickets issued and not yet waited on
  Ticket next_ = 1;
  bool stop_ = false;
  OffloadStats stats_;
  std::thread worker_;  // last: starts after everything above is constructed
};

}  // namespace oomless
