// Page-sparse attention in chunk-recurrent training (PagedKvStore with sparse_pages): with every earlier
// page selected it is the dense computation bit for bit; with fewer it differs, selects the sinks and k
// pages per query page, gives the same bits in every offload mode and SavePolicy, moves bytes per chunk
// bounded by k and not by T, and its gradients (selection fixed) match finite differences in float64.
#include "util/chunked_run.h"
#include "util/fd_check.h"

namespace oomless::test {
namespace {

const int64_t kT = 150, kC = 32, kP = 8;  // 5 chunks (the last of 22 tokens), 4 pages per chunk

// k >= every history gives each query page all earlier pages: the same windows, calls and bits as dense,
// for GQA, MHA, Qwen3 norms, either summary, on Device and on disk.
TEST(SparseAttention, EveryPageSelectedIsBitwiseDense) {
  for (const Variant& v : variants()) {
    const std::vector<int32_t> ids = tokens(kT, v.cfg.V, 21);
    RunSetup dense{v.cfg};
    const Result want = run(dense, ids, kC, kP, KvOffload::none);
    for (PageSummary sum : {PageSummary::mean, PageSummary::minmax})
      for (KvOffload mode : {KvOffload::none, KvOffload::disk}) {
        RunSetup s{v.cfg};
        s.sparse_pages = 64, s.sink_pages = 1, s.summary = sum;
        const Result got = run(s, ids, kC, kP, mode);
        EXPECT_TRUE(same_bits(got, want)) << v.name << " " << page_summary_name(sum) << " " << kv_offload_name(mode);
        // The sparse machinery did run: selections were made (all earlier pages).
        size_t made = 0;
        for (const auto& sel : got.selections) made += !sel.empty();
        EXPECT_GT(made, 0u) << v.name;
      }
  }
}

// k below the history: each query page of chunk c reads the first page and k others (distinct, earlier,
// ascending); the loss moves away from dense but stays near it (the model is the same, attention loses
// some keys).
TEST(SparseAttention, SelectsSinksAndKPagesAndDiffersFromDense) {
  const Variant v = variants()[0];
  const std::vector<int32_t> ids = tokens(kT, v.cfg.V, 22);
  const Result dense = run({v.cfg}, ids, kC, kP, KvOffload::none);
  for (PageSummary sum : {PageSummary::mean, PageSummary::minmax}) {
    RunSetup s{v.cfg};
    s.sparse_pages = 3, s.sink_pages = 1, s.summary = sum;
    const Result r = run(s, ids, kC, kP, KvOffload::none);
    EXPECT_FALSE(same_bits(r, dense)) << page_summary_name(sum);
    EXPECT_EQ(r.count, dense.count);
    EXPECT_LT(std::abs(r.loss_sum - dense.loss_sum) / dense.loss_sum, 0.2) << page_summary_name(sum);
    const int64_t ppc = kC / kP, chunks = (kT + kC - 1) / kC;
    size_t i = 0;
    for (int64_t l = 0; l < v.cfg.L; ++l)
      for (int64_t c = 0; c < chunks; ++c)
        for (int64_t qp = 0; qp < ppc; ++qp, ++i) {
          const std::vector<int64_t>& sel = r.selections[i];
          const int64_t hist = c * ppc, rows = std::min(kC, kT - c * kC);
          if (c == 0 || qp * kP >= rows) {
            EXPECT_TRUE(sel.empty()) << "layer " << l << " chunk " << c << " page " << qp;
            continue;
          }
          ASSERT_EQ(static_cast<int64_t>(sel.size()), std::min<int64_t>(hist, 4)) << "chunk " << c;
          EXPECT_EQ(sel.front(), 0) << "the sink page";
          for (size_t j = 1; j < sel.size(); ++j) EXPECT_LT(sel[j - 1], sel[j]);
          EXPECT_LT(sel.back(), hist);
        }
  }
}

// Sparse results are bitwise the same on Device, in Host RAM and on disk, and for every SavePolicy: the
// selection depends on the queries and summaries only, never on where the pages are.
TEST(SparseAttention, BitwiseAcrossOffloadModesAndSavePolicies) {
  for (const Variant& v : {variants()[0], variants()[3]}) {
    const std::vector<int32_t> ids = tokens(kT, v.cfg.V, 23);
    RunSetup s{v.cfg};
    s.sparse_pages = 2, s.sink_pages = 1;
    const Result base = run(s, ids, kC, kP, KvOffload::none);
    for (SavePolicy pol : {SavePolicy::all, SavePolicy::none})
      for (KvOffload mode : {KvOffload::none, KvOffload::host, KvOffload::disk}) {
        RunSetup t = s;
        t.policy = pol;
        EXPECT_TRUE(same_bits(run(t, ids, kC, kP, mode), base))
            << v.name << " " << save_policy_name(pol) << " " << kv_offload_name(mode);
      }
  }
}

// Bytes fetched to Device per chunk: dense grows with the chunk's history; sparse stays under a bound
// that depends on k, C/P and the layer count only — the same at T = 512 and T = 1024.
TEST(SparseAttention, BytesPerChunkScaleWithKNotT) {
  const ModelConfig cfg = variants()[0].cfg;
  const int64_t C = 64, P = 8, ppc = C / P, k = 2, sinks = 1;
  const uint64_t page = 2 * static_cast<uint64_t>(cfg.Hkv * P * cfg.D) * sizeof(float);
  // Per layer and chunk at most ppc (k + sinks) distinct pages are read: by the pass-1 forward, the pass-2
  // forward and the backward (keys and their gradients); plus the chunk's own gradient pages.
  const uint64_t bound = static_cast<uint64_t>(cfg.L) * (4 * ppc * (k + sinks) + ppc) * page;
  for (int64_t T : {512, 1024}) {
    const std::vector<int32_t> ids = tokens(T, cfg.V, 24);
    RunSetup s{cfg};
    s.sparse_pages = k, s.sink_pages = sinks;
    const Result sparse = run(s, ids, C, P, KvOffload::disk);
    ASSERT_EQ(sparse.fetched.size(), static_cast<size_t>(T / C));
    uint64_t most = 0;
    for (uint64_t b : sparse.fetched) most = std::max(most, b);
    EXPECT_LE(most, bound) << "T=" << T;
    EXPECT_GT(most, 0u);
    if (T == 1024) {
      // Dense reads every earlier page: its last chunks go well past the bound.
      const Result dense = run({cfg}, ids, C, P, KvOffload::disk);
      EXPECT_GT(dense.fetched[static_cast<size_t>(T / C - 2)], 2 * bound);
    }
  }
}

// Finite differences of the chunked loss in float64 (ref backend) with the selection fixed
// (keep_selection: the step's selections are replayed by every later evaluation): every sampled parameter
// gradient of the sparse step matches.
TEST(SparseAttention, GradientsMatchFiniteDifferencesWithTheSelectionFixed) {
  for (const Variant& v : {variants()[0], variants()[3]}) {
    SCOPED_TRACE(v.name);
    const ModelConfig& cfg = v.cfg;
    CpuMemory mem(size_t{1} << 32);
    auto ops = make_ops("ref");
    ParamSet params(cfg, DType::f64, mem.device, Category::weights);
    init_random(*ops, params, 7, 0.3);
    Model m(cfg, *ops, params, mem.device);
    const int64_t T = 46, C = 8, P = 2;  // 6 chunks (the last of 6 tokens), 4 pages each
    m.reserve(C, true, true);
    PagedKvOptions o{C, P, KvOffload::none, spill_dir()};
    o.sparse_pages = 2, o.sink_pages = 1, o.keep_selection = true;
    PagedKvStore kv(kv_dims(cfg), *ops, mem.device, mem.host, o, T, true);
    std::vector<int32_t> ids = tokens(T, cfg.V, 25), tg = targets_of(ids);
    Tensor id_t(ids.data(), DType::i32, {T}), tg_t(tg.data(), DType::i32, {T});
    int64_t N = 0;
    for (int32_t t : tg) N += t >= 0;
    const double scale = 1.0 / static_cast<double>(N);
    m.chunked_step(id_t, tg_t, C, kv, scale);
    // Sparse indeed: the last chunk's query pages read 3 of the 20 earlier pages.
    EXPECT_EQ(kv.selection(cfg.L - 1, 5, 0).size(), 3u);
    auto loss = [&] { return m.chunked_eval(id_t, tg_t, C, kv).loss_sum * scale; };
    EXPECT_GT(check_sampled_gradients(params, m.grads(), loss, 3, 13), 25);
  }
}

// The scores: a query page whose queries point along u selects the earlier pages whose keys point along
// u, with either summary, and the sink; pages of unrelated keys are left out.
TEST(SparseAttention, SelectsThePagesWhoseKeysMatchTheQueries) {
  ModelConfig cfg = variants()[0].cfg;  // H 4, Hkv 2, D 6
  cfg.L = 1;
  const int64_t C = 32, P = 4, ppc = C / P, T = 2 * C, H = cfg.H, Hkv = cfg.Hkv, D = cfg.D;
  const std::vector<int64_t> planted = {2, 5};  // pages of chunk 0 with keys along u
  for (PageSummary sum : {PageSummary::mean, PageSummary::minmax}) {
    CpuMemory mem(size_t{1} << 30);
    auto ops = make_ops("cpu", &mem.device);
    PagedKvOptions o{C, P, KvOffload::none, spill_dir()};
    o.sparse_pages = 2, o.sink_pages = 1, o.summary = sum;
    PagedKvStore kv(kv_dims(cfg), *ops, mem.device, mem.host, o, T, false);
    std::mt19937_64 rng(5);
    std::normal_distribution<float> nd(0.0f, 0.1f);
    const float u[] = {1, -1, 1, 1, -1, 1};
    std::vector<float> k(static_cast<size_t>(Hkv * C * D)), v(k.size()), q(static_cast<size_t>(C * H * D));
    for (float& x : v) x = nd(rng);
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t t = 0; t < C; ++t)
        for (int64_t d = 0; d < D; ++d) {
          const bool on = std::find(planted.begin(), planted.end(), t / P) != planted.end();
          k[static_cast<size_t>((h * C + t) * D + d)] = nd(rng) + (on ? u[d] : 0.0f);
        }
    for (int64_t t = 0; t < C; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) q[static_cast<size_t>((t * H + h) * D + d)] = nd(rng) + u[d];
    std::vector<int32_t> pos(static_cast<size_t>(C));
    std::vector<float> out(q.size()), lse(static_cast<size_t>(H * C));
    std::vector<Buffer> keep;  // the store's operands are Device tensors, as the model's are
    const Tensor kd = test::arena_copy(mem.device, keep, k, DType::f32, {Hkv, C, D}),
                 vd = test::arena_copy(mem.device, keep, v, DType::f32, {Hkv, C, D});
    kv.begin(T, C);
    kv.set_chunk(0);
    kv.store(0, kd, vd);
    kv.set_chunk(1);
    for (int64_t t = 0; t < C; ++t) pos[static_cast<size_t>(t)] = static_cast<int32_t>(C + t);
    kv.forward(0, test::arena_copy(mem.device, keep, out, DType::f32, {C, H, D}),
               test::arena_copy(mem.device, keep, lse, DType::f32, {H, C}),
               test::arena_copy(mem.device, keep, q, DType::f32, {C, H, D}), kd, vd,
               test::arena_copy(mem.device, keep, pos, DType::i32, {C}));
    for (int64_t qp = 0; qp < ppc; ++qp)
      EXPECT_EQ(kv.selection(0, 1, qp), (std::vector<int64_t>{0, 2, 5})) << page_summary_name(sum) << " page " << qp;
    kv.end();
  }
}

// Settings the store cannot use are clear errors.
TEST(SparseAttention, BadSettingsAreClearErrors) {
  const ModelConfig cfg = variants()[0].cfg;
  CpuMemory mem(size_t{1} << 30);
  auto ops = make_ops("cpu", &mem.device);
  PagedKvOptions o{32, 8, KvOffload::none, spill_dir()};
  o.sparse_pages = -1;
  try {
    PagedKvStore kv(kv_dims(cfg), *ops, mem.device, mem.host, o, 128, true);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--sparse-pages"), std::string::npos) << e.what();
  }
  try {
    parse_page_summary("median");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mean or minmax"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace oomless::test
