// Engine::evaluate: the mean loss at the current parameters, forward only.
#include "engine/engine.h"
#include "engine/engine_impl.h"
#include "engine/executor.h"

namespace porter::engine {

double Engine::evaluate(const std::vector<io::HostBatch>& micro_batches) {
  if (pending_ != nullptr) throw_step_begun("evaluate");
  Impl& im = *impl_;
  check_states_on_device("evaluate");  // Note [Offloaded model states]
  check_batches(run_, *model_, micro_batches, 0);
  const int n = model_->num_stages();
  double sum = 0.0;
  const std::vector<BatchField> spec = model_->batch_spec(run_);
  struct TargetsGuard {
    Model& m;
    nn::Ctx& ctx;
    ~TargetsGuard() {
      m.set_targets(tensor::Tensor());
      ctx.set_batch(nullptr);
    }
  } guard{*model_, *im.ctx};
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
    const nn::Batch batch = upload_batch(*allocator_, micro_batches[i], spec);
    tensor::Tensor x = batch.get(model_->input_name());
    const tensor::Tensor& targets = batch.get(model_->target_name());
    im.ctx->set_run({run_.seed, static_cast<uint64_t>(step_), static_cast<uint32_t>(i),
                     x.dim(0), batch_positions(x), /*eval=*/true});
    im.ctx->set_batch(&batch);
    for (int s = 0; s < n; ++s) {
      gathers.before_op(static_cast<size_t>(s));
      nn::Tape tape;  // a checkpointed forward keeps nothing; dropped at once
      if (s == n - 1) model_->set_targets(targets);
      x = nn::forward_stage(*im.ctx, model_->stage(s), s, tape, nn::SaveMode::kCheckpoint, x);
      gathers.after_op(static_cast<size_t>(s));
    }
    im.ctx->set_batch(nullptr);
    sum += static_cast<double>(tensor::to_host_f32(*device_, x).at(0));
  }
  return sum / static_cast<double>(micro_batches.size());
}

}  // namespace porter::engine
