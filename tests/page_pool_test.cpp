// PagePool and PageTable: page sizes, lazy allocation and reuse as the ledger sees them, both limits
// (capacity and arena budget), id and pointer stability, page contents that never overlap, a two-thread
// alloc/free stress, and the page table's lookups, order and sequence drops.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "memory/allocator.h"
#include "memory/page_pool.h"

namespace oomless {
namespace {

constexpr size_t kBig = size_t(1) << 30;

// The message of the Error (or subclass E) that f throws; fails the test if it throws nothing.
template <class E = Error, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error thrown";
  return "";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ---- PagePool ----

TEST(PagePool, ShapeBytesForF32AndBf16) {
  PageShape f32{2, 16, 64, DType::f32};
  EXPECT_EQ(f32.half_bytes(), size_t(2 * 16 * 64 * 4));
  EXPECT_EQ(f32.page_bytes(), size_t(2 * 2 * 16 * 64 * 4));
  PageShape bf16{3, 7, 33, DType::bf16};
  EXPECT_EQ(bf16.half_bytes(), size_t(3 * 7 * 33 * 2));
  EXPECT_EQ(bf16.page_bytes(), size_t(2 * 3 * 7 * 33 * 2));

  Ledger ledger;
  Arena dev(Tier::Device, kBig, ledger);
  PagePool pool(dev, Category::kv, bf16, 4, "kv.dev");
  EXPECT_EQ(pool.shape().Hkv, 3);
  EXPECT_EQ(pool.shape().P, 7);
  EXPECT_EQ(pool.shape().D, 33);
  EXPECT_EQ(pool.shape().dtype, DType::bf16);
  EXPECT_EQ(pool.category(), Category::kv);
  EXPECT_EQ(pool.capacity(), 4);
  EXPECT_EQ(pool.what(), "kv.dev");
  EXPECT_THROW(PagePool(dev, Category::kv, PageShape{0, 7, 33, DType::bf16}, 4, "bad"), Error);
  EXPECT_THROW(PagePool(dev, Category::kv, bf16, -1, "bad"), Error);
}

TEST(PagePool, AllocatesLazilyAndTheLedgerShowsIt) {
  Ledger ledger;
  Arena dev(Tier::Device, kBig, ledger);
  PageShape shape{2, 16, 8, DType::f32};
  const size_t pb = shape.page_bytes();
  PagePool pool(dev, Category::kv, shape, 8, "kv");
  EXPECT_EQ(pool.held(), 0);
  EXPECT_EQ(ledger.current(Tier::Device, Category::kv), 0u);

  int64_t a = pool.alloc();
  EXPECT_EQ(pool.in_use(), 1);
  EXPECT_EQ(pool.held(), 1);
  EXPECT_EQ(ledger.current(Tier::Device, Category::kv), pb);
  int64_t b = pool.alloc();
  EXPECT_NE(a, b);
  EXPECT_EQ(ledger.current(Tier::Device, Category::kv), 2 * pb);
  EXPECT_EQ(ledger.peak(Tier::Device, Category::kv), 2 * pb);
  EXPECT_EQ(ledger.current(Tier::Device, Category::kv_grad), 0u);
  EXPECT_EQ(dev.used(), 2 * pb);
  EXPECT_EQ(pool.peak_in_use(), 2);
}

TEST(PagePool, FreedPagesAreReusedLastFirstWithoutNewArenaAllocations) {
  Ledger ledger;
  Arena dev(Tier::Device, kBig, ledger);
  PageShape shape{1, 8, 4, DType::bf16};
  const size_t pb = shape.page_bytes();
  PagePool pool(dev, Category::kv, shape, 8, "kv");
  int64_t a = pool.alloc(), b = pool.alloc(), c = pool.alloc();
  EXPECT_EQ(a, 0);
  EXPECT_EQ(b, 1);
  EXPECT_EQ(c, 2);
  void* kb = pool.k(b);
  pool.free(b);
  pool.free(c);
  EXPECT_EQ(pool.in_use(), 1);
  EXPECT_EQ(pool.held(), 3);
  EXPECT_EQ(ledger.current(Tier::Device, Category::kv), 3 * pb);  // freed pages stay held

  EXPECT_EQ(pool.alloc(), c);  // last freed first
  EXPECT_EQ(pool.alloc(), b);
  EXPECT_EQ(pool.k(b), kb);    // the same memory, not a new allocation
  EXPECT_EQ(pool.held(), 3);
  EXPECT_EQ(pool.in_use(), 3);
  EXPECT_EQ(ledger.current(Tier::Device, Category::kv), 3 * pb);
  EXPECT_EQ(ledger.peak(Tier::Device, Category::kv), 3 * pb);
  EXPECT_EQ(pool.peak_in_use(), 3);

  int64_t d = pool.alloc();  // free list empty: a new page
  EXPECT_EQ(d, 3);
  EXPECT_EQ(pool.held(), 4);
  EXPECT_EQ(ledger.current(Tier::Device, Category::kv), 4 * pb);
}

TEST(PagePool, TrimReturnsFreePagesToTheArena) {
  Ledger ledger;
  Arena host(Tier::Host, kBig, ledger);
  PageShape shape{2, 32, 16, DType::f32};
  const size_t pb = shape.page_bytes();
  PagePool pool(host, Category::kv_grad, shape, 16, "dkv");
  std::vector<int64_t> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(pool.alloc());
  EXPECT_EQ(ledger.current(Tier::Host, Category::kv_grad), 5 * pb);
  EXPECT_EQ(ledger.current(Tier::Host, Category::kv), 0u);
  pool.free(ids[1]);
  pool.free(ids[3]);
  pool.free(ids[4]);
  EXPECT_EQ(ledger.current(Tier::Host, Category::kv_grad), 5 * pb);

  EXPECT_EQ(pool.trim(), 3);
  EXPECT_EQ(pool.held(), 2);
  EXPECT_EQ(pool.in_use(), 2);
  EXPECT_EQ(ledger.current(Tier::Host, Category::kv_grad), 2 * pb);
  EXPECT_EQ(ledger.peak(Tier::Host, Category::kv_grad), 5 * pb);
  EXPECT_EQ(host.used(), 2 * pb);
  EXPECT_EQ(pool.trim(), 0);

  // Pages still allocated are untouched; a new alloc takes a page from the arena again, reusing an id.
  pool.zero(ids[0]);
  pool.zero(ids[2]);
  int64_t n = pool.alloc();
  EXPECT_TRUE(n == ids[1] || n == ids[3] || n == ids[4]) << n;
  EXPECT_EQ(pool.held(), 3);
  EXPECT_EQ(ledger.current(Tier::Host, Category::kv_grad), 3 * pb);

  pool.free(ids[0]);
  pool.free(ids[2]);
  pool.free(n);
  EXPECT_EQ(pool.trim(), 3);
  EXPECT_EQ(ledger.current(Tier::Host, Category::kv_grad), 0u);
  EXPECT_EQ(host.used(), 0u);
}

TEST(PagePool, DestroyingThePoolReturnsEverything) {
  Ledger ledger;
  Arena dev(Tier::Device, kBig, ledger);
  {
    PagePool pool(dev, Category::kv, PageShape{1, 4, 4, DType::f32}, 4, "kv");
    pool.alloc();
    pool.free(pool.alloc());
    EXPECT_EQ(ledger.current(Tier::Device, Category::kv), 2 * pool.shape().page_bytes());
  }
  EXPECT_EQ(ledger.current(Tier::Device, Category::kv), 0u);
  EXPECT_EQ(dev.used(), 0u);
}

TEST(PagePool, PastCapacityIsOutOfBudgetNamingThePool) {
  Ledger ledger;
  Arena dev(Tier::Device, kBig, ledger);
  PageShape shape{2, 16, 64, DType::bf16};  // 8 KiB a page
  PagePool pool(dev, Category::kv, shape, 3, "layer kv pages");
  int64_t a = pool.alloc();
  pool.alloc();
  pool.alloc();
  std::string m = error_of<OutOfBudget>([&] { pool.alloc(); });
  EXPECT_EQ(m.rfind("[page_pool]", 0), 0u) << m;
  EXPECT_TRUE(has(m, "layer kv pages")) << m;
  EXPECT_TRUE(has(m, "capacity 3")) << m;
  EXPECT_TRUE(has(m, "in use 3")) << m;
  EXPECT_TRUE(has(m, "8.00 KiB")) << m;
  // Nothing changed, and a freed page makes room again.
  EXPECT_EQ(pool.in_use(), 3);
  EXPECT_EQ(pool.held(), 3);
  EXPECT_EQ(ledger.current(Tier::Device, Category::kv), 3 * shape.page_bytes());
  pool.free(a);
  EXPECT_EQ(pool.alloc(), a);
  EXPECT_THROW(pool.alloc(), OutOfBudget);

  PagePool none(dev, Category::kv, shape, 0, "empty");
  EXPECT_THROW(none.alloc(), OutOfBudget);
}

TEST(PagePool, ArenaBudgetIsTheSecondLimit) {
  PageShape shape{2, 16, 64, DType::f32};
  const size_t pb = shape.page_bytes();
  {
    Ledger ledger;
    Arena tiny(Tier::Device, pb - 1, ledger);
    PagePool pool(tiny, Category::kv, shape, 100, "kv.tiny");
    std::string m = error_of<OutOfBudget>([&] { pool.alloc(); });
    EXPECT_EQ(m.rfind("[arena]", 0), 0u) << m;
    EXPECT_TRUE(has(m, "kv.tiny")) << m;  // the arena names the pool
    EXPECT_EQ(pool.in_use(), 0);
    EXPECT_EQ(pool.held(), 0);
    EXPECT_EQ(ledger.current(Tier::Device, Category::kv), 0u);
  }
  {
    Ledger ledger;
    Arena small(Tier::Device, 2 * pb + pb / 2, ledger);
    PagePool pool(small, Category::kv, shape, 100, "kv.small");
    int64_t a = pool.alloc();
    pool.alloc();
    EXPECT_THROW(pool.alloc(), OutOfBudget);
    EXPECT_EQ(pool.in_use(), 2);
    EXPECT_EQ(pool.held(), 2);
    pool.free(a);
    EXPECT_EQ(pool.alloc(), a);  // reuse needs no budget
  }
}

TEST(PagePool, BadIdsAndDoubleFreesAreErrors) {
  Ledger ledger;
  Arena dev(Tier::Device, kBig, ledger);
  PagePool pool(dev, Category::kv, PageShape{1, 4, 4, DType::f32}, 4, "kv.check");
  int64_t a = pool.alloc();
  int64_t b = pool.alloc();
  pool.free(a);
  std::string m = error_of([&] { pool.free(a); });
  EXPECT_EQ(m.rfind("[page_pool] kv.check", 0), 0u) << m;
  EXPECT_TRUE(has(m, "not allocated")) << m;
  m = error_of([&] { pool.free(7); });
  EXPECT_TRUE(has(m, "never gave out")) << m;
  EXPECT_THROW(pool.free(-1), Error);
  EXPECT_THROW(pool.k(a), Error);
  EXPECT_THROW(pool.v(a), Error);
  EXPECT_THROW(pool.k(-1), Error);
  EXPECT_THROW(pool.v(4), Error);
  EXPECT_THROW(pool.block(a, 0, 1), Error);
  EXPECT_THROW(pool.zero(a), Error);
  EXPECT_THROW(pool.zero(99), Error);
  // The failed calls changed nothing.
  EXPECT_EQ(pool.in_use(), 1);
  EXPECT_EQ(pool.held(), 2);
  EXPECT_NE(pool.k(b), nullptr);
  EXPECT_EQ(pool.alloc(), a);
  EXPECT_EQ(pool.in_use(), 2);
}

TEST(PagePool, IdsAndPointersStayPutWhileOtherPagesComeAndGo) {
  DeviceAccess inside;  // pages written and read as the kernels do (strict device mode)
  Ledger ledger;
  Arena dev(Tier::Device, kBig, ledger);
  PageShape shape{2, 8, 16, DType::f32};
  const size_t half = shape.half_bytes();
  PagePool pool(dev, Category::kv, shape, 64, "kv");
  std::vector<int64_t> keep;
  std::vector<void*> keep_k, keep_v;
  std::vector<int64_t> churn;
  for (int i = 0; i < 8; ++i) {
    int64_t id = pool.alloc();
    keep.push_back(id);
    keep_k.push_back(pool.k(id));
    keep_v.push_back(pool.v(id));
    std::memset(pool.k(id), 0x10 + i, half);
    std::memset(pool.v(id), 0x40 + i, half);
    churn.push_back(pool.alloc());
  }
  for (int round = 0; round < 20; ++round) {
    for (int64_t id : churn) pool.free(id);
    if (round % 3 == 0) pool.trim();
    churn.clear();
    for (int i = 0; i < 20 + round; ++i) {
      churn.push_back(pool.alloc());
      std::memset(pool.k(churn.back()), 0xee, 2 * half);
    }
  }
  for (size_t i = 0; i < keep.size(); ++i) {
    EXPECT_EQ(pool.k(keep[i]), keep_k[i]);
    EXPECT_EQ(pool.v(keep[i]), keep_v[i]);
    const auto* k = static_cast<const unsigned char*>(keep_k[i]);
    const auto* v = static_cast<const unsigned char*>(keep_v[i]);
    for (size_t j = 0; j < half; ++j) {
      ASSERT_EQ(k[j], 0x10 + i) << "page " << keep[i] << " K byte " << j;
      ASSERT_EQ(v[j], 0x40 + i) << "page " << keep[i] << " V byte " << j;
    }
  }
  // Ids stay dense: never beyond the most pages held at once.
  for (int64_t id : churn) EXPECT_LT(id, pool.peak_in_use());
}

TEST(PagePool, ZeroClearsBothHalvesOfOnePage) {
  DeviceAccess inside;  // pages written and read as the kernels do (strict device mode)
  Ledger ledger;
  Arena dev(Tier::Device, kBig, ledger);
  PageShape shape{3, 5, 7, DType::f32};
  const size_t half = shape.half_bytes();
  PagePool pool(dev, Category::kv_grad, shape, 4, "dkv");
  int64_t a = pool.alloc(), b = pool.alloc();
  std::memset(pool.k(a), 0xab, half);
  std::memset(pool.v(a), 0xcd, half);
  std::memset(pool.k(b), 0x77, half);
  std::memset(pool.v(b), 0x77, half);
  pool.zero(a);
  const auto* ka = static_cast<const unsigned char*>(pool.k(a));
  const auto* va = static_cast<const unsigned char*>(pool.v(a));
  const auto* kb = static_cast<const unsigned char*>(pool.k(b));
  const auto* vb = static_cast<const unsigned char*>(pool.v(b));
  for (size_t j = 0; j < half; ++j) {
    ASSERT_EQ(ka[j], 0) << j;
    ASSERT_EQ(va[j], 0) << j;
    ASSERT_EQ(kb[j], 0x77) << j;
    ASSERT_EQ(vb[j], 0x77) << j;
  }
  const float* kf = static_cast<const float*>(pool.k(a));
  EXPECT_EQ(kf[3 * 5 * 7 - 1], 0.0f);
}

TEST(PagePool, BlockIsThePageAsTheKernelsReadIt) {
  DeviceAccess inside;  // pages written and read as the kernels do (strict device mode)
  Ledger ledger;
  Arena dev(Tier::Device, kBig, ledger);
  PageShape shape{2, 16, 8, DType::bf16};
  PagePool pool(dev, Category::kv, shape, 4, "kv");
  pool.alloc();
  int64_t id = pool.alloc();
  KvBlock b = pool.block(id, 32, 5);
  EXPECT_EQ(b.k, pool.k(id));
  EXPECT_EQ(b.v, pool.v(id));
  EXPECT_EQ(static_cast<char*>(b.v) - static_cast<char*>(b.k), static_cast<ptrdiff_t>(shape.half_bytes()));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.k) % 64, 0u);
  EXPECT_EQ(b.start, 32);
  EXPECT_EQ(b.len, 5);
  KvBlock full = pool.block(id, 0, 16);
  EXPECT_EQ(full.len, 16);
  KvBlock empty = pool.block(id, 48, 0);
  EXPECT_EQ(empty.len, 0);
  EXPECT_EQ(empty.start, 48);
  EXPECT_THROW(pool.block(id, 0, 17), Error);  // len > P
  EXPECT_THROW(pool.block(id, 0, -1), Error);
  EXPECT_THROW(pool.block(id, -16, 4), Error);
}

TEST(PagePool, ReserveHoldsPagesBeforeTheRun) {
  DeviceAccess inside;  // pages written and read as the kernels do (strict device mode)
  Ledger ledger;
  PageShape shape{2, 16, 16, DType::f32};
  const size_t pb = shape.page_bytes();
  Arena dev(Tier::Device, 6 * pb, ledger);
  PagePool pool(dev, Category::kv, shape, 5, "kv.reserve");
  pool.reserve(4);
  EXPECT_EQ(pool.held(), 4);
  EXPECT_EQ(pool.in_use(), 0);
  EXPECT_EQ(ledger.current(Tier::Device, Category::kv), 4 * pb);
  for (int64_t want = 0; want < 4; ++want) EXPECT_EQ(pool.alloc(), want);  // lowest id first
  EXPECT_EQ(pool.held(), 4);
  EXPECT_EQ(ledger.current(Tier::Device, Category::kv), 4 * pb);
  pool.reserve(2);  // already held: nothing to do
  EXPECT_EQ(pool.held(), 4);

  std::string m = error_of<OutOfBudget>([&] { pool.reserve(6); });
  EXPECT_TRUE(has(m, "kv.reserve")) << m;
  EXPECT_TRUE(has(m, "capacity is 5")) << m;
  EXPECT_EQ(pool.held(), 4);
  EXPECT_THROW(pool.reserve(-1), Error);

  // An arena refusal partway leaves the pool as it was: 1.5 pages of budget left for 2 pages.
  Buffer other = dev.alloc(pb / 2, Category::workspace);
  PagePool second(dev, Category::kv_grad, shape, 8, "dkv.reserve");
  std::string m2 = error_of<OutOfBudget>([&] { second.reserve(2); });
  EXPECT_TRUE(has(m2, "dkv.reserve")) << m2;
  EXPECT_EQ(second.held(), 0);
  EXPECT_EQ(ledger.current(Tier::Device, Category::kv_grad), 0u);
  second.reserve(1);
  EXPECT_EQ(second.held(), 1);
  EXPECT_EQ(ledger.current(Tier::Device, Category::kv_grad), pb);
}

TEST(PagePool, ManyPagesHoldDistinctBytes) {
  DeviceAccess inside;  // pages written and read as the kernels do (strict device mode)
  for (PageShape shape : {PageShape{3, 7, 5, DType::f32}, PageShape{8, 64, 128, DType::bf16}}) {  // malloc'd, mapped
    Ledger ledger;
    Arena dev(Tier::Device, kBig, ledger);
    const int n = 48;
    PagePool pool(dev, Category::kv, shape, n, "kv");
    const size_t words = shape.half_bytes() / 4;
    std::vector<int64_t> ids;
    for (int i = 0; i < n; ++i) ids.push_back(pool.alloc());
    auto tag = [](int64_t id, int half, size_t j) { return static_cast<uint32_t>(id * 2654435761u + half * 40503u + j); };
    for (int64_t id : ids) {
      auto* k = static_cast<uint32_t*>(pool.k(id));
      auto* v = static_cast<uint32_t*>(pool.v(id));
      for (size_t j = 0; j < words; ++j) {
        k[j] = tag(id, 0, j);
        v[j] = tag(id, 1, j);
      }
    }
    for (int64_t id : ids) {
      const auto* k = static_cast<const uint32_t*>(pool.k(id));
      const auto* v = static_cast<const uint32_t*>(pool.v(id));
      for (size_t j = 0; j < words; ++j) {
        ASSERT_EQ(k[j], tag(id, 0, j)) << "page " << id << " K word " << j;
        ASSERT_EQ(v[j], tag(id, 1, j)) << "page " << id << " V word " << j;
      }
    }
    EXPECT_EQ(ledger.current(Tier::Device, Category::kv), n * shape.page_bytes());
  }
}

TEST(PagePool, TwoThreadsAllocAndFreeConcurrently) {
  DeviceAccess inside;  // pages written and read as the kernels do (strict device mode)
  Ledger ledger;
  Arena dev(Tier::Device, kBig, ledger);
  PageShape shape{1, 4, 8, DType::f32};
  const int64_t cap = 64;
  PagePool pool(dev, Category::kv, shape, cap, "kv.stress");
  // owner[id] is the thread holding the page, or -1: a page handed to both threads would show here.
  std::vector<std::atomic<int>> owner(cap);
  for (auto& o : owner) o = -1;
  std::atomic<int> conflicts{0}, corrupted{0}, errors{0}, ready{0};
  auto worker = [&](int t) {
    std::mt19937_64 rng(1234 + t);
    ++ready;
    while (ready.load() < 2) std::this_thread::yield();  // start together, so the calls overlap
    std::vector<int64_t> mine;
    for (int op = 0; op < 100000; ++op) {
      try {
        bool do_alloc = mine.empty() || (mine.size() < size_t(cap / 2) && (rng() & 1));
        if (do_alloc) {
          int64_t id = pool.alloc();
          int expected = -1;
          if (id < 0 || id >= cap || !owner[id].compare_exchange_strong(expected, t)) {
            ++conflicts;
            continue;
          }
          auto* k = static_cast<int64_t*>(pool.k(id));
          auto* v = static_cast<int64_t*>(pool.v(id));
          k[0] = id * 10 + t;
          v[0] = -(id * 10 + t);
          mine.push_back(id);
        } else {
          size_t i = rng() % mine.size();
          int64_t id = mine[i];
          mine[i] = mine.back();
          mine.pop_back();
          if (static_cast<int64_t*>(pool.k(id))[0] != id * 10 + t ||
              static_cast<int64_t*>(pool.v(id))[0] != -(id * 10 + t))
            ++corrupted;
          owner[id] = -1;
          pool.free(id);
        }
        if (t == 0 && op % 1000 == 999) pool.trim();
      } catch (const std::exception&) {
        ++errors;
      }
    }
    for (int64_t id : mine) {
      owner[id] = -1;
      pool.free(id);
    }
  };
  std::thread a(worker, 0), b(worker, 1);
  a.join();
  b.join();
  EXPECT_EQ(conflicts.load(), 0);
  EXPECT_EQ(corrupted.load(), 0);
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(pool.in_use(), 0);
  EXPECT_GT(pool.peak_in_use(), 2);
  EXPECT_LE(pool.peak_in_use(), cap);
  EXPECT_LE(pool.held(), cap);
  EXPECT_EQ(ledger.current(Tier::Device, Category::kv), size_t(pool.held()) * shape.page_bytes());
  const int64_t held = pool.held();
  EXPECT_EQ(pool.trim(), held);
  EXPECT_EQ(pool.held(), 0);
  EXPECT_EQ(ledger.current(Tier::Device, Category::kv), 0u);
}

// ---- PageTable ----

TEST(PageTable, SetFindAndAt) {
  PageTable t;
  EXPECT_EQ(t.count(), 0);
  EXPECT_EQ(t.find(0, 0, 0), nullptr);
  t.set(7, 2, 3, PageRef{Tier::Host, 11, 48, 16});
  const PageRef* r = t.find(7, 2, 3);
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->tier, Tier::Host);
  EXPECT_EQ(r->slot, 11);
  EXPECT_EQ(r->start, 48);
  EXPECT_EQ(r->len, 16);
  EXPECT_EQ(t.find(7, 2, 4), nullptr);
  EXPECT_EQ(t.find(7, 3, 3), nullptr);
  EXPECT_EQ(t.find(8, 2, 3), nullptr);

  // at() gives the entry itself: a page being filled grows len in place.
  t.set(7, 2, 4, PageRef{Tier::Device, 0, 64, 1});
  t.at(7, 2, 4).len += 5;
  EXPECT_EQ(t.find(7, 2, 4)->len, 6);
  EXPECT_EQ(&t.at(7, 2, 4), t.find(7, 2, 4));
  EXPECT_EQ(t.count(), 2);
}

TEST(PageTable, SetReplacesAnEntry) {
  PageTable t;
  t.set(1, 0, 0, PageRef{Tier::Device, 5, 0, 16});
  t.set(1, 0, 0, PageRef{Tier::Disk, 9, 0, 16});  // spilled
  EXPECT_EQ(t.count(), 1);
  EXPECT_EQ(t.find(1, 0, 0)->tier, Tier::Disk);
  EXPECT_EQ(t.find(1, 0, 0)->slot, 9);
}

TEST(PageTable, MissingKeyAndBadEntriesAreErrorsNamingTheKey) {
  PageTable t;
  t.set(3, 2, 6, PageRef{Tier::Device, 0, 96, 16});
  std::string m = error_of([&] { t.at(3, 2, 7); });
  EXPECT_EQ(m.rfind("[page_table]", 0), 0u) << m;
  EXPECT_TRUE(has(m, "seq 3 layer 2 page 7")) << m;
  EXPECT_THROW(t.at(3, 1, 6), Error);
  EXPECT_THROW(t.set(3, 2, 0, PageRef{Tier::Device, -1, 0, 0}), Error);
  EXPECT_THROW(t.set(3, 2, 0, PageRef{Tier::Device, 0, 0, -1}), Error);
  EXPECT_THROW(t.set(3, 2, 0, PageRef{Tier::Device, 0, -16, 0}), Error);
  EXPECT_THROW(t.set(3, -1, 0, PageRef{}), Error);
  EXPECT_THROW(t.set(3, 0, -1, PageRef{}), Error);
  EXPECT_EQ(t.count(), 1);
}

TEST(PageTable, EraseRemovesOneEntry) {
  PageTable t;
  t.set(1, 0, 0, PageRef{Tier::Device, 0, 0, 16});
  t.set(1, 0, 1, PageRef{Tier::Device, 1, 16, 16});
  EXPECT_TRUE(t.erase(1, 0, 0));
  EXPECT_FALSE(t.erase(1, 0, 0));
  EXPECT_FALSE(t.erase(2, 0, 1));
  EXPECT_EQ(t.count(), 1);
  EXPECT_EQ(t.find(1, 0, 0), nullptr);
  ASSERT_NE(t.find(1, 0, 1), nullptr);
  EXPECT_EQ(t.find(1, 0, 1)->slot, 1);
}

TEST(PageTable, PagesAreAscendingPerSequenceAndLayer) {
  PageTable t;
  const int64_t big = int64_t(1) << 40;
  for (int64_t lp : {5, 0, 3, 12}) t.set(1, 0, lp, PageRef{Tier::Device, lp, int32_t(lp * 16), 16});
  for (int64_t lp : {2, 1}) t.set(1, 1, lp, PageRef{Tier::Host, lp, int32_t(lp * 16), 16});
  t.set(0, 0, 9, PageRef{});
  t.set(2, 0, 4, PageRef{});
  t.set(big, 0, 1, PageRef{});
  t.set(-1, 0, 8, PageRef{});
  EXPECT_EQ(t.pages(1, 0), (std::vector<int64_t>{0, 3, 5, 12}));
  EXPECT_EQ(t.pages(1, 1), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(t.pages(0, 0), (std::vector<int64_t>{9}));
  EXPECT_EQ(t.pages(2, 0), (std::vector<int64_t>{4}));
  EXPECT_EQ(t.pages(big, 0), (std::vector<int64_t>{1}));
  EXPECT_EQ(t.pages(-1, 0), (std::vector<int64_t>{8}));
  EXPECT_TRUE(t.pages(1, 2).empty());
  EXPECT_TRUE(t.pages(3, 0).empty());
  EXPECT_EQ(t.count(), 10);
}

TEST(PageTable, DropSequenceRemovesAndReturnsOnlyItsEntries) {
  PageTable t;
  for (int64_t seq : {10, 11, 12})
    for (int32_t layer : {0, 1, 2})
      for (int64_t lp : {1, 0})
        t.set(seq, layer, lp, PageRef{Tier::Device, seq * 100 + layer * 10 + lp, int32_t(lp * 32), int32_t(seq)});
  EXPECT_EQ(t.count(), 18);
  std::vector<PageRef> dropped = t.drop_sequence(11);
  ASSERT_EQ(dropped.size(), 6u);
  std::vector<int64_t> slots;
  for (const PageRef& r : dropped) {
    slots.push_back(r.slot);
    EXPECT_EQ(r.len, 11);
  }
  EXPECT_EQ(slots, (std::vector<int64_t>{1100, 1101, 1110, 1111, 1120, 1121}));  // by (layer, page)
  EXPECT_EQ(t.count(), 12);
  for (int32_t layer : {0, 1, 2}) {
    EXPECT_TRUE(t.pages(11, layer).empty());
    EXPECT_EQ(t.pages(10, layer), (std::vector<int64_t>{0, 1}));
    EXPECT_EQ(t.pages(12, layer), (std::vector<int64_t>{0, 1}));
  }
  EXPECT_EQ(t.find(12, 2, 1)->slot, 1221);
  EXPECT_EQ(t.find(10, 0, 0)->slot, 1000);
  EXPECT_TRUE(t.drop_sequence(11).empty());
  EXPECT_TRUE(t.drop_sequence(99).empty());
  EXPECT_EQ(t.drop_sequence(12).size(), 6u);
  EXPECT_EQ(t.drop_sequence(10).size(), 6u);
  EXPECT_EQ(t.count(), 0);
}

}  // namespace
}  // namespace oomless
