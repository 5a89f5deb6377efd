// A structural check of a Chrome trace as porter writes it (Note [Trace of several ranks] in
// engine/trace.h), shared by the cli tests that read --trace files.
#pragma once

#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace porter::cli::testing {

// The ways `doc` breaks the schema, empty when it holds: a "traceEvents" array whose every
// event has a string name, ph in {X, C, M}, integer pid and tid and a numeric ts; X events a
// numeric dur >= 0; C events numeric args; M events object args; and a process_name
// metadata event for every pid.
inline std::vector<std::string> trace_schema_errors(const nlohmann::json& doc) {
  std::vector<std::string> errors;
  if (!doc.is_object() || !doc.contains("traceEvents") || !doc["traceEvents"].is_array()) {
    return {"no traceEvents array"};
  }
  std::set<int64_t> pids, named;
  size_t i = 0;
  for (const nlohmann::json& e : doc["traceEvents"]) {
    const std::string at = "event " + std::to_string(i++) + " " + e.dump().substr(0, 120);
    if (!e.is_object()) {
      errors.push_back(at + ": not an object");
      continue;
    }
    if (!e.contains("name") || !e["name"].is_string()) errors.push_back(at + ": name");
    if (!e.contains("pid") || !e["pid"].is_number_integer()) errors.push_back(at + ": pid");
    if (!e.contains("tid") || !e["tid"].is_number_integer()) errors.push_back(at + ": tid");
    if (!e.contains("ts") || !e["ts"].is_number()) errors.push_back(at + ": ts");
    const std::string ph =
        e.contains("ph") && e["ph"].is_string() ? e["ph"].get<std::string>() : "";
    if (ph != "X" && ph != "C" && ph != "M") errors.push_back(at + ": ph");
    if (ph == "X" && (!e.contains("dur") || !e["dur"].is_number() || e["dur"].get<double>() < 0)) {
      errors.push_back(at + ": dur");
    }
    if (ph == "C" && (!e.contains("args") || !e["args"].is_object())) {
      errors.push_back(at + ": counter args");
    } else if (ph == "C") {
      for (const auto& [k, v] : e["args"].items()) {
        if (!v.is_number()) errors.push_back(at + ": counter value " + k);
      }
    }
    if (ph == "M" && (!e.contains("args") || !e["args"].is_object())) {
      errors.push_back(at + ": metadata args");
    }
    if (!e.contains("pid") || !e["pid"].is_number_integer()) continue;
    pids.insert(e["pid"].get<int64_t>());
    if (ph == "M" && e.value("name", "") == "process_name") named.insert(e["pid"].get<int64_t>());
  }
  for (int64_t pid : pids) {
    if (!named.count(pid)) errors.push_back("pid " + std::to_string(pid) + " has no process_name");
  }
  return errors;
}

}  // namespace porter::cli::testing
