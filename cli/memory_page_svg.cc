// The memory page's static chart: the SVG a browser shows with scripts off.
//
// Note [Static fallback]
// The page must say where the memory went even where no script runs (a mail client, a
// locked-down browser, a text dump of the DOM). So the chart's essentials are drawn here, on
// the server side, from the same data the script reads: the measured categories as stacked
// step areas, the predicted curve, the capacity line and the phase bands. The script, when it
// runs, replaces this SVG with its interactive chart. Colours are CSS classes (cat-params,
// ...) that the template defines once for both.
#include <algorithm>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "base/units.h"
#include "cli/memory_page.h"

namespace porter::cli {
namespace {

using nlohmann::ordered_json;

constexpr double kWidth = 1200, kHeight = 440;
constexpr double kLeft = 84, kRight = 24, kTop = 24, kBottom = 44;

struct Scale {
  double duration = 1.0, ymax = 1.0;
  double x(double t) const { return kLeft + t / duration * (kWidth - kLeft - kRight); }
  double y(double b) const { return kTop + (1.0 - b / ymax) * (kHeight - kTop - kBottom); }
};

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

// The predicted total after each op: (end time, bytes).
std::vector<std::pair<double, double>> predicted_points(const ordered_json& data) {
  std::vector<std::pair<double, double>> out;
  const ordered_json& p = data["predicted"];
  const double base = p["baseline_bytes"].get<double>();
  for (const ordered_json& op : p["ops"]) {
    out.emplace_back(op["end"].get<double>(), base + op["footprint_bytes"].get<double>());
  }
  return out;
}

// Returns the categories drawn (those with bytes), bottom to top.
std::vector<std::string> stacked_areas(const ordered_json& data, const Scale& sc,
                                       std::ostringstream& o) {
  std::vector<std::string> drawn;
  const ordered_json& m = data["measured"];
  const std::vector<double> times = m["times"].get<std::vector<double>>();
  if (times.empty()) return drawn;
  const double x_end = sc.x(data["duration"].get<double>());
  std::vector<double> below(times.size(), 0.0);
  for (const ordered_json& name : data["categories"]) {
    const std::vector<double> v = m["bytes"][name.get<std::string>()].get<std::vector<double>>();
    if (std::all_of(v.begin(), v.end(), [](double b) { return b == 0.0; })) continue;
    drawn.push_back(name.get<std::string>());
    std::vector<double> top(v.size());
    for (size_t i = 0; i < v.size(); ++i) top[i] = below[i] + v[i];
    // Step-after edges: the upper one left to right, the lower one back.
    o << "<path class=\"area cat-" << name.get<std::string>() << "\" d=\"M" << num(sc.x(times[0]))
      << "," << num(sc.y(top[0]));
    for (size_t i = 1; i < times.size(); ++i) {
      o << "H" << num(sc.x(times[i])) << "V" << num(sc.y(top[i]));
    }
    o << "H" << num(x_end) << "V" << num(sc.y(below.back()));
    for (size_t i = times.size() - 1; i >= 1; --i) {
      o << "H" << num(sc.x(times[i])) << "V" << num(sc.y(below[i - 1]));
    }
    o << "H" << num(sc.x(times[0])) << "Z\"><title>" << name.get<std::string>()
      << "</title></path>";
    below = std::move(top);
  }
  return drawn;
}

}  // namespace

std::string static_svg(const ordered_json& data) {
  Scale sc;
  sc.duration = std::max(1e-9, data["duration"].get<double>());
  const std::vector<std::pair<double, double>> pred = predicted_points(data);
  double ymax = data["predicted"]["peak_bytes"].get<double>();
  for (const auto& [t, b] : pred) ymax = std::max(ymax, b);
  if (!data["capacity_bytes"].is_null()) {
    ymax = std::max(ymax, data["capacity_bytes"].get<double>());
  }
  if (!data["measured"].is_null()) {
    ymax = std::max(ymax, data["measured"]["peak_bytes"].get<double>());
  }
  sc.ymax = std::max(1.0, ymax * 1.08);

  std::ostringstream o;
  o << "<svg id=\"chart-static\" class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" "
    << "viewBox=\"0 0 " << kWidth << " " << kHeight << "\" role=\"img\" aria-label=\"memory over "
    << "the step\">";
  for (const ordered_json& ph : data["phases"]) {
    const double x0 = sc.x(ph["start"].get<double>()), x1 = sc.x(ph["end"].get<double>());
    o << "<rect class=\"band phase-" << ph["phase"].get<std::string>() << "\" x=\"" << num(x0)
      << "\" y=\"" << kTop << "\" width=\"" << num(std::max(0.5, x1 - x0)) << "\" height=\""
      << kHeight - kTop - kBottom << "\"><title>" << ph["phase"].get<std::string>()
      << "</title></rect>";
  }
  std::vector<std::string> drawn;
  if (!data["measured"].is_null()) drawn = stacked_areas(data, sc, o);
  if (!pred.empty()) {
    o << "<path class=\"predicted\" d=\"M" << num(sc.x(pred[0].first)) << ","
      << num(sc.y(pred[0].second));
    for (size_t i = 1; i < pred.size(); ++i) {
      o << "H" << num(sc.x(pred[i].first)) << "V" << num(sc.y(pred[i].second));
    }
    o << "\"><title>predicted</title></path>";
  }
  if (!data["capacity_bytes"].is_null()) {
    const double cap = data["capacity_bytes"].get<double>();
    o << "<line class=\"capacity\" x1=\"" << kLeft << "\" x2=\"" << kWidth - kRight << "\" y1=\""
      << num(sc.y(cap)) << "\" y2=\"" << num(sc.y(cap)) << "\"/><text class=\"label\" x=\""
      << kWidth - kRight - 4 << "\" y=\"" << num(sc.y(cap) - 5) << "\" text-anchor=\"end\">"
      << "capacity " << format_bytes(static_cast<uint64_t>(cap)) << "</text>";
  }
  // Axes: five byte ticks, five time ticks.
  for (int i = 0; i <= 4; ++i) {
    const double b = sc.ymax * i / 4.0, t = sc.duration * i / 4.0;
    o << "<line class=\"grid\" x1=\"" << kLeft << "\" x2=\"" << kWidth - kRight << "\" y1=\""
      << num(sc.y(b)) << "\" y2=\"" << num(sc.y(b)) << "\"/><text class=\"tick\" x=\""
      << kLeft - 6 << "\" y=\"" << num(sc.y(b) + 4) << "\" text-anchor=\"end\">"
      << format_bytes(static_cast<uint64_t>(b)) << "</text><text class=\"tick\" x=\""
      << num(sc.x(t)) << "\" y=\"" << kHeight - kBottom + 18 << "\" text-anchor=\""
      << (i == 0 ? "start" : i == 4 ? "end" : "middle") << "\">" << num(t) << " "
      << data["time_unit"].get<std::string>() << "</text>";
  }
  // The legend, along the bottom: the drawn categories, then the two lines.
  double lx = kLeft;
  const double ly = kHeight - 8;
  for (const std::string& name : drawn) {
    o << "<rect class=\"cat-" << name << "\" x=\"" << num(lx) << "\" y=\"" << ly - 10
      << "\" width=\"12\" height=\"12\"/><text class=\"tick\" x=\"" << num(lx + 16) << "\" y=\""
      << ly << "\">" << name << "</text>";
    lx += 28 + 7.0 * static_cast<double>(name.size());
  }
  o << "<line class=\"predicted\" x1=\"" << num(lx) << "\" x2=\"" << num(lx + 18) << "\" y1=\""
    << ly - 4 << "\" y2=\"" << ly - 4 << "\"/><text class=\"tick\" x=\"" << num(lx + 22)
    << "\" y=\"" << ly << "\">predicted</text><line class=\"capacity\" x1=\"" << num(lx + 100)
    << "\" x2=\"" << num(lx + 118) << "\" y1=\"" << ly - 4 << "\" y2=\"" << ly - 4
    << "\"/><text class=\"tick\" x=\"" << num(lx + 122) << "\" y=\"" << ly
    << "\">capacity</text>";
  o << "</svg>";
  return o.str();
}

std::string html_escape(std::string_view text) {
  std::string out;
  for (char ch : text) {
    switch (ch) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += ch;
    }
  }
  return out;
}

}  // namespace porter::cli
