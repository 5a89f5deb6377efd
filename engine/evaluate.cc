// Engine::evaluate: the mean loss at the current parameters, forward only.
#include "engine/engine.h"
#include "engine/engine_impl.h"

namespace porter::engine {

double Engine::evaluate(const std::vector<io::HostBatch>& micro_batches) {
  Impl& im = *impl_;
  check_states_on_device("evaluate");  // Note [Offloaded model states]
  check_batches(run_, *model_, micro_batches, 0);
  const int n = model_->num_stages();
  double sum = 0.0;
  struct TargetsGuard {
    Model& m;
    ~TargetsGuard() { m.set_targets(tensor::Tensor()); }
  } guard{*model_};
  // Stage 3: the forward pass's gather plan around each stage (Note [Stage 3 driver]);
  // nothing stays gathered however evaluate ends.
  const Stage3Driver& gathers = im.forward_gathers;
  struct GatherGuard {
    zero::ParamGatherer* g;
    ~GatherGuard() {
      if (g != nullptr) g->abort();
    }
  } gather_guard{im.gatherer.get()};
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    const io::HostBatch& mb = micro_batches[i];
    tensor::Tensor x = upload_ids(*allocator_, mb.tokens, mb.batch, mb.seq);
    tensor::Tensor targets = upload_ids(*allocator_, mb.targets, mb.batch, mb.seq);
    im.ctx->set_run({run_.seed, static_cast<uint64_t>(step_), static_cast<uint32_t>(i),
                     static_cast<int64_t>(mb.batch), static_cast<int64_t>(mb.seq),
                     /*eval=*/true});
    for (int s = 0; s < n; ++s) {
      gathers.before_op(static_cast<size_t>(s));
      nn::Tape tape;  // a checkpointed forward keeps nothing; dropped at once
      if (s == n - 1) model_->set_targets(targets);
      x = nn::forward_stage(*im.ctx, model_->stage(s), s, tape, nn::SaveMode::kCheckpoint, x);
      gathers.after_op(static_cast<size_t>(s));
    }
    sum += static_cast<double>(tensor::to_host_f32(*device_, x).at(0));
  }
  return sum / static_cast<double>(micro_batches.size());
}

}  // namespace porter::engine
