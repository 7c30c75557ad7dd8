#include "backend/ops.h"

#include "backend/cpu/cpu_ops.h"
#include "backend/ref/ref_ops.h"
#include "backend/strict_ops.h"
#include "memory/allocator.h"

#include <cstring>

namespace oomless {

void Ops::upload(Tensor dst, const void* src) {
  if (dst.nbytes() > 0) std::memcpy(dst.data, src, static_cast<size_t>(dst.nbytes()));
}

void Ops::download(void* dst, Tensor src) {
  if (src.nbytes() > 0) std::memcpy(dst, src.data, static_cast<size_t>(src.nbytes()));
}

void Ops::copy(Tensor dst, Tensor src) {
  OOM_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel(), "[copy] dst ", dst.str(), " and src ", src.str(),
            " differ in dtype or size");
  if (dst.nbytes() > 0 && dst.data != src.data) std::memmove(dst.data, src.data, static_cast<size_t>(dst.nbytes()));
}

void Ops::copy_rows(Tensor dst, int64_t dst_ld, Tensor src, int64_t src_ld, int64_t rows, int64_t cols) {
  OOM_CHECK(dst.dtype == src.dtype, "[copy_rows] dst ", dst.str(), " and src ", src.str(), " differ in dtype");
  OOM_CHECK(dtype_bits(dst.dtype) % 8 == 0, "[copy_rows] ", dtype_name(dst.dtype), " packs elements below a byte");
  OOM_CHECK(rows >= 0 && cols >= 0 && dst_ld >= cols && src_ld >= cols, "[copy_rows] ", rows, " rows of ", cols,
            " elements with strides ", dst_ld, " / ", src_ld, ": a stride must cover its row");
  if (rows == 0 || cols == 0) return;
  OOM_CHECK((rows - 1) * dst_ld + cols <= dst.numel() && (rows - 1) * src_ld + cols <= src.numel(), "[copy_rows] ",
            rows, " rows of ", cols, " elements with strides ", dst_ld, " / ", src_ld, " run past dst ", dst.str(),
            " or src ", src.str());
  const size_t row = static_cast<size_t>(dtype_bytes(dst.dtype, cols));
  const int64_t dl = dtype_bytes(dst.dtype, dst_ld), sl = dtype_bytes(src.dtype, src_ld);
  for (int64_t r = 0; r < rows; ++r)
    std::memmove(static_cast<char*>(dst.data) + r * dl, static_cast<const char*>(src.data) + r * sl, row);
}

void Ops::zero(Tensor x) {
  if (x.nbytes() > 0) std::memset(x.data, 0, static_cast<size_t>(x.nbytes()));
}

void Ops::iota(Tensor x, int32_t first) {
  int32_t* p = x.as<int32_t>("[iota]");
  for (int64_t i = 0; i < x.numel(); ++i) p[i] = first + static_cast<int32_t>(i);
}

void Ops::write_host(Tensor dst, const std::function<void(void*)>& write) {
  if (dst.nbytes() > 0) write(dst.data);
}

void Ops::read_host(Tensor src, const std::function<void(const void*)>& read) {
  if (src.nbytes() > 0) read(src.data);
}

Tensor Ops::map_to_host(Tensor t) {
  t.tier = Tier::Host;
  return t;
}

void Ops::unmap_from_host(Tensor t, Tensor host, bool) {
  OOM_CHECK(host.data == t.data, "[ops] unmap_from_host: ", host.str(), " is not the host view of ", t.str());
}

std::unique_ptr<Ops> make_ops(std::string_view name, Arena* workspace) {
  if (name == "ref") return strict_device() ? make_strict_ops(std::make_unique<RefOps>()) : std::make_unique<RefOps>();
  if (name == "cpu")
    return strict_device() ? make_strict_ops(std::make_unique<CpuOps>(workspace)) : std::make_unique<CpuOps>(workspace);
  if (name == "cuda")
    fail("[backend] the CUDA backend has no kernels yet in this build; use --backend cpu");
  fail("[backend] unknown backend '", name, "': choose cpu (or ref, the float64 oracle used by tests)");
}

}  // namespace oomless
