// The end-of-run summary, the --report JSON and the --dump-dir files of `porter train`.
#include "cli/train_report.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <cstdio>
#include <fstream>

#include "base/error.h"
#include "base/units.h"
#include "models/analytic.h"
#include "cli/common.h"
#include "config/parse.h"
#include "memory/category.h"
#include "io/npy.h"
#include "zero/partition.h"

namespace porter::cli {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

StepTimes step_times(const std::vector<engine::StepResult>& steps) {
  StepTimes t;
  if (steps.empty()) return t;
  std::vector<double> v;
  for (const auto& s : steps) v.push_back(s.time_s);
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  t.median_s = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  t.min_s = v.front();
  t.max_s = v.back();
  return t;
}

double tokens_per_s(const std::vector<engine::StepResult>& steps) {
  double tokens = 0, time = 0;
  for (const auto& s : steps) {
    tokens += static_cast<double>(s.tokens);
    time += s.time_s;
  }
  return time > 0 ? tokens / time : 0.0;
}

double mean_last_loss(const std::vector<engine::StepResult>& steps, size_t n) {
  const size_t k = std::min(n, steps.size());
  double sum = 0;
  for (size_t i = steps.size() - k; i < steps.size(); ++i) sum += steps[i].loss;
  return k ? sum / static_cast<double>(k) : 0.0;
}

ordered_json memory_json(const engine::MemoryReport& mem) {
  ordered_json by_cat = ordered_json::object(), cur_cat = ordered_json::object();
  for (memory::Category c : memory::kAllCategories) {
    by_cat[std::string(memory::category_name(c))] = mem.peak_by_category[memory::index_of(c)];
    cur_cat[std::string(memory::category_name(c))] = mem.current_by_category[memory::index_of(c)];
  }
  return {
      {"capacity_bytes", mem.capacity_bytes},
      {"peak_bytes", mem.peak_bytes},
      {"predicted_peak_bytes", mem.predicted_peak_bytes},
      {"peak_by_category", by_cat},
      {"current_by_category", cur_cat},
      {"model_state_bytes", mem.model_state_bytes},
      {"activation_peak_bytes", mem.peak_activation_bytes},
      {"predicted_activation_peak_bytes", mem.predicted_activation_bytes},
      {"pinned_peak_bytes", mem.peak_pinned_bytes},
      {"pinned_limit_bytes", mem.pinned_limit_bytes},
      // Offloaded model states (Note [Host-state bytes per rank]); zero without offload.
      {"host",
       {{"predicted", {{"optimizer", mem.predicted_host_state.optimizer},
                       {"grads", mem.predicted_host_state.grads},
                       {"params", mem.predicted_host_state.params},
                       {"total", mem.predicted_host_state.total()}}},
        {"measured", {{"optimizer", mem.host_state.optimizer},
                      {"grads", mem.host_state.grads},
                      {"params", mem.host_state.params},
                      {"total", mem.host_state.total()}}},
        {"pinned_in_use_bytes", mem.pinned_in_use_bytes}}},
  };
}

ordered_json zero_json(engine::Engine& engine) {
  const engine::ZeroStats z = engine.zero_stats();
  const zero::Partition part =
      zero::make_partition(engine.model().layout().total_elems(), engine.dp_size());
  // Offloaded states are on the host (docs/zero.md, "Optimizer offload", "Parameter offload");
  // stage 3's device params hold the persistent stages beside the shard ("Stage 3").
  const zero::StateDTypes dtypes = engine.run_options().state_dtypes();
  const zero::OptimizerOptions& oo = engine.run_options().optimizer;
  zero::StateBytes exact = zero::device_state_bytes(
      zero::exact_bytes(part, z.zero_stage, dtypes), part, z.zero_stage, dtypes, oo.offload.enabled,
      oo.offload.ratio, oo.param_offload.enabled);
  exact.params += z.persistent_bytes;
  return {
      {"stage", z.zero_stage},
      {"world_size", z.world_size},
      {"shard_elems", z.shard_elems},
      {"padded_elems", z.padded_elems},
      {"comm_bytes", z.comm_bytes},
      {"comm_busy_s", z.comm_busy_s},
      {"comm_exposed_s", z.comm_exposed_s},
      {"reduce_hidden_fraction", z.reduce_hidden_fraction},
      {"loss_scale", z.loss_scale},
      {"skipped_steps", z.skipped_steps},
      {"model_state_bytes", {{"params", exact.params}, {"grads", exact.grads},
                             {"optimizer", exact.optimizer}, {"total", exact.total()}}},
      // Stage 3's parameter gathers (docs/zero.md, "Stage 3"); zero below it.
      {"gathers", z.gathers},
      {"gathered_bytes", z.gathered_bytes},
      {"gather_busy_s", z.gather_busy_s},
      {"gather_exposed_s", z.gather_exposed_s},
      {"gather_hidden_fraction", z.gather_hidden_fraction},
      {"peak_live_elems", z.peak_live_elems},
      {"peak_gathered_bytes", z.peak_gathered_bytes},
      {"predicted_peak_live_elems", z.predicted_peak_live_elems},
      {"predicted_gathered_bytes", z.predicted_gathered_bytes},
      {"persistent_bytes", z.persistent_bytes},
      // Optimizer offload (Note [Optimizer offload] in zero/sharded_optimizer.h); null without.
      {"offload_optimizer",
       z.offload_host_bytes > 0
           ? ordered_json{{"d2h_bytes", z.offload_d2h_bytes},
                          {"d2h_overlapped_bytes", z.offload_d2h_overlapped_bytes},
                          {"d2h_wait_s", z.offload_d2h_wait_s},
                          {"h2d_bytes", z.offload_h2d_bytes},
                          {"cpu_update_s", z.offload_cpu_update_s},
                          {"exposed_s", z.offload_exposed_s},
                          {"host_bytes", z.offload_host_bytes},
                          {"pin_memory", engine.run_options().optimizer.offload.pin_memory}}
           : ordered_json()},
      // Parameter offload (Note [Parameter offload]); null without.
      {"offload_param",
       engine.run_options().optimizer.param_offload.enabled
           ? ordered_json{{"host_bytes", z.param_offload_host_bytes},
                          {"h2d_bytes", z.param_offload_h2d_bytes},
                          {"d2h_bytes", z.param_offload_d2h_bytes},
                          {"pin_memory", engine.run_options().optimizer.param_offload.pin_memory}}
           : ordered_json()},
  };
}

// Note [Tensor-parallel report]: the layers' collectives on the tp group and the all-gathers
// of partitioned checkpoints, cumulative over the run; this rank's.
ordered_json tensor_parallel_json(engine::Engine& engine) {
  const engine::TensorParallelStats t = engine.tp_stats();
  return {
      {"t", engine.tp_size()},
      {"sp", engine.config().porter.model.sequence_parallel && engine.tp_size() > 1},
      {"tp_rank", engine.tp_rank()},
      {"comm_bytes", t.comm_bytes},
      {"comm_busy_s", t.comm_busy_s},
      {"gathers", t.gathers},
      {"gathered_bytes", t.gathered_bytes},
      {"gather_busy_s", t.gather_busy_s},
      {"gather_exposed_s", t.gather_exposed_s},
      {"hidden_fraction", t.hidden_fraction},
      {"partitioned_bytes", t.partitioned_bytes},
      {"predicted_partitioned_bytes", t.predicted_partitioned_bytes},
      // One block kept with its input on this rank: porter's exact bytes and Korthikanti et
      // al.'s formula in their 16-bit accounting (docs/memory-model.md).
      {"layer_bytes", models::layer_bytes(engine.run_options().shape)},
      {"korthikanti_layer_bytes", models::korthikanti_layer_bytes(engine.run_options().shape)},
  };
}

ordered_json rank_json(int rank, engine::Engine& engine) {
  return {{"rank", rank},
          {"memory", memory_json(engine.memory_report())},
          {"zero", zero_json(engine)},
          {"tensor_parallel", tensor_parallel_json(engine)}};
}

ordered_json train_report(const TrainRun& run, engine::Engine& engine) {
  const engine::MemoryReport mem = engine.memory_report();
  const checkpoint::Plan& plan = engine.plan();
  const config::Config& cfg = engine.config();
  ordered_json j;
  j["config"] = run.config_file;
  j["device"] = run.device;
  j["data"] = run.data;
  j["compute_dtype"] = tensor::dtype_name(engine.compute_dtype());
  // Note [Kernel table]: porter.device.kernel_table can pin this report's choices.
  j["kernel_table"] = ordered_json::parse(engine.kernel_table().to_json().dump());
  j["num_params"] = engine.model().layout().num_params();
  j["start_step"] = run.start_step;
  j["resumed_from"] = run.resumed_from.empty() ? ordered_json() : ordered_json(run.resumed_from);
  j["restarts"] = run.restarts;
  j["stopped_by"] = run.stopped_by.empty() ? ordered_json() : ordered_json(run.stopped_by);
  {
    // Note [Background checkpoints]: the step waits only for the snapshot.
    ordered_json saves = ordered_json::array();
    for (const engine::CheckpointRecord& c : run.checkpoints) {
      saves.push_back({{"step", c.step},
                       {"path", c.path.string()},
                       {"bytes", c.bytes},
                       {"snapshot_s", c.snapshot_s},
                       {"write_s", c.write_s},
                       {"publish_s", c.publish_s}});
    }
    j["checkpoints"] = saves;
  }
  j["steps"] = run.steps.size();
  j["tokens_per_step"] = run.steps.empty() ? 0 : run.steps.front().tokens;
  ordered_json losses = ordered_json::array(), lrs = ordered_json::array(),
               norms = ordered_json::array(), times = ordered_json::array();
  for (const auto& s : run.steps) {
    losses.push_back(s.loss);
    lrs.push_back(s.lr);
    norms.push_back(s.grad_norm);
    times.push_back(s.time_s);
  }
  j["losses"] = losses;
  j["first_loss"] = run.steps.empty() ? ordered_json() : ordered_json(run.steps.front().loss);
  j["final_loss"] = run.steps.empty() ? ordered_json() : ordered_json(run.steps.back().loss);
  j["final_loss_mean_last_10"] =
      run.steps.empty() ? ordered_json() : ordered_json(mean_last_loss(run.steps));
  j["validation_data"] = run.validation_data.empty() ? ordered_json() : ordered_json(run.validation_data);
  j["validation_micro_batches"] = run.validation_micro_batches;
  ordered_json validation = ordered_json::array();
  for (const ValidationLoss& v : run.validation) validation.push_back({{"step", v.step}, {"loss", v.loss}});
  j["validation"] = std::move(validation);
  j["lrs"] = lrs;
  j["grad_norms"] = norms;
  j["step_times_s"] = times;
  j["tokens_per_s"] = tokens_per_s(run.steps);
  j["tokens_per_s_all_ranks"] = tokens_per_s(run.steps) * engine.dp_size();
  const StepTimes st = step_times(run.steps);
  j["step_time_s"] = {{"median", st.median_s}, {"min", st.min_s}, {"max", st.max_s}};
  j["wall_s"] = run.wall_s;
  // wall_clock_breakdown (Note [Wall-clock breakdown] in engine/engine.h): each step's phases
  // in milliseconds, rank 0's; null when the key is off.
  ordered_json wall_clock;
  if (!run.steps.empty() && run.steps.front().wall_clock.enabled) {
    wall_clock = ordered_json::array();
    for (const engine::StepResult& s : run.steps) {
      const engine::WallClockBreakdown& w = s.wall_clock;
      wall_clock.push_back({{"step", s.step},
                            {"forward_ms", w.forward_ms},
                            {"backward_ms", w.backward_ms()},
                            {"backward_inner_ms", w.backward_inner_ms},
                            {"reduce_ms", w.reduce_ms},
                            {"optimizer_ms", w.optimizer_ms},
                            {"recompute_ms", w.recompute_ms},
                            {"offload_wait_ms", w.offload_wait_ms},
                            {"step_ms", 1e3 * s.time_s}});
    }
  }
  j["wall_clock"] = std::move(wall_clock);

  j["memory"] = memory_json(mem);
  const bool timed = plan.prediction.offload.timed;
  ordered_json stages = ordered_json::array();
  for (const checkpoint::StagePlan& s : plan.stages) {
    size_t offloaded = 0;
    for (const checkpoint::StashEntry& e : plan.offload.entries) {
      if (e.on_host && static_cast<size_t>(e.stage) == stages.size()) {
        offloaded += plan.offload.host_bytes(e);
      }
    }
    stages.push_back({{"name", s.name}, {"action", s.action}, {"holds_input", s.holds_input},
                      {"forwards", s.forwards}, {"where", checkpoint::where_name(s.where)},
                      {"offloaded_bytes", offloaded},
                      {"exposed_copy_s", timed ? ordered_json(s.exposed_copy_s) : ordered_json()}});
  }
  double recompute_total = 0;
  for (const auto& s : run.steps) recompute_total += s.recompute_s;
  j["plan"] = {
      {"policy", config::to_string(plan.policy)},
      {"description", plan.description},
      {"budget_bytes", plan.budget_bytes ? ordered_json(*plan.budget_bytes) : ordered_json()},
      {"costs", engine.costs().source},
      {"stages", stages},
      {"predicted_recompute_s", mem.predicted_recompute_s},
      {"measured_recompute_s", mem.measured_recompute_s},
      {"measured_recompute_total_s", recompute_total},
      {"schedule", plan.schedule.to_string()},
  };
  j["offload"] = offload_report(run, engine);
  j["world_size"] = run.world_size;
  j["comm_backend"] = run.comm_backend.empty() ? ordered_json() : ordered_json(run.comm_backend);
  j["zero"] = zero_json(engine);
  j["tensor_parallel"] = tensor_parallel_json(engine);
  j["ranks"] = run.ranks;
  j["resolved_config"] = config::to_json(cfg);
  return j;
}

offload::StashStats offload_totals(const std::vector<engine::StepResult>& steps) {
  offload::StashStats t;
  for (const engine::StepResult& s : steps) t.add(s.offload);
  return t;
}

ordered_json offload_report(const TrainRun& run, engine::Engine& engine) {
  const checkpoint::Plan& plan = engine.plan();
  const checkpoint::OffloadPrediction& p = plan.prediction.offload;
  const offload::StashStats m = offload_totals(run.steps);
  const double mbs = static_cast<double>(engine.config().gradient_accumulation_steps);
  const double link = engine.link_bytes_per_s();
  auto timed = [&](double v) { return p.timed ? ordered_json(v) : ordered_json(); };
  ordered_json j;
  j["enabled"] = !plan.offload.empty();
  // Measured, summed over the run's steps (the peaks: the largest of any step).
  j["d2h_bytes"] = m.d2h_bytes;
  j["h2d_bytes"] = m.h2d_bytes;
  j["copy_busy_s"] = m.copy_busy_s;
  j["exposed_wait_s"] = m.exposed_wait_s;
  j["hidden_fraction"] = m.hidden_fraction();
  j["pinned_peak_bytes"] = m.pinned_peak_bytes;
  j["staging_peak_bytes"] = m.staging_peak_bytes;
  j["link_bytes_per_s"] = link > 0 ? ordered_json(link) : ordered_json();
  // The plan's prediction, per step (micro-batches x the simulator's micro-batch).
  j["predicted"] = {
      {"checkpoints", plan.offload.entries.size()},
      {"offloaded_bytes_per_micro_batch", plan.offload.offloaded_bytes},
      {"d2h_bytes_per_step", static_cast<size_t>(static_cast<double>(p.d2h_bytes) * mbs)},
      {"h2d_bytes_per_step", static_cast<size_t>(static_cast<double>(p.h2d_bytes) * mbs)},
      {"pinned_bytes", plan.offload.pinned_bytes},
      {"staging_peak_bytes", p.peak_staging_bytes},
      {"prefetch_depth", plan.sim.prefetch_depth},
      {"contiguous", plan.offload.contiguous},
      {"timed", p.timed},
      {"copy_busy_s_per_step", timed(p.copy_busy_s * mbs)},
      {"exposed_s_per_step", timed(p.exposed_s * mbs)},
      {"hidden_fraction", timed(p.hidden_fraction())},
  };
  // Per-checkpoint records (activation_checkpointing.profile): times in seconds from the
  // first record.
  const auto& ac = engine.config().activation_checkpointing;
  if (ac && ac->profile) {
    const std::vector<offload::CopyRecord>& copies = engine.last_copies();
    const std::vector<offload::WaitRecord>& waits = engine.last_waits();
    std::optional<offload::Clock::time_point> t0;
    for (const auto& c : copies) t0 = t0 ? std::min(*t0, c.start) : c.start;
    for (const auto& w : waits) t0 = t0 ? std::min(*t0, w.reached) : w.reached;
    auto since = [&](offload::Clock::time_point t) {
      return std::chrono::duration<double>(t - *t0).count();
    };
    ordered_json cj = ordered_json::array(), wj = ordered_json::array();
    for (const auto& c : copies) {
      cj.push_back({{"direction", c.direction == offload::CopyRecord::Direction::kD2H ? "d2h" : "h2d"},
                    {"stage", c.stage}, {"micro_batch", c.micro_batch}, {"bytes", c.bytes},
                    {"start_s", since(c.start)}, {"seconds", c.seconds()}});
    }
    for (const auto& w : waits) {
      wj.push_back({{"stage", w.stage}, {"micro_batch", w.micro_batch},
                    {"reached_s", since(w.reached)}, {"exposed_s", w.exposed_s}});
    }
    j["copies"] = std::move(cj);
    j["waits"] = std::move(wj);
  }
  return j;
}

void print_summary(const TrainRun& run, engine::Engine& engine, std::ostream& out) {
  const engine::MemoryReport mem = engine.memory_report();
  const StepTimes st = step_times(run.steps);
  char buf[256];
  out << "\nsummary\n";
  Table t({"", ""});
  t.add({"steps", std::to_string(run.steps.size()) +
                      (run.start_step ? " (from step " + std::to_string(run.start_step) + ")" : "")});
  if (!run.steps.empty()) {
    std::snprintf(buf, sizeof buf, "%.4f -> %.4f", run.steps.front().loss, run.steps.back().loss);
    t.add({"loss (first -> final)", buf});
    std::snprintf(buf, sizeof buf, "%.4f", mean_last_loss(run.steps));
    t.add({"loss (mean of the last " + std::to_string(std::min<size_t>(10, run.steps.size())) +
               " steps)",
           buf});
  }
  if (!run.validation.empty()) {
    const ValidationLoss& v = run.validation.back();
    std::snprintf(buf, sizeof buf, "%.4f", v.loss);
    t.add({"val loss (step " + std::to_string(v.step) + ")", buf});
  }
  t.add({"step time (median, min, max)", format_seconds(st.median_s) + ", " +
                                             format_seconds(st.min_s) + ", " + format_seconds(st.max_s)});
  t.add({"tokens/s", format_count(tokens_per_s(run.steps))});
  if (run.world_size > 1) {
    // Every data-parallel rank trains as many tokens per step, in lockstep.
    t.add({"tokens/s (" + std::to_string(engine.dp_size()) + " data-parallel ranks)",
           format_count(tokens_per_s(run.steps) * engine.dp_size())});
  }
  std::snprintf(buf, sizeof buf, "%.1f s", run.wall_s);
  t.add({"wall time", buf});
  t.print(out);

  if (run.ranks.size() > 1) {
    // One peak column per rank (Note [Per-rank report]).
    out << "\nmemory per rank: " << run.device << "\n";
    std::vector<std::string> header = {"category"};
    for (const ordered_json& r : run.ranks) header.push_back("rank " + r["rank"].dump());
    Table m(header);
    auto row = [&](const std::string& label, const auto& get) {
      std::vector<std::string> cells = {label};
      for (const ordered_json& r : run.ranks) cells.push_back(format_bytes(get(r["memory"])));
      m.add(cells);
    };
    // Partitioned checkpoints: the checkpoints row holds each rank's 1/t share of them.
    const int ways = engine.plan().offload.ways;
    const bool partitioned = engine.plan().offload.any_partitioned();
    for (memory::Category c : memory::kAllCategories) {
      const std::string name(memory::category_name(c));
      const std::string label =
          c == memory::Category::kCheckpoints && partitioned
              ? name + " (partitioned: a 1/" + std::to_string(ways) + " share each)"
              : name;
      row(label, [&](const ordered_json& mj) { return mj["peak_by_category"][name].get<uint64_t>(); });
    }
    row("all (peak of the sum)", [](const ordered_json& mj) { return mj["peak_bytes"].get<uint64_t>(); });
    m.print(out);
  } else {
    out << "\nmemory: " << run.device << "\n";
    Table m({"category", "peak"});
    for (memory::Category c : memory::kAllCategories) {
      m.add({std::string(memory::category_name(c)), format_bytes(mem.peak_by_category[memory::index_of(c)])});
    }
    m.add({"all (peak of the sum)", format_bytes(mem.peak_bytes)});
    m.print(out);
  }
  if (mem.host_state.total() > 0 || mem.predicted_host_state.total() > 0) {
    // The offloaded model states in host memory, this rank's (Note [Host-state bytes per rank]).
    out << "\nhost memory (model states, rank 0's): pinned in use "
        << format_bytes(mem.pinned_in_use_bytes) << " of " << format_bytes(mem.pinned_limit_bytes)
        << " (porter.device.pinned_limit), checkpoint stash included\n";
    Table h({"category", "predicted", "measured"});
    auto add = [&](const char* name, size_t predicted, size_t measured) {
      h.add({name, format_bytes(predicted), format_bytes(measured)});
    };
    add("optimizer (master, moments)", mem.predicted_host_state.optimizer, mem.host_state.optimizer);
    add("gradient shard", mem.predicted_host_state.grads, mem.host_state.grads);
    add("params (shard / working copy)", mem.predicted_host_state.params, mem.host_state.params);
    add("total", mem.predicted_host_state.total(), mem.host_state.total());
    h.print(out);
  }

  const engine::ZeroStats z = engine.zero_stats();
  if (z.world_size > 1 || z.zero_stage > 0) {
    const double n = static_cast<double>(std::max<size_t>(1, run.steps.size()));
    std::snprintf(buf, sizeof buf, "%.1f%%", 100.0 * z.reduce_hidden_fraction);
    out << "\nzero: stage " << z.zero_stage << " over " << z.world_size << " rank"
        << (z.world_size == 1 ? "" : "s")
        << (run.comm_backend.empty() ? std::string() : " (" + run.comm_backend + ")")
        << ", shard " << format_count(static_cast<double>(z.shard_elems)) << " of "
        << format_count(static_cast<double>(z.padded_elems)) << " elements; comm "
        << format_bytes(static_cast<uint64_t>(static_cast<double>(z.comm_bytes) / n))
        << " per step, " << format_seconds(z.comm_busy_s / n) << " busy, "
        << format_seconds(z.comm_exposed_s / n) << " exposed per step; gradient reductions "
        << buf << " hidden behind backward";
    if (z.skipped_steps > 0 || z.loss_scale != 1.0) {
      std::snprintf(buf, sizeof buf, "%g", z.loss_scale);
      out << "; loss scale " << buf << ", " << z.skipped_steps << " skipped step"
          << (z.skipped_steps == 1 ? "" : "s");
    }
    out << " (rank 0's)\n";
    if (z.offload_host_bytes > 0) {
      char queued[16];
      std::snprintf(queued, sizeof queued, "%.0f",
                    z.offload_d2h_bytes > 0 ? 100.0 * static_cast<double>(z.offload_d2h_overlapped_bytes) /
                                                  static_cast<double>(z.offload_d2h_bytes)
                                            : 0.0);
      out << "  optimizer offload: " << format_bytes(z.offload_host_bytes) << " on the host ("
          << (engine.run_options().optimizer.offload.pin_memory ? "pinned" : "pageable")
          << "); " << format_bytes(static_cast<uint64_t>(static_cast<double>(z.offload_d2h_bytes) / n))
          << " of gradients down (" << queued << "% queued during backward, "
          << format_seconds(z.offload_d2h_wait_s / n) << " waited) and "
          << format_bytes(static_cast<uint64_t>(static_cast<double>(z.offload_h2d_bytes) / n))
          << " of parameters up per step; host AdamW " << format_seconds(z.offload_cpu_update_s / n)
          << ", " << format_seconds(z.offload_exposed_s / n) << " exposed per step\n";
    }
    if (engine.run_options().optimizer.param_offload.enabled) {
      out << "  parameter offload: the shard, " << format_bytes(z.param_offload_host_bytes)
          << ", on the host ("
          << (engine.run_options().optimizer.param_offload.pin_memory ? "pinned" : "pageable")
          << "); "
          << format_bytes(static_cast<uint64_t>(static_cast<double>(z.param_offload_h2d_bytes) / n))
          << " uploaded for the gathers";
      if (z.param_offload_d2h_bytes > 0) {
        out << " and "
            << format_bytes(static_cast<uint64_t>(static_cast<double>(z.param_offload_d2h_bytes) / n))
            << " of updated shard down";
      }
      out << " per step\n";
    }
    if (z.zero_stage == 3) {
      std::snprintf(buf, sizeof buf, "%.1f%%", 100.0 * z.gather_hidden_fraction);
      out << "  parameter gathers: "
          << format_count(static_cast<double>(z.gathers) / n) << " per step, "
          << format_bytes(static_cast<uint64_t>(static_cast<double>(z.gathered_bytes) / n))
          << " received, " << format_seconds(z.gather_busy_s / n) << " busy, "
          << format_seconds(z.gather_exposed_s / n) << " exposed per step (" << buf
          << " hidden); live at most " << format_count(static_cast<double>(z.peak_live_elems))
          << " elements, " << format_bytes(z.peak_gathered_bytes) << " (predicted "
          << format_bytes(z.predicted_gathered_bytes) << "); persistent "
          << format_bytes(z.persistent_bytes) << "\n";
    }
  }

  if (engine.tp_size() > 1) {
    const engine::TensorParallelStats tps = engine.tp_stats();
    const double n = static_cast<double>(std::max<size_t>(1, run.steps.size()));
    out << "\ntensor parallel: " << engine.tp_size() << " ranks"
        << (engine.config().porter.model.sequence_parallel ? ", sequence-parallel" : "")
        << "; a block's activations "
        << format_bytes(models::layer_bytes(engine.run_options().shape))
        << " per rank (Korthikanti's formula: "
        << format_bytes(static_cast<uint64_t>(
               models::korthikanti_layer_bytes(engine.run_options().shape)))
        << ")"
        << "; comm " << format_bytes(static_cast<uint64_t>(static_cast<double>(tps.comm_bytes) / n))
        << " per step, " << format_seconds(tps.comm_busy_s / n) << " busy";
    if (tps.gathers > 0) {
      std::snprintf(buf, sizeof buf, "%.1f%%", 100.0 * tps.hidden_fraction);
      out << "; partitioned checkpoints: " << format_bytes(tps.partitioned_bytes)
          << " of slices held at most (predicted " << format_bytes(tps.predicted_partitioned_bytes)
          << "), "
          << format_bytes(static_cast<uint64_t>(static_cast<double>(tps.gathered_bytes) / n))
          << " gathered per step, " << format_seconds(tps.gather_busy_s / n) << " busy, "
          << format_seconds(tps.gather_exposed_s / n) << " exposed, " << buf
          << " hidden behind recompute";
    }
    out << " (rank 0's)\n";
  }

  const checkpoint::Plan& plan = engine.plan();
  // Partitioned holds that stay on the device are in the plan's layout too; the offload line
  // is about the host.
  const bool host_holds =
      std::any_of(plan.offload.entries.begin(), plan.offload.entries.end(),
                  [](const checkpoint::StashEntry& e) { return e.on_host; });
  if (host_holds) {
    const offload::StashStats o = offload_totals(run.steps);
    const double n = static_cast<double>(std::max<size_t>(1, run.steps.size()));
    std::snprintf(buf, sizeof buf, "%.1f%%", 100.0 * o.hidden_fraction());
    out << "\noffload: " << format_bytes(static_cast<uint64_t>(static_cast<double>(o.d2h_bytes) / n))
        << " to the host and " << format_bytes(static_cast<uint64_t>(static_cast<double>(o.h2d_bytes) / n))
        << " back per step; copies " << format_seconds(o.copy_busy_s / n) << " per step, "
        << format_seconds(o.exposed_wait_s / n) << " exposed (" << buf << " hidden); pinned peak "
        << format_bytes(o.pinned_peak_bytes) << "; link ";
    const double link = engine.link_bytes_per_s();
    out << (link > 0 ? format_bytes(static_cast<uint64_t>(link)) + "/s" : std::string("unknown"))
        << "\n";
  }

  out << "\npredicted vs measured (" << engine.plan().description << ")\n";
  Table p({"", "predicted", "measured"});
  p.add({"activation peak", format_bytes(mem.predicted_activation_bytes),
         format_bytes(mem.peak_activation_bytes)});
  p.add({"total peak", format_bytes(mem.predicted_peak_bytes), format_bytes(mem.peak_bytes)});
  p.add({"recompute per step",
         engine.costs().has_times() ? format_seconds(mem.predicted_recompute_s) : "(analytic: no times)",
         format_seconds(mem.measured_recompute_s)});
  p.print(out);
}

void write_dump(const fs::path& dir, engine::Engine& engine, const std::vector<float>& params,
                const engine::StepResult& step) {
  std::error_code ec;
  for (const char* sub : {"params", "grads", "batch"}) {
    fs::create_directories(dir / sub, ec);
    if (ec) throw IoError("--dump-dir: cannot create \"" + (dir / sub).string() + "\": " + ec.message());
  }
  const std::vector<float> grads = engine.grads_host();
  const nn::ParamLayout& layout = engine.model().layout();
  ordered_json tensors = ordered_json::array();
  for (const nn::ParamEntry& e : layout.entries()) {
    const std::vector<int64_t> shape = e.shape.to_vector();
    const int64_t numel = e.shape.numel();
    const size_t end = static_cast<size_t>(e.offset_elems + numel);
    if (end > params.size() || end > grads.size()) {
      throw InternalError("--dump-dir: parameter " + e.name + " lies outside the flat buffers");
    }
    io::write_npy((dir / "params" / (e.name + ".npy")).string(), params.data() + e.offset_elems,
                  tensor::DType::kF32, shape);
    io::write_npy((dir / "grads" / (e.name + ".npy")).string(), grads.data() + e.offset_elems,
                  tensor::DType::kF32, shape);
    tensors.push_back({{"name", e.name}, {"shape", shape},
                       {"param", "params/" + e.name + ".npy"}, {"grad", "grads/" + e.name + ".npy"}});
  }
  ordered_json batches = ordered_json::array();
  const auto& mbs = engine.last_batches();
  for (size_t m = 0; m < mbs.size(); ++m) {
    const io::HostBatch& b = mbs[m];
    const std::vector<int64_t> shape = {b.batch, b.seq};
    const std::string tok = "batch/tokens_" + std::to_string(m) + ".npy";
    const std::string tgt = "batch/targets_" + std::to_string(m) + ".npy";
    io::write_npy((dir / tok).string(), b.tokens.data(), tensor::DType::kI32, shape);
    io::write_npy((dir / tgt).string(), b.targets.data(), tensor::DType::kI32, shape);
    batches.push_back({{"tokens", tok}, {"targets", tgt}, {"shape", shape}});
  }
  const config::Config& cfg = engine.config();
  ordered_json manifest;
  manifest["format"] = "porter-dump/1";
  manifest["step"] = step.step - 1;  // 0-based index of the dumped step
  manifest["steps_done_after"] = step.step;
  manifest["dtype"] = "float32";
  manifest["compute_dtype"] = tensor::dtype_name(engine.compute_dtype());
  manifest["loss"] = step.loss;
  manifest["grad_norm"] = step.grad_norm;
  manifest["clip_coef"] = step.clip_coef;
  manifest["lr"] = step.lr;
  manifest["micro_batches"] = mbs.size();
  manifest["grad_scale"] = "gradient of the mean loss over the micro-batches, before clipping";
  manifest["names"] = ordered_json::array();
  for (const nn::ParamEntry& e : layout.entries()) manifest["names"].push_back(e.name);
  manifest["tensors"] = tensors;
  manifest["batches"] = batches;
  manifest["model"] = config::to_json(cfg)["porter"]["model"];
  manifest["config"] = config::to_json(cfg);
  const fs::path path = dir / "manifest.json";
  std::ofstream out(path);
  out << manifest.dump(2) << "\n";
  if (!out) throw IoError("--dump-dir: cannot write \"" + path.string() + "\"");
}

}  // namespace porter::cli
