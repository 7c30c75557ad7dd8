// The memory operations of Ops (upload, download, copy, zero, iota): how code above backend/ moves bytes in
// and out of tensors. Every backend under test, several dtypes, byte for byte.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "backend/ops.h"
#include "core/error.h"
#include "util/harness.h"

namespace oomless {
namespace {

TEST(OpsMemory, UploadDownloadCopyZeroAndIotaMoveTheBytes) {
  for (const std::string& be : test::backends_under_test()) {
    SCOPED_TRACE(be);
    auto ops = make_ops(be);
    for (DType t : {DType::f32, DType::bf16, DType::i32, DType::u8, DType::f64}) {
      SCOPED_TRACE(dtype_name(t));
      const int64_t n = 37;
      const size_t bytes = static_cast<size_t>(dtype_bytes(t, n));
      std::vector<uint8_t> host(bytes), a(bytes, 0xAB), b(bytes, 0xCD), back(bytes);
      std::iota(host.begin(), host.end(), uint8_t{3});
      Tensor ta(a.data(), t, {n}), tb(b.data(), t, {n});
      ops->upload(ta, host.data());
      EXPECT_EQ(a, host);
      ops->copy(tb, ta);
      EXPECT_EQ(b, host);
      ops->download(back.data(), tb);
      EXPECT_EQ(back, host);
      ops->zero(ta);
      EXPECT_EQ(a, std::vector<uint8_t>(bytes, 0));
    }
    std::vector<int32_t> pos(9, -1);
    ops->iota(Tensor(pos.data(), DType::i32, {9}), 40);
    for (int i = 0; i < 9; ++i) EXPECT_EQ(pos[static_cast<size_t>(i)], 40 + i);
    std::vector<float> f(4);
    std::vector<int32_t> g(4);
    EXPECT_THROW(ops->copy(Tensor(f.data(), DType::f32, {4}), Tensor(g.data(), DType::i32, {4})), Error);
    EXPECT_THROW(ops->copy(Tensor(f.data(), DType::f32, {4}), Tensor(f.data(), DType::f32, {3})), Error);
    EXPECT_THROW(ops->iota(Tensor(f.data(), DType::f32, {4}), 0), Error);
  }
}

}  // namespace
}  // namespace oomless
