// Shared set-up of the engine tests: a tiny GPT config, a cpu device and deterministic
// micro-batches.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "config/config.h"
#include "io/data.h"
#include "engine/engine.h"
#include "io/state_file.h"
#include "memory/device.h"
#include "zero/partition.h"

namespace porter::engine::testing {

inline config::Config tiny_config(config::CheckpointPolicy policy = config::CheckpointPolicy::kNone,
                                  double dropout = 0.1, int64_t accumulation = 2,
                                  bool bf16 = false) {
  config::Config c;
  c.train_micro_batch_size_per_gpu = 2;
  c.gradient_accumulation_steps = accumulation;
  c.train_batch_size = 2 * accumulation;
  c.gradient_clipping = 1.0;
  c.bf16.enabled = bf16;
  config::OptimizerConfig opt;
  opt.lr = 1e-2;
  opt.weight_decay = 0.01;
  c.optimizer = opt;
  c.porter.model.layers = 3;
  c.porter.model.hidden = 32;
  c.porter.model.heads = 4;
  c.porter.model.seq_len = 16;
  c.porter.model.vocab = 64;
  c.porter.model.dropout = dropout;
  c.porter.checkpointing.policy = policy;
  c.porter.train.seed = 7;
  return c;
}

inline std::unique_ptr<memory::Device> cpu_device(size_t limit_bytes = size_t{256} << 20) {
  memory::DeviceOptions o;
  o.memory_limit_bytes = limit_bytes;
  o.threads = 1;
  return memory::make_device(o);
}

// Step `step`'s micro-batches: a learnable pattern (the target is a function of the token).
inline std::vector<io::HostBatch> batches(const config::Config& c, int64_t step) {
  std::vector<io::HostBatch> out;
  const int64_t b = c.train_micro_batch_size_per_gpu, t = c.porter.model.seq_len;
  const int64_t v = c.porter.model.vocab;
  for (int64_t m = 0; m < c.gradient_accumulation_steps; ++m) {
    io::HostBatch mb;
    mb.batch = b;
    mb.seq = t;
    for (int64_t i = 0; i < b * t; ++i) {
      const int64_t tok = (i * 7 + m * 13 + step * 5 + (i * i) % 11) % v;
      mb.tokens.push_back(static_cast<int32_t>(tok));
      mb.targets.push_back(static_cast<int32_t>((tok * 3 + 1) % v));
    }
    out.push_back(std::move(mb));
  }
  return out;
}

inline std::unique_ptr<Engine> gpt_engine(memory::Device& device, const config::Config& c) {
  return std::make_unique<Engine>(device, std::make_unique<TransformerModel>(c.porter.model), c);
}

// A profiled chain's costs against the analytic model's (models/analytic.h): every stage's
// name, sizes and backward peak, and every available save option's byte figures, equal.
inline void expect_costs_match(const checkpoint::ChainCosts& profiled,
                               const checkpoint::ChainCosts& analytic) {
  ASSERT_EQ(profiled.num_stages(), analytic.num_stages());
  for (int i = 0; i < profiled.num_stages(); ++i) {
    const checkpoint::StageCost& a = analytic.stages[i];
    const checkpoint::StageCost& b = profiled.stages[i];
    SCOPED_TRACE(a.name);
    EXPECT_EQ(b.name, a.name);
    EXPECT_EQ(b.is_block, a.is_block);
    EXPECT_EQ(b.input_bytes, a.input_bytes);
    EXPECT_EQ(b.output_bytes, a.output_bytes);
    EXPECT_EQ(b.backward_total_peak_bytes, a.backward_total_peak_bytes);
    for (int o = 0; o < checkpoint::kNumSaveOptions; ++o) {
      const checkpoint::OptionCost& x = a.options[o];
      const checkpoint::OptionCost& y = b.options[o];
      SCOPED_TRACE(std::string(checkpoint::save_option_name(static_cast<checkpoint::SaveOption>(o))));
      EXPECT_EQ(y.available, x.available);
      if (!x.available) continue;
      EXPECT_EQ(y.forward_peak_bytes, x.forward_peak_bytes);
      EXPECT_EQ(y.forward_total_peak_bytes, x.forward_total_peak_bytes);
      EXPECT_EQ(y.saved_bytes, x.saved_bytes);
      EXPECT_EQ(y.tape_refs_input, x.tape_refs_input);
      EXPECT_EQ(y.tape_refs_output, x.tape_refs_output);
      EXPECT_EQ(y.recompute_peak_bytes, x.recompute_peak_bytes);
      EXPECT_EQ(y.recompute_total_peak_bytes, x.recompute_total_peak_bytes);
      EXPECT_EQ(y.recompute_saved_bytes, x.recompute_saved_bytes);
    }
  }
}

inline bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// One rank's whole training state, as Engine::save_checkpoint writes it (Note [Engine state]
// and Note [Data-parallel checkpoints] in engine/state.cc): every section (working params,
// the f32 master, both AdamW moments) with the range of the padded flat buffer it covers,
// and the meta's step, optimizer_steps and loss scaler. The ranges differ between stages:
// params is the whole buffer below stage 3 and the rank's shard (meta params_range) at 3;
// the optimizer's sections are the whole buffer at stage 0 and the rank's shard above.
struct SavedState {
  struct Section {
    std::string name;
    int64_t begin = 0;      // elements of the padded flat buffer
    int64_t elems = 0;
    size_t elem_bytes = 0;  // 2 or 4
    std::vector<std::byte> bytes;
  };
  struct Tensor {
    std::string name;
    int64_t offset = 0, elems = 0;
  };
  int world_rank = 0, tp_rank = 0;
  int64_t padded_elems = 0;
  int64_t step = 0, optimizer_steps = 0;
  nlohmann::json loss_scaler;
  std::vector<Tensor> layout;  // meta's, to name what differs
  std::vector<Section> sections;
  // The layout tensor holding element i of the padded buffer, or "padding".
  std::string tensor_at(int64_t i) const {
    for (const Tensor& t : layout) {
      if (i >= t.offset && i < t.offset + t.elems) {
        return t.name + "[" + std::to_string(i - t.offset) + "]";
      }
    }
    return "padding";
  }
};

// Saves e's state into a fresh temporary directory and reads it back. A collective at
// stage 3 (save_checkpoint gathers): every rank calls it.
inline SavedState saved_state(const Engine& e) {
  namespace fs = std::filesystem;
  static std::atomic<int> counter{0};
  const fs::path dir = fs::temp_directory_path() /
                       ("porter_test_state_" + std::to_string(::getpid()) + "_" +
                        std::to_string(counter.fetch_add(1)));
  fs::remove_all(dir);
  e.save_checkpoint(dir);
  const bool ranks = e.dp_size() * e.tp_size() > 1;
  const io::LoadedState st = io::read_state(ranks ? dir / ("rank" + std::to_string(e.world_rank())) : dir);
  fs::remove_all(dir);
  const nlohmann::json& m = st.meta;
  SavedState out;
  out.world_rank = e.world_rank();
  out.tp_rank = e.tp_rank();
  out.step = m.at("step").get<int64_t>();
  out.optimizer_steps = m.at("optimizer_steps").get<int64_t>();
  out.loss_scaler = m.at("loss_scaler");
  for (const nlohmann::json& t : m.at("layout").at("params")) {
    int64_t n = 1;
    for (const nlohmann::json& d : t.at("shape")) n *= d.get<int64_t>();
    out.layout.push_back({t.at("name").get<std::string>(), t.at("offset").get<int64_t>(), n});
  }
  const int dp = m.at("dp_size").get<int>();
  const int stage = m.at("zero_stage").get<int>();
  const zero::Partition part =
      zero::make_partition(m.at("layout").at("total_elems").get<int64_t>(), dp);
  out.padded_elems = part.padded_elems;
  for (const io::StateSection& sec : st.sections) {
    SavedState::Section s{sec.name, 0, part.padded_elems, 0, sec.bytes};
    if (sec.name == "params") {
      if (m.contains("params_range")) {
        s.begin = m.at("params_range")[0].get<int64_t>();
        s.elems = m.at("params_range")[1].get<int64_t>() - s.begin;
      }
    } else if (stage > 0) {
      s.begin = part.begin(e.dp_rank());
      s.elems = part.shard_elems;
    }
    if (s.elems <= 0 || s.bytes.size() % static_cast<size_t>(s.elems) != 0) {
      throw std::logic_error("saved_state: section '" + s.name + "' has " +
                             std::to_string(s.bytes.size()) + " bytes for " +
                             std::to_string(s.elems) + " elements");
    }
    s.elem_bytes = s.bytes.size() / static_cast<size_t>(s.elems);
    out.sections.push_back(std::move(s));
  }
  return out;
}

namespace detail {

// One run's section over the whole padded buffer of one tp rank, from its ranks' ranges.
struct AssembledSection {
  size_t elem_bytes = 0;
  std::vector<std::byte> bytes;
  std::vector<bool> covered;
};
using AssembledState = std::map<std::pair<int, std::string>, AssembledSection>;

// Puts every rank's sections together; where ranks hold the same elements (stage 0's
// optimizer, params below stage 3) their copies must agree.
inline AssembledState assemble(const std::vector<SavedState>& run, const std::string& what) {
  AssembledState out;
  for (const SavedState& st : run) {
    for (const SavedState::Section& s : st.sections) {
      AssembledSection& a = out[{st.tp_rank, s.name}];
      if (a.bytes.empty()) {
        a.elem_bytes = s.elem_bytes;
        a.bytes.resize(static_cast<size_t>(st.padded_elems) * s.elem_bytes);
        a.covered.assign(static_cast<size_t>(st.padded_elems), false);
      }
      if (a.elem_bytes != s.elem_bytes || a.covered.size() != static_cast<size_t>(st.padded_elems)) {
        ADD_FAILURE() << what << ": rank " << st.world_rank << "'s " << s.name
                      << " has another element size or padded length than its peers'";
        continue;
      }
      int64_t differ = 0, first = -1;
      for (int64_t i = 0; i < s.elems; ++i) {
        const size_t g = static_cast<size_t>(s.begin + i);
        const std::byte* src = s.bytes.data() + static_cast<size_t>(i) * s.elem_bytes;
        std::byte* dst = a.bytes.data() + g * s.elem_bytes;
        if (a.covered[g]) {
          if (std::memcmp(src, dst, s.elem_bytes) != 0 && differ++ == 0) first = s.begin + i;
        } else {
          std::memcpy(dst, src, s.elem_bytes);
          a.covered[g] = true;
        }
      }
      EXPECT_EQ(differ, 0) << what << ": rank " << st.world_rank << "'s " << s.name
                           << " differs from another rank's copy, first at " << st.tensor_at(first);
    }
  }
  for (const auto& [key, a] : out) {
    EXPECT_TRUE(std::all_of(a.covered.begin(), a.covered.end(), [](bool b) { return b; }))
        << what << ": the ranks' " << key.second << " do not cover the padded buffer";
  }
  return out;
}

// Same name and range: the sections compare the same bytes.
inline bool same_range(const SavedState::Section& a, const SavedState::Section& b) {
  return a.name == b.name && a.begin == b.begin && a.elems == b.elems &&
         a.elem_bytes == b.elem_bytes;
}

// Each rank's sections of `got` against the assembled sections of the other run, but those
// that `done` (the other run, already compared this way) holds over the same range.
inline void expect_sections_in(const std::vector<SavedState>& got, const AssembledState& want,
                               const std::string& what, const char* got_name,
                               const std::vector<SavedState>* done = nullptr) {
  for (size_t r = 0; r < got.size(); ++r) {
    const SavedState& st = got[r];
    for (const SavedState::Section& s : st.sections) {
      if (done != nullptr && r < done->size() &&
          std::any_of((*done)[r].sections.begin(), (*done)[r].sections.end(),
                      [&](const SavedState::Section& d) { return same_range(d, s); })) {
        continue;
      }
      const auto it = want.find({st.tp_rank, s.name});
      if (it == want.end()) {
        ADD_FAILURE() << what << ": rank " << st.world_rank << " of the " << got_name
                      << " run has a section '" << s.name << "' the other has not";
        continue;
      }
      const AssembledSection& a = it->second;
      if (a.elem_bytes != s.elem_bytes ||
          static_cast<size_t>(s.begin + s.elems) > a.covered.size()) {
        ADD_FAILURE() << what << ": rank " << st.world_rank << "'s " << s.name << " ("
                      << s.elem_bytes << "-byte elements [" << s.begin << ", "
                      << s.begin + s.elems << ")) does not fit the other run's ("
                      << a.elem_bytes << "-byte elements, " << a.covered.size() << ")";
        continue;
      }
      const std::byte* ref = a.bytes.data() + static_cast<size_t>(s.begin) * s.elem_bytes;
      if (std::memcmp(s.bytes.data(), ref, s.bytes.size()) == 0) continue;
      int64_t differ = 0, first = -1;
      for (int64_t i = 0; i < s.elems; ++i) {
        const size_t o = static_cast<size_t>(i) * s.elem_bytes;
        if (std::memcmp(s.bytes.data() + o, ref + o, s.elem_bytes) != 0 && differ++ == 0) {
          first = s.begin + i;
        }
      }
      ADD_FAILURE() << what << ": rank " << st.world_rank << "'s " << s.name << " differs in "
                    << differ << " of " << s.elems << " elements, first at "
                    << st.tensor_at(first) << " (the " << got_name << " run against the other)";
    }
  }
}

}  // namespace detail

// The whole training state of two runs, bit for bit, on every rank: step, optimizer_steps
// and the loss scaler, and every section where the other run holds the same elements (each
// run's ranks assembled, so stage 0 compares with stage 3's shards). A state that no step
// updated proves nothing: every state compared must have optimizer_steps > 0 (fp16 runs
// whose every step overflowed fail here).
inline void expect_same_state(const std::vector<SavedState>& a, const std::vector<SavedState>& b,
                              const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t r = 0; r < a.size(); ++r) {
    EXPECT_EQ(a[r].step, b[r].step) << what << ": rank " << r;
    EXPECT_EQ(a[r].optimizer_steps, b[r].optimizer_steps) << what << ": rank " << r;
    EXPECT_GT(a[r].optimizer_steps, 0) << what << ": rank " << r << " never updated";
    EXPECT_EQ(a[r].loss_scaler, b[r].loss_scaler) << what << ": rank " << r;
    std::vector<std::string> na, nb;
    for (const SavedState::Section& s : a[r].sections) na.push_back(s.name);
    for (const SavedState::Section& s : b[r].sections) nb.push_back(s.name);
    EXPECT_EQ(na, nb) << what << ": rank " << r;
  }
  detail::expect_sections_in(a, detail::assemble(b, what), what, "first");
  detail::expect_sections_in(b, detail::assemble(a, what), what, "second", &a);
}

inline void expect_same_state(const SavedState& a, const SavedState& b, const std::string& what) {
  expect_same_state(std::vector<SavedState>{a}, std::vector<SavedState>{b}, what);
}

// The message of the E that fn throws, or "(no error)".
template <typename E>
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "(no error)";
}


// The data-parallel suites' GPT (zero, zero3, optimizer offload): 2 layers, hidden 64, one
// micro-batch of 2 per rank and accumulation step, no clipping, no dropout, ZeRO `stage` with
// small buckets (so that they straddle shards and several are in flight) and overlap_comm.
inline config::Config zero_config(int world_size, int stage, int64_t gas = 1) {
  config::Config c;
  c.world_size = world_size;
  c.train_micro_batch_size_per_gpu = 2;
  c.gradient_accumulation_steps = gas;
  c.train_batch_size = 2 * gas * world_size;
  c.gradient_clipping = 0.0;
  config::OptimizerConfig opt;
  opt.lr = 3e-3;
  opt.weight_decay = 0.01;
  c.optimizer = opt;
  c.porter.model.layers = 2;
  c.porter.model.hidden = 64;
  c.porter.model.heads = 2;
  c.porter.model.seq_len = 16;
  c.porter.model.vocab = 256;
  c.porter.model.dropout = 0.0;
  c.porter.train.seed = 11;
  c.porter.comm.timeout_s = 20.0;
  c.zero_optimization.stage = stage;
  c.zero_optimization.reduce_bucket_size_elems = 20000;
  c.zero_optimization.overlap_comm = true;
  return c;
}

// The offload suites' config: zero_config with clipping, dropout, full checkpointing, one
// kernel thread and stage-3 prefetch and reuse of about one block.
inline config::Config offload_config(int world_size, int stage, int64_t gas = 1) {
  config::Config c = zero_config(world_size, stage, gas);
  c.gradient_clipping = 1.0;
  c.porter.model.dropout = 0.1;
  c.porter.train.seed = 5;
  c.porter.device.threads = 1;
  c.porter.checkpointing.policy = config::CheckpointPolicy::kFull;
  c.zero_optimization.stage3_prefetch_bucket_size_elems = 60000;
  c.zero_optimization.stage3_max_reuse_distance_elems = 60000;
  return c;
}

// Runs fn(rank, device, dp) on c.world_size thread ranks, each with its own cpu device and a
// Gloo communicator on it (with one rank: on the calling thread, dp null); rethrows the first
// rank's error.
inline void for_each_dp_rank(
    const config::Config& c,
    const std::function<void(int rank, memory::Device& device,
                             std::shared_ptr<comm::Communicator> dp)>& fn) {
  const int ws = static_cast<int>(c.world_size);
  if (ws == 1) {
    auto device = cpu_device();
    fn(0, *device, nullptr);
    return;
  }
  auto errors = comm::run_thread_ranks(ws, [&](int rank, std::shared_ptr<comm::Store> store) {
    auto device = cpu_device();
    comm::CommOptions o;
    o.timeout = comm::Seconds{c.porter.comm.timeout_s};
    fn(rank, *device, comm::make_communicator(*device, store, rank, ws, o));
  });
  for (auto& err : errors) {
    if (err) std::rethrow_exception(err);
  }
}

// One rank's results of run_dp_ranks: the shared record of the data-parallel suites.
struct DpRankRun {
  std::vector<double> losses;
  std::vector<float> params;          // params_host() after the steps
  SavedState state;                   // the whole training state after the steps
  ZeroStats total;                    // zero_stats()
  MemoryReport memory;                // memory_report() after the steps (peaks over them)
  size_t pinned_bytes = 0;            // the pinned pool's in-use bytes after the steps
  checkpoint::Prediction prediction;  // the plan's
  std::string plan;                   // the schedule, printed
  size_t current(memory::Category c) const {
    return memory.current_by_category[static_cast<size_t>(c)];
  }
  size_t peak(memory::Category c) const { return memory.peak_by_category[static_cast<size_t>(c)]; }
};

// `steps` steps of the built-in GPT on c.world_size thread ranks (for_each_dp_rank), each
// rank training on its share of the data.
inline std::vector<DpRankRun> run_dp_ranks(const config::Config& c, int steps) {
  const int ws = static_cast<int>(c.world_size);
  std::vector<DpRankRun> runs(static_cast<size_t>(ws));
  for_each_dp_rank(c, [&](int rank, memory::Device& device, std::shared_ptr<comm::Communicator> dp) {
    Engine e(device, std::make_unique<TransformerModel>(c.porter.model), c, data_parallel(dp));
    e.reset_peaks();
    DpRankRun& run = runs[static_cast<size_t>(rank)];
    const io::DataSource data(c.porter.data, c.porter.model.vocab, c.train_micro_batch_size_per_gpu,
                          c.porter.model.seq_len);
    for (int s = 0; s < steps; ++s) {
      run.losses.push_back(
          e.train_step(data.rank_batches(s, c.gradient_accumulation_steps, rank, ws)).loss);
    }
    run.memory = e.memory_report();  // before params_host(), whose buffers would count
    run.pinned_bytes = e.pinned_pool().stats().in_use_bytes;
    run.params = e.params_host();
    run.state = saved_state(e);
    run.total = e.zero_stats();
    run.prediction = e.plan().prediction;
    run.plan = e.plan().schedule.to_string();
  });
  return runs;
}

// One rank's results of run_tp_ranks: the tensor-parallel suites' record.
struct TpRankRun {
  std::vector<StepResult> steps;
  std::vector<float> first_grads;  // after step 1, this rank's layout
  std::vector<float> params;       // after the last step
  SavedState state;                // after the last step
  TensorParallelStats tp;
  MemoryReport memory;
  checkpoint::Plan plan;
};

// `steps` steps of the built-in model on c.world_size thread ranks in tp groups of
// porter.model.tensor_parallel; the tp ranks of a dp rank share its batches.
inline std::vector<TpRankRun> run_tp_ranks(const config::Config& c, int steps) {
  const int ws = static_cast<int>(c.world_size);
  const int tp = static_cast<int>(c.porter.model.tensor_parallel);
  std::vector<TpRankRun> runs(static_cast<size_t>(ws));
  auto errors = comm::run_thread_ranks(ws, [&](int rank, std::shared_ptr<comm::Store> store) {
    auto device = cpu_device();
    comm::CommOptions o;
    o.timeout = comm::Seconds{c.porter.comm.timeout_s};
    std::shared_ptr<comm::Communicator> world =
        comm::make_communicator(*device, store, rank, ws, o);
    comm::ProcessGroups g = comm::make_process_groups(world, tp);
    Engine e(*device, std::make_unique<TransformerModel>(c.porter.model, g.tp_rank), c,
             tp == 1 ? data_parallel(world) : g);
    TpRankRun& run = runs[static_cast<size_t>(rank)];
    const io::DataSource data(c.porter.data, c.porter.model.vocab, c.train_micro_batch_size_per_gpu,
                          c.porter.model.seq_len);
    for (int s = 0; s < steps; ++s) {
      run.steps.push_back(e.train_step(
          data.rank_batches(s, c.gradient_accumulation_steps, g.dp_rank, g.dp_size)));
      if (s == 0) run.first_grads = e.grads_host();
    }
    run.params = e.params_host();
    run.tp = e.tp_stats();
    run.memory = e.memory_report();
    run.plan = e.plan();
    run.state = saved_state(e);
  });
  for (auto& err : errors) {
    if (err) std::rethrow_exception(err);
  }
  return runs;
}

// Every rank's losses, final parameters (params_host()) and whole training state bit for bit.
inline void expect_bitwise_runs(const std::vector<DpRankRun>& a, const std::vector<DpRankRun>& b,
                                const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  std::vector<SavedState> sa, sb;
  for (size_t r = 0; r < a.size(); ++r) {
    EXPECT_EQ(a[r].losses, b[r].losses) << what << ": rank " << r;
    EXPECT_TRUE(bitwise_equal(a[r].params, b[r].params)) << what << ": rank " << r;
    sa.push_back(a[r].state);
    sb.push_back(b[r].state);
  }
  expect_same_state(sa, sb, what);
}

// The same for tensor-parallel runs, rank by rank.
inline void expect_bitwise_runs(const std::vector<TpRankRun>& a, const std::vector<TpRankRun>& b,
                                const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  std::vector<SavedState> sa, sb;
  for (size_t r = 0; r < a.size(); ++r) {
    ASSERT_EQ(a[r].steps.size(), b[r].steps.size()) << what;
    for (size_t s = 0; s < a[r].steps.size(); ++s) {
      EXPECT_EQ(a[r].steps[s].loss, b[r].steps[s].loss) << what << ": rank " << r << " step " << s;
    }
    EXPECT_TRUE(bitwise_equal(a[r].params, b[r].params)) << what << ": rank " << r;
    sa.push_back(a[r].state);
    sb.push_back(b[r].state);
  }
  expect_same_state(sa, sb, what);
}

// One rank's 4 straight steps of c: their losses and the state after them.
struct StraightRun {
  std::vector<double> losses;
  SavedState state;
};

// One rank: 4 straight steps of c, and a training checkpoint of c written to `dir` after its
// first 2 steps (in another engine).
inline StraightRun straight_and_checkpoint(const config::Config& c,
                                           const std::filesystem::path& dir) {
  StraightRun straight;
  {
    auto device = cpu_device();
    auto e = gpt_engine(*device, c);
    for (int s = 0; s < 4; ++s) straight.losses.push_back(e->train_step(batches(c, s)).loss);
    straight.state = saved_state(*e);
  }
  auto device = cpu_device();
  auto e = gpt_engine(*device, c);
  for (int s = 0; s < 2; ++s) e->train_step(batches(c, s));
  e->save_checkpoint(dir);
  return straight;
}

// Loads `dir` into an engine of r and expects its steps 2 and 3, and the whole state after
// them, to be straight's.
inline void expect_resumes(const config::Config& r, const std::filesystem::path& dir,
                           const StraightRun& straight, const std::string& what) {
  auto device = cpu_device();
  auto e = gpt_engine(*device, r);
  e->load_checkpoint(dir);
  EXPECT_EQ(e->train_step(batches(r, 2)).loss, straight.losses.at(2)) << what;
  EXPECT_EQ(e->train_step(batches(r, 3)).loss, straight.losses.at(3)) << what;
  expect_same_state(saved_state(*e), straight.state, what);
}

// How a BombModel's armed stage fails.
enum class Bomb {
  kBackward,     // its backward throws
  kForward,      // its forward throws
  kInfinities,   // its backward returns a dx of infinities (inf/nan gradients below it)
};

// Wraps a TransformerModel layer: when armed, it fails as `how` says.
class BombLayer : public nn::Layer {
 public:
  BombLayer(nn::Layer& inner, std::function<bool()> armed, Bomb how)
      : inner_(inner), armed_(std::move(armed)), how_(how) {}
  std::vector<nn::ParamSpec> params() const override { return inner_.params(); }
  void bind(std::span<const tensor::Tensor> p, std::span<const tensor::Tensor> g) override {
    inner_.bind(p, g);
  }
  tensor::Tensor forward(nn::Ctx& ctx, const tensor::Tensor& x) override {
    if (how_ == Bomb::kForward && armed_()) throw std::runtime_error("bomb: injected failure in forward");
    return inner_.forward(ctx, x);
  }
  tensor::Tensor backward(nn::Ctx& ctx, const tensor::Tensor& dy) override {
    if (how_ == Bomb::kBackward && armed_()) {
      throw std::runtime_error("bomb: injected failure in backward");
    }
    tensor::Tensor dx = inner_.backward(ctx, dy);
    if (how_ == Bomb::kInfinities && armed_()) ctx.kernels().fill(dx, INFINITY);
    return dx;
  }

 private:
  nn::Layer& inner_;
  std::function<bool()> armed_;
  Bomb how_;
};

// The GPT with stage `bomb_stage` wrapped in a BombLayer.
class BombModel : public Model {
 public:
  BombModel(const config::ModelConfig& c, int bomb_stage, std::function<bool()> armed,
            Bomb how = Bomb::kBackward)
      : inner_(c) {
    for (int i = 0; i < inner_.num_stages(); ++i) {
      layers_.push_back(std::make_unique<BombLayer>(
          inner_.stage(i), i == bomb_stage ? armed : [] { return false; }, how));
    }
  }
  int num_stages() const override { return inner_.num_stages(); }
  nn::Layer& stage(int i) override { return *layers_.at(static_cast<size_t>(i)); }
  std::string stage_name(int i) const override { return inner_.stage_name(i); }
  bool is_block(int i) const override { return inner_.is_block(i); }
  const nn::ParamLayout& layout() const override { return inner_.layout(); }
  void bind(const nn::FlatParams& flat) override { inner_.bind(flat); }
  std::vector<float> init_values(uint64_t seed) const override { return inner_.init_values(seed); }
  void set_targets(const tensor::Tensor& t) override { inner_.set_targets(t); }
  void set_loss_scale(float s) override { inner_.set_loss_scale(s); }
  std::vector<int> grad_writers(int i) const override { return inner_.grad_writers(i); }

 private:
  TransformerModel inner_;
  std::vector<std::unique_ptr<BombLayer>> layers_;
};

}  // namespace porter::engine::testing
