// Edit distance and the did-you-mean choice over known keys; see Note [Did-you-mean].
#include "config/suggest.h"

#include <algorithm>
#include <cctype>

namespace porter::config {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// "Comm_Overlap" -> "comm_overlap" with its parts sorted: "comm_overlap".
std::string sorted_parts(std::string_view s) {
  std::vector<std::string> parts;
  std::string current;
  for (char c : lower(s)) {
    if (c == '_') {
      parts.push_back(current);
      current.clear();
    } else {
      current += c;
    }
  }
  parts.push_back(current);
  std::sort(parts.begin(), parts.end());
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) out += '_';
    out += parts[i];
  }
  return out;
}

}  // namespace

size_t edit_distance(std::string_view a, std::string_view b) {
  // Three rows of the dynamic program: d[i][j] = distance(a[0..i), b[0..j)); the row before
  // the previous one is needed for transpositions.
  std::vector<size_t> before(b.size() + 1), previous(b.size() + 1), current(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) previous[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    current[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t substitute = previous[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      current[j] = std::min({previous[j] + 1, current[j - 1] + 1, substitute});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        current[j] = std::min(current[j], before[j - 2] + 1);
      }
    }
    std::swap(before, previous);
    std::swap(previous, current);
  }
  return previous[b.size()];
}

std::optional<std::string> suggest(std::string_view word,
                                   const std::vector<std::string>& candidates) {
  // Keys longer than this are not plausible typos of a known key; it also bounds the work.
  constexpr size_t kMaxWordLength = 128;
  if (word.empty() || word.size() > kMaxWordLength) return std::nullopt;
  const std::string word_lower = lower(word);
  const std::string word_sorted = sorted_parts(word);
  std::optional<std::string> best;
  size_t best_distance = 0;
  for (const std::string& candidate : candidates) {
    if (candidate == word) continue;
    size_t d = std::min(edit_distance(word_lower, lower(candidate)),
                        edit_distance(word_sorted, sorted_parts(candidate)));
    size_t limit = std::max<size_t>(1, std::max(word.size(), candidate.size()) / 4);
    if (d > limit) continue;
    if (!best || d < best_distance) {
      best = candidate;
      best_distance = d;
    }
  }
  return best;
}

}  // namespace porter::config
