// Fitting measured costs: y = a + b*x by weighted least squares, with a knee where data leave
// the cache. Internal to the planner (calibration fits every cost with it).
#pragma once

#include <cstddef>
#include <span>
#include <vector>

namespace terse {

// y = a + b*x, fitted by least squares with each point weighted by 1/y: a compromise between
// absolute residuals (large sizes, where the time goes, dominate) and relative ones (small sizes
// still predicted within a small factor).
struct LinearFit {
  double a = 0;  // seconds (or bytes) at x = 0
  double b = 0;  // per element (or per byte)
  // Beyond x = knee (when > 0) the slope is b2: the working set has left the cache. Only
  // fit_cost() sets it.
  double knee = 0;
  double b2 = 0;
  // Fit error on the points it was fitted to: root mean square and largest |predicted/y - 1|.
  double rms_relative_error = 0;
  double max_relative_error = 0;
  int points = 0;    // points fitted
  int outliers = 0;  // points left out: more than 25% and 3x the others' rms off the line
  // The measured points, for reports and plots.
  std::vector<double> xs, ys;

  double operator()(double x) const {
    return knee > 0 && x > knee ? a + b * knee + b2 * (x - knee) : a + b * x;
  }
};

// Throws InvalidArgument unless x and y have the same size >= 2 and y > 0. a and b are clamped
// at 0 (a negative intercept or slope is measurement noise, never a real cost). Up to two points
// far off the line through the others are left out (see LinearFit::outliers).
LinearFit fit_linear(std::span<const double> x, std::span<const double> y);

// A cost: fit_linear, or a line up to a knee at one of the measured x and another slope beyond
// it, when that halves the relative error (memory-bound work slows down once its data no longer
// fit in the cache). x must be sorted.
LinearFit fit_cost(std::span<const double> x, std::span<const double> y);

// Indices of the points of a cost series (x sorted, all > 0) whose cost per element is more than
// `factor` times its neighbour's: the point below it, or above it for the first. Leaving the
// cache raises the cost per element a few times at most; far more is a disturbance, which the
// calibration measures again.
std::vector<std::size_t> implausible_steps(std::span<const double> x, std::span<const double> y,
                                           double factor);

}  // namespace terse
