#include "backend/lapack.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"

extern "C" {
void sgesdd_(const char* jobz, const int* m, const int* n, float* a, const int* lda, float* s, float* u, const int* ldu,
             float* vt, const int* ldvt, float* work, const int* lwork, int* iwork, int* info, size_t jobz_len);
void dgesdd_(const char* jobz, const int* m, const int* n, double* a, const int* lda, double* s, double* u,
             const int* ldu, double* vt, const int* ldvt, double* work, const int* lwork, int* iwork, int* info,
             size_t jobz_len);
}

namespace oomless::lapack {

namespace {

void gesdd(int m, int n, float* a, float* s, float* u, float* vt, float* work, int lwork, int* iwork, int* info) {
  const int k = std::min(m, n);
  sgesdd_("S", &m, &n, a, &m, s, u, &m, vt, &k, work, &lwork, iwork, info, 1);
}
void gesdd(int m, int n, double* a, double* s, double* u, double* vt, double* work, int lwork, int* iwork, int* info) {
  const int k = std::min(m, n);
  dgesdd_("S", &m, &n, a, &m, s, u, &m, vt, &k, work, &lwork, iwork, info, 1);
}

template <class T>
int64_t query_lwork(int64_t m, int64_t n) {
  // LAPACK's own answer for the column-major (n, m) problem.
  T w = 0;
  int info = 0, iw = 0;
  gesdd(static_cast<int>(n), static_cast<int>(m), nullptr, nullptr, nullptr, nullptr, &w, -1, &iw, &info);
  OOM_CHECK(info == 0, "[svd] LAPACK gesdd workspace query failed (info ", info, ")");
  return static_cast<int64_t>(w) + 1;
}

// Element counts of the work buffer's parts: a copy of g, S, U' (n, k), VT' (k, m), LAPACK's work; then
// 8k ints.
struct Parts {
  int64_t a, s, u, vt, work, iwork;
};
template <class T>
Parts parts(int64_t m, int64_t n) {
  const int64_t k = std::min(m, n);
  return {m * n, k, n * k, k * m, query_lwork<T>(m, n), 8 * k};
}

template <class T>
size_t bytes(int64_t m, int64_t n) {
  const Parts p = parts<T>(m, n);
  return sizeof(T) * static_cast<size_t>(p.a + p.s + p.u + p.vt + p.work) + sizeof(int) * static_cast<size_t>(p.iwork);
}

template <class T>
void basis(const T* g, int64_t m, int64_t n, int64_t r, bool right, T* out, void* work) {
  OOM_CHECK(m >= 1 && n >= 1 && r >= 1 && r <= std::min(m, n), "[svd] rank ", r, " must be in 1..min(", m, ", ", n, ")");
  OOM_CHECK(m * n < (int64_t{1} << 31), "[svd] a ", m, " x ", n, " matrix is past LAPACK's 32-bit sizes");
  const Parts p = parts<T>(m, n);
  const int64_t k = std::min(m, n);
  T* a = static_cast<T*>(work);
  T* s = a + p.a;
  T* u = s + p.s;
  T* vt = u + p.u;
  T* w = vt + p.vt;
  int* iw = reinterpret_cast<int*>(w + p.work);
  std::memcpy(a, g, sizeof(T) * static_cast<size_t>(m * n));
  int info = 0;
  gesdd(static_cast<int>(n), static_cast<int>(m), a, s, u, vt, w, static_cast<int>(p.work), iw, &info);
  OOM_CHECK(info == 0, "[svd] LAPACK gesdd failed on a ", m, " x ", n, " matrix (info ", info,
            info > 0 ? ": the SVD did not converge; a non-finite gradient?" : "", ")");
  // g^T = U' S VT' with U' (n, k) = V and VT' (k, m) = U^T, both column-major.
  if (right) {
    std::memcpy(out, u, sizeof(T) * static_cast<size_t>(r * n));  // columns 0..r-1 of U' = rows of V^T
  } else {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < r; ++j) out[i * r + j] = vt[j + i * k];
  }
  // Sign: the largest-magnitude entry of each vector positive.
  const int64_t len = right ? n : m, stride = right ? 1 : r;
  for (int64_t j = 0; j < r; ++j) {
    T* v = right ? out + j * n : out + j;
    int64_t best = 0;
    for (int64_t i = 1; i < len; ++i)
      if (std::fabs(v[i * stride]) > std::fabs(v[best * stride])) best = i;
    if (v[best * stride] < 0)
      for (int64_t i = 0; i < len; ++i) v[i * stride] = -v[i * stride];
  }
}

}  // namespace

size_t svd_workspace(int64_t m, int64_t n, size_t elem) { return elem == 8 ? bytes<double>(m, n) : bytes<float>(m, n); }

void svd_basis(const float* g, int64_t m, int64_t n, int64_t r, bool right, float* out, void* work) {
  basis(g, m, n, r, right, out, work);
}
void svd_basis(const double* g, int64_t m, int64_t n, int64_t r, bool right, double* out, void* work) {
  basis(g, m, n, r, right, out, work);
}

}  // namespace oomless::lapack
