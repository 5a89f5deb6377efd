// Reading a training checkpoint's sections at any layout, and consolidated weights from its
// per-rank files (Notes [Consolidating a checkpoint] and [Tensor-parallel parts in bytes] in
// io/consolidate.h).
#include "io/consolidate.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <tuple>

#include "base/check.h"
#include "base/error.h"
#include "config/parse.h"
#include "io/state_file.h"
#include "models/factory.h"

namespace porter::io {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string quoted(const fs::path& p) { return "\"" + p.string() + "\""; }

std::string prefix(std::string_view who) { return std::string(who) + ": "; }

std::string shape_string(const json& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + shape[i].dump();
  return s + ")";
}

fs::path rank_path(const fs::path& dir, int rank, int world) {
  return world > 1 ? dir / ("rank" + std::to_string(rank)) : dir;
}

// meta.json alone (no sections).
json peek_meta(const fs::path& dir, std::string_view who) {
  const fs::path path = dir / "meta.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(prefix(who) + "cannot read " + quoted(path));
  json meta;
  try {
    meta = json::parse(in);
  } catch (const json::exception& e) {
    throw IoError(prefix(who) + quoted(path) + ": unparsable JSON: " + e.what());
  }
  return meta;
}

// Throws IoError unless `meta` is an engine checkpoint's (Note [Engine state] in state.cc).
void check_kind(const json& meta, const fs::path& dir, std::string_view who) {
  const fs::path path = dir / "meta.json";
  if (!meta.is_object() || !meta.contains("kind") || meta["kind"] != "porter.engine") {
    throw IoError(prefix(who) + quoted(path) + " is not a porter training checkpoint: kind is " +
                  (meta.is_object() && meta.contains("kind") ? meta["kind"].dump() : "absent") +
                  ", expected \"porter.engine\"");
  }
  for (const char* key : {"step", "compute_dtype", "layout"}) {
    if (!meta.contains(key)) {
      throw IoError(prefix(who) + quoted(path) + " is not a porter training checkpoint: it has no \"" +
                    key + "\"");
    }
  }
  if (!meta["step"].is_number_integer()) {
    throw IoError(prefix(who) + quoted(path) + ": step " + meta["step"].dump() + " is not an integer");
  }
}

int int_field(const json& meta, const char* key, int fallback, const fs::path& dir,
              std::string_view who) {
  if (!meta.contains(key)) return fallback;
  const json& v = meta[key];
  if (!v.is_number_integer()) {
    throw IoError(prefix(who) + quoted(dir / "meta.json") + ": \"" + key + "\" is " + v.dump() +
                  ", not an integer");
  }
  return v.get<int>();
}

// config.model.tensor_parallel, 1 when absent.
json tensor_parallel_of(const json& meta) {
  const json* p = &meta;
  for (const char* key : {"config", "model", "tensor_parallel"}) {
    if (!p->is_object() || !p->contains(key)) return 1;
    p = &(*p)[key];
  }
  return *p;
}

tensor::DType parse_compute_dtype(const json& v, const fs::path& dir, std::string_view who) {
  for (tensor::DType t : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
    if (v == std::string(tensor::dtype_name(t))) return t;
  }
  throw IoError(prefix(who) + quoted(dir / "meta.json") + ": compute_dtype " + v.dump() +
                " is not one of \"f32\", \"bf16\", \"f16\"");
}

// The first parameter at which two layouts differ, in words, or "" when they are equal.
std::string layout_difference(const json& a, const fs::path& a_dir, const json& b,
                              const fs::path& b_dir) {
  if (a == b) return "";
  const json& ap = a.value("params", json::array());
  const json& bp = b.value("params", json::array());
  auto entry = [](const json& e) {
    return "'" + e.value("name", std::string("?")) + "' " + shape_string(e.value("shape", json::array())) +
           " at offset " + e.value("offset", json(0)).dump();
  };
  for (size_t i = 0; i < std::min(ap.size(), bp.size()); ++i) {
    if (ap[i] != bp[i]) {
      return "the model layout at parameter " + std::to_string(i) + ": " + quoted(a_dir) + " has " +
             entry(ap[i]) + ", " + quoted(b_dir) + " has " + entry(bp[i]);
    }
  }
  return "the model layout: " + quoted(a_dir) + " has " + std::to_string(ap.size()) +
         " parameters (" + a.value("total_elems", json(0)).dump() + " elements), " + quoted(b_dir) +
         " has " + std::to_string(bp.size()) + " (" + b.value("total_elems", json(0)).dump() + ")";
}

// Throws IoError naming the first field on which rank `b` disagrees with rank `a`. The layout
// is compared only between the dp ranks of one tp rank (tp ranks hold different parts).
void check_agree(const json& a, const fs::path& a_dir, const json& b, const fs::path& b_dir,
                 bool compare_layout, std::string_view who) {
  const std::string rule = " (every rank saves the same training state: these directories do "
                           "not come from one save)";
  for (const char* key : {"step", "dp_size", "zero_stage", "compute_dtype"}) {
    const json va = a.contains(key) ? a[key] : json("absent");
    const json vb = b.contains(key) ? b[key] : json("absent");
    if (va != vb) {
      throw IoError(prefix(who) + "checkpoint ranks disagree on " + std::string(key) + ": " +
                    quoted(a_dir) + " has " + va.dump() + ", " + quoted(b_dir) + " has " +
                    vb.dump() + rule);
    }
  }
  const json ta = tensor_parallel_of(a), tb = tensor_parallel_of(b);
  if (ta != tb) {
    throw IoError(prefix(who) + "checkpoint ranks disagree on config.model.tensor_parallel: " +
                  quoted(a_dir) + " has " + ta.dump() + ", " + quoted(b_dir) + " has " + tb.dump() +
                  rule);
  }
  if (compare_layout) {
    const std::string diff = layout_difference(a["layout"], a_dir, b["layout"], b_dir);
    if (!diff.empty()) throw IoError(prefix(who) + "checkpoint ranks disagree on " + diff + rule);
  }
}

json layout_json(const nn::ParamLayout& layout) {
  json params = json::array();
  for (const nn::ParamEntry& e : layout.entries()) {
    params.push_back({{"name", e.name}, {"shape", e.shape.to_vector()}, {"offset", e.offset_elems}});
  }
  return {{"total_elems", layout.total_elems()}, {"params", params}};
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// A window [base, base + n) of a padded flat buffer being assembled from the ranks' ranges
// (elements of `elem_bytes`).
class FlatAssembly {
 public:
  FlatAssembly(int64_t base, int64_t elems, size_t elem_bytes, std::vector<FlatTensorSpec> specs,
               std::string section, std::string who)
      : bytes_(static_cast<size_t>(elems) * elem_bytes), base_(base), end_(base + elems),
        elem_bytes_(elem_bytes), specs_(std::move(specs)), section_(std::move(section)),
        who_(std::move(who)) {}

  int64_t begin() const { return base_; }
  int64_t end() const { return end_; }

  // The first element at or after `at` in the window that no rank placed yet (end() if none).
  int64_t first_uncovered(int64_t at) const {
    for (const Piece& p : pieces_) {
      if (p.begin <= at && p.end > at) at = p.end;
    }
    return std::min(at, end_);
  }

  // Lays `src` (elements [begin, end), within the window) in; where another rank already
  // placed elements, they must be equal byte for byte.
  void place(int64_t begin, int64_t end, std::span<const std::byte> src, const fs::path& from) {
    std::vector<Piece> added;
    int64_t at = begin;
    for (const Piece& p : pieces_) {
      if (p.end <= at) continue;
      if (p.begin >= end) break;
      if (p.begin > at) {
        copy(at, p.begin, begin, src);
        added.push_back({at, p.begin, from});
      }
      const int64_t lo = std::max(at, p.begin), hi = std::min(end, p.end);
      compare(lo, hi, begin, src, from, p.from);
      at = hi;
    }
    if (at < end) {
      copy(at, end, begin, src);
      added.push_back({at, end, from});
    }
    pieces_.insert(pieces_.end(), added.begin(), added.end());
    std::sort(pieces_.begin(), pieces_.end(),
              [](const Piece& x, const Piece& y) { return x.begin < y.begin; });
  }

  // Throws IoError naming the first parameter with elements in the window no rank placed.
  void check_covered(const fs::path& dir) const {
    for (const FlatTensorSpec& s : specs_) {
      const int64_t lo = std::max(base_, s.offset_elems);
      const int64_t hi = std::min(end_, s.offset_elems + numel(s.shape));
      if (lo >= hi) continue;
      const int64_t at = first_uncovered(lo);
      if (at < hi) {
        throw IoError(who_ + quoted(dir) + ": elements [" + std::to_string(at) + ", " +
                      std::to_string(hi) + ") of the flat buffer (parameter '" + s.name +
                      "') are in no rank's " + section_ + " section");
      }
    }
  }

  std::vector<std::byte> take() { return std::move(bytes_); }

 private:
  struct Piece {
    int64_t begin, end;
    fs::path from;
  };

  std::byte* at(int64_t elem) { return bytes_.data() + static_cast<size_t>(elem - base_) * elem_bytes_; }
  const std::byte* at(int64_t elem) const {
    return bytes_.data() + static_cast<size_t>(elem - base_) * elem_bytes_;
  }

  void copy(int64_t lo, int64_t hi, int64_t src_begin, std::span<const std::byte> src) {
    std::memcpy(at(lo), src.data() + static_cast<size_t>(lo - src_begin) * elem_bytes_,
                static_cast<size_t>(hi - lo) * elem_bytes_);
  }

  void compare(int64_t lo, int64_t hi, int64_t src_begin, std::span<const std::byte> src,
               const fs::path& from, const fs::path& first) const {
    auto theirs = [&](int64_t i) { return src.data() + static_cast<size_t>(i - src_begin) * elem_bytes_; };
    if (std::memcmp(at(lo), theirs(lo), static_cast<size_t>(hi - lo) * elem_bytes_) == 0) return;
    int64_t i = lo;
    while (std::memcmp(at(i), theirs(i), elem_bytes_) == 0) ++i;
    throw IoError(who_ + quoted(from) + ": " + section_ + " element " + std::to_string(i) + " (" +
                  where(i) + ") differs from " + quoted(first) + "'s: the ranks' copies of "
                  "the same elements must be equal (the directories do not come from one save)");
  }

  std::string where(int64_t elem) const {
    for (const FlatTensorSpec& s : specs_) {
      if (elem >= s.offset_elems && elem < s.offset_elems + numel(s.shape)) {
        return "parameter '" + s.name + "' element " + std::to_string(elem - s.offset_elems);
      }
    }
    return "alignment padding";
  }

  std::vector<std::byte> bytes_;
  int64_t base_, end_;
  size_t elem_bytes_;
  std::vector<FlatTensorSpec> specs_;
  std::string section_;
  std::string who_;  // the messages' prefix
  std::vector<Piece> pieces_;  // disjoint, sorted by begin
};

// The section's entry in meta.json's table ({"name", "file", "bytes", "crc32c"}).
const json& section_entry(const json& meta, std::string_view section, const fs::path& dir,
                          std::string_view who) {
  if (meta.contains("sections") && meta["sections"].is_array()) {
    for (const json& e : meta["sections"]) {
      if (e.is_object() && e.value("name", std::string()) == section) {
        if (!e.contains("bytes") || !e["bytes"].is_number_unsigned() || !e.contains("crc32c") ||
            !e["crc32c"].is_number_unsigned()) {
          throw IoError(prefix(who) + "training state " + quoted(dir / "meta.json") +
                        ": malformed section entry " + e.dump());
        }
        return e;
      }
    }
  }
  throw IoError(prefix(who) + "training state " + quoted(dir) + ": no section \"" +
                std::string(section) + "\" in this checkpoint");
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

// Reads `path` whole in blocks, checking its size and CRC-32C against meta.json's `entry`,
// and returns the bytes [lo, hi) of it.
std::vector<std::byte> read_checked(const fs::path& path, const json& entry, uint64_t lo,
                                    uint64_t hi, std::string_view who) {
  const uint64_t expected_bytes = entry["bytes"].get<uint64_t>();
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  if (ec) {
    throw IoError(prefix(who) + "training state " + quoted(path) + ": section \"" +
                  entry.value("name", std::string()) + "\" is missing (" + ec.message() + ")");
  }
  if (size != expected_bytes) {
    throw IoError(prefix(who) + "training state " + quoted(path) + ": " +
                  (size < expected_bytes ? "truncated" : "oversized") + ": " +
                  std::to_string(size) + " bytes, meta.json says " + std::to_string(expected_bytes));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(prefix(who) + "training state " + quoted(path) + ": cannot open it");
  std::vector<std::byte> out(static_cast<size_t>(hi - lo));
  std::vector<std::byte> block(std::min<uint64_t>(size, uint64_t{4} << 20));
  uint32_t crc = 0;
  for (uint64_t at = 0; at < size;) {
    const uint64_t n = std::min<uint64_t>(block.size(), size - at);
    if (!in.read(reinterpret_cast<char*>(block.data()), static_cast<std::streamsize>(n))) {
      throw IoError(prefix(who) + "training state " + quoted(path) + ": cannot read " +
                    std::to_string(size) + " bytes");
    }
    crc = crc32c(std::span<const std::byte>(block.data(), static_cast<size_t>(n)), crc);
    const uint64_t a = std::max(at, lo), b = std::min(at + n, hi);
    if (a < b) std::memcpy(out.data() + (a - lo), block.data() + (a - at), static_cast<size_t>(b - a));
    at += n;
  }
  const uint32_t expected_crc = entry["crc32c"].get<uint32_t>();
  if (crc != expected_crc) {
    throw IoError(prefix(who) + "training state " + quoted(path) + ": checksum mismatch: crc32c " +
                  hex32(crc) + ", meta.json says " + hex32(expected_crc) + " (the file is corrupt)");
  }
  return out;
}

}  // namespace

int64_t CheckpointInfo::total_elems(int tp_rank) const {
  return meta(tp_rank).at("layout").at("total_elems").get<int64_t>();
}

zero::Partition CheckpointInfo::partition(int tp_rank) const {
  return zero::make_partition(total_elems(tp_rank), dp_size);
}

bool CheckpointInfo::has_section(std::string_view name) const {
  const json& m = meta(0);
  if (!m.contains("sections") || !m["sections"].is_array()) return false;
  return std::any_of(m["sections"].begin(), m["sections"].end(), [&](const json& e) {
    return e.is_object() && e.value("name", std::string()) == name;
  });
}

CheckpointInfo inspect_checkpoint(const fs::path& dir, std::string_view who) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw IoError(prefix(who) + quoted(dir) + ": no such directory");

  // Where the states are: dir itself (one rank) or dir/rank<r>.
  const bool has_meta = fs::exists(dir / "meta.json", ec);
  const bool has_rank0 = fs::exists(dir / "rank0" / "meta.json", ec);
  if (!has_meta && !has_rank0) {
    throw IoError(prefix(who) + quoted(dir) + " is not a porter training checkpoint: it has "
                  "neither meta.json nor rank0/meta.json (porter train --save DIR, or "
                  "Engine::save_checkpoint, writes one)");
  }
  const fs::path first_dir = has_rank0 ? dir / "rank0" : dir;
  const json m0 = peek_meta(first_dir, who);
  check_kind(m0, first_dir, who);
  const int dp = int_field(m0, "dp_size", 1, first_dir, who);
  const json tp_json = tensor_parallel_of(m0);
  if (!tp_json.is_number_integer() || tp_json.get<int>() < 1 || dp < 1) {
    throw IoError(prefix(who) + quoted(first_dir / "meta.json") + ": dp_size " +
                  std::to_string(dp) + " and config.model.tensor_parallel " + tp_json.dump() +
                  " must be positive integers");
  }
  const int tp = tp_json.get<int>();
  const int world = dp * tp;
  if (has_rank0 && world == 1) {
    throw IoError(prefix(who) + quoted(first_dir / "meta.json") + " was written by one rank, "
                  "so its state is the directory itself: pass " + quoted(first_dir));
  }
  if (!has_rank0 && world > 1) {
    throw IoError(prefix(who) + quoted(dir / "meta.json") + " is one rank's state of a "
                  "checkpoint written by " + std::to_string(world) + " ranks (dp " +
                  std::to_string(dp) + " x tp " + std::to_string(tp) + "): pass the directory "
                  "that holds rank0 .. rank" +
                  std::to_string(world - 1));
  }

  // Every rank saves its own state: name all that are missing before reading any.
  std::string missing;
  for (int r = 0; r < world && world > 1; ++r) {
    const fs::path rd = rank_path(dir, r, world);
    if (!fs::exists(rd / "meta.json", ec)) {
      missing += (missing.empty() ? "" : ", ") + quoted(rd) +
                 (fs::is_directory(rd, ec) ? " (no meta.json: a save that did not complete)" : "");
    }
  }
  if (!missing.empty()) {
    throw IoError(prefix(who) + quoted(dir) + " was written by " + std::to_string(world) +
                  " ranks (dp " + std::to_string(dp) + " x tp " + std::to_string(tp) +
                  ") but lacks " + missing + "; copy every rank's directory into it");
  }

  CheckpointInfo info;
  info.dir = dir;
  info.dp_size = dp;
  info.tp_size = tp;
  info.step = m0["step"].get<int64_t>();
  info.zero_stage = int_field(m0, "zero_stage", 0, first_dir, who);
  info.compute_dtype = parse_compute_dtype(m0["compute_dtype"], first_dir, who);
  for (int r = 0; r < world; ++r) {
    const fs::path rd = rank_path(dir, r, world);
    json meta = r == 0 ? m0 : peek_meta(rd, who);
    check_kind(meta, rd, who);
    // Rank 0 for the run's fields; dp rank 0 of the same tp rank for the layout.
    check_agree(m0, first_dir, meta, rd, /*compare_layout=*/tp == 1, who);
    if (r >= tp) {
      const int k = r % tp;
      check_agree(info.metas[static_cast<size_t>(k)], info.rank_dirs[static_cast<size_t>(k)], meta,
                  rd, /*compare_layout=*/true, who);
    }
    info.rank_dirs.push_back(rd);
    info.metas.push_back(std::move(meta));
  }
  return info;
}

size_t section_elem_bytes(const CheckpointInfo& info, std::string_view section) {
  return section == "params" ? tensor::dtype_size(info.compute_dtype) : 4;
}

std::pair<int64_t, int64_t> section_range(const CheckpointInfo& info, int rank,
                                          std::string_view section) {
  const int tp_rank = rank % info.tp_size, dp_rank = rank / info.tp_size;
  const zero::Partition part = info.partition(tp_rank);
  const json& meta = info.metas.at(static_cast<size_t>(rank));
  const fs::path& dir = info.rank_dirs.at(static_cast<size_t>(rank));
  if (section == "params") {
    if (!meta.contains("params_range")) return {0, part.padded_elems};
    const json& r = meta["params_range"];
    auto count = [](const json& j) { return j.is_number_integer() && j.get<int64_t>() >= 0; };
    if (!r.is_array() || r.size() != 2 || !count(r[0]) || !count(r[1]) ||
        r[0].get<int64_t>() > r[1].get<int64_t>() || r[1].get<int64_t>() > part.padded_elems) {
      throw IoError("training state " + quoted(dir / "meta.json") + ": params_range " + r.dump() +
                    " is not [begin, end] within the padded flat buffer of " +
                    std::to_string(part.padded_elems) + " elements");
    }
    return {r[0].get<int64_t>(), r[1].get<int64_t>()};
  }
  if (info.zero_stage >= 1) return {part.begin(dp_rank), part.end(dp_rank)};
  return {0, part.padded_elems};
}

std::vector<std::byte> read_flat_section(
    const CheckpointInfo& info, int tp_rank, std::string_view section, int64_t begin, int64_t end,
    Replicas replicas, const std::function<void(const fs::path&)>& on_rank_read,
    std::string_view who) {
  PORTER_CHECK(tp_rank >= 0 && tp_rank < info.tp_size && begin <= end, "read_flat_section: tp rank ",
               tp_rank, " of ", info.tp_size, ", elements [", begin, ", ", end, ")");
  const size_t elem = section_elem_bytes(info, section);
  const zero::Partition part = info.partition(tp_rank);
  const fs::path& first = info.rank_dirs.at(static_cast<size_t>(tp_rank));
  FlatAssembly flat(begin, end - begin, elem,
                    layout_specs(info.meta(tp_rank)["layout"], quoted(first / "meta.json")),
                    std::string(section), prefix(who));
  const int64_t saved_end = std::min(end, part.padded_elems);  // past it: 0
  for (int d = 0; d < info.dp_size; ++d) {
    const int rank = d * info.tp_size + tp_rank;
    const fs::path& rd = info.rank_dirs[static_cast<size_t>(rank)];
    const auto [rb, re] = section_range(info, rank, section);
    const json& entry = section_entry(info.metas[static_cast<size_t>(rank)], section, rd, who);
    const uint64_t need = static_cast<uint64_t>(re - rb) * elem;
    if (entry["bytes"].get<uint64_t>() != need) {
      throw IoError(prefix(who) + quoted(rd) + ": section '" + std::string(section) + "' has " +
                    std::to_string(entry["bytes"].get<uint64_t>()) + " bytes, expected " +
                    std::to_string(need) + ": elements [" + std::to_string(rb) + ", " +
                    std::to_string(re) + ") of the padded flat buffer (" +
                    std::to_string(part.padded_elems) + " elements) in " +
                    (elem == 4 ? "f32" : std::string(tensor::dtype_name(info.compute_dtype))) +
                    ", dp rank " + std::to_string(d) + " of " + std::to_string(info.dp_size) +
                    " at ZeRO stage " + std::to_string(info.zero_stage));
    }
    // What this rank adds to the window: all of its part (kCompare), or from the first element
    // not yet covered to the end of its range (kReadOnce; ranges are intervals).
    int64_t lo = std::max(begin, rb), hi = std::min(saved_end, re);
    if (replicas == Replicas::kReadOnce && lo < hi) lo = flat.first_uncovered(lo);
    if (lo >= hi) {
      if (replicas == Replicas::kReadOnce) continue;
      lo = hi = rb;  // read (and checked) all the same
    }
    const std::vector<std::byte> bytes =
        read_checked(rd / (std::string(section) + ".bin"), entry,
                     static_cast<uint64_t>(lo - rb) * elem, static_cast<uint64_t>(hi - rb) * elem, who);
    if (lo < hi) flat.place(lo, hi, bytes, rd);
    if (on_rank_read) on_rank_read(rd);
  }
  flat.check_covered(info.dir);
  return flat.take();
}

config::ModelConfig checkpoint_model_config(const CheckpointInfo& info, std::string_view who) {
  const json& meta = info.meta(0);
  const fs::path path = info.rank_dirs.at(0) / "meta.json";
  if (!meta.contains("config") || !meta["config"].is_object() ||
      !meta["config"].contains("model") || !meta["config"]["model"].is_object()) {
    throw IoError(prefix(who) + quoted(path) + " holds no config.model, from which the "
                  "tensor-parallel parts would be joined");
  }
  // Parsed at tensor_parallel 1 (the batch sizes it checks are not the checkpoint's), the
  // degree set after; `from` names weights to start from, not the layout.
  json model = meta["config"]["model"];
  for (const char* key : {"tensor_parallel", "sequence_parallel", "from"}) model.erase(key);
  try {
    config::ModelConfig c =
        config::parse_config_string(
            json{{"train_micro_batch_size_per_gpu", 1}, {"porter", {{"model", model}}}}.dump())
            .config.porter.model;
    c.tensor_parallel = info.tp_size;
    return c;
  } catch (const Error& e) {
    throw IoError(prefix(who) + quoted(path) + ": config.model does not describe a model porter "
                  "builds: " + e.what());
  }
}

namespace {

config::ModelConfig whole_config(config::ModelConfig model) {
  model.tensor_parallel = 1;
  model.sequence_parallel = false;
  return model;
}

// Note [Tensor-parallel parts in bytes]: fn(part_elem, whole_elem, elems) for every run of
// elements that rank tp_rank's part (of `model`, in its layout) shares with the whole model
// (the layout at tensor_parallel 1), but the replicated parameters when `skip_replicated`.
template <typename Fn>
void for_each_run(const config::ModelConfig& model, int tp_rank, bool skip_replicated, Fn fn) {
  const std::unique_ptr<models::Transformer> rank_model = models::build_model(model, tp_rank);
  const std::unique_ptr<models::Transformer> whole_model = models::build_model(whole_config(model));
  for (const models::ParamShard& s : rank_model->shard_map()) {
    const nn::ParamEntry& w = whole_model->layout().find(s.entry->name);
    if (skip_replicated && s.entry->shape == w.shape) continue;
    const int64_t whole_cols = w.shape.rank() == 2 ? w.shape[1] : 1;
    for (const models::ParamShard::Block& b : s.blocks) {
      const int64_t p = s.entry->offset_elems + b.row * s.cols;
      const int64_t q = w.offset_elems + b.whole_row * whole_cols + b.whole_col;
      if (s.cols == whole_cols) {  // the block's rows are whole: one run
        fn(p, q, b.rows * s.cols);
        continue;
      }
      for (int64_t i = 0; i < b.rows; ++i) fn(p + i * s.cols, q + i * whole_cols, s.cols);
    }
  }
}

int64_t layout_elems(const config::ModelConfig& model, int tp_rank) {
  return models::build_model(model, tp_rank)->layout().total_elems();
}

}  // namespace

int64_t whole_model_elems(const config::ModelConfig& model) {
  return layout_elems(whole_config(model), 0);
}

void place_tensor_parallel_part(const config::ModelConfig& model, int tp_rank,
                                std::span<const std::byte> part, std::span<std::byte> whole,
                                size_t elem_bytes) {
  const int64_t part_elems = layout_elems(model, tp_rank);
  PORTER_CHECK(static_cast<int64_t>(part.size()) >= part_elems * static_cast<int64_t>(elem_bytes) &&
                   static_cast<int64_t>(whole.size()) >=
                       whole_model_elems(model) * static_cast<int64_t>(elem_bytes),
               "place_tensor_parallel_part: ", part.size(), " bytes of tp rank ", tp_rank,
               "'s part and ", whole.size(), " of the whole model, in ", elem_bytes,
               "-byte elements");
  // Replicated parameters from rank 0 (they are equal on every rank).
  for_each_run(model, tp_rank, /*skip_replicated=*/tp_rank != 0, [&](int64_t p, int64_t q, int64_t n) {
    std::memcpy(whole.data() + static_cast<size_t>(q) * elem_bytes,
                part.data() + static_cast<size_t>(p) * elem_bytes, static_cast<size_t>(n) * elem_bytes);
  });
}

std::vector<std::byte> join_tensor_parallel(const config::ModelConfig& model,
                                            std::vector<std::vector<std::byte>> parts,
                                            size_t elem_bytes) {
  PORTER_CHECK_EQ(static_cast<int64_t>(parts.size()), model.tensor_parallel,
                  "join_tensor_parallel: one part per tensor-parallel rank");
  std::vector<std::byte> whole(static_cast<size_t>(whole_model_elems(model)) * elem_bytes);
  for (size_t k = 0; k < parts.size(); ++k) {
    place_tensor_parallel_part(model, static_cast<int>(k), parts[k], whole, elem_bytes);
    std::vector<std::byte>().swap(parts[k]);
  }
  return whole;
}

std::vector<std::byte> split_tensor_parallel(const config::ModelConfig& model, int tp_rank,
                                             std::span<const std::byte> whole, size_t elem_bytes) {
  PORTER_CHECK(static_cast<int64_t>(whole.size()) >=
                   whole_model_elems(model) * static_cast<int64_t>(elem_bytes),
               "split_tensor_parallel: ", whole.size(), " bytes of the whole model in ",
               elem_bytes, "-byte elements");
  std::vector<std::byte> part(static_cast<size_t>(layout_elems(model, tp_rank)) * elem_bytes);
  for_each_run(model, tp_rank, /*skip_replicated=*/false, [&](int64_t p, int64_t q, int64_t n) {
    std::memcpy(part.data() + static_cast<size_t>(p) * elem_bytes,
                whole.data() + static_cast<size_t>(q) * elem_bytes, static_cast<size_t>(n) * elem_bytes);
  });
  return part;
}

ConsolidateResult consolidate_checkpoint(const fs::path& dir, const ConsolidateOptions& options) {
  const CheckpointInfo info = inspect_checkpoint(dir);
  const int tp = info.tp_size;
  if (options.tp_rank && (*options.tp_rank < 0 || *options.tp_rank >= tp)) {
    throw InvalidArgument("consolidate: tp rank " + std::to_string(*options.tp_rank) +
                          " is not in " + quoted(dir) + ", whose tensor-parallel ranks are 0.." +
                          std::to_string(tp - 1));
  }

  ConsolidateResult res;
  res.dp_size = info.dp_size;
  res.tp_size = tp;
  res.tp_rank = options.tp_rank.value_or(0);
  res.whole = tp == 1 || !options.tp_rank;
  res.step = info.step;
  res.zero_stage = info.zero_stage;
  res.compute_dtype = info.compute_dtype;
  if (options.dtype == WeightsDType::kWorking) {
    res.section = "params";
    res.dtype = res.compute_dtype;
  } else {
    res.section = info.has_section("master") && res.compute_dtype != tensor::DType::kF32
                      ? "master" : "params";
    res.dtype = tensor::DType::kF32;
  }
  const tensor::DType section_dtype = res.section == "master" ? tensor::DType::kF32 : res.compute_dtype;

  // The tp ranks to read, each from its dp ranks (every one: replicas are compared).
  std::vector<int> tp_ranks;
  if (!res.whole) tp_ranks.push_back(res.tp_rank);
  for (int k = 0; res.whole && k < tp; ++k) tp_ranks.push_back(k);
  const int count = static_cast<int>(tp_ranks.size()) * info.dp_size;
  // The model the parts join into, checked against the parts' layouts before reading any.
  std::optional<config::ModelConfig> model;
  if (tp > 1 && res.whole) {
    for (int k = 0; k < tp; ++k) {
      std::string built;
      try {
        if (!model) model = checkpoint_model_config(info);
        built = layout_difference(info.meta(k)["layout"], info.rank_dirs[static_cast<size_t>(k)],
                                  layout_json(models::build_model(*model, k)->layout()),
                                  "config.model");
      } catch (const Error& e) {
        built = e.what();
      }
      if (!built.empty()) {
        throw IoError("consolidate: " + quoted(dir) + "'s tp rank " + std::to_string(k) +
                      " does not hold the part of the model its config.model describes (" + built +
                      "), so the tp ranks cannot be joined into the whole model; pass --tp-rank K "
                      "to write one rank's part (K in 0.." + std::to_string(tp - 1) + ")");
      }
    }
  }

  std::vector<std::vector<std::byte>> parts;
  for (int k : tp_ranks) {
    const zero::Partition part = info.partition(k);
    std::vector<std::byte> flat = read_flat_section(
        info, k, res.section, 0, part.padded_elems, Replicas::kCompare, [&](const fs::path& rd) {
          res.rank_dirs.push_back(rd);
          if (options.on_rank_read) {
            options.on_rank_read(static_cast<int>(res.rank_dirs.size()), count, rd);
          }
        });
    parts.push_back(std::move(flat));
  }
  std::vector<FlatTensorSpec> specs;
  std::vector<std::byte> flat;
  const size_t elem = tensor::dtype_size(section_dtype);
  if (model) {
    flat = join_tensor_parallel(*model, std::move(parts), elem);
    specs = layout_specs(models::build_model(whole_config(*model))->layout());
  } else {
    flat = std::move(parts.at(0));
    specs = layout_specs(info.meta(res.tp_rank)["layout"],
                         quoted(info.rank_dirs[static_cast<size_t>(res.tp_rank)] / "meta.json"));
  }
  if (section_dtype != res.dtype) flat = to_f32_bytes(section_dtype, flat);
  res.tensors = layout_tensors(specs, res.dtype, flat);
  for (const WeightTensor& t : res.tensors) {
    res.num_params += t.numel();
    res.data_bytes += t.bytes.size();
  }
  return res;
}

}  // namespace porter::io
