// LAPACK's divide-and-conquer SVD (gesdd, from OpenBLAS) behind Ops::svd_basis, for the CPU backend (float)
// and the reference one (double). Row-major g (m, n) is handed to LAPACK as the column-major (n, m) matrix
// g^T, whose factors are g's with U and V swapped, so nothing is transposed.
#pragma once
#include <cstddef>
#include <cstdint>

namespace oomless::lapack {

// Bytes of the work buffer svd_basis needs for an (m, n) matrix of elements `elem` bytes (4 or 8).
size_t svd_workspace(int64_t m, int64_t n, size_t elem);
// out = the top-r right (r, n) or left (m, r) singular vectors of g, signs as Ops::svd_basis says; `work`
// holds svd_workspace(m, n, sizeof(T)) bytes, aligned to 8. Throws oomless::Error when LAPACK fails.
void svd_basis(const float* g, int64_t m, int64_t n, int64_t r, bool right, float* out, void* work);
void svd_basis(const double* g, int64_t m, int64_t n, int64_t r, bool right, double* out, void* work);

}  // namespace oomless::lapack
