#include "backend/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace oomless {

void rope_inv_freq(double* inv_freq, int64_t D, const RopeConfig& cfg) {
  // yarn: the dimensions (of D) whose rotations over original_max_position are beta_fast and beta_slow;
  // below lo the original frequencies, above hi the interpolated ones (transformers' find_correction_range).
  double lo = 0, hi = 0;
  if (cfg.scaling == RopeScaling::yarn) {
    auto dim_of = [&](double rotations) {
      return static_cast<double>(D) * std::log(cfg.original_max_position / (rotations * 2.0 * std::numbers::pi)) /
             (2.0 * std::log(cfg.theta));
    };
    lo = dim_of(cfg.beta_fast);
    hi = dim_of(cfg.beta_slow);
    if (cfg.truncate) lo = std::floor(lo), hi = std::ceil(hi);
    lo = std::max(lo, 0.0);
    hi = std::min(hi, static_cast<double>(D - 1));
    if (lo == hi) hi += 0.001;  // as transformers: no division by zero
  }
  for (int64_t i = 0; i < D / 2; ++i) {
    double f = 1.0 / std::pow(cfg.theta, static_cast<double>(2 * i) / static_cast<double>(D));
    switch (cfg.scaling) {
      case RopeScaling::none:
        break;
      case RopeScaling::linear:
        f /= cfg.factor;
        break;
      case RopeScaling::llama3: {
        // transformers' _compute_llama3_parameters, in double.
        double low_wavelen = cfg.original_max_position / cfg.low_freq_factor;
        double high_wavelen = cfg.original_max_position / cfg.high_freq_factor;
        double wavelen = 2.0 * std::numbers::pi / f;
        double scaled = wavelen > low_wavelen ? f / cfg.factor : f;
        bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
        if (medium) {
          double smooth = (cfg.original_max_position / wavelen - cfg.low_freq_factor) /
                          (cfg.high_freq_factor - cfg.low_freq_factor);
          scaled = (1.0 - smooth) * scaled / cfg.factor + smooth * scaled;
        }
        f = scaled;
        break;
      }
      case RopeScaling::yarn: {
        // transformers' _compute_yarn_parameters: the share of the original frequency is 1 - ramp(i).
        const double ramp = std::clamp((static_cast<double>(i) - lo) / (hi - lo), 0.0, 1.0);
        const double keep = 1.0 - ramp;
        f = f / cfg.factor * (1.0 - keep) + f * keep;
        break;
      }
    }
    inv_freq[i] = f;
  }
}

}  // namespace oomless
