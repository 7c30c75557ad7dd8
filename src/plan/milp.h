// A mixed-integer linear program, solved by GLPK's branch and cut (glp_intopt, with its presolver): binary,
// bounded integer and continuous columns, rows lo <= sum a_j x_j <= hi, minimise a linear objective.
#pragma once
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace oomless {

class Milp {
 public:
  static constexpr double kInf = std::numeric_limits<double>::infinity();
  using Terms = std::vector<std::pair<int, double>>;  // (column, coefficient)

  int binary(std::string name);
  int integer(std::string name, int lo, int hi);  // lo <= x <= hi, whole
  int continuous(std::string name, double lo, double hi = kInf);
  // lo <= terms <= hi (either may be infinite, not both).
  void row(Terms terms, double lo, double hi);
  void minimize(Terms objective) { objective_ = std::move(objective); }
  int columns() const { return static_cast<int>(cols_.size()); }
  int rows() const { return static_cast<int>(rows_.size()); }

  struct Solution {
    bool feasible = false;
    double objective = 0;
    std::vector<double> x;  // per column
    std::string status;     // GLPK's word for how it ended
  };
  Solution solve() const;

 private:
  enum class Kind { binary, integer, continuous };
  struct Col {
    std::string name;
    Kind kind;
    double lo, hi;
  };
  struct Row {
    Terms terms;
    double lo, hi;
  };
  std::vector<Col> cols_;
  std::vector<Row> rows_;
  Terms objective_;
};

}  // namespace oomless
