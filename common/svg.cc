#include "common/svg.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace triax::svg {

std::string Escape(absl::string_view s) {
  std::string o;
  o.reserve(s.size());
  for (char c : s) {
    if (c == '&') {
      o += "&amp;";
    } else if (c == '<') {
      o += "&lt;";
    } else if (c == '>') {
      o += "&gt;";
    } else {
      o += c;
    }
  }
  return o;
}

const char* Color(size_t i) {
  static constexpr const char* kColors[] = {"#3182bd", "#e6550d", "#31a354",
                                            "#756bb1", "#636363", "#d6616b",
                                            "#8c6d31", "#17becf"};
  return kColors[i % 8];
}

std::string Open(int width, int height) {
  return absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
      width, height);
}

int AppendLinePanel(const LinePanel& p, const std::vector<Series>& series,
                    std::string* out) {
  const int y0 = p.top + 30, y1 = y0 + p.height;
  const int right = p.left + p.width;
  absl::StrAppend(
      out,
      absl::StrFormat(
          "<text x=\"10\" y=\"%d\" font-size=\"14\">%s</text>\n"
          "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"black\"/>\n"
          "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"black\"/>\n",
          p.top + 14, Escape(p.title), p.left, y1, right, y1, p.left, y0,
          p.left, y1));
  const size_t ticks = p.x_ticks.size();
  for (size_t t = 0; t < ticks; ++t) {
    const double x = p.left + (ticks > 1 ? p.width * static_cast<double>(t) /
                                               static_cast<double>(ticks - 1)
                                         : 0.0);
    absl::StrAppend(out, absl::StrFormat("<text x=\"%.1f\" y=\"%d\" "
                                         "text-anchor=\"middle\">%s</text>\n",
                                         x, y1 + 16, Escape(p.x_ticks[t])));
  }
  absl::StrAppend(
      out, absl::StrFormat(
               "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%s</text>\n"
               "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">0</text>\n",
               p.left - 6, y0 + 4, Escape(p.y_max_label), p.left - 6, y1));
  for (size_t i = 0; i < series.size(); ++i) {
    std::string points;
    for (const auto& [x, y] : series[i].points) {
      absl::StrAppend(
          &points, points.empty() ? "" : " ",
          absl::StrFormat("%.1f,%.1f", p.left + p.width * x / p.x_max,
                          y1 - p.height * y / p.y_max));
    }
    const int ly = y0 + 18 * static_cast<int>(i);
    absl::StrAppend(
        out, absl::StrFormat(
                 "<polyline class=\"%s\" points=\"%s\" fill=\"none\" "
                 "stroke=\"%s\" stroke-width=\"2\"/>\n"
                 "<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"12\" "
                 "fill=\"%s\"/><text x=\"%d\" y=\"%d\">%s</text>\n",
                 Escape(p.css_class), points, Color(i), right + 12, ly,
                 Color(i), right + 28, ly + 10, Escape(series[i].label)));
  }
  return p.height + 60;
}

}  // namespace triax::svg
