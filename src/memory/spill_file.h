// The Disk tier: one anonymous spill file cut into fixed-size slots, for K/V pages of past chunks
// that neither Device nor Host memory has room for.
//
// Guarantees:
// - The file has no name (O_TMPFILE, or mkstemp + unlink where the filesystem lacks it): it vanishes
//   when the SpillFile is destroyed or the process dies, and nothing is left to clean up.
// - open() refuses a folder that is missing, not a folder, not writable, or on tmpfs/ramfs (spilling
//   to RAM saves no memory); each message names the folder and says to choose another with --spill-dir.
// - Slots are reused last-freed-first, so the file only grows when every slot is in use: its size is
//   the peak of slots in use, which the ledger reports as Tier::Disk (current = slots in use x
//   slot_bytes, under the category given at open).
// - read/write move the whole length or throw oomless::Error: short transfers are continued, EINTR
//   retried. An error names the spill folder, the errno text and what to do; ENOSPC says the disk is
//   full. A failed write leaves earlier slots readable.
// - I/O goes through io_uring (liburing) where the kernel allows it, else pread/pwrite. Batches submit
//   every op at once and wait for all of them.
//
// Environment (read once, at open):
//   OOMLESS_SPILL_IO=posix|uring           overrides IoMode::automatic (an explicit mode wins).
//   OOMLESS_FAULT_SPILL_ENOSPC_AFTER=N     test hook: writes fail with ENOSPC, as on a full disk, once
//                                          this SpillFile has written N bytes (in both io modes).
//
// Thread safety: every method may be called from any thread; I/O calls are serialised (one io_uring
// ring). Freeing a slot while a transfer on it is in flight is the caller's bug.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "memory/arena.h"

namespace oomless {

enum class IoMode { automatic, uring, posix };

// One transfer of a batch: n bytes at offset within slot. `data` is the source of a write (only read)
// or the destination of a read.
struct IoOp {
  int64_t slot = -1;
  void* data = nullptr;
  size_t n = 0;
  size_t offset = 0;
};

class SpillFile {
 public:
  // `ledger` must outlive the SpillFile.
  static std::unique_ptr<SpillFile> open(const std::string& dir, size_t slot_bytes, Ledger& ledger, Category cat,
                                         IoMode mode = IoMode::automatic);
  // Whether this build and kernel can set up an io_uring ring; when not, *why says what refused it.
  static bool uring_available(std::string* why = nullptr);

  SpillFile(const SpillFile&) = delete;
  SpillFile& operator=(const SpillFile&) = delete;
  ~SpillFile();

  const char* io_name() const;  // "io_uring" or "pread/pwrite"
  size_t slot_bytes() const { return slot_bytes_; }
  const std::string& dir() const { return dir_; }

  int64_t alloc_slot();
  void free_slot(int64_t slot);  // throws on a slot that is not in use (double free, never allocated)
  int64_t slots_in_use() const;
  int64_t file_slots() const;    // slots the file has grown to (its size / slot_bytes)

  // Synchronous, full-length transfers within one slot in use: offset_in_slot + n <= slot_bytes.
  // Reading bytes that were never written past the file's end is an error.
  void write(int64_t slot, const void* src, size_t n, size_t offset_in_slot = 0);
  void read(int64_t slot, void* dst, size_t n, size_t offset_in_slot = 0);
  // Every op submitted at once; returns when all have completed. Without `errors` the first failure
  // is thrown after all ops have finished; with it, errors is resized to ops.size() and holds each op's
  // message ("" for success) and nothing is thrown, so a caller can tell which ops failed.
  // Two ops of one batch must not overlap: their order is not defined.
  void write_batch(const std::vector<IoOp>& ops, std::vector<std::string>* errors = nullptr);
  void read_batch(const std::vector<IoOp>& ops, std::vector<std::string>* errors = nullptr);

 private:
  struct Ring;
  SpillFile(std::string dir, size_t slot_bytes, Ledger& ledger, Category cat);
  void transfer(bool is_write, const std::vector<IoOp>& ops, std::vector<std::string>* errors);
  void run_posix(bool is_write, const std::vector<IoOp>& ops, std::vector<size_t>& done, std::vector<int>& err);
  void run_uring(bool is_write, const std::vector<IoOp>& ops, std::vector<size_t>& done, std::vector<int>& err);
  size_t fault_cap(size_t want);  // bytes a write may move under the ENOSPC hook; reserves them
  std::string describe(bool is_write, const IoOp& op, size_t done, int err) const;

  std::string dir_;
  size_t slot_bytes_;
  Ledger& ledger_;
  Category cat_;
  int fd_ = -1;

  mutable std::mutex mu_;       // slot bookkeeping
  std::vector<uint8_t> in_use_;  // per slot of the file
  std::vector<int64_t> free_;   // freed slots, reused from the back
  int64_t n_in_use_ = 0;

  std::mutex io_mu_;  // the ring and the counters below
  std::unique_ptr<Ring> ring_;
  int64_t fault_after_ = -1;  // OOMLESS_FAULT_SPILL_ENOSPC_AFTER, or -1
  uint64_t written_ = 0;      // bytes written (or reserved by a write in flight)
};

}  // namespace oomless
