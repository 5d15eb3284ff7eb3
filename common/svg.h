// Plain SVG charts, written as text (kvctl plan --svg, capacity_replay
// --svg): escaping, the document frame, and a line panel with its axes,
// tick labels and legend. No dependencies beyond Abseil strings.
//
// Thread contract: pure functions (thread-safe).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace triax::svg {

// `s` with &, < and > escaped, for text content and attribute values.
std::string Escape(absl::string_view s);

// The i-th of 8 distinct line colors (cycled).
const char* Color(size_t i);

// The opening <svg> tag of a width x height document in sans-serif 12 px
// with a white background; end the document with "</svg>\n".
std::string Open(int width, int height);

// One line of a LinePanel: points in data coordinates.
struct Series {
  std::string label;
  std::vector<std::pair<double, double>> points;
};

// A line chart over [0, x_max] x [0, y_max]: its title at y = top + 14,
// the plot area from x = left, y = top + 30, width x height pixels, the x
// axis' tick labels at equal steps from 0 to x_max (x_ticks.size() - 1
// steps), y_max_label at the top of the y axis and "0" at its foot, a
// legend to the right. Every polyline has class `css_class`.
struct LinePanel {
  std::string title;  // plain text (escaped when written)
  int top = 0;
  int left = 200, width = 520, height = 220;
  double x_max = 1, y_max = 1;  // > 0
  std::vector<std::string> x_ticks;
  std::string y_max_label;
  std::string css_class;
};

// Appends the panel with one polyline per series (color Color(i), legend
// entry i) to *out; returns the height it takes (height + 60).
int AppendLinePanel(const LinePanel& panel, const std::vector<Series>& series,
                    std::string* out);

}  // namespace triax::svg
