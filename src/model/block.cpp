// One Llama block, forward and backward, through Ops. Keys and values are laid out per kv head,
// (Hkv, P, D), the block layout the attention kernel reads; each kv head's projection is its own GEMM
// writing straight into that layout (a contiguous slice of W's rows), so no transpose is needed and a
// KV cache or page is filled in place.
#include <cmath>

#include "model/model.h"
#include "model/model_detail.h"

namespace oomless {

namespace {

// Rows [r0, r0 + n) of a row-major matrix with `cols` columns, as an (n, cols) view (empty stays empty).
Tensor rows(const Tensor& t, int64_t r0, int64_t n, int64_t cols) {
  if (t.quant) {
    Tensor r(nullptr, t.dtype, {n, cols});
    r.quant = t.quant, r.qrow0 = t.qrow0 + r0, r.as_bf16 = t.as_bf16;
    return r;
  }
  if (!t.data) return Tensor();
  char* p = static_cast<char*>(t.data) + dtype_bytes(t.dtype, r0 * cols);
  Tensor r(p, t.dtype, {n, cols});
  r.as_bf16 = t.as_bf16;
  return r;
}

// Elements [e0, e0 + n) of a vector.
Tensor span(const Tensor& t, int64_t e0, int64_t n) {
  if (!t.data) return Tensor();
  char* p = static_cast<char*>(t.data) + dtype_bytes(t.dtype, e0);
  return Tensor(p, t.dtype, {n});
}

// Head h of a (Hkv, P, D) buffer, slots t0 .. t0+T-1, as (T, D).
Tensor head(const Tensor& kv, int64_t h, int64_t P, int64_t t0, int64_t T, int64_t D) {
  char* p = static_cast<char*>(kv.data) + dtype_bytes(kv.dtype, (h * P + t0) * D);
  return Tensor(p, kv.dtype, {T, D});
}

Tensor mat(const Tensor& t, int64_t r, int64_t c) { return Tensor(t.data, t.dtype, {r, c}); }

// Head h of DoRA's (Hkv, T, D) unscaled k or v, or empty.
Tensor z_head(const Tensor& z, int64_t h, int64_t T, int64_t D) {
  return z.data ? head(z, h, T, 0, T, D) : Tensor();
}

}  // namespace

const LayerParams& Model::wc(int64_t layer) const {
  return wread_[static_cast<size_t>(layer)];
}

void Model::block_forward(int64_t layer, Acts& a, const KvSlots& kv, Tensor pos, Tensor x_out, Pass pass) {
  const LayerParams& P = params_.layers[static_cast<size_t>(layer)];
  const LayerParams& C = wc(layer);
  const int64_t T = a.x_in.dims[0], E = cfg_.E, H = cfg_.H, Hkv = cfg_.Hkv, D = cfg_.D;
  const int64_t Pk = kv.k.dims[1], t0 = kv.t0;
  const double eps = cfg_.rms_eps;

  ops_.rmsnorm_forward(a.h1, a.rstd1, a.x_in, P.in_norm, eps);
  Tensor h1 = as_operand(a.h1, 0);
  // An adapted projection's output y (holding x W^T, with its bias unless DoRA): + s u B^T, then DoRA's scale
  // and bias; with DoRA and dropout in training PEFT's form (dora_dropout_forward).
  auto adapt = [&](Proj p, Tensor y, Tensor x, Tensor w, Tensor u, Tensor z, Tensor b, int64_t r0) {
    if (!lora_on(layer, p)) return;
    if (dora_on(layer, p) && dropout_on()) return dora_dropout_forward(layer, p, y, x, w, u, z, b, r0);
    lora_up(layer, p, y, u, r0);
    if (dora_on(layer, p)) dora_forward(layer, p, y, z, b, r0);
  };

  // Queries: projection [-> per-head RMSNorm (Qwen3)] -> RoPE.
  Tensor q2 = mat(a.q, T, H * D);
  if (pass != Pass::kv_only) {
    Tensor qlin = cfg_.qk_norm ? mat(a.q_pre, T, H * D) : q2;
    const bool dq = dora_on(layer, Proj::q);  // DoRA adds the bias after its scale
    linear_forward(qlin, h1, C.wq, dq ? Tensor() : P.bq);
    if (lora_on(layer, Proj::q)) lora_down(layer, Proj::q, a.u[0], a.h1, h1);
    adapt(Proj::q, qlin, a.h1, C.wq, a.u[0], a.z[0], P.bq, 0);
    if (cfg_.qk_norm)
      ops_.rmsnorm_forward(mat(a.q, T * H, D), a.q_rstd, mat(a.q_pre, T * H, D), P.q_norm, eps);
    ops_.rope_forward(a.q, a.q, pos, cfg_.rope);
  }

  // Keys and values, one kv head at a time, into (Hkv, P, D); a LoRA's x A^T once for all heads.
  const bool lk = lora_on(layer, Proj::k), lv = lora_on(layer, Proj::v);
  const bool dk = dora_on(layer, Proj::k), dv = dora_on(layer, Proj::v);
  if (lk) lora_down(layer, Proj::k, a.u[1], a.h1, h1);
  if (lv) lora_down(layer, Proj::v, a.u[2], a.h1, h1);
  for (int64_t h = 0; h < Hkv; ++h) {
    Tensor kh = head(kv.k, h, Pk, t0, T, D);
    Tensor wk = rows(C.wk, h * D, D, E), wv = rows(C.wv, h * D, D, E);
    Tensor klin = cfg_.qk_norm ? head(a.k_pre, h, T, 0, T, D) : kh;
    linear_forward(klin, h1, wk, dk ? Tensor() : span(P.bk, h * D, D));
    adapt(Proj::k, klin, a.h1, wk, a.u[1], z_head(a.z[1], h, T, D), span(P.bk, h * D, D), h * D);
    if (cfg_.qk_norm) ops_.rmsnorm_forward(kh, span(a.k_rstd, h * T, T), klin, P.k_norm, eps);
    Tensor kh3(kh.data, kh.dtype, {T, int64_t{1}, D});
    ops_.rope_forward(kh3, kh3, pos, cfg_.rope);
    Tensor vh = head(kv.v, h, Pk, t0, T, D);
    linear_forward(vh, h1, wv, dv ? Tensor() : span(P.bv, h * D, D));
    adapt(Proj::v, vh, a.h1, wv, a.u[2], z_head(a.z[2], h, T, D), span(P.bv, h * D, D), h * D);
  }

  if (pass == Pass::kv_only) return;
  if (chunk_kv_) {
    if (pass != Pass::recompute_keep_attention) chunk_kv_->forward(layer, a.o, a.lse, a.q, a.k, a.v, pos);
  } else {
    KvBlock blk{kv.k.data, kv.v.data, 0, static_cast<int32_t>(t0 + T)};
    KvBlocks blocks{&blk, 1, Hkv, Pk, D, kv.k.dtype};
    ops_.attention_forward(a.o, a.lse, a.q, blocks, pos, 1.0 / std::sqrt(static_cast<double>(D)));
  }

  Tensor proj = mat(s_->proj, T, E);
  Tensor o_op = as_operand(mat(a.o, T, H * D), 0);
  const bool d_o = dora_on(layer, Proj::o);
  linear_forward(proj, o_op, C.wo, d_o ? Tensor() : P.bo);
  if (lora_on(layer, Proj::o)) lora_down(layer, Proj::o, a.u[3], mat(a.o, T, H * D), o_op);
  adapt(Proj::o, proj, mat(a.o, T, H * D), C.wo, a.u[3], a.z[3], P.bo, 0);
  ops_.add(a.x_mid, a.x_in, proj);

  ops_.rmsnorm_forward(a.h2, a.rstd2, a.x_mid, P.post_norm, eps);
  Tensor h2 = as_operand(a.h2, 0);
  linear_forward(a.gate, h2, C.wg, Tensor());
  linear_forward(a.up, h2, C.wu, Tensor());
  for (Proj p : {Proj::gate, Proj::up}) {
    if (!lora_on(layer, p)) continue;
    Tensor u = a.u[static_cast<int>(p)];
    lora_down(layer, p, u, a.h2, h2);
    adapt(p, p == Proj::gate ? a.gate : a.up, a.h2, p == Proj::gate ? C.wg : C.wu, u, a.z[static_cast<int>(p)], Tensor(), 0);
  }
  ops_.swiglu_forward(a.act, a.gate, a.up);
  const bool ld = lora_on(layer, Proj::down), dd = dora_on(layer, Proj::down);
  if (pass != Pass::full && !dd) {
    if (ld) lora_down(layer, Proj::down, a.u[6], a.act, as_operand(a.act, 0));  // the backward needs it
    return;
  }
  // (A recompute with DoRA on down_proj runs it too: the backward needs its unscaled output.)
  Tensor act_op = as_operand(a.act, 0);
  linear_forward(proj, act_op, C.wd, Tensor());
  if (ld) lora_down(layer, Proj::down, a.u[6], a.act, act_op);
  adapt(Proj::down, proj, a.act, C.wd, a.u[6], a.z[6], Tensor(), 0);
  if (pass != Pass::full) return;
  ops_.add(x_out, a.x_mid, proj);
}

void Model::recompute_for_backward(int64_t layer, Acts& a, Tensor pos) {
  const LayerParams& P = params_.layers[static_cast<size_t>(layer)];
  const int64_t T = a.x_in.dims[0], H = cfg_.H, Hkv = cfg_.Hkv, D = cfg_.D;
  const double eps = cfg_.rms_eps;
  switch (opt_.save) {
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
  const LayerParams& C = wc(layer);
  const LayerParams& G = grads_ ? grads_->layers[static_cast<size_t>(layer)] : no_grads_;  // frozen: all empty
  Scratch& s = *s_;
  const int64_t T = a.x_in.dims[0], E = cfg_.E, F = cfg_.F, H = cfg_.H, Hkv = cfg_.Hkv, D = cfg_.D;
  auto view = [](const Tensor& t, std::initializer_list<int64_t> shape) { return Tensor(t.data, t.dtype, shape); };
  Tensor dh = view(s.dh, {T, E}), dxn = view(s.dxn, {T, E});
  Tensor dgate = view(s.dgate, {T, F}), dup = view(s.dup, {T, F}), dact = view(s.dact, {T, F});
  // A whole adapted projection's LoRA backward: its output gradient dy_op, input x_op, input gradient dx_in.
  auto lora = [&](Proj p, Tensor dx_in, Tensor dy_op, Tensor x, Tensor x_op) {
    if (!lora_on(layer, p)) return;
    lora_backward_rows(layer, p, s.du[0], dy_op, a.u[static_cast<int>(p)], 0, false);
    lora_backward_input(layer, p, dx_in, s.du[0], x, x_op);
  };
  if (lora_r_) s.du[0] = view(s.du[0], {T, lora_r_}), s.du[1] = view(s.du[1], {T, lora_r_});

  // DoRA on o_proj / down_proj: their dy is the residual's gradient, so g * dy goes to a scratch.
  Tensor dz = s.dz.data ? view(s.dz, {T, E}) : Tensor();
  auto residual_dy = [&](Proj p, int z) {
    if (!dora_on(layer, p)) return as_operand(dx, 0);
    dora_backward(layer, p, dz, dx, a.z[z], 0);
    return as_operand(dz, 0);
  };

  // DoRA with dropout in training (dora_dropout_backward), for a whole projection: dy (kept), input x / x_op,
  // input gradient dx (=|+=).
  const bool dora_drop = dora_ && dropout_on();
  auto dora_drop_whole = [&](Proj p, Tensor dy, int z, Tensor w, Tensor dx_in, bool dx_acc, Tensor x, Tensor x_op) {
    Tensor t(s.dora_t.data, act_, {T, x.dims[1]});
    dora_dropout_backward(layer, p, dy, a.z[z], w, a.u[z], dx_in, dx_acc, t, false, s.du[0], false, 0);
    lora_backward_input(layer, p, dx_in, s.du[0], x, x_op, t);
  };

  // MLP: x_out = x_mid + down(silu(gate(h2)) * up(h2)).
  Tensor act_op = as_operand(a.act, 1);
  if (dora_drop && dora_on(layer, Proj::down)) {
    dora_drop_whole(Proj::down, dx, 6, C.wd, dact, false, a.act, act_op);
  } else {
    Tensor dx_op = residual_dy(Proj::down, 6);
    linear_backward_input(dact, dx_op, C.wd, false);
    linear_backward_weight(G.wd, dx_op, act_op);
    lora(Proj::down, dact, dx_op, a.act, act_op);
  }
  ops_.swiglu_backward(dgate, dup, dact, a.gate, a.up);
  Tensor h2 = as_operand(a.h2, 1);
  if (dora_drop && dora_on(layer, Proj::gate)) {
    dora_drop_whole(Proj::gate, dgate, 4, C.wg, dh, false, a.h2, h2);
  } else {
    if (dora_on(layer, Proj::gate)) dora_backward(layer, Proj::gate, dgate, dgate, a.z[4], 0);
    Tensor g_op = as_operand(dgate, 0);
    linear_backward_input(dh, g_op, C.wg, false);
    linear_backward_weight(G.wg, g_op, h2);
    lora(Proj::gate, dh, g_op, a.h2, h2);
  }
  if (dora_drop && dora_on(layer, Proj::up)) {
    dora_drop_whole(Proj::up, dup, 5, C.wu, dh, true, a.h2, h2);
  } else {
    if (dora_on(layer, Proj::up)) dora_backward(layer, Proj::up, dup, dup, a.z[5], 0);
    Tensor u_op = as_operand(dup, 0);
    linear_backward_input(dh, u_op, C.wu, true);
    linear_backward_weight(G.wu, u_op, h2);
    lora(Proj::up, dh, u_op, a.h2, h2);
  }
  ops_.rmsnorm_backward(dxn, G.post_norm, dh, a.x_mid, P.post_norm, a.rstd2);
  ops_.add(dx, dx, dxn);

  // Attention output projection: x_mid = x_in + o_proj(o).
  Tensor d_o = view(s.d_o, {T, H, D});
  Tensor o_op = as_operand(mat(a.o, T, H * D), 1);
  if (dora_drop && dora_on(layer, Proj::o)) {
    dora_drop_whole(Proj::o, dx, 3, C.wo, mat(d_o, T, H * D), false, mat(a.o, T, H * D), o_op);
  } else {
    Tensor dx_op = residual_dy(Proj::o, 3);
    linear_backward_input(mat(d_o, T, H * D), dx_op, C.wo, false);
    linear_backward_weight(G.wo, dx_op, o_op);
    lora(Proj::o, mat(d_o, T, H * D), dx_op, mat(a.o, T, H * D), o_op);
  }
  bias_backward(G.bo, dx);

  // Attention; dK/dV accumulate, so start from zero.
  Tensor dq = view(s.dq, {T, H, D}), dk = view(s.dk, {Hkv, T, D}), dv = view(s.dv, {Hkv, T, D});
  ops_.fill(dk, 0.0);
  ops_.fill(dv, 0.0);
  if (chunk_kv_) {
    chunk_kv_->backward(layer, dq, dk, dv, d_o, a.q, a.k, a.v, a.o, a.lse, pos);
  } else {
    KvBlock kb{a.k.data, a.v.data, 0, static_cast<int32_t>(T)};
    KvBlocks kv{&kb, 1, Hkv, T, D, a.k.dtype};
    KvBlock dkb{dk.data, dv.data, 0, static_cast<int32_t>(T)};
    KvBlocks dkv{&dkb, 1, Hkv, T, D, act_};
    ops_.attention_backward(dq, dkv, d_o, a.q, kv, a.o, a.lse, pos, 1.0 / std::sqrt(static_cast<double>(D)));
  }

  // RoPE, then the Qwen3 per-head norms, backwards.
  ops_.rope_backward(dq, dq, pos, cfg_.rope);
  for (int64_t h = 0; h < Hkv; ++h) {
    Tensor dkh(head(dk, h, T, 0, T, D).data, act_, {T, int64_t{1}, D});
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
  // Bias gradients from dy itself, before DoRA scales it in place.
  Tensor h1 = as_operand(a.h1, 1);
  bias_backward(G.bq, mat(dq_lin, T, H * D));
  if (dora_drop && dora_on(layer, Proj::q)) {
    dora_drop_whole(Proj::q, mat(dq_lin, T, H * D), 0, C.wq, dh, false, a.h1, h1);
  } else {
    if (dora_on(layer, Proj::q)) dora_backward(layer, Proj::q, mat(dq_lin, T, H * D), mat(dq_lin, T, H * D), a.z[0], 0);
    Tensor dq_op = as_operand(mat(dq_lin, T, H * D), 0);
    linear_backward_input(dh, dq_op, C.wq, false);
    linear_backward_weight(G.wq, dq_op, h1);
    lora(Proj::q, dh, dq_op, a.h1, h1);
  }
  const bool lk = lora_on(layer, Proj::k), lv = lora_on(layer, Proj::v);
  const bool dk_on = dora_on(layer, Proj::k), dv_on = dora_on(layer, Proj::v);
  // DoRA with dropout: (g dy - dy) W of every head gathered in tk / tv for the adapter's input gradient.
  const bool kd = dora_drop && dk_on, vd = dora_drop && dv_on;
  Tensor tk = kd ? Tensor(s.dora_t.data, act_, {T, E}) : Tensor(), tv = vd ? Tensor(s.dora_t2.data, act_, {T, E}) : Tensor();
  // Head h's rows of the k or v projection: bias, DoRA, the base's input gradient, the adapter's rows.
  auto kv_head = [&](Proj p, int64_t h, Tensor dy, int z, Tensor w, Tensor gw, Tensor gb, bool dora, bool dd, Tensor t,
                     Tensor du) {
    bias_backward(span(gb, h * D, D), dy);
    if (dd) {
      dora_dropout_backward(layer, p, dy, z_head(a.z[z], h, T, D), rows(w, h * D, D, E), a.u[z], dh, true, t, h > 0, du,
                            h > 0, h * D);
      return;
    }
    if (dora) dora_backward(layer, p, dy, dy, z_head(a.z[z], h, T, D), h * D);
    Tensor op = as_operand(dy, 0);
    linear_backward_input(dh, op, rows(w, h * D, D, E), true);
    linear_backward_weight(rows(gw, h * D, D, E), op, h1);
    if (lora_on(layer, p)) lora_backward_rows(layer, p, du, op, a.u[z], h * D, h > 0);
  };
  for (int64_t h = 0; h < Hkv; ++h) {
    kv_head(Proj::k, h, head(dk_lin, h, T, 0, T, D), 1, C.wk, G.wk, G.bk, dk_on, kd, tk, s.du[0]);
    kv_head(Proj::v, h, head(dv, h, T, 0, T, D), 2, C.wv, G.wv, G.bv, dv_on, vd, tv, s.du[1]);
  }
  if (lk) lora_backward_input(layer, Proj::k, dh, s.du[0], a.h1, h1, tk);
  if (lv) lora_backward_input(layer, Proj::v, dh, s.du[1], a.h1, h1, tv);
  ops_.rmsnorm_backward(dxn, G.in_norm, dh, a.x_in, P.in_norm, a.rstd1);
  ops_.add(dx, dx, dxn);
}

}  // namespace oomless
