#include "memory/spill_file.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>

// Builds without liburing (CMake defines OOMLESS_WITH_URING=0 when pkg-config finds none) use
// pread/pwrite only.
#ifndef OOMLESS_WITH_URING
#if __has_include(<liburing.h>)
#define OOMLESS_WITH_URING 1
#else
#define OOMLESS_WITH_URING 0
#endif
#endif
#if OOMLESS_WITH_URING
#include <liburing.h>
#endif

namespace oomless {

namespace {

constexpr unsigned kRingEntries = 64;
// One read/write moves at most this much; io_uring reports a result as an int, and Linux caps a
// single transfer just below 2 GiB anyway.
constexpr size_t kMaxChunk = size_t(1) << 30;
constexpr int kEof = -1;  // in the per-op error codes: a read reached the end of the file

std::string errno_text(int err) {
  const char* name = err == ENOSPC ? " (ENOSPC)" : err == EDQUOT ? " (EDQUOT)" : err == EIO ? " (EIO)"
                   : err == EACCES ? " (EACCES)" : err == EPERM ? " (EPERM)" : err == EROFS ? " (EROFS)" : "";
  return std::string(std::strerror(err)) + name;
}

const char* kChoose = "choose another folder with --spill-dir";

// OOMLESS_FAULT_SPILL_ENOSPC_AFTER as a byte count, or -1 when unset.
int64_t fault_after_env() {
  const char* v = std::getenv("OOMLESS_FAULT_SPILL_ENOSPC_AFTER");
  if (!v) return -1;
  int64_t n = -1;
  auto [p, ec] = std::from_chars(v, v + std::strlen(v), n);
  OOM_CHECK(ec == std::errc() && *p == '\0' && n >= 0, "[spill] OOMLESS_FAULT_SPILL_ENOSPC_AFTER='", v,
            "' is not a byte count (a whole number >= 0)");
  return n;
}

IoMode mode_from_env(IoMode mode) {
  if (mode != IoMode::automatic) return mode;
  const char* v = std::getenv("OOMLESS_SPILL_IO");
  if (!v || !*v) return mode;
  std::string s(v);
  if (s == "posix") return IoMode::posix;
  if (s == "uring" || s == "io_uring") return IoMode::uring;
  if (s == "auto" || s == "automatic") return IoMode::automatic;
  fail("[spill] OOMLESS_SPILL_IO='", s, "' is not an io mode: use posix, uring or auto");
}

std::string uring_why(int err) {
  std::string why = std::string("io_uring_queue_init failed: ") + errno_text(err);
  std::ifstream f("/proc/sys/kernel/io_uring_disabled");
  int disabled = 0;
  if (f >> disabled && disabled != 0)
    why += "; the kernel has io_uring turned off (kernel.io_uring_disabled = " + std::to_string(disabled) + ")";
  else if (err == EPERM || err == ENOSYS)
    why += "; a seccomp filter (containers often have one) or the kernel refuses io_uring";
  return why;
}

}  // namespace

struct SpillFile::Ring {
#if OOMLESS_WITH_URING
  io_uring ring{};
#endif
  // A submit failed: the ring is abandoned and pread/pwrite used from then on. Atomic because
  // io_name() reads it without the io lock.
  std::atomic<bool> broken{false};
};

bool SpillFile::uring_available(std::string* why) {
#if OOMLESS_WITH_URING
  io_uring ring{};
  int r = io_uring_queue_init(kRingEntries, &ring, 0);
  if (r < 0) {
    if (why) *why = uring_why(-r);
    return false;
  }
  io_uring_queue_exit(&ring);
  return true;
#else
  if (why) *why = "this build has no liburing (install liburing-dev and rebuild)";
  return false;
#endif
}

SpillFile::SpillFile(std::string dir, size_t slot_bytes, Ledger& ledger, Category cat)
    : dir_(std::move(dir)), slot_bytes_(slot_bytes), ledger_(ledger), cat_(cat) {}

SpillFile::~SpillFile() {
  if (n_in_use_) ledger_.on_free(Tier::Disk, cat_, size_t(n_in_use_) * slot_bytes_);
#if OOMLESS_WITH_URING
  if (ring_) io_uring_queue_exit(&ring_->ring);
#endif
  if (fd_ >= 0) ::close(fd_);
}

std::unique_ptr<SpillFile> SpillFile::open(const std::string& dir, size_t slot_bytes, Ledger& ledger, Category cat,
                                           IoMode mode) {
  OOM_CHECK(slot_bytes > 0, "[spill] a spill file needs slots of at least one byte");
  OOM_CHECK(!dir.empty(), "[spill] no spill folder given: choose a disk-backed folder with --spill-dir");
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    int err = errno;
    if (err == ENOENT)
      fail("[spill] the spill folder ", dir, " does not exist: create it or ", kChoose);
    fail("[spill] cannot use the spill folder ", dir, ": ", errno_text(err), "; ", kChoose);
  }
  OOM_CHECK(S_ISDIR(st.st_mode), "[spill] the spill folder ", dir, " is not a folder: ", kChoose);
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    fail("[spill] the spill folder ", dir, " is not writable (", errno_text(errno), "): make it writable or ", kChoose);
  struct statfs fs {};
  if (::statfs(dir.c_str(), &fs) == 0 && (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC))
    fail("[spill] the spill folder ", dir, " is on ", fs.f_type == TMPFS_MAGIC ? "tmpfs" : "ramfs",
         ", which lives in RAM: spilling to RAM saves no memory; choose a disk-backed folder with --spill-dir");

  std::unique_ptr<SpillFile> f(new SpillFile(dir, slot_bytes, ledger, cat));
  f->fd_ = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (f->fd_ < 0) {
    int err = errno;
    if (err != EOPNOTSUPP && err != EISDIR && err != EINVAL)
      fail("[spill] cannot create the spill file in ", dir, ": ", errno_text(err), "; ", kChoose);
    // The filesystem has no O_TMPFILE: a named file, unlinked at once, is just as anonymous.
    std::string tmpl = dir + (dir.back() == '/' ? "" : "/") + "oomless-spill-XXXXXX";
    f->fd_ = ::mkostemp(tmpl.data(), O_CLOEXEC);
    if (f->fd_ < 0) fail("[spill] cannot create the spill file in ", dir, ": ", errno_text(errno), "; ", kChoose);
    ::unlink(tmpl.c_str());
  }
  f->fault_after_ = fault_after_env();

  mode = mode_from_env(mode);
  if (mode != IoMode::posix) {
#if OOMLESS_WITH_URING
    auto ring = std::make_unique<Ring>();
    int r = io_uring_queue_init(kRingEntries, &ring->ring, 0);
    if (r == 0)
      f->ring_ = std::move(ring);
    else if (mode == IoMode::uring)
      fail("[spill] io_uring was asked for (IoMode::uring or OOMLESS_SPILL_IO=uring) but is unavailable: ",
           uring_why(-r), "; use OOMLESS_SPILL_IO=posix");
#else
    OOM_CHECK(mode != IoMode::uring, "[spill] io_uring was asked for but this build has no liburing: install ",
              "liburing-dev and rebuild, or use OOMLESS_SPILL_IO=posix");
#endif
  }
  return f;
}

const char* SpillFile::io_name() const { return ring_ && !ring_->broken ? "io_uring" : "pread/pwrite"; }

int64_t SpillFile::alloc_slot() {
  int64_t slot;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
    } else {
      slot = int64_t(in_use_.size());
      OOM_CHECK(size_t(slot) + 1 <= size_t(std::numeric_limits<off_t>::max()) / slot_bytes_,
                "[spill] the spill file in ", dir_, " cannot grow past ", slot, " slots of ", slot_bytes_, " bytes");
      in_use_.push_back(0);
    }
    in_use_[size_t(slot)] = 1;
    ++n_in_use_;
  }
  ledger_.on_alloc(Tier::Disk, cat_, slot_bytes_);
  return slot;
}

void SpillFile::free_slot(int64_t slot) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    OOM_CHECK(slot >= 0 && size_t(slot) < in_use_.size() && in_use_[size_t(slot)], "[spill] free_slot(", slot,
              "): the slot is not in use (freed twice, or never allocated)");
    in_use_[size_t(slot)] = 0;
    free_.push_back(slot);
    --n_in_use_;
  }
  ledger_.on_free(Tier::Disk, cat_, slot_bytes_);
}

int64_t SpillFile::slots_in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return n_in_use_;
}

int64_t SpillFile::file_slots() const {
  std::lock_guard<std::mutex> lock(mu_);
  return int64_t(in_use_.size());
}

void SpillFile::write(int64_t slot, const void* src, size_t n, size_t offset_in_slot) {
  transfer(true, {IoOp{slot, const_cast<void*>(src), n, offset_in_slot}}, nullptr);
}

void SpillFile::read(int64_t slot, void* dst, size_t n, size_t offset_in_slot) {
  transfer(false, {IoOp{slot, dst, n, offset_in_slot}}, nullptr);
}

void SpillFile::write_batch(const std::vector<IoOp>& ops, std::vector<std::string>* errors) {
  transfer(true, ops, errors);
}

void SpillFile::read_batch(const std::vector<IoOp>& ops, std::vector<std::string>* errors) {
  transfer(false, ops, errors);
}

void SpillFile::transfer(bool is_write, const std::vector<IoOp>& ops, std::vector<std::string>* errors) {
  std::vector<std::string> msgs(ops.size());
  std::vector<size_t> done(ops.size(), 0);
  std::vector<int> err(ops.size(), 0);
  {
    // Caller bugs are reported per op, like I/O errors, so that one bad op does not sink a batch.
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < ops.size(); ++i) {
      const IoOp& op = ops[i];
      const char* verb = is_write ? "write" : "read";
      if (op.slot < 0 || size_t(op.slot) >= in_use_.size() || !in_use_[size_t(op.slot)])
        msgs[i] = "[spill] " + std::string(verb) + " of slot " + std::to_string(op.slot) +
                  ": the slot is not in use (allocate it with alloc_slot first)";
      else if (op.n > slot_bytes_ || op.offset > slot_bytes_ - op.n)
        msgs[i] = "[spill] " + std::string(verb) + " of " + std::to_string(op.n) + " bytes at offset " +
                  std::to_string(op.offset) + " of slot " + std::to_string(op.slot) + " runs past the slot's " +
                  std::to_string(slot_bytes_) + " bytes";
      else if (!op.data && op.n)
        msgs[i] = "[spill] " + std::string(verb) + " of slot " + std::to_string(op.slot) + " has no buffer";
      if (!msgs[i].empty()) err[i] = EINVAL;
    }
  }
  {
    std::lock_guard<std::mutex> lock(io_mu_);
    if (ring_ && !ring_->broken) run_uring(is_write, ops, done, err);
    if (!ring_ || ring_->broken) run_posix(is_write, ops, done, err);
    for (size_t i = 0; i < ops.size(); ++i)
      if (msgs[i].empty() && (err[i] || done[i] < ops[i].n)) msgs[i] = describe(is_write, ops[i], done[i], err[i]);
  }
  if (errors) {
    *errors = std::move(msgs);
    return;
  }
  for (const std::string& m : msgs)
    if (!m.empty()) throw Error(m);
}

size_t SpillFile::fault_cap(size_t want) {
  size_t allowed = want;
  if (fault_after_ >= 0)
    allowed = size_t(std::min<uint64_t>(want, uint64_t(fault_after_) - std::min<uint64_t>(written_, fault_after_)));
  written_ += allowed;
  return allowed;
}

// Continues each op from done[i]; ops with an error code already set are skipped.
void SpillFile::run_posix(bool is_write, const std::vector<IoOp>& ops, std::vector<size_t>& done,
                          std::vector<int>& err) {
  for (size_t i = 0; i < ops.size(); ++i) {
    const IoOp& op = ops[i];
    const off_t base = off_t(size_t(op.slot) * slot_bytes_ + op.offset);
    while (!err[i] && done[i] < op.n) {
      size_t chunk = std::min(op.n - done[i], kMaxChunk);
      if (is_write && (chunk = fault_cap(chunk)) == 0) {
        err[i] = ENOSPC;  // the test hook's full disk
        break;
      }
      char* p = static_cast<char*>(op.data) + done[i];
      ssize_t r = is_write ? ::pwrite(fd_, p, chunk, base + off_t(done[i])) : ::pread(fd_, p, chunk, base + off_t(done[i]));
      int e = errno;
      if (is_write && size_t(std::max<ssize_t>(r, 0)) < chunk) written_ -= chunk - size_t(std::max<ssize_t>(r, 0));
      if (r < 0 && e == EINTR) continue;
      if (r < 0)
        err[i] = e;
      else if (r == 0)
        err[i] = is_write ? ENOSPC : kEof;  // a file write of 0 bytes can only mean a full disk
      else
        done[i] += size_t(r);
    }
  }
}

// Rounds of at most kRingEntries ops, one request per unfinished op, submitted together; each round
// waits for all of its completions, so the ring is empty between rounds and between calls. Short
// transfers and EINTR/EAGAIN continue in the next round.
void SpillFile::run_uring(bool is_write, const std::vector<IoOp>& ops, std::vector<size_t>& done,
                          std::vector<int>& err) {
#if OOMLESS_WITH_URING
  io_uring& ring = ring_->ring;
  std::vector<size_t> chunk(ops.size(), 0);
  std::vector<size_t> order;  // ops in the order their requests were queued
  for (;;) {
    unsigned queued = 0;
    order.clear();
    for (size_t i = 0; i < ops.size() && queued < kRingEntries; ++i) {
      const IoOp& op = ops[i];
      if (err[i] || done[i] >= op.n) continue;
      size_t c = std::min(op.n - done[i], kMaxChunk);
      if (is_write && (c = fault_cap(c)) == 0) {
        err[i] = ENOSPC;
        continue;
      }
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);  // never null: the ring holds kRingEntries
      char* p = static_cast<char*>(op.data) + done[i];
      const uint64_t pos = size_t(op.slot) * slot_bytes_ + op.offset + done[i];
      if (is_write)
        io_uring_prep_write(sqe, fd_, p, unsigned(c), pos);
      else
        io_uring_prep_read(sqe, fd_, p, unsigned(c), pos);
      io_uring_sqe_set_data64(sqe, i);
      chunk[i] = c;
      order.push_back(i);
      ++queued;
    }
    if (!queued) return;
    unsigned submitted = 0;
    while (submitted < queued) {
      int r = io_uring_submit(&ring);
      if (r == -EINTR || r == -EAGAIN || r == -EBUSY) continue;
      if (r <= 0) {
        // The ring cannot take requests: finish what is in flight below, then leave the rest (and
        // every later call) to pread/pwrite.
        ring_->broken = true;
        break;
      }
      submitted += unsigned(r);
    }
    for (unsigned k = 0; k < submitted;) {
      io_uring_cqe* cqe = nullptr;
      int r = io_uring_wait_cqe(&ring, &cqe);
      if (r == -EINTR || r == -EAGAIN) continue;
      // Requests in flight may still write into the caller's buffers: there is no safe way on.
      if (r < 0) fail("[spill] ", dir_, ": waiting for io_uring completions failed: ", errno_text(-r));
      const size_t i = size_t(io_uring_cqe_get_data64(cqe));
      const int res = cqe->res;
      io_uring_cqe_seen(&ring, cqe);
      ++k;
      const size_t got = res > 0 ? size_t(res) : 0;
      if (is_write && got < chunk[i]) written_ -= chunk[i] - got;  // return the unused reservation
      if (res == -EINTR || res == -EAGAIN) continue;
      if (res < 0)
        err[i] = -res;
      else if (res == 0)
        err[i] = is_write ? ENOSPC : kEof;
      else
        done[i] += got;
    }
    if (ring_->broken) {
      // Requests queued but never submitted (the kernel takes them in order): their reservations go
      // back and run_posix does them.
      if (is_write)
        for (size_t k = submitted; k < order.size(); ++k) written_ -= chunk[order[k]];
      return;
    }
  }
#endif
}

std::string SpillFile::describe(bool is_write, const IoOp& op, size_t done, int err) const {
  std::string what = std::string(is_write ? "writing " : "reading ") + std::to_string(op.n) + " bytes at offset " +
                     std::to_string(op.offset) + " of slot " + std::to_string(op.slot);
  if (err == ENOSPC || err == EDQUOT)
    return "[spill] the disk holding the spill file in " + dir_ + " is full: " +
           (err == ENOSPC ? "no space left on device (ENOSPC)" : "disk quota exceeded (EDQUOT)") + " while " + what +
           " (" + std::to_string(written_) + " bytes spilled so far); free space on that disk or choose a folder on " +
           "a larger disk with --spill-dir";
  if (err == kEof || err == 0)
    return "[spill] " + dir_ + ": " + what + " reached the end of the spill file after " + std::to_string(done) +
           " bytes: that part of the slot was never written (write a slot before reading it back)";
  return "[spill] " + dir_ + ": " + what + " of the spill file failed: " + errno_text(err) +
         "; check the disk (dmesg), free space, or " + kChoose;
}

}  // namespace oomless
