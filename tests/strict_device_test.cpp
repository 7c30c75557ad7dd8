// The strict device mode (memory/allocator.h): Device memory from the guarded allocator is open to host code
// only inside a DeviceAccess, which every call of the strict backend opens; a host read or write anywhere else
// kills the process with a message naming it.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "backend/strict_ops.h"
#include "core/kv_block.h"
#include "memory/allocator.h"
#include "memory/arena.h"
#include "optim/adamw.h"
#include "optim/galore.h"
#include "optim/host_placed.h"
#include "optim/optimizer.h"

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

// A kernel takes its operands on one side: a call mixing Device and host tensors, or attention over K/V pages
// on the other side of its queries, is refused naming both; the memory operations cross.
TEST(StrictDevice, AKernelTakesItsOperandsOnOneSide) {
  Ledger ledger;
  Arena device(Tier::Device, size_t{1} << 30, ledger, nullptr, &guarded_allocator());
  std::unique_ptr<Ops> ops = make_strict_ops(make_ops("cpu"));
  Buffer a = device.alloc(64 * sizeof(float), Category::activations);
  const Tensor ta = a.view(DType::f32, {8, 8});
  std::vector<float> host(64, 1.0f);
  const Tensor th = Tensor::of(host.data(), {8, 8});
  ops->upload(ta, host.data());
  ops->copy(th, ta);  // crossing is what copy is for
  try {
    ops->matmul(th, ta, ta, false, false, false);
    ADD_FAILURE() << "a Device product written into host memory";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("matmul: argument 1, f32[8, 8], is host memory and argument 2"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(ops->add(ta, ta, th), Error);
  ops->add(th, th, th);  // all on the host: allowed
  // Attention: queries in Device memory, one K/V block in host memory.
  std::vector<float> k(2 * 4 * 8), v(k.size());
  Buffer q = device.alloc(4 * 2 * 8 * sizeof(float), Category::activations);
  Buffer o = device.alloc(4 * 2 * 8 * sizeof(float), Category::activations);
  Buffer lse = device.alloc(2 * 4 * sizeof(float), Category::activations);
  Buffer pos = device.alloc(4 * sizeof(int32_t), Category::workspace);
  ops->zero(q.view(DType::f32, {4 * 2 * 8}));
  ops->iota(pos.view(DType::i32, {4}), 0);
  KvBlock blk{k.data(), v.data(), 0, 4};
  const KvBlocks kv{&blk, 1, 2, 4, 8, DType::f32};
  try {
    ops->attention_forward(o.view(DType::f32, {4, 2, 8}), lse.view(DType::f32, {2, 4}), q.view(DType::f32, {4, 2, 8}),
                           kv, pos.view(DType::i32, {4}), 0.25);
    ADD_FAILURE() << "attention over host pages with Device queries";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("K/V block 0 (keys 0..3) is in host memory"), std::string::npos) << e.what();
  }
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

// The optimizer on the host (HostPlaced): parameters and gradients in guarded Device memory, the state in host
// memory, stepped by the host's backend over staged copies: bit for bit the same optimizer run on the device,
// and the host never touches Device memory (it would die here).
TEST(StrictDevice, AnOptimizerOnTheHostStepsStagedCopiesBitForBitAsOnTheDevice) {
  Ledger ledger;
  Arena device(Tier::Device, size_t{1} << 30, ledger, nullptr, &guarded_allocator());
  Arena host(Tier::Host, size_t{1} << 30, ledger, nullptr, &heap_allocator());
  std::unique_ptr<Ops> dev_ops = make_strict_ops(make_ops("cpu", &device));
  std::unique_ptr<Ops> host_ops = make_ops("cpu", &host);
  const AdamWSettings adam{1e-2, 0.9, 0.99, 1e-8, 0.1};
  for (const char* name : {"adamw", "adamw8bit", "galore"}) {
    SCOPED_TRACE(name);
    std::vector<Buffer> keep;
    std::vector<std::vector<float>> grads;
    TrainableSet sets[2];
    std::mt19937_64 rng(5);
    std::normal_distribution<float> nd;
    for (int t = 0; t < 3; ++t) {
      const int64_t rows = t == 2 ? 1 : 48, cols = 64;
      std::vector<float> p(static_cast<size_t>(rows * cols)), g(p.size());
      for (float& x : p) x = nd(rng);
      for (float& x : g) x = 0.1f * nd(rng);
      grads.push_back(g);
      for (TrainableSet& set : sets) {
        keep.push_back(device.alloc(p.size() * 4, Category::weights));
        const Tensor pt = rows == 1 ? keep.back().view(DType::f32, {cols}) : keep.back().view(DType::f32, {rows, cols});
        keep.push_back(device.alloc(g.size() * 4, Category::grads));
        const Tensor gt = rows == 1 ? keep.back().view(DType::f32, {cols}) : keep.back().view(DType::f32, {rows, cols});
        dev_ops->upload(pt, p.data());
        dev_ops->upload(gt, g.data());
        set.push_back({"model.layers.0.mlp.w" + std::to_string(t) + ".weight", pt, gt, t < 2, 0});
      }
    }
    const GaLoreSettings galore{8, 2, 0.25, false, false};
    std::unique_ptr<Optimizer> on_device = make_optimizer(name, sets[0], device, adam, galore);
    HostPlaced on_host(make_optimizer(name, sets[1], host, adam, galore), *host_ops);
    for (int64_t step = 1; step <= 3; ++step) {
      // each step's gradients afresh, as a backward gives them (GaLore uses its gradient as scratch)
      for (TrainableSet& set : sets)
        for (size_t t = 0; t < set.size(); ++t) dev_ops->upload(set[t].grad, grads[t].data());
      on_device->step(*dev_ops, sets[0], 1e-2, step);
      on_host.step(*dev_ops, sets[1], 1e-2, step);
    }
    for (size_t t = 0; t < sets[0].size(); ++t) {
      std::vector<float> a(static_cast<size_t>(sets[0][t].param.numel())), b(a.size());
      dev_ops->download(a.data(), sets[0][t].param);
      dev_ops->download(b.data(), sets[1][t].param);
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << t;
    }
  }
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
