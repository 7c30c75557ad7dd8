// The Disk tier's spill file: bit-identical round trips at random sizes and offsets in both io modes
// (pread/pwrite and io_uring, single ops and batches larger than the ring), slot reuse, the ledger's
// Disk counters, refused folders (missing, a file, unwritable, tmpfs), a full disk through the fault
// hook, and the choice of io mode.
#include "memory/spill_file.h"

#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "util/spill_scratch.h"

namespace oomless {
namespace {

namespace fs = std::filesystem;
using namespace oomless::test;


// Skips the calling test when io_uring cannot be used here, with the reason.
#define NEED_URING()                                                 \
  do {                                                               \
    std::string why;                                                 \
    if (!SpillFile::uring_available(&why)) GTEST_SKIP() << why;      \
  } while (0)

// Random (slot, offset, size) writes, checked by reading back whole slots, sub-ranges and batches.
void round_trip(IoMode mode, const char* expect_io) {
  Scratch s;
  NEED_SCRATCH(s);
  Ledger ledger;
  const size_t slot_bytes = 65536 + 7;  // odd, so offsets are not aligned to anything
  auto f = SpillFile::open(s.path, slot_bytes, ledger, Category::kv, mode);
  EXPECT_STREQ(f->io_name(), expect_io);
  std::mt19937_64 rng(42);
  const int slots = 24;
  std::vector<std::vector<uint8_t>> image(slots, std::vector<uint8_t>(slot_bytes, 0));
  for (int i = 0; i < slots; ++i) ASSERT_EQ(f->alloc_slot(), i);
  // Every slot is written in full once, so any range of it can be read back.
  for (int i = 0; i < slots; ++i) {
    image[size_t(i)] = random_bytes(rng, slot_bytes);
    f->write(i, image[size_t(i)].data(), slot_bytes);
  }
  for (int k = 0; k < 200; ++k) {
    int64_t slot = int64_t(rng() % slots);
    size_t n = k % 7 == 0 ? slot_bytes : size_t(rng() % (slot_bytes + 1));
    size_t off = n == slot_bytes ? 0 : size_t(rng() % (slot_bytes - n + 1));
    auto bytes = random_bytes(rng, n);
    f->write(slot, bytes.data(), n, off);
    std::copy(bytes.begin(), bytes.end(), image[size_t(slot)].begin() + ptrdiff_t(off));
    // Read back a random range of a random slot, between guard bytes that must survive.
    int64_t rs = int64_t(rng() % slots);
    size_t rn = size_t(rng() % (slot_bytes + 1));
    size_t roff = size_t(rng() % (slot_bytes - rn + 1));
    std::vector<uint8_t> got(rn + 128, 0xA5);
    f->read(rs, got.data() + 64, rn, roff);
    ASSERT_EQ(std::memcmp(got.data() + 64, image[size_t(rs)].data() + roff, rn), 0) << "slot " << rs << " k " << k;
    for (size_t g = 0; g < 64; ++g) ASSERT_TRUE(got[g] == 0xA5 && got[rn + 64 + g] == 0xA5) << "guard byte " << g;
  }
  // A batch of 100 ops (more than the ring's 64 entries): distinct (slot, range) pairs.
  std::vector<IoOp> ops;
  std::vector<std::vector<uint8_t>> srcs;
  for (int k = 0; k < 100; ++k) {
    int64_t slot = k % slots;
    size_t quarter = slot_bytes / 5;
    size_t off = size_t(k / slots) * quarter;  // k / slots in 0..4: disjoint ranges within a slot
    size_t n = 1 + size_t(rng() % quarter);
    srcs.push_back(random_bytes(rng, n));
    ops.push_back(IoOp{slot, srcs.back().data(), n, off});
  }
  for (size_t k = 0; k < ops.size(); ++k) ops[k].data = srcs[k].data();
  f->write_batch(ops);
  for (size_t k = 0; k < ops.size(); ++k)
    std::copy(srcs[k].begin(), srcs[k].end(), image[size_t(ops[k].slot)].begin() + ptrdiff_t(ops[k].offset));
  std::vector<std::vector<uint8_t>> back(slots, std::vector<uint8_t>(slot_bytes));
  std::vector<IoOp> reads;
  for (int i = 0; i < slots; ++i) reads.push_back(IoOp{i, back[size_t(i)].data(), slot_bytes, 0});
  std::vector<std::string> errors;
  f->read_batch(reads, &errors);
  for (int i = 0; i < slots; ++i) {
    EXPECT_EQ(errors[size_t(i)], "");
    EXPECT_TRUE(back[size_t(i)] == image[size_t(i)]) << "slot " << i << " after the batches";
  }
}

TEST(SpillFile, RoundTripsAreBitIdenticalWithPreadPwrite) { round_trip(IoMode::posix, "pread/pwrite"); }

TEST(SpillFile, RoundTripsAreBitIdenticalWithIoUring) {
  NEED_URING();
  round_trip(IoMode::uring, "io_uring");
}

TEST(SpillFile, SlotsAreReusedLastFreedFirstAndTheLedgerCountsThem) {
  Scratch s;
  NEED_SCRATCH(s);
  Ledger ledger;
  const size_t sb = 4096;
  {
    auto f = SpillFile::open(s.path, sb, ledger, Category::kv);
    EXPECT_EQ(f->alloc_slot(), 0);
    EXPECT_EQ(f->alloc_slot(), 1);
    EXPECT_EQ(f->alloc_slot(), 2);
    EXPECT_EQ(ledger.current(Tier::Disk, Category::kv), 3 * sb);
    f->free_slot(1);
    f->free_slot(0);
    EXPECT_EQ(f->slots_in_use(), 1);
    EXPECT_EQ(ledger.current(Tier::Disk, Category::kv), sb);
    EXPECT_EQ(ledger.current_total(Tier::Disk), sb);
    EXPECT_EQ(f->alloc_slot(), 0);  // last freed first
    EXPECT_EQ(f->alloc_slot(), 1);
    EXPECT_EQ(f->file_slots(), 3);  // no growth while freed slots were there
    EXPECT_EQ(f->alloc_slot(), 3);
    EXPECT_EQ(f->file_slots(), 4);
    EXPECT_EQ(ledger.current(Tier::Disk, Category::kv), 4 * sb);
    EXPECT_EQ(ledger.peak(Tier::Disk, Category::kv), 4 * sb);
    EXPECT_EQ(ledger.current(Tier::Host, Category::kv), 0u);  // disk bytes are not RAM
    // A reused slot holds what its new owner writes.
    std::vector<uint8_t> a(sb, 1), b(sb, 0);
    f->write(0, a.data(), sb);
    f->read(0, b.data(), sb);
    EXPECT_TRUE(a == b);
  }
  EXPECT_EQ(ledger.current_total(Tier::Disk), 0u);  // closing releases the slots still in use
  EXPECT_EQ(ledger.peak_total(Tier::Disk), 4 * sb);
}

TEST(SpillFile, MisuseIsAnErrorNotACorruption) {
  Scratch s;
  NEED_SCRATCH(s);
  Ledger ledger;
  auto f = SpillFile::open(s.path, 1000, ledger, Category::kv, IoMode::posix);
  int64_t a = f->alloc_slot();
  std::vector<uint8_t> buf(2000, 7);
  f->free_slot(a);
  EXPECT_TRUE(contains(error_of([&] { f->free_slot(a); }), "not in use")) << "double free";
  EXPECT_TRUE(contains(error_of([&] { f->free_slot(5); }), "not in use")) << "never allocated";
  EXPECT_TRUE(contains(error_of([&] { f->write(a, buf.data(), 10); }), "not in use")) << "write to a freed slot";
  a = f->alloc_slot();
  EXPECT_TRUE(contains(error_of([&] { f->write(a, buf.data(), 1001); }), "runs past")) << "longer than a slot";
  EXPECT_TRUE(contains(error_of([&] { f->write(a, buf.data(), 10, 995); }), "runs past")) << "offset + n";
  // Bytes that were never written at the end of the file cannot be read back as if they were, in
  // either io mode (a short read is continued, then reported).
  f->write(a, buf.data(), 10);
  std::string m = error_of([&] { f->read(a, buf.data(), 20); });
  EXPECT_TRUE(contains(m, "never written") && contains(m, "after 10 bytes") && contains(m, s.path)) << m;
  EXPECT_EQ(f->slots_in_use(), 1);
  if (SpillFile::uring_available()) {
    auto u = SpillFile::open(s.path, 1000, ledger, Category::kv, IoMode::uring);
    int64_t b = u->alloc_slot();
    u->write(b, buf.data(), 10);
    m = error_of([&] { u->read(b, buf.data(), 20); });
    EXPECT_TRUE(contains(m, "never written") && contains(m, "after 10 bytes")) << "io_uring: " << m;
  }
}

TEST(SpillFile, RefusesAMissingFolderOrAFile) {
  Scratch s;
  NEED_SCRATCH(s);
  Ledger ledger;
  const std::string missing = s.path + "/no_such_dir";
  std::string m = error_of([&] { SpillFile::open(missing, 4096, ledger, Category::kv); });
  EXPECT_TRUE(contains(m, missing) && contains(m, "does not exist") && contains(m, "--spill-dir")) << m;
  const std::string file = s.path + "/a_file";
  FILE* fp = std::fopen(file.c_str(), "w");
  ASSERT_TRUE(fp);
  std::fclose(fp);
  m = error_of([&] { SpillFile::open(file, 4096, ledger, Category::kv); });
  EXPECT_TRUE(contains(m, "not a folder") && contains(m, "--spill-dir")) << m;
}

TEST(SpillFile, RefusesAnUnwritableFolder) {
  Scratch s;
  NEED_SCRATCH(s);
  const std::string ro = s.path + "/read_only";
  ASSERT_EQ(::mkdir(ro.c_str(), 0500), 0);
  ::chmod(ro.c_str(), 0500);
  // Root (and CAP_DAC_OVERRIDE) writes through permission bits, so there is nothing to refuse.
  if (::access(ro.c_str(), W_OK) == 0) {
    ::chmod(ro.c_str(), 0700);
    GTEST_SKIP() << "permission bits do not stop this user (root?): a 0500 folder is writable";
  }
  Ledger ledger;
  std::string m = error_of([&] { SpillFile::open(ro, 4096, ledger, Category::kv); });
  ::chmod(ro.c_str(), 0700);
  EXPECT_TRUE(contains(m, ro) && contains(m, "not writable") && contains(m, "--spill-dir")) << m;
}

TEST(SpillFile, RefusesTmpfsBecauseItIsRam) {
  if (!in_ram("/dev/shm")) GTEST_SKIP() << "/dev/shm is not tmpfs here";
  Ledger ledger;
  std::string m = error_of([&] { SpillFile::open("/dev/shm", 4096, ledger, Category::kv); });
  EXPECT_TRUE(contains(m, "/dev/shm") && contains(m, "saves no memory") && contains(m, "--spill-dir")) << m;
}

TEST(SpillFile, TheFileHasNoNameInTheFolder) {
  Scratch s;
  NEED_SCRATCH(s);
  Ledger ledger;
  auto f = SpillFile::open(s.path, 4096, ledger, Category::kv);
  std::vector<uint8_t> buf(4096, 3);
  f->write(f->alloc_slot(), buf.data(), buf.size());
  EXPECT_TRUE(fs::is_empty(s.path)) << "the spill file left a name in " << s.path;
}

// The fault hook fills the disk after `limit` bytes: slot 0 (written in full before) must read back,
// the write that crosses the limit must say the disk is full, and so must a batch, per op.
void full_disk(IoMode mode) {
  Scratch s;
  NEED_SCRATCH(s);
  const size_t sb = 10000;
  EnvGuard fault("OOMLESS_FAULT_SPILL_ENOSPC_AFTER", std::to_string(sb + 1234));
  Ledger ledger;
  auto f = SpillFile::open(s.path, sb, ledger, Category::kv, mode);
  std::mt19937_64 rng(7);
  auto a = random_bytes(rng, sb), b = random_bytes(rng, sb);
  int64_t s0 = f->alloc_slot(), s1 = f->alloc_slot(), s2 = f->alloc_slot();
  f->write(s0, a.data(), sb);
  std::string m = error_of([&] { f->write(s1, b.data(), sb); });
  EXPECT_TRUE(contains(m, "is full") && contains(m, "ENOSPC") && contains(m, s.path) && contains(m, "--spill-dir") &&
              contains(m, "slot 1"))
      << m;
  std::vector<uint8_t> back(sb);
  f->read(s0, back.data(), sb);
  EXPECT_TRUE(back == a) << "a slot written before the disk filled up changed";
  // The first 1234 bytes of slot 1 did reach the disk (a short write, then ENOSPC).
  f->read(s1, back.data(), 1234);
  EXPECT_EQ(std::memcmp(back.data(), b.data(), 1234), 0);
  std::vector<std::string> errors;
  f->write_batch({IoOp{s1, b.data(), 10, 0}, IoOp{s2, b.data(), 10, 0}}, &errors);
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_TRUE(contains(errors[0], "is full") && contains(errors[1], "is full")) << errors[0] << " / " << errors[1];
  f->read(s0, back.data(), sb);  // still readable after the failed batch
  EXPECT_TRUE(back == a);
}

TEST(SpillFile, FullDiskIsAClearErrorWithPreadPwrite) { full_disk(IoMode::posix); }

TEST(SpillFile, FullDiskIsAClearErrorWithIoUring) {
  NEED_URING();
  full_disk(IoMode::uring);
}

TEST(SpillFile, AutomaticPicksIoUringWhenAvailableAndTheEnvironmentOverridesIt) {
  Scratch s;
  NEED_SCRATCH(s);
  Ledger ledger;
  std::string why;
  const bool uring = SpillFile::uring_available(&why);
  EXPECT_STREQ(SpillFile::open(s.path, 512, ledger, Category::kv)->io_name(), uring ? "io_uring" : "pread/pwrite")
      << why;
  {
    EnvGuard env("OOMLESS_SPILL_IO", "posix");
    EXPECT_STREQ(SpillFile::open(s.path, 512, ledger, Category::kv)->io_name(), "pread/pwrite");
    if (uring) {  // an explicit mode wins over the environment
      EXPECT_STREQ(SpillFile::open(s.path, 512, ledger, Category::kv, IoMode::uring)->io_name(), "io_uring");
    }
  }
  {
    EnvGuard env("OOMLESS_SPILL_IO", "uring");
    if (uring) {
      EXPECT_STREQ(SpillFile::open(s.path, 512, ledger, Category::kv)->io_name(), "io_uring");
    } else {
      EXPECT_TRUE(contains(error_of([&] { SpillFile::open(s.path, 512, ledger, Category::kv); }), "unavailable"));
    }
  }
  {
    EnvGuard env("OOMLESS_SPILL_IO", "fast");
    std::string m = error_of([&] { SpillFile::open(s.path, 512, ledger, Category::kv); });
    EXPECT_TRUE(contains(m, "OOMLESS_SPILL_IO") && contains(m, "posix")) << m;
  }
}

}  // namespace
}  // namespace oomless
