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

RingKv::RingKv(const KvDims& dims, Ops& ops, Arena& device, Arena& host)
    : d_(dims), ops_(ops), device_(device), host_(host) {}

void RingKv::begin(int64_t T, int64_t C) {
  OOM_CHECK(C >= T, "[context parallel] a rank's slice is one chunk: chunks of ", C, " for a slice of ", T,
            " tokens");
  T_ = T;
}

void RingKv::set_chunk(int64_t c) { OOM_CHECK(c == 0, "[context parallel] a rank's slice is one chunk, not ", c + 1); }

size_t RingKv::device_bytes(const KvDims& d, int64_t T, int rank, DType kv, DType grad) {
  return static_cast<size_t>(dtype_bytes(kv, rank * block_elems(d, T)) + dtype_bytes(grad, rank * block_elems(d, T)));
}

size_t RingKv::host_bytes(const KvDims& d, int64_t T, int ranks, DType kv, DType grad) {
  const int64_t b = block_elems(d, T);  // forward: the sent copies and the received blocks; backward: likewise
  return static_cast<size_t>(std::max(dtype_bytes(kv, (ranks - 1) * b), dtype_bytes(grad, ranks * b)));
}

KvBlocks RingKv::gather(Tensor k, Tensor v, Buffer* held, std::vector<KvBlock>* blocks) {
  const int N = dist::size(), r = dist::rank();
  const int64_t half = d_.Hkv * T_ * d_.D, bytes = dtype_bytes(k.dtype, half), blk = 2 * bytes;
  // This rank's block to every later rank; every earlier rank's from it.
  std::vector<int64_t> send(static_cast<size_t>(N), 0), recv(static_cast<size_t>(N), 0);
  for (int s = 0; s < N; ++s) {
    if (s > r) send[static_cast<size_t>(s)] = blk;
    if (s < r) recv[static_cast<size_t>(s)] = blk;
  }
  // This rank's block once for each later rank (what goes through MPI lives in host memory).
  Buffer out = take(host_, blk * (N - 1 - r), "context parallel: keys sent");
  Buffer in = take(host_, blk * r, "context parallel: keys received");
  if (r + 1 < N) {
    ops_.download(out.data(), k);
    ops_.download(out.as<char>() + bytes, v);
    for (int s = 1; s < N - 1 - r; ++s) std::memcpy(out.as<char>() + s * blk, out.data(), static_cast<size_t>(blk));
  }
  dist::exchange(out.data(), send, in.data(), recv);
  *held = take(device_, blk * r, "context parallel: earlier keys");
  blocks->clear();
  for (int s = 0; s < r; ++s) {
    char* at = held->as<char>() + s * blk;
    ops_.upload(Tensor(at, DType::u8, {blk}, Tier::Device), in.as<char>() + s * blk);
    blocks->push_back(KvBlock{at, at + bytes, static_cast<int32_t>(s * T_), static_cast<int32_t>(T_)});
  }
  blocks->push_back(KvBlock{k.data, v.data, static_cast<int32_t>(r * T_), static_cast<int32_t>(T_)});
  return KvBlocks{blocks->data(), r + 1, d_.Hkv, T_, d_.D, k.dtype, bf16_};
}

void RingKv::forward(int64_t, Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, Tensor pos) {
  Buffer held;
  std::vector<KvBlock> blocks;
  const KvBlocks kv = gather(k, v, &held, &blocks);
  ops_.attention_forward(o, lse, q, kv, pos, 1.0 / std::sqrt(static_cast<double>(d_.D)));
}

void RingKv::backward(int64_t, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor o,
                      Tensor lse, Tensor pos) {
  const int N = dist::size(), r = dist::rank();
  Buffer held;
  std::vector<KvBlock> blocks;
  const KvBlocks kv = gather(k, v, &held, &blocks);
  // The earlier blocks' gradients from zero; the own block's into dk, dv (which start at zero).
  const int64_t half = d_.Hkv * T_ * d_.D, gbytes = dtype_bytes(dk.dtype, half), gblk = 2 * gbytes;
  Buffer grads = take(device_, gblk * r, "context parallel: earlier keys' gradients");
  if (r > 0) ops_.zero(Tensor(grads.data(), DType::u8, {gblk * r}, Tier::Device));
  std::vector<KvBlock> gblocks;
  for (int s = 0; s < r; ++s) {
    char* at = grads.as<char>() + s * gblk;
    gblocks.push_back(KvBlock{at, at + gbytes, blocks[static_cast<size_t>(s)].start, blocks[static_cast<size_t>(s)].len});
  }
  gblocks.push_back(KvBlock{dk.data, dv.data, static_cast<int32_t>(r * T_), static_cast<int32_t>(T_)});
  ops_.attention_backward(dq, KvBlocks{gblocks.data(), r + 1, d_.Hkv, T_, d_.D, dk.dtype}, dout, q, kv, o, lse, pos,
                          1.0 / std::sqrt(static_cast<double>(d_.D)));
  // Each earlier block's gradient to its rank; the later ranks' for this rank's keys, added in rank order.
  std::vector<int64_t> send(static_cast<size_t>(N), 0), recv(static_cast<size_t>(N), 0);
  for (int s = 0; s < N; ++s) {
    if (s < r) send[static_cast<size_t>(s)] = gblk;
    if (s > r) recv[static_cast<size_t>(s)] = gblk;
  }
  Buffer out = take(host_, gblk * r, "context parallel: gradients sent");
  Buffer in = take(host_, gblk * (N - r), "context parallel: gradients received");
  if (r > 0) ops_.download(out.data(), Tensor(grads.data(), DType::u8, {gblk * r}, Tier::Device));
  grads = Buffer();
  dist::exchange(out.data(), send, in.as<char>() + gblk, recv);
  if (r + 1 == N) return;
  // in: this rank's own sums first, then the later ranks' blocks in rank order.
  float* mine = in.as<float>();
  ops_.download(mine, dk);
  ops_.download(mine + half, dv);
  OOM_CHECK(dk.dtype == DType::f32, "[context parallel] key gradients are f32");
  for (int s = r + 1; s < N; ++s) {
    const float* add = in.as<float>() + (s - r) * 2 * half;
    for (int64_t i = 0; i < 2 * half; ++i) mine[i] += add[i];
  }
  ops_.upload(dk, mine);
  ops_.upload(dv, mine + half);
}

}  // namespace oomless
