// Did-you-mean suggestions for misspelled keys and enum values.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace porter::config {

// Edit distance with insertions, deletions, substitutions and swaps of two adjacent characters,
// all costing 1 (optimal string alignment distance).
size_t edit_distance(std::string_view a, std::string_view b);

// The candidate closest to `word`, if it is close enough to be a plausible typo.
//
// Note [Did-you-mean]
// Two measures, the smaller wins: the plain edit distance, and the edit distance between the
// words with their '_'-separated parts sorted, so that swapped parts ("comm_overlap" for
// "overlap_comm") count as close. Comparison ignores case. A candidate is close enough when
// the distance is at most max(1, length/4) of the longer word; ties go to the earlier
// candidate.
std::optional<std::string> suggest(std::string_view word,
                                   const std::vector<std::string>& candidates);

}  // namespace porter::config
