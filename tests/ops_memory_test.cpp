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

// copy_rows: strided rows (a kv head's page out of a chunk, a slice of every row of lse) land where the strides
// say and nothing else is written; a stride shorter than its row, rows past either tensor, a dtype mismatch or
// a sub-byte dtype are errors.
TEST(OpsMemory, CopyRowsMovesStridedRowsAndNothingElse) {
  for (const std::string& be : test::backends_under_test()) {
    SCOPED_TRACE(be);
    auto ops = make_ops(be);
    for (DType t : {DType::f32, DType::bf16, DType::u8, DType::f64}) {
      SCOPED_TRACE(dtype_name(t));
      const int64_t rows = 3, cols = 5, src_ld = 11, dst_ld = 7, w = dtype_bytes(t, 1);
      const int64_t src_n = (rows - 1) * src_ld + cols + 2, dst_n = rows * dst_ld;
      std::vector<uint8_t> src(static_cast<size_t>(src_n * w)), dst(static_cast<size_t>(dst_n * w), 0xEE);
      std::iota(src.begin(), src.end(), uint8_t{1});
      std::vector<uint8_t> want = dst;
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(want.data() + r * dst_ld * w, src.data() + (r * src_ld + 1) * w, static_cast<size_t>(cols * w));
      const Tensor ts(src.data() + w, t, {src_n - 1}), td(dst.data(), t, {dst_n});
      ops->copy_rows(td, dst_ld, ts, src_ld, rows, cols);
      EXPECT_EQ(dst, want);
      EXPECT_THROW(ops->copy_rows(td, 4, ts, src_ld, rows, cols), Error);  // stride under the row
      EXPECT_THROW(ops->copy_rows(td, dst_ld, ts, src_ld, rows + 2, cols), Error);  // past src
      EXPECT_THROW(ops->copy_rows(Tensor(dst.data(), t, {2 * dst_ld + cols - 1}), dst_ld, ts, src_ld, rows, cols),
                   Error);  // the last row past dst
      ops->copy_rows(Tensor(dst.data(), t, {2 * dst_ld + cols}), dst_ld, ts, src_ld, rows, cols);  // exactly fits
      EXPECT_EQ(dst, want);
    }
    std::vector<float> f(16);
    std::vector<int32_t> g(16);
    EXPECT_THROW(ops->copy_rows(Tensor(f.data(), DType::f32, {16}), 4, Tensor(g.data(), DType::i32, {16}), 4, 2, 4),
                 Error);
    std::vector<uint8_t> q(16);
    EXPECT_THROW(ops->copy_rows(Tensor(q.data(), DType::nf4, {32}), 8, Tensor(q.data(), DType::nf4, {32}), 8, 2, 3),
                 Error);
  }
}

}  // namespace
}  // namespace oomless
