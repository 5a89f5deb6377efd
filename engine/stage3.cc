// ZeRO stage 3's gather units and driver (stage3.h).
#include "engine/stage3.h"

#include <algorithm>

#include "zero/bucket_model.h"
#include "zero/buckets.h"

namespace porter::engine {

Stage3Layout stage3_layout(Model& model, const Stage3Options& stage3, tensor::DType dtype) {
  const int n = model.num_stages();
  std::vector<zero::StageParams> stages;
  for (int s = 0; s < n; ++s) stages.push_back({model.stage_name(s), model.stage(s).params()});
  const zero::StageLayout sl = zero::stage_layout(model.layout(), stages);
  Stage3Layout out;
  checkpoint::ParamGather& c = out.costs;
  c.enabled = true;
  c.prefetch_elems = stage3.prefetch_elems;
  c.max_live_elems = stage3.max_live_elems;
  c.max_reuse_distance = stage3.max_reuse_distance_elems;
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
  return out;
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
  const zero::Partition part = zero::make_partition(model.layout().total_elems(), dp_size);
  const std::vector<zero::BucketBytes> b = zero::bucket_bytes(
      zero::plan_buckets(sl.ranges, writers, run.reduce_bucket_elems), part, run.reducer, n);
  std::vector<checkpoint::CommStage> out;
  bool any = false;
  for (const zero::BucketBytes& x : b) {
    out.push_back({x.between, x.during, x.after});
    any = any || x.during > 0 || x.after > 0;
  }
  if (!any) out.clear();
  return out;
}

void add_zero_costs(checkpoint::ChainCosts& costs, const RunOptions& run, int dp_size) {
  TransformerModel gpt(run.shape.model);  // layers and layout only; allocates nothing
  if (run.zero_stage() == 3) costs.params = stage3_layout(gpt, run.stage3, run.compute_dtype).costs;
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
