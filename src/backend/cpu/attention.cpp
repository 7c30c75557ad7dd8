// Causal GQA attention over a block table on the CPU, flash-style: tiles of kBq queries x kBk keys,
// online softmax, never a T x T buffer. Forward saves only O and lse (H, T); backward recomputes the
// probabilities from lse.
//
// Keys are cut into key tiles that never cross a block: block b, slots [j0, j0 + n), at positions
// [start_b + j0, start_b + j0 + n). Queries are cut into query tiles of consecutive rows; since query
// positions are arbitrary, each tile carries its lowest and highest position. A key tile whose first
// position is past a query tile's highest is skipped; keys past that highest position are trimmed off
// the tile; a row at position p sees the first clamp(p - first + 1, 0, n) keys of a tile (keys are in
// position order within a block), so masking is a per-row column count, not an element test.
//
// Scores are kept in base 2: x = scale log2(e) q.k, so every exponential is exp2 and
//   lse = ln(2) (m + log2 l)   with m the row maximum of x and l = sum 2^(x - m).
//
// Forward, parallel over (query tile, head), for each visible key tile:
//   S = Q K^T (Gemm::tile), m' = max(m, rowmax x), P = 2^(x - m'), l = l 2^(m - m') + rowsum P,
//   O = O 2^(m - m') + P V (Gemm::tile, accumulating into o itself); at the end O /= l.
//   One position under GQA (a decode step): parallel over kv heads instead, the group's query heads the rows
//   of one task, so each key tile is read once a group (the same bits: rows do not mix); with f32 products
//   split further over every thread (decode_split), keys and values read in place by kernels of its own.
// Backward, with D_i = rowsum(dO_i * O_i) precomputed and P = 2^(x - lse log2 e), parallel over (key tile,
// kv head), each task looping over the group's query heads and every query tile that sees its key tile:
//   dV += P^T dO,  dP = dO V^T,  dS = scale P (dP - D),  dK += dS^T Q,  dQ += dS K.
// O, dK and dV rows are each owned by one task, which adds its terms in a fixed order. A dQ tile takes terms
// from every key tile it sees, so they take turns: a counter per (head, query tile) says how many of its
// visible key tiles (in ascending order) have added theirs, and a task waits for its turn before adding.
// The sums are those of a pass per query tile over its key tiles in order (S, P and dS are the same bits
// wherever computed), without computing S, P and dS a second time: results are bitwise identical for any
// thread count. Tasks are dealt round-robin, each thread taking its own in ascending order, so the causal
// triangle's uneven task costs spread evenly, and the task holding the lowest unfinished key tile never
// waits (no deadlock: a key tile waits only for lower ones).
//
// bf16 products (KvBlocks::bf16_products, bf16 compute): every tile product takes bf16 operands: q and dout
// rounded once per call, key tiles per tile, P and dS per tile after the fp32 softmax and score gradients.
// On the amx GEMM path they are bf16 (bf16 K/V pages read as they are) and the products run on AMX tiles:
// where D is a multiple of 32 through attention_amx (Ctx::tiles: operands laid out for the tiles once, a
// softmax of its own), else gemm_detail::tile_bf16_amx; on the other paths the rounded values stay in f32
// and the f32 tile kernels multiply them (the same sums as bf16 operands widened). Deterministic either way.
//
// The softmax rows (online_softmax, probabilities, score_grads) run eight lanes a vector on the avx2 and generic
// GEMM paths and sixteen on avx512 and amx, with the same bits (each lane's operations are the same, and the
// reductions fold sixteen fixed lanes either way); on amx the forward's P, and the backward's P and dS, go
// to bf16 in the pass that makes them rather than in a pass of their own.
//
// K/V may be f32, bf16, f8_e4m3 (scaled per block or per row) or, forward only, i8 (scaled per row); narrow
// key tiles are widened to f32 per tile. dK/dV blocks are f32 and
// accumulate (+=). Scratch (per-thread tiles, tile tables, D and lse in base 2) is one workspace
// allocation per call, sized by omp_get_max_threads().
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include <sched.h>

#include "backend/attention_merge.h"
#include "backend/checks.h"
#include "backend/cpu/attention_amx.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/gemm.h"
#include "backend/cpu/gemm_kernel.h"
#include "core/clones.h"

namespace oomless {

namespace {
constexpr DType kAct = DType::f32;
constexpr const char* kOp = "[attention]";
constexpr int64_t kBq = 96;   // queries per tile (a multiple of the GEMM's 6-row micro tile)
constexpr int64_t kBk = 128;  // keys per tile (a multiple of its 16-column micro tile)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.6931471805599453;

struct KeyTile {
  int64_t block, j0, n;  // slots [j0, j0 + n) of block `block`
  int64_t lo;            // position of slot j0; slot j0 + j is at lo + j
};
struct QueryTile {
  int64_t r0, n;   // rows [r0, r0 + n)
  int64_t lo, hi;  // lowest and highest position among them
};

// Everything a task reads; pointers into the caller's tensors and the call's scratch.
struct Ctx {
  int64_t T, H, Hkv, D, P, group, ldq;  // ldq = H * D: the row stride of q, o, dout, dq
  const float* q;
  const int32_t* pos;
  float* o;
  float* lse;
  const KvBlocks* kv;
  const KvBlocks* dkv;
  const float* dout;
  float* dq;
  const float* lse2;  // (H, T) lse log2(e), backward only
  const float* dsum;  // (H, T) D = rowsum(dout * o), backward only
  int32_t* dq_done;       // (H, n_qt) backward: how many visible key tiles have added their dS K to dQ's tile
  const int32_t* dq_turn;  // (n_kt, n_qt) backward: key tile i's place among those query tile j sees
  float c;            // scale log2(e)
  float scale;
  bool bf16 = false;           // bf16 products
  bool amx = false;            // ... as bf16 operands on AMX tiles
  bool lanes16 = false;        // the softmax rows sixteen lanes a vector (the avx512 and amx GEMM paths)
  const float* qr = nullptr;   // bf16 products off amx: q and dout rounded, in f32 (T, ldq)
  const float* dr = nullptr;
  const uint16_t* qh = nullptr;  // bf16 products on amx: q and dout in bf16 (T, ldq)
  const uint16_t* dh = nullptr;
  const uint16_t* kvh = nullptr;  // forward on amx, f32 K/V converted once (kv_once_floats): block b's K at
                                  // kvh + 2 b Hkv P D, its V Hkv P D after
  bool tiles = false;  // on amx with D a multiple of 32: attention_amx's products over operands laid out once
  const uint32_t* kvp = nullptr;  // tiles, forward: key tile i under kv head g packed once per call
                                  // (kv_pack_floats): its keys' pairs at kvp + (i Hkv + g) kBk D, its values' after
  const uint16_t* qth = nullptr;  // tiles, backward: q and dout transposed per (head, query tile): (D, kBq)
  const uint16_t* dth = nullptr;  // bf16 at qth + (h n_qt + i) D kBq
  const KeyTile* kt;
  int64_t n_kt;
  const QueryTile* qt;
  int64_t n_qt;
};

// n rounded up to 16 floats, so that every scratch region starts 64-byte aligned.
int64_t padded(int64_t n) { return (n + 15) / 16 * 16; }

// Whether bf16 products take attention_amx's tiles (Ctx::tiles): on amx, D a multiple of 32 up to 256.
bool tiles_ok(bool amx, int64_t D) { return amx && D % 32 == 0 && D <= 256; }

// Eight floats, or eight int32, as a GCC vector: the row loops below are written on them explicitly so
// that every ISA clone gets the same eight-wide code (two SSE halves by default, one AVX2 register
// under x86-64-v3), with identical lanes and therefore identical sums. The helpers pass them by value
// only between inline functions of this file, so GCC's note that a 32-byte vector argument has another
// ABI without AVX does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

__attribute__((always_inline)) inline v8f splat(float a) { return v8f{a, a, a, a, a, a, a, a}; }
__attribute__((always_inline)) inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
__attribute__((always_inline)) inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }
__attribute__((always_inline)) inline v8f vmax(v8f a, v8f b) { return a > b ? a : b; }
__attribute__((always_inline)) inline float hmax(v8f a) {
  float m = a[0];
  for (int k = 1; k < 8; ++k) m = m > a[k] ? m : a[k];
  return m;
}
__attribute__((always_inline)) inline float hsum(v8f a) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

// 2^x in f32, relative error about 1e-7: x = n + f with n an integer and |f| <= 1/2, 2^f from its
// degree-7 Taylor polynomial in f ln 2, 2^n from the exponent bits. Below -126 it returns 0 (masked
// and negligible terms); the arguments here are <= 0 up to rounding, clamped at 127. One body for eight
// floats (V, with I as many int32) and sixteen (exp2_v16 below): the same operations on every lane, so a
// lane's value does not depend on the width. (A macro rather than a template: clang refuses a 64-byte vector
// passed to a function not compiled for AVX-512, even one always inlined.)
#define OOMLESS_EXP2_BODY(V, I)                                                    \
  {                                                                                \
    const V round = V{} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer in the low bits */ \
    const V lo = V{} - 126.0f, hi = V{} + 127.0f;                                  \
    V xc = x < lo ? lo : x;                                                        \
    xc = xc > hi ? hi : xc;                                                        \
    const V t = xc + round;                                                        \
    const V n = t - round;                                                         \
    const V f = xc - n;                                                            \
    const I e = (((I)t - (I)round) + 127) << 23;                                   \
    V p = V{} + 1.5252733804059840e-05f;                                           \
    p = p * f + 1.5403530393381609e-04f;                                           \
    p = p * f + 1.3333558146428443e-03f;                                           \
    p = p * f + 9.6181291076284772e-03f;                                           \
    p = p * f + 5.5504108664821580e-02f;                                           \
    p = p * f + 2.4022650695910071e-01f;                                           \
    p = p * f + 6.9314718055994531e-01f;                                           \
    p = p * f + 1.0f;                                                              \
    const V y = p * (V)e;                                                          \
    return x < lo ? V{} : y;                                                       \
  }
__attribute__((always_inline)) inline v8f exp2_v8(v8f x) OOMLESS_EXP2_BODY(v8f, v8i)
__attribute__((always_inline)) inline float exp2_f32(float x) { return exp2_v8(splat(x))[0]; }

// Keys of a tile that a query at position p sees: the first clamp(p - lo + 1, 0, n).
inline int64_t visible(int32_t p, int64_t lo, int64_t n) { return std::clamp<int64_t>(p - lo + 1, 0, n); }

// Applies y = f(x) in place to x[0, n) sixteen at a time, the last partial sixteen through a copy
// padded with `pad`; folds each y into the lane-wise reduction r = g(r, y) over 16 fixed lanes (two
// vectors; padded lanes included, so `pad` must map to g's identity).
template <class F, class G>
__attribute__((always_inline)) inline void map_reduce(float* x, int64_t n, float pad, v8f* r0, v8f* r1, F f, G g) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const v8f y0 = f(load8(x + j)), y1 = f(load8(x + j + 8));
    store8(x + j, y0);
    store8(x + j + 8, y1);
    *r0 = g(*r0, y0);
    *r1 = g(*r1, y1);
  }
  if (j < n) {
    alignas(32) float tail[16];
    for (int k = 0; k < 16; ++k) tail[k] = j + k < n ? x[j + k] : pad;
    const v8f y0 = f(load8(tail)), y1 = f(load8(tail + 8));
    *r0 = g(*r0, y0);
    *r1 = g(*r1, y1);
    store8(tail, y0);
    store8(tail + 8, y1);
    for (int k = 0; j + k < n; ++k) x[j + k] = tail[k];
  }
}

// x[j] *= c for j < n, returns max_j x[j] (-inf when n == 0).
__attribute__((always_inline)) inline float scale_max(float* x, int64_t n, float c) {
  v8f m0 = splat(kNegInf), m1 = m0;
  map_reduce(x, n, kNegInf, &m0, &m1, [c](v8f v) { return v * c; }, vmax);
  return hmax(vmax(m0, m1));
}

// x[j] = 2^(x[j] - shift) for j < n, returns their sum over 16 fixed lanes.
__attribute__((always_inline)) inline float exp2_sum(float* x, int64_t n, float shift) {
  v8f s0 = splat(0.0f), s1 = s0;
  map_reduce(x, n, kNegInf, &s0, &s1, [shift](v8f v) { return exp2_v8(v - shift); },
             [](v8f a, v8f b) { return a + b; });
  return hsum(s0 + s1);
}

// ---- the same row loops sixteen lanes a vector (the AVX-512 GEMM paths) ------------------------------
// One 16-float vector holds the lanes of map_reduce's two eight-float ones (lane k < 8 of the first, k >= 8
// of the second), element for element the same operations, and the reductions fold its halves as those
// fold their two vectors: the same bits (Attention.Bf16ProductsOnEveryPath compares the avx2 and avx512 paths).
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

#define OOMLESS_LANES16 __attribute__((target("arch=x86-64-v4"), always_inline)) inline
OOMLESS_LANES16 v16f exp2_v16(v16f x) OOMLESS_EXP2_BODY(v16f, v16i)
#undef OOMLESS_EXP2_BODY
OOMLESS_LANES16 v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
OOMLESS_LANES16 void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }
// hmax(vmax(first eight lanes, last eight)) and hsum(first eight + last eight): the eight-lane forms' folds.
OOMLESS_LANES16 float hmax16(v16f v) {
  float m = v[0] > v[8] ? v[0] : v[8];
  for (int k = 1; k < 8; ++k) {
    const float a = v[k] > v[k + 8] ? v[k] : v[k + 8];
    m = m > a ? m : a;
  }
  return m;
}
OOMLESS_LANES16 float hsum16(v16f v) {
  float a[8];
  for (int k = 0; k < 8; ++k) a[k] = v[k] + v[k + 8];
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}
// f32_to_bf16's bits for sixteen floats (NaN kept quiet).
OOMLESS_LANES16 void store_bf16x16(uint16_t* d, v16f y) {
  const v16u u = (v16u)y;
  const v16u quiet = (u >> 16) | 0x40u, rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const v16h h = __builtin_convertvector((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded, v16h);
  std::memcpy(d, &h, sizeof h);
}
// x[0, n) padded with `pad` to sixteen, the padding lanes included in what is computed from it.
OOMLESS_LANES16 v16f load_tail16(const float* x, int64_t n, float pad) {
  alignas(64) float t[16];
  for (int k = 0; k < 16; ++k) t[k] = k < n ? x[k] : pad;
  return load16(t);
}
OOMLESS_LANES16 void store_bf16_tail16(uint16_t* h, int64_t n, v16f v) {
  alignas(64) uint16_t t[16];
  store_bf16x16(t, v);
  for (int k = 0; k < n; ++k) h[k] = t[k];
}
OOMLESS_LANES16 void store_tail16(float* x, int64_t n, v16f v) {
  alignas(64) float t[16];
  store16(t, v);
  for (int k = 0; k < n; ++k) x[k] = t[k];
}

// scale_max on sixteen lanes.
__attribute__((target("arch=x86-64-v4"))) float scale_max16(float* x, int64_t n, float c) {
  v16f m = v16f{} + kNegInf;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const v16f y = load16(x + j) * c;
    store16(x + j, y);
    m = m > y ? m : y;
  }
  if (j < n) {
    const v16f y = load_tail16(x + j, n - j, kNegInf) * c;
    m = m > y ? m : y;
    store_tail16(x + j, n - j, y);
  }
  return hmax16(m);
}

// exp2_sum on sixteen lanes; with h, the values go to h in bf16 (f32_to_bf16's bits) instead of back to x.
__attribute__((target("arch=x86-64-v4"))) float exp2_sum16(float* x, int64_t n, float shift, uint16_t* h) {
  v16f s = v16f{};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const v16f y = exp2_v16(load16(x + j) - shift);
    if (h) store_bf16x16(h + j, y);
    else store16(x + j, y);
    s = s + y;
  }
  if (j < n) {
    const v16f y = exp2_v16(load_tail16(x + j, n - j, kNegInf) - shift);
    s = s + y;
    if (h) {
      store_bf16_tail16(h + j, n - j, y);
    } else {
      store_tail16(x + j, n - j, y);
    }
  }
  return hsum16(s);
}

// probabilities' row on sixteen lanes: x[j] = 2^(c x[j] - shift) for j < n, and with h in bf16 too.
__attribute__((target("arch=x86-64-v4"))) void probs16(float* x, int64_t n, float c, float shift, uint16_t* h) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const v16f y = exp2_v16(load16(x + j) * c - shift);
    store16(x + j, y);
    if (h) store_bf16x16(h + j, y);
  }
  if (j < n) {
    const v16f y = exp2_v16(load_tail16(x + j, n - j, 0.0f) * c - shift);
    store_tail16(x + j, n - j, y);
    if (h) {
      store_bf16_tail16(h + j, n - j, y);
    }
  }
}

// score_grads' row on sixteen lanes into bf16: h[j] = bf16(scale p[j] (g[j] - dr)) for j < nk.
__attribute__((target("arch=x86-64-v4"))) void score_grads16_bf16(const float* g, const float* p, int64_t nk, float dr,
                                                                  float scale, uint16_t* h) {
  int64_t j = 0;
  for (; j + 16 <= nk; j += 16) store_bf16x16(h + j, scale * load16(p + j) * (load16(g + j) - dr));
  for (; j < nk; ++j) h[j] = f32_to_bf16(scale * p[j] * (g[j] - dr));
}
#undef OOMLESS_LANES16

// The online-softmax step of the forward for one (nq, nk) score tile S: turns S into P in place (or, with
// Sh, into bf16 P in Sh, row stride nk), updates the running max m and sum l of each row and rescales the row
// of O (nq, D; stride ldo). W: eight lanes a vector or sixteen (the same bits).
template <int W>
__attribute__((always_inline)) inline void softmax_rows(float* S, uint16_t* Sh, int64_t nq, int64_t nk, float c,
                                                        const int32_t* qpos, int64_t klo, float* m, float* l, float* O,
                                                        int64_t ldo, int64_t D) {
  for (int64_t r = 0; r < nq; ++r) {
    float* x = S + r * nk;
    uint16_t* xh = Sh ? Sh + r * nk : nullptr;
    const int64_t n = visible(qpos[r], klo, nk);
    float mt;
    if constexpr (W == 16) mt = scale_max16(x, n, c);
    else mt = scale_max(x, n, c);
    const float mn = std::max(m[r], mt);
    if (mn == kNegInf) {  // nothing visible yet: the row stays empty
      if (xh) std::fill(xh, xh + nk, uint16_t{0});
      else std::fill(x, x + nk, 0.0f);
      continue;
    }
    const float alpha = exp2_f32(m[r] - mn);  // 0 when m[r] = -inf
    float sum;
    if constexpr (W == 16) sum = exp2_sum16(x, n, mn, xh);
    else sum = exp2_sum(x, n, mn);
    if (xh) std::fill(xh + n, xh + nk, uint16_t{0});
    else std::fill(x + n, x + nk, 0.0f);
    l[r] = l[r] * alpha + sum;
    m[r] = mn;
    if (alpha != 1.0f) {
      float* orow = O + r * ldo;
      for (int64_t d = 0; d < D; ++d) orow[d] *= alpha;
    }
  }
}

OOMLESS_CLONES("arch=x86-64-v3", "default")
void online_softmax(float* S, int64_t nq, int64_t nk, float c, const int32_t* qpos, int64_t klo, float* m, float* l,
                    float* O, int64_t ldo, int64_t D) {
  softmax_rows<8>(S, nullptr, nq, nk, c, qpos, klo, m, l, O, ldo, D);
}

__attribute__((target("arch=x86-64-v4")))
void online_softmax16(float* S, uint16_t* Sh, int64_t nq, int64_t nk, float c, const int32_t* qpos, int64_t klo,
                      float* m, float* l, float* O, int64_t ldo, int64_t D) {
  softmax_rows<16>(S, Sh, nq, nk, c, qpos, klo, m, l, O, ldo, D);
}

// P = 2^(c S - lse2) in place for the visible keys of each row, 0 elsewhere and on rows that see no
// key at all (lse = -inf).
OOMLESS_CLONES("arch=x86-64-v3", "default")
void probabilities(float* S, int64_t nq, int64_t nk, float c, const int32_t* qpos, int64_t klo, const float* lse2) {
  for (int64_t r = 0; r < nq; ++r) {
    float* x = S + r * nk;
    const int64_t n = lse2[r] == kNegInf ? 0 : visible(qpos[r], klo, nk);
    const float shift = lse2[r];
    v8f none0{}, none1{};  // no reduction wanted
    map_reduce(x, n, 0.0f, &none0, &none1, [c, shift](v8f v) { return exp2_v8(v * c - shift); },
               [](v8f r, v8f) { return r; });
    std::fill(x + n, x + nk, 0.0f);
  }
}

// ... on sixteen lanes, and with Sh, P in bf16 there too (row stride nk).
__attribute__((target("arch=x86-64-v4")))
void probabilities16(float* S, uint16_t* Sh, int64_t nq, int64_t nk, float c, const int32_t* qpos, int64_t klo,
                     const float* lse2) {
  for (int64_t r = 0; r < nq; ++r) {
    float* x = S + r * nk;
    uint16_t* xh = Sh ? Sh + r * nk : nullptr;
    const int64_t n = lse2[r] == kNegInf ? 0 : visible(qpos[r], klo, nk);
    probs16(x, n, c, lse2[r], xh);
    std::fill(x + n, x + nk, 0.0f);
    if (xh) std::fill(xh + n, xh + nk, uint16_t{0});
  }
}

// dS = scale P (dP - D) in place of dP, tiles (nq, nk).
OOMLESS_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
void score_grads(float* dP, const float* P, int64_t nq, int64_t nk, const float* dsum, float scale) {
  for (int64_t r = 0; r < nq; ++r) {
    float* g = dP + r * nk;
    const float* p = P + r * nk;
    const float dr = dsum[r];
    for (int64_t j = 0; j < nk; ++j) g[j] = scale * p[j] * (g[j] - dr);
  }
}

// ... into bf16 dS (dSh, row stride nk), dP left as it is.
__attribute__((target("arch=x86-64-v4")))
void score_grads16(const float* dP, const float* P, uint16_t* dSh, int64_t nq, int64_t nk, const float* dsum, float scale) {
  for (int64_t r = 0; r < nq; ++r) score_grads16_bf16(dP + r * nk, P + r * nk, nk, dsum[r], scale, dSh + r * nk);
}

// o /= l per row (o = 0 stays where nothing was seen); lse = ln 2 (m + log2 l), -inf for empty rows.
void finish_rows(float* O, int64_t ldo, int64_t D, int64_t nq, const float* m, const float* l, float* lse) {
  for (int64_t r = 0; r < nq; ++r) {
    if (m[r] == kNegInf) {
      lse[r] = kNegInf;
      continue;
    }
    const float inv = 1.0f / l[r];
    float* orow = O + r * ldo;
    for (int64_t d = 0; d < D; ++d) orow[d] *= inv;
    lse[r] = static_cast<float>(kLn2 * (static_cast<double>(m[r]) + std::log2(static_cast<double>(l[r]))));
  }
}

// A tile product's operand: f32 rows (f), or bf16 rows (h) when the products run on AMX tiles.
struct Opnd {
  const float* f = nullptr;
  const uint16_t* h = nullptr;
  int64_t ld = 0;
};

// c (M, N) [+]= op(a) . op(b) with explicit leading dimensions, single-threaded: AMX tiles for bf16 operands,
// else the f32 tile kernels. work: the AMX packing buffer.
void tile_gemm(int64_t M, int64_t N, int64_t K, bool ta, bool tb, Opnd a, Opnd b, float* c, int64_t ldc,
               bool accumulate, uint32_t* work) {
  GemmShape s{.M = M, .N = N, .K = K, .ta = ta, .tb = tb, .lda = a.ld, .ldb = b.ld, .ldc = ldc, .accumulate = accumulate};
  if (a.h) {
    s.ab = DType::bf16;
    return gemm_detail::tile_bf16_amx(s, a.h, b.h, c, work);
  }
  Gemm::tile(s, a.f, b.f, c);
}

// x[0, n) rounded to bf16 in place (bf16 products off amx) or into h (on amx).
void round_tile(float* x, int64_t n, uint16_t* h) {
  if (h) return convert(h, DType::bf16, x, DType::f32, n);
  for (int64_t i = 0; i < n; ++i) x[i] = round_to_bf16(x[i]);
}

// The key (values: false) or value rows (n, D) of key tile kt under kv head g: a pointer into the block when
// f32, else widened (bf16, or f8_e4m3 / int8 times the block's or the rows' scales) into buf.
const float* side_rows(const Ctx& x, const KeyTile& kt, int64_t g, int64_t n, bool values, float* buf) {
  const KvBlock& blk = x.kv->blocks[kt.block];
  const int64_t off = (g * x.P + kt.j0) * x.D;
  const void* src = values ? blk.v : blk.k;
  if (x.kv->dtype == DType::f32) return static_cast<const float*>(src) + off;
  const float* row_scale = values ? blk.v_rows : blk.k_rows;
  if (x.kv->dtype == DType::f8_e4m3) {
    static const std::array<float, 256> lut = [] {
      std::array<float, 256> t{};
      for (int c = 0; c < 256; ++c) t[static_cast<size_t>(c)] = f8e4m3_to_f32(static_cast<uint8_t>(c));
      return t;
    }();
    const uint8_t* c8 = static_cast<const uint8_t*>(src) + off;
    if (row_scale) {
      const float* sc = row_scale + g * x.P + kt.j0;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t d = 0; d < x.D; ++d) buf[i * x.D + d] = lut[c8[i * x.D + d]] * sc[i];
    } else {
      const float sc = values ? blk.v_scale : blk.k_scale;
      for (int64_t i = 0; i < n * x.D; ++i) buf[i] = lut[c8[i]] * sc;
    }
  } else if (x.kv->dtype == DType::i8) {
    const int8_t* c8 = static_cast<const int8_t*>(src) + off;
    const float* sc = row_scale + g * x.P + kt.j0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < x.D; ++d) buf[i * x.D + d] = static_cast<float>(c8[i * x.D + d]) * sc[i];
  } else {
    const uint16_t* h16 = static_cast<const uint16_t*>(src) + off;
    for (int64_t i = 0; i < n * x.D; ++i) buf[i] = bf16_to_f32(h16[i]);
  }
  return buf;
}

// The K and V rows (n, D) of key tile kt under kv head g (side_rows), into kbuf and vbuf where widened.
void key_rows(const Ctx& x, const KeyTile& kt, int64_t g, int64_t n, const float** K, const float** V, float* kbuf,
              float* vbuf) {
  *K = side_rows(x, kt, g, n, false, kbuf);
  *V = side_rows(x, kt, g, n, true, vbuf);
}

// Per-thread scratch of one task: score tiles and widened key tiles.
struct Tiles {
  float* s;   // (rows, kBk) scores (tile_rows), then probabilities
  float* ds;  // (rows, kBk) dP, then dS (backward)
  float* m;   // (rows) running max (forward)
  float* l;   // (rows) running sum (forward)
  float* k;   // (kBk, D) widened keys (narrow K/V, or rounded for bf16 products)
  float* v;   // (kBk, D) widened values
  uint16_t* kh;    // on amx: (kBk, D) keys in bf16 (K/V not bf16)
  uint16_t* vh;    // values
  uint16_t* sh;    // (kBq, kBk) P in bf16
  uint16_t* dsh;   // (kBq, kBk) dS in bf16
  uint32_t* work;  // tile_bf16_amx's packing buffer
  // x.tiles only (carve_tiles_amx): sh holds P (forward) or dS (backward) as bf16 rows, and
  uint16_t* sh2;   // (kBq, kBk) the backward's second dS (a tile's, until its dQ turn)
  uint32_t* pp;    // (kBq / 2, kBk) the pairs of P (backward)
  uint32_t* dsp;   // (kBq / 2, kBk) the pairs of dS
  uint32_t* kp;    // (D / 2, kBk) the keys' pairs transposed (the right side of Q K^T)
  uint32_t* vp;    // (kBk / 2, D) the values' pairs (P V; the backward: their pairs transposed, for dO V^T)
  uint32_t* kr;    // (kBk / 2, D) the keys' pairs (dS K)
  float* dkt;      // (D, kBk) the task's dK^T and dV^T sums
  float* dvt;
  float* opad;     // (kBq, D) O's or dQ's rows where a query tile is not whole 16-row tiles
  float* l16;      // (kBq, 16) the forward's running sums, sixteen lanes a row
};

int64_t amx_work_floats(int64_t D) {
  const int64_t big = std::max<int64_t>(kBk, D);
  return padded(static_cast<int64_t>(gemm_detail::amx_tile_words(std::max(kBq, kBk), big, big)));
}

// The query rows a task's tiles hold: kBq, or fewer where no task has more (T < kBq; a decode step under GQA:
// the group's heads), so that a decode step's scratch stays small (it is allocated every call). AMX keeps
// whole tiles.
int64_t tile_rows(int64_t T, int64_t H, int64_t Hkv, bool amx, bool backward) {
  if (amx) return kBq;
  const int64_t group = Hkv > 0 ? H / Hkv : 1;
  if (!backward && T == 1 && group > 1 && group <= kBq) return group;
  return std::min(kBq, T);
}

int64_t tiles_floats(int64_t D, bool widen, bool amx, int64_t rows) {
  return 2 * padded(rows * kBk) + 2 * padded(rows) + (widen ? 2 * padded(kBk * D) : 0) +
         (amx ? padded(kBk * D) + padded(kBq * kBk) + amx_work_floats(D) : 0);
}

Tiles carve_tiles(float* base, int64_t D, bool widen, bool amx, int64_t rows) {
  Tiles t{};
  t.s = base;
  t.ds = t.s + padded(rows * kBk);
  t.m = t.ds + padded(rows * kBk);
  t.l = t.m + padded(rows);
  float* p = t.l + padded(rows);
  if (widen) {
    t.k = p;
    t.v = t.k + padded(kBk * D);
    p = t.v + padded(kBk * D);
  }
  if (amx) {  // halves of floats: two bf16 key/value tiles, two bf16 score tiles, then the packing buffer
    t.kh = reinterpret_cast<uint16_t*>(p);
    t.vh = t.kh + padded(kBk * D);
    p += padded(kBk * D);
    t.sh = reinterpret_cast<uint16_t*>(p);
    t.dsh = t.sh + padded(kBq * kBk);
    p += padded(kBq * kBk);
    t.work = reinterpret_cast<uint32_t*>(p);
  }
  return t;
}

// Per-thread scratch under x.tiles: f32 S and dP (kBq, kBk), m and l, the widened key tile (fp8 / int8 K/V),
// bf16 rows of P or dS (two of dS), the pairs of P and dS, three packed key tiles, dK^T and dV^T, a (kBq, D) O, and l
// in sixteen lanes a row.
int64_t tiles_floats_amx(int64_t D, DType kv_dtype) {
  const bool widen = kv_dtype != DType::f32 && kv_dtype != DType::bf16;
  return 2 * padded(kBq * kBk) + 2 * padded(kBq) + (widen ? 2 * padded(kBk * D) : 0) + 4 * padded(kBq * kBk / 2) +
         3 * padded(kBk * D / 2) + 2 * padded(D * kBk) + padded(kBq * D) + padded(kBq * 16);
}

Tiles carve_tiles_amx(float* base, int64_t D, DType kv_dtype) {
  const bool widen = kv_dtype != DType::f32 && kv_dtype != DType::bf16;
  Tiles t{};
  float* p = base;
  auto take = [&p](int64_t n) {
    float* r = p;
    p += padded(n);
    return r;
  };
  t.s = take(kBq * kBk);
  t.ds = take(kBq * kBk);
  t.m = take(kBq);
  t.l = take(kBq);
  if (widen) {
    t.k = take(kBk * D);
    t.v = take(kBk * D);
  }
  t.sh = reinterpret_cast<uint16_t*>(take(kBq * kBk / 2));
  t.sh2 = reinterpret_cast<uint16_t*>(take(kBq * kBk / 2));
  t.pp = reinterpret_cast<uint32_t*>(take(kBq * kBk / 2));
  t.dsp = reinterpret_cast<uint32_t*>(take(kBq * kBk / 2));
  t.kp = reinterpret_cast<uint32_t*>(take(kBk * D / 2));
  t.vp = reinterpret_cast<uint32_t*>(take(kBk * D / 2));
  t.kr = reinterpret_cast<uint32_t*>(take(kBk * D / 2));
  t.dkt = take(D * kBk);
  t.dvt = take(D * kBk);
  t.opad = take(kBq * D);
  t.l16 = take(kBq * 16);
  return t;
}

// The K and V operands (n, D) of key tile kt under kv head g: f32 as key_rows gives them; with bf16 products
// rounded (off amx, in w.k / w.v) or in bf16 (on amx: bf16 pages as they are, else rounded into w.kh / w.vh).
void key_operands(const Ctx& x, const KeyTile& kt, int64_t g, int64_t n, const Tiles& w, Opnd* K, Opnd* V) {
  K->ld = V->ld = x.D;
  const int64_t off = (g * x.P + kt.j0) * x.D;
  if (x.amx && x.kv->dtype == DType::bf16) {
    const KvBlock& blk = x.kv->blocks[kt.block];
    K->h = static_cast<const uint16_t*>(blk.k) + off;
    V->h = static_cast<const uint16_t*>(blk.v) + off;
    return;
  }
  if (x.kvh) {
    const int64_t side = x.Hkv * x.P * x.D;
    K->h = x.kvh + 2 * kt.block * side + off;
    V->h = K->h + side;
    return;
  }
  key_rows(x, kt, g, n, &K->f, &V->f, w.k, w.v);
  if (!x.bf16 || x.kv->dtype == DType::bf16) return;  // bf16 pages widen exactly
  if (x.amx) {
    convert(w.kh, DType::bf16, K->f, DType::f32, n * x.D);
    convert(w.vh, DType::bf16, V->f, DType::f32, n * x.D);
    K->h = w.kh, V->h = w.vh, K->f = V->f = nullptr;
    return;
  }
  if (K->f != w.k) {  // f32 pages: copied before rounding
    std::memcpy(w.k, K->f, sizeof(float) * n * x.D);
    std::memcpy(w.v, V->f, sizeof(float) * n * x.D);
  }
  round_tile(w.k, n * x.D, nullptr);
  round_tile(w.v, n * x.D, nullptr);
  K->f = w.k, V->f = w.v;
}

// Under x.tiles, the first n keys (values: false) or values of key tile kt under kv head g, packed for the
// tiles: their pairs transposed (out: (D / 2, npad), row stride ldo words) or their pairs ((npad / 2, D)),
// keys n to npad zero. bf16 and f32 pages are read as they are; narrower ones widened into buf first.
void pack_side(const Ctx& x, const KeyTile& kt, int64_t g, int64_t n, bool values, bool transposed, int64_t npad,
               uint32_t* out, int64_t ldo, float* buf) {
  const KvBlock& blk = x.kv->blocks[kt.block];
  const int64_t off = (g * x.P + kt.j0) * x.D;
  const void* src = values ? blk.v : blk.k;
  auto pack = [&](const auto* rows) {
    if (transposed) attn_amx::pack_t(rows, x.D, n, x.D, npad, out, ldo);
    else attn_amx::pack_rows(rows, x.D, n, x.D, npad, out);
  };
  if (x.kv->dtype == DType::bf16) return pack(static_cast<const uint16_t*>(src) + off);
  if (x.kv->dtype == DType::f32) return pack(static_cast<const float*>(src) + off);
  pack(side_rows(x, kt, g, n, values, buf));
}

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// The rows of q or dout at row r0 under head h, as the products read them.
Opnd q_rows(const Ctx& x, const float* f32, const float* rounded, const uint16_t* h16, int64_t r0, int64_t h) {
  const int64_t off = r0 * x.ldq + h * x.D;
  Opnd o;
  o.ld = x.ldq;
  if (x.amx) o.h = h16 + off;
  else o.f = (x.bf16 ? rounded : f32) + off;
  return o;
}

// A score tile (n elements, row stride nk) as a product's operand: as it is, rounded in place, or in bf16.
Opnd score_operand(const Ctx& x, float* t, uint16_t* h, int64_t n, int64_t nk) {
  Opnd o;
  o.ld = nk;
  if (x.bf16) round_tile(t, n, x.amx ? h : nullptr);
  if (x.amx) o.h = h;
  else o.f = t;
  return o;
}

int64_t count_key_tiles(const KvBlocks& kv) {
  int64_t n = 0;
  for (int64_t b = 0; b < kv.n_blocks; ++b) n += (kv.blocks[b].len + kBk - 1) / kBk;
  return n;
}

void fill_key_tiles(KeyTile* out, const KvBlocks& kv) {
  for (int64_t b = 0; b < kv.n_blocks; ++b) {
    const KvBlock& blk = kv.blocks[b];
    for (int64_t j0 = 0; j0 < blk.len; j0 += kBk)
      *out++ = KeyTile{b, j0, std::min<int64_t>(kBk, blk.len - j0), static_cast<int64_t>(blk.start) + j0};
  }
}

void fill_query_tiles(QueryTile* out, const int32_t* pos, int64_t T) {
  for (int64_t r0 = 0; r0 < T; r0 += kBq) {
    QueryTile qt{r0, std::min(kBq, T - r0), std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()};
    for (int64_t r = r0; r < r0 + qt.n; ++r) {
      qt.lo = std::min<int64_t>(qt.lo, pos[r]);
      qt.hi = std::max<int64_t>(qt.hi, pos[r]);
    }
    *out++ = qt;
  }
}

// One workspace allocation: the tile tables, `extra` floats of shared arrays, and per-thread tiles.
struct Scratch {
  Buffer buf;
  KeyTile* kt;
  QueryTile* qt;
  float* extra;
  float* tiles;
  int64_t tile_floats;
};

int64_t scratch_bytes(int64_t n_kt, int64_t n_qt, int64_t extra_floats, int64_t tile_floats) {
  const int threads = std::max(1, omp_get_max_threads());
  const int64_t kt_bytes = (n_kt * static_cast<int64_t>(sizeof(KeyTile)) + 63) / 64 * 64;
  const int64_t qt_bytes = (n_qt * static_cast<int64_t>(sizeof(QueryTile)) + 63) / 64 * 64;
  return kt_bytes + qt_bytes + 4 * (padded(extra_floats) + threads * tile_floats);
}

Scratch make_scratch(CpuOps& ops, int64_t n_kt, int64_t n_qt, int64_t extra_floats, int64_t tile_floats) {
  const int64_t kt_bytes = (n_kt * static_cast<int64_t>(sizeof(KeyTile)) + 63) / 64 * 64;
  const int64_t qt_bytes = (n_qt * static_cast<int64_t>(sizeof(QueryTile)) + 63) / 64 * 64;
  Scratch s;
  s.buf = ops.scratch(static_cast<size_t>(scratch_bytes(n_kt, n_qt, extra_floats, tile_floats)), "attention");
  char* p = s.buf.as<char>();
  s.kt = reinterpret_cast<KeyTile*>(p);
  s.qt = reinterpret_cast<QueryTile*>(p + kt_bytes);
  s.extra = reinterpret_cast<float*>(p + kt_bytes + qt_bytes);
  s.tiles = s.extra + padded(extra_floats);
  s.tile_floats = tile_floats;
  return s;
}

Ctx make_ctx(const AttentionDims& dims, const Tensor& q, const Tensor& o, const Tensor& lse, const KvBlocks& kv,
             const Tensor& q_pos, double scale) {
  Ctx x{};
  x.T = dims.T;
  x.H = dims.H;
  x.Hkv = dims.Hkv;
  x.D = dims.D;
  x.P = kv.P;
  x.group = dims.H / dims.Hkv;
  x.ldq = dims.H * dims.D;
  x.q = static_cast<const float*>(q.data);
  x.pos = static_cast<const int32_t*>(q_pos.data);
  x.o = static_cast<float*>(o.data);
  x.lse = static_cast<float*>(lse.data);
  x.kv = &kv;
  x.c = static_cast<float>(scale * kLog2e);
  x.scale = static_cast<float>(scale);
  x.bf16 = kv.bf16_products;
  x.amx = x.bf16 && gemm_isa() == GemmIsa::amx;
  x.lanes16 = gemm_isa() == GemmIsa::avx512 || gemm_isa() == GemmIsa::amx;
  x.tiles = tiles_ok(x.amx, x.D);
  return x;
}

// Floats of scratch for one (T, ldq) operand copy under bf16 products (none without).
// On amx the rows go on, zero, to a whole last query tile (the tiles read 16 or 32 rows at a time).
int64_t operand_floats(int64_t T, int64_t ldq, bool bf16, bool amx) {
  if (!bf16) return 0;
  return padded(amx ? (round_up(T, kBq) * ldq + 1) / 2 : T * ldq);
}
int64_t operand_floats(const Ctx& x) { return operand_floats(x.T, x.ldq, x.bf16, x.amx); }

// Under bf16 products, src (T, ldq) rounded into dst: bf16 values in f32 (*rounded) or bf16 (*h16, on amx).
void round_rows(Ctx* x, const float* src, float* dst, const float** rounded, const uint16_t** h16) {
  if (!x->bf16) return;
  const int64_t n = x->T * x->ldq;
  constexpr int64_t kChunk = 1 << 14;
  uint16_t* h = reinterpret_cast<uint16_t*>(dst);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < (n + kChunk - 1) / kChunk; ++c) {
    const int64_t i0 = c * kChunk, len = std::min(kChunk, n - i0);
    if (x->amx) {
      // Under the tiles by the hardware's conversion: it reads f32 denormals as zero, which the tiles read
      // as zero from f32_to_bf16's bf16 denormals as well, so every product is the same.
      if (x->tiles) attn_amx::to_bf16(h + i0, src + i0, len);
      else convert(h + i0, DType::bf16, src + i0, DType::f32, len);
    } else {
      for (int64_t i = i0; i < i0 + len; ++i) dst[i] = round_to_bf16(src[i]);
    }
  }
  if (x->amx) {
    std::fill(h + n, h + round_up(x->T, kBq) * x->ldq, uint16_t{0});
    *h16 = h;
  } else {
    *rounded = dst;
  }
}

// Under bf16 products on amx, f32 K/V whose keys number no more than the queries (Hkv x blocks x P <= H x T,
// as in full-sequence attention) are converted to bf16 once per forward call, not per key tile of every
// (query tile, head) task: the floats of that copy (0 where it is not made). The same values either way.
int64_t kv_once_floats(int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t n_blocks, int64_t P, DType kv_dtype,
                       bool amx) {
  if (!amx || kv_dtype != DType::f32 || Hkv * n_blocks * P > H * T) return 0;
  return padded(n_blocks * Hkv * P * D);  // 2 n_blocks Hkv P D halves
}

// Under the tiles, a forward call whose keys number no more than its queries (the rule of kv_once_floats)
// packs every (key tile, kv head) once, for all the query tiles and heads that read it: the floats of those
// packs (0 where each task packs its own: a decode step, or a long history beside few queries).
int64_t kv_pack_floats(int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t n_blocks, int64_t P, int64_t n_kt,
                       bool tiles, bool decode) {
  if (!tiles || decode || Hkv * n_blocks * P > H * T) return 0;
  return padded(n_kt * Hkv * kBk * D);  // two (kBk D / 2)-word packs a (key tile, kv head)
}

// The backward's shared floats: lse in base 2 and D (H, T), the rounded q and dout (`rows` each), the dQ
// turns as int32: the counters (H, n_qt) and each key tile's turn per query tile (n_kt, n_qt); under the
// tiles, q and dout transposed per (head, query tile).
int64_t backward_extra_floats(int64_t T, int64_t H, int64_t D, int64_t n_kt, int64_t n_qt, int64_t rows, bool tiles) {
  return 2 * padded(H * T) + 2 * rows + padded(H * n_qt) + padded(n_kt * n_qt) +
         (tiles ? 2 * padded(H * n_qt * D * kBq / 2) : 0);
}

// ---- tasks ------------------------------------------------------------------------------------------

// Keys of tile kt that some query of tile qt can see: the first n of the tile (0 when none).
int64_t visible_keys(const KeyTile& kt, const QueryTile& qt) {
  return kt.lo > qt.hi ? 0 : std::min(kt.n, qt.hi - kt.lo + 1);
}

// forward_rows under x.tiles: 16-row tiles of Q read in place (rows past nq are the next rows or the zero
// padding of round_rows, and their outputs are dropped), key tiles packed once per call (x.kvp) or here;
// O's rows through w.opad where nq is not a multiple of 16.
void forward_rows_tiles(const Ctx& x, int64_t g, const QueryTile& qt, const uint16_t* Q, int64_t ldq, int64_t nq,
                        const int32_t* qpos, float* O, int64_t ldo, float* lse, const Tiles& w) {
  const int64_t rows = round_up(nq, 16), D = x.D;
  float* Ow = O;
  int64_t ldw = ldo;
  if (rows != nq) Ow = w.opad, ldw = D;
  for (int64_t r = 0; r < rows; ++r) {
    std::fill(Ow + r * ldw, Ow + r * ldw + D, 0.0f);
    w.m[r] = kNegInf;
  }
  std::fill(w.l16, w.l16 + 16 * rows, 0.0f);
  attn_amx::begin();
  for (int64_t i = 0; i < x.n_kt; ++i) {
    const KeyTile& kt = x.kt[i];
    const int64_t nk = visible_keys(kt, qt);
    if (nk == 0) continue;
    const int64_t np = round_up(nk, 32);
    const uint32_t *kp = w.kp, *vp = w.vp;
    int64_t ldk = np;
    if (x.kvp) {
      kp = x.kvp + (i * x.Hkv + g) * kBk * D;
      vp = kp + kBk * D / 2;
      ldk = round_up(kt.n, 32);
    } else {
      pack_side(x, kt, g, nk, false, true, np, w.kp, np, w.k);
      pack_side(x, kt, g, nk, true, false, np, w.vp, 0, w.v);
    }
    attn_amx::product(Q, ldq, kp, ldk, w.s, np, rows, np, D, false);  // S = Q K^T
    attn_amx::softmax_rows(w.s, w.sh, nq, rows, np, nk, x.c, qpos, kt.lo, w.m, w.l16, Ow, ldw, D);
    attn_amx::product(w.sh, np, vp, D, Ow, ldw, rows, D, np, true);  // O += P V
  }
  attn_amx::end();
  attn_amx::fold_sums(w.l16, nq, w.l);
  finish_rows(Ow, ldw, D, nq, w.m, w.l, lse);
  if (Ow != O)
    for (int64_t r = 0; r < nq; ++r) std::memcpy(O + r * ldo, Ow + r * ldw, sizeof(float) * D);
}

// Forward over nq rows that share kv head g and query tile qt's visible keys: Q's rows (row stride Q.ld),
// their positions, O's rows (stride ldo) and their lse (consecutive).
void forward_rows(const Ctx& x, int64_t g, const QueryTile& qt, Opnd Q, int64_t nq, const int32_t* qpos, float* O,
                  int64_t ldo, float* lse, const Tiles& w) {
  if (x.tiles) return forward_rows_tiles(x, g, qt, Q.h, Q.ld, nq, qpos, O, ldo, lse, w);
  for (int64_t r = 0; r < nq; ++r) {
    std::fill(O + r * ldo, O + r * ldo + x.D, 0.0f);
    w.m[r] = kNegInf;
    w.l[r] = 0.0f;
  }
  for (int64_t i = 0; i < x.n_kt; ++i) {
    const KeyTile& kt = x.kt[i];
    const int64_t nk = visible_keys(kt, qt);
    if (nk == 0) continue;
    Opnd K, V;
    key_operands(x, kt, g, nk, w, &K, &V);
    tile_gemm(nq, nk, x.D, false, true, Q, K, w.s, nk, false, w.work);  // S = Q K^T
    Opnd P;
    if (x.lanes16) {  // on amx, P goes straight to bf16
      online_softmax16(w.s, x.amx ? w.sh : nullptr, nq, nk, x.c, qpos, kt.lo, w.m, w.l, O, ldo, x.D);
      P = x.amx ? Opnd{.h = w.sh, .ld = nk} : score_operand(x, w.s, w.sh, nq * nk, nk);
    } else {
      online_softmax(w.s, nq, nk, x.c, qpos, kt.lo, w.m, w.l, O, ldo, x.D);
      P = score_operand(x, w.s, w.sh, nq * nk, nk);
    }
    tile_gemm(nq, x.D, nk, false, false, P, V, O, ldo, true, w.work);  // O += P V
  }
  finish_rows(O, ldo, x.D, nq, w.m, w.l, lse);
}

void forward_task(const Ctx& x, int64_t h, const QueryTile& qt, const Tiles& w) {
  forward_rows(x, h / x.group, qt, q_rows(x, x.q, x.qr, x.qh, qt.r0, h), qt.n, x.pos + qt.r0,
               x.o + qt.r0 * x.ldq + h * x.D, x.ldq, x.lse + h * x.T + qt.r0, w);
}

// One position (a decode step) under GQA: kv head g's query heads are the rows of one task, so each key tile
// is read once for the group instead of once per head. Row for row the same products and softmax as
// forward_task's (each output's sums do not depend on the other rows of a tile): the same bits.
void decode_group_task(const Ctx& x, int64_t g, const Tiles& w) {
  int32_t qpos[kBq];
  std::fill(qpos, qpos + x.group, x.pos[0]);
  Opnd Q = q_rows(x, x.q, x.qr, x.qh, 0, g * x.group);
  Q.ld = x.D;  // T = 1: the group's heads are consecutive D-wide rows
  forward_rows(x, g, x.qt[0], Q, x.group, qpos, x.o + g * x.group * x.D, x.D, x.lse + g * x.group, w);
}

// ---- a decode step's tile products, without packing ----------------------------------------------
// Gemm::tile packs the key tile into panels (the keys transposed) and runs a few query rows against it, and
// its one-strip P V keeps three chains of fused multiply-adds in flight (one 16-column panel at a time): for
// a decode step's two or three rows both leave the core waiting (together most of the step's attention).
// These kernels compute the same chains (each output's fused multiply-adds in ascending k from 0, K within
// one k block of Gemm::tile: the same bits) with more of them in flight and nothing packed: the scores take
// sixteen keys at a time, their 8 x 8 pieces transposed in registers; P V takes 32 value columns at a time
// for every row. T: float, or uint16_t for bf16 K/V (widened exactly as they load). AVX2 + FMA (eight
// lanes; on AVX-512 CPUs too: these are bound by the cache's bytes, not by the vector width).

// Eight keys' chains (R rows) over one 8-wide slice of D: their 8 x 8 piece transposed, then 8 FMAs a row.
template <class T, int R>
__attribute__((target("avx2,fma"), always_inline)) inline void score_slice(const float* q, int64_t ldq, const T* k8,
                                                                          int64_t D, int64_t d0, __m256* acc) {
  __m256 rows[8], cols[8];
  for (int i = 0; i < 8; ++i) rows[i] = gemm_detail::load8(k8 + i * D + d0);
  gemm_detail::transpose8(rows, cols);
  for (int k = 0; k < 8; ++k)
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(q + r * ldq + d0 + k), cols[k], acc[r]);
}

// S (R rows, n; row stride lds) = Q (R rows, row stride ldq) K^T for the n key rows K (row stride D).
// D: a multiple of 8.
template <class T, int R>
__attribute__((target("avx2,fma"))) void scores_direct_rows(const float* q, int64_t ldq, const T* K, int64_t n,
                                                            int64_t D, float* S, int64_t lds) {
  int64_t j0 = 0;
  for (; j0 + 16 <= n; j0 += 16) {  // two groups of eight keys, their chains interleaved
    __m256 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
    const T* k8 = K + j0 * D;
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      score_slice<T, R>(q, ldq, k8, D, d0, a0);
      score_slice<T, R>(q, ldq, k8 + 8 * D, D, d0, a1);
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(S + r * lds + j0, a0[r]);
      _mm256_storeu_ps(S + r * lds + j0 + 8, a1[r]);
    }
  }
  for (; j0 + 8 <= n; j0 += 8) {
    __m256 a0[R];
    for (int r = 0; r < R; ++r) a0[r] = _mm256_setzero_ps();
    for (int64_t d0 = 0; d0 < D; d0 += 8) score_slice<T, R>(q, ldq, K + j0 * D, D, d0, a0);
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(S + r * lds + j0, a0[r]);
  }
  for (; j0 < n; ++j0)  // the last n % 8 keys: the same chains one at a time
    for (int r = 0; r < R; ++r) {
      float c = 0.0f;
      for (int64_t d = 0; d < D; ++d) c = __builtin_fmaf(q[r * ldq + d], gemm_detail::widen(K[j0 * D + d]), c);
      S[r * lds + j0] = c;
    }
}

// C (R rows, W * 8 columns; row stride ldc) = P (R rows, n; row stride ldp) V (n rows, row stride ldv).
template <class T, int R, int W>
__attribute__((target("avx2,fma"))) void pv_direct_cols(const float* p, int64_t ldp, const T* V, int64_t ldv, int64_t n,
                                                        float* C, int64_t ldc) {
  __m256 acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) acc[r][w] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m256 v[W];
    for (int w = 0; w < W; ++w) v[w] = gemm_detail::load8(V + j * ldv + 8 * w);
    for (int r = 0; r < R; ++r) {
      const __m256 pj = _mm256_broadcast_ss(p + r * ldp + j);
      for (int w = 0; w < W; ++w) acc[r][w] = _mm256_fmadd_ps(pj, v[w], acc[r][w]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(C + r * ldc + 8 * w, acc[r][w]);
}

// The same with sixteen columns a vector (each column's chain is the same: the same bits), W * 16 columns.
#define OOMLESS_PV512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
OOMLESS_PV512 inline __m512 load16v(const float* p) { return _mm512_loadu_ps(p); }
OOMLESS_PV512 inline __m512 load16v(const uint16_t* p) {  // bf16 widened (vector extensions: GCC 12 warns on
  v16h h;                                                    // the intrinsics' undefined operand)
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<__m512>(__builtin_convertvector(h, v16u) << 16);
}
template <class T, int R, int W>
OOMLESS_PV512 void pv_direct_cols16(const float* p, int64_t ldp, const T* V, int64_t ldv, int64_t n, float* C,
                                    int64_t ldc) {
  __m512 acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) acc[r][w] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 v[W];
    for (int w = 0; w < W; ++w) v[w] = load16v(V + j * ldv + 16 * w);
    for (int r = 0; r < R; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * ldp + j]);
      for (int w = 0; w < W; ++w) acc[r][w] = _mm512_fmadd_ps(pj, v[w], acc[r][w]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) _mm512_storeu_ps(C + r * ldc + 16 * w, acc[r][w]);
}

// ... over all D columns (a multiple of 8): 64 at a time where the GEMM path is AVX-512's, then 32 at a time.
template <class T, int R>
void pv_direct_rows(const float* p, int64_t ldp, const T* V, int64_t n, int64_t D, float* C, int64_t ldc) {
  int64_t d0 = 0;
  if (gemm_isa() == GemmIsa::avx512 || gemm_isa() == GemmIsa::amx)
    for (; d0 + 64 <= D; d0 += 64) pv_direct_cols16<T, R, 4>(p, ldp, V + d0, D, n, C + d0, ldc);
  for (; d0 + 32 <= D; d0 += 32) pv_direct_cols<T, R, 4>(p, ldp, V + d0, D, n, C + d0, ldc);
  switch ((D - d0) / 8) {
    case 3: return pv_direct_cols<T, R, 3>(p, ldp, V + d0, D, n, C + d0, ldc);
    case 2: return pv_direct_cols<T, R, 2>(p, ldp, V + d0, D, n, C + d0, ldc);
    case 1: return pv_direct_cols<T, R, 1>(p, ldp, V + d0, D, n, C + d0, ldc);
    default: return;
  }
}

// set_decode_direct_kernels' switch (cpu_ops.h).
bool& direct_switch() {
  static bool on = [] {
    const char* e = std::getenv("OOMLESS_DECODE_DIRECT");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
}

// Whether the direct kernels run and give Gemm::tile's bits here: switched on, a GEMM path with the AVX2 + FMA
// kernels (the AVX-512 ones add the same chains), K/V in f32 or bf16, D a multiple of 8 in one k block, key
// tiles in one.
bool decode_direct_ok(const Ctx& x) {
  static_assert(kBk <= 256, "P V's k (a key tile) must stay within one k block of Gemm::tile");
  return direct_switch() && gemm_isa() != GemmIsa::generic && x.D % 8 == 0 && x.D <= 256 &&
         (x.kv->dtype == DType::f32 || x.kv->dtype == DType::bf16);
}

// Calls f.template operator()<T, R>(...) for kv dtype f32/bf16 and R = 1..4 rows.
template <class F>
void with_rows(DType dt, int64_t R, F&& f) {
  auto rows = [&]<class T>(T tag) {
    if (R == 4) f.template operator()<T, 4>(tag);
    else if (R == 3) f.template operator()<T, 3>(tag);
    else if (R == 2) f.template operator()<T, 2>(tag);
    else f.template operator()<T, 1>(tag);
  };
  if (dt == DType::f32) rows(float{});
  else rows(uint16_t{});
}

// S (G, nk; row stride nk) for key tile kt under kv head g and the G query rows at q (row stride D), four
// rows at a time.
void scores_direct(const Ctx& x, const KeyTile& kt, int64_t g, int64_t nk, const float* q, int64_t G, float* S) {
  const KvBlock& blk = x.kv->blocks[kt.block];
  const int64_t off = (g * x.P + kt.j0) * x.D;
  for (int64_t r0 = 0; r0 < G; r0 += 4)
    with_rows(x.kv->dtype, std::min<int64_t>(4, G - r0), [&]<class T, int R>(T) {
      scores_direct_rows<T, R>(q + r0 * x.D, x.D, static_cast<const T*>(blk.k) + off, nk, x.D, S + r0 * nk, nk);
    });
}

// C (G, D) = P V for key tile kt under kv head g, P (G, nk; row stride nk), three rows at a time (twelve
// chains of eight columns in flight).
void pv_direct(const Ctx& x, const KeyTile& kt, int64_t g, int64_t nk, const float* P, int64_t G, float* C) {
  const KvBlock& blk = x.kv->blocks[kt.block];
  const int64_t off = (g * x.P + kt.j0) * x.D;
  for (int64_t r0 = 0; r0 < G; r0 += 3)
    with_rows(x.kv->dtype, std::min<int64_t>(3, G - r0), [&]<class T, int R>(T) {
      if constexpr (R <= 3)
        pv_direct_rows<T, R>(P + r0 * nk, nk, static_cast<const T*>(blk.v) + off, nk, x.D, C + r0 * x.D, x.D);
    });
}

// A decode step's attention with f32 products, every KV head's key tiles spread over the threads, in four
// phases that give decode_group_task's bits: (A) each (KV head, key tile)'s scores S = Q K^T; (B) per query
// head, online_softmax over its tiles in order, turning each S into P and recording, instead of rescaling
// O, the factor it would have applied to O at that tile (a one-wide row that starts at 1); (C) each tile's
// product P V from zero (the chain decode_group_task adds to O); (D) per query head, O = O * factor + chain
// tile by tile in order, as the accumulating tile product does, then finish_rows. (A) and (C) take the
// direct kernels where decode_direct_ok, Gemm::tile elsewhere; (B) and (D) go a query head at a time (a
// row's softmax and sums do not involve the others), so more threads than KV heads share them. The scores, chains and
// factors live in `split` (decode_split_floats).
int64_t decode_split_floats(int64_t Hkv, int64_t n_kt, int64_t group, int64_t D) {
  const int64_t tiles = Hkv * n_kt * group;
  return padded(tiles * kBk) + padded(tiles * D) + padded(tiles) + 2 * padded(Hkv * group);
}

void decode_split(const Ctx& x, float* split, float* tiles, int64_t tile_floats, bool widen, int64_t trows) {
  const int64_t G = x.group, nt = x.n_kt, D = x.D, units = x.Hkv * nt;
  float* S = split;                      // (Hkv, nt, G, kBk)
  float* C = S + padded(units * G * kBk);  // (Hkv, nt, G, D)
  float* F = C + padded(units * G * D);    // (Hkv, nt, G) the factors
  float* M = F + padded(units * G);        // (Hkv, G) running max, then sum
  float* L = M + padded(x.Hkv * G);
  const QueryTile& qt = x.qt[0];
  const bool direct = decode_direct_ok(x);
  int32_t qpos[kBq];
  std::fill(qpos, qpos + G, x.pos[0]);
#pragma omp parallel
  {
    const Tiles w = carve_tiles(tiles + omp_get_thread_num() * tile_floats, D, widen, false, trows);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) {  // (A)
      const int64_t g = u / nt;
      const KeyTile& kt = x.kt[u % nt];
      const int64_t nk = visible_keys(kt, qt);
      if (nk == 0) continue;
      Opnd K, Q = q_rows(x, x.q, x.qr, x.qh, 0, g * G);
      Q.ld = K.ld = D;
      if (direct) {
        scores_direct(x, kt, g, nk, Q.f, G, S + u * G * kBk);
        continue;
      }
      K.f = side_rows(x, kt, g, nk, false, w.k);  // the keys only
      tile_gemm(G, nk, D, false, true, Q, K, S + u * G * kBk, nk, false, w.work);
    }
#pragma omp for schedule(static)
    for (int64_t hr = 0; hr < x.Hkv * G; ++hr) {  // (B), a query head at a time (its rows do not mix)
      const int64_t g = hr / G, r = hr % G;
      float* m = M + hr;
      float* l = L + hr;
      *m = kNegInf;
      *l = 0.0f;
      for (int64_t i = 0; i < nt; ++i) {
        const KeyTile& kt = x.kt[i];
        const int64_t nk = visible_keys(kt, qt), u = g * nt + i;
        if (nk == 0) continue;
        F[u * G + r] = 1.0f;
        online_softmax(S + u * G * kBk + r * nk, 1, nk, x.c, qpos, kt.lo, m, l, F + u * G + r, 1, 1);
      }
    }
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) {  // (C)
      const int64_t g = u / nt;
      const KeyTile& kt = x.kt[u % nt];
      const int64_t nk = visible_keys(kt, qt);
      if (nk == 0) continue;
      if (direct) {
        pv_direct(x, kt, g, nk, S + u * G * kBk, G, C + u * G * D);
        continue;
      }
      Opnd V, P;
      V.f = side_rows(x, kt, g, nk, true, w.v);  // the values only
      V.ld = D;
      P.f = S + u * G * kBk;
      P.ld = nk;
      tile_gemm(G, D, nk, false, false, P, V, C + u * G * D, D, false, w.work);
    }
#pragma omp for schedule(static)
    for (int64_t hr = 0; hr < x.Hkv * G; ++hr) {  // (D), a query head at a time
      const int64_t g = hr / G, r = hr % G;
      float* orow = x.o + hr * D;
      std::fill(orow, orow + D, 0.0f);
      for (int64_t i = 0; i < nt; ++i) {
        const int64_t u = g * nt + i;
        if (visible_keys(x.kt[i], qt) == 0) continue;
        const float* c = C + (u * G + r) * D;
        if (const float alpha = F[u * G + r]; alpha != 1.0f)
          for (int64_t d = 0; d < D; ++d) orow[d] *= alpha;
        for (int64_t d = 0; d < D; ++d) orow[d] = orow[d] + c[d];
      }
      finish_rows(orow, D, D, 1, M + hr, L + hr, x.lse + hr);
    }
  }
}

// S, P and dS of one (query tile, key tile) pair under head h into w.s (P) and w.ds (dS).
// With bf16 products, P and dS are rounded after dS is computed from the fp32 P; *P and *dS are the operands.
void recompute_scores(const Ctx& x, int64_t h, const QueryTile& qt, const KeyTile& kt, int64_t nk, Opnd K, Opnd V,
                      const Tiles& w, Opnd* P, Opnd* dS) {
  const Opnd Q = q_rows(x, x.q, x.qr, x.qh, qt.r0, h);
  const Opnd dO = q_rows(x, x.dout, x.dr, x.dh, qt.r0, h);
  const float* lse2 = x.lse2 + h * x.T + qt.r0;
  const float* dsum = x.dsum + h * x.T + qt.r0;
  const bool fused = x.amx && x.lanes16;  // P and dS straight to bf16 as they are made
  tile_gemm(qt.n, nk, x.D, false, true, Q, K, w.s, nk, false, w.work);    // S = Q K^T
  if (x.lanes16) probabilities16(w.s, fused ? w.sh : nullptr, qt.n, nk, x.c, x.pos + qt.r0, kt.lo, lse2);
  else probabilities(w.s, qt.n, nk, x.c, x.pos + qt.r0, kt.lo, lse2);
  tile_gemm(qt.n, nk, x.D, false, true, dO, V, w.ds, nk, false, w.work);  // dP = dO V^T
  if (fused) {
    score_grads16(w.ds, w.s, w.dsh, qt.n, nk, dsum, x.scale);
    *P = Opnd{.h = w.sh, .ld = nk};
    *dS = Opnd{.h = w.dsh, .ld = nk};
    return;
  }
  score_grads(w.ds, w.s, qt.n, nk, dsum, x.scale);
  *P = score_operand(x, w.s, w.sh, qt.n * nk, nk);
  *dS = score_operand(x, w.ds, w.dsh, qt.n * nk, nk);
}

// Waits until the dQ tile's counter reaches `turn`: spinning a while, then yielding the core (a thread that
// waits for one that is not running, on a loaded machine, must not keep it off the CPU).
void wait_turn(int32_t* done, int32_t turn) {
  std::atomic_ref<int32_t> c(*done);
  for (int spins = 0; c.load(std::memory_order_acquire) != turn; ++spins) {
    if (spins < 4096) _mm_pause();
    else sched_yield();
  }
}

void kv_grad_task(const Ctx& x, int64_t g, int64_t ki, const Tiles& w) {
  const KeyTile& kt = x.kt[ki];
  const KvBlock& dblk = x.dkv->blocks[kt.block];
  const int64_t off = (g * x.P + kt.j0) * x.D;
  float* dK = static_cast<float*>(dblk.k) + off;
  float* dV = static_cast<float*>(dblk.v) + off;
  Opnd K, V;
  key_operands(x, kt, g, kt.n, w, &K, &V);
  for (int64_t h = g * x.group; h < (g + 1) * x.group; ++h) {
    for (int64_t i = 0; i < x.n_qt; ++i) {
      const QueryTile& qt = x.qt[i];
      const int64_t nk = visible_keys(kt, qt);
      if (nk == 0) continue;
      const Opnd Q = q_rows(x, x.q, x.qr, x.qh, qt.r0, h);
      const Opnd dO = q_rows(x, x.dout, x.dr, x.dh, qt.r0, h);
      Opnd P, dS;
      recompute_scores(x, h, qt, kt, nk, K, V, w, &P, &dS);
      tile_gemm(nk, x.D, qt.n, true, false, P, dO, dV, x.D, true, w.work);   // dV += P^T dO
      tile_gemm(nk, x.D, qt.n, true, false, dS, Q, dK, x.D, true, w.work);   // dK += dS^T Q
      int32_t* done = x.dq_done + h * x.n_qt + i;
      wait_turn(done, x.dq_turn[ki * x.n_qt + i]);
      tile_gemm(qt.n, x.D, nk, false, false, dS, K, x.dq + qt.r0 * x.ldq + h * x.D, x.ldq, true, w.work);  // dQ += dS K
      std::atomic_ref<int32_t>(*done).fetch_add(1, std::memory_order_release);
    }
  }
}

// kv_grad_task under x.tiles: the key tile packed three ways once (K^T and V^T pairs for S and dP, K's pairs
// for dS K), dK^T and dV^T summed in w.dkt / w.dvt over the group's heads and the query tiles in order
// (dV^T += dO^T P, dK^T += Q^T dS: q and dout transposed once per call, P and dS as pairs), then added to
// dK and dV. Query tiles go in whole 32-row tiles (the rows past a tail tile's are zero in every operand);
// a tail tile's dQ rows through w.opad.
void kv_grad_task_tiles(const Ctx& x, int64_t g, int64_t ki, const Tiles& w) {
  const KeyTile& kt = x.kt[ki];
  const KvBlock& dblk = x.dkv->blocks[kt.block];
  const int64_t D = x.D, off = (g * x.P + kt.j0) * D, npad = round_up(kt.n, 32);
  pack_side(x, kt, g, kt.n, false, true, npad, w.kp, npad, w.k);
  pack_side(x, kt, g, kt.n, true, true, npad, w.vp, npad, w.v);
  pack_side(x, kt, g, kt.n, false, false, npad, w.kr, 0, w.k);
  std::fill(w.dkt, w.dkt + D * npad, 0.0f);
  std::fill(w.dvt, w.dvt + D * npad, 0.0f);
  // dQ += dS K for a (head, query tile) in its turn. A tile's is added after the next tile's other four
  // products (its dS kept meanwhile in the second buffer), so that a task following the one before it on
  // the same dQ tiles seldom finds its turn not yet come.
  struct PendingDq {
    int64_t h = 0, i = 0, rows = 0, np = 0, at = 0;
    uint16_t* ds = nullptr;
  } pending;
  auto add_dq = [&](const PendingDq& p) {
    const QueryTile& qt = x.qt[p.i];
    int32_t* done = x.dq_done + p.h * x.n_qt + p.i;
    wait_turn(done, x.dq_turn[ki * x.n_qt + p.i]);
    float* dq = x.dq + p.at;
    if (p.rows == qt.n) {
      attn_amx::product(p.ds, p.np, w.kr, D, dq, x.ldq, p.rows, D, p.np, true);  // dQ += dS K
    } else {
      for (int64_t r = 0; r < p.rows; ++r)
        if (r < qt.n) std::memcpy(w.opad + r * D, dq + r * x.ldq, sizeof(float) * D);
        else std::fill(w.opad + r * D, w.opad + (r + 1) * D, 0.0f);
      attn_amx::product(p.ds, p.np, w.kr, D, w.opad, D, p.rows, D, p.np, true);
      for (int64_t r = 0; r < qt.n; ++r) std::memcpy(dq + r * x.ldq, w.opad + r * D, sizeof(float) * D);
    }
    std::atomic_ref<int32_t>(*done).fetch_add(1, std::memory_order_release);
  };
  uint16_t *dsh = w.sh, *dsh2 = w.sh2;  // dS of this tile, and of the one waiting for its turn
  attn_amx::begin();
  for (int64_t h = g * x.group; h < (g + 1) * x.group; ++h) {
    for (int64_t i = 0; i < x.n_qt; ++i) {
      const QueryTile& qt = x.qt[i];
      const int64_t nk = visible_keys(kt, qt);
      if (nk == 0) continue;
      const int64_t np = round_up(nk, 32), rows = round_up(qt.n, 32), at = qt.r0 * x.ldq + h * D;
      const float* lse2 = x.lse2 + h * x.T + qt.r0;
      const float* dsum = x.dsum + h * x.T + qt.r0;
      attn_amx::product(x.qh + at, x.ldq, w.kp, npad, w.s, np, rows, np, D, false);   // S = Q K^T
      attn_amx::product(x.dh + at, x.ldq, w.vp, npad, w.ds, np, rows, np, D, false);  // dP = dO V^T
      attn_amx::grad_rows(w.s, w.ds, w.pp, dsh, w.dsp, qt.n, rows, np, nk, x.c, x.pos + qt.r0, kt.lo, lse2, dsum,
                          x.scale);
      const int64_t tq = (h * x.n_qt + i) * D * kBq;
      attn_amx::product(x.dth + tq, kBq, w.pp, np, w.dvt, npad, D, np, rows, true);   // dV^T += dO^T P
      attn_amx::product(x.qth + tq, kBq, w.dsp, np, w.dkt, npad, D, np, rows, true);  // dK^T += Q^T dS
      if (pending.rows > 0) add_dq(pending);  // the tile before's dQ, once this one's other products are done
      pending = PendingDq{h, i, rows, np, at, dsh};
      std::swap(dsh, dsh2);  // the next tile's dS goes to the other buffer
    }
  }
  if (pending.rows > 0) add_dq(pending);
  attn_amx::end();
  float* dK = static_cast<float*>(dblk.k) + off;
  float* dV = static_cast<float*>(dblk.v) + off;
  for (int64_t j = 0; j < kt.n; ++j)
    for (int64_t d = 0; d < D; ++d) {
      dK[j * D + d] += w.dkt[d * npad + j];
      dV[j * D + d] += w.dvt[d * npad + j];
    }
}

}  // namespace

bool decode_direct_kernels() { return direct_switch(); }
void set_decode_direct_kernels(bool on) { direct_switch() = on; }

void CpuOps::attention_forward(Tensor o, Tensor lse, Tensor q, const KvBlocks& kv, Tensor q_pos, double scale) {
  const AttentionDims dims =
      check_attention(kOp, o, lse, q, kv, q_pos, kAct, {DType::f32, DType::bf16, DType::f8_e4m3, DType::i8});
  if (dims.T == 0 || dims.H == 0) return;
  Ctx x = make_ctx(dims, q, o, lse, kv, q_pos, scale);
  const bool widen = kv.dtype != DType::f32 || (x.bf16 && !x.amx);
  x.n_kt = count_key_tiles(kv);
  x.n_qt = (x.T + kBq - 1) / kBq;
  const int64_t rows = operand_floats(x);
  const int64_t trows = tile_rows(x.T, x.H, x.Hkv, x.amx, false);
  const bool decode = x.T == 1 && x.group > 1 && x.group <= kBq;
  const bool split = decode && !x.bf16;  // (f32 products: decode_split)
  const int64_t split_floats = split ? decode_split_floats(x.Hkv, x.n_kt, x.group, x.D) : 0;
  const int64_t once_floats =
      decode ? 0 : kv_once_floats(x.T, x.H, x.Hkv, x.D, kv.n_blocks, kv.P, kv.dtype, x.amx && !x.tiles);
  const int64_t pack_floats = kv_pack_floats(x.T, x.H, x.Hkv, x.D, kv.n_blocks, kv.P, x.n_kt, x.tiles, decode);
  Scratch s = make_scratch(*this, x.n_kt, x.n_qt, padded(rows) + split_floats + once_floats + pack_floats,
                           x.tiles ? tiles_floats_amx(x.D, kv.dtype) : tiles_floats(x.D, widen, x.amx, trows));
  fill_key_tiles(s.kt, kv);
  fill_query_tiles(s.qt, x.pos, x.T);
  x.kt = s.kt;
  x.qt = s.qt;
  round_rows(&x, x.q, s.extra, &x.qr, &x.qh);
  if (once_floats > 0) {
    uint16_t* h = reinterpret_cast<uint16_t*>(s.extra + padded(rows) + split_floats);
    const int64_t side = x.Hkv * x.P * x.D;
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < 2 * kv.n_blocks * x.Hkv; ++u) {  // (block, side, kv head): its len rows
      const int64_t b = u / (2 * x.Hkv), sd = u / x.Hkv % 2, g = u % x.Hkv;
      const KvBlock& blk = kv.blocks[b];
      const float* src = static_cast<const float*>(sd ? blk.v : blk.k) + g * x.P * x.D;
      oomless::convert(h + (2 * b + sd) * side + g * x.P * x.D, DType::bf16, src, DType::f32, blk.len * x.D);
    }
    x.kvh = h;
  }
  if (pack_floats > 0) {
    uint32_t* packs = reinterpret_cast<uint32_t*>(s.extra + padded(rows) + split_floats + once_floats);
    const int64_t words = kBk * x.D / 2;
#pragma omp parallel
    {
      float* buf = s.tiles + omp_get_thread_num() * s.tile_floats;  // a thread's tiles, not in use yet
#pragma omp for schedule(static)
      for (int64_t u = 0; u < x.n_kt * x.Hkv; ++u) {  // u = i Hkv + g
        const KeyTile& kt = x.kt[u / x.Hkv];
        const int64_t npad = round_up(kt.n, 32);
        pack_side(x, kt, u % x.Hkv, kt.n, false, true, npad, packs + 2 * u * words, npad, buf);
        pack_side(x, kt, u % x.Hkv, kt.n, true, false, npad, packs + (2 * u + 1) * words, 0, buf);
      }
    }
    x.kvp = packs;
  }
  if (split) return decode_split(x, s.extra + padded(rows), s.tiles, s.tile_floats, widen, trows);
  const int64_t tasks = decode ? x.Hkv : x.n_qt * x.H;
#pragma omp parallel
  {
    float* tb = s.tiles + omp_get_thread_num() * s.tile_floats;
    const Tiles w = x.tiles ? carve_tiles_amx(tb, x.D, kv.dtype) : carve_tiles(tb, x.D, widen, x.amx, trows);
#pragma omp for schedule(static, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      if (decode) decode_group_task(x, t, w);
      else forward_task(x, t % x.H, x.qt[t / x.H], w);
    }
  }
}

void CpuOps::attention_backward(Tensor dq, const KvBlocks& dkv, Tensor dout, Tensor q, const KvBlocks& kv, Tensor o,
                                Tensor lse, Tensor q_pos, double scale) {
  const AttentionDims dims = check_attention(kOp, o, lse, q, kv, q_pos, kAct, {DType::f32, DType::bf16, DType::f8_e4m3});
  check_attention_backward(kOp, dims, dq, dout, dkv, kv, kAct);
  if (dims.T == 0 || dims.H == 0) return;
  Ctx x = make_ctx(dims, q, o, lse, kv, q_pos, scale);
  x.dkv = &dkv;
  x.dout = static_cast<const float*>(dout.data);
  x.dq = static_cast<float*>(dq.data);
  const bool widen = kv.dtype != DType::f32 || (x.bf16 && !x.amx);
  x.n_kt = count_key_tiles(kv);
  x.n_qt = (x.T + kBq - 1) / kBq;
  const int64_t HT = x.H * x.T, rows = operand_floats(x);
  const int64_t trows = tile_rows(x.T, x.H, x.Hkv, x.amx, true);
  Scratch s = make_scratch(*this, x.n_kt, x.n_qt, backward_extra_floats(x.T, x.H, x.D, x.n_kt, x.n_qt, rows, x.tiles),
                           x.tiles ? tiles_floats_amx(x.D, kv.dtype) : tiles_floats(x.D, widen, x.amx, trows));
  fill_key_tiles(s.kt, kv);
  fill_query_tiles(s.qt, x.pos, x.T);
  x.kt = s.kt;
  x.qt = s.qt;
  float* lse2 = s.extra;
  float* dsum = s.extra + padded(HT);
  round_rows(&x, x.q, dsum + padded(HT), &x.qr, &x.qh);
  round_rows(&x, x.dout, dsum + padded(HT) + rows, &x.dr, &x.dh);
  x.lse2 = lse2;
  x.dsum = dsum;
  int32_t* dq_done = reinterpret_cast<int32_t*>(dsum + padded(HT) + 2 * rows);
  int32_t* dq_turn = dq_done + padded(x.H * x.n_qt);
  std::fill(dq_done, dq_done + x.H * x.n_qt, 0);
  for (int64_t j = 0; j < x.n_qt; ++j) {
    int32_t seen = 0;
    for (int64_t i = 0; i < x.n_kt; ++i) {
      dq_turn[i * x.n_qt + j] = seen;
      if (visible_keys(x.kt[i], x.qt[j]) > 0) ++seen;
    }
  }
  x.dq_done = dq_done;
  x.dq_turn = dq_turn;
  if (x.tiles) {  // q and dout transposed per (head, query tile)
    uint16_t* qth = reinterpret_cast<uint16_t*>(dq_turn + padded(x.n_kt * x.n_qt));
    uint16_t* dth = qth + 2 * padded(x.H * x.n_qt * x.D * kBq / 2);
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < x.H * x.n_qt; ++u) {  // u = h n_qt + i
      const QueryTile& qt = x.qt[u % x.n_qt];
      const int64_t at = qt.r0 * x.ldq + (u / x.n_qt) * x.D;
      attn_amx::transpose(x.qh + at, x.ldq, qt.n, x.D, kBq, qth + u * x.D * kBq, kBq);
      attn_amx::transpose(x.dh + at, x.ldq, qt.n, x.D, kBq, dth + u * x.D * kBq, kBq);
    }
    x.qth = qth;
    x.dth = dth;
  }
  const int64_t kv_tasks = x.n_kt * x.Hkv;
#pragma omp parallel
  {
    float* tb = s.tiles + omp_get_thread_num() * s.tile_floats;
    const Tiles w = x.tiles ? carve_tiles_amx(tb, x.D, kv.dtype) : carve_tiles(tb, x.D, widen, x.amx, trows);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < HT; ++i) {  // i = h * T + t
      const int64_t h = i / x.T, t = i % x.T;
      const float* orow = x.o + t * x.ldq + h * x.D;
      const float* grow = x.dout + t * x.ldq + h * x.D;
      if (x.tiles) {  // the tiles' own bits: sixteen lanes
        dsum[i] = attn_amx::dot(orow, grow, x.D);
      } else {
        float acc = 0.0f;
        for (int64_t d = 0; d < x.D; ++d) acc += orow[d] * grow[d];
        dsum[i] = acc;
      }
      lse2[i] = static_cast<float>(static_cast<double>(x.lse[i]) * kLog2e);
      std::fill(x.dq + t * x.ldq + h * x.D, x.dq + t * x.ldq + (h + 1) * x.D, 0.0f);
    }
    // Round-robin by hand rather than schedule(static, 1): the turns need each thread to take its tasks in
    // ascending order.
    const int64_t nth = omp_get_num_threads();
    for (int64_t t = omp_get_thread_num(); t < kv_tasks; t += nth) {
      if (x.tiles) kv_grad_task_tiles(x, t % x.Hkv, t / x.Hkv, w);
      else kv_grad_task(x, t % x.Hkv, t / x.Hkv, w);
    }
  }
}

void CpuOps::attention_merge(Tensor o, Tensor lse, Tensor o2, Tensor lse2, int64_t row0) {
  const AttentionDims d = check_attention_merge("[attention_merge]", o, lse, o2, lse2, row0, DType::f32);
  detail::attention_merge_rows(static_cast<float*>(o.data), static_cast<float*>(lse.data),
                               static_cast<const float*>(o2.data), static_cast<const float*>(lse2.data), d.T,
                               o2.dims[0], row0, d.H, d.D);
}

size_t CpuOps::attention_workspace(bool backward, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t key_blocks,
                                   int64_t block_len, DType kv_dtype, bool bf16_products) const {
  if (T <= 0 || H <= 0) return 0;
  const bool amx = bf16_products && gemm_isa() == GemmIsa::amx;
  const bool widen = kv_dtype != DType::f32 || (bf16_products && !amx);
  const int64_t n_kt = key_blocks * ((block_len + kBk - 1) / kBk), n_qt = (T + kBq - 1) / kBq;
  const int64_t rows = operand_floats(T, H * D, bf16_products, amx);
  const int64_t group = Hkv > 0 ? H / Hkv : 1;
  const bool split = !backward && T == 1 && group > 1 && group <= kBq && !bf16_products;
  const bool decode = T == 1 && group > 1 && group <= kBq;
  const bool tiles = tiles_ok(amx, D);
  const int64_t extra =
      backward ? backward_extra_floats(T, H, D, n_kt, n_qt, rows, tiles)
               : padded(rows) + (split ? decode_split_floats(Hkv, n_kt, group, D) : 0) +
                     (decode ? 0 : kv_once_floats(T, H, Hkv, D, key_blocks, block_len, kv_dtype, amx && !tiles)) +
                     kv_pack_floats(T, H, Hkv, D, key_blocks, block_len, n_kt, tiles, decode);
  const int64_t tile_floats =
      tiles ? tiles_floats_amx(D, kv_dtype) : tiles_floats(D, widen, amx, tile_rows(T, H, Hkv, amx, backward));
  return static_cast<size_t>(scratch_bytes(n_kt, n_qt, extra, tile_floats));
}

}  // namespace oomless
