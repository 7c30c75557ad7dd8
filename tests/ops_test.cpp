// The conformance matrix: every non-attention, non-cross-entropy op of every built backend against the
// float64 reference, on random inputs, odd and round shapes, each input dtype the op takes. Outputs are
// checked for NaN/Inf, guard bytes and error (relative L2, or the elementwise matmul bound).
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <random>

#include "backend/ref/ref_ops.h"
#include "core/cpu_info.h"
#include "util/harness.h"

namespace oomless::test {
namespace {

struct Case {
  std::string op;
  std::vector<int64_t> dims;  // op-specific sizes
  DType in;                   // dtype of the weights/inputs given to the backend (f32 or bf16)
  std::string backend;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.op << " " << dtype_name(c.in) << " on " << c.backend << " dims";
  for (int64_t d : c.dims) *os << " " << d;
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
  std::string s = info.param.op + "_" + dtype_name(info.param.in) + "_" + info.param.backend;
  for (int64_t d : info.param.dims) s += "_" + std::to_string(d);
  return s;
}

// Runs the same op on `ops` (f32 activations) and on ref (f64), comparing every output.
class OpsConformance : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    ops = make_ops(GetParam().backend);
    rng.seed(1234 + GetParam().dims.size() * 7 + GetParam().dims[0]);
  }
  // Random activations: same values in f32 (backend) and f64 (ref).
  std::pair<HostTensor, HostTensor> act(std::vector<int64_t> shape, double sd = 1.0) {
    HostTensor a(DType::f32, shape);
    a.randn(rng, sd);
    return {a, a.as(DType::f64)};
  }
  std::unique_ptr<Ops> ops;
  RefOps ref;
  std::mt19937_64 rng;
  const double tol = tol_for(DType::f32);
};

TEST_P(OpsConformance, MatchesReference) {
  const Case& c = GetParam();
  const auto& d = c.dims;
  if (c.op.rfind("matmul", 0) == 0) {
    bool ta = c.op == "matmul_tn", tb = c.op == "matmul_nt";
    bool acc = d.size() > 3 && d[3];
    int64_t M = d[0], N = d[1], K = d[2];
    HostTensor a(c.in, ta ? std::vector<int64_t>{K, M} : std::vector<int64_t>{M, K});
    HostTensor b(c.in, tb ? std::vector<int64_t>{N, K} : std::vector<int64_t>{K, N});
    a.randn(rng);
    b.randn(rng);
    auto [cc, cr] = act({M, N});
    HostTensor old = cr.clone();
    ops->matmul(cc, a, b, ta, tb, acc);
    HostTensor a64 = a.as(DType::f64), b64 = b.as(DType::f64), bound(DType::f64, {M, N});
    ref.matmul(cr, a64, b64, ta, tb, acc);
    ref.matmul_magnitude(bound, a64, b64, ta, tb);
    if (acc)  // the old value of c is part of the bound
      for (int64_t i = 0; i < bound.numel(); ++i) bound.set(i, bound.get(i) + std::fabs(old.get(i)));
    expect_within_bound(cc, cr, bound, eps_of(DType::f32), K, 2.0, c.op);
  } else if (c.op == "embedding") {
    int64_t T = d[0], V = d[1], E = d[2];
    HostTensor table(c.in, {V, E}), ids(DType::i32, {T});
    table.randn(rng);
    ids.randint(rng, 0, static_cast<int32_t>(V));
    auto [oc, orf] = act({T, E});
    ops->embedding_forward(oc, ids, table);
    ref.embedding_forward(orf, ids, table.as(DType::f64));
    expect_close(oc, orf, 0.0, "embedding out");
    auto [dtc, dtr] = act({V, E});
    auto [gc, gr] = act({T, E});
    ops->embedding_backward(dtc, gc, ids);
    ref.embedding_backward(dtr, gr, ids);
    expect_close(dtc, dtr, tol, "embedding dtable");
  } else if (c.op == "rmsnorm") {
    int64_t R = d[0], E = d[1];
    auto [xc, xr] = act({R, E});
    auto [wc, wr] = act({E});
    auto [yc, yr] = act({R, E});
    auto [sc, sr] = act({R});
    ops->rmsnorm_forward(yc, sc, xc, wc, 1e-5);
    ref.rmsnorm_forward(yr, sr, xr, wr, 1e-5);
    expect_close(yc, yr, tol, "rmsnorm out");
    expect_close(sc, sr, tol, "rmsnorm rstd");
    auto [gc, gr] = act({R, E});
    auto [dxc, dxr] = act({R, E});
    auto [dwc, dwr] = act({E});
    ops->rmsnorm_backward(dxc, dwc, gc, xc, wc, sc);
    ref.rmsnorm_backward(dxr, dwr, gr, xr, wr, sr);
    expect_close(dxc, dxr, tol, "rmsnorm din");
    expect_close(dwc, dwr, tol, "rmsnorm dweight (+=)");
  } else if (c.op.rfind("rope", 0) == 0) {
    int64_t T = d[0], H = d[1], D = d[2];
    RopeConfig cfg;
    cfg.theta = c.op == "rope" ? 10000.0 : 500000.0;
    if (c.op != "rope") cfg.factor = 8.0, cfg.original_max_position = 8192;
    if (c.op == "rope_llama3") cfg.scaling = RopeScaling::llama3;
    if (c.op == "rope_yarn") cfg.scaling = RopeScaling::yarn, cfg.attention_factor = 1.2;
    HostTensor pos(DType::i32, {T});
    pos.randint(rng, 0, 200000);  // absolute positions, large ones included
    auto [xc, xr] = act({T, H, D});
    auto [yc, yr] = act({T, H, D});
    ops->rope_forward(yc, xc, pos, cfg);
    ref.rope_forward(yr, xr, pos, cfg);
    expect_close(yc, yr, tol, "rope out");
    ops->rope_backward(xc, xc, pos, cfg);  // in place, as the model uses it
    ref.rope_backward(xr, xr, pos, cfg);
    expect_close(xc, xr, tol, "rope din (in place)");
  } else if (c.op == "swiglu") {
    int64_t T = d[0], F = d[1];
    auto [gc, gr] = act({T, F}, 3.0);
    auto [uc, ur] = act({T, F});
    auto [yc, yr] = act({T, F});
    ops->swiglu_forward(yc, gc, uc);
    ref.swiglu_forward(yr, gr, ur);
    expect_close(yc, yr, tol, "swiglu out");
    auto [dc, dr] = act({T, F});
    auto [dgc, dgr] = act({T, F});
    auto [duc, dur] = act({T, F});
    ops->swiglu_backward(dgc, duc, dc, gc, uc);
    ref.swiglu_backward(dgr, dur, dr, gr, ur);
    expect_close(dgc, dgr, tol, "swiglu dgate");
    expect_close(duc, dur, tol, "swiglu dup");
    // Element by element, within a few f32 roundings of each term's magnitude (exp to 1.4 ulp, then a
    // division and products): a relative L2 error would let a slightly wrong exp through.
    const double e = 16.0 * eps_of(DType::f32);
    int64_t bad = 0;
    for (int64_t i = 0; i < T * F; ++i) {
      const double g = gr.get(i), u = ur.get(i), dy = dr.get(i), sg = 1.0 / (1.0 + std::exp(-g));
      bad += std::fabs(yc.get(i) - yr.get(i)) > e * std::fabs(g * sg * u) + 1e-37;
      bad += std::fabs(duc.get(i) - dur.get(i)) > e * std::fabs(dy * g * sg) + 1e-37;
      const double dg_mag = std::fabs(dy * u * sg) * (1.0 + std::fabs(g) * (1.0 - sg));
      bad += std::fabs(dgc.get(i) - dgr.get(i)) > e * dg_mag + 1e-37;
    }
    EXPECT_EQ(bad, 0) << "swiglu: outputs beyond a few roundings of the reference";
  } else if (c.op == "elementwise") {
    int64_t n = d[0];
    auto [ac, ar] = act({n});
    auto [bc, br] = act({n});
    auto [oc, orf] = act({n});
    ops->add(oc, ac, bc);
    ref.add(orf, ar, br);
    expect_close(oc, orf, tol, "add");
    ops->add(ac, ac, bc);  // aliasing: the residual stream
    ref.add(ar, ar, br);
    expect_close(ac, ar, tol, "add in place");
    ops->axpy(ac, -0.37, bc);
    ref.axpy(ar, -0.37, br);
    expect_close(ac, ar, tol, "axpy");
    ops->scale(ac, 1.7);
    ref.scale(ar, 1.7);
    expect_close(ac, ar, tol, "scale");
    double sc = ops->sum_squares(ac), sr = ref.sum_squares(ar);
    EXPECT_LE(std::fabs(sc - sr), 1e-6 * sr + 1e-30) << "sum_squares";
    // abs_max: the same value (a max takes no rounding), then NaN once an element is not finite (inf or NaN),
    // wherever it is.
    double mc = 0, mr = 0;
    for (int64_t i = 0; i < n; ++i) {
      mc = std::max(mc, std::fabs(static_cast<double>(ac.ptr<float>()[i])));
      mr = std::max(mr, std::fabs(ar.ptr<double>()[i]));
    }
    EXPECT_EQ(ops->abs_max(ac), mc) << "abs_max";
    EXPECT_EQ(ref.abs_max(ar), mr) << "abs_max";
    EXPECT_GT(mc, 0.0) << "abs_max";
    for (double bad : {INFINITY, -INFINITY, NAN}) {
      const int64_t at = n / 2;
      const float keep = ac.ptr<float>()[at];
      ac.ptr<float>()[at] = static_cast<float>(bad);
      ar.ptr<double>()[at] = bad;
      EXPECT_TRUE(std::isnan(ops->abs_max(ac))) << "abs_max with " << bad;
      EXPECT_TRUE(std::isnan(ref.abs_max(ar))) << "abs_max with " << bad;
      ac.ptr<float>()[at] = keep;
      ar.ptr<double>()[at] = keep;
    }
    ops->fill(ac, 0.25);
    ref.fill(ar, 0.25);
    expect_close(ac, ar, 0.0, "fill");
    HostTensor h16(DType::bf16, {n});
    ops->convert(h16, bc);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(h16.ptr<uint16_t>()[i], f32_to_bf16(bc.ptr<float>()[i])) << "convert f32->bf16 at " << i;
    EXPECT_TRUE(h16.guards_intact());
  } else if (c.op == "adamw") {
    int64_t n = d[0];
    auto [pc, pr] = act({n});
    auto [gc, gr] = act({n});
    auto [mc, mr] = act({n}, 0.1);
    HostTensor vc(DType::f32, {n});
    vc.uniform(rng, 0.0, 0.05);
    HostTensor vr = vc.as(DType::f64);
    AdamWConfig cfg;
    cfg.lr = 1e-2;
    cfg.weight_decay = 0.1;
    for (int64_t step = 1; step <= 3; ++step) {
      cfg.step = step;
      ops->adamw_step(pc, gc, mc, vc, cfg);
      ref.adamw_step(pr, gr, mr, vr, cfg);
    }
    expect_close(pc, pr, tol, "adamw param");
    expect_close(mc, mr, tol, "adamw m");
    expect_close(vc, vr, tol, "adamw v");
  } else {
    FAIL() << "no such op row " << c.op;
  }
}

std::vector<Case> all_cases() {
  std::vector<Case> cs;
  for (const std::string& be : backends_under_test()) {
    for (DType t : {DType::f32, DType::bf16}) {
      for (const char* op : {"matmul_nn", "matmul_nt", "matmul_tn"})
        for (std::vector<int64_t> d : {std::vector<int64_t>{1, 1, 1, 0}, {7, 33, 257, 0}, {257, 7, 33, 1},
                                       {33, 257, 7, 1}, {128, 64, 256, 0}, {64, 128, 96, 1}})
          cs.push_back({op, d, t, be});
      for (std::vector<int64_t> d : {std::vector<int64_t>{1, 7, 1}, {33, 257, 7}, {257, 33, 64}})
        cs.push_back({"embedding", d, t, be});
    }
    // E = 1 is left out: there din = r w dy eps / (x^2 + eps) is a cancellation no float kernel can
    // reproduce to a relative tolerance; one-token rows (R = 1) are in.
    for (std::vector<int64_t> d : {std::vector<int64_t>{1, 7}, {7, 33}, {257, 64}, {33, 257}, {128, 128}})
      cs.push_back({"rmsnorm", d, DType::f32, be});
    for (const char* op : {"rope", "rope_llama3", "rope_yarn"})
      for (std::vector<int64_t> d : {std::vector<int64_t>{1, 1, 2}, {7, 3, 16}, {33, 4, 64}, {257, 2, 128}})
        cs.push_back({op, d, DType::f32, be});
    for (std::vector<int64_t> d : {std::vector<int64_t>{1, 1}, {7, 33}, {257, 64}, {33, 257}})
      cs.push_back({"swiglu", d, DType::f32, be});
    for (int64_t n : {1, 7, 33, 257, 100000}) {
      cs.push_back({"elementwise", {n}, DType::f32, be});
      cs.push_back({"adamw", {n}, DType::f32, be});
    }
  }
  return cs;
}

INSTANTIATE_TEST_SUITE_P(Matrix, OpsConformance, testing::ValuesIn(all_cases()), case_name);

// Bad input: every op names itself and the problem.
TEST(OpsErrors, ShapeAndDtypeMismatchesNameTheOp) {
  for (const std::string& be : std::vector<std::string>{"ref", "cpu"}) {
    auto ops = make_ops(be);
    DType act = ops->act_dtype();
    HostTensor a(act, {4, 5}), b(act, {6, 7}), c(act, {4, 7}), ids(DType::i32, {4}), bad_ids(DType::i32, {4});
    bad_ids.fill(99);
    auto expect_err = [&](auto&& fn, const std::string& prefix) {
      try {
        fn();
        ADD_FAILURE() << be << ": no error for " << prefix;
      } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()).rfind(prefix, 0), 0u) << be << ": " << e.what();
      }
    };
    expect_err([&] { ops->matmul(c, a, b, false, false, false); }, "[matmul]");
    expect_err([&] { ops->embedding_forward(a, bad_ids, b); }, "[embedding]");
    expect_err([&] { ops->add(a, a, c); }, "[add]");
    HostTensor i32x(DType::i32, {4, 5});
    expect_err([&] { ops->scale(i32x, 2.0); }, "[scale]");
    HostTensor odd(act, {2, 2, 3}), pos(DType::i32, {2});
    expect_err([&] { ops->rope_forward(odd, odd, pos, RopeConfig{}); }, "[rope]");
    HostTensor w(act, {6}), rstd(act, {4});
    expect_err([&] { ops->rmsnorm_forward(a, rstd, a, w, 1e-5); }, "[rmsnorm]");
    AdamWConfig cfg;
    cfg.step = 0;
    expect_err([&] { ops->adamw_step(a, a, a, a, cfg); }, "[adamw]");
  }
  EXPECT_THROW(make_ops("tpu"), Error);
}

// A float B read as bf16 (Tensor::as_bf16, bf16 compute over fp32 master weights) gives the bits of the
// product with a bf16 copy of B, on every backend, for both layouts of B; the values include exact ties
// between two bf16 neighbours, so rounding to nearest even is checked, not just rounding. One row too (a
// decode step; x W^T reads B's rows where they are, rounding them as it goes), past a row segment of 512 and
// with a tail of K mod 8, with infinities, NaNs (one that a rounding blind to NaN would carry to -0) and a value that rounds up to
// infinity among B's values.
TEST(Matmul, BReadAsBf16EqualsTheProductWithABf16Copy) {
  std::mt19937_64 rng(5);
  for (const std::string& be : backends_under_test()) {
    auto ops = make_ops(be);
    const DType act = ops->act_dtype();
    for (bool tb : {false, true})
      for (int64_t M : {int64_t(1), int64_t(3), int64_t(40)}) {
        // skinny and blocked loop nests, one and two k slices; one row
        const int64_t N = 37, K = M == 1 ? 605 : M == 3 ? 29 : 400;
        HostTensor a(DType::bf16, {M, K}), b(DType::f32, {tb ? N : K, tb ? K : N});
        a.randn(rng);
        b.randn(rng);
        // Every third value sits exactly halfway between two bf16 values (odd and even low bits).
        for (int64_t i = 0; i < b.numel(); i += 3) {
          uint32_t u = f32_bits(b.ptr<float>()[i]);
          b.ptr<float>()[i] = bits_f32((u & 0xffff0000u) | 0x8000u);
        }
        if (M == 1) {  // in outputs of their own (B's rows with tb, its columns without)
          const uint32_t specials[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7fffffffu, 0xffa01234u, 0x7f7fffffu};
          for (int j = 0; j < 6; ++j) {
            const int64_t col = 5 * j + 1, k = 7 * j + 3;
            b.ptr<float>()[tb ? col * K + k : k * N + col] = bits_f32(specials[j]);
          }
        }
        HostTensor b_act = b.as(act), b_copy = b.as(DType::bf16);
        HostTensor c_read(act, {M, N}), c_copy(act, {M, N});
        ops->matmul(c_read, a, b_act.t().read_as_bf16(), false, tb, false);
        ops->matmul(c_copy, a, b_copy, false, tb, false);
        // Bit for bit, but that any NaN is a NaN (the copy's conversion and the read's rounding may quiet a NaN
        // with different payloads).
        const std::vector<double> r = c_read.to_f64(), k = c_copy.to_f64();
        int64_t differ = 0, nans = 0;
        for (size_t j = 0; j < r.size(); ++j) {
          nans += std::isnan(r[j]);
          differ += std::isnan(r[j]) != std::isnan(k[j]) ||
                    (!std::isnan(r[j]) && std::memcmp(&r[j], &k[j], sizeof(double)) != 0);
        }
        EXPECT_EQ(differ, 0) << be << " M=" << M << (tb ? " b transposed" : "");
        if (M == 1) EXPECT_EQ(nans, 3) << be << (tb ? " b transposed" : "");  // the three NaN columns
        if (M == 1) continue;  // (its outputs with a special value are not finite)
        // Not simply the product with the unrounded b.
        HostTensor c_plain(act, {M, N}), a_act = a.as(act);
        ops->matmul(c_plain, a_act, b_act, false, tb, false);
        EXPECT_GT(rel_l2(c_plain, c_copy), 1e-4) << be;
      }
  }
}

// A backend may keep the last call's rotation table (the CPU one does, while positions and frequencies repeat):
// every call in a sequence that changes one of them at a time, forward and backward, must be bitwise the same
// call on a fresh backend; and a call too long for the table gives the rows the table gives.
TEST(Rope, ARepeatedCallIsTheFreshCall) {
  std::mt19937_64 rng(11);
  for (const std::string& be : backends_under_test()) {
    auto ops = make_ops(be);
    const DType act = ops->act_dtype();
    const int64_t T = 40, H = 3, D = 64;
    HostTensor x(DType::f32, {T, H, D});
    x.randn(rng);
    const HostTensor xa = x.as(act);
    HostTensor pa(DType::i32, {T}), pb(DType::i32, {T}), pc(DType::i32, {T / 2});
    pa.randint(rng, 0, 100000);
    pb.randint(rng, 0, 100000);
    for (int64_t t = 0; t < T / 2; ++t) pc.ptr<int32_t>()[t] = pa.ptr<int32_t>()[t];
    RopeConfig c1, c2;
    c2.theta = 500000.0;
    c2.scaling = RopeScaling::yarn, c2.factor = 4.0, c2.attention_factor = 1.1;
    HostTensor pa2 = pa;  // pa with its last position moved
    pa2.ptr<int32_t>()[T - 1] += 1;
    struct Call { const HostTensor* pos; const RopeConfig* cfg; bool backward; };
    const std::vector<Call> calls = {{&pa, &c1, false}, {&pa, &c1, true}, {&pb, &c1, false}, {&pa, &c2, false},
                                     {&pa, &c1, true}, {&pa2, &c1, false}, {&pc, &c1, false}, {&pa, &c1, false}};
    for (size_t i = 0; i < calls.size(); ++i) {
      const Call& c = calls[i];
      const int64_t n = c.pos->numel();
      const Tensor in(xa.t().data, act, {n, H, D});  // its first n rows
      HostTensor got(act, {n, H, D}), want(act, {n, H, D});
      auto fresh = make_ops(be);
      if (c.backward) {
        ops->rope_backward(got, in, *c.pos, *c.cfg);
        fresh->rope_backward(want, in, *c.pos, *c.cfg);
      } else {
        ops->rope_forward(got, in, *c.pos, *c.cfg);
        fresh->rope_forward(want, in, *c.pos, *c.cfg);
      }
      EXPECT_EQ(std::memcmp(got.t().data, want.t().data, got.t().nbytes()), 0) << be << " call " << i;
    }
    // 2100 positions x 32 pairs: past the CPU backend's table; its first 40 rows are the 40-position call's.
    const int64_t L = 2100;
    HostTensor pl(DType::i32, {L}), xl(DType::f32, {L, 1, D});
    pl.randint(rng, 0, 100000);
    xl.randn(rng);
    const HostTensor xla = xl.as(act);
    HostTensor yl(act, {L, 1, D}), ys(act, {T, 1, D});
    ops->rope_forward(yl, xla, pl, c2);
    ops->rope_forward(ys, Tensor(xla.t().data, act, {T, 1, D}), Tensor(pl.t().data, DType::i32, {T}), c2);
    EXPECT_EQ(std::memcmp(yl.t().data, ys.t().data, ys.t().nbytes()), 0) << be;
  }
}

// Ids and targets outside the vocabulary: each backend checks the values where it reads them (the shared
// checks read no tensor memory), with a message naming the op, the value and its position.
TEST(OpsErrors, IdsAndTargetsOutsideTheVocabularyNameThem) {
  std::vector<std::string> bes = backends_under_test();
  bes.push_back("ref");
  for (const std::string& be : bes) {
    auto ops = make_ops(be);
    const DType act = ops->act_dtype();
    HostTensor table(act, {6, 5}), rows(act, {4, 5}), ids(DType::i32, {4});
    table.fill(0.5);
    for (int64_t t = 0; t < 4; ++t) ids.set(t, t == 2 ? 99 : t);
    auto expect_msg = [&](auto&& fn, const std::string& want) {
      try {
        fn();
        ADD_FAILURE() << be << ": no error, expected " << want;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << be << ": " << e.what();
      }
    };
    expect_msg([&] { ops->embedding_forward(rows, ids, table); },
               "[embedding] id 99 at position 2 is outside the vocabulary [0, 6)");
    expect_msg([&] { ops->embedding_backward(table, rows, ids); },
               "[embedding_backward] id 99 at position 2 is outside the vocabulary [0, 6)");
    HostTensor h(act, {4, 5}), lse(act, {4}), dh(act, {4, 5}), dw(act, {6, 5}), tg(DType::i32, {4});
    h.fill(0.25);
    for (int64_t t = 0; t < 4; ++t) tg.set(t, t == 3 ? 6 : t == 1 ? -100 : t);
    const std::string bad = "target 6 of row 3 is outside the vocabulary [0, 6) and is not the ignore index -100";
    expect_msg([&] { ops->linear_cross_entropy_forward(lse, h, table, tg, -100); }, bad);
    expect_msg([&] { ops->linear_cross_entropy_backward(dh, dw, h, table, tg, lse, -100, 1.0); }, bad);
    expect_msg([&] { ops->linear_cross_entropy_fused(lse, dh, h, table, tg, -100, 1.0); }, bad);
    expect_msg([&] { ops->linear_cross_entropy_trained(lse, dh, dw, h, table, tg, -100, 1.0); }, bad);
    expect_msg([&] { ops->target_logits(h, table, tg, -100); }, bad);
  }
}

// Only matmul's b and the cross-entropy head take a tensor read as bf16; every other use names it.
TEST(OpsErrors, ReadAsBf16IsRefusedWhereNotSupported) {
  for (const std::string& be : backends_under_test()) {
    auto ops = make_ops(be);
    const DType act = ops->act_dtype();
    HostTensor x(act, {4, 6}), w(act, {6}), rstd(act, {4}), b(act, {6, 5}), c(act, {4, 5});
    x.fill(1.0);
    w.fill(1.0);
    auto expect_error = [](auto&& fn, std::initializer_list<const char*> parts, const std::string& what) {
      try {
        fn();
        ADD_FAILURE() << what << ": no error";
      } catch (const Error& e) {
        for (const char* p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << what << ": " << e.what();
      }
    };
    expect_error([&] { ops->rmsnorm_forward(x, rstd, x, w.t().read_as_bf16(), 1e-5); }, {"[rmsnorm]", "read as bf16"},
                 be);
    // b read as bf16 needs a bf16 a.
    expect_error([&] { ops->matmul(c, x, b.t().read_as_bf16(), false, false, false); },
                 {"[matmul]", "read as bf16", "needs a bf16 a"}, be);
  }
}

// Dropout: the same mask on both backends and any offset split; the kept fraction and the mean of
// dropout(x) over seeds are 1 - p and x within 5 standard deviations; accumulate adds.
TEST(Dropout, SameMaskEverywhereAndUnbiased) {
  auto cpu = make_ops("cpu");
  auto ref = make_ops("ref");
  const int64_t n = 4000;
  const double p = 0.3;
  std::vector<float> x(n), y(n), y2(n);
  for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = 1.0f + static_cast<float>(i % 7);
  std::vector<double> xd(x.begin(), x.end()), yd(n);
  cpu->dropout(Tensor::of(y.data(), {n}), Tensor::of(x.data(), {n}), p, 42, 1000, false);
  ref->dropout(Tensor::of(yd.data(), {n}), Tensor::of(xd.data(), {n}), p, 42, 1000, false);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const size_t k = static_cast<size_t>(i);
    EXPECT_EQ(y[k] != 0, yd[k] != 0) << i;
    if (y[k] != 0) {
      ++kept;
      EXPECT_FLOAT_EQ(y[k], x[k] / 0.7f);
    }
  }
  const double sd = std::sqrt(n * p * (1 - p));
  EXPECT_NEAR(static_cast<double>(kept), n * (1 - p), 5 * sd);
  // The second half drawn on its own (offset + 2000) is the same mask.
  cpu->dropout(Tensor::of(y2.data() + 2000, {n - 2000}), Tensor::of(x.data() + 2000, {n - 2000}), p, 42, 3000, false);
  EXPECT_EQ(std::memcmp(y.data() + 2000, y2.data() + 2000, (n - 2000) * sizeof(float)), 0);
  std::vector<float> acc(n, 2.0f);
  cpu->dropout(Tensor::of(acc.data(), {n}), Tensor::of(x.data(), {n}), p, 42, 1000, true);
  for (size_t k = 0; k < acc.size(); ++k) EXPECT_EQ(acc[k], 2.0f + y[k]) << k;
  // Unbiased: the mean over 400 seeds of dropout(1) is 1 (sd of one draw sqrt(p / (1 - p))).
  std::vector<float> ones(64, 1.0f), out(64);
  std::vector<double> mean(64, 0.0);
  const int seeds = 400;
  for (int si = 0; si < seeds; ++si) {
    cpu->dropout(Tensor::of(out.data(), {64}), Tensor::of(ones.data(), {64}), p, 1000 + si, 0, false);
    for (size_t k = 0; k < 64; ++k) mean[k] += out[k] / seeds;
  }
  const double se = std::sqrt(p / (1 - p) / seeds);
  for (size_t k = 0; k < 64; ++k) EXPECT_NEAR(mean[k], 1.0, 5 * se) << k;
  EXPECT_THROW(cpu->dropout(Tensor::of(y.data(), {n}), Tensor::of(x.data(), {n}), 1.0, 1, 0, false), Error);
}

}  // namespace
}  // namespace oomless::test

namespace oomless {
namespace {

// DoRA's ops on the CPU against the float64 reference (relative L2 within fp32 rounding), the same bits for
// 1 and 2 threads, a block-quantised w read as the GEMM reads it, and dz aliasing dy.
TEST(DoraOps, MatchReferenceAndThreadCounts) {
  auto cpu = make_ops("cpu");
  auto ref = make_ops("ref");
  std::mt19937_64 rng(77);
  std::normal_distribution<double> nd(0.0, 1.0);
  const int64_t T = 37, N = 70, K = 45, r = 5;
  auto rnd = [&](int64_t n, double mean = 0) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = static_cast<float>(mean + nd(rng));
    return v;
  };
  auto f64 = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
  auto rel = [](const std::vector<float>& a, const std::vector<double>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < b.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
    return std::sqrt(num / den);
  };
  std::vector<float> w = rnd(N * K), b = rnd(N * r), p = rnd(r * N), q = rnd(N * r), m = rnd(N, 3.0);
  std::vector<float> y = rnd(T * N), dy = rnd(T * N), bias = rnd(N), dm0 = rnd(N);
  std::vector<double> wd = f64(w), bd = f64(b), pd = f64(p), qd = f64(q), md = f64(m), biasd = f64(bias);
  // Row norms of w, then n and g from them (scaled down so that n^2 stays positive).
  const double s = 0.05;
  std::vector<float> wn(N), n(N), g(N);
  std::vector<double> wnd(N), ndd(N), gd(N);
  cpu->row_norms(Tensor::of(wn.data(), {N}), Tensor::of(w.data(), {N, K}));
  ref->row_norms(Tensor::of(wnd.data(), {N}), Tensor::of(wd.data(), {N, K}));
  EXPECT_LT(rel(wn, wnd), 1e-7);
  cpu->dora_scale(Tensor::of(g.data(), {N}), Tensor::of(n.data(), {N}), Tensor::of(m.data(), {N}),
                  Tensor::of(wn.data(), {N}), Tensor::of(b.data(), {N, r}), Tensor::of(p.data(), {r, N}),
                  Tensor::of(q.data(), {N, r}), s);
  ref->dora_scale(Tensor::of(gd.data(), {N}), Tensor::of(ndd.data(), {N}), Tensor::of(md.data(), {N}),
                  Tensor::of(wnd.data(), {N}), Tensor::of(bd.data(), {N, r}), Tensor::of(pd.data(), {r, N}),
                  Tensor::of(qd.data(), {N, r}), s);
  EXPECT_LT(rel(n, ndd), 1e-6);
  EXPECT_LT(rel(g, gd), 1e-6);
  double cross = 0, self = 0;  // n_5 by hand
  for (int64_t i = 0; i < r; ++i) cross += bd[5 * r + i] * pd[i * N + 5], self += bd[5 * r + i] * qd[5 * r + i];
  EXPECT_NEAR(ndd[5], std::sqrt(wnd[5] * wnd[5] + 2 * s * cross + s * s * self), 1e-12);
  // Forward: y = g y + bias, z = y before.
  std::vector<float> yc = y, z(T * N);
  std::vector<double> ydd = f64(y), zd(T * N);
  cpu->dora_forward(Tensor::of(yc.data(), {T, N}), Tensor::of(z.data(), {T, N}), Tensor::of(g.data(), {N}),
                    Tensor::of(bias.data(), {N}));
  ref->dora_forward(Tensor::of(ydd.data(), {T, N}), Tensor::of(zd.data(), {T, N}), Tensor::of(gd.data(), {N}),
                    Tensor::of(biasd.data(), {N}));
  EXPECT_EQ(std::memcmp(z.data(), y.data(), y.size() * 4), 0);
  EXPECT_LT(rel(yc, ydd), 1e-6);
  // Backward, dz aliasing dy, for 1 and 2 threads.
  std::vector<float> out[2], dmo[2];
  const int threads = get_threads();
  for (int th : {1, 2}) {
    set_threads(th);
    out[th - 1] = dy, dmo[th - 1] = dm0;
    cpu->dora_backward(Tensor::of(out[th - 1].data(), {T, N}), Tensor::of(dmo[th - 1].data(), {N}),
                       Tensor::of(out[th - 1].data(), {T, N}), Tensor::of(z.data(), {T, N}), Tensor::of(g.data(), {N}),
                       Tensor::of(n.data(), {N}));
  }
  set_threads(threads);
  EXPECT_EQ(std::memcmp(out[0].data(), out[1].data(), out[0].size() * 4), 0);
  EXPECT_EQ(std::memcmp(dmo[0].data(), dmo[1].data(), dmo[0].size() * 4), 0);
  std::vector<double> dzd(T * N), dmd = f64(dm0), dyd = f64(dy), zdd = f64(z), gdd = f64(g), nd2 = f64(n);
  ref->dora_backward(Tensor::of(dzd.data(), {T, N}), Tensor::of(dmd.data(), {N}), Tensor::of(dyd.data(), {T, N}),
                     Tensor::of(zdd.data(), {T, N}), Tensor::of(gdd.data(), {N}), Tensor::of(nd2.data(), {N}));
  EXPECT_LT(rel(out[0], dzd), 1e-6);
  EXPECT_LT(rel(dmo[0], dmd), 1e-6);
  // scale_rows.
  std::vector<float> ws = w;
  std::vector<double> wsd = wd;
  cpu->scale_rows(Tensor::of(ws.data(), {N, K}), Tensor::of(g.data(), {N}));
  ref->scale_rows(Tensor::of(wsd.data(), {N, K}), Tensor::of(gdd.data(), {N}));
  EXPECT_LT(rel(ws, wsd), 1e-7);
  // A quantised w (here a toy format: rows of w halved): the norms of what dequant_row gives.
  QuantMatrix qm;
  qm.format = "toy";
  qm.rows = N, qm.cols = K, qm.data = w.data();
  qm.dequant_row = [](const QuantMatrix& qq, int64_t row, int64_t col, int64_t cnt, float* o) {
    for (int64_t j = 0; j < cnt; ++j) o[j] = 0.5f * static_cast<const float*>(qq.data)[row * qq.cols + col + j];
  };
  Tensor wq(nullptr, DType::f32, {N - 3, K});
  wq.quant = &qm, wq.qrow0 = 3;
  std::vector<float> wnq(N - 3);
  cpu->row_norms(Tensor::of(wnq.data(), {N - 3}), wq);
  for (int64_t j = 0; j < N - 3; ++j) EXPECT_FLOAT_EQ(wnq[static_cast<size_t>(j)], 0.5f * wn[static_cast<size_t>(j + 3)]);
  // Shapes and dtypes are checked.
  EXPECT_THROW(cpu->row_norms(Tensor::of(wn.data(), {N - 1}), Tensor::of(w.data(), {N, K})), Error);
  EXPECT_THROW(cpu->dora_forward(Tensor::of(yc.data(), {T, N}), Tensor(), Tensor::of(g.data(), {N - 1}), Tensor()), Error);
  EXPECT_THROW(cpu->dora_scale(Tensor::of(g.data(), {N}), Tensor::of(g.data(), {N}), Tensor::of(m.data(), {N}),
                               Tensor::of(wn.data(), {N}), Tensor(), Tensor(), Tensor(), 0.0),
               Error);
}

}  // namespace
}  // namespace oomless

namespace oomless::test {
namespace {

float gs_at(const HostTensor& t, int64_t i) { return t.ptr<float>()[i]; }

// AdamW and the sum of squares run in AVX-512 / AVX2 clones on CPUs that have them: the bits must be those of
// the plain float arithmetic (no fused multiply-add taken where the formula has none), as written here, and
// for the sum of squares those of its eight lanes a 16384-element chunk added in the stated order.
TEST(CpuOps, AdamWAndSumOfSquaresGiveThePlainArithmeticsBits) {
  auto ops = make_ops("cpu");
  std::mt19937_64 rng(11);
  const int64_t n = 100003;  // past one task's block, with a tail
  HostTensor p(DType::f32, {n}), g(DType::f32, {n}), m(DType::f32, {n}), v(DType::f32, {n});
  p.randn(rng);
  g.randn(rng);
  m.randn(rng);
  v.uniform(rng, 0.0, 0.05);
  std::vector<float> pe(p.ptr<float>(), p.ptr<float>() + n), me(m.ptr<float>(), m.ptr<float>() + n),
      ve(v.ptr<float>(), v.ptr<float>() + n);
  for (bool after : {false, true}) {
    AdamWConfig cfg;
    cfg.lr = 1e-2, cfg.weight_decay = 0.1, cfg.step = 3, cfg.decay_after_update = after;
    ops->adamw_step(p, g, m, v, cfg);
    const float b1 = static_cast<float>(cfg.beta1), b2 = static_cast<float>(cfg.beta2);
    const float omb1 = static_cast<float>(1.0 - cfg.beta1), omb2 = static_cast<float>(1.0 - cfg.beta2);
    const float inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(cfg.beta1, 3.0)));
    const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(cfg.beta2, 3.0)));
    const float lr = static_cast<float>(cfg.lr), wd = static_cast<float>(cfg.weight_decay);
    const float eps = static_cast<float>(cfg.eps), keep = static_cast<float>(1.0 - cfg.lr * cfg.weight_decay);
    const float* gs = g.ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      volatile float prod_m = b1 * me[i], prod_g = omb1 * gs[i];  // each product rounded on its own
      const float mi = prod_m + prod_g;
      volatile float prod_v = b2 * ve[i], og = omb2 * gs[i];
      volatile float prod_gg = og * gs[i];
      const float vi = prod_v + prod_gg;
      me[i] = mi, ve[i] = vi;
      volatile float num = mi * inv_bc1, den_s = std::sqrt(vi) * inv_sqrt_bc2;
      const float update = num / (den_s + eps);
      if (after) {
        volatile float step = lr * update;
        pe[i] = (pe[i] - step) * keep;
      } else {
        volatile float decay = wd * pe[i];
        pe[i] -= lr * (update + decay);
      }
      ASSERT_EQ(f32_bits(p.ptr<float>()[i]), f32_bits(pe[i])) << "param " << i << (after ? " (decay after)" : "");
      ASSERT_EQ(f32_bits(m.ptr<float>()[i]), f32_bits(me[i])) << "m " << i;
      ASSERT_EQ(f32_bits(v.ptr<float>()[i]), f32_bits(ve[i])) << "v " << i;
    }
  }
  // Magnitudes spread over 2^-20 .. 2^20, so that another order of the additions rounds differently.
  for (int64_t i = 0; i < n; ++i) g.ptr<float>()[i] = std::ldexp(g.ptr<float>()[i], static_cast<int>(rng() % 41) - 20);
  double total = 0;
  for (int64_t c0 = 0; c0 < n; c0 += 16384) {
    const int64_t c1 = std::min(n, c0 + 16384);
    double lane[8] = {};
    int64_t i = c0;
    for (; i + 8 <= c1; i += 8)
      for (int l = 0; l < 8; ++l) lane[l] += static_cast<double>(gs_at(g, i + l)) * gs_at(g, i + l);
    double s = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    for (; i < c1; ++i) s += static_cast<double>(gs_at(g, i)) * gs_at(g, i);
    total += s;
  }
  EXPECT_EQ(ops->sum_squares(g), total);
  // The lanes added pairwise: 2.25 + (2^-52 + 2^-52) is 2.25 + 2^-51, where adding the two halves of an ulp one
  // at a time would round back to 2.25 twice.
  HostTensor x(DType::f32, {8});
  x.fill(0.0);
  x.ptr<float>()[0] = 1.5f, x.ptr<float>()[2] = x.ptr<float>()[3] = std::ldexp(1.0f, -26);
  EXPECT_EQ(ops->sum_squares(x), 2.25 + std::ldexp(1.0, -51));
}

}  // namespace
}  // namespace oomless::test
