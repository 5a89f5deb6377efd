// The parameters and gradients as host vectors in layout order (Engine::params_host,
// grads_host, set_params_host, set_params_host_range), and the tensor-parallel replicated
// ranges of the flat buffer.
#include <algorithm>
#include <cstddef>
#include <span>
#include <string_view>

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

// Note [Sharded loading]
// set_params_host_range loads what zero::ShardedOptimizer::set_params loads, from the
// rank's own part of the values only (set_params takes the whole padded buffer):
// - stages 0-2: the whole padded buffer into the working parameters (the flat buffer), and
//   its optimizer range [begin, end) into the f32 master copy;
// - stage 3: the range into the working shard and into the master copy, then the persistent
//   units gathered again (a collective).
// The master copy is the optimizer's "master" state tensor: the host's part then the
// device's (Note [Partial offload] in zero/sharded_optimizer.h). With f32 compute and the
// optimizer offloaded the host's f32 parameters are the working copy's first elements, which
// ShardedOptimizer::state_loaded copies from it. Conversions to bf16 and f16 round as
// tensor::from_host_f32 does, a chunk at a time, so the host holds the values and at most
// kUploadChunkElems converted elements: set_params_host over this entry is set_params_host
// as it was, bit for bit, with one host copy of the model fewer.
namespace {

constexpr size_t kUploadChunkElems = size_t{1} << 20;

// `values` into `t` (as many elements), rounded as tensor::from_host_f32 rounds.
void upload(memory::Device& device, std::span<const float> values, const tensor::Tensor& t) {
  PORTER_CHECK_EQ(static_cast<int64_t>(values.size()), t.numel(), "set_params_host_range: upload");
  if (values.empty()) return;
  if (t.dtype() == tensor::DType::kF32) {
    device.copy_sync(t.data(), values.data(), t.nbytes());
    return;
  }
  const bool bf16 = t.dtype() == tensor::DType::kBF16;
  PORTER_CHECK(bf16 || t.dtype() == tensor::DType::kF16, "set_params_host_range into ",
               tensor::dtype_name(t.dtype()));
  std::vector<uint16_t> h(std::min(values.size(), kUploadChunkElems));
  auto* dst = static_cast<std::byte*>(t.data());
  for (size_t at = 0; at < values.size(); at += h.size()) {
    const size_t n = std::min(h.size(), values.size() - at);
    for (size_t i = 0; i < n; ++i) {
      h[i] = bf16 ? tensor::f32_to_bf16(values[at + i]) : tensor::f32_to_f16(values[at + i]);
    }
    device.copy_sync(dst + at * sizeof(uint16_t), h.data(), n * sizeof(uint16_t));
  }
}

}  // namespace

void Engine::set_params_host(const std::vector<float>& values) {
  const int64_t p = model_->layout().total_elems();
  PORTER_CHECK(static_cast<int64_t>(values.size()) == p, "set_params_host: ", values.size(),
               " values for a layout of ", p, " elements (padding included)");
  // Note [Flat partition]: the tail past the layout is zero.
  set_params_host_range([&](int64_t begin, std::span<float> out) {
    for (size_t i = 0; i < out.size(); ++i) {
      const int64_t at = begin + static_cast<int64_t>(i);
      out[i] = at < p ? values[static_cast<size_t>(at)] : 0.0f;
    }
  });
}

void Engine::set_params_host_range(
    const std::function<void(int64_t begin, std::span<float> values)>& fill) {
  if (pending_ != nullptr) throw_step_begun("set_params_host");
  Impl& im = *impl_;
  zero::ShardedOptimizer& opt = *im.optimizer;
  const bool stage3 = im.gatherer != nullptr;
  const int64_t begin = stage3 ? opt.begin() : 0;
  const int64_t end = stage3 ? opt.end() : im.part.padded_elems;
  std::vector<float> values(static_cast<size_t>(end - begin), 0.0f);
  fill(begin, std::span<float>(values));
  // Note [Sharded loading]
  if (stage3) {
    upload(*device_, values, opt.working());
  } else {
    upload(*device_, values, im.flat->params());
  }
  const std::span<const float> mine =
      std::span<const float>(values).subspan(static_cast<size_t>(opt.begin() - begin),
                                             static_cast<size_t>(opt.end() - opt.begin()));
  if (opt.has_master()) {
    for (const zero::ShardedOptimizer::StateTensor& st : opt.state_tensors()) {
      if (std::string_view(st.name) != "master") continue;
      const size_t first = static_cast<size_t>(st.tensor.numel());
      upload(*device_, mine.subspan(0, first), st.tensor);
      if (st.rest.defined() && st.rest.numel() > 0) upload(*device_, mine.subspan(first), st.rest);
    }
  }
  opt.state_loaded();  // f32 compute, offloaded: the host's parameters from the working copy
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
