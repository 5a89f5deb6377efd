// Run directories (Note [Run directory] in io/run_dir.h).
#include "io/run_dir.h"

#include <algorithm>
#include <fstream>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "io/state_file.h"

namespace porter::io {

namespace fs = std::filesystem;

namespace {

constexpr const char* kLatest = "latest";

std::string quoted(const fs::path& p) { return "\"" + p.string() + "\""; }

// The step directories of `run_dir`, newest first.
std::vector<int64_t> step_dirs(const fs::path& run_dir) {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (fs::directory_iterator it(run_dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (!it->is_directory(ec)) continue;
    if (std::optional<int64_t> s = parse_step_dir_name(it->path().filename().string())) {
      steps.push_back(*s);
    }
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

void remove_all_or_throw(const fs::path& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
  if (ec) throw IoError("checkpoint: cannot remove " + quoted(p) + ": " + ec.message());
}

}  // namespace

std::string step_dir_name(int64_t step) { return "step-" + std::to_string(step); }

std::optional<int64_t> parse_step_dir_name(const std::string& name) {
  constexpr std::string_view prefix = "step-";
  if (name.size() <= prefix.size() || name.size() > prefix.size() + 18 ||
      name.compare(0, prefix.size(), prefix) != 0) {
    return std::nullopt;
  }
  int64_t v = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    v = v * 10 + (name[i] - '0');
  }
  // One spelling per step: "step-007" is not a step directory.
  if (step_dir_name(v) != name) return std::nullopt;
  return v;
}

fs::path pending_checkpoint_dir(const fs::path& run_dir, int64_t step) {
  return run_dir / ("." + step_dir_name(step) + ".tmp");
}

std::optional<int64_t> read_latest(const fs::path& run_dir) {
  std::ifstream in(run_dir / kLatest);
  std::string name;
  if (!in || !std::getline(in, name)) return std::nullopt;
  return parse_step_dir_name(name);
}

std::vector<int64_t> publish_checkpoint(const fs::path& run_dir, int64_t step, int64_t keep) {
  const fs::path pending = pending_checkpoint_dir(run_dir, step);
  const fs::path final_dir = run_dir / step_dir_name(step);
  std::error_code ec;
  if (fs::exists(final_dir, ec)) remove_all_or_throw(final_dir);  // 1.
  rename_into_place(pending, final_dir);                             // 2.
  sync_dir(run_dir);
  const std::string text = step_dir_name(step) + "\n";               // 3.
  const fs::path tmp = run_dir / ".latest.tmp";
  write_and_sync(tmp, text.data(), text.size());
  rename_into_place(tmp, run_dir / kLatest);
  sync_dir(run_dir);
  std::vector<int64_t> removed;                                      // 4.
  const std::vector<int64_t> steps = step_dirs(run_dir);
  for (size_t i = 0; i < steps.size(); ++i) {
    if (static_cast<int64_t>(i) < keep || steps[i] == step) continue;
    remove_all_or_throw(run_dir / step_dir_name(steps[i]));
    removed.push_back(steps[i]);
  }
  for (fs::directory_iterator it(run_dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() < 6 || name.front() != '.' || name.substr(name.size() - 4) != ".tmp") continue;
    const std::optional<int64_t> s = parse_step_dir_name(name.substr(1, name.size() - 5));
    if (s && *s < step) {
      std::error_code ignored;  // a leftover: best effort
      fs::remove_all(it->path(), ignored);
    }
  }
  return removed;
}

bool is_checkpoint(const fs::path& path) {
  std::error_code ec;
  return fs::exists(path / "meta.json", ec) || fs::exists(path / "rank0" / "meta.json", ec);
}

bool is_run_dir(const fs::path& path) {
  std::error_code ec;
  return fs::exists(path / kLatest, ec) || !step_dirs(path).empty();
}

std::vector<fs::path> resume_candidates(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    throw IoError("--resume " + quoted(path) + ": no such directory");
  }
  if (is_checkpoint(path)) return {path};
  if (!is_run_dir(path)) {
    throw IoError("--resume " + quoted(path) + ": not a checkpoint (no meta.json or rank0/"
                  "meta.json) and not a run directory (no latest or step-<N>); give a directory "
                  "written by porter train --save");
  }
  std::vector<fs::path> out;
  const std::optional<int64_t> latest = read_latest(path);
  if (latest && fs::is_directory(path / step_dir_name(*latest), ec)) {
    out.push_back(path / step_dir_name(*latest));
  }
  for (int64_t s : step_dirs(path)) {
    if (!latest || s != *latest) out.push_back(path / step_dir_name(s));
  }
  if (out.empty()) {
    throw IoError("--resume " + quoted(path) + ": the run directory holds no complete "
                  "checkpoint yet (latest names none, and there is no step-<N>)");
  }
  return out;
}

std::string check_checkpoint(const fs::path& dir, int rank, int world_size) {
  try {
    if (!is_checkpoint(dir)) {
      return "no meta.json or rank0/meta.json (not a complete checkpoint)";
    }
    std::error_code ec;
    if (fs::exists(dir / "meta.json", ec)) {  // written by one rank
      if (rank == 0) read_state(dir);
      return "";
    }
    // Several ranks: rank0's meta.json says how many (read_state checks it again below).
    nlohmann::json meta;
    {
      std::ifstream in(dir / "rank0" / "meta.json");
      meta = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    }
    if (!meta.is_object()) return quoted(dir / "rank0" / "meta.json") + " is not JSON";
    const int dp = meta.value("dp_size", 1);
    int tp = meta.value("tp_size", 0);
    if (tp == 0) {  // checkpoints from before tp_size was recorded
      const nlohmann::json c = meta.value("config", nlohmann::json::object());
      tp = c.contains("model") ? c["model"].value("tensor_parallel", 1) : 1;
    }
    const int saved = dp * tp;
    for (int r = rank; r < saved; r += world_size) read_state(dir / ("rank" + std::to_string(r)));
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

}  // namespace porter::io
