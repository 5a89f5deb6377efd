// The memory page's static chart: the SVG a browser shows with scripts off.
//
// Note [Static fallback]
// The page must say where the memory went even where no script runs (a mail client, a
// locked-down browser, a text dump of the DOM). So the chart's essentials are drawn here, on
// the server side, from the same data the script reads: the measured categories as stacked
// step areas, the predicted envelope, the capacity line (or its value above the chart), the
// phase bands, and on a failure page the failed request and its moment. The script, when it
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

// The chart's layout, from the data's "chart" (Note [Chart scale] in memory_page.h).
struct Scale {
  double width = 1200, height = 440, left = 84, right = 24, top = 24, bottom = 44;
  double duration = 1.0, ymax = 1.0;
  double x(double t) const { return left + t / duration * (width - left - right); }
  double y(double b) const { return top + (1.0 - b / ymax) * (height - top - bottom); }
};

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
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

// The predicted envelope (Note [Predicted envelope]): each op's peak over its span; a new
// subpath where consecutive ops do not touch.
std::string envelope_path(const ordered_json& data, const Scale& sc) {
  const ordered_json& p = data["predicted"];
  const double base = p["baseline_bytes"].get<double>();
  std::string d;
  double last_end = -1.0;
  for (const ordered_json& op : p["ops"]) {
    const double s = op["start"].get<double>(), e = op["end"].get<double>();
    const double y = sc.y(base + op["peak_bytes"].get<double>());
    if (d.empty() || s != last_end) {
      d += "M" + num(sc.x(s)) + "," + num(y);
    } else {
      d += "V" + num(y);
    }
    d += "H" + num(sc.x(e));
    last_end = e;
  }
  return d;
}

}  // namespace

std::string static_svg(const ordered_json& data) {
  const ordered_json& chart = data["chart"];
  Scale sc;
  sc.width = chart["width"].get<double>();
  sc.height = chart["height"].get<double>();
  sc.left = chart["left"].get<double>();
  sc.right = chart["right"].get<double>();
  sc.top = chart["top"].get<double>();
  sc.bottom = chart["bottom"].get<double>();
  sc.duration = std::max(1e-9, data["duration"].get<double>());
  sc.ymax = chart["y_max_bytes"].get<double>();
  const double right_x = sc.width - sc.right, plot_h = sc.height - sc.top - sc.bottom;

  std::ostringstream o;
  o << "<svg id=\"chart-static\" class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" "
    << "viewBox=\"0 0 " << sc.width << " " << sc.height << "\" role=\"img\" "
    << "aria-label=\"memory over the step\">";
  for (const ordered_json& ph : data["phases"]) {
    const double x0 = sc.x(ph["start"].get<double>()), x1 = sc.x(ph["end"].get<double>());
    o << "<rect class=\"band phase-" << ph["phase"].get<std::string>() << "\" x=\"" << num(x0)
      << "\" y=\"" << sc.top << "\" width=\"" << num(std::max(0.5, x1 - x0)) << "\" height=\""
      << plot_h << "\"><title>" << ph["phase"].get<std::string>() << "</title></rect>";
  }
  std::vector<std::string> drawn;
  if (!data["measured"].is_null()) drawn = stacked_areas(data, sc, o);
  if (const std::string d = envelope_path(data, sc); !d.empty()) {
    o << "<path class=\"predicted\" d=\"" << d << "\"><title>predicted: each op's peak</title>"
      << "</path>";
  }
  if (!data["capacity_bytes"].is_null()) {
    const double cap = data["capacity_bytes"].get<double>();
    const std::string label = "capacity " + format_bytes(static_cast<uint64_t>(cap));
    if (chart["capacity_on_chart"].get<bool>()) {
      o << "<line class=\"capacity\" x1=\"" << sc.left << "\" x2=\"" << right_x << "\" y1=\""
        << num(sc.y(cap)) << "\" y2=\"" << num(sc.y(cap)) << "\"/><text class=\"label\" x=\""
        << sc.left + 6 << "\" y=\"" << num(sc.y(cap) - 5) << "\">" << label << "</text>";
    } else {
      o << "<text class=\"label capacity-off\" x=\"" << right_x - 4 << "\" y=\""
        << num(sc.top - 8) << "\" text-anchor=\"end\">&#8593; " << label
        << " (above the chart)</text>";
    }
  }
  if (const ordered_json& f = data["failure"]; !f.is_null()) {
    const double fx = sc.x(f["time"].get<double>());
    const double live = f["live_bytes"].get<double>();
    const double req = f["requested_bytes"].get<double>();
    o << "<rect class=\"failed-request\" x=\"" << num(fx - 6) << "\" y=\"" << num(sc.y(live + req))
      << "\" width=\"12\" height=\"" << num(std::max(1.0, sc.y(live) - sc.y(live + req)))
      << "\"><title>failed request</title></rect><line class=\"failure\" x1=\"" << num(fx)
      << "\" x2=\"" << num(fx) << "\" y1=\"" << sc.top << "\" y2=\"" << sc.top + plot_h
      << "\"/><text class=\"label\" x=\"" << num(fx - 10) << "\" y=\"" << sc.top + 14
      << "\" text-anchor=\"end\">out of memory: "
      << format_bytes(static_cast<uint64_t>(req)) << " for "
      << html_escape(f["category"].is_null() ? std::string("?") : f["category"].get<std::string>())
      << "</text>";
  }
  // Axes: the byte ticks of the chart's layout, five time ticks.
  for (const ordered_json& tick : chart["y_ticks"]) {
    const double b = tick.get<double>();
    o << "<line class=\"grid\" x1=\"" << sc.left << "\" x2=\"" << right_x << "\" y1=\""
      << num(sc.y(b)) << "\" y2=\"" << num(sc.y(b)) << "\"/><text class=\"tick\" x=\""
      << sc.left - 6 << "\" y=\"" << num(sc.y(b) + 4) << "\" text-anchor=\"end\">"
      << format_bytes(static_cast<uint64_t>(b)) << "</text>";
  }
  for (int i = 0; i <= 4; ++i) {
    const double t = sc.duration * i / 4.0;
    o << "<text class=\"tick\" x=\"" << num(sc.x(t)) << "\" y=\"" << sc.height - sc.bottom + 18
      << "\" text-anchor=\"" << (i == 0 ? "start" : i == 4 ? "end" : "middle") << "\">" << num(t)
      << " " << data["time_unit"].get<std::string>() << "</text>";
  }
  // The legend, along the bottom: the drawn categories, then the two lines.
  double lx = sc.left;
  const double ly = sc.height - 8;
  for (const std::string& name : drawn) {
    o << "<rect class=\"cat-" << name << "\" x=\"" << num(lx) << "\" y=\"" << ly - 10
      << "\" width=\"12\" height=\"12\"/><text class=\"tick\" x=\"" << num(lx + 16) << "\" y=\""
      << ly << "\">" << name << "</text>";
    lx += 28 + 7.0 * static_cast<double>(name.size());
  }
  o << "<line class=\"predicted\" x1=\"" << num(lx) << "\" x2=\"" << num(lx + 18) << "\" y1=\""
    << ly - 4 << "\" y2=\"" << ly - 4 << "\"/><text class=\"tick\" x=\"" << num(lx + 22)
    << "\" y=\"" << ly << "\">predicted (each op's peak)</text><line class=\"capacity\" x1=\""
    << num(lx + 190) << "\" x2=\"" << num(lx + 208) << "\" y1=\"" << ly - 4 << "\" y2=\"" << ly - 4
    << "\"/><text class=\"tick\" x=\"" << num(lx + 212) << "\" y=\"" << ly
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
