// The parameters and gradients as host vectors in layout order (Engine::params_host,
// grads_host, set_params_host), and the tensor-parallel replicated ranges of the flat buffer.
#include "base/check.h"
#include "engine/engine.h"
#include "engine/engine_impl.h"

namespace porter::engine {

std::vector<std::pair<int64_t, int64_t>> replicated_ranges(const nn::ParamLayout& layout,
                                                           const std::vector<bool>& replicated) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (size_t i = 0; i < replicated.size(); ++i) {
    if (!replicated[i]) continue;
    const nn::ParamEntry& e = layout.entries()[i];
    const int64_t end = e.offset_elems + e.shape.numel();
    const int64_t aligned = (end + nn::kParamAlignElems - 1) / nn::kParamAlignElems *
                            nn::kParamAlignElems;
    if (!ranges.empty() && ranges.back().second == e.offset_elems) {
      ranges.back().second = aligned;
    } else {
      ranges.emplace_back(e.offset_elems, aligned);
    }
  }
  return ranges;
}

void Engine::set_params_host(const std::vector<float>& values) {
  Impl& im = *impl_;
  const int64_t p = model_->layout().total_elems();
  PORTER_CHECK(static_cast<int64_t>(values.size()) == p, "set_params_host: ", values.size(),
               " values for a layout of ", p, " elements (padding included)");
  // Note [Flat partition]: the tail past the layout is zero.
  std::vector<float> padded = values;
  padded.resize(static_cast<size_t>(im.part.padded_elems), 0.0f);
  im.optimizer->set_params(padded);
  if (im.gatherer) im.gatherer->refresh_persistent();  // a collective at stage 3
}

std::vector<float> Engine::params_host() const {
  const Impl& im = *impl_;
  const int64_t p = model_->layout().total_elems();
  if (!im.gatherer) return tensor::to_host_f32(*device_, im.flat->params().slice(0, p));
  // Stage 3: the shards, all-gathered (every rank calls this).
  const tensor::Tensor& shard = im.optimizer->working();
  tensor::Tensor all = tensor::Tensor::empty(*allocator_, tensor::Shape{im.part.padded_elems}, shard.dtype(),
                                     memory::Category::kWorkspace);
  if (comm::Communicator* dp = im.comm()) {
    const comm::CommLabel label(dp, "params");
    dp->all_gather(shard.data(), all.data(), static_cast<size_t>(im.part.shard_elems),
                   nn::comm_type(shard.dtype())).wait_on(device_->compute_stream());
  } else {
    device_->copy_sync(all.data(), shard.data(), shard.nbytes());
  }
  return tensor::to_host_f32(*device_, all.slice(0, p));
}

// Stage 0: the whole (reduced) buffer. Stages 1 and 2: the rank's shard, zero elsewhere (with
// one rank the shard is the whole buffer).
std::vector<float> Engine::grads_host() const {
  const Impl& im = *impl_;
  const int64_t p = model_->layout().total_elems();
  if (run_.zero_stage() == 0) return tensor::to_host_f32(*device_, im.flat->grads().slice(0, p));
  std::vector<float> out(static_cast<size_t>(p), 0.0f);
  // Note [Streamed gradients]: with the optimizer offloaded the shard may live on the host only.
  const void* streamed = im.optimizer->streamed_grads();
  const int64_t n = im.optimizer->end() - im.optimizer->begin();
  const std::vector<float> shard =
      streamed != nullptr
          ? tensor::to_host_f32(*device_, tensor::Tensor::from_blob(const_cast<void*>(streamed),
                                                                    tensor::Shape{n},
                                                                    im.flat->grad_dtype(),
                                                                    memory::Category::kGrads))
          : tensor::to_host_f32(*device_, im.reducer->shard());
  const int64_t lo = im.optimizer->begin();
  for (int64_t i = 0; i < static_cast<int64_t>(shard.size()) && lo + i < p; ++i) {
    out[static_cast<size_t>(lo + i)] = shard[static_cast<size_t>(i)];
  }
  return out;
}

}  // namespace porter::engine
