// Arenas with a hard budget, and the ledger that every memory claim in oomless is measured with.
//
// Every byte the engine holds comes from an Arena and carries a Category. An allocation past the
// budget throws OutOfBudget naming the category, the request, what is held per category and the
// budget: it never aborts. The Ledger keeps current and peak bytes per (tier, category), the peak of
// each tier's total and of the static (weights, grads, optimizer, adapter) and dynamic (activations,
// kv, kv_grad, workspace) sums. Several arenas may share one Budget: on a CPU run Device and Host are
// the same RAM and --budget caps their sum.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "core/error.h"
#include "core/tensor.h"
#include "core/tier.h"
#include "memory/allocator.h"

namespace oomless {

enum class Category : uint8_t { weights, grads, optimizer, adapter, activations, kv, kv_grad, workspace };
inline constexpr int kCategoryCount = 8;
const char* category_name(Category c);
constexpr bool is_static(Category c) { return static_cast<int>(c) < static_cast<int>(Category::activations); }

struct OutOfBudget : Error {
  using Error::Error;
};

// "24GiB", "24GB", "512MiB", "1.5G" (binary), "1000000" (bytes). Throws naming the accepted forms.
size_t parse_size(std::string_view s);
std::string format_bytes(size_t n);  // "1.50 GiB"

class Ledger {
 public:
  void on_alloc(Tier t, Category c, size_t n);
  void on_free(Tier t, Category c, size_t n);

  size_t current(Tier t, Category c) const;
  size_t peak(Tier t, Category c) const;
  size_t current_total(Tier t) const;
  size_t peak_total(Tier t) const;   // peak of the tier's sum, not the sum of peaks
  size_t peak_static() const;        // over all tiers
  size_t peak_dynamic() const;
  size_t peak_all() const;           // peak of everything held, all tiers together
  void reset_peaks();                // peaks := current

  std::string table() const;  // human-readable, one row per category, columns per tier
  std::string json() const;   // {"device": {"weights": {"current": n, "peak": n}, ..., "total": {...}}, ...}

 private:
  struct Counter {
    size_t cur = 0, peak = 0;
    void add(size_t n) { cur += n; if (cur > peak) peak = cur; }
  };
  mutable std::mutex mu_;
  std::array<std::array<Counter, kCategoryCount>, kTierCount> by_cat_{};
  std::array<Counter, kTierCount> by_tier_{};
  Counter static_{}, dynamic_{}, all_{};
};

// A byte limit that one or more arenas draw from.
struct Budget {
  explicit Budget(size_t limit_bytes) : limit(limit_bytes) {}
  size_t limit;
  size_t used = 0;
};

class Arena;

// Move-only owner of one allocation; returns it to its arena on destruction.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { reset(); }

  void reset();
  void* data() const { return ptr_; }
  size_t size() const { return bytes_; }
  Category category() const { return cat_; }
  explicit operator bool() const { return ptr_ != nullptr; }
  template <class T> T* as() const { return static_cast<T*>(ptr_); }
  // A view of the buffer's start; throws if the shape needs more bytes than the buffer has.
  Tensor view(DType t, std::initializer_list<int64_t> shape) const;
  // The tier of the arena it came from (Host for an empty buffer): what views of its parts carry.
  Tier tier() const;

 private:
  friend class Arena;
  Arena* arena_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  Category cat_ = Category::workspace;
};

class Arena {
 public:
  // A tier arena with its own budget, recorded in `ledger`. `shared`, if given, is a second limit that
  // this arena's allocations also count against (and must outlive the arena). Its memory comes from
  // `from`, by default the tier's allocator (memory/allocator.h).
  Arena(Tier tier, size_t budget, Ledger& ledger, Budget* shared = nullptr, Allocator* from = nullptr);
  // A sub-arena over `bytes` at `base`, memory another arena holds and already counts: allocations are
  // carved from it in order (64-byte aligned) and the region is reused from its start once none is live.
  // Recorded in `ledger`, which should be a private one so that no byte is counted twice. `from` is the
  // allocator that memory came from (it clears alloc_zeroed's carvings; the tier's when null).
  Arena(void* base, size_t bytes, Tier tier, Ledger& ledger, Allocator* from = nullptr);
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena();

  // Zero-size requests return an empty Buffer. Memory is 64-byte aligned; large requests are mapped
  // pages returned to the OS on free, so the process RSS follows the ledger.
  Buffer alloc(size_t bytes, Category cat, std::string_view what = {});
  // The same, every byte zero (cleared by the allocator, where the memory is).
  Buffer alloc_zeroed(size_t bytes, Category cat, std::string_view what = {});
  Tier tier() const { return tier_; }
  size_t budget() const { return budget_; }
  size_t used() const;
  Ledger& ledger() const { return ledger_; }
  // Where its memory comes from (for a sub-arena, where its region came from).
  Allocator* allocator() const { return from_; }

 private:
  friend class Buffer;
  void release(void* p, size_t bytes, Category c);
  Buffer take(size_t bytes, Category cat, std::string_view what, bool zeroed);
  Tier tier_;
  size_t budget_;
  Ledger& ledger_;
  Budget* shared_;
  Allocator* from_ = nullptr;
  mutable std::mutex mu_;
  size_t used_ = 0;
  char* region_ = nullptr;  // sub-arena: its memory, the next free offset and the live allocations
  size_t region_next_ = 0;
  int64_t region_live_ = 0;
};

// The memory of one CPU run: a ledger and Device + Host arenas that share one budget.
struct CpuMemory {
  explicit CpuMemory(size_t budget);
  Ledger ledger;
  Budget shared;
  Arena device;
  Arena host;
};

}  // namespace oomless
