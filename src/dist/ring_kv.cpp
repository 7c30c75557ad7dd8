#include "dist/ring_kv.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "dist/comm.h"

namespace oomless {

namespace {
// One slice's keys then values of one layer: 2 (Hkv, T, D) elements.
int64_t block_elems(const KvDims& d, int64_t T) { return 2 * d.Hkv * T * d.D; }

// `bytes` of workspace from `arena`, or nothing for none.
Buffer take(Arena& arena, int64_t bytes, const char* what) {
  return bytes > 0 ? arena.alloc(static_cast<size_t>(bytes), Category::workspace, what) : Buffer();
}
}  // namespace

RingKv::RingKv(const KvDims& dims, Ops& ops, Arena& device, Arena& host, int ranks)
    : d_(dims),
      n_(ranks > 0 ? ranks : dist::size()),
      r_(dist::rank() % n_),
      base_(dist::rank() - r_),
      ops_(ops),
      device_(device),
      host_(host) {
  OOM_CHECK(dist::size() % n_ == 0, "[context parallel] rings of ", n_, " ranks out of ", dist::size());
}

void RingKv::begin(int64_t T, int64_t C) {
  OOM_CHECK(C >= T, "[context parallel] a rank's slice is one chunk: chunks of ", C, " for a slice of ", T,
            " tokens");
  T_ = T;
}

void RingKv::set_chunk(int64_t c) { OOM_CHECK(c == 0, "[context parallel] a rank's slice is one chunk, not ", c + 1); }

size_t RingKv::device_bytes(const KvDims& d, int64_t T, DType kv, DType grad) {
  // forward: one earlier block and its partial O and lse; backward: one block, its gradients and a dq
  const int64_t rows = T * d.H * d.D;
  return static_cast<size_t>(std::max(dtype_bytes(kv, block_elems(d, T)) + dtype_bytes(DType::f32, rows + d.H * T),
                                      dtype_bytes(kv, block_elems(d, T)) + dtype_bytes(grad, block_elems(d, T)) +
                                          dtype_bytes(DType::f32, rows)));
}

size_t RingKv::host_bytes(const KvDims& d, int64_t T, int rank, int ranks, DType kv, DType grad) {
  // every message in flight at once: this rank's block and the earlier ones; backward also the earlier blocks'
  // gradients sent and the later ranks' received
  const int64_t b = block_elems(d, T);
  return static_cast<size_t>(dtype_bytes(kv, (rank + 1) * b) + dtype_bytes(grad, (ranks - 1) * b));
}

namespace {
// A message's tag: the layer and what it carries (keys and values forward, again backward, key gradients).
enum Kind { kKvForward = 0, kKvBackward = 1, kGrads = 2 };
int tag(int64_t layer, Kind k) { return static_cast<int>(layer % 8000) * 4 + k; }
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

}  // namespace oomless
