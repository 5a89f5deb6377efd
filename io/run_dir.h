// A run directory: the periodic training checkpoints of one run, the pointer to the newest
// complete one, and the choice of which one to resume from.
//
// Note [Run directory]
// `porter train --save DIR` with porter.train.save_every N > 0 (or --save-every N) keeps:
//   DIR/step-<N>/        a checkpoint (io/state_file.h; with several ranks, DIR/step-<N>/rank<r>)
//   DIR/.step-<N>.tmp/   a checkpoint being written
//   DIR/latest           "step-<N>\n": the newest complete checkpoint
// Every rank writes its files into .step-<N>.tmp (write_state fsyncs each file and its rank
// directory). When all ranks are done, rank 0 publishes (publish_checkpoint):
//   1. a step-<N> left by an earlier attempt that died before latest named it is removed;
//   2. .step-<N>.tmp is renamed to step-<N>, and DIR is fsynced;
//   3. latest is written to .latest.tmp, fsynced, renamed over latest, and DIR fsynced;
//   4. step directories beyond the newest `keep` (never the one latest names) and leftover
//      .step-<M>.tmp directories with M < N are removed.
// A crash at any moment leaves latest naming a complete checkpoint (or, before the first
// publish, no latest at all), and every step-<N> a complete one.
// Resuming from DIR (resume_candidates) tries latest's checkpoint first, then the other
// step directories from the newest down; the caller checks each (check_checkpoint) and takes
// the first that passes, warning about the ones it skips.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace porter::io {

std::string step_dir_name(int64_t step);                         // "step-<N>"
std::optional<int64_t> parse_step_dir_name(const std::string& name);  // its inverse
std::filesystem::path pending_checkpoint_dir(const std::filesystem::path& run_dir, int64_t step);

// The step latest names, if there is a readable latest naming a step directory.
std::optional<int64_t> read_latest(const std::filesystem::path& run_dir);

// Note [Run directory], steps 1-4. Throws IoError naming the path on a failed rename or write.
// Returns the steps of the checkpoints it removed.
std::vector<int64_t> publish_checkpoint(const std::filesystem::path& run_dir, int64_t step,
                                        int64_t keep);

// True when `path` is one checkpoint: it has meta.json, or rank0/meta.json.
bool is_checkpoint(const std::filesystem::path& path);
// True when `path` holds latest or a step-<N> directory.
bool is_run_dir(const std::filesystem::path& path);

// The checkpoints to try when resuming from `path`, best first: `path` itself when it is one
// checkpoint; for a run directory, latest's checkpoint, then the other step directories from
// the newest down. Throws IoError when `path` is neither (naming what was looked for).
std::vector<std::filesystem::path> resume_candidates(const std::filesystem::path& path);

// Reads and verifies (sizes, CRC-32C) the files of checkpoint `dir` that rank `rank` of a
// world of `world_size` is responsible for checking: the checkpoint's rank directories r with
// r % world_size == rank (all of them for one rank). Returns "" when they pass, else why not.
std::string check_checkpoint(const std::filesystem::path& dir, int rank, int world_size);

}  // namespace porter::io
