// This rank's part of a training checkpoint written at another layout (Note [Resharding a
// checkpoint] in engine/reshard.h).
#include "engine/reshard.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <memory>

#include "base/check.h"
#include "base/error.h"
#include "engine/checkpoint_snapshot.h"
#include "models/factory.h"

namespace porter::engine {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string shape_string(const json& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + shape[i].dump();
  return s + ")";
}

// meta.json of `dir`, or null when it is absent or not JSON.
json try_meta(const fs::path& dir) {
  std::ifstream in(dir / "meta.json", std::ios::binary);
  if (!in) return nullptr;
  try {
    return json::parse(in);
  } catch (const json::exception&) {
    return nullptr;
  }
}

int int_or(const json& meta, const char* key, int fallback) {
  return meta.contains(key) && meta[key].is_number_integer() ? meta[key].get<int>() : fallback;
}

int tensor_parallel_of(const json& meta) {
  if (meta.contains("config") && meta["config"].is_object() && meta["config"].contains("model") &&
      meta["config"]["model"].is_object()) {
    return int_or(meta["config"]["model"], "tensor_parallel", 1);
  }
  return 1;
}

std::string layout_words(int dp, int tp, int stage) {
  return std::to_string(dp) + " data-parallel x " + std::to_string(tp) +
         " tensor-parallel ranks at ZeRO stage " + std::to_string(stage);
}

config::ModelConfig at_degree(config::ModelConfig model, int tp) {
  model.tensor_parallel = tp;
  if (tp == 1) model.sequence_parallel = false;
  return model;
}

// [begin, end) of `part` (a flat buffer in a layout of `elems` elements), 0 past it.
std::vector<std::byte> window(const std::vector<std::byte>& part, int64_t elems, size_t elem,
                              int64_t begin, int64_t end) {
  std::vector<std::byte> out(static_cast<size_t>(end - begin) * elem);
  const int64_t hi = std::min(end, elems);
  if (begin < hi) {
    std::memcpy(out.data(), part.data() + static_cast<size_t>(begin) * elem,
                static_cast<size_t>(hi - begin) * elem);
  }
  return out;
}

}  // namespace

SavedLayout peek_saved_layout(const fs::path& dir) {
  SavedLayout s;
  json meta = try_meta(dir);
  if (meta.is_object()) {
    s.rank_dirs = false;
  } else {
    meta = try_meta(dir / "rank0");
    if (!meta.is_object()) return s;
    s.rank_dirs = true;
  }
  if (meta.value("kind", json()) != "porter.engine") return s;
  s.found = true;
  s.dp_size = std::max(1, int_or(meta, "dp_size", 1));
  s.tp_size = std::max(1, tensor_parallel_of(meta));
  s.zero_stage = int_or(meta, "zero_stage", 0);
  if (!s.rank_dirs && s.world() > 1) {
    throw InvalidArgument(
        dir.string() + ": this is one rank's state of a checkpoint written by " +
        std::to_string(s.world()) + " ranks (" + std::to_string(s.dp_size) +
        " data-parallel ranks x " + std::to_string(s.tp_size) + " tensor-parallel); load the "
        "directory that holds rank0 .. rank" + std::to_string(s.world() - 1) +
        ", which resumes at any layout");
  }
  return s;
}

bool same_layout(const SavedLayout& saved, const RankLayout& mine) {
  return saved.dp_size == mine.dp_size && saved.tp_size == mine.tp_size &&
         (mine.dp_size == 1 || saved.zero_stage == mine.zero_stage);
}

void check_checkpoint_layout(const std::string& where, const json& saved, const json& mine,
                             const std::string& fix) {
  const json& sp = saved.at("params");
  const json& mp = mine.at("params");
  for (size_t i = 0; i < std::min(sp.size(), mp.size()); ++i) {
    const json& a = sp[i];
    const json& b = mp[i];
    if (a.at("name") != b.at("name") || a.at("shape") != b.at("shape") ||
        a.at("offset") != b.at("offset")) {
      throw InvalidArgument(where + "model layout differs at parameter " + std::to_string(i) +
                            ": the checkpoint has '" + a.at("name").get<std::string>() + "' " +
                            shape_string(a.at("shape")) + " at offset " + a.at("offset").dump() +
                            ", this model has '" + b.at("name").get<std::string>() + "' " +
                            shape_string(b.at("shape")) + " at offset " + b.at("offset").dump() +
                            "; " + fix);
    }
  }
  if (sp.size() != mp.size() || saved.at("total_elems") != mine.at("total_elems")) {
    throw InvalidArgument(where + "model layout differs: the checkpoint has " +
                          std::to_string(sp.size()) + " parameters (" +
                          saved.at("total_elems").dump() + " elements), this model has " +
                          std::to_string(mp.size()) + " (" + mine.at("total_elems").dump() +
                          " elements); " + fix);
  }
}

std::vector<std::vector<std::byte>> reshard_sections(const io::CheckpointInfo& saved,
                                                     const RankLayout& mine,
                                                     const std::vector<ReshardTarget>& targets) {
  PORTER_CHECK(mine.layout != nullptr, "reshard_sections: the rank's layout");
  const std::string where = saved.dir.string() + ": ";
  const std::string saved_words = layout_words(saved.dp_size, saved.tp_size, saved.zero_stage);
  const std::string mine_words = layout_words(mine.dp_size, mine.tp_size, mine.zero_stage);
  // Check everything before reading any section.
  const std::string dtype(tensor::dtype_name(saved.compute_dtype));
  const std::string my_dtype(tensor::dtype_name(mine.compute_dtype));
  if (dtype != my_dtype) {
    throw InvalidArgument(where + "compute dtype differs: the checkpoint was trained in " + dtype +
                          ", this engine computes in " + my_dtype +
                          " (bf16.enabled must match; the layout may differ)");
  }
  const std::string fix = "load it into an engine built from the same model config (the "
                          "data-parallel size, tensor_parallel, ZeRO stage and offload may "
                          "differ)";
  const json my_layout = checkpoint_layout_json(*mine.layout);
  const bool same_tp = saved.tp_size == mine.tp_size;
  if (same_tp) {
    check_checkpoint_layout(where, saved.meta(mine.tp_rank).at("layout"), my_layout, fix);
  } else {
    if (!mine.transformer) {
      throw InvalidArgument(
          where + "written by " + saved_words + ", this engine runs " + mine_words +
          ": changing the tensor-parallel degree is supported for the built-in transformer "
          "(porter.model) only, whose parts porter knows; resume this model at tensor_parallel " +
          std::to_string(saved.tp_size) + " (the data-parallel size and ZeRO stage may differ)");
    }
    for (int k = 0; k < saved.tp_size; ++k) {
      std::unique_ptr<models::Transformer> part;
      try {
        part = models::build_model(at_degree(mine.model, saved.tp_size), k);
      } catch (const InvalidArgument& e) {
        throw InvalidArgument(where + "written at tensor_parallel " +
                              std::to_string(saved.tp_size) + ", which this engine's model "
                              "cannot be split into (" + e.what() + "); " + fix);
      }
      check_checkpoint_layout(where + "tensor-parallel rank " + std::to_string(k) + ": ",
                              saved.meta(k).at("layout"), checkpoint_layout_json(part->layout()),
                              fix);
    }
  }
  for (const ReshardTarget& t : targets) {
    if (!saved.has_section(t.section)) {
      throw IoError(where + "holds no section \"" + t.section + "\", which this engine needs");
    }
  }

  std::vector<std::vector<std::byte>> out;
  for (const ReshardTarget& t : targets) {
    const size_t elem = io::section_elem_bytes(saved, t.section);
    if (same_tp) {
      out.push_back(io::read_flat_section(saved, mine.tp_rank, t.section, t.begin, t.end,
                                          io::Replicas::kReadOnce, {}, "load_checkpoint"));
      continue;
    }
    // The section's whole model, the saved parts placed in it one at a time.
    std::vector<std::byte> part;
    {
      const config::ModelConfig saved_model = at_degree(mine.model, saved.tp_size);
      std::vector<std::byte> whole(static_cast<size_t>(io::whole_model_elems(saved_model)) * elem);
      for (int k = 0; k < saved.tp_size; ++k) {
        const std::vector<std::byte> saved_part = io::read_flat_section(
            saved, k, t.section, 0, saved.total_elems(k), io::Replicas::kReadOnce, {},
            "load_checkpoint");
        io::place_tensor_parallel_part(saved_model, k, saved_part, whole, elem);
      }
      part = io::split_tensor_parallel(mine.model, mine.tp_rank, whole, elem);
    }
    out.push_back(window(part, mine.layout->total_elems(), elem, t.begin, t.end));
  }
  return out;
}

WholeSection read_whole_section(const fs::path& dir, const std::string& section,
                                const config::ModelConfig& model) {
  const io::CheckpointInfo info = io::inspect_checkpoint(dir, "read_whole_section");
  WholeSection out;
  out.elem_bytes = io::section_elem_bytes(info, section);
  std::vector<std::vector<std::byte>> parts;
  for (int k = 0; k < info.tp_size; ++k) {
    parts.push_back(io::read_flat_section(info, k, section, 0, info.total_elems(k),
                                          io::Replicas::kReadOnce, {}, "read_whole_section"));
  }
  if (info.tp_size == 1) {
    out.bytes = std::move(parts[0]);
  } else {
    out.bytes = io::join_tensor_parallel(at_degree(model, info.tp_size), std::move(parts),
                                         out.elem_bytes);
  }
  return out;
}

}  // namespace porter::engine
