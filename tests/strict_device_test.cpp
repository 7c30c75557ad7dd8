// The strict device mode (memory/allocator.h): Device memory from the guarded allocator is open to host code
// only inside a DeviceAccess, which every call of the strict backend opens; a host read or write anywhere else
// kills the process with a message naming it.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "backend/ops.h"
#include "backend/strict_ops.h"
#include "memory/allocator.h"
#include "memory/arena.h"

namespace oomless {
namespace {

constexpr const char* kFault = "host code touched Device memory at 0x[0-9a-f]+ outside the backend";

TEST(StrictDevice, GuardedMemoryIsOpenOnlyInsideADeviceAccess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Ledger ledger;
  Arena device(Tier::Device, size_t{1} << 30, ledger, nullptr, &guarded_allocator());
  Buffer b = device.alloc(1000 * sizeof(float), Category::activations);
  ASSERT_TRUE(in_guarded_range(b.data()));
  float* p = b.as<float>();
  {
    DeviceAccess open;
    p[999] = 3.5f;
    EXPECT_EQ(p[999], 3.5f);
  }
  EXPECT_DEATH({ volatile float x = p[999]; (void)x; }, kFault);  // a planted host read
  EXPECT_DEATH({ p[0] = 1.0f; }, kFault);                         // and a write
  {
    DeviceAccess outer;
    {
      DeviceAccess inner;
    }
    EXPECT_EQ(p[999], 3.5f);  // still open: scopes nest
  }
  EXPECT_DEATH({ volatile float x = p[999]; (void)x; }, kFault);
}

TEST(StrictDevice, TheStrictBackendOpensItForEachCall) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Ledger ledger;
  Arena device(Tier::Device, size_t{1} << 30, ledger, nullptr, &guarded_allocator());
  std::unique_ptr<Ops> ops = make_strict_ops(make_ops("cpu"));
  Buffer a = device.alloc(64 * sizeof(float), Category::activations);
  Buffer c = device.alloc(64 * sizeof(float), Category::activations);
  const Tensor ta = a.view(DType::f32, {8, 8}), tc = c.view(DType::f32, {8, 8});
  std::vector<float> host(64);
  for (int i = 0; i < 64; ++i) host[static_cast<size_t>(i)] = i % 8 == i / 8 ? 2.0f : 0.0f;  // 2 I
  ops->upload(ta, host.data());
  ops->matmul(tc, ta, ta, false, false, false);  // 4 I
  ops->scale(tc, 0.5);
  std::vector<float> back(64);
  ops->download(back.data(), tc);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(back[static_cast<size_t>(i)], i % 8 == i / 8 ? 2.0f : 0.0f) << i;
  EXPECT_DEATH({ volatile float x = c.as<float>()[9]; (void)x; }, kFault);
}

TEST(StrictDevice, FreedRangesAreTakenAgainAndReadAsZeros) {
  Allocator& g = guarded_allocator();
  void* x = g.allocate(3 * 4096 + 1);
  void* y = g.allocate(4096);
  ASSERT_TRUE(x && y);
  EXPECT_NE(x, y);
  {
    DeviceAccess open;
    static_cast<char*>(x)[5] = 7;
  }
  g.deallocate(x, 3 * 4096 + 1);
  void* z = g.allocate_zeroed(2 * 4096);  // first fit: the freed range, cleared
  EXPECT_EQ(z, x);
  {
    DeviceAccess open;
    EXPECT_EQ(static_cast<char*>(z)[5], 0);
  }
  g.deallocate(z, 2 * 4096);
  g.deallocate(y, 4096);
  void* w = g.allocate(5 * 4096);  // the three ranges coalesced
  EXPECT_EQ(w, x);
  g.deallocate(w, 5 * 4096);
}

TEST(StrictDevice, HeapMemoryIsNotGuarded) {
  Ledger ledger;
  Arena host(Tier::Host, size_t{1} << 30, ledger, nullptr, &heap_allocator());
  Buffer b = host.alloc(4096, Category::optimizer);
  EXPECT_FALSE(in_guarded_range(b.data()));
  b.as<char>()[0] = 1;  // host memory: host code may touch it
  EXPECT_EQ(b.as<char>()[0], 1);
}

}  // namespace
}  // namespace oomless
