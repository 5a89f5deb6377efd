// The Engine's memory report: measured peaks per category against the plan's prediction,
// and its table for the terminal (docs/engine.md, "Reports").
#include <algorithm>
#include <iomanip>
#include <sstream>

#include "base/units.h"
#include "engine/engine.h"
#include "engine/engine_impl.h"

namespace porter::engine {

MemoryReport Engine::memory_report() const {
  const Impl& im = *impl_;
  const memory::MemoryStats s = allocator_->stats();
  MemoryReport r;
  r.capacity_bytes = s.capacity_bytes;
  r.peak_bytes = std::max(im.peak_requested_bytes, s.peak_requested_bytes);
  for (size_t c = 0; c < memory::kNumCategories; ++c) {
    r.peak_by_category[c] = std::max(im.peak_by_category[c], s.by_category[c].peak_bytes);
    r.current_by_category[c] = s.by_category[c].current_bytes;
  }
  r.peak_activation_bytes = std::max(im.peak_activation_bytes, s.peak_activation_bytes);
  r.predicted_activation_bytes = im.plan.prediction.peak_activation_bytes;
  r.model_state_bytes = s[memory::Category::kParams].current_bytes +
                        s[memory::Category::kGrads].current_bytes +
                        s[memory::Category::kOptimizer].current_bytes;
  r.predicted_peak_bytes = run_.predicted_peak_bytes(r.model_state_bytes, im.plan.prediction);
  r.predicted_recompute_s =
      im.plan.prediction.recompute_s * static_cast<double>(run_.gradient_accumulation_steps);
  r.peak_pinned_bytes = im.offload_total.pinned_peak_bytes;
  r.pinned_limit_bytes = im.pinned->stats().limit_bytes;
  r.predicted_pinned_bytes = im.plan.offload.pinned_bytes;
  r.offloaded_bytes = im.plan.offload.offloaded_bytes;
  r.offload = im.offload_total;
  // Note [Host-state bytes per rank]: measured is what the optimizer's host arrays hold, the
  // pinned pool's blocks (PinnedPool::block_bytes: a reused cached block can exceed the
  // rounded request the prediction counts) and pageable arrays at their size.
  r.host_state = im.optimizer->host_state();
  const zero::OptimizerOptions& o = run_.optimizer;
  if (o.offload.enabled || o.param_offload.enabled) {
    r.predicted_host_state = zero::host_state_bytes(
        im.part, o.zero_stage, run_.state_dtypes(), o.offload.enabled,
        o.param_offload.enabled, o.offload.pin_memory, o.param_offload.pin_memory, o.offload.ratio);
  }
  r.pinned_in_use_bytes = im.pinned->stats().in_use_bytes;
  if (!im.recompute_s_per_step.empty()) {
    std::vector<double> v = im.recompute_s_per_step;
    std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
    r.measured_recompute_s = v[v.size() / 2];
  }
  return r;
}

std::string MemoryReport::format() const {
  std::ostringstream o;
  auto row = [&](std::string_view name, const std::string& a, const std::string& b) {
    o << "  " << std::left << std::setw(22) << name << std::right << std::setw(12) << a
      << std::setw(14) << b << "\n";
  };
  o << "memory (capacity " << format_bytes(capacity_bytes) << ")\n";
  row("category", "current", "peak");
  for (memory::Category c : memory::kAllCategories) {
    const size_t i = memory::index_of(c);
    row(memory::category_name(c), format_bytes(current_by_category[i]),
        format_bytes(peak_by_category[i]));
  }
  row("all categories", "", format_bytes(peak_bytes));
  o << "\n";
  row("", "predicted", "measured");
  row("activation peak", format_bytes(predicted_activation_bytes),
      format_bytes(peak_activation_bytes));
  row("total peak", format_bytes(predicted_peak_bytes), format_bytes(peak_bytes));
  std::ostringstream p, m;
  p << std::fixed << std::setprecision(3) << predicted_recompute_s * 1e3 << " ms";
  m << std::fixed << std::setprecision(3) << measured_recompute_s * 1e3 << " ms";
  row("recompute per step", p.str(), m.str());
  row("pinned peak", format_bytes(predicted_pinned_bytes), format_bytes(peak_pinned_bytes));
  o << "  pinned limit " << format_bytes(pinned_limit_bytes) << "\n";
  if (offloaded_bytes > 0 || offload.d2h_bytes > 0) {
    o << std::fixed << std::setprecision(3) << "  offload: " << format_bytes(offloaded_bytes)
      << " per micro-batch to host; copied d2h " << format_bytes(offload.d2h_bytes) << ", h2d "
      << format_bytes(offload.h2d_bytes) << "; copy busy " << offload.copy_busy_s * 1e3
      << " ms, exposed wait " << offload.exposed_wait_s * 1e3 << " ms, hidden "
      << std::setprecision(1) << offload.hidden_fraction() * 100.0 << "%\n";
  }
  if (host_state.total() > 0 || predicted_host_state.total() > 0) {
    o << "\n";
    row("host (model states)", "predicted", "measured");
    row("optimizer state", format_bytes(predicted_host_state.optimizer),
        format_bytes(host_state.optimizer));
    row("gradient shard", format_bytes(predicted_host_state.grads), format_bytes(host_state.grads));
    row("params / working copy", format_bytes(predicted_host_state.params),
        format_bytes(host_state.params));
    row("host total", format_bytes(predicted_host_state.total()), format_bytes(host_state.total()));
    o << "  pinned in use now " << format_bytes(pinned_in_use_bytes)
      << " (checkpoint stash and pinned model states)\n";
  }
  return o.str();
}

}  // namespace porter::engine
