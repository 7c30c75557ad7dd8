// The asynchronous offloader: interleaved copy/to_disk/from_disk jobs waited on out of order give the
// right bytes in both io modes (with disk batches), a failed job rethrows from its own wait while
// other tickets complete, ticket misuse is an error, the counters add up to the byte, the destructor
// runs what is pending without hanging, and wait time grows when the caller waits on a slow job.
#include "memory/offloader.h"

#include <sys/mman.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "util/spill_scratch.h"

namespace oomless {
namespace {

namespace fs = std::filesystem;
using namespace oomless::test;


// Keeps the worker busy for a while (tens of milliseconds: fresh pages fault in as they are written),
// so that the jobs issued after it queue up behind it.
struct SlowCopy {
  size_t n = size_t(64) << 20;
  void* dst = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  std::vector<uint8_t> src = std::vector<uint8_t>(n, 0x5A);
  ~SlowCopy() { ::munmap(dst, n); }
};

// Groups of writes, then reads of the same slots, then RAM copies, then rewrites of the same slots and
// reads again: each group is one kind, so the worker batches it; FIFO makes every read see the write
// issued just before it. Waits go in a shuffled order.
void interleaved(IoMode mode) {
  Scratch s;
  NEED_SCRATCH(s);
  Ledger ledger;
  const size_t sb = 16384 + 3;
  auto disk = SpillFile::open(s.path, sb, ledger, Category::kv, mode);
  std::mt19937_64 rng(1234);
  const int pages = 48;
  std::vector<std::vector<uint8_t>> dev(pages), dev2(pages), back(pages), back2(pages), host(pages);
  std::vector<size_t> len(pages), off(pages);
  std::vector<int64_t> slot(pages);
  for (int i = 0; i < pages; ++i) {
    len[size_t(i)] = 1 + size_t(rng() % sb);
    off[size_t(i)] = size_t(rng() % (sb - len[size_t(i)] + 1));
    dev[size_t(i)] = random_bytes(rng, len[size_t(i)]);
    dev2[size_t(i)] = random_bytes(rng, len[size_t(i)]);
    back[size_t(i)].assign(len[size_t(i)], 0);
    back2[size_t(i)].assign(len[size_t(i)], 0);
    host[size_t(i)].assign(len[size_t(i)], 0);
    slot[size_t(i)] = disk->alloc_slot();
  }
  SlowCopy slow;
  ASSERT_NE(slow.dst, MAP_FAILED);
  Offloader off_(disk.get());
  std::vector<Offloader::Ticket> tickets;
  tickets.push_back(off_.copy(slow.dst, slow.src.data(), slow.n, Tier::Host, Tier::Host));
  for (int g = 0; g < pages; g += 8) {
    for (int i = g; i < g + 8; ++i)
      tickets.push_back(off_.to_disk(slot[size_t(i)], dev[size_t(i)].data(), len[size_t(i)], off[size_t(i)], Tier::Device));
    for (int i = g; i < g + 8; ++i)
      tickets.push_back(off_.from_disk(back[size_t(i)].data(), slot[size_t(i)], len[size_t(i)], off[size_t(i)], Tier::Host));
    for (int i = g; i < g + 8; ++i)
      tickets.push_back(off_.copy(host[size_t(i)].data(), dev[size_t(i)].data(), len[size_t(i)], Tier::Device, Tier::Host));
    for (int i = g; i < g + 8; ++i)
      tickets.push_back(off_.to_disk(slot[size_t(i)], dev2[size_t(i)].data(), len[size_t(i)], off[size_t(i)], Tier::Device));
    for (int i = g; i < g + 8; ++i)
      tickets.push_back(off_.from_disk(back2[size_t(i)].data(), slot[size_t(i)], len[size_t(i)], off[size_t(i)]));
  }
  std::shuffle(tickets.begin(), tickets.end(), rng);
  for (auto t : tickets) off_.wait(t);
  for (int i = 0; i < pages; ++i) {
    EXPECT_TRUE(back[size_t(i)] == dev[size_t(i)]) << "page " << i << ": the read did not see the first write";
    EXPECT_TRUE(back2[size_t(i)] == dev2[size_t(i)]) << "page " << i << ": the read did not see the rewrite";
    EXPECT_TRUE(host[size_t(i)] == dev[size_t(i)]) << "page " << i << ": RAM copy";
  }
  OffloadStats st = off_.stats();
  EXPECT_EQ(st.jobs, tickets.size());
  EXPECT_EQ(st.failed_jobs, 0u);
  EXPECT_GT(st.batched_jobs, 0u) << "the disk jobs queued behind a slow copy were not batched";
}

TEST(Offloader, InterleavedJobsWaitedOutOfOrderGiveTheRightBytesWithPreadPwrite) { interleaved(IoMode::posix); }

TEST(Offloader, InterleavedJobsWaitedOutOfOrderGiveTheRightBytesWithIoUring) {
  std::string why;
  if (!SpillFile::uring_available(&why)) GTEST_SKIP() << why;
  interleaved(IoMode::uring);
}

TEST(Offloader, AFailedJobRethrowsFromItsOwnWaitAndOthersComplete) {
  Scratch s;
  NEED_SCRATCH(s);
  Ledger ledger;
  const size_t sb = 4096;
  EnvGuard fault("OOMLESS_FAULT_SPILL_ENOSPC_AFTER", std::to_string(sb));
  auto disk = SpillFile::open(s.path, sb, ledger, Category::kv);
  int64_t s0 = disk->alloc_slot(), s1 = disk->alloc_slot();
  std::vector<uint8_t> a(sb, 1), b(sb, 2), c(sb, 0), d(sb, 0);
  Offloader off(disk.get());
  auto t_bad_slot = off.from_disk(c.data(), 77, 16);   // slot 77 was never allocated
  auto t_ok_write = off.to_disk(s0, a.data(), sb);      // fills the (fake) disk exactly
  auto t_full = off.to_disk(s1, b.data(), sb);          // ENOSPC
  auto t_ok_copy = off.copy(d.data(), b.data(), sb, Tier::Host, Tier::Device);
  auto t_ok_read = off.from_disk(c.data(), s0, sb);
  off.wait(t_ok_copy);  // a later ticket first: not poisoned by the failures before it
  EXPECT_TRUE(d == b);
  std::string m = error_of([&] { off.wait(t_full); });
  EXPECT_TRUE(contains(m, "is full") && contains(m, "ENOSPC") && contains(m, s.path)) << m;
  m = error_of([&] { off.wait(t_bad_slot); });
  EXPECT_TRUE(contains(m, "not in use")) << m;
  off.wait(t_ok_write);
  off.wait(t_ok_read);
  EXPECT_TRUE(c == a);
  EXPECT_EQ(off.stats().failed_jobs, 2u);
  // wait_all throws the first failure among the tickets it consumes, and counts the others.
  auto t1 = off.from_disk(c.data(), 78, 16);
  auto t2 = off.copy(d.data(), a.data(), sb, Tier::Host, Tier::Host);
  auto t3 = off.from_disk(c.data(), 79, 16);
  m = error_of([&] { off.wait_all(); });
  EXPECT_TRUE(contains(m, "slot 78") && contains(m, "1 later transfers failed")) << m;
  EXPECT_TRUE(d == a);
  EXPECT_TRUE(off.done(t1) && off.done(t2) && off.done(t3));
  off.wait_all();  // nothing left: no error
}

TEST(Offloader, TicketMisuseIsAnError) {
  Offloader off;  // no spill file
  std::vector<uint8_t> a(100, 1), b(100, 0);
  off.wait(0);  // no-op
  EXPECT_TRUE(off.done(0));
  auto t = off.copy(b.data(), a.data(), 100, Tier::Device, Tier::Host);
  off.wait(t);
  EXPECT_TRUE(off.done(t));
  EXPECT_TRUE(contains(error_of([&] { off.wait(t); }), "already waited"));
  EXPECT_TRUE(contains(error_of([&] { off.wait(t + 100); }), "no such ticket"));
  EXPECT_TRUE(contains(error_of([&] { (void)off.done(t + 100); }), "no such ticket"));
  EXPECT_TRUE(contains(error_of([&] { off.to_disk(0, a.data(), 10); }), "needs a spill file"));
  EXPECT_TRUE(contains(error_of([&] { off.copy(b.data(), a.data(), 10, Tier::Host, Tier::Disk); }), "to_disk"));
}

TEST(Offloader, CountersAddUpPerDirection) {
  Scratch s;
  NEED_SCRATCH(s);
  Ledger ledger;
  auto disk = SpillFile::open(s.path, 1000, ledger, Category::kv);
  int64_t sl = disk->alloc_slot();
  std::vector<uint8_t> a(1000, 3), b(1000, 0);
  Offloader off(disk.get());
  off.wait(off.copy(b.data(), a.data(), 100, Tier::Device, Tier::Host));
  off.copy(b.data(), a.data(), 200, Tier::Device, Tier::Host);
  off.copy(b.data(), a.data(), 30, Tier::Host, Tier::Device);
  off.to_disk(sl, a.data(), 1000, 0, Tier::Device);
  off.to_disk(sl, a.data(), 7, 993, Tier::Host);
  off.from_disk(b.data(), sl, 500, 100, Tier::Host);
  off.from_disk(b.data(), sl, 11);  // to Device by default
  off.from_disk(b.data(), 999, 5);  // fails: its bytes are not counted
  EXPECT_THROW(off.wait_all(), Error);
  OffloadStats st = off.stats();
  auto at = [&](Tier f, Tier t) { return st.bytes[static_cast<int>(f)][static_cast<int>(t)]; };
  EXPECT_EQ(at(Tier::Device, Tier::Host), 300u);
  EXPECT_EQ(at(Tier::Host, Tier::Device), 30u);
  EXPECT_EQ(at(Tier::Device, Tier::Disk), 1000u);
  EXPECT_EQ(at(Tier::Host, Tier::Disk), 7u);
  EXPECT_EQ(at(Tier::Disk, Tier::Host), 500u);
  EXPECT_EQ(at(Tier::Disk, Tier::Device), 11u);
  EXPECT_EQ(at(Tier::Device, Tier::Device) + at(Tier::Host, Tier::Host) + at(Tier::Disk, Tier::Disk), 0u);
  EXPECT_EQ(st.jobs, 8u);
  EXPECT_EQ(st.failed_jobs, 1u);
  EXPECT_GT(st.busy_seconds, 0.0);
  off.reset_stats();
  st = off.stats();
  EXPECT_EQ(st.jobs, 0u);
  EXPECT_EQ(st.bytes[0][1], 0u);
  EXPECT_EQ(st.wait_seconds, 0.0);
}

TEST(Offloader, DestructorRunsPendingJobsWithoutHanging) {
  Scratch s;
  NEED_SCRATCH(s);
  Ledger ledger;
  auto disk = SpillFile::open(s.path, 256, ledger, Category::kv);
  std::mt19937_64 rng(5);
  const int n = 300;
  std::vector<std::vector<uint8_t>> src(n), dst(n, std::vector<uint8_t>(256, 0));
  for (auto& v : src) v = random_bytes(rng, 256);
  std::vector<int64_t> slots(n);
  for (auto& sl : slots) sl = disk->alloc_slot();
  auto off = std::make_unique<Offloader>(disk.get());
  SlowCopy slow;
  ASSERT_NE(slow.dst, MAP_FAILED);
  off->copy(slow.dst, slow.src.data(), slow.n, Tier::Host, Tier::Host);
  for (int i = 0; i < n; ++i) {
    off->to_disk(slots[size_t(i)], src[size_t(i)].data(), 256);
    off->from_disk(dst[size_t(i)].data(), slots[size_t(i)], 256);
  }
  off->from_disk(dst[0].data(), 12345, 1);  // a failure nobody waits on must not escape
  std::packaged_task<void()> destroy([&] { off.reset(); });
  auto finished = destroy.get_future();
  std::thread t(std::move(destroy));
  if (finished.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    t.detach();
    FAIL() << "~Offloader did not return within 20 s";
  }
  t.join();
  for (int i = 0; i < n; ++i) ASSERT_TRUE(dst[size_t(i)] == src[size_t(i)]) << "job " << i << " was not run";
}

TEST(Offloader, WaitSecondsGrowWhenWaitingOnASlowJob) {
  Offloader off;
  SlowCopy slow;
  ASSERT_NE(slow.dst, MAP_FAILED);
  // A wait issued right after a job that takes the worker tens of milliseconds blocks for most of that
  // time. Retried, since the scheduler may in rare cases run the whole job before the wait begins.
  double wait_share = 0;
  for (int attempt = 0; attempt < 3 && wait_share < 0.5; ++attempt) {
    off.reset_stats();
    ::madvise(slow.dst, slow.n, MADV_DONTNEED);  // fresh pages again, so the copy stays slow
    off.wait(off.copy(slow.dst, slow.src.data(), slow.n, Tier::Device, Tier::Host));
    OffloadStats st = off.stats();
    ASSERT_GT(st.busy_seconds, 0.0);
    wait_share = st.wait_seconds / st.busy_seconds;
  }
  EXPECT_GE(wait_share, 0.5) << "wait() did not count the time spent blocked";
  EXPECT_EQ(std::memcmp(slow.dst, slow.src.data(), slow.n), 0);
}

}  // namespace
}  // namespace oomless
