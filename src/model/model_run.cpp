// Whole-model passes: embedding -> blocks -> final norm -> fused LM head + cross-entropy, and back.
#include <algorithm>
#include <cstring>

#include "model/model.h"
#include "model/model_detail.h"

namespace oomless {

namespace {
constexpr int32_t kIgnore = -100;  // transformers' ignore_index
}

Tensor Model::run_blocks(Tensor ids, Tensor pos, std::vector<KvSlots>* cache, int64_t t0) {
  // Embedding, then every block; the residual stream lives in layer_in (all L + 1 states when training,
  // two alternating ones otherwise). Keys and values go to the block's own buffers or to the cache.
  Scratch& s = *s_;
  const int64_t T = ids.dims[0];
  const size_t n_states = s.layer_in.size();
  auto state = [&](int64_t i) { return Tensor(s.layer_in[static_cast<size_t>(i) % n_states], act_, {T, cfg_.E}); };
  ops_.embedding_forward(state(0), ids, params_.embed);
  for (int64_t l = 0; l < cfg_.L; ++l) {
    Acts a = acts_for_layer(l);
    a.x_in = state(l);
    KvSlots kv = cache ? (*cache)[static_cast<size_t>(l)] : KvSlots{a.k, a.v, 0};
    kv.t0 = t0;
    act_offload_before_forward(l);
    if (layer_fetch_) layer_fetch_(l);
    block_forward(l, a, kv, pos, state(l + 1), Pass::full);
    if (stash_) stash_layer(l, a);
    act_offload_after_forward(l);
  }
  return state(cfg_.L);
}

CeResult Model::head_forward(Tensor lse, Tensor hn, Tensor targets, bool for_backward, std::optional<double> grad_scale) {
  fused_scale_.reset();
  const Linear head = head_linear();
  if (!for_backward || !grad_scale) return ops_.linear_cross_entropy_forward(lse, hn, head.w, targets, kIgnore);
  // Training: the head's whole backward with the loss (a trained head's dw too), so backward starts at dh.
  Tensor dh(s_->dh, act_, {hn.dims[0], cfg_.E});
  const CeResult r =
      head.gw.data ? ops_.linear_cross_entropy_trained(lse, dh, head.gw, hn, head.w, targets, kIgnore, *grad_scale)
                   : ops_.linear_cross_entropy_fused(lse, dh, hn, head.w, targets, kIgnore, *grad_scale);
  fused_scale_ = grad_scale;
  return r;
}

CeResult Model::forward(Tensor ids, Tensor targets, bool for_backward, std::optional<double> grad_scale) {
  OOM_CHECK(ids.ndim == 1 && ids.dtype == DType::i32, "[model] ids must be i32 (T), got ", ids.str());
  OOM_CHECK(targets.ndim == 1 && targets.dtype == DType::i32 && targets.dims[0] == ids.dims[0],
            "[model] targets must be i32 (T) like ids, got ", targets.str());
  const int64_t T = ids.dims[0];
  cfg_.check_sequence(T);
  OOM_CHECK(s_ && T <= cap_T_, "[model] forward of ", T, " tokens needs reserve(", T, ") first");
  OOM_CHECK(!for_backward || cap_backward_, "[model] forward for backward needs reserve(T, true)");
  if (for_backward) ensure_grads();
  T_ = T;
  if (act_offloading()) {  // a forward without the backward of the last one: its transfers end first
    s_->off->wait_all();
    std::fill(s_->out.begin(), s_->out.end(), 0);
    std::fill(s_->in.begin(), s_->in.end(), 0);
  }
  training_ = for_backward;
  stash_ = for_backward && narrow_saved();
  round_qkv_ = false;
  row0_ = 0;
  refresh_dora();
  Scratch& s = *s_;
  const int32_t* id = ids.as<int32_t>("[model]");
  for (int64_t t = 0; t < T; ++t)
    OOM_CHECK(id[t] >= 0 && id[t] < cfg_.V, "[model] token id ", id[t], " at position ", t,
              " is outside the vocabulary [0, ", cfg_.V, ")");
  Tensor pos(s.pos, DType::i32, {T});
  Tensor id_t(s.ids, DType::i32, {T}), tg_t(s.targets, DType::i32, {T});
  ops_.upload(id_t, ids.data);
  ops_.upload(tg_t, targets.data);
  ops_.iota(pos, 0);

  const Tensor x_last = run_blocks(id_t, pos, nullptr, 0);
  Tensor hn(s.hn, act_, {T, cfg_.E}), rstd(s.rstd_f, act_, {T}), lse(s.lse_f, act_, {T});
  ops_.rmsnorm_forward(hn, rstd, x_last, params_.final_norm, cfg_.rms_eps);
  CeResult r = head_forward(lse, hn, tg_t, for_backward, grad_scale);
  have_forward_ = for_backward;
  return r;
}

void Model::backward(double grad_scale) {
  OOM_CHECK(have_forward_, "[model] backward needs a forward(for_backward = true) first");
  have_forward_ = false;
  Scratch& s = *s_;
  ensure_grads();
  // Under adapters the embedding, final norm and head are frozen: no weight gradients (empty tensors).
  const Linear head = head_linear();
  const Tensor g_norm = grads_ ? grads_->final_norm : Tensor();
  const int64_t T = T_, E = cfg_.E;
  Tensor pos(s.pos, DType::i32, {T});
  Tensor id_t(s.ids, DType::i32, {T}), tg_t(s.targets, DType::i32, {T});
  Tensor hn(s.hn, act_, {T, E}), rstd(s.rstd_f, act_, {T}), lse(s.lse_f, act_, {T});
  Tensor dx(s.dx, act_, {T, E}), dh(s.dh, act_, {T, E});
  if (fused_scale_) {  // the forward left dh
    OOM_CHECK(*fused_scale_ == grad_scale, "[model] backward(", grad_scale, ") after a forward for grad_scale ",
              *fused_scale_);
    fused_scale_.reset();
  } else {
    ops_.linear_cross_entropy_backward(dh, head.gw, hn, head.w, tg_t, lse, kIgnore, grad_scale);
  }
  Tensor x_last(s.layer_in[static_cast<size_t>(cfg_.L)], act_, {T, E});
  ops_.rmsnorm_backward(dx, g_norm, dh, x_last, params_.final_norm, rstd);
  grads_final(kHeadGroup);
  for (int64_t l = cfg_.L - 1; l >= 0; --l) {
    act_offload_before_backward(l);
    Acts a = acts_for_layer(l);
    unstash_layer(l, a);
    if (layer_fetch_) layer_fetch_(l);
    recompute_for_backward(l, a, pos);
    block_backward(l, a, pos, dx);
    act_offload_after_backward(l);
    grads_final(l);
  }
  if (grads_) ops_.embedding_backward(grads_->embed, dx, id_t);
  else if (g_embed_.data) ops_.embedding_backward(g_embed_, dx, id_t);
  grads_final(kEmbedGroup);
  if (hook_this_backward_ && drop_hook_after_) grad_hook_ = nullptr;
}

void Model::logits(Tensor out) {
  OOM_CHECK(s_ && T_ > 0, "[model] logits need a forward first");
  check_shape("[model] logits", "out", out, {T_, cfg_.V});
  OOM_CHECK(out.dtype == act_, "[model] logits come in the compute dtype ", dtype_name(act_), ", not ",
            dtype_name(out.dtype));
  // Host memory: rows of the product land in a device buffer of at most ~16 MiB and are downloaded from it.
  const int64_t V = cfg_.V, row_bytes = dtype_bytes(act_, V);
  const int64_t rows = std::clamp<int64_t>((int64_t{16} << 20) / row_bytes, 1, T_);
  Buffer dev = arena_.alloc(static_cast<size_t>(rows * row_bytes), Category::workspace, "logits");
  for (int64_t r0 = 0; r0 < T_; r0 += rows) {
    const int64_t n = std::min(rows, T_ - r0);
    const Tensor hn(s_->hn, dtype_bytes(act_, r0 * cfg_.E), act_, {n, cfg_.E});
    const Tensor part = dev.view(act_, {n, V});
    ops_.matmul(part, as_operand(hn, 0), head_, false, true, false);
    ops_.download(static_cast<char*>(out.data) + r0 * row_bytes, part);
  }
}

std::vector<double> Model::token_losses() {
  OOM_CHECK(s_ && T_ > 0, "[model] token losses need a forward first");
  // CE_t = lse_t - logit_t[target_t], the target logit from the operands the loss used (bf16 in bf16 mode), taken
  // by the backend; lse and the targets come back to the host beside it.
  const int64_t T = T_;
  const Tensor hn(s_->hn, act_, {T, cfg_.E}), tg_t(s_->targets, DType::i32, {T}),
      lse_t(s_->lse_f, act_, {T});
  const std::vector<double> logit = ops_.target_logits(hn, head_, tg_t, kIgnore);
  std::vector<int32_t> tg(static_cast<size_t>(T));
  std::vector<char> lse_raw(static_cast<size_t>(lse_t.nbytes()));
  ops_.download(tg.data(), tg_t);
  ops_.download(lse_raw.data(), lse_t);
  std::vector<double> out(static_cast<size_t>(T), 0.0), lse(static_cast<size_t>(T));
  convert(lse.data(), DType::f64, lse_raw.data(), act_, T);
  for (int64_t t = 0; t < T; ++t)
    if (tg[static_cast<size_t>(t)] >= 0) out[static_cast<size_t>(t)] = lse[static_cast<size_t>(t)] - logit[static_cast<size_t>(t)];
  return out;
}

void Model::decode_forward(Tensor ids, int64_t t0, std::vector<KvSlots>& cache, Tensor logits_last) {
  const int64_t T = ids.dims[0];
  OOM_CHECK(s_ && T <= cap_T_, "[model] decode of ", T, " tokens needs reserve(", T, ") first");
  OOM_CHECK(static_cast<int64_t>(cache.size()) == cfg_.L, "[model] the KV cache needs one entry per layer");
  OOM_CHECK(t0 + T <= cache[0].k.dims[1], "[model] the KV cache holds ", cache[0].k.dims[1], " tokens; ", t0 + T,
            " needed");
  check_shape("[model] decode", "logits_last", logits_last, {cfg_.V});
  T_ = T;
  training_ = false;
  stash_ = round_qkv_ = false;
  if (t0 == 0) refresh_dora();  // a new sequence
  Scratch& s = *s_;
  Tensor pos(s.pos, DType::i32, {T}), id_t(s.ids, DType::i32, {T});
  ops_.iota(pos, static_cast<int32_t>(t0));
  ops_.upload(id_t, ids.data);
  const Tensor x_out = run_blocks(id_t, pos, &cache, t0);
  // Only the last token's logits are needed.
  Tensor x_last(x_out, dtype_bytes(act_, (T - 1) * cfg_.E), act_, {1, cfg_.E});
  Tensor hn(s.hn, act_, {1, cfg_.E}), rstd(s.rstd_f, act_, {1});
  ops_.rmsnorm_forward(hn, rstd, x_last, params_.final_norm, cfg_.rms_eps);
  OOM_CHECK(logits_last.dtype == act_, "[model] decode logits come in the compute dtype ", dtype_name(act_), ", not ",
            dtype_name(logits_last.dtype));
  if (!decode_logits_)
    decode_logits_ = arena_.alloc(static_cast<size_t>(dtype_bytes(act_, cfg_.V)), Category::workspace, "decode logits");
  const Tensor dev = decode_logits_.view(act_, {1, cfg_.V});
  ops_.matmul(dev, as_operand(hn, 0), head_, false, true, false);
  ops_.download(logits_last.data, dev);
  have_forward_ = false;
  fused_scale_.reset();
}

}  // namespace oomless
