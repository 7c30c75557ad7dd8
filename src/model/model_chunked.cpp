// The chunk-recurrent schedule (model.h, "Chunk-recurrent training"): pass 1 forward over all chunks but
// the last keeping only keys and values, pass 2 in reverse with recompute, loss and backward per chunk.
#include <algorithm>
#include <cstring>

#include "model/model.h"
#include "model/model_detail.h"

namespace oomless {

namespace {

// Chunk c of an i32 vector (T), C per chunk.
Tensor chunk_of(const Tensor& t, int64_t c, int64_t C) {
  const int64_t T = t.dims[0], n = std::min(C, T - c * C);
  return Tensor(t, static_cast<int64_t>(sizeof(int32_t)) * c * C, DType::i32, {n});
}

// Clears the model's pointer to the store and ends the store's sequence on every exit path.
struct ChunkScope {
  ChunkKv*& slot;
  ChunkKv& kv;
  ChunkScope(ChunkKv*& s, ChunkKv& k) : slot(s), kv(k) { slot = &kv; }
  ~ChunkScope() {
    slot = nullptr;
    try {
      kv.end();
    } catch (...) {
      // end() only frees; an error from it must not replace the one unwinding.
    }
  }
};

// A zigzag slice's second piece for the calls of one sequence (Model::pos1_), cleared on every exit path.
struct TwoPieces {
  int64_t& slot;
  TwoPieces(int64_t& s, int64_t t1, int64_t T, int64_t C, bool dropout) : slot(s) {
    OOM_CHECK(t1 < 0 || (C >= T && T % 2 == 0), "[model] a slice in two pieces is one chunk of an even length (", T,
              " tokens in chunks of ", C, ")");
    OOM_CHECK(t1 < 0 || !dropout, "[model] adapter dropout draws by position from one first position: not with a "
              "slice in two pieces");
    slot = t1;
  }
  ~TwoPieces() { slot = -1; }
};

}  // namespace

CeResult Model::chunk_forward(Tensor ids, Tensor targets, int64_t t0, ChunkKv& kv, bool store, bool loss,
                              bool for_backward, std::optional<double> grad_scale) {
  const int64_t T = ids.dims[0];
  T_ = T;
  row0_ = t0;
  stash_ = for_backward && narrow_saved();
  round_qkv_ = training_ && !for_backward && narrow_saved();
  Scratch& s = *s_;
  Tensor pos(s.pos, DType::i32, {T});
  Tensor id_t(s.ids, DType::i32, {T}), tg_t(s.targets, DType::i32, {T});
  ops_.upload(id_t, ids.data);
  ops_.upload(tg_t, targets.data);
  if (pos1_ >= 0) {  // a zigzag slice: two pieces
    const int64_t h = T / 2;
    ops_.iota(Tensor(pos.data, DType::i32, {h}, pos.tier), static_cast<int32_t>(t0));
    ops_.iota(Tensor(static_cast<int32_t*>(pos.data) + h, DType::i32, {T - h}, pos.tier), static_cast<int32_t>(pos1_));
  } else {
    ops_.iota(pos, static_cast<int32_t>(t0));
  }
  const size_t n_states = s.layer_in.size();
  auto state = [&](int64_t i) { return Tensor(s.layer_in[static_cast<size_t>(i) % n_states], act_, {T, cfg_.E}); };
  ops_.embedding_forward(state(0), id_t, params_.embed);
  for (int64_t l = 0; l < cfg_.L; ++l) {
    Acts a = acts_for_layer(l);
    a.x_in = state(l);
    // Without a loss (pass 1) the last layer only has to leave its keys and values for later chunks.
    const Pass pass = !loss && l == cfg_.L - 1 ? Pass::kv_only : Pass::full;
    if (layer_fetch_) layer_fetch_(l);
    block_forward(l, a, KvSlots{a.k, a.v, 0}, pos, state(l + 1), pass);
    if (stash_) stash_layer(l, a);
    if (store) kv.store(l, a.k, a.v);
  }
  have_forward_ = false;
  fused_scale_.reset();
  if (!loss) return {};
  Tensor hn(s.hn, act_, {T, cfg_.E}), rstd(s.rstd_f, act_, {T}), lse(s.lse_f, act_, {T});
  ops_.rmsnorm_forward(hn, rstd, state(cfg_.L), params_.final_norm, cfg_.rms_eps);
  CeResult r = head_forward(lse, hn, tg_t, for_backward, grad_scale);
  have_forward_ = for_backward;
  return r;
}

namespace {

void check_chunked(const ModelConfig& cfg, const Tensor& ids, const Tensor& targets, int64_t C) {
  OOM_CHECK(ids.ndim == 1 && ids.dtype == DType::i32, "[model] ids must be i32 (T), got ", ids.str());
  OOM_CHECK(targets.ndim == 1 && targets.dtype == DType::i32 && targets.dims[0] == ids.dims[0],
            "[model] targets must be i32 (T) like ids, got ", targets.str());
  OOM_CHECK(C >= 1, "[model] the chunk length must be >= 1, got ", C);
  cfg.check_sequence(ids.dims[0]);
  const int32_t* id = static_cast<const int32_t*>(ids.data);
  for (int64_t t = 0; t < ids.dims[0]; ++t)
    OOM_CHECK(id[t] >= 0 && id[t] < cfg.V, "[model] token id ", id[t], " at position ", t,
              " is outside the vocabulary [0, ", cfg.V, ")");
}

}  // namespace

CeResult Model::chunked_step(Tensor ids, Tensor targets, int64_t C, ChunkKv& kv, double grad_scale, int64_t t0,
                             int64_t t1) {
  check_chunked(cfg_, ids, targets, C);
  const int64_t T = ids.dims[0], n = (T + C - 1) / C;
  TwoPieces pieces(pos1_, t1, T, C, lora_dropout_ > 0.0);
  OOM_CHECK(s_ && cap_chunked_ && cap_backward_ && std::min(C, T) <= cap_T_, "[model] chunked_step with chunks of ",
            std::min(C, T), " tokens needs reserve(", std::min(C, T), ", true, true) first");
  ensure_grads();
  training_ = true;
  refresh_dora();
  ChunkScope scope(chunk_kv_, kv);
  kv.set_bf16_products(opt_.dtype == ComputeDType::bf16);
  kv.begin(T, C);
  // Pass 1: every chunk but the last, keys and values only.
  for (int64_t c = 0; c + 1 < n; ++c) {
    kv.set_chunk(c);
    chunk_forward(chunk_of(ids, c, C), chunk_of(targets, c, C), t0 + c * C, kv, true, false, false);
  }
  // Pass 2: in reverse, recompute + loss + backward.
  CeResult total;
  for (int64_t c = n - 1; c >= 0; --c) {
    kv.set_chunk(c);
    const CeResult r =
        chunk_forward(chunk_of(ids, c, C), chunk_of(targets, c, C), t0 + c * C, kv, false, true, true, grad_scale);
    hook_this_backward_ = c == 0 || hook_every_chunk_;  // chunk 0's: the last accumulation into every gradient
    drop_hook_after_ = c == 0;
    backward(grad_scale);
    hook_this_backward_ = drop_hook_after_ = true;
    kv.chunk_done(c);
    total.loss_sum += r.loss_sum;
    total.count += r.count;
  }
  return total;
}

CeResult Model::chunked_eval(Tensor ids, Tensor targets, int64_t C, ChunkKv& kv, std::vector<double>* token_losses,
                             int64_t t0, int64_t t1) {
  check_chunked(cfg_, ids, targets, C);
  const int64_t T = ids.dims[0], n = (T + C - 1) / C;
  TwoPieces pieces(pos1_, t1, T, C, false);
  OOM_CHECK(s_ && cap_chunked_ && std::min(C, T) <= cap_T_, "[model] chunked_eval with chunks of ", std::min(C, T),
            " tokens needs reserve(", std::min(C, T), ", false, true) first");
  training_ = false;
  refresh_dora();
  ChunkScope scope(chunk_kv_, kv);
  kv.set_bf16_products(opt_.dtype == ComputeDType::bf16);
  kv.begin(T, C);
  CeResult total;
  if (token_losses) token_losses->clear();
  for (int64_t c = 0; c < n; ++c) {
    kv.set_chunk(c);
    const CeResult r =
        chunk_forward(chunk_of(ids, c, C), chunk_of(targets, c, C), t0 + c * C, kv, c + 1 < n, true, false);
    if (token_losses) {
      const std::vector<double> per = this->token_losses();
      token_losses->insert(token_losses->end(), per.begin(), per.end());
    }
    total.loss_sum += r.loss_sum;
    total.count += r.count;
  }
  return total;
}

}  // namespace oomless
