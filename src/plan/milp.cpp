#include "plan/milp.h"

#include <glpk.h>

#include <cmath>
#include <memory>

#include "core/error.h"

namespace oomless {

int Milp::binary(std::string name) {
  cols_.push_back({std::move(name), Kind::binary, 0, 1});
  return columns() - 1;
}

int Milp::integer(std::string name, int lo, int hi) {
  OOM_CHECK(lo <= hi, "[plan] an integer column with no value: ", name);
  cols_.push_back({std::move(name), Kind::integer, static_cast<double>(lo), static_cast<double>(hi)});
  return columns() - 1;
}

int Milp::continuous(std::string name, double lo, double hi) {
  OOM_CHECK(std::isfinite(lo), "[plan] a column needs a finite lower bound: ", name);
  cols_.push_back({std::move(name), Kind::continuous, lo, hi});
  return columns() - 1;
}

void Milp::row(Terms terms, double lo, double hi) {
  OOM_CHECK(std::isfinite(lo) || std::isfinite(hi), "[plan] a row with no bound");
  for (const auto& [j, a] : terms) OOM_CHECK(j >= 0 && j < columns() && std::isfinite(a), "[plan] a bad row term");
  rows_.push_back({std::move(terms), lo, hi});
}

Milp::Solution Milp::solve() const {
  glp_term_out(GLP_OFF);
  std::unique_ptr<glp_prob, void (*)(glp_prob*)> p(glp_create_prob(), glp_delete_prob);
  glp_set_obj_dir(p.get(), GLP_MIN);
  glp_add_cols(p.get(), columns());
  for (int j = 0; j < columns(); ++j) {
    const Col& c = cols_[static_cast<size_t>(j)];
    glp_set_col_name(p.get(), j + 1, c.name.c_str());
    glp_set_col_kind(p.get(), j + 1, c.kind == Kind::binary ? GLP_BV : c.kind == Kind::integer ? GLP_IV : GLP_CV);
    if (c.kind == Kind::integer) glp_set_col_bnds(p.get(), j + 1, c.lo == c.hi ? GLP_FX : GLP_DB, c.lo, c.hi);
    if (c.kind == Kind::continuous)
      glp_set_col_bnds(p.get(), j + 1, std::isfinite(c.hi) ? GLP_DB : GLP_LO, c.lo, std::isfinite(c.hi) ? c.hi : 0);
  }
  for (const auto& [j, a] : objective_) glp_set_obj_coef(p.get(), j + 1, glp_get_obj_coef(p.get(), j + 1) + a);
  if (rows() > 0) glp_add_rows(p.get(), rows());
  std::vector<int> ind;
  std::vector<double> val;
  for (int i = 0; i < rows(); ++i) {
    const Row& r = rows_[static_cast<size_t>(i)];
    const int type = !std::isfinite(r.lo) ? GLP_UP : !std::isfinite(r.hi) ? GLP_LO : r.lo == r.hi ? GLP_FX : GLP_DB;
    glp_set_row_bnds(p.get(), i + 1, type, std::isfinite(r.lo) ? r.lo : 0, std::isfinite(r.hi) ? r.hi : 0);
    // GLPK takes 1-based arrays; a column named twice in a row is summed first.
    ind.assign(1, 0);
    val.assign(1, 0.0);
    for (const auto& [j, a] : r.terms) {
      bool merged = false;
      for (size_t k = 1; k < ind.size(); ++k)
        if (ind[k] == j + 1) val[k] += a, merged = true;
      if (!merged) ind.push_back(j + 1), val.push_back(a);
    }
    glp_set_mat_row(p.get(), i + 1, static_cast<int>(ind.size()) - 1, ind.data(), val.data());
  }
  glp_iocp parm;
  glp_init_iocp(&parm);
  parm.presolve = GLP_ON;
  parm.msg_lev = GLP_MSG_OFF;
  parm.mip_gap = 0.0;
  Solution s;
  const int rc = glp_intopt(p.get(), &parm);
  const int st = glp_mip_status(p.get());
  s.status = rc != 0 && rc != GLP_ENOPFS && rc != GLP_ENODFS ? "solver error " + std::to_string(rc)
             : st == GLP_OPT ? "optimal"
             : st == GLP_FEAS ? "feasible"
             : st == GLP_NOFEAS ? "infeasible"
                                : "undefined";
  s.feasible = st == GLP_OPT || st == GLP_FEAS;
  if (!s.feasible) return s;
  s.objective = glp_mip_obj_val(p.get());
  for (int j = 0; j < columns(); ++j) s.x.push_back(glp_mip_col_val(p.get(), j + 1));
  return s;
}

}  // namespace oomless
