// The on-disk format of a training checkpoint: a directory with `meta.json` (what the state
// is: format version, step, model layout, dtypes, config) and one binary file per section
// (`<name>.bin`), each with its byte count and CRC-32C in the meta. Writes are atomic: every
// file goes to a temporary name in the directory, is flushed, and is renamed into place;
// meta.json is renamed last, so a directory without a complete meta.json is no checkpoint.
// docs/engine.md documents the layout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace porter::io {

inline constexpr int kStateFormatVersion = 1;

struct StateSection {
  std::string name;  // file stem: [a-z0-9_]+
  std::vector<std::byte> bytes;
};

// The durable-write steps the checkpoint files are made of (Note [Atomic state writes] in
// state_file.cc), for writers of other files in a checkpoint directory. Each throws IoError
// naming the path, except sync_dir, which is best effort (some filesystems refuse it).
// Writes `size` bytes to `path` (created or truncated) and fsyncs it.
void write_and_sync(const std::filesystem::path& path, const void* data, size_t size);
// fsync of a directory, which makes the renames in it durable.
void sync_dir(const std::filesystem::path& dir);
void rename_into_place(const std::filesystem::path& from, const std::filesystem::path& to);

// CRC-32C (Castagnoli) of `bytes`.
uint32_t crc32c(std::span<const std::byte> bytes, uint32_t crc = 0);

// Writes `meta` (to which the sections' sizes and checksums and the format version are
// added) and the sections into `dir`, creating it. Throws IoError naming the path.
void write_state(const std::filesystem::path& dir, nlohmann::json meta,
                 const std::vector<StateSection>& sections);

struct LoadedState {
  nlohmann::json meta;
  std::vector<StateSection> sections;  // in meta order
  const StateSection& section(const std::string& name) const;  // throws IoError if absent
};

// Reads and verifies a checkpoint. Throws IoError with the path and the reason: missing
// directory or meta.json, unparsable meta, unknown format version, a missing, truncated or
// oversized section file, or a checksum mismatch.
LoadedState read_state(const std::filesystem::path& dir);

}  // namespace porter::io
