// ZeRO stage 3's gather units and driver (stage3.h).
#include "engine/stage3.h"

#include <algorithm>
#include <string>

#include "base/units.h"
#include "engine/engine.h"
#include "zero/bucket_model.h"
#include "zero/buckets.h"
#include "zero/partition.h"

namespace porter::engine {

namespace {

constexpr int64_t kDeepSpeedMaxLive = 1'000'000'000;

// L of Note [Stage 3 sizing]: the most non-persistent elements one stage reads.
int64_t largest_read_elems(const checkpoint::ParamGather& g) {
  int64_t best = 0;
  for (const std::vector<int>& reads : g.reads) {
    int64_t elems = 0;
    std::vector<int> seen;
    for (int u : reads) {
      if (u < 0 || u >= static_cast<int>(g.units.size())) continue;  // plan_gathers names it
      const checkpoint::GatherUnit& unit = g.units[static_cast<size_t>(u)];
      if (unit.persistent || std::find(seen.begin(), seen.end(), u) != seen.end()) continue;
      seen.push_back(u);
      elems += unit.elems;
    }
    best = std::max(best, elems);
  }
  return best;
}

bool all_given(const Stage3Options& s) {
  return s.prefetch_given && s.max_live_given && s.max_reuse_distance_given;
}

}  // namespace

void size_stage3(Stage3Options& s, const checkpoint::ParamGather& gather, int64_t padded_elems) {
  if (all_given(s)) return;
  const int64_t largest = largest_read_elems(gather);
  int64_t persistent = 0;
  for (const checkpoint::GatherUnit& u : gather.units) persistent += u.persistent ? u.elems : 0;
  const int64_t shard = s.shard_on_host ? 0 : padded_elems / std::max(1, s.dp_size);
  const int64_t room = padded_elems - shard - persistent;
  if (!s.max_reuse_distance_given) s.max_reuse_distance_elems = 0;
  if (!s.prefetch_given) {
    const bool two_fit = s.max_live_given ? s.max_live_elems >= 2 * largest : 2 * largest < room;
    s.prefetch_elems = two_fit ? largest : 0;
  }
  if (!s.max_live_given) {
    s.max_live_elems = s.max_reuse_distance_given ? kDeepSpeedMaxLive : largest + s.prefetch_elems;
  }
}

Stage3Layout stage3_layout(Model& model, const Stage3Options& stage3, tensor::DType dtype) {
  const int n = model.num_stages();
  std::vector<zero::StageParams> stages;
  for (int s = 0; s < n; ++s) stages.push_back({model.stage_name(s), model.stage(s).params()});
  const zero::StageLayout sl = zero::stage_layout(model.layout(), stages);
  Stage3Layout out;
  checkpoint::ParamGather& c = out.costs;
  c.enabled = true;
  c.reads.assign(static_cast<size_t>(n), {});
  for (int s = 0; s < n; ++s) {
    const zero::StageRange& r = sl.ranges[static_cast<size_t>(s)];
    zero::ParamUnit u;
    u.name = model.stage_name(s);
    u.lo = r.lo;
    u.hi = r.hi;
    for (size_t i = 0; i < sl.entry_stage.size(); ++i)
      if (sl.entry_stage[i] == s) u.entries.push_back(i);
    u.persistent = u.elems() > 0 && u.elems() < stage3.persistence_threshold_elems;
    c.units.push_back({u.name, u.elems(), static_cast<size_t>(u.elems()) * tensor::dtype_size(dtype),
                       u.persistent});
    out.units.push_back(std::move(u));
    c.reads[static_cast<size_t>(s)].push_back(s);
  }
  for (int t = 0; t < n; ++t) {
    for (int w : model.grad_writers(t)) {
      if (w == t || w < 0 || w >= n) continue;
      std::vector<int>& r = c.reads[static_cast<size_t>(w)];
      if (std::find(r.begin(), r.end(), t) == r.end()) r.push_back(t);
    }
  }
  // Note [Stage 3 sizing]: the knobs not given, for these units.
  Stage3Options knobs = stage3;
  size_stage3(knobs, c, zero::make_partition(model.layout().total_elems(), std::max(1, stage3.dp_size)).padded_elems);
  c.prefetch_elems = knobs.prefetch_elems;
  c.max_live_elems = knobs.max_live_elems;
  c.max_reuse_distance = knobs.max_reuse_distance_elems;
  return out;
}

std::string Stage3Report::line() const {
  auto knob = [](int64_t v, bool given) {
    return std::to_string(v) + (given ? " (config)" : " (sized by porter)");
  };
  return "stage 3 gathers: prefetch " + knob(knobs.prefetch_elems, knobs.prefetch_given) +
         ", max live " + knob(knobs.max_live_elems, knobs.max_live_given) +
         ", max reuse distance " + knob(knobs.max_reuse_distance_elems, knobs.max_reuse_distance_given) +
         " elements; parameters per rank at peak " + format_bytes(stage3_params_bytes) +
         " (stage 2: " + format_bytes(stage2_params_bytes) + ")";
}

std::optional<Stage3Report> stage3_report(Model& model, const RunOptions& run,
                                          const checkpoint::Schedule& schedule) {
  if (run.zero_stage() != 3) return std::nullopt;
  const Stage3Layout layout = stage3_layout(model, run.stage3, run.compute_dtype);
  const checkpoint::ParamGather& g = layout.costs;
  Stage3Report r;
  r.knobs = run.stage3;
  r.knobs.prefetch_elems = g.prefetch_elems;
  r.knobs.max_live_elems = g.max_live_elems;
  r.knobs.max_reuse_distance_elems = g.max_reuse_distance;
  r.largest_read_elems = largest_read_elems(g);
  const checkpoint::GatherPlan plan = checkpoint::plan_gathers(schedule, g);
  r.peak_live_elems = plan.peak_live_elems;
  const int dp = std::max(1, run.stage3.dp_size);
  const zero::Partition part = zero::make_partition(model.layout().total_elems(), dp);
  const size_t p = tensor::dtype_size(run.compute_dtype);
  r.stage2_params_bytes = p * static_cast<size_t>(part.padded_elems);
  r.stage3_params_bytes = (run.stage3.shard_on_host ? 0 : p * static_cast<size_t>(part.shard_elems)) +
                          g.persistent_bytes() + plan.peak_live_bytes;
  const bool any_given = run.stage3.prefetch_given || run.stage3.max_live_given ||
                         run.stage3.max_reuse_distance_given;
  if (r.stage3_params_bytes <= r.stage2_params_bytes || (dp == 1 && !any_given)) return r;
  const std::string figures = "ZeRO stage 3 holds " + format_bytes(r.stage3_params_bytes) +
                              " of parameters per rank at peak, more than stage 2's " +
                              format_bytes(r.stage2_params_bytes) + " at " + std::to_string(dp) +
                              " data-parallel rank" + (dp == 1 ? "" : "s");
  std::string given;
  auto add = [&](bool is_given, const char* key, int64_t v) {
    if (!is_given) return;
    given += (given.empty() ? "" : ", ") + std::string(key) + " " + std::to_string(v);
  };
  add(run.stage3.prefetch_given, "stage3_prefetch_bucket_size", r.knobs.prefetch_elems);
  add(run.stage3.max_live_given, "stage3_max_live_parameters", r.knobs.max_live_elems);
  add(run.stage3.max_reuse_distance_given, "stage3_max_reuse_distance", r.knobs.max_reuse_distance_elems);
  if (dp == 1) {
    r.warning = figures + ": at one rank the shard is every parameter, so stage 3 cannot hold "
                "less; use stage 2, or more data-parallel ranks";
  } else if (!given.empty()) {
    r.warning = figures + " (gathered at once: " + format_bytes(plan.peak_live_bytes) +
                "), with zero_optimization." + given +
                " as the config sets them; leave them out and porter sizes them to hold less "
                "(docs/zero.md, Stage 3)";
  } else {
    r.warning = figures + ": the persistent stages (zero_optimization."
                "stage3_param_persistence_threshold " +
                std::to_string(run.stage3.persistence_threshold_elems) + ") hold " +
                format_bytes(g.persistent_bytes()) + " and the largest stage needs " +
                format_bytes(p * static_cast<size_t>(r.largest_read_elems)) +
                " gathered; lower the threshold or use more data-parallel ranks";
  }
  return r;
}

std::optional<Stage3Report> stage3_report(const RunOptions& run, const checkpoint::Schedule& schedule) {
  if (run.zero_stage() != 3) return std::nullopt;
  TransformerModel gpt(run.shape.model);  // layers and layout only; allocates nothing
  return stage3_report(gpt, run, schedule);
}

std::optional<Stage3Report> stage3_report(Engine& engine) {
  RunOptions run = engine.run_options();
  if (run.zero_stage() != 3) return std::nullopt;
  run.stage3.dp_size = engine.dp_size();
  return stage3_report(engine.model(), run, engine.plan().schedule);
}

void add_stage3_params(checkpoint::ChainCosts& costs, const RunOptions& run) {
  if (run.zero_stage() != 3) return;
  TransformerModel gpt(run.shape.model);  // layers and layout only; allocates nothing
  costs.params = stage3_layout(gpt, run.stage3, run.compute_dtype).costs;
}

std::vector<checkpoint::CommStage> bucket_costs(Model& model, const RunOptions& run, int dp_size) {
  const int n = model.num_stages();
  std::vector<zero::StageParams> stages;
  std::vector<std::vector<int>> writers;
  for (int s = 0; s < n; ++s) {
    stages.push_back({model.stage_name(s), model.stage(s).params()});
    writers.push_back(model.grad_writers(s));
  }
  const zero::StageLayout sl = zero::stage_layout(model.layout(), stages);
  return bucket_costs(zero::plan_buckets(sl.ranges, writers, run.reduce_bucket_elems),
                      zero::make_partition(model.layout().total_elems(), dp_size), run, n);
}

std::vector<checkpoint::CommStage> bucket_costs(const std::vector<zero::Bucket>& buckets,
                                                const zero::Partition& part,
                                                const RunOptions& run, int num_stages) {
  std::vector<checkpoint::CommStage> out;
  bool any = false;
  for (const zero::BucketBytes& x : zero::bucket_bytes(buckets, part, run.reducer, num_stages)) {
    out.push_back({x.between, x.during, x.after});
    any = any || x.during > 0 || x.after > 0;
  }
  if (!any) out.clear();
  return out;
}

void add_zero_costs(checkpoint::ChainCosts& costs, const RunOptions& run, int dp_size) {
  TransformerModel gpt(run.shape.model);  // layers and layout only; allocates nothing
  if (run.zero_stage() == 3) {
    Stage3Options stage3 = run.stage3;
    stage3.dp_size = dp_size;  // the knobs not given are sized for these ranks
    costs.params = stage3_layout(gpt, stage3, run.compute_dtype).costs;
  }
  costs.comm = bucket_costs(gpt, run, dp_size);
}

checkpoint::Schedule forward_schedule(int num_stages) {
  checkpoint::Schedule s;
  s.num_stages = num_stages;
  for (int i = 0; i < num_stages; ++i) {
    s.ops.push_back(checkpoint::ScheduleOp::forward(i, checkpoint::SaveOption::kCheckpoint, false));
  }
  return s;
}

void Stage3Driver::before_op(size_t k) const {
  if (gatherer_ == nullptr) return;
  for (int u : plan_.evict[k]) gatherer_->release(u);
  for (int u : plan_.issue[k]) gatherer_->gather(u);
  for (int u : plan_.wait[k]) gatherer_->wait(u);
}

void Stage3Driver::after_op(size_t k) const {
  if (gatherer_ == nullptr) return;
  for (int u : plan_.release[k]) gatherer_->release(u);
}

}  // namespace porter::engine
