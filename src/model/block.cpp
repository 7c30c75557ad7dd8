// One Llama block, forward and backward, through Ops. Keys and values are laid out per kv head,
// (Hkv, P, D), the block layout the attention kernel reads; each kv head's projection is its own GEMM
// writing straight into that layout (a contiguous slice of W's rows), so no transpose is needed and a
// KV cache or page is filled in place.
#include <cmath>

#include "model/model.h"
#include "model/model_detail.h"

namespace oomless {

namespace {

// Head h of a (Hkv, P, D) buffer, slots t0 .. t0+T-1, as (T, D).
Tensor head(const Tensor& kv, int64_t h, int64_t P, int64_t t0, int64_t T, int64_t D) {
  return Tensor(kv, dtype_bytes(kv.dtype, (h * P + t0) * D), kv.dtype, {T, D});
}

Tensor mat(const Tensor& t, int64_t r, int64_t c) { return Tensor(t, t.dtype, {r, c}); }

// Head h of DoRA's (Hkv, T, D) unscaled k or v, or empty.
Tensor z_head(const Tensor& z, int64_t h, int64_t T, int64_t D) {
  return z.data ? head(z, h, T, 0, T, D) : Tensor();
}

}  // namespace

void Model::block_forward(int64_t layer, Acts& a, const KvSlots& kv, Tensor pos, Tensor x_out, Pass pass) {
  const LayerParams& P = params_.layers[static_cast<size_t>(layer)];
  const int64_t T = a.x_in.dims[0], E = cfg_.E, H = cfg_.H, Hkv = cfg_.Hkv, D = cfg_.D;
  const int64_t Pk = kv.k.dims[1], t0 = kv.t0;
  const double eps = cfg_.rms_eps;
  auto lin = [&](Proj p) { return linear(layer, p); };
  auto u_of = [&](Proj p) { return a.u[static_cast<int>(p)]; };
  auto z_of = [&](Proj p) { return a.z[static_cast<int>(p)]; };
  // A whole projection: its adapter's u = s x A^T, then the projection itself.
  auto whole = [&](const Linear& L, Proj p, Tensor y, Tensor x, Tensor x_op) {
    if (L.lora()) lora_down(L, u_of(p), x, x_op);
    project(L, y, x, x_op, u_of(p), z_of(p));
  };

  ops_.rmsnorm_forward(a.h1, a.rstd1, a.x_in, P.in_norm, eps);
  Tensor h1 = as_operand(a.h1, 0);

  // Queries: projection [-> per-head RMSNorm (Qwen3)] -> RoPE.
  Tensor q2 = mat(a.q, T, H * D);
  if (pass != Pass::kv_only) {
    whole(lin(Proj::q), Proj::q, cfg_.qk_norm ? mat(a.q_pre, T, H * D) : q2, a.h1, h1);
    if (cfg_.qk_norm)
      ops_.rmsnorm_forward(mat(a.q, T * H, D), a.q_rstd, mat(a.q_pre, T * H, D), P.q_norm, eps);
    ops_.rope_forward(a.q, a.q, pos, cfg_.rope);
    // --act-dtype: attention's inputs are rounded to their stored copies before it runs, so the backward
    // reads the q, k, v the forward's LSE was taken over.
    if (pass == Pass::full) stash_in_place(layer, ActKind::q, a.q);
  }

  // Keys and values, one kv head (D rows of each projection) at a time, into (Hkv, P, D); an adapter's
  // x A^T once for all heads.
  const Linear K = lin(Proj::k), V = lin(Proj::v);
  if (K.lora()) lora_down(K, u_of(Proj::k), a.h1, h1);
  if (V.lora()) lora_down(V, u_of(Proj::v), a.h1, h1);
  // A cache in a narrower dtype (generate --kv-dtype bf16|fp8|int8): the keys and values are made in a.k / a.v
  // and stored rounded (fp8 / int8 with a scale per head and position); attention then reads every
  // position, this pass's too, from the cache.
  const bool staged = kv.k.dtype != act_;
  // Store head h's keys and values (T positions, made in kh / vh) into the cache, rounded if it is narrower.
  auto store = [&](int64_t h, Tensor kh, Tensor vh) {
    if (staged && kv.k_scale.data) {
      ops_.cast_rows_scaled(head(kv.k, h, Pk, t0, T, D), span_of(kv.k_scale, h * Pk + t0, T), kh);
      ops_.cast_rows_scaled(head(kv.v, h, Pk, t0, T, D), span_of(kv.v_scale, h * Pk + t0, T), vh);
    } else if (staged) {
      ops_.convert(head(kv.k, h, Pk, t0, T, D), kh);
      ops_.convert(head(kv.v, h, Pk, t0, T, D), vh);
    } else {
      ops_.copy(head(kv.k, h, Pk, t0, T, D), kh);
      ops_.copy(head(kv.v, h, Pk, t0, T, D), vh);
    }
  };
  if (T == 1 && pass == Pass::full) {
    // One position (a decode step): (Hkv, 1, D) is the projection's (1, Hkv D) row, so the keys and values of
    // every kv head are one product each (every output is its own one-row dot: the bits of a product a head),
    // normed and rotated in one call each, then stored a head at a time.
    auto row = [&](const Tensor& t) { return t.data ? mat(t, 1, Hkv * D) : Tensor(); };
    const Tensor k_all(a.k, a.k.dtype, {1, Hkv, D});
    project(K, cfg_.qk_norm ? row(a.k_pre) : row(a.k), a.h1, h1, u_of(Proj::k), row(z_of(Proj::k)));
    if (cfg_.qk_norm) ops_.rmsnorm_forward(mat(a.k, Hkv, D), a.k_rstd, mat(a.k_pre, Hkv, D), P.k_norm, eps);
    ops_.rope_forward(k_all, k_all, pos, cfg_.rope);
    project(V, row(a.v), a.h1, h1, u_of(Proj::v), row(z_of(Proj::v)));
    if (staged) {
      for (int64_t h = 0; h < Hkv; ++h) store(h, head(a.k, h, 1, 0, 1, D), head(a.v, h, 1, 0, 1, D));
    } else {  // row h of (Hkv, D) to position t0 of cache head h: one strided copy each
      const int64_t span = (Hkv - 1) * Pk * D + D;
      ops_.copy_rows(Tensor(kv.k, dtype_bytes(kv.k.dtype, t0 * D), kv.k.dtype, {span}), Pk * D, a.k, D, Hkv, D);
      ops_.copy_rows(Tensor(kv.v, dtype_bytes(kv.v.dtype, t0 * D), kv.v.dtype, {span}), Pk * D, a.v, D, Hkv, D);
    }
  }
  for (int64_t h = 0; h < Hkv && !(T == 1 && pass == Pass::full); ++h) {
    Tensor kh = staged ? head(a.k, h, T, 0, T, D) : head(kv.k, h, Pk, t0, T, D);
    Tensor vh = staged ? head(a.v, h, T, 0, T, D) : head(kv.v, h, Pk, t0, T, D);
    Tensor klin = cfg_.qk_norm ? head(a.k_pre, h, T, 0, T, D) : kh;
    project(K.rows(h * D, D), klin, a.h1, h1, u_of(Proj::k), z_head(z_of(Proj::k), h, T, D));
    if (cfg_.qk_norm) ops_.rmsnorm_forward(kh, span_of(a.k_rstd, h * T, T), klin, P.k_norm, eps);
    Tensor kh3(kh, kh.dtype, {T, int64_t{1}, D});
    ops_.rope_forward(kh3, kh3, pos, cfg_.rope);
    project(V.rows(h * D, D), vh, a.h1, h1, u_of(Proj::v), z_head(z_of(Proj::v), h, T, D));
    if (staged) store(h, kh, vh);
  }

  if (pass == Pass::full || pass == Pass::kv_only) {
    stash_in_place(layer, ActKind::k, a.k);
    stash_in_place(layer, ActKind::v, a.v);
  }

  if (pass == Pass::kv_only) return;
  if (chunk_kv_) {
    if (pass != Pass::recompute_keep_attention) chunk_kv_->forward(layer, a.o, a.lse, a.q, a.k, a.v, pos);
  } else {
    KvBlock blk{kv.k.data, kv.v.data, 0, static_cast<int32_t>(t0 + T)};
    blk.k_rows = static_cast<const float*>(kv.k_scale.data);
    blk.v_rows = static_cast<const float*>(kv.v_scale.data);
    KvBlocks blocks{&blk, 1, Hkv, Pk, D, kv.k.dtype, opt_.dtype == ComputeDType::bf16};
    ops_.attention_forward(a.o, a.lse, a.q, blocks, pos, 1.0 / std::sqrt(static_cast<double>(D)));
  }

  Tensor proj = mat(s_->proj, T, E);
  whole(lin(Proj::o), Proj::o, proj, mat(a.o, T, H * D), as_operand(mat(a.o, T, H * D), 0));
  ops_.add(a.x_mid, a.x_in, proj);

  ops_.rmsnorm_forward(a.h2, a.rstd2, a.x_mid, P.post_norm, eps);
  Tensor h2 = as_operand(a.h2, 0);
  whole(lin(Proj::gate), Proj::gate, a.gate, a.h2, h2);
  whole(lin(Proj::up), Proj::up, a.up, a.h2, h2);
  ops_.swiglu_forward(a.act, a.gate, a.up);
  const Linear Dn = lin(Proj::down);
  if (pass != Pass::full && !Dn.dora()) {
    if (Dn.lora()) lora_down(Dn, u_of(Proj::down), a.act, as_operand(a.act, 0));  // the backward needs it
    return;
  }
  // (A recompute with DoRA on down_proj runs it too: the backward needs its unscaled output.)
  whole(Dn, Proj::down, proj, a.act, as_operand(a.act, 0));
  if (pass != Pass::full) return;
  ops_.add(x_out, a.x_mid, proj);
}

void Model::recompute_for_backward(int64_t layer, Acts& a, Tensor pos) {
  const LayerParams& P = params_.layers[static_cast<size_t>(layer)];
  const int64_t T = a.x_in.dims[0], H = cfg_.H, Hkv = cfg_.Hkv, D = cfg_.D;
  const double eps = cfg_.rms_eps;
  switch (save_policy(layer)) {
    case SavePolicy::all:
      return;
    case SavePolicy::none: {
      KvSlots kv{a.k, a.v, 0};
      block_forward(layer, a, kv, pos, Tensor(), chunk_kv_ ? Pass::recompute_keep_attention : Pass::recompute);
      return;
    }
    case SavePolicy::selective:
      // Norms and the SwiGLU product from the kept residual states and matmul outputs; the same kernels on
      // the same inputs, so the same bits as the first forward.
      ops_.rmsnorm_forward(a.h1, a.rstd1, a.x_in, P.in_norm, eps);
      ops_.rmsnorm_forward(a.h2, a.rstd2, a.x_mid, P.post_norm, eps);
      ops_.swiglu_forward(a.act, a.gate, a.up);
      if (cfg_.qk_norm) {
        ops_.rmsnorm_forward(mat(s_->tmp_rows, T * H, D), a.q_rstd, mat(a.q_pre, T * H, D), P.q_norm, eps);
        ops_.rmsnorm_forward(mat(s_->tmp_rows, Hkv * T, D), a.k_rstd, mat(a.k_pre, Hkv * T, D), P.k_norm, eps);
      }
      return;
  }
}

void Model::block_backward(int64_t layer, Acts& a, Tensor pos, Tensor dx) {
  const LayerParams& P = params_.layers[static_cast<size_t>(layer)];
  const LayerParams& G = grads_ ? grads_->layers[static_cast<size_t>(layer)] : no_grads_;  // frozen: all empty
  Scratch& s = *s_;
  const int64_t T = a.x_in.dims[0], E = cfg_.E, F = cfg_.F, H = cfg_.H, Hkv = cfg_.Hkv, D = cfg_.D;
  auto view = [](const Tensor& t, std::initializer_list<int64_t> shape) { return Tensor(t, t.dtype, shape); };
  Tensor dh = view(s.dh, {T, E}), dxn = view(s.dxn, {T, E});
  Tensor dgate = view(s.dgate, {T, F}), dup = view(s.dup, {T, F}), dact = view(s.dact, {T, F});
  if (lora_r_) s.du[0] = view(s.du[0], {T, lora_r_}), s.du[1] = view(s.du[1], {T, lora_r_});
  // DoRA with dropout (dora_dropout_backward) gathers (g dy - dy) W for the adapter's input gradient in t.
  auto t_for = [&](const Linear& L, const Tensor& buf, int64_t K) {
    return L.dora() && dropout_on() ? Tensor(buf, act_, {T, K}) : Tensor();
  };
  // A whole projection's backward: output gradient dy (DoRA's g * dy into dz), input x / x_op, input
  // gradient dx_in (=|+=).
  auto whole = [&](Proj p, Tensor dy, Tensor dz, Tensor x, Tensor x_op, Tensor dx_in, bool dx_acc) {
    const Linear L = linear(layer, p);
    const int i = static_cast<int>(p);
    Tensor t = t_for(L, s.dora_t, x.dims[1]);
    project_backward(L, dy, dz, x_op, dx_in, dx_acc, a.u[i], a.z[i], s.du[0], false, t, false);
    if (L.lora()) lora_backward_input(L, dx_in, s.du[0], x, x_op, t);
  };
  // o_proj / down_proj: their dy is the residual's gradient, kept, so DoRA's g * dy goes to a scratch.
  Tensor dz = s.dz.data ? view(s.dz, {T, E}) : Tensor();

  // MLP: x_out = x_mid + down(silu(gate(h2)) * up(h2)).
  whole(Proj::down, dx, dz, a.act, as_operand(a.act, 1), dact, false);
  ops_.swiglu_backward(dgate, dup, dact, a.gate, a.up);
  Tensor h2 = as_operand(a.h2, 1);
  whole(Proj::gate, dgate, dgate, a.h2, h2, dh, false);
  whole(Proj::up, dup, dup, a.h2, h2, dh, true);
  ops_.rmsnorm_backward(dxn, G.post_norm, dh, a.x_mid, P.post_norm, a.rstd2);
  ops_.add(dx, dx, dxn);

  // Attention output projection: x_mid = x_in + o_proj(o).
  Tensor d_o = view(s.d_o, {T, H, D});
  whole(Proj::o, dx, dz, mat(a.o, T, H * D), as_operand(mat(a.o, T, H * D), 1), mat(d_o, T, H * D), false);

  // Attention; dK/dV accumulate, so start from zero.
  Tensor dq = view(s.dq, {T, H, D}), dk = view(s.dk, {Hkv, T, D}), dv = view(s.dv, {Hkv, T, D});
  ops_.fill(dk, 0.0);
  ops_.fill(dv, 0.0);
  if (chunk_kv_) {
    chunk_kv_->backward(layer, dq, dk, dv, d_o, a.q, a.k, a.v, a.o, a.lse, pos);
  } else {
    KvBlock kb{a.k.data, a.v.data, 0, static_cast<int32_t>(T)};
    KvBlocks kv{&kb, 1, Hkv, T, D, a.k.dtype, opt_.dtype == ComputeDType::bf16};
    KvBlock dkb{dk.data, dv.data, 0, static_cast<int32_t>(T)};
    KvBlocks dkv{&dkb, 1, Hkv, T, D, act_};
    ops_.attention_backward(dq, dkv, d_o, a.q, kv, a.o, a.lse, pos, 1.0 / std::sqrt(static_cast<double>(D)));
  }

  // RoPE, then the Qwen3 per-head norms, backwards.
  ops_.rope_backward(dq, dq, pos, cfg_.rope);
  for (int64_t h = 0; h < Hkv; ++h) {
    Tensor dkh(head(dk, h, T, 0, T, D), act_, {T, int64_t{1}, D});
    ops_.rope_backward(dkh, dkh, pos, cfg_.rope);
  }
  Tensor dq_lin = dq, dk_lin = dk;
  if (cfg_.qk_norm) {
    dq_lin = view(s.dq_pre, {T, H, D});
    dk_lin = view(s.dk_pre, {Hkv, T, D});
    ops_.rmsnorm_backward(mat(dq_lin, T * H, D), G.q_norm, mat(dq, T * H, D), mat(a.q_pre, T * H, D), P.q_norm,
                          a.q_rstd);
    ops_.rmsnorm_backward(mat(dk_lin, Hkv * T, D), G.k_norm, mat(dk, Hkv * T, D), mat(a.k_pre, Hkv * T, D),
                          P.k_norm, a.k_rstd);
  }

  // Projections: dh1 = dq . Wq + sum over kv heads of (dk_h . Wk_h + dv_h . Wv_h).
  Tensor h1 = as_operand(a.h1, 1);
  whole(Proj::q, mat(dq_lin, T, H * D), mat(dq_lin, T, H * D), a.h1, h1, dh, false);
  const Linear K = linear(layer, Proj::k), V = linear(layer, Proj::v);
  Tensor tk = t_for(K, s.dora_t, E), tv = t_for(V, s.dora_t2, E);
  for (int64_t h = 0; h < Hkv; ++h) {
    Tensor dkh = head(dk_lin, h, T, 0, T, D), dvh = head(dv, h, T, 0, T, D);
    project_backward(K.rows(h * D, D), dkh, dkh, h1, dh, true, a.u[1], z_head(a.z[1], h, T, D), s.du[0], h > 0, tk,
                     h > 0);
    project_backward(V.rows(h * D, D), dvh, dvh, h1, dh, true, a.u[2], z_head(a.z[2], h, T, D), s.du[1], h > 0, tv,
                     h > 0);
  }
  if (K.lora()) lora_backward_input(K, dh, s.du[0], a.h1, h1, tk);
  if (V.lora()) lora_backward_input(V, dh, s.du[1], a.h1, h1, tv);
  ops_.rmsnorm_backward(dxn, G.in_norm, dh, a.x_in, P.in_norm, a.rstd1);
  ops_.add(dx, dx, dxn);
}

}  // namespace oomless
