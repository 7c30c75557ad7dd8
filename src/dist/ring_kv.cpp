#include "dist/ring_kv.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "dist/comm.h"
#include "kv/kv_views.h"

namespace oomless {

namespace {
// One slice's keys then values of one layer: 2 (Hkv, T, D) elements.
int64_t block_elems(const KvDims& d, int64_t T) { return 2 * d.Hkv * T * d.D; }

// `bytes` of workspace from `arena`, or nothing for none.
Buffer take(Arena& arena, int64_t bytes, const char* what) {
  return bytes > 0 ? arena.alloc(static_cast<size_t>(bytes), Category::workspace, what) : Buffer();
}
}  // namespace

RingKv::RingKv(const KvDims& dims, Ops& ops, Arena& device, Arena& host, int ranks, RingOptions options)
    : d_(dims),
      n_(ranks > 0 ? ranks : dist::size()),
      r_(dist::rank() % n_),
      base_(dist::rank() - r_),
      ops_(ops),
      device_(device),
      host_(host),
      sp_(options) {
  OOM_CHECK(dist::size() % n_ == 0, "[context parallel] rings of ", n_, " ranks out of ", dist::size());
  OOM_CHECK(sp_.pages == 0 || (sp_.P > 0 && sp_.sinks >= 0 && (sp_.S == 1 || sp_.S == 2)),
            "[context parallel] page-sparse selection needs a page size and a summary");
  OOM_CHECK(!(sp_.zigzag && sp_.pages > 0), "[context parallel] the zigzag split is dense (no page-sparse selection)");
  if (sp_.pages > 0) {
    sel_.resize(static_cast<size_t>(d_.L));
    served_.resize(static_cast<size_t>(d_.L));
  }
}

void RingKv::begin(int64_t T, int64_t C) {
  OOM_CHECK(C >= T, "[context parallel] a rank's slice is one chunk: chunks of ", C, " for a slice of ", T,
            " tokens");
  OOM_CHECK(sp_.pages == 0 || T % sp_.P == 0, "[context parallel] a slice of ", T, " tokens is not whole pages of ",
            sp_.P);
  OOM_CHECK(!sp_.zigzag || T % 2 == 0, "[context parallel] a zigzag slice is two pieces: ", T, " tokens is odd");
  T_ = T;
}

int64_t RingKv::first(int64_t T) const { return sp_.zigzag ? r_ * (T / (2 * n_)) : r_ * (T / n_); }
int64_t RingKv::second(int64_t T) const { return sp_.zigzag ? (2 * n_ - 1 - r_) * (T / (2 * n_)) : -1; }

void RingKv::set_chunk(int64_t c) { OOM_CHECK(c == 0, "[context parallel] a rank's slice is one chunk, not ", c + 1); }

namespace {
// Page-sparse: the summaries of (r + 1) slices' pages (f32) and one slice's selection (ids and counts).
int64_t summary_bytes(const KvDims& d, int64_t T, int rank, const RingOptions& sp) {
  return dtype_bytes(DType::f32, (rank + 1) * (T / sp.P) * sp.S * d.Hkv * d.D);
}
int64_t selection_bytes(int64_t T, const RingOptions& sp) {
  return dtype_bytes(DType::i32, (T / sp.P) * (sp.pages + sp.sinks + 1));
}
}  // namespace

size_t RingKv::device_bytes(const KvDims& d, int64_t T, DType kv, DType grad, int rank, const RingOptions& sp) {
  if (sp.zigzag) {  // one other rank's two pieces (and their gradients), O and lse, or dq and half the lse
    const int64_t rows = T * d.H * d.D;
    return static_cast<size_t>(std::max(dtype_bytes(kv, block_elems(d, T)) + dtype_bytes(DType::f32, rows + d.H * T),
                                        dtype_bytes(kv, block_elems(d, T)) + dtype_bytes(grad, block_elems(d, T)) +
                                            dtype_bytes(DType::f32, rows + d.H * T / 2)));
  }
  // forward: one earlier block and its partial O and lse; backward: one block, its gradients and a dq
  // (page-sparse: an earlier rank's pages asked for, at most its slice; in the forward the summaries and the
  // selection beside them)
  const int64_t rows = T * d.H * d.D;
  const int64_t sel = sp.pages > 0 ? summary_bytes(d, T, rank, sp) + selection_bytes(T, sp) : 0;
  if (rank == 0) return static_cast<size_t>(sel);  // no earlier slice: its own summaries at most
  return static_cast<size_t>(std::max(sel + dtype_bytes(kv, block_elems(d, T)) +
                                           dtype_bytes(DType::f32, rows + d.H * T),
                                      dtype_bytes(kv, block_elems(d, T)) + dtype_bytes(grad, block_elems(d, T)) +
                                          dtype_bytes(DType::f32, rows + (sp.pages > 0 ? d.H * T : 0))));
}

size_t RingKv::host_bytes(const KvDims& d, int64_t T, int rank, int ranks, DType kv, DType grad,
                          const RingOptions& sp) {
  // every message in flight at once: this rank's block and the earlier ones; backward also the earlier blocks'
  // gradients sent and the later ranks' received, and on a rank before the last its own keys' gradients that
  // those are added to
  const int64_t b = block_elems(d, T);
  if (sp.zigzag) {  // in quarter blocks (a piece's keys or values): forward the own four and each other rank's
                    // message (two from an earlier rank, four from a later one); backward also the gradients
                    // both ways (as many) and the own sums
    const int64_t q = b / 4, kvq = 4 + 2 * rank + 4 * (ranks - 1 - rank);
    return static_cast<size_t>(dtype_bytes(kv, kvq * q) + dtype_bytes(grad, (6 * (ranks - 1) + 4) * q));
  }
  if (sp.pages == 0)
    return static_cast<size_t>(dtype_bytes(kv, (rank + 1) * b) +
                               dtype_bytes(grad, (rank + 1 < ranks ? ranks : ranks - 1) * b));
  // Page-sparse: buffers for every page of a slice asked of each rank (the selection is known only at the
  // step; the bound keeps the ledger the estimate's): forward, the summaries, the asks both ways, the pages
  // served to each later rank and received from each earlier one; backward, those pages again, the gradients
  // both ways and this rank's own sums.
  const int64_t asks = dtype_bytes(DType::i32, (ranks - 1) * (T / sp.P + 1));
  const int64_t fwd = summary_bytes(d, T, rank, sp) + asks + dtype_bytes(kv, (ranks - 1) * b);
  const int64_t bwd = dtype_bytes(kv, (ranks - 1) * b) + dtype_bytes(grad, (rank + 1 < ranks ? ranks : ranks - 1) * b);
  return static_cast<size_t>(std::max(fwd, bwd));
}

namespace {
// A message's tag: the layer and what it carries (keys and values forward, again backward, key gradients).
// Page-sparse adds the pages' summaries and the asks.
enum Kind { kKvForward = 0, kKvBackward = 1, kGrads = 2, kSummaries = 3, kAsks = 4 };
int tag(int64_t layer, Kind k) { return static_cast<int>(layer % 8000) * 8 + k; }
}  // namespace

void RingKv::post(int64_t layer, int kind, Tensor k, Tensor v, Ring* ring) {
  const int N = n_, r = r_;
  const int64_t bytes = dtype_bytes(k.dtype, d_.Hkv * T_ * d_.D), blk = 2 * bytes;
  ring->blk = blk;
  ring->host = take(host_, blk * (r + 1), "context parallel: keys in flight");
  char* own = ring->host.as<char>() + r * blk;
  ring->recvs.clear();
  ring->sends.clear();
  for (int s = 0; s < r; ++s)
    ring->recvs.push_back(
        dist::irecv(ring->host.as<char>() + s * blk, blk, base_ + s, tag(layer, static_cast<Kind>(kind))));
  if (r + 1 < N) {
    ops_.download(own, k);
    ops_.download(own + bytes, v);
    for (int s = r + 1; s < N; ++s)
      ring->sends.push_back(dist::isend(own, blk, base_ + s, tag(layer, static_cast<Kind>(kind))));
  }
  if (r > 0) ring->dev = take(device_, blk, "context parallel: an earlier slice's keys");
}

KvBlocks RingKv::arrived(int s, Ring* ring, DType dtype, KvBlock* block) {
  dist::wait(ring->recvs[static_cast<size_t>(s)]);
  char* at = ring->dev.as<char>();
  ops_.upload(Tensor(at, DType::u8, {ring->blk}, Tier::Device), ring->host.as<char>() + s * ring->blk);
  *block = KvBlock{at, at + ring->blk / 2, static_cast<int32_t>(s * T_), static_cast<int32_t>(T_)};
  return KvBlocks{block, 1, d_.Hkv, T_, d_.D, dtype, bf16_};
}

void RingKv::forward(int64_t layer, Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, Tensor pos) {
  if (sp_.pages > 0) return forward_sparse(layer, o, lse, q, k, v, pos);
  if (sp_.zigzag) return forward_zigzag(layer, o, lse, q, k, v, pos);
  const int r = r_;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d_.D));
  Ring ring;
  post(layer, kKvForward, k, v, &ring);
  // The own slice while the earlier ones travel, then each as it is needed, nearest first, merged in.
  KvBlock own{k.data, v.data, static_cast<int32_t>(r * T_), static_cast<int32_t>(T_)};
  ops_.attention_forward(o, lse, q, KvBlocks{&own, 1, d_.Hkv, T_, d_.D, k.dtype, bf16_}, pos, scale);
  if (r > 0) {
    Buffer part = take(device_, dtype_bytes(o.dtype, o.numel() + lse.numel()), "context parallel: a partial O");
    Tensor o2(part.data(), o.dtype, {o.dims[0], o.dims[1], o.dims[2]}, Tier::Device);
    Tensor l2(part.as<char>() + dtype_bytes(o.dtype, o.numel()), lse.dtype, {lse.dims[0], lse.dims[1]}, Tier::Device);
    for (int s = r - 1; s >= 0; --s) {
      KvBlock blk;
      ops_.attention_forward(o2, l2, q, arrived(s, &ring, k.dtype, &blk), pos, scale);
      ops_.attention_merge(o, lse, o2, l2, 0);
    }
  }
  for (dist::Request& x : ring.sends) dist::wait(x);
}

void RingKv::backward(int64_t layer, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v,
                      Tensor o, Tensor lse, Tensor pos) {
  if (sp_.pages > 0) return backward_sparse(layer, dq, dk, dv, dout, q, k, v, o, lse, pos);
  if (sp_.zigzag) return backward_zigzag(layer, dq, dk, dv, dout, q, k, v, o, lse, pos);
  const int N = n_, r = r_;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d_.D));
  OOM_CHECK(dk.dtype == DType::f32, "[context parallel] key gradients are f32");
  const int64_t half = d_.Hkv * T_ * d_.D, gblk = dtype_bytes(dk.dtype, 2 * half);
  Ring ring;
  post(layer, kKvBackward, k, v, &ring);
  // The later ranks' gradients for this rank's keys, and this rank's for the earlier ones, in flight.
  Buffer grads = take(host_, gblk * (N - 1), "context parallel: key gradients in flight");
  std::vector<dist::Request> in, out;
  for (int s = r + 1; s < N; ++s)
    in.push_back(dist::irecv(grads.as<char>() + (s - 1) * gblk, gblk, base_ + s, tag(layer, kGrads)));
  // The own slice (dq =, its keys' share into dk, dv, which start at zero), then each earlier one as it comes:
  // its dq added, its key gradients sent back to its rank.
  KvBlock own{k.data, v.data, static_cast<int32_t>(r * T_), static_cast<int32_t>(T_)};
  KvBlock down{dk.data, dv.data, own.start, own.len};
  ops_.attention_backward(dq, KvBlocks{&down, 1, d_.Hkv, T_, d_.D, dk.dtype}, dout, q,
                          KvBlocks{&own, 1, d_.Hkv, T_, d_.D, k.dtype, bf16_}, o, lse, pos, scale);
  if (r > 0) {
    Buffer part = take(device_, gblk + dtype_bytes(dq.dtype, dq.numel()), "context parallel: an earlier slice's gradients");
    Tensor dkv(part.data(), dk.dtype, {2 * half}, Tier::Device);
    Tensor dq2(part.as<char>() + gblk, dq.dtype, {dq.dims[0], dq.dims[1], dq.dims[2]}, Tier::Device);
    for (int s = r - 1; s >= 0; --s) {
      KvBlock blk;
      const KvBlocks kv = arrived(s, &ring, k.dtype, &blk);
      ops_.zero(dkv);
      KvBlock gb{dkv.data, static_cast<char*>(dkv.data) + gblk / 2, blk.start, blk.len};
      ops_.attention_backward(dq2, KvBlocks{&gb, 1, d_.Hkv, T_, d_.D, dk.dtype}, dout, q, kv, o, lse, pos, scale);
      ops_.axpy(dq, 1.0, dq2);
      char* at = grads.as<char>() + s * gblk;  // slots below this rank: its gradients for rank s
      ops_.download(at, dkv);
      out.push_back(dist::isend(at, gblk, base_ + s, tag(layer, kGrads)));
    }
  }
  for (dist::Request& x : in) dist::wait(x);
  if (r + 1 < N) {  // the later ranks' sums for this rank's keys, in rank order
    Buffer mine = take(host_, gblk, "context parallel: own key gradients");
    float* m = mine.as<float>();
    ops_.download(m, dk);
    ops_.download(m + half, dv);
    for (int s = r + 1; s < N; ++s) {
      const float* add = reinterpret_cast<const float*>(grads.as<char>() + (s - 1) * gblk);
      for (int64_t i = 0; i < 2 * half; ++i) m[i] += add[i];
    }
    ops_.upload(dk, m);
    ops_.upload(dv, m + half);
  }
  for (dist::Request& x : out) dist::wait(x);
  for (dist::Request& x : ring.sends) dist::wait(x);
}

// ---- page-sparse ----------------------------------------------------------------------------------------

namespace {
using kv_detail::rows;

// Consecutive query pages reading the same of one earlier rank's pages: rows [r0, r0 + n), and the places of
// those pages in the list asked of that rank.
struct PageGroup {
  int64_t r0, n;
  std::vector<int32_t> idx;
};

// The arrived pages of rank s (`asked`: their places in its slice, sorted) as blocks: page i at base + i * stride,
// its keys then its values (stride / 2 bytes each).
std::vector<KvBlock> page_blocks(char* base, int64_t stride, const std::vector<int32_t>& asked, int64_t s,
                                 int64_t T, int64_t P) {
  std::vector<KvBlock> out;
  for (size_t i = 0; i < asked.size(); ++i) {
    char* b = base + static_cast<int64_t>(i) * stride;
    out.push_back(KvBlock{b, b + stride / 2, static_cast<int32_t>(s * T + asked[i] * P), static_cast<int32_t>(P)});
  }
  return out;
}

// The blocks of `all` a group reads.
std::vector<KvBlock> picked(const std::vector<KvBlock>& all, const std::vector<int32_t>& idx) {
  std::vector<KvBlock> out;
  for (int32_t i : idx) out.push_back(all[static_cast<size_t>(i)]);
  return out;
}
}  // namespace

std::vector<int32_t> RingKv::asked_of(int64_t layer, int s) const {
  const std::vector<int32_t>& sel = sel_[static_cast<size_t>(layer)];
  const int64_t ppc = T_ / sp_.P, W = sp_.pages + sp_.sinks, nq = ppc;
  const int32_t* cnt = sel.data() + nq * W;
  std::vector<int32_t> out;
  for (int64_t qp = 0; qp < nq; ++qp)
    for (int32_t i = 0; i < cnt[qp]; ++i) {
      const int32_t p = sel[static_cast<size_t>(qp * W + i)];
      if (p >= s * ppc && p < (s + 1) * ppc) out.push_back(static_cast<int32_t>(p - s * ppc));
    }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

void RingKv::pack_pages(char* dst, const std::vector<int32_t>& list, Tensor k, Tensor v) {
  const int64_t P = sp_.P, D = d_.D, Hkv = d_.Hkv, prows = P * D, half = dtype_bytes(k.dtype, Hkv * prows);
  for (size_t i = 0; i < list.size(); ++i) {
    char* page = dst + static_cast<int64_t>(i) * 2 * half;
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t at = (h * T_ + list[i] * P) * D;
      ops_.download(page + dtype_bytes(k.dtype, h * prows),
                    Tensor(static_cast<char*>(k.data) + dtype_bytes(k.dtype, at), k.dtype, {prows}, k.tier));
      ops_.download(page + half + dtype_bytes(v.dtype, h * prows),
                    Tensor(static_cast<char*>(v.data) + dtype_bytes(v.dtype, at), v.dtype, {prows}, v.tier));
    }
  }
}

namespace {
// The groups of query pages reading rank s's pages `asked` (their places in s's slice, sorted), from the rank's
// selection sel (nq, W) and counts.
std::vector<PageGroup> groups_of(const std::vector<int32_t>& sel, int64_t nq, int64_t W, int64_t P, int64_t ppc, int s,
                                 const std::vector<int32_t>& asked) {
  const int32_t* cnt = sel.data() + nq * W;
  std::vector<PageGroup> out;
  bool open = false;  // the last group ends at the previous query page
  for (int64_t qp = 0; qp < nq; ++qp) {
    std::vector<int32_t> idx;
    for (int32_t i = 0; i < cnt[qp]; ++i) {
      const int32_t p = sel[static_cast<size_t>(qp * W + i)] - static_cast<int32_t>(s * ppc);
      if (p < 0 || p >= ppc) continue;
      idx.push_back(static_cast<int32_t>(std::lower_bound(asked.begin(), asked.end(), p) - asked.begin()));
    }
    if (!idx.empty() && open && idx == out.back().idx) {
      out.back().n += P;
    } else if (!idx.empty()) {
      out.push_back(PageGroup{qp * P, P, std::move(idx)});
    }
    open = !out.empty() && out.back().r0 + out.back().n == (qp + 1) * P;
  }
  return out;
}
}  // namespace

void RingKv::forward_sparse(int64_t layer, Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, Tensor pos) {
  const int N = n_, r = r_;
  const int64_t P = sp_.P, ppc = T_ / P, nq = ppc, W = sp_.pages + sp_.sinks, HD = d_.Hkv * d_.D;
  const int64_t sbytes = dtype_bytes(DType::f32, sp_.S * HD), page = dtype_bytes(k.dtype, 2 * HD * P);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d_.D));
  // The own slice first (dense, causal), then the summaries: this rank's pages' to the later ranks.
  KvBlock own{k.data, v.data, static_cast<int32_t>(r * T_), static_cast<int32_t>(T_)};
  ops_.attention_forward(o, lse, q, KvBlocks{&own, 1, d_.Hkv, T_, d_.D, k.dtype, bf16_}, pos, scale);
  Buffer dsum = take(device_, (r + 1) * ppc * sbytes + dtype_bytes(DType::i32, nq * (W + 1)),
                     "context parallel: page summaries and a selection");
  Buffer hsum = take(host_, (r + 1) * ppc * sbytes, "context parallel: page summaries in flight");
  char* dmine = dsum.as<char>() + r * ppc * sbytes;
  for (int64_t p = 0; p < ppc; ++p)
    ops_.page_summary(Tensor(dmine + p * sbytes, DType::f32, {sp_.S, d_.Hkv, d_.D}, Tier::Device), k, p * P, P);
  std::vector<dist::Request> sum_in, sum_out, ask_in, ask_out, pages_in, pages_out;
  if (r + 1 < N) {
    ops_.download(hsum.as<char>() + r * ppc * sbytes, Tensor(dmine, DType::f32, {ppc * sp_.S * HD}, Tier::Device));
    for (int t = r + 1; t < N; ++t)
      sum_out.push_back(
          dist::isend(hsum.as<char>() + r * ppc * sbytes, ppc * sbytes, base_ + t, tag(layer, kSummaries)));
  }
  for (int s = 0; s < r; ++s)
    sum_in.push_back(dist::irecv(hsum.as<char>() + s * ppc * sbytes, ppc * sbytes, base_ + s, tag(layer, kSummaries)));
  // The asks: each earlier rank's pages this rank's queries selected (count, then the pages), and the later ranks'.
  const int64_t ask_len = ppc + 1;
  Buffer asks = take(host_, dtype_bytes(DType::i32, (N - 1) * ask_len), "context parallel: pages asked");
  int32_t* ask = asks.as<int32_t>();  // slots [0, r): this rank's asks of rank s; [r, N - 1): later rank s + 1's
  for (int t = r + 1; t < N; ++t)
    ask_in.push_back(
        dist::irecv(ask + (t - 1) * ask_len, dtype_bytes(DType::i32, ask_len), base_ + t, tag(layer, kAsks)));
  std::vector<int32_t>& sel = sel_[static_cast<size_t>(layer)];
  sel.assign(static_cast<size_t>(nq * (W + 1)), 0);
  std::vector<std::vector<int32_t>> asked(static_cast<size_t>(r));
  int64_t total = 0;
  if (r > 0) {
    for (dist::Request& x : sum_in) dist::wait(x);
    ops_.upload(Tensor(dsum.data(), DType::f32, {r * ppc * sp_.S * HD}, Tier::Device), hsum.data());
    int32_t* dsel = reinterpret_cast<int32_t*>(dsum.as<char>() + (r + 1) * ppc * sbytes);
    ops_.page_select(Tensor(dsel, DType::i32, {nq, W}, Tier::Device),
                     Tensor(dsel + nq * W, DType::i32, {nq}, Tier::Device), q,
                     Tensor(dsum.data(), DType::f32, {r * ppc, sp_.S, d_.Hkv, d_.D}, Tier::Device), P, sp_.sinks);
    ops_.download(sel.data(), Tensor(dsel, DType::i32, {nq * (W + 1)}, Tier::Device));
    for (int s = 0; s < r; ++s) {
      asked[static_cast<size_t>(s)] = asked_of(layer, s);
      const std::vector<int32_t>& a = asked[static_cast<size_t>(s)];
      int32_t* slot = ask + s * ask_len;
      slot[0] = static_cast<int32_t>(a.size());
      std::copy(a.begin(), a.end(), slot + 1);
      ask_out.push_back(dist::isend(slot, dtype_bytes(DType::i32, ask_len), base_ + s, tag(layer, kAsks)));
      total += static_cast<int64_t>(a.size());
    }
  }
  // The pages asked of this rank, and those this rank asked for (room for all of every slice: see host_bytes).
  Buffer in = take(host_, r * ppc * page, "context parallel: pages received");
  {
    int64_t at = 0;
    for (int s = 0; s < r; ++s) {
      const int64_t n = static_cast<int64_t>(asked[static_cast<size_t>(s)].size());
      pages_in.push_back(dist::irecv(in.as<char>() + at * page, n * page, base_ + s, tag(layer, kKvForward)));
      at += n;
    }
  }
  std::vector<std::vector<int32_t>>& served = served_[static_cast<size_t>(layer)];
  served.assign(static_cast<size_t>(N - 1 - r), {});
  Buffer out = take(host_, (N - 1 - r) * ppc * page, "context parallel: pages served");
  for (int t = r + 1; t < N; ++t) {
    dist::wait(ask_in[static_cast<size_t>(t - r - 1)]);
    const int32_t* slot = ask + (t - 1) * ask_len;
    std::vector<int32_t>& list = served[static_cast<size_t>(t - r - 1)];
    list.assign(slot + 1, slot + 1 + slot[0]);
    char* at = out.as<char>() + (t - r - 1) * ppc * page;
    pack_pages(at, list, k, v);
    pages_out.push_back(dist::isend(at, static_cast<int64_t>(list.size()) * page, base_ + t, tag(layer, kKvForward)));
  }
  // Each earlier rank's pages as they arrive, nearest first, merged into O and lse.
  if (r > 0) {
    Buffer blk = take(device_, ppc * page, "context parallel: an earlier slice's pages");
    Buffer part = take(device_, dtype_bytes(o.dtype, o.numel() + lse.numel()), "context parallel: a partial O");
    int64_t at = total;
    for (int s = r - 1; s >= 0; --s) {
      const std::vector<int32_t>& a = asked[static_cast<size_t>(s)];
      const int64_t n = static_cast<int64_t>(a.size());
      at -= n;
      dist::wait(pages_in[static_cast<size_t>(s)]);
      if (n == 0) continue;
      ops_.upload(Tensor(blk.data(), DType::u8, {n * page}, Tier::Device), in.as<char>() + at * page);
      const std::vector<KvBlock> blocks = page_blocks(blk.as<char>(), page, a, s, T_, P);
      for (const PageGroup& g : groups_of(sel, nq, W, P, ppc, s, a)) {
        const std::vector<KvBlock> read = picked(blocks, g.idx);
        Tensor o2(part.data(), o.dtype, {g.n, o.dims[1], o.dims[2]}, Tier::Device);
        Tensor l2(part.as<char>() + dtype_bytes(o.dtype, o.numel()), lse.dtype, {lse.dims[0], g.n}, Tier::Device);
        ops_.attention_forward(o2, l2, rows(q, g.r0, g.n),
                               KvBlocks{read.data(), static_cast<int64_t>(read.size()), d_.Hkv, P, d_.D, k.dtype,
                                        bf16_},
                               rows(pos, g.r0, g.n), scale);
        ops_.attention_merge(o, lse, o2, l2, g.r0);
      }
    }
  }
  for (dist::Request& x : sum_out) dist::wait(x);
  for (dist::Request& x : ask_out) dist::wait(x);
  for (dist::Request& x : pages_out) dist::wait(x);
}

void RingKv::backward_sparse(int64_t layer, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k,
                             Tensor v, Tensor o, Tensor lse, Tensor pos) {
  const int N = n_, r = r_;
  const int64_t P = sp_.P, ppc = T_ / P, nq = ppc, W = sp_.pages + sp_.sinks, HD = d_.Hkv * d_.D;
  const int64_t page = dtype_bytes(k.dtype, 2 * HD * P), gpage = dtype_bytes(dk.dtype, 2 * HD * P);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d_.D));
  OOM_CHECK(dk.dtype == DType::f32, "[context parallel] key gradients are f32");
  const std::vector<int32_t>& sel = sel_[static_cast<size_t>(layer)];
  const std::vector<std::vector<int32_t>>& served = served_[static_cast<size_t>(layer)];
  OOM_CHECK(static_cast<int64_t>(sel.size()) == nq * (W + 1) && static_cast<int64_t>(served.size()) == N - 1 - r,
            "[context parallel] internal: layer ", layer, "'s backward without its forward's selection");
  std::vector<std::vector<int32_t>> asked(static_cast<size_t>(r));
  int64_t total = 0;
  for (int s = 0; s < r; ++s) {
    asked[static_cast<size_t>(s)] = asked_of(layer, s);
    total += static_cast<int64_t>(asked[static_cast<size_t>(s)].size());
  }
  // The same pages travel again (the forward's asks), and their gradients come back.
  std::vector<dist::Request> pages_in, pages_out, grads_in, grads_out;
  Buffer in = take(host_, r * ppc * page, "context parallel: pages received");
  for (int s = 0, at = 0; s < r; ++s) {
    const int64_t n = static_cast<int64_t>(asked[static_cast<size_t>(s)].size());
    pages_in.push_back(dist::irecv(in.as<char>() + at * page, n * page, base_ + s, tag(layer, kKvBackward)));
    at += static_cast<int>(n);
  }
  Buffer out = take(host_, (N - 1 - r) * ppc * page, "context parallel: pages served");
  Buffer gin = take(host_, (N - 1 - r) * ppc * gpage, "context parallel: key gradients received");
  for (int t = r + 1, at = 0; t < N; ++t) {
    const std::vector<int32_t>& list = served[static_cast<size_t>(t - r - 1)];
    const int64_t n = static_cast<int64_t>(list.size());
    pack_pages(out.as<char>() + at * page, list, k, v);
    pages_out.push_back(dist::isend(out.as<char>() + at * page, n * page, base_ + t, tag(layer, kKvBackward)));
    grads_in.push_back(dist::irecv(gin.as<char>() + at * gpage, n * gpage, base_ + t, tag(layer, kGrads)));
    at += static_cast<int>(n);
  }
  // The own slice (dq =, its keys' share into dk, dv, which start at zero), then each earlier rank's pages as
  // they come: dq added, their key gradients sent back.
  KvBlock own{k.data, v.data, static_cast<int32_t>(r * T_), static_cast<int32_t>(T_)};
  KvBlock down{dk.data, dv.data, own.start, own.len};
  ops_.attention_backward(dq, KvBlocks{&down, 1, d_.Hkv, T_, d_.D, dk.dtype}, dout, q,
                          KvBlocks{&own, 1, d_.Hkv, T_, d_.D, k.dtype, bf16_}, o, lse, pos, scale);
  Buffer gout = take(host_, r * ppc * gpage, "context parallel: key gradients sent");
  if (r > 0) {
    Buffer part = take(device_, ppc * page + ppc * gpage + dtype_bytes(dq.dtype, dq.numel()) +
                                    dtype_bytes(lse.dtype, lse.numel()),
                       "context parallel: an earlier slice's pages and gradients");
    char* blk = part.as<char>();
    char* gblk = blk + ppc * page;
    Tensor dq2all(gblk + ppc * gpage, dq.dtype, {dq.dims[0], dq.dims[1], dq.dims[2]}, Tier::Device);
    int64_t at = total;
    for (int s = r - 1; s >= 0; --s) {
      const std::vector<int32_t>& a = asked[static_cast<size_t>(s)];
      const int64_t n = static_cast<int64_t>(a.size());
      at -= n;
      dist::wait(pages_in[static_cast<size_t>(s)]);
      if (n == 0) {
        grads_out.push_back(dist::isend(gout.as<char>() + at * gpage, 0, base_ + s, tag(layer, kGrads)));
        continue;
      }
      ops_.upload(Tensor(blk, DType::u8, {n * page}, Tier::Device), in.as<char>() + at * page);
      const Tensor g(gblk, dk.dtype, {n * 2 * HD * P}, Tier::Device);
      ops_.zero(g);
      const std::vector<KvBlock> blocks = page_blocks(blk, page, a, s, T_, P),
                                 gblocks = page_blocks(gblk, gpage, a, s, T_, P);
      for (const PageGroup& gr : groups_of(sel, nq, W, P, ppc, s, a)) {
        const std::vector<KvBlock> read = picked(blocks, gr.idx), gread = picked(gblocks, gr.idx);
        const int64_t nb = static_cast<int64_t>(read.size());
        const KvBlocks kv{read.data(), nb, d_.Hkv, P, d_.D, k.dtype, bf16_},
            gk{gread.data(), nb, d_.Hkv, P, d_.D, dk.dtype};
        Tensor dq2(dq2all.data, dq.dtype, {gr.n, dq.dims[1], dq.dims[2]}, Tier::Device);
        if (gr.n == T_) {
          ops_.attention_backward(dq2, gk, dout, q, kv, o, lse, pos, scale);
        } else {  // some rows: their lse gathered into (H, n) behind dq2
          Tensor l(static_cast<char*>(dq2all.data) + dtype_bytes(dq.dtype, gr.n * dq.dims[1] * dq.dims[2]), lse.dtype,
                   {lse.dims[0], gr.n}, Tier::Device);
          kv_detail::lse_rows(ops_, l, lse, gr.r0, gr.n);
          ops_.attention_backward(dq2, gk, rows(dout, gr.r0, gr.n), rows(q, gr.r0, gr.n), kv, rows(o, gr.r0, gr.n), l,
                                  rows(pos, gr.r0, gr.n), scale);
        }
        const Tensor dq_rows = rows(dq, gr.r0, gr.n);
        ops_.add(dq_rows, dq_rows, dq2);
      }
      ops_.download(gout.as<char>() + at * gpage, g);
      grads_out.push_back(dist::isend(gout.as<char>() + at * gpage, n * gpage, base_ + s, tag(layer, kGrads)));
    }
  }
  // The later ranks' gradients for this rank's pages, added in rank order (each rank's pages in order).
  if (r + 1 < N) {
    const int64_t half = d_.Hkv * T_ * d_.D, prows = P * d_.D;
    Buffer mine = take(host_, dtype_bytes(DType::f32, 2 * half), "context parallel: own key gradients");
    float* m = mine.as<float>();
    ops_.download(m, dk);
    ops_.download(m + half, dv);
    for (int t = r + 1, at = 0; t < N; ++t) {
      dist::wait(grads_in[static_cast<size_t>(t - r - 1)]);
      for (int32_t p : served[static_cast<size_t>(t - r - 1)]) {
        const float* gk = reinterpret_cast<const float*>(gin.as<char>() + static_cast<int64_t>(at) * gpage);
        const float* gv = gk + HD * P;
        for (int64_t h = 0; h < d_.Hkv; ++h) {
          float* mk = m + h * T_ * d_.D + p * prows;
          float* mv = m + half + h * T_ * d_.D + p * prows;
          for (int64_t i = 0; i < prows; ++i) {
            mk[i] += gk[h * prows + i];
            mv[i] += gv[h * prows + i];
          }
        }
        ++at;
      }
    }
    ops_.upload(dk, m);
    ops_.upload(dv, m + half);
  }
  for (dist::Request& x : grads_out) dist::wait(x);
  for (dist::Request& x : pages_out) dist::wait(x);
}

// ---- zigzag ---------------------------------------------------------------------------------------------

void RingKv::pack_pieces(char* dst, Tensor k, Tensor v) {
  const int64_t h = T_ / 2, D = d_.D, Hkv = d_.Hkv, piece = dtype_bytes(k.dtype, Hkv * h * D);
  for (int half = 0; half < 2; ++half)
    for (int kv = 0; kv < 2; ++kv) {
      const Tensor& t = kv == 0 ? k : v;
      char* out = dst + (2 * half + kv) * piece;
      for (int64_t g = 0; g < Hkv; ++g)
        ops_.download(out + dtype_bytes(t.dtype, g * h * D),
                      Tensor(static_cast<char*>(t.data) + dtype_bytes(t.dtype, (g * T_ + half * h) * D), t.dtype,
                             {h * D}, t.tier));
    }
}

void RingKv::own_pieces(const Tensor& a, const Tensor& b, KvBlock* out) const {
  const int64_t h = T_ / 2, T = 2 * n_ * h, off = dtype_bytes(a.dtype, h * d_.D);
  out[0] = KvBlock{a.data, b.data, static_cast<int32_t>(first(T)), static_cast<int32_t>(h)};
  out[1] = KvBlock{static_cast<char*>(a.data) + off, static_cast<char*>(b.data) + off, static_cast<int32_t>(second(T)),
                   static_cast<int32_t>(h)};
}

std::vector<dist::Request> RingKv::send_pieces(int64_t layer, int kind, Tensor k, Tensor v, char* at) {
  const int64_t piece = dtype_bytes(k.dtype, d_.Hkv * (T_ / 2) * d_.D);
  std::vector<dist::Request> sends;
  pack_pieces(at, k, v);
  for (int t = 0; t < n_; ++t)
    if (t != r_)
      sends.push_back(dist::isend(at, (t > r_ ? 2 : 4) * piece, base_ + t, tag(layer, static_cast<Kind>(kind))));
  return sends;
}

namespace {
// The other ranks of a ring in the order a zigzag rank reads them: the earlier ones nearest first, then the later.
std::vector<int> others(int r, int N) {
  std::vector<int> order;
  for (int s = r - 1; s >= 0; --s) order.push_back(s);
  for (int s = r + 1; s < N; ++s) order.push_back(s);
  return order;
}
}  // namespace

void RingKv::forward_zigzag(int64_t layer, Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, Tensor pos) {
  const int N = n_, r = r_;
  const int64_t h = T_ / 2, D = d_.D, Hkv = d_.Hkv, piece = dtype_bytes(k.dtype, Hkv * h * D);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  // Messages: the own four pieces, then each other rank's (an earlier rank's first two, a later rank's four).
  auto size_of = [&](int s) { return (s < r ? 2 : 4) * piece; };
  std::vector<int64_t> at(static_cast<size_t>(N), 0);
  int64_t total = 4 * piece;
  for (int s : others(r, N)) at[static_cast<size_t>(s)] = total, total += size_of(s);
  Buffer host = take(host_, total, "context parallel: keys in flight");
  char* hb = host.as<char>();
  std::vector<dist::Request> recvs(static_cast<size_t>(N));
  for (int s : others(r, N))
    recvs[static_cast<size_t>(s)] =
        dist::irecv(hb + at[static_cast<size_t>(s)], size_of(s), base_ + s, tag(layer, kKvForward));
  std::vector<dist::Request> sends = send_pieces(layer, kKvForward, k, v, hb);
  // The own two pieces (causal by position), while the others travel.
  KvBlock own[2];
  own_pieces(k, v, own);
  ops_.attention_forward(o, lse, q, KvBlocks{own, 2, Hkv, T_, D, k.dtype, bf16_}, pos, scale);
  Buffer dev = take(device_, 4 * piece, "context parallel: another slice's keys");
  Buffer part = take(device_, dtype_bytes(o.dtype, o.numel() + lse.numel()), "context parallel: a partial O");
  char* db = dev.as<char>();
  // An earlier rank's first piece is read by every row; a later rank's two pieces by the second piece's rows.
  for (int s : others(r, N)) {
    dist::wait(recvs[static_cast<size_t>(s)]);
    ops_.upload(Tensor(db, DType::u8, {size_of(s)}, Tier::Device), hb + at[static_cast<size_t>(s)]);
    const int32_t len = static_cast<int32_t>(h);
    const KvBlock blk[2] = {KvBlock{db, db + piece, static_cast<int32_t>(s * h), len},
                            KvBlock{db + 2 * piece, db + 3 * piece, static_cast<int32_t>((2 * N - 1 - s) * h), len}};
    const int64_t r0 = s < r ? 0 : h, n = s < r ? T_ : h;
    Tensor o2(part.data(), o.dtype, {n, o.dims[1], o.dims[2]}, Tier::Device);
    Tensor l2(part.as<char>() + dtype_bytes(o.dtype, o.numel()), lse.dtype, {lse.dims[0], n}, Tier::Device);
    ops_.attention_forward(o2, l2, rows(q, r0, n), KvBlocks{blk, s < r ? 1 : 2, Hkv, h, D, k.dtype, bf16_},
                           rows(pos, r0, n), scale);
    ops_.attention_merge(o, lse, o2, l2, r0);
  }
  for (dist::Request& x : sends) dist::wait(x);
}

void RingKv::backward_zigzag(int64_t layer, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k,
                             Tensor v, Tensor o, Tensor lse, Tensor pos) {
  const int N = n_, r = r_;
  const int64_t h = T_ / 2, D = d_.D, Hkv = d_.Hkv, H = d_.H, piece = dtype_bytes(k.dtype, Hkv * h * D),
                gpiece = dtype_bytes(dk.dtype, Hkv * h * D);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  OOM_CHECK(dk.dtype == DType::f32, "[context parallel] key gradients are f32");
  // The pieces travel again; the gradients of the pieces read go back (an earlier rank reads this rank's two, a
  // later rank its first).
  auto size_of = [&](int s) { return (s < r ? 2 : 4) * piece; };
  auto grads_in = [&](int t) { return (t < r ? 4 : 2) * gpiece; };   // from rank t, for this rank's pieces
  auto grads_out = [&](int s) { return (s < r ? 2 : 4) * gpiece; };  // to rank s, for its pieces
  std::vector<int64_t> at(static_cast<size_t>(N), 0), gat(static_cast<size_t>(N), 0), oat(static_cast<size_t>(N), 0);
  int64_t total = 4 * piece, gtotal = 0, ototal = 0;
  for (int s : others(r, N)) {
    at[static_cast<size_t>(s)] = total, total += size_of(s);
    gat[static_cast<size_t>(s)] = gtotal, gtotal += grads_in(s);
    oat[static_cast<size_t>(s)] = ototal, ototal += grads_out(s);
  }
  Buffer host = take(host_, total, "context parallel: keys in flight");
  Buffer gin = take(host_, gtotal, "context parallel: key gradients received");
  Buffer gout = take(host_, ototal, "context parallel: key gradients sent");
  char* hb = host.as<char>();
  std::vector<dist::Request> recvs(static_cast<size_t>(N)), ins(static_cast<size_t>(N)), outs;
  for (int s : others(r, N)) {
    const size_t i = static_cast<size_t>(s);
    recvs[i] = dist::irecv(hb + at[i], size_of(s), base_ + s, tag(layer, kKvBackward));
    ins[i] = dist::irecv(gin.as<char>() + gat[i], grads_in(s), base_ + s, tag(layer, kGrads));
  }
  std::vector<dist::Request> sends = send_pieces(layer, kKvBackward, k, v, hb);
  // The own pieces (dq =, their share into dk, dv, which start at zero).
  KvBlock own[2], down[2];
  own_pieces(k, v, own);
  own_pieces(dk, dv, down);
  ops_.attention_backward(dq, KvBlocks{down, 2, Hkv, T_, D, dk.dtype}, dout, q,
                          KvBlocks{own, 2, Hkv, T_, D, k.dtype, bf16_}, o, lse, pos, scale);
  Buffer part = take(device_,
                     4 * piece + 4 * gpiece + dtype_bytes(dq.dtype, dq.numel()) + dtype_bytes(lse.dtype, H * h),
                     "context parallel: another slice's keys and gradients");
  char* db = part.as<char>();
  char* gb = db + 4 * piece;
  char* dqb = gb + 4 * gpiece;
  char* lb = dqb + dtype_bytes(dq.dtype, dq.numel());
  for (int s : others(r, N)) {
    dist::wait(recvs[static_cast<size_t>(s)]);
    const int pieces = s < r ? 2 : 4;
    ops_.upload(Tensor(db, DType::u8, {pieces * piece}, Tier::Device), hb + at[static_cast<size_t>(s)]);
    const Tensor g(gb, dk.dtype, {pieces * Hkv * h * D}, Tier::Device);
    ops_.zero(g);
    const int32_t p0 = static_cast<int32_t>(s * h), p1 = static_cast<int32_t>((2 * N - 1 - s) * h),
                  len = static_cast<int32_t>(h);
    const KvBlock blk[2] = {KvBlock{db, db + piece, p0, len}, KvBlock{db + 2 * piece, db + 3 * piece, p1, len}};
    const KvBlock gblk[2] = {KvBlock{gb, gb + gpiece, p0, len}, KvBlock{gb + 2 * gpiece, gb + 3 * gpiece, p1, len}};
    const int nb = s < r ? 1 : 2;
    const KvBlocks kv{blk, nb, Hkv, h, D, k.dtype, bf16_}, gk{gblk, nb, Hkv, h, D, dk.dtype};
    if (s < r) {  // every row
      Tensor dq2(dqb, dq.dtype, {dq.dims[0], dq.dims[1], dq.dims[2]}, Tier::Device);
      ops_.attention_backward(dq2, gk, dout, q, kv, o, lse, pos, scale);
      ops_.axpy(dq, 1.0, dq2);
    } else {  // the second piece's rows: their lse gathered into (H, h)
      Tensor dq2(dqb, dq.dtype, {h, dq.dims[1], dq.dims[2]}, Tier::Device);
      Tensor l(lb, lse.dtype, {H, h}, Tier::Device);
      kv_detail::lse_rows(ops_, l, lse, h, h);
      ops_.attention_backward(dq2, gk, rows(dout, h, h), rows(q, h, h), kv, rows(o, h, h), l,
                              rows(pos, h, h), scale);
      const Tensor dq_rows = rows(dq, h, h);
      ops_.axpy(dq_rows, 1.0, dq2);
    }
    char* out = gout.as<char>() + oat[static_cast<size_t>(s)];
    ops_.download(out, g);
    outs.push_back(dist::isend(out, grads_out(s), base_ + s, tag(layer, kGrads)));
  }
  // The other ranks' gradients for this rank's pieces, added in rank order: keys and values of the first piece,
  // then (from an earlier rank) of the second.
  const int64_t half = Hkv * T_ * D;
  Buffer mine = take(host_, dtype_bytes(DType::f32, 2 * half), "context parallel: own key gradients");
  float* m = mine.as<float>();
  ops_.download(m, dk);
  ops_.download(m + half, dv);
  for (int t = 0; t < N; ++t) {
    if (t == r) continue;
    dist::wait(ins[static_cast<size_t>(t)]);
    const float* src = reinterpret_cast<const float*>(gin.as<char>() + gat[static_cast<size_t>(t)]);
    for (int p = 0; p < (t < r ? 4 : 2); ++p)
      for (int64_t g2 = 0; g2 < Hkv; ++g2) {
        float* dst = m + (p % 2) * half + (g2 * T_ + (p / 2) * h) * D;
        const float* add = src + (p * Hkv + g2) * h * D;
        for (int64_t i = 0; i < h * D; ++i) dst[i] += add[i];
      }
  }
  ops_.upload(dk, m);
  ops_.upload(dv, m + half);
  for (dist::Request& x : outs) dist::wait(x);
  for (dist::Request& x : sends) dist::wait(x);
}

}  // namespace oomless
