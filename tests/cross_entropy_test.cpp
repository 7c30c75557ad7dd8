// Fused LM head + cross-entropy: every built backend against the float64 reference (forward lse, loss
// and count; backward dh and the accumulated dw; the one-call forward + dh of a frozen head), a
// finite-difference check of the reference backward, bitwise determinism across thread counts, ignored
// rows, large logits, targets predicted with near certainty and bad input.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>

#include "backend/ref/ref_ops.h"
#include "util/harness.h"

namespace oomless::test {
namespace {

constexpr int32_t kIgnore = -100;

// One random instance, given to the backend as is and to ref widened exactly to f64.
struct Problem {
  HostTensor h;        // (T, E) f32
  HostTensor w;        // (V, E) f32 or bf16
  HostTensor targets;  // (T) i32, about a fifth of them kIgnore
  HostTensor dw0;      // (V, E) f32, the gradient dw accumulates onto
};

Problem make_problem(int64_t T, int64_t E, int64_t V, DType wt, uint64_t seed, double h_scale = 1.0) {
  std::mt19937_64 rng(seed);
  Problem p{HostTensor(DType::f32, {T, E}), HostTensor(wt, {V, E}), HostTensor(DType::i32, {T}),
            HostTensor(DType::f32, {V, E})};
  p.h.randn(rng, h_scale);
  p.w.randn(rng, 1.0 / std::sqrt(static_cast<double>(E)));  // logits of about h_scale
  p.targets.randint(rng, 0, static_cast<int32_t>(V));
  std::bernoulli_distribution ignored(0.2);
  for (int64_t t = 0; t < T; ++t)
    if (ignored(rng)) p.targets.set(t, kIgnore);
  p.dw0.randn(rng, 1e-3);
  return p;
}

struct Outputs {
  CeResult r;
  HostTensor lse;  // (T)
  HostTensor dh;   // (T, E)
  HostTensor dw;   // (V, E), dw0 + the gradient
};

// Forward then backward on `ops` in its activation dtype. lse and dh start as garbage so that every
// element must be written; dw starts as dw0.
Outputs run(Ops& ops, const Problem& p, double grad_scale) {
  const DType act = ops.act_dtype();
  const int64_t T = p.h.t().dims[0], E = p.h.t().dims[1];
  HostTensor h = p.h.as(act);
  HostTensor w = act == DType::f64 ? p.w.as(DType::f64) : p.w.clone();  // exact: the same bf16 values
  Outputs o{CeResult{}, HostTensor(act, {T}), HostTensor(act, {T, E}), p.dw0.as(act)};
  o.lse.fill(12345.0);
  o.dh.fill(7.0);
  o.r = ops.linear_cross_entropy_forward(o.lse, h, w, p.targets, kIgnore);
  ops.linear_cross_entropy_backward(o.dh, o.dw, h, w, p.targets, o.lse, kIgnore, grad_scale);
  return o;
}

// The one-call versions: linear_cross_entropy_fused (no dw: dw is left as dw0), or with a trained head
// linear_cross_entropy_trained (dw += as well), the head read as bf16 when w_as_bf16.
Outputs run_one_call(Ops& ops, const Problem& p, double grad_scale, bool trained, bool w_as_bf16 = false) {
  const DType act = ops.act_dtype();
  const int64_t T = p.h.t().dims[0], E = p.h.t().dims[1];
  HostTensor h = p.h.as(act);
  HostTensor w = act == DType::f64 ? p.w.as(DType::f64) : p.w.clone();
  Outputs o{CeResult{}, HostTensor(act, {T}), HostTensor(act, {T, E}), p.dw0.as(act)};
  o.lse.fill(12345.0);
  o.dh.fill(7.0);
  const Tensor wt = w_as_bf16 ? w.t().read_as_bf16() : w.t();
  o.r = trained ? ops.linear_cross_entropy_trained(o.lse, o.dh, o.dw, h, wt, p.targets, kIgnore, grad_scale)
                : ops.linear_cross_entropy_fused(o.lse, o.dh, h, wt, p.targets, kIgnore, grad_scale);
  return o;
}
Outputs run_fused(Ops& ops, const Problem& p, double grad_scale) { return run_one_call(ops, p, grad_scale, false); }
Outputs run_trained(Ops& ops, const Problem& p, double grad_scale, bool w_as_bf16 = false) {
  return run_one_call(ops, p, grad_scale, true, w_as_bf16);
}

// got - base, in f64.
HostTensor minus(const HostTensor& got, const HostTensor& base) {
  HostTensor d(DType::f64, {got.numel()});
  for (int64_t i = 0; i < got.numel(); ++i) d.set(i, got.get(i) - base.get(i));
  return d;
}

// Bit for bit the same outputs: count, loss, lse, dh, and dw unless `dw_close` (then dw - dw0 within f32's
// tolerance).
void expect_same(const Outputs& got, const Outputs& want, const Problem& p, const std::string& what,
                 bool dw_close = false) {
  EXPECT_EQ(got.r.count, want.r.count) << what;
  EXPECT_EQ(std::memcmp(&got.r.loss_sum, &want.r.loss_sum, sizeof(double)), 0) << what << " loss";
  EXPECT_EQ(std::memcmp(got.lse.t().data, want.lse.t().data, want.lse.t().nbytes()), 0) << what << " lse";
  EXPECT_EQ(std::memcmp(got.dh.t().data, want.dh.t().data, want.dh.t().nbytes()), 0) << what << " dh";
  if (dw_close)
    expect_close(minus(got.dw, p.dw0), minus(want.dw, p.dw0), tol_for(DType::f32), what + " dw - dw0");
  else
    EXPECT_EQ(std::memcmp(got.dw.t().data, want.dw.t().data, want.dw.t().nbytes()), 0) << what << " dw";
}

// Compares a backend's outputs with ref's at relative tolerance `tol`. The loss is a sum of
// differences lse - logit of values as large as |lse|, so its error is measured against sum |lse|.
void expect_matches(const Outputs& got, const Outputs& ref, const Problem& p, double tol, const std::string& what) {
  EXPECT_EQ(got.r.count, ref.r.count) << what;
  double lse_mass = 0;
  for (int64_t t = 0; t < ref.lse.numel(); ++t) lse_mass += std::fabs(ref.lse.get(t));
  EXPECT_NEAR(got.r.loss_sum, ref.r.loss_sum, tol * (std::fabs(ref.r.loss_sum) + lse_mass) + 1e-30)
      << what << " loss_sum";
  expect_close(got.lse, ref.lse, tol, what + " lse");
  expect_close(got.dh, ref.dh, tol, what + " dh");
  expect_close(got.dw, ref.dw, tol, what + " dw (+= onto dw0)");
  expect_close(minus(got.dw, p.dw0), minus(ref.dw, p.dw0), tol, what + " dw - dw0");
}

double grad_scale_for(const Problem& p) {
  int64_t n = 0;
  for (int64_t t = 0; t < p.targets.numel(); ++t) n += p.targets.get(t) != kIgnore;
  return n ? 1.0 / static_cast<double>(n) : 0.5;
}

struct Case {
  int64_t T, E, V;
  DType w;
  std::string backend;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.backend << " T=" << c.T << " E=" << c.E << " V=" << c.V << " w " << dtype_name(c.w);
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return c.backend + "_T" + std::to_string(c.T) + "_E" + std::to_string(c.E) + "_V" + std::to_string(c.V) + "_" +
         dtype_name(c.w);
}

class CrossEntropyMatrix : public testing::TestWithParam<Case> {};

// A bf16 w is compared against ref on the same bf16-rounded weights, so the tolerance stays f32's. The fused
// call of the same problem too.
TEST_P(CrossEntropyMatrix, MatchesReference) {
  const Case& c = GetParam();
  Problem p = make_problem(c.T, c.E, c.V, c.w, 1000 * c.T + 10 * c.E + c.V);
  auto ops = make_ops(c.backend);
  RefOps ref;
  const double gs = grad_scale_for(p);
  Outputs got = run(*ops, p, gs), want = run(ref, p, gs);
  expect_matches(got, want, p, tol_for(DType::f32), c.backend);
  // The fused call (a frozen head): lse and loss are the forward's bits, dh matches ref's at f32's tolerance.
  Outputs fused = run_fused(*ops, p, gs);
  EXPECT_EQ(std::memcmp(&fused.r.loss_sum, &got.r.loss_sum, sizeof(double)), 0) << c.backend << " fused loss";
  EXPECT_EQ(fused.r.count, got.r.count);
  EXPECT_EQ(std::memcmp(fused.lse.t().data, got.lse.t().data, got.lse.t().nbytes()), 0) << c.backend << " fused lse";
  expect_close(fused.dh, want.dh, tol_for(DType::f32), c.backend + " fused dh");
  // The trained call (dw too): the forward's and backward's bits (the CPU backend keeps Tc rows here).
  expect_same(run_trained(*ops, p, gs), got, p, c.backend + " trained");
}

std::vector<Case> all_cases() {
  std::vector<Case> cs;
  for (const std::string& be : backends_under_test())
    for (DType w : {DType::f32, DType::bf16})
      for (int64_t T : {1, 7, 33, 257})
        for (int64_t E : {16, 64})
          for (int64_t V : {1, 7, 100, 8192, 10007}) cs.push_back({T, E, V, w, be});
  // Several token chunks and a one-column last vocab chunk: the CPU kernel's 8 MiB tile holds 512
  // rows of 4096 logits.
  for (const std::string& be : backends_under_test())
    for (DType w : {DType::f32, DType::bf16}) cs.push_back({1100, 16, 4097, w, be});
  return cs;
}

INSTANTIATE_TEST_SUITE_P(Matrix, CrossEntropyMatrix, testing::ValuesIn(all_cases()), case_name);

// Central differences in float64 of grad_scale * loss_sum against the reference backward.
TEST(CrossEntropyRef, BackwardMatchesFiniteDifferences) {
  const int64_t T = 4, E = 3, V = 5;
  std::mt19937_64 rng(7);
  HostTensor h(DType::f64, {T, E}), w(DType::f64, {V, E}), targets(DType::i32, {T}), lse(DType::f64, {T});
  h.randn(rng);
  w.randn(rng);
  const int32_t tg[T] = {1, kIgnore, 4, 0};
  for (int64_t t = 0; t < T; ++t) targets.set(t, tg[t]);
  const double gs = 0.7, step = 1e-5;
  RefOps ref;
  auto loss = [&] { return gs * ref.linear_cross_entropy_forward(lse, h, w, targets, kIgnore).loss_sum; };
  loss();
  HostTensor dh(DType::f64, {T, E}), dw(DType::f64, {V, E});
  dw.fill(0.0);
  ref.linear_cross_entropy_backward(dh, dw, h, w, targets, lse, kIgnore, gs);
  for (auto [x, g, name] : {std::tuple{&h, &dh, "dh"}, std::tuple{&w, &dw, "dw"}}) {
    for (int64_t i = 0; i < x->numel(); ++i) {
      const double x0 = x->get(i);
      x->set(i, x0 + step);
      const double up = loss();
      x->set(i, x0 - step);
      const double down = loss();
      x->set(i, x0);
      const double fd = (up - down) / (2 * step);
      EXPECT_NEAR(g->get(i), fd, 1e-8 * (1.0 + std::fabs(fd))) << name << "[" << i << "]";
    }
  }
  // The ignored row gets no gradient.
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(dh.get(1 * E + e), 0.0);
}

// Same results, bit for bit, for 1, 2 and 3 threads (a fresh backend each time).
TEST(CrossEntropy, BitwiseIdenticalAcrossThreadCounts) {
  const int max_threads = omp_get_max_threads();
  for (const std::string& be : backends_under_test())
    for (DType wt : {DType::f32, DType::bf16}) {
      Problem p = make_problem(600, 64, 9001, wt, 99);  // token chunks 512 + 88, vocab chunks 4096 + 4096 + 809
      std::vector<Outputs> outs, fused, trained;
      for (int threads : {1, 2, 3}) {
        omp_set_num_threads(threads);
        auto ops = make_ops(be);
        outs.push_back(run(*ops, p, 0.25));
        fused.push_back(run_fused(*ops, p, 0.25));
        trained.push_back(run_trained(*ops, p, 0.25));
      }
      omp_set_num_threads(max_threads);
      for (size_t k = 1; k < outs.size(); ++k) {
        const std::string what = be + " w " + dtype_name(wt) + ", threads 1 vs " + std::to_string(k + 1);
        for (auto m : {&Outputs::lse, &Outputs::dh})
          EXPECT_EQ(std::memcmp((fused[0].*m).t().data, (fused[k].*m).t().data, (fused[0].*m).t().nbytes()), 0)
              << what << " fused";
        EXPECT_EQ(std::memcmp(&outs[0].r.loss_sum, &outs[k].r.loss_sum, sizeof(double)), 0) << what << " loss";
        EXPECT_EQ(outs[0].r.count, outs[k].r.count) << what;
        expect_same(trained[k], trained[0], p, what + " trained");
        for (auto m : {&Outputs::lse, &Outputs::dh, &Outputs::dw})
          EXPECT_EQ(std::memcmp((outs[0].*m).t().data, (outs[k].*m).t().data, (outs[0].*m).t().nbytes()), 0) << what;
      }
    }
}

// bf16 compute: a float head read as bf16 (Tensor::as_bf16: the LM head of bf16 training reads the fp32
// master weights without a copy) gives the bits of a float head holding the rounded values, read the same
// way, forward, backward and fused.
// Every product then takes bf16 operands (h and the dlogits are rounded as well, as the model's other
// products round theirs), so the result is within bf16 rounding of the fp32 computation with the rounded
// head, not its bits.
TEST(CrossEntropy, HeadReadAsBf16IsBf16Compute) {
  for (const std::string& be : backends_under_test()) {
    auto ops = make_ops(be);
    const DType act = ops->act_dtype();
    Problem p = make_problem(300, 48, 5003, DType::f32, 17);  // several vocab chunks
    auto once = [&](Tensor w) {
      const int64_t T = p.h.t().dims[0], E = p.h.t().dims[1];
      HostTensor h = p.h.as(act);
      Outputs o{CeResult{}, HostTensor(act, {T}), HostTensor(act, {T, E}), p.dw0.as(act)};
      o.r = ops->linear_cross_entropy_forward(o.lse, h, w, p.targets, kIgnore);
      ops->linear_cross_entropy_backward(o.dh, o.dw, h, w, p.targets, o.lse, kIgnore, 0.5);
      return o;
    };
    HostTensor w_act = p.w.as(act), w_copy = p.w.as(DType::bf16), w_round = w_copy.as(act);
    Outputs read = once(w_act.t().read_as_bf16()), copy = once(w_round.t().read_as_bf16());
    Outputs rounded = once(w_copy), plain = once(w_act);  // fp32 compute: the rounded head, the head itself
    EXPECT_EQ(std::memcmp(&read.r.loss_sum, &copy.r.loss_sum, sizeof(double)), 0) << be;
    for (auto m : {&Outputs::lse, &Outputs::dh, &Outputs::dw})
      EXPECT_EQ(std::memcmp((read.*m).t().data, (copy.*m).t().data, (read.*m).t().nbytes()), 0) << be;
    EXPECT_NE(read.r.loss_sum, plain.r.loss_sum) << be << ": the head was not rounded";
    EXPECT_NE(read.r.loss_sum, rounded.r.loss_sum) << be << ": h was not rounded";
    EXPECT_NEAR(read.r.loss_sum, rounded.r.loss_sum, 2e-3 * std::fabs(rounded.r.loss_sum)) << be;
    EXPECT_LT(rel_l2(read.dh, rounded.dh), 2e-2) << be;
    HostTensor dw_read = read.dw.clone(), dw_rounded = rounded.dw.clone();  // the gradients alone (dw0 added)
    for (int64_t i = 0; i < dw_read.numel(); ++i) {
      dw_read.set(i, dw_read.get(i) - p.dw0.get(i));
      dw_rounded.set(i, dw_rounded.get(i) - p.dw0.get(i));
    }
    EXPECT_LT(rel_l2(dw_read, dw_rounded), 2e-2) << be;
    auto fused = [&](Tensor w) {
      const int64_t T = p.h.t().dims[0], E = p.h.t().dims[1];
      HostTensor h = p.h.as(act), lse(act, {T}), dh(act, {T, E});
      ops->linear_cross_entropy_fused(lse, dh, h, w, p.targets, kIgnore, 0.5);
      return dh;
    };
    const HostTensor dh_read = fused(w_act.t().read_as_bf16()), dh_copy = fused(w_round.t().read_as_bf16());
    EXPECT_EQ(std::memcmp(dh_read.t().data, dh_copy.t().data, dh_read.t().nbytes()), 0) << be << " fused";
    EXPECT_LT(rel_l2(dh_read, read.dh), 2e-2) << be << " fused against two-pass";
  }
}

// target_logits: each supervised row's h . w[target] in double, 0 for ignored rows, against ref; lse minus it,
// summed over the rows, is the forward's loss; with the head read as bf16, the logits of the bf16-rounded head,
// and again the loss's terms.
TEST(CrossEntropy, TargetLogitsAreTheLossesLogits) {
  RefOps ref;
  for (DType wt : {DType::f32, DType::bf16}) {
    const Problem p = make_problem(67, 40, 301, wt, 23);
    const int64_t T = p.h.t().dims[0];
    const HostTensor h64 = p.h.as(DType::f64), w64 = p.w.as(DType::f64);
    const std::vector<double> want = ref.target_logits(h64, w64, p.targets, kIgnore);
    for (const std::string& be : backends_under_test()) {
      auto ops = make_ops(be);
      const Outputs o = run(*ops, p, 1.0);
      const HostTensor h = p.h.as(ops->act_dtype());
      HostTensor w = ops->act_dtype() == DType::f64 ? p.w.as(DType::f64) : p.w.clone();
      const std::vector<double> got = ops->target_logits(h, w, p.targets, kIgnore);
      ASSERT_EQ(got.size(), static_cast<size_t>(T));
      double sum = 0;
      for (int64_t t = 0; t < T; ++t) {
        const size_t i = static_cast<size_t>(t);
        if (p.targets.get(t) == kIgnore) {
          EXPECT_EQ(got[i], 0.0) << be << " row " << t;
          continue;
        }
        EXPECT_NEAR(got[i], want[i], 1e-6 * (1 + std::fabs(want[i]))) << be << " row " << t;
        sum += o.lse.get(t) - got[i];
      }
      EXPECT_NEAR(sum, o.r.loss_sum, 1e-5 * std::fabs(o.r.loss_sum)) << be << " " << dtype_name(wt);
      if (wt != DType::f32) continue;
      // The head read as bf16: the rounded head's logits (the same bits as a bf16 copy of it).
      const HostTensor w_round = p.w.as(DType::bf16).as(ops->act_dtype());
      const std::vector<double> read = ops->target_logits(h, w.t().read_as_bf16(), p.targets, kIgnore);
      const std::vector<double> copy = ops->target_logits(h, w_round.t().read_as_bf16(), p.targets, kIgnore);
      EXPECT_EQ(std::memcmp(read.data(), copy.data(), read.size() * sizeof(double)), 0) << be;
      EXPECT_NE(std::memcmp(read.data(), got.data(), read.size() * sizeof(double)), 0) << be << ": not rounded";
      // and lse minus them sums to that head's loss (h rounded too, where the backend's products are bf16)
      HostTensor lse(ops->act_dtype(), {T});
      const CeResult rb = ops->linear_cross_entropy_forward(lse, h, w.t().read_as_bf16(), p.targets, kIgnore);
      double sb = 0;
      for (int64_t t = 0; t < T; ++t)
        if (p.targets.get(t) != kIgnore) sb += lse.get(t) - read[static_cast<size_t>(t)];
      EXPECT_NEAR(sb, rb.loss_sum, 1e-6 * std::fabs(rb.loss_sum)) << be << " read as bf16";
    }
  }
}

// Every row ignored: no loss, lse 0, dh 0, dw untouched; on ref too.
TEST(CrossEntropy, AllRowsIgnored) {
  std::vector<std::string> bes = backends_under_test();
  bes.push_back("ref");
  for (const std::string& be : bes) {
    Problem p = make_problem(33, 16, 100, DType::f32, 5);
    p.targets.fill(kIgnore);
    auto ops = make_ops(be);
    Outputs o = run(*ops, p, 0.5), f = run_fused(*ops, p, 0.5);
    expect_same(run_trained(*ops, p, 0.5), o, p, be + " trained");
    EXPECT_EQ(f.r.count, 0) << be;
    for (int64_t i = 0; i < f.dh.numel(); ++i) ASSERT_EQ(f.dh.get(i), 0.0) << be << " fused dh[" << i << "]";
    for (int64_t i = 0; i < f.lse.numel(); ++i) ASSERT_EQ(f.lse.get(i), 0.0) << be << " fused lse[" << i << "]";
    EXPECT_EQ(o.r.count, 0) << be;
    EXPECT_EQ(o.r.loss_sum, 0.0) << be;
    for (int64_t i = 0; i < o.lse.numel(); ++i) ASSERT_EQ(o.lse.get(i), 0.0) << be << " lse[" << i << "]";
    for (int64_t i = 0; i < o.dh.numel(); ++i) ASSERT_EQ(o.dh.get(i), 0.0) << be << " dh[" << i << "]";
    for (int64_t i = 0; i < o.dw.numel(); ++i) ASSERT_EQ(o.dw.get(i), p.dw0.get(i)) << be << " dw[" << i << "]";
  }
}

// The trained call at a vocabulary whose Tc rows of logits (512 x 33000 floats) pass the CPU backend's 64 MiB
// store: it keeps 496-row blocks, so lse, the loss and dh keep the two calls' bits and dw their value within
// fp32 rounding; and with the head read as bf16 (bf16 compute), where every product takes bf16 operands.
TEST(CrossEntropy, TrainedIsTheForwardThenTheBackward) {
  for (const std::string& be : backends_under_test()) {
    auto ops = make_ops(be);
    Problem p = make_problem(600, 16, 33000, DType::f32, 17);
    const double gs = grad_scale_for(p);
    expect_same(run_trained(*ops, p, gs), run(*ops, p, gs), p, be + " V 33000", true);
    Problem q = make_problem(300, 48, 5000, DType::f32, 18);
    Outputs want = run_trained(*ops, q, 0.125);  // the same call twice: the same bits
    expect_same(run_trained(*ops, q, 0.125), want, q, be + " again");
    // bf16 compute: the forward then the backward over the head read as bf16.
    HostTensor h = q.h.as(ops->act_dtype()), w = q.w.clone();
    Outputs two{CeResult{}, HostTensor(ops->act_dtype(), {300}), HostTensor(ops->act_dtype(), {300, 48}), q.dw0.clone()};
    two.r = ops->linear_cross_entropy_forward(two.lse, h, w.t().read_as_bf16(), q.targets, kIgnore);
    ops->linear_cross_entropy_backward(two.dh, two.dw, h, w.t().read_as_bf16(), q.targets, two.lse, kIgnore, 0.125);
    expect_same(run_trained(*ops, q, 0.125, true), two, q, be + " head read as bf16");
  }
}

// Logits of a few tens, the largest past 88.7 where exp overflows f32 (so only the max shift keeps
// them finite), stay finite and as accurate as ordinary ones.
TEST(CrossEntropy, LargeLogitsStayFiniteAndAccurate) {
  const double scale = 25.0;
  for (const std::string& be : backends_under_test())
    for (DType wt : {DType::f32, DType::bf16}) {
      Problem p = make_problem(33, 64, 1000, wt, 11, scale);
      auto ops = make_ops(be);
      RefOps ref;
      const double gs = grad_scale_for(p);
      Outputs got = run(*ops, p, gs), want = run(ref, p, gs);
      double max_lse = 0;
      for (int64_t t = 0; t < want.lse.numel(); ++t) max_lse = std::max(max_lse, std::fabs(want.lse.get(t)));
      EXPECT_GT(max_lse, 88.7) << "the case must reach logits whose exp overflows f32";
      EXPECT_TRUE(std::isfinite(got.r.loss_sum));
      expect_matches(got, want, p, tol_for(DType::f32), be + " w " + dtype_name(wt) + " large logits");
      expect_close(run_fused(*ops, p, gs).dh, want.dh, tol_for(DType::f32), be + " fused dh, large logits");
    }
}

// Targets the head predicts with p close to 1 (a trained model's easy tokens): dlogit_t = p_t - 1 is tiny
// and 1 - exp(logit_t - lse) in f32 keeps few of its bits. The fused call takes 1 - p_t as a sum of the
// other terms and so stays at f32's tolerance, at least as close to ref as the two-call backward.
TEST(CrossEntropy, ConfidentTargetsKeepTheirPrecision) {
  for (const std::string& be : backends_under_test()) {
    Problem p = make_problem(16, 32, 500, DType::f32, 23);
    // Each row's target is the column of its largest logit, its logit raised by 25 (p_t above 0.999).
    const int64_t T = 16, E = 32, V = 500;
    for (int64_t t = 0; t < T; ++t) {
      const int32_t v = static_cast<int32_t>((t * 37) % V);
      p.targets.set(t, v);
      double hh = 0;
      for (int64_t e = 0; e < E; ++e) hh += p.h.get(t * E + e) * p.h.get(t * E + e);
      for (int64_t e = 0; e < E; ++e) p.w.set(v * E + e, p.w.get(v * E + e) + 25.0 * p.h.get(t * E + e) / hh);
    }
    auto ops = make_ops(be);
    RefOps ref;
    const double gs = 1.0 / T;
    Outputs want = run(ref, p, gs), two = run(*ops, p, gs), fused = run_fused(*ops, p, gs);
    double worst = 1.0;
    for (int64_t t = 0; t < T; ++t) {
      const double logit = [&] {
        double s = 0;
        for (int64_t e = 0; e < E; ++e) s += p.h.get(t * E + e) * p.w.get(p.targets.get(t) * E + e);
        return s;
      }();
      worst = std::min(worst, std::exp(logit - want.lse.get(t)));
    }
    ASSERT_GT(worst, 0.999) << "every target must be predicted with near certainty";
    const double e_fused = rel_l2(fused.dh, want.dh), e_two = rel_l2(two.dh, want.dh);
    EXPECT_LE(e_fused, tol_for(DType::f32)) << be << " (two-call backward: " << e_two << ")";
    EXPECT_LE(e_fused, e_two) << be;
  }
}

void expect_error(const std::function<void()>& fn, std::initializer_list<const char*> parts, const std::string& what) {
  try {
    fn();
    ADD_FAILURE() << what << ": no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("[cross_entropy]", 0), 0u) << what << ": " << msg;
    for (const char* s : parts) EXPECT_NE(msg.find(s), std::string::npos) << what << ": '" << s << "' not in " << msg;
  }
}

TEST(CrossEntropy, BadInputThrows) {
  std::vector<std::string> bes = backends_under_test();
  bes.push_back("ref");
  for (const std::string& be : bes) {
    auto ops = make_ops(be);
    const DType act = ops->act_dtype();
    const int64_t T = 5, E = 4, V = 10;
    HostTensor h(act, {T, E}), w(act, {V, E}), lse(act, {T}), dh(act, {T, E}), dw(act, {V, E});
    HostTensor targets(DType::i32, {T});
    h.fill(0.1);
    w.fill(0.2);
    dw.fill(0.0);
    targets.fill(2);
    targets.set(3, 10);  // == V
    expect_error([&] { ops->linear_cross_entropy_forward(lse, h, w, targets, kIgnore); }, {"target 10", "row 3"},
                 be + " target == V");
    expect_error([&] { ops->linear_cross_entropy_backward(dh, dw, h, w, targets, lse, kIgnore, 1.0); },
                 {"target 10", "row 3"}, be + " backward target == V");
    targets.set(3, -1);  // negative and not the ignore index
    expect_error([&] { ops->linear_cross_entropy_forward(lse, h, w, targets, kIgnore); }, {"target -1", "row 3"},
                 be + " target -1");
    targets.set(3, 2);
    HostTensor w_wide(act, {V, E + 1}), lse_short(act, {T - 1}), dw_short(act, {V - 1, E}), h_i32(DType::i32, {T, E});
    HostTensor dw_bf16(DType::bf16, {V, E});
    expect_error([&] { ops->linear_cross_entropy_forward(lse, h, w_wide, targets, kIgnore); }, {"w"}, be + " width");
    expect_error([&] { ops->linear_cross_entropy_forward(lse_short, h, w, targets, kIgnore); }, {"lse"}, be + " lse");
    expect_error([&] { ops->linear_cross_entropy_forward(lse, h_i32, w, targets, kIgnore); }, {"h"}, be + " h dtype");
    expect_error([&] { ops->linear_cross_entropy_backward(dh, dw_short, h, w, targets, lse, kIgnore, 1.0); }, {"dw"},
                 be + " dw shape");
    expect_error([&] { ops->linear_cross_entropy_backward(dh, dw_bf16, h, w, targets, lse, kIgnore, 1.0); }, {"dw"},
                 be + " dw dtype");
  }
}

}  // namespace
}  // namespace oomless::test
