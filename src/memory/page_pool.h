// Paged KV storage: fixed-size pages drawn from an arena, and the table of where each page of a
// sequence lives.
//
// A page holds P positions of one layer's keys and values: K (Hkv, P, D) then V (Hkv, P, D), one
// contiguous 64-byte-aligned arena Buffer, which is exactly the KvBlock the attention kernels read.
// A PagePool takes pages from the arena only when it has no free one, one Buffer per page, so the
// ledger shows what is really held; a freed page is kept and handed out again (last freed, first
// reused) with no arena call, until trim() gives the free pages back. Two limits apply: the pool's
// capacity (most pages held at once) and the arena's budget; past either, alloc throws OutOfBudget.
// Page ids are dense small ints, stable while the page is allocated; its K/V pointers never move.
//
// PageTable is plain bookkeeping: (sequence, layer, logical page) -> where that page lives.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "core/dtype.h"
#include "core/kv_block.h"
#include "core/tier.h"
#include "memory/arena.h"

namespace oomless {

// The layout of one page: K and V each (Hkv, P, D) of dtype.
struct PageShape {
  int64_t Hkv = 0, P = 0, D = 0;
  DType dtype = DType::f32;
  size_t half_bytes() const { return static_cast<size_t>(dtype_bytes(dtype, Hkv * P * D)); }  // K or V
  size_t page_bytes() const { return 2 * half_bytes(); }
};

// Pages of one shape and one ledger category (kv for K/V pages, kv_grad for fp32 KV-gradient pages).
// alloc, free, k, v, block, zero and the counters may be called from several threads (the trainer and
// an offload worker); the bytes of a page belong to whoever holds its id. The arena must outlive the
// pool; destroying the pool returns every page it holds, allocated or free, to the arena.
class PagePool {
 public:
  // capacity: the most pages held at once (>= 0). what: names the pool in errors and in the arena's.
  PagePool(Arena& arena, Category cat, PageShape shape, int64_t capacity, std::string what);
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // A page id, from the free list if it has one, else a new page from the arena. Its bytes are
  // whatever they were: zero() it where that matters. Throws OutOfBudget past capacity (naming the
  // pool, capacity, pages in use and page bytes) or when the arena refuses (the arena's error).
  int64_t alloc();
  // Puts an allocated page on the free list. Throws Error for an id that is not allocated.
  void free(int64_t id);
  // Makes sure at least n pages are held (allocated from the arena now, onto the free list), so that
  // a run that cannot fit fails at setup. Throws OutOfBudget when n > capacity or the arena refuses;
  // a failed reserve leaves the pool as it was.
  void reserve(int64_t n);
  // Returns every free page to the arena; returns how many. Allocated pages are untouched.
  int64_t trim();

  // K (Hkv, P, D) and V (Hkv, P, D) of an allocated page; throw Error for any other id.
  void* k(int64_t id) const;
  void* v(int64_t id) const;
  // The page as an attention block holding absolute positions start .. start+len-1, 0 <= len <= P.
  KvBlock block(int64_t id, int32_t start, int32_t len) const;
  // Sets both halves of an allocated page to zero bytes (KV-gradient pages start at zero).
  void zero(int64_t id);

  int64_t capacity() const { return capacity_; }
  int64_t in_use() const;
  int64_t held() const;         // taken from the arena: in use + free list
  int64_t peak_in_use() const;
  const PageShape& shape() const { return shape_; }
  Category category() const { return cat_; }
  const std::string& what() const { return what_; }

 private:
  enum class State : uint8_t { vacant, free, in_use };  // vacant: id known, no page (after trim)
  char* page_locked(int64_t id, const char* op) const;  // mu_ held; checks the id is in use
  int64_t place_locked(Buffer b);  // mu_ held; gives a new page a vacant or new id (state left as is)

  Arena& arena_;
  const Category cat_;
  const PageShape shape_;
  const int64_t capacity_;
  const std::string what_;

  mutable std::mutex mu_;
  std::vector<Buffer> pages_;   // by id; empty where vacant
  std::vector<State> state_;    // by id
  std::vector<int64_t> free_;   // ids on the free list, last freed at the back
  std::vector<int64_t> vacant_; // ids with no page, reused before new ids
  int64_t in_use_ = 0, held_ = 0, peak_in_use_ = 0;
};

// Where one logical page of a sequence lives. tier Device or Host: slot is a page id in that tier's
// PagePool; Disk: slot is a slot index in the spill file. start is the absolute position of the page's
// slot 0 (logical page * P); len is how many positions are filled (a page being filled grows len).
struct PageRef {
  Tier tier = Tier::Device;
  int64_t slot = 0;
  int32_t start = 0;
  int32_t len = 0;
  float k_scale = 1.0f, v_scale = 1.0f;  // f8_e4m3 pages: what a code's value is multiplied by (KvBlock's)
};

// (sequence id, layer, logical page) -> PageRef, ordered by that key. Not thread-safe: the owner
// guards it. The table owns no storage: whoever erases or drops an entry frees its page.
class PageTable {
 public:
  // Inserts or replaces. Throws Error for layer < 0, lpage < 0, slot < 0, start < 0 or len < 0.
  void set(int64_t seq, int32_t layer, int64_t lpage, PageRef ref);
  const PageRef* find(int64_t seq, int32_t layer, int64_t lpage) const;  // nullptr if absent
  PageRef& at(int64_t seq, int32_t layer, int64_t lpage);                 // throws Error naming the key if absent
  bool erase(int64_t seq, int32_t layer, int64_t lpage);                  // false if absent
  std::vector<int64_t> pages(int64_t seq, int32_t layer) const;           // logical pages present, ascending
  int64_t count() const { return static_cast<int64_t>(map_.size()); }
  // Removes every entry of seq and returns them ordered by (layer, logical page), for the caller to
  // free their storage.
  std::vector<PageRef> drop_sequence(int64_t seq);

 private:
  using Key = std::tuple<int64_t, int32_t, int64_t>;
  std::map<Key, PageRef> map_;
};

}  // namespace oomless
