// Training-checkpoint files: CRC-32C, atomic section writes, and verified reads. The layout
// is documented in docs/training-state.md.
#include "io/state_file.h"

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"
#include "kernels/cpu/isa.h"

namespace porter::io {
namespace {

namespace fs = std::filesystem;

// Reflected CRC-32C table (Castagnoli polynomial 0x1EDC6F41, reversed 0x82F63B78).
constexpr std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kCrc32cTable = make_crc32c_table();

std::string quoted(const fs::path& p) { return "\"" + p.string() + "\""; }

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

// Writes `size` bytes to `path` (created or truncated) and fsyncs it.
void write_and_sync(const fs::path& path, const void* data, size_t size) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw IoError("training state: cannot create " + quoted(path) + ": " + errno_text());
  const char* p = static_cast<const char*>(data);
  size_t left = size;
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      std::string why = errno_text();
      ::close(fd);
      throw IoError("training state: cannot write " + quoted(path) + ": " + why);
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    std::string why = errno_text();
    throw IoError("training state: cannot flush " + quoted(path) + ": " + why);
  }
}

// fsync of a directory makes the renames in it durable. Best effort: some filesystems refuse.
void sync_dir(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

void rename_into_place(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  if (ec) {
    throw IoError("training state: cannot rename " + quoted(from) + " to " + quoted(to) + ": " +
                  ec.message());
  }
}

namespace {

bool valid_section_name(const std::string& name) {
  if (name.empty()) return false;
  for (char c : name) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  }
  return true;
}

}  // namespace

namespace {

uint32_t crc32c_table(const std::byte* p, size_t n, uint32_t c) {
  for (size_t i = 0; i < n; ++i) c = kCrc32cTable[(c ^ static_cast<uint8_t>(p[i])) & 0xffu] ^ (c >> 8);
  return c;
}

#if PORTER_CPU_X86
// SSE4.2's crc32 instruction computes CRC-32C (the Castagnoli polynomial) eight bytes at a
// time, about twenty times the table's speed; the same value (Note [Cpu ISA dispatch]).
PORTER_CPU_TARGET(PORTER_ISA_CRC32) uint32_t crc32c_sse42(const std::byte* p, size_t n, uint32_t c) {
  uint64_t c64 = c;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    c64 = _mm_crc32_u64(c64, v);
  }
  auto c32 = static_cast<uint32_t>(c64);
  for (; i < n; ++i) c32 = _mm_crc32_u8(c32, static_cast<uint8_t>(p[i]));
  return c32;
}
#endif

}  // namespace

uint32_t crc32c(std::span<const std::byte> bytes, uint32_t crc) {
#if PORTER_CPU_X86
  static const bool hw = kernels::cpu::cpu_runs(PORTER_ISA_CRC32);
  if (hw) return ~crc32c_sse42(bytes.data(), bytes.size(), ~crc);
#endif
  return ~crc32c_table(bytes.data(), bytes.size(), ~crc);
}

void write_state(const fs::path& dir, nlohmann::json meta,
                 const std::vector<StateSection>& sections) {
  if (!meta.is_object()) throw InvalidArgument("write_state: meta must be a JSON object");
  nlohmann::json listed = nlohmann::json::array();
  for (size_t i = 0; i < sections.size(); ++i) {
    const StateSection& s = sections[i];
    if (!valid_section_name(s.name)) {
      throw InvalidArgument("write_state: section name \"" + s.name + "\" must match [a-z0-9_]+");
    }
    for (size_t j = 0; j < i; ++j) {
      if (sections[j].name == s.name) {
        throw InvalidArgument("write_state: section \"" + s.name + "\" appears twice");
      }
    }
    listed.push_back({{"name", s.name},
                      {"file", s.name + ".bin"},
                      {"bytes", s.bytes.size()},
                      {"crc32c", crc32c(s.bytes)}});
  }
  meta["format_version"] = kStateFormatVersion;
  meta["sections"] = std::move(listed);

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw IoError("training state: cannot create directory " + quoted(dir) + ": " + ec.message());

  // Note [Atomic state writes]
  // 1. Every section goes to a temporary file in `dir`, fsynced.
  // 2. An existing meta.json is removed, so that from here until step 4 the directory is no
  //    checkpoint (never an old meta over new sections).
  // 3. The sections are renamed into place.
  // 4. meta.json is written the same way, last.
  for (const StateSection& s : sections) {
    write_and_sync(dir / ("." + s.name + ".bin.tmp"), s.bytes.data(), s.bytes.size());
  }
  const fs::path meta_path = dir / "meta.json";
  fs::remove(meta_path, ec);
  if (ec) throw IoError("training state: cannot replace " + quoted(meta_path) + ": " + ec.message());
  sync_dir(dir);
  for (const StateSection& s : sections) {
    rename_into_place(dir / ("." + s.name + ".bin.tmp"), dir / (s.name + ".bin"));
  }
  const std::string text = meta.dump(2) + "\n";
  const fs::path meta_tmp = dir / ".meta.json.tmp";
  write_and_sync(meta_tmp, text.data(), text.size());
  rename_into_place(meta_tmp, meta_path);
  sync_dir(dir);
}

const StateSection& LoadedState::section(const std::string& name) const {
  for (const StateSection& s : sections) {
    if (s.name == name) return s;
  }
  throw IoError("training state: no section \"" + name + "\" in this checkpoint");
}

LoadedState read_state(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    throw IoError("training state " + quoted(dir) + ": no such directory");
  }
  const fs::path meta_path = dir / "meta.json";
  std::ifstream meta_in(meta_path, std::ios::binary);
  if (!meta_in) {
    throw IoError("training state " + quoted(meta_path) + ": missing (not a training checkpoint, "
                  "or a save that did not complete)");
  }
  LoadedState state;
  try {
    state.meta = nlohmann::json::parse(meta_in);
  } catch (const nlohmann::json::exception& e) {
    throw IoError("training state " + quoted(meta_path) + ": unparsable JSON: " + e.what());
  }
  if (!state.meta.is_object()) {
    throw IoError("training state " + quoted(meta_path) + ": expected a JSON object");
  }
  const auto version = state.meta.find("format_version");
  if (version == state.meta.end() || !version->is_number_integer()) {
    throw IoError("training state " + quoted(meta_path) + ": no integer \"format_version\"");
  }
  if (version->get<int64_t>() != kStateFormatVersion) {
    throw IoError("training state " + quoted(meta_path) + ": unknown format version " +
                  version->dump() + " (this porter reads version " +
                  std::to_string(kStateFormatVersion) + ")");
  }
  const auto listed = state.meta.find("sections");
  if (listed == state.meta.end() || !listed->is_array()) {
    throw IoError("training state " + quoted(meta_path) + ": no \"sections\" array");
  }
  for (const nlohmann::json& entry : *listed) {
    if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() ||
        !entry.contains("bytes") || !entry["bytes"].is_number_unsigned() ||
        !entry.contains("crc32c") || !entry["crc32c"].is_number_unsigned()) {
      throw IoError("training state " + quoted(meta_path) + ": malformed section entry " +
                    entry.dump());
    }
    StateSection s;
    s.name = entry["name"].get<std::string>();
    if (!valid_section_name(s.name)) {
      throw IoError("training state " + quoted(meta_path) + ": bad section name \"" + s.name + "\"");
    }
    const uint64_t expected_bytes = entry["bytes"].get<uint64_t>();
    const uint32_t expected_crc = entry["crc32c"].get<uint32_t>();
    const fs::path path = dir / (s.name + ".bin");
    const uintmax_t size = fs::file_size(path, ec);
    if (ec) {
      throw IoError("training state " + quoted(path) + ": section \"" + s.name +
                    "\" is missing (" + ec.message() + ")");
    }
    if (size != expected_bytes) {
      throw IoError("training state " + quoted(path) + ": " +
                    (size < expected_bytes ? "truncated" : "oversized") + ": " +
                    std::to_string(size) + " bytes, meta.json says " +
                    std::to_string(expected_bytes));
    }
    s.bytes.resize(static_cast<size_t>(size));
    std::ifstream in(path, std::ios::binary);
    if (!in.read(reinterpret_cast<char*>(s.bytes.data()), static_cast<std::streamsize>(size))) {
      throw IoError("training state " + quoted(path) + ": cannot read " + std::to_string(size) +
                    " bytes");
    }
    const uint32_t crc = crc32c(s.bytes);
    if (crc != expected_crc) {
      throw IoError("training state " + quoted(path) + ": checksum mismatch: crc32c " + hex32(crc) +
                    ", meta.json says " + hex32(expected_crc) + " (the file is corrupt)");
    }
    state.sections.push_back(std::move(s));
  }
  return state;
}

}  // namespace porter::io
