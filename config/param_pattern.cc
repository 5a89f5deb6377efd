// Parameter patterns of porter.optimizer (no_decay, param_groups): fnmatch globs over layout
// names, and the rank selector "ndim<N".
#include <fnmatch.h>

#include <charconv>
#include <string>

#include "config/config.h"
#include "config/json_reader.h"

namespace porter::config {
namespace {

constexpr const char* kPatternRule =
    "a pattern is an fnmatch glob over a parameter's layout name (e.g. \"*.bias\", "
    "\"h.*.ln1.*\", \"wpe\") or a rank selector ndim<N, ndim<=N, ndim==N, ndim>=N, ndim>N "
    "(e.g. \"ndim<2\": biases and norm gains)";

}  // namespace

bool RankSelector::matches(int64_t rank) const {
  switch (op) {
    case Op::kLt: return rank < ndim;
    case Op::kLe: return rank <= ndim;
    case Op::kEq: return rank == ndim;
    case Op::kGe: return rank >= ndim;
    case Op::kGt: return rank > ndim;
  }
  return false;
}

// A selector starts with "ndim" and an operator; no layout name holds '<', '>' or '='.
std::optional<RankSelector> rank_selector(const std::string& pattern, const std::string& path) {
  const std::string_view s = pattern;
  if (s.substr(0, 4) != "ndim" || s.size() < 5 || s.find_first_of("<>=", 4) != 4) {
    return std::nullopt;
  }
  RankSelector r;
  std::string_view rest = s.substr(4);
  static constexpr std::pair<std::string_view, RankSelector::Op> kOps[] = {
      {"<=", RankSelector::Op::kLe}, {">=", RankSelector::Op::kGe},
      {"==", RankSelector::Op::kEq}, {"<", RankSelector::Op::kLt},
      {">", RankSelector::Op::kGt}};
  bool found = false;
  for (const auto& [spelling, op] : kOps) {
    if (rest.substr(0, spelling.size()) == spelling) {
      r.op = op;
      rest.remove_prefix(spelling.size());
      found = true;
      break;
    }
  }
  const char* end = rest.data() + rest.size();
  auto [ptr, ec] = std::from_chars(rest.data(), end, r.ndim);
  if (!found || rest.empty() || ec != std::errc() || ptr != end || r.ndim < 0) {
    detail::fail(path, "\"" + pattern + "\" is not a rank selector; " + kPatternRule);
  }
  return r;
}

void check_param_pattern(const std::string& pattern, const std::string& path) {
  if (pattern.empty()) detail::fail(path, "\"\": an empty pattern matches no parameter; " +
                                          std::string(kPatternRule));
  if (rank_selector(pattern, path)) return;
  // Brackets: "[...]" with "]" allowed first (after an optional "!" or "^"), as fnmatch reads
  // them; an unclosed one would be matched literally, which is never what was meant.
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '\\') {
      ++i;
      continue;
    }
    if (pattern[i] != '[') continue;
    size_t j = i + 1;
    if (j < pattern.size() && (pattern[j] == '!' || pattern[j] == '^')) ++j;
    if (j < pattern.size() && pattern[j] == ']') ++j;
    while (j < pattern.size() && pattern[j] != ']') ++j;
    if (j >= pattern.size()) {
      detail::fail(path, "\"" + pattern + "\": the '[' at offset " + std::to_string(i) +
                             " is not closed; close it with ']' or write \\[ for the "
                             "character; " + kPatternRule);
    }
    i = j;
  }
}

bool param_pattern_matches(const std::string& pattern, const std::string& name, int64_t rank) {
  if (std::optional<RankSelector> r = rank_selector(pattern, pattern)) return r->matches(rank);
  return fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
}

}  // namespace porter::config
