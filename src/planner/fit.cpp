// Fitting measured costs (fit.h): weighted least squares with outliers left out, and a knee
// where the data leave the cache.
#include "planner/fit.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "terse/error.h"

namespace terse {

namespace {

// Weighted least squares, w = 1/y (see the header), over the points in use; then the errors.
void solve(std::span<const double> x, std::span<const double> y, const std::vector<bool>& use,
           LinearFit& f) {
  double sw = 0, swx = 0, swxx = 0, swy = 0, swxy = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!use[i]) continue;
    const double w = 1.0 / y[i];
    sw += w;
    swx += w * x[i];
    swxx += w * x[i] * x[i];
    swy += w * y[i];
    swxy += w * x[i] * y[i];
  }
  const double det = sw * swxx - swx * swx;
  f.a = f.b = 0;
  if (det > 0) {
    f.a = (swxx * swy - swx * swxy) / det;
    f.b = (sw * swxy - swx * swy) / det;
  }
  if (det <= 0 || f.b < 0) {  // all x equal, or a decreasing cost: a constant
    f.b = 0;
    f.a = swy / sw;
  } else if (f.a < 0) {  // refit through the origin
    f.a = 0;
    f.b = swxy / swxx;
  }
  double sq = 0;
  f.max_relative_error = 0;
  f.points = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!use[i]) continue;
    const double rel = f(x[i]) / y[i] - 1;
    sq += rel * rel;
    f.max_relative_error = std::max(f.max_relative_error, std::abs(rel));
    ++f.points;
  }
  f.rms_relative_error = std::sqrt(sq / f.points);
}

}  // namespace

LinearFit fit_linear(std::span<const double> x, std::span<const double> y) {
  if (x.size() != y.size() || x.size() < 2) {
    throw InvalidArgument(
        fmt::format("fit_linear: need two or more points ({} x, {} y)", x.size(), y.size()));
  }
  for (double v : y) {
    if (!(v > 0)) throw InvalidArgument("fit_linear: every y must be positive");
  }
  LinearFit f;
  std::vector<bool> use(x.size(), true);
  solve(x, y, use, f);
  // A point far off the line the others agree on is a disturbance (another process took the
  // core), not a cost: drop up to two such points, keeping at least four.
  for (int round = 0; round < 2 && f.points > 4; ++round) {
    std::size_t worst = 0;
    double worst_rel = -1, others = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      if (!use[i]) continue;
      const double rel = std::abs(f(x[i]) / y[i] - 1);
      others += rel * rel;
      if (rel > worst_rel) {
        worst_rel = rel;
        worst = i;
      }
    }
    others = std::sqrt((others - worst_rel * worst_rel) / (f.points - 1));
    if (worst_rel < 0.25 || worst_rel < 3 * others) break;
    use[worst] = false;
    ++f.outliers;
    solve(x, y, use, f);
  }
  f.xs.assign(x.begin(), x.end());
  f.ys.assign(y.begin(), y.end());
  return f;
}

std::vector<std::size_t> implausible_steps(std::span<const double> x, std::span<const double> y,
                                           double factor) {
  if (x.size() != y.size()) throw InvalidArgument("implausible_steps: x and y differ in size");
  std::vector<std::size_t> out;
  auto rate = [&](std::size_t i) { return y[i] / x[i]; };
  for (std::size_t i = 0; i < x.size() && x.size() > 1; ++i) {
    const std::size_t neighbour = i == 0 ? 1 : i - 1;
    if (rate(i) > factor * rate(neighbour)) out.push_back(i);
  }
  return out;
}

LinearFit fit_cost(std::span<const double> x, std::span<const double> y) {
  LinearFit best = fit_linear(x, y);
  LinearFit knee_best;
  double knee_rms = best.rms_relative_error;
  // Knees leave at least three points below (a line with an outlier test) and one above.
  for (std::size_t k = 2; k + 1 < x.size(); ++k) {
    LinearFit f = fit_linear(x.first(k + 1), y.first(k + 1));
    const double at = f(x[k]);
    double num = 0, den = 0;
    for (std::size_t i = k + 1; i < x.size(); ++i) {
      const double w = 1.0 / y[i], d = x[i] - x[k];
      num += w * d * (y[i] - at);
      den += w * d * d;
    }
    f.knee = x[k];
    f.b2 = std::max(f.b, num / den);  // past the cache, work never gets cheaper per element
    double sq = 0, worst = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double rel = std::abs(f(x[i]) / y[i] - 1);
      sq += rel * rel;
      worst = std::max(worst, rel);
    }
    f.rms_relative_error = std::sqrt(sq / x.size());
    f.max_relative_error = worst;
    f.points = static_cast<int>(x.size());
    f.outliers = 0;
    if (f.rms_relative_error < knee_rms) {
      knee_rms = f.rms_relative_error;
      knee_best = f;
    }
  }
  if (knee_best.knee > 0 && knee_rms < best.rms_relative_error / 2) {
    knee_best.xs.assign(x.begin(), x.end());
    knee_best.ys.assign(y.begin(), y.end());
    return knee_best;
  }
  return best;
}

}  // namespace terse
