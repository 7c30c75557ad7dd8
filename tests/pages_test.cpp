// Ops::page_summary and Ops::page_select (page-level top-k sparse attention) on every backend, against the
// definitions computed here: a page's mean or per-dimension min and max; each query page's sinks plus the k
// history pages of the highest score, ties to the lower page, a NaN score last, every page when the history
// fits the selection, a short last query page.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "backend/ref/ref_ops.h"
#include "util/harness.h"

namespace oomless::test {
namespace {

std::vector<std::string> page_backends() {
  std::vector<std::string> b = backends_under_test();
  b.push_back("ref");
  return b;
}

TEST(Pages, SummaryIsTheMeanOrTheMinAndMaxOfThePageRows) {
  const int64_t Hkv = 2, Tc = 24, D = 5, P = 8;
  std::mt19937_64 rng(3);
  for (const std::string& be : page_backends()) {
    auto ops = make_ops(be);
    HostTensor k(ops->act_dtype(), {Hkv, Tc, D});
    k.randn(rng);
    for (int64_t row0 : {0, 8, 16})
      for (int64_t S : {1, 2}) {
        HostTensor out(DType::f32, {S, Hkv, D});
        ops->page_summary(out.t(), k.t(), row0, P);
        for (int64_t h = 0; h < Hkv; ++h)
          for (int64_t d = 0; d < D; ++d) {
            double sum = 0, lo = 1e300, hi = -1e300;
            for (int64_t t = row0; t < row0 + P; ++t) {
              const double x = k.get((h * Tc + t) * D + d);
              sum += x, lo = std::min(lo, x), hi = std::max(hi, x);
            }
            if (S == 1) {
              EXPECT_EQ(out.get(h * D + d), static_cast<float>(sum / P)) << be << " mean h " << h << " d " << d;
            } else {
              EXPECT_EQ(out.get(h * D + d), static_cast<float>(lo)) << be << " min h " << h << " d " << d;
              EXPECT_EQ(out.get((Hkv + h) * D + d), static_cast<float>(hi)) << be << " max h " << h << " d " << d;
            }
          }
        EXPECT_TRUE(out.guards_intact()) << be;
      }
    HostTensor bad(DType::f32, {1, Hkv, D});
    EXPECT_THROW(ops->page_summary(bad.t(), k.t(), 20, P), Error) << be << ": rows past the chunk";
  }
}

// The selection by definition: page j >= sinks scores sum_h sum_d f(qs(h, d), summary of j under h's kv head).
std::vector<int32_t> expected_selection(const HostTensor& q, const HostTensor& summ, int64_t qp, int64_t P,
                                        int64_t sinks, int64_t W) {
  const int64_t Tc = q.t().dims[0], H = q.t().dims[1], D = q.t().dims[2];
  const int64_t hist = summ.t().dims[0], S = summ.t().dims[1], Hkv = summ.t().dims[2];
  std::vector<int32_t> all(static_cast<size_t>(hist));
  std::iota(all.begin(), all.end(), 0);
  if (hist <= W) return all;
  std::vector<std::pair<double, int32_t>> scored;
  for (int64_t j = sinks; j < hist; ++j) {
    double sc = 0;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        double qs = 0;
        for (int64_t t = qp * P; t < std::min(Tc, (qp + 1) * P); ++t) qs += q.get((t * H + h) * D + d);
        const int64_t g = h / (H / Hkv);
        const double lo = summ.get(((j * S) * Hkv + g) * D + d);
        sc += S == 1 ? qs * lo : std::max(qs * lo, qs * summ.get(((j * S + 1) * Hkv + g) * D + d));
      }
    scored.push_back({std::isnan(sc) ? -std::numeric_limits<double>::infinity() : sc, static_cast<int32_t>(j)});
  }
  std::stable_sort(scored.begin(), scored.end(), [](auto& a, auto& b) { return a.first > b.first; });
  std::vector<int32_t> out(all.begin(), all.begin() + sinks);
  for (int64_t i = 0; i < W - sinks; ++i) out.push_back(scored[static_cast<size_t>(i)].second);
  std::sort(out.begin(), out.end());
  return out;
}

TEST(Pages, SelectionIsTheSinksAndTheBestScoredPages) {
  const int64_t H = 6, Hkv = 2, D = 4, P = 4, Tc = 14;  // 4 query pages, the last of 2 rows
  std::mt19937_64 rng(5);
  for (const std::string& be : page_backends())
    for (int64_t S : {1, 2})
      for (int64_t hist : {3, 12}) {
        auto ops = make_ops(be);
        const int64_t sinks = 1, W = 4;
        HostTensor q(ops->act_dtype(), {Tc, H, D}), summ(DType::f32, {hist, S, Hkv, D});
        q.randn(rng);
        summ.randn(rng);
        if (hist == 12) {
          for (int64_t i = 0; i < S * Hkv * D; ++i) summ.set(7 * S * Hkv * D + i, summ.get(5 * S * Hkv * D + i));  // a tie
          summ.set(9 * S * Hkv * D, std::numeric_limits<double>::quiet_NaN());  // a NaN score
        }
        const int64_t nq = (Tc + P - 1) / P;
        HostTensor sel(DType::i32, {nq, W}), cnt(DType::i32, {nq});
        ops->page_select(sel.t(), cnt.t(), q.t(), summ.t(), P, sinks);
        const std::string what = be + " S=" + std::to_string(S) + " hist=" + std::to_string(hist);
        for (int64_t qp = 0; qp < nq; ++qp) {
          const std::vector<int32_t> want = expected_selection(q, summ, qp, P, sinks, W);
          ASSERT_EQ(cnt.get(qp), static_cast<double>(want.size())) << what << " query page " << qp;
          for (size_t i = 0; i < want.size(); ++i)
            EXPECT_EQ(sel.get(qp * W + static_cast<int64_t>(i)), want[i]) << what << " query page " << qp << " #" << i;
          if (hist == 12) {
            for (size_t i = 0; i < want.size(); ++i) EXPECT_NE(want[i], 9) << what << ": the NaN page was selected";
          }
        }
        EXPECT_TRUE(sel.guards_intact() && cnt.guards_intact()) << what;
      }
}

// Ties go to the lower page: two pages with the same summary, room for one of them.
TEST(Pages, ATieSelectsTheLowerPage) {
  for (const std::string& be : page_backends()) {
    auto ops = make_ops(be);
    HostTensor q(ops->act_dtype(), {2, 1, 1}), summ(DType::f32, {4, 1, 1, 1}), sel(DType::i32, {1, 2}),
        cnt(DType::i32, {1});
    q.set(0, 1.0), q.set(1, 1.0);
    for (int64_t j = 0; j < 4; ++j) summ.set(j, j == 1 || j == 3 ? 2.0 : 0.5);
    ops->page_select(sel.t(), cnt.t(), q.t(), summ.t(), 2, 1);
    EXPECT_EQ(cnt.get(0), 2) << be;
    EXPECT_EQ(sel.get(0), 0) << be;
    EXPECT_EQ(sel.get(1), 1) << be;
  }
}

}  // namespace
}  // namespace oomless::test
