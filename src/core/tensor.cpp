#include "core/tensor.h"

#include <sstream>

namespace oomless {

Tensor::Tensor(void* d, DType t, std::initializer_list<int64_t> shape, Tier where) : data(d), dtype(t), tier(where) {
  OOM_CHECK(shape.size() <= 4, "[tensor] at most 4 dimensions, got ", shape.size());
  for (int64_t s : shape) {
    OOM_CHECK(s >= 0, "[tensor] negative dimension ", s);
    dims[ndim++] = s;
  }
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= dims[i];
  return n;
}

Tensor Tensor::reshape(std::initializer_list<int64_t> shape) const {
  Tensor t(data, dtype, shape, tier);
  t.as_bf16 = as_bf16;
  OOM_CHECK(t.numel() == numel(), "[tensor] reshape of ", str(), " to ", t.str(), " changes the element count");
  return t;
}

std::string Tensor::str() const {
  std::ostringstream os;
  if (quant) os << quant->format << (as_bf16 ? " as bf16[" : "[");
  else os << dtype_name(dtype) << (as_bf16 ? " as bf16[" : "[");
  for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << dims[i];
  os << "]";
  return os.str();
}

bool Tensor::same_shape(const Tensor& o) const {
  if (ndim != o.ndim) return false;
  for (int i = 0; i < ndim; ++i)
    if (dims[i] != o.dims[i]) return false;
  return true;
}

void check_shape(const char* op, const char* name, const Tensor& t, std::initializer_list<int64_t> shape) {
  bool ok = t.ndim == static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) {
    if (ok && t.dims[i] != s) ok = false;
    ++i;
  }
  if (!ok) {
    Tensor want(nullptr, t.dtype, shape);
    fail(op, " ", name, " has shape ", t.str(), ", expected ", want.str());
  }
  OOM_CHECK(t.data != nullptr || t.quant || t.numel() == 0, op, " ", name, " has no data");
}

void check_dtype(const char* op, const char* name, const Tensor& t, std::initializer_list<DType> allowed) {
  OOM_CHECK(!t.quant, op, " ", name, " is stored quantised (", t.quant ? t.quant->format : "",
            "), which only a matmul's b operand takes");
  OOM_CHECK(!t.as_bf16, op, " ", name, " is ", t.str(), ", read as bf16, which this op does not take; pass the ",
            dtype_name(t.dtype), " tensor itself");
  for (DType d : allowed)
    if (t.dtype == d) return;
  std::ostringstream os;
  for (DType d : allowed) os << (os.tellp() > 0 ? " or " : "") << dtype_name(d);
  fail(op, " ", name, " is ", dtype_name(t.dtype), ", this backend takes ", os.str());
}

void check_same_shape(const char* op, const char* a_name, const Tensor& a, const char* b_name, const Tensor& b) {
  OOM_CHECK(a.same_shape(b), op, " ", a_name, " ", a.str(), " and ", b_name, " ", b.str(), " must have the same shape");
}

}  // namespace oomless
