#include "memory/allocator.h"

#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>

#include "core/error.h"

namespace oomless {

namespace {

// Requests at least this large are whole mapped pages, unmapped on free, so RSS tracks the ledger
// (malloc would keep freed chunks in its heap).
constexpr size_t kMapThreshold = 256 * 1024;
constexpr size_t kAlign = 64;

class HeapAllocator final : public Allocator {
 public:
  const char* name() const override { return "heap"; }
  void* allocate(size_t bytes) override {
    if (bytes >= kMapThreshold) {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      return p == MAP_FAILED ? nullptr : p;
    }
    return std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  }
  void* allocate_zeroed(size_t bytes) override {
    if (bytes >= kMapThreshold) {
      // Mapped pages are zero already. Populated now: left to first touch, a page read before it is written
      // (optimizer moments, accumulated gradients) maps the shared zero page, and the write that follows
      // copies it and flushes the other threads' TLBs by interrupt, which in a virtual machine cost
      // SmolLM2's first AdamW step about 3 s.
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
      return p == MAP_FAILED ? nullptr : p;
    }
    void* p = allocate(bytes);
    if (p) std::memset(p, 0, bytes);
    return p;
  }
  void zero(void* p, size_t bytes) override { std::memset(p, 0, bytes); }
  void deallocate(void* p, size_t bytes) override {
    if (bytes >= kMapThreshold)
      munmap(p, bytes);
    else
      std::free(p);
  }
};

// The guarded range: reserved once (address space only, nothing committed), handed out first-fit in whole
// pages; [base, base + high) covers what has ever been handed out (in whole 2 MiB pages), PROT_NONE unless a
// DeviceAccess is open.
constexpr size_t kReserve = size_t{1} << 40;  // 1 TiB of addresses
constexpr size_t kPage = 4096;
constexpr size_t kHuge = size_t{2} << 20;

char* g_base = nullptr;  // set once, read by the fault handler
struct sigaction g_previous {};

void write_str(const char* s) {
  ssize_t r = write(STDERR_FILENO, s, std::strlen(s));
  (void)r;
}

void on_fault(int sig, siginfo_t* info, void* ctx) {
  const char* a = static_cast<const char*>(info->si_addr);
  if (g_base && a >= g_base && a < g_base + kReserve) {
    char msg[256];
    std::snprintf(msg, sizeof msg,
                  "[strict-device] host code touched Device memory at %p outside the backend: read and write "
                  "tensors through Ops (upload, download, copy, a kernel), not their data pointers. Backtrace:\n",
                  info->si_addr);
    write_str(msg);
    void* frames[64];
    const int n = backtrace(frames, 64);
    backtrace_symbols_fd(frames, n, STDERR_FILENO);
    signal(SIGSEGV, SIG_DFL);  // the access runs again and the process dies of it
    return;
  }
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction) return g_previous.sa_sigaction(sig, info, ctx);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN && g_previous.sa_handler) {
    return g_previous.sa_handler(sig);
  }
  signal(SIGSEGV, SIG_DFL);
}

class GuardedAllocator final : public Allocator {
 public:
  const char* name() const override { return "guarded"; }

  void* allocate(size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    reserve();
    const size_t need = (bytes + kPage - 1) / kPage * kPage;
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < need) continue;
      const size_t off = it->first, len = it->second;
      free_.erase(it);
      if (len > need) free_[off + need] = len - need;
      if (off + need > high_) {  // the open (or closed) part grows in whole huge pages
        const size_t high = (off + need + kHuge - 1) / kHuge * kHuge;
        if (open_ > 0) protect(high_, high - high_, PROT_READ | PROT_WRITE);
        high_ = high;
      }
      return g_base + off;
    }
    return nullptr;
  }
  void* allocate_zeroed(size_t bytes) override {
    void* p = allocate(bytes);
    if (p) zero(p, bytes);  // a freed range keeps the huge pages it shares with others, and their bytes
    return p;
  }
  void zero(void* p, size_t bytes) override;

  void deallocate(void* p, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t off = static_cast<size_t>(static_cast<char*>(p) - g_base);
    size_t len = (bytes + kPage - 1) / kPage * kPage;
    // The whole huge pages inside go back to the system (the ledger's RSS); splitting the edges would leave
    // small pages, which make each open and close walk 512 times the entries.
    const size_t lo = (off + kHuge - 1) / kHuge * kHuge, hi = (off + len) / kHuge * kHuge;
    if (hi > lo) madvise(g_base + lo, hi - lo, MADV_DONTNEED);
    size_t start = off;
    auto next = free_.lower_bound(off);
    if (next != free_.end() && off + len == next->first) {
      len += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == start) {
        start = prev->first;
        len += prev->second;
        free_.erase(prev);
      }
    }
    free_[start] = len;
  }

  void open() {
    std::lock_guard<std::mutex> lock(mu_);
    if (open_++ == 0 && high_ > 0) protect(0, high_, PROT_READ | PROT_WRITE);
  }
  void close() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--open_ == 0 && high_ > 0) protect(0, high_, PROT_NONE);
  }

 private:
  void reserve() {
    if (g_base) return;
    void* p = mmap(nullptr, kReserve + kHuge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    OOM_CHECK(p != MAP_FAILED, "[strict-device] could not reserve ", kReserve >> 30,
              " GiB of address space for guarded Device memory: ", std::strerror(errno));
    // On huge pages where the system allows: opening and closing then changes one entry per 2 MiB.
    p = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(p) + kHuge - 1) / kHuge * kHuge);
    madvise(p, kReserve, MADV_HUGEPAGE);
    void* frames[4];
    backtrace(frames, 4);  // loads the unwinder now, not in the fault handler
    struct sigaction sa {};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_previous);
    g_base = static_cast<char*>(p);
    free_[0] = kReserve;
  }
  void protect(size_t off, size_t len, int prot) {
    OOM_CHECK(mprotect(g_base + off, len, prot) == 0, "[strict-device] mprotect of guarded Device memory failed: ",
              std::strerror(errno));
  }

  std::mutex mu_;
  std::map<size_t, size_t> free_;  // offset -> length, coalesced
  size_t high_ = 0;
  int64_t open_ = 0;
};

GuardedAllocator& guarded() {
  static GuardedAllocator a;
  return a;
}

std::atomic<int> g_strict{-1};  // -1: not decided yet

}  // namespace

Allocator& heap_allocator() {
  static HeapAllocator a;
  return a;
}

Allocator& guarded_allocator() { return guarded(); }

bool strict_device() {
  int s = g_strict.load();
  if (s < 0) {
    const char* e = std::getenv("OOMLESS_STRICT_DEVICE");
    s = e && std::strcmp(e, "0") != 0 && *e ? 1 : 0;
    g_strict.store(s);
  }
  return s == 1;
}

void set_strict_device(bool on) { g_strict.store(on ? 1 : 0); }

Allocator& tier_allocator(Tier t) {
  if (t == Tier::Device && strict_device()) return guarded_allocator();
  return heap_allocator();
}

void GuardedAllocator::zero(void* p, size_t bytes) {
  DeviceAccess open;
  std::memset(p, 0, bytes);
}

DeviceAccess::DeviceAccess() { guarded().open(); }
DeviceAccess::~DeviceAccess() { guarded().close(); }

bool in_guarded_range(const void* p) {
  const char* a = static_cast<const char*>(p);
  return g_base && a >= g_base && a < g_base + kReserve;
}

}  // namespace oomless
