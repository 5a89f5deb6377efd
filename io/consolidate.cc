// Consolidated weights from a training checkpoint's per-rank files (Note [Consolidating a
// checkpoint] in io/consolidate.h).
#include "io/consolidate.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <optional>
#include <tuple>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "io/state_file.h"
#include "zero/partition.h"

namespace porter::io {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string quoted(const fs::path& p) { return "\"" + p.string() + "\""; }

std::string shape_string(const json& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + shape[i].dump();
  return s + ")";
}

fs::path rank_path(const fs::path& dir, int rank, int world) {
  return world > 1 ? dir / ("rank" + std::to_string(rank)) : dir;
}

// meta.json alone (no sections), to learn the world size before reading anything large.
json peek_meta(const fs::path& dir) {
  const fs::path path = dir / "meta.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError("consolidate: cannot read " + quoted(path));
  json meta;
  try {
    meta = json::parse(in);
  } catch (const json::exception& e) {
    throw IoError("consolidate: " + quoted(path) + ": unparsable JSON: " + e.what());
  }
  return meta;
}

// Throws IoError unless `meta` is an engine checkpoint's (Note [Engine state] in state.cc).
void check_kind(const json& meta, const fs::path& dir) {
  const fs::path path = dir / "meta.json";
  if (!meta.is_object() || !meta.contains("kind") || meta["kind"] != "porter.engine") {
    throw IoError("consolidate: " + quoted(path) + " is not a porter training checkpoint: kind is " +
                  (meta.is_object() && meta.contains("kind") ? meta["kind"].dump() : "absent") +
                  ", expected \"porter.engine\"");
  }
  for (const char* key : {"step", "compute_dtype", "layout"}) {
    if (!meta.contains(key)) {
      throw IoError("consolidate: " + quoted(path) + " is not a porter training checkpoint: it has no \"" +
                    key + "\"");
    }
  }
  if (!meta["step"].is_number_integer()) {
    throw IoError("consolidate: " + quoted(path) + ": step " + meta["step"].dump() +
                  " is not an integer");
  }
}

int int_field(const json& meta, const char* key, int fallback, const fs::path& dir) {
  if (!meta.contains(key)) return fallback;
  const json& v = meta[key];
  if (!v.is_number_integer()) {
    throw IoError("consolidate: " + quoted(dir / "meta.json") + ": \"" + key + "\" is " + v.dump() +
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

tensor::DType parse_compute_dtype(const json& v, const fs::path& dir) {
  for (tensor::DType t : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16}) {
    if (v == std::string(tensor::dtype_name(t))) return t;
  }
  throw IoError("consolidate: " + quoted(dir / "meta.json") + ": compute_dtype " + v.dump() +
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
                 bool compare_layout) {
  const std::string rule = " (every rank saves the same training state: these directories do "
                           "not come from one save)";
  for (const char* key : {"step", "dp_size", "zero_stage", "compute_dtype"}) {
    const json va = a.contains(key) ? a[key] : json("absent");
    const json vb = b.contains(key) ? b[key] : json("absent");
    if (va != vb) {
      throw IoError("consolidate: checkpoint ranks disagree on " + std::string(key) + ": " +
                    quoted(a_dir) + " has " + va.dump() + ", " + quoted(b_dir) + " has " +
                    vb.dump() + rule);
    }
  }
  const json ta = tensor_parallel_of(a), tb = tensor_parallel_of(b);
  if (ta != tb) {
    throw IoError("consolidate: checkpoint ranks disagree on config.model.tensor_parallel: " +
                  quoted(a_dir) + " has " + ta.dump() + ", " + quoted(b_dir) + " has " + tb.dump() +
                  rule);
  }
  if (compare_layout) {
    const std::string diff = layout_difference(a["layout"], a_dir, b["layout"], b_dir);
    if (!diff.empty()) throw IoError("consolidate: checkpoint ranks disagree on " + diff + rule);
  }
}

// The padded flat buffer being assembled from the ranks' ranges (elements of `elem_bytes`).
class FlatAssembly {
 public:
  FlatAssembly(int64_t padded_elems, size_t elem_bytes, const std::vector<FlatTensorSpec>& specs,
               std::string section)
      : bytes_(static_cast<size_t>(padded_elems) * elem_bytes), elem_bytes_(elem_bytes),
        specs_(specs), section_(std::move(section)) {}

  // Lays `src` (elements [begin, end)) in; where another rank already placed elements, they
  // must be equal byte for byte.
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

  // Throws IoError naming the first parameter with elements no rank placed.
  void check_covered(const fs::path& dir) const {
    for (const FlatTensorSpec& s : specs_) {
      int64_t n = 1;
      for (int64_t d : s.shape) n *= d;
      int64_t at = s.offset_elems;
      const int64_t end = s.offset_elems + n;
      for (const Piece& p : pieces_) {
        if (p.begin <= at && p.end > at) at = p.end;
      }
      if (at < end) {
        throw IoError("consolidate: " + quoted(dir) + ": elements [" + std::to_string(at) + ", " +
                      std::to_string(end) + ") of the flat buffer (parameter '" + s.name +
                      "') are in no rank's " + section_ + " section");
      }
    }
  }

  std::vector<std::byte>& bytes() { return bytes_; }

 private:
  struct Piece {
    int64_t begin, end;
    fs::path from;
  };

  void copy(int64_t lo, int64_t hi, int64_t src_begin, std::span<const std::byte> src) {
    std::memcpy(bytes_.data() + static_cast<size_t>(lo) * elem_bytes_,
                src.data() + static_cast<size_t>(lo - src_begin) * elem_bytes_,
                static_cast<size_t>(hi - lo) * elem_bytes_);
  }

  void compare(int64_t lo, int64_t hi, int64_t src_begin, std::span<const std::byte> src,
               const fs::path& from, const fs::path& first) const {
    const std::byte* mine = bytes_.data() + static_cast<size_t>(lo) * elem_bytes_;
    const std::byte* theirs = src.data() + static_cast<size_t>(lo - src_begin) * elem_bytes_;
    if (std::memcmp(mine, theirs, static_cast<size_t>(hi - lo) * elem_bytes_) == 0) return;
    int64_t i = lo;
    while (std::memcmp(bytes_.data() + static_cast<size_t>(i) * elem_bytes_,
                       src.data() + static_cast<size_t>(i - src_begin) * elem_bytes_,
                       elem_bytes_) == 0) {
      ++i;
    }
    throw IoError("consolidate: " + quoted(from) + ": " + section_ + " element " + std::to_string(i) +
                  " (" + where(i) + ") differs from " + quoted(first) + "'s: the ranks' copies of "
                  "the same elements must be equal (the directories do not come from one save)");
  }

  std::string where(int64_t elem) const {
    for (const FlatTensorSpec& s : specs_) {
      int64_t n = 1;
      for (int64_t d : s.shape) n *= d;
      if (elem >= s.offset_elems && elem < s.offset_elems + n) {
        return "parameter '" + s.name + "' element " + std::to_string(elem - s.offset_elems);
      }
    }
    return "alignment padding";
  }

  std::vector<std::byte> bytes_;
  size_t elem_bytes_;
  const std::vector<FlatTensorSpec>& specs_;  // not owned: the caller's, outlives this
  std::string section_;
  std::vector<Piece> pieces_;  // disjoint, sorted by begin
};

// A rank's "params_range" [begin, end] when meta.json has one.
std::optional<std::pair<int64_t, int64_t>> params_range(const json& meta, int64_t padded,
                                                        const fs::path& dir) {
  if (!meta.contains("params_range")) return std::nullopt;
  const json& r = meta["params_range"];
  auto count = [](const json& j) { return j.is_number_integer() && j.get<int64_t>() >= 0; };
  if (!r.is_array() || r.size() != 2 || !count(r[0]) || !count(r[1]) ||
      r[0].get<int64_t>() > r[1].get<int64_t>() || r[1].get<int64_t>() > padded) {
    throw IoError("consolidate: " + quoted(dir / "meta.json") + ": params_range " + r.dump() +
                  " is not [begin, end] within the padded flat buffer of " + std::to_string(padded) +
                  " elements");
  }
  return std::make_pair(r[0].get<int64_t>(), r[1].get<int64_t>());
}

}  // namespace

ConsolidateResult consolidate_checkpoint(const fs::path& dir, const ConsolidateOptions& options) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw IoError("consolidate: " + quoted(dir) + ": no such directory");

  // Where the states are: dir itself (one rank) or dir/rank<r>.
  const bool has_meta = fs::exists(dir / "meta.json", ec);
  const bool has_rank0 = fs::exists(dir / "rank0" / "meta.json", ec);
  if (!has_meta && !has_rank0) {
    throw IoError("consolidate: " + quoted(dir) + " is not a porter training checkpoint: it has "
                  "neither meta.json nor rank0/meta.json (porter train --save DIR, or "
                  "Engine::save_checkpoint, writes one)");
  }
  const fs::path first_dir = has_rank0 ? dir / "rank0" : dir;
  const json m0 = peek_meta(first_dir);
  check_kind(m0, first_dir);
  const int dp = int_field(m0, "dp_size", 1, first_dir);
  const json tp_json = tensor_parallel_of(m0);
  if (!tp_json.is_number_integer() || tp_json.get<int>() < 1 || dp < 1) {
    throw IoError("consolidate: " + quoted(first_dir / "meta.json") + ": dp_size " +
                  std::to_string(dp) + " and config.model.tensor_parallel " + tp_json.dump() +
                  " must be positive integers");
  }
  const int tp = tp_json.get<int>();
  const int world = dp * tp;
  if (has_rank0 && world == 1) {
    throw IoError("consolidate: " + quoted(first_dir / "meta.json") + " was written by one rank, "
                  "so its state is the directory itself: pass " + quoted(first_dir));
  }
  if (!has_rank0 && world > 1) {
    throw IoError("consolidate: " + quoted(dir / "meta.json") + " is one rank's state of a "
                  "checkpoint written by " + std::to_string(world) + " ranks (dp " +
                  std::to_string(dp) + " x tp " + std::to_string(tp) + "): pass the directory "
                  "that holds rank0 .. rank" + std::to_string(world - 1));
  }
  if (tp > 1 && !options.tp_rank) {
    throw InvalidArgument("consolidating a tensor-parallel checkpoint is not supported: each tp "
                          "rank holds a different part of the model; pass --tp-rank K to write "
                          "that rank's part (" + quoted(dir) + " has tensor_parallel " +
                          std::to_string(tp) + ", K in 0.." + std::to_string(tp - 1) + ")");
  }
  const int tp_rank = options.tp_rank.value_or(0);
  if (tp_rank < 0 || tp_rank >= tp) {
    throw InvalidArgument("consolidate: tp rank " + std::to_string(tp_rank) + " is not in " +
                          quoted(dir) + ", whose tensor-parallel ranks are 0.." +
                          std::to_string(tp - 1));
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
    throw IoError("consolidate: " + quoted(dir) + " was written by " + std::to_string(world) +
                  " ranks (dp " + std::to_string(dp) + " x tp " + std::to_string(tp) +
                  ") but lacks " + missing + "; copy every rank's directory into it");
  }

  ConsolidateResult res;
  res.dp_size = dp;
  res.tp_size = tp;
  res.tp_rank = tp_rank;
  res.step = m0["step"].get<int64_t>();
  res.zero_stage = int_field(m0, "zero_stage", 0, first_dir);
  res.compute_dtype = parse_compute_dtype(m0["compute_dtype"], first_dir);

  std::optional<FlatAssembly> flat;
  std::vector<FlatTensorSpec> specs;
  zero::Partition part;
  json ref_meta;
  fs::path ref_dir;
  tensor::DType section_dtype = res.compute_dtype;  // of the section's elements on disk
  for (int d = 0; d < dp; ++d) {
    const fs::path rd = rank_path(dir, d * tp + tp_rank, world);
    const LoadedState state = read_state(rd);  // verifies the checksums
    const json& meta = state.meta;
    check_kind(meta, rd);
    check_agree(m0, first_dir, meta, rd, /*compare_layout=*/tp == 1);
    if (d == 0) {
      ref_meta = meta;
      ref_dir = rd;
      specs = layout_specs(meta["layout"], quoted(rd / "meta.json"));
      part = zero::make_partition(meta["layout"]["total_elems"].get<int64_t>(), dp);
      const bool has_master = std::any_of(state.sections.begin(), state.sections.end(),
                                          [](const StateSection& s) { return s.name == "master"; });
      if (options.dtype == WeightsDType::kWorking) {
        res.section = "params";
        res.dtype = res.compute_dtype;
      } else {
        res.section = has_master && res.compute_dtype != tensor::DType::kF32 ? "master" : "params";
        res.dtype = tensor::DType::kF32;
        if (res.section == "master") section_dtype = tensor::DType::kF32;
      }
      flat.emplace(part.padded_elems, tensor::dtype_size(res.dtype), specs, res.section);
    } else {
      check_agree(ref_meta, ref_dir, meta, rd, /*compare_layout=*/true);
    }

    // The rank's range of the padded buffer (Note [Consolidating a checkpoint]).
    int64_t begin = 0, end = part.padded_elems;
    if (res.section == "params") {
      if (const auto r = params_range(meta, part.padded_elems, rd)) std::tie(begin, end) = *r;
    } else if (res.zero_stage >= 1) {
      begin = part.begin(d);
      end = part.end(d);
    }
    const StateSection& s = state.section(res.section);
    const uint64_t need = static_cast<uint64_t>(end - begin) * tensor::dtype_size(section_dtype);
    if (s.bytes.size() != need) {
      throw IoError("consolidate: " + quoted(rd) + ": section '" + res.section + "' has " +
                    std::to_string(s.bytes.size()) + " bytes, expected " + std::to_string(need) +
                    ": elements [" + std::to_string(begin) + ", " + std::to_string(end) +
                    ") of the padded flat buffer (" + std::to_string(part.padded_elems) +
                    " elements) in " + std::string(tensor::dtype_name(section_dtype)) +
                    ", dp rank " + std::to_string(d) + " of " + std::to_string(dp) +
                    " at ZeRO stage " + std::to_string(res.zero_stage));
    }
    if (section_dtype != res.dtype) {
      const std::vector<std::byte> wide = to_f32_bytes(section_dtype, s.bytes);
      flat->place(begin, end, wide, rd);
    } else {
      flat->place(begin, end, s.bytes, rd);
    }
    res.rank_dirs.push_back(rd);
    if (options.on_rank_read) options.on_rank_read(d + 1, dp, rd);
  }
  flat->check_covered(dir);
  res.tensors = layout_tensors(specs, res.dtype, flat->bytes());
  for (const WeightTensor& t : res.tensors) {
    res.num_params += t.numel();
    res.data_bytes += t.bytes.size();
  }
  return res;
}

}  // namespace porter::io
