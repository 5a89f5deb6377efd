// The sharded optimizer's phases (Note [Sharded optimizer] in sharded_optimizer.h).
#include "zero/sharded_optimizer.h"

#include <algorithm>
#include <utility>
#include <vector>
#include <chrono>
#include <cmath>
#include <cstring>

#include "base/check.h"
#include "base/error.h"
#include "nn/ctx.h"
#include "zero/cpu_adam.h"
#include "zero/host_grads.h"

namespace porter::zero {

namespace {

using Clock = std::chrono::steady_clock;

tensor::Tensor zeros_f32(kernels::Kernels& kernels, memory::CachingAllocator& allocator, int64_t n) {
  tensor::Tensor t =
      tensor::Tensor::empty(allocator, tensor::Shape{n}, tensor::DType::kF32, memory::Category::kOptimizer);
  kernels.fill(t, 0.0f);
  return t;
}

}  // namespace

// Note [Optimizer offload], Note [Parameter offload]: the host arrays of the rank's range,
// each a block of a host tier (Note [Host tier] in memory/host_tier.h): the pinned one with
// pin_memory, the pageable one otherwise.
struct ShardedOptimizer::Host {
  struct Array {
    memory::HostBlock block;
    void* data = nullptr;
    size_t bytes = 0;
    size_t held = 0;  // what it takes: the tier's block (Note [Host-state bytes per rank])
  };
  // The tiers first, so that they go after every block and lane.
  std::unique_ptr<memory::HostTier> owned_pinned;  // built over a pinned pool
  std::unique_ptr<memory::HostTier> pageable;      // pin_memory false
  memory::HostTier* optimizer_tier = nullptr;      // master, moments, gradient and working copies
  memory::HostTier* param_tier = nullptr;          // the parameter shard (parameter offload)
  bool optimizer = false;  // master, exp_avg, exp_avg_sq, grad live here
  bool params = false;     // `out` is the parameter shard itself
  Array master, exp_avg, exp_avg_sq, grad, out;
  Array staging;  // Note [Streamed gradients]: the copies' staging block
  std::unique_ptr<CpuAdam> adam;
  // The copies of the offloaded optimizer (Note [Optimizer offload]): gradients down as the
  // reducer finishes them, the working copy up after the update.
  std::unique_ptr<memory::HostLane> lane;
  std::vector<std::pair<int64_t, int64_t>> sent;  // this step's gradient parts already queued
  uint64_t sent_bytes = 0;
  // Note [Streamed gradients]: the reducer's sink, over `grad` (the only gradient shard);
  // null when the device keeps one (stage 1, a partial offload).
  std::unique_ptr<HostGradients> streamed;
  bool streamed_finished = false;  // this step's copies and accumulations are done
  static Array make(memory::HostTier& tier, size_t bytes, const char* key, const char* what) {
    Array a;
    a.bytes = bytes;
    if (bytes == 0) return a;
    try {
      a.block = tier.allocate(bytes);
    } catch (const OutOfMemoryError& e) {
      throw OutOfMemoryError(std::string("zero_optimization.") + key + ": the host " + what +
                             " (" + std::to_string(bytes) + " bytes) does not fit in " + tier.name() +
                             ": " + e.what() + " (raise " + tier.limit_key() + ", or set " + key +
                             ".pin_memory to false)",
                             e.requested_bytes());
    }
    a.data = a.block.data();
    a.held = tier.block_bytes(a.data);  // a reused cached block can be larger
    return a;
  }
};

ShardedOptimizer::~ShardedOptimizer() = default;

ShardedOptimizer::ShardedOptimizer(nn::FlatParams& flat, kernels::Kernels& kernels,
                                   memory::CachingAllocator& allocator, comm::Communicator* dp,
                                   const Partition& part, const OptimizerOptions& options,
                                   memory::PinnedPool* pinned)
    : ShardedOptimizer(flat, kernels, allocator, dp, part, options,
                       pinned != nullptr ? std::make_unique<memory::PinnedHostTier>(*pinned) : nullptr,
                       nullptr) {}

ShardedOptimizer::ShardedOptimizer(nn::FlatParams& flat, kernels::Kernels& kernels,
                                   memory::CachingAllocator& allocator, comm::Communicator* dp,
                                   const Partition& part, const OptimizerOptions& options,
                                   memory::HostTier* pinned)
    : ShardedOptimizer(flat, kernels, allocator, dp, part, options, nullptr, pinned) {}

ShardedOptimizer::ShardedOptimizer(nn::FlatParams& flat, kernels::Kernels& kernels,
                                   memory::CachingAllocator& allocator, comm::Communicator* dp,
                                   const Partition& part, const OptimizerOptions& options,
                                   std::unique_ptr<memory::HostTier> owned_pinned,
                                   memory::HostTier* pinned)
    : flat_(&flat),
      kernels_(&kernels),
      allocator_(&allocator),
      dp_(dp != nullptr && dp->size() > 1 ? dp : nullptr),
      part_(part),
      options_(options),
      scaler_(options.fp16) {
  PORTER_CHECK(options.zero_stage >= 0 && options.zero_stage <= 3,
               "ShardedOptimizer: ZeRO stage ", options.zero_stage, " (expected 0..3)");
  PORTER_CHECK_EQ(flat.padded_elems(), part.padded_elems,
                  "ShardedOptimizer: the flat buffer is not the partition's padded size");
  const int rank = dp != nullptr ? dp->rank() : 0;
  begin_ = options.zero_stage >= 1 ? part.begin(rank) : 0;
  end_ = options.zero_stage >= 1 ? part.end(rank) : part.padded_elems;
  runs_ = resolve_param_groups(flat.layout(), part.padded_elems, options.param_groups,
                               options.adamw.weight_decay);
  const int64_t n = end_ - begin_;
  const bool offload_params = options.param_offload.enabled;
  // Note [Partial offload]: the first h elements of the range are the host's.
  const int64_t h = options.offload.enabled ? offloaded_elems(n, options.offload.ratio) : 0;
  // The config parser refuses these combinations (Note [Run options] in
  // engine/run_options.h); below it they are programming errors.
  PORTER_ASSERT(options.offload.ratio == 1.0 || options.zero_stage == 3,
                "ShardedOptimizer: a partial optimizer offload needs ZeRO stage 3");
  host_elems_ = h;
  PORTER_ASSERT(!offload_params || options.zero_stage == 3,
                "ShardedOptimizer: parameter offload needs ZeRO stage 3, got stage ",
                options.zero_stage);
  PORTER_ASSERT(!options.offload.enabled || options.zero_stage >= 1,
                "ShardedOptimizer: optimizer offload needs ZeRO stage 1-3");
  if (options.offload.enabled || offload_params) {
    const bool pin_opt = options.offload.enabled && options.offload.pin_memory;
    const bool pin_params = offload_params && options.param_offload.pin_memory;
    host_ = std::make_unique<Host>();
    host_->owned_pinned = std::move(owned_pinned);
    if (pinned == nullptr) pinned = host_->owned_pinned.get();
    PORTER_CHECK((!pin_opt && !pin_params) || pinned != nullptr,
                 "ShardedOptimizer: offload with pin_memory needs the pinned pool");
    PORTER_CHECK(pinned == nullptr || &pinned->device() == &allocator.device(),
                 "ShardedOptimizer: the pinned host tier is over another device than the allocator");
    if (!pin_opt || !pin_params) {
      host_->pageable = std::make_unique<memory::PageableHostTier>(allocator.device());
    }
    host_->optimizer_tier = pin_opt ? pinned : host_->pageable.get();
    host_->param_tier = pin_params ? pinned : host_->pageable.get();
    host_->optimizer = options.offload.enabled;
    host_->params = offload_params;
    const size_t pbytes = static_cast<size_t>(n) * tensor::dtype_size(flat.param_dtype());
    if (offload_params) {
      host_->out = Host::make(*host_->param_tier, pbytes, "offload_param", "parameter shard");
    }
    if (options.offload.enabled) {
      memory::HostTier& tier = *host_->optimizer_tier;
      const size_t f32 = static_cast<size_t>(h) * sizeof(float);
      constexpr const char* key = "offload_optimizer";
      host_->master = Host::make(tier, f32, key, "master weights");
      host_->exp_avg = Host::make(tier, f32, key, "AdamW exp_avg");
      host_->exp_avg_sq = Host::make(tier, f32, key, "AdamW exp_avg_sq");
      const size_t gbytes = static_cast<size_t>(h) * tensor::dtype_size(flat.grad_dtype());
      host_->grad = Host::make(tier, gbytes, key, "gradient shard");
      if (!offload_params) {
        host_->out = Host::make(tier, static_cast<size_t>(h) * tensor::dtype_size(flat.param_dtype()),
                                key, "working copy");
      }
      if (f32 > 0) {
        std::memset(host_->exp_avg.data, 0, f32);
        std::memset(host_->exp_avg_sq.data, 0, f32);
      }
      CpuAdamOptions ao;
      ao.threads = options.offload.threads;
      host_->adam = std::make_unique<CpuAdam>(ao);
      host_->lane = tier.open_lane("optimizer offload");
      if (streams_gradients(options.zero_stage, options.offload)) {
        host_->staging = Host::make(
            tier,
            static_cast<size_t>(HostGradients::staging_elems(h)) * tensor::dtype_size(flat.grad_dtype()),
            key, "gradient staging block");
        host_->streamed = std::make_unique<HostGradients>(
            *host_->lane, allocator.device(), flat.grad_dtype(), host_->grad.data, h,
            host_->staging.data, host_->adam->threads());
      }
    }
  }
  // Stage 3 keeps only the shard of the working parameters, and owns it here: on the device,
  // or in host memory with parameter offload (the device copies to and from it like any
  // pinned buffer).
  if (options.zero_stage != 3) {
    working_ = flat.params().slice(begin_, end_);
  } else if (offload_params) {
    working_ = tensor::Tensor::from_blob(host_->out.data, tensor::Shape{n}, flat.param_dtype(),
                                     memory::Category::kParams);
  } else {
    working_ = tensor::Tensor::empty(allocator, tensor::Shape{n}, flat.param_dtype(),
                                 memory::Category::kParams);
  }
  if (options.offload.enabled && h > 0) {
    // Checkpoints see the host arrays as tensors (the device copies them like any buffer).
    if (flat.param_dtype() != tensor::DType::kF32) {
      host_master_ = tensor::Tensor::from_blob(host_->master.data, tensor::Shape{h}, tensor::DType::kF32,
                                           memory::Category::kOptimizer);
    }
    host_exp_avg_ = tensor::Tensor::from_blob(host_->exp_avg.data, tensor::Shape{h}, tensor::DType::kF32,
                                          memory::Category::kOptimizer);
    host_exp_avg_sq_ = tensor::Tensor::from_blob(host_->exp_avg_sq.data, tensor::Shape{h},
                                             tensor::DType::kF32, memory::Category::kOptimizer);
  }
  if (h == n && options.offload.enabled) return;  // nothing of the optimizer on the device
  if (flat.param_dtype() != tensor::DType::kF32) {
    master_ = tensor::Tensor::empty(allocator, tensor::Shape{n - h}, tensor::DType::kF32,
                                memory::Category::kOptimizer);
  }
  exp_avg_ = zeros_f32(kernels, allocator, n - h);
  exp_avg_sq_ = zeros_f32(kernels, allocator, n - h);
}

bool ShardedOptimizer::offloaded() const { return host_ != nullptr && host_->optimizer; }
bool ShardedOptimizer::has_master() const { return flat_->param_dtype() != tensor::DType::kF32; }
bool ShardedOptimizer::params_offloaded() const { return host_ != nullptr && host_->params; }
memory::HostTier* ShardedOptimizer::param_tier() const {
  return params_offloaded() ? host_->param_tier : nullptr;
}
memory::HostTierStats ShardedOptimizer::host_tier_stats() const {
  return host_ != nullptr && host_->lane != nullptr ? host_->lane->stats() : memory::HostTierStats{};
}

HostStateBytes ShardedOptimizer::host_state() const {
  HostStateBytes b;
  if (!host_) return b;
  b.optimizer = host_->master.held + host_->exp_avg.held + host_->exp_avg_sq.held;
  b.grads = host_->grad.held + host_->staging.held;
  b.params = host_->out.held;
  return b;
}

OffloadStats ShardedOptimizer::take_offload_stats() {
  const OffloadStats s = offload_stats_;
  offload_stats_ = OffloadStats{};
  return s;
}

void ShardedOptimizer::state_loaded() {
  if (!offloaded() || has_master() || host_->master.bytes == 0) return;
  // f32 compute: the checkpoint's params are the master weights (of the host's part).
  allocator_->device().copy_sync(host_->master.data, working_.data(), host_->master.bytes);
}

bool streams_gradients(int zero_stage, const OptimizerOffloadOptions& offload) {
  return offload.enabled && offload.ratio >= 1.0 && zero_stage >= 2;
}

GradSink* ShardedOptimizer::grad_sink() const {
  return host_ != nullptr ? host_->streamed.get() : nullptr;
}

const void* ShardedOptimizer::streamed_grads() const {
  if (!away_.empty()) throw_away("ShardedOptimizer::streamed_grads");
  return host_ != nullptr && host_->streamed ? host_->streamed->data() : nullptr;
}

void ShardedOptimizer::for_each_state(const std::function<void(tensor::Tensor&)>& f) {
  f(master_);
  f(exp_avg_);
  f(exp_avg_sq_);
  if (options_.zero_stage == 3 && !params_offloaded()) f(working_);
}

void ShardedOptimizer::set_away(std::string why) {
  away_ = std::move(why);
  if (options_.zero_stage == 3) return;  // working_ is one of the states
  if (!away_.empty()) {
    working_ = tensor::Tensor();  // a view of the flat buffer, which is away too
  } else {
    working_ = flat_->params().slice(begin_, end_);
  }
}

void ShardedOptimizer::throw_away(const char* what) const {
  throw UsageError(std::string(what) + ": " + away_);
}

void ShardedOptimizer::begin_step() {
  if (!away_.empty()) throw_away("ShardedOptimizer::begin_step");
  if (!offloaded()) return;
  try {
    host_->lane->stream().synchronize();  // a failed step's copies are done before they are forgotten
  } catch (...) {  // that step reported its error
  }
  host_->sent.clear();
  host_->sent_bytes = 0;
  host_->streamed_finished = false;
  if (host_->streamed) host_->streamed->take_sent_bytes();
}

// Note [Streamed gradients]: waits for this step's copies and host accumulations, once.
void ShardedOptimizer::finish_streamed_gradients() {
  if (host_->streamed_finished) return;
  offload_stats_.d2h_wait_s += host_->streamed->finish();
  const uint64_t sent = host_->streamed->take_sent_bytes();
  offload_stats_.d2h_bytes += sent;
  offload_stats_.d2h_overlapped_bytes += sent;
  host_->streamed_finished = true;
}

void ShardedOptimizer::gradients_ready(const tensor::Tensor& grads, int64_t lo, int64_t hi) {
  PORTER_CHECK(lo >= 0 && hi <= grads.numel() && grads.dtype() == flat_->grad_dtype(),
               "ShardedOptimizer::gradients_ready: [", lo, ", ", hi, ") of a shard of ",
               grads.numel());
  hi = std::min(hi, host_elems_);  // Note [Partial offload]: the host's part only
  if (!offloaded() || lo >= hi) return;
  host_->lane->after(allocator_->device().compute_stream());
  const size_t es = tensor::dtype_size(grads.dtype());
  const size_t bytes = static_cast<size_t>(hi - lo) * es;
  host_->lane->to_host(static_cast<char*>(host_->grad.data) + static_cast<size_t>(lo) * es,
                       static_cast<const char*>(grads.data()) + static_cast<size_t>(lo) * es, bytes);
  host_->sent.emplace_back(lo, hi);
  host_->sent_bytes += bytes;
}

// The parts of the gradient shard no gradients_ready() queued go down now; then the host waits
// for every copy (a copy error is thrown here, before any state changed).
void ShardedOptimizer::finish_gradient_copies(const tensor::Tensor& grads) {
  std::vector<std::pair<int64_t, int64_t>> sent = host_->sent;
  std::sort(sent.begin(), sent.end());
  host_->lane->after(allocator_->device().compute_stream());
  int64_t at = 0;
  const size_t es = tensor::dtype_size(grads.dtype());
  auto copy = [&](int64_t lo, int64_t hi) {
    if (lo >= hi) return;
    host_->lane->to_host(static_cast<char*>(host_->grad.data) + static_cast<size_t>(lo) * es,
                         static_cast<const char*>(grads.data()) + static_cast<size_t>(lo) * es,
                         static_cast<size_t>(hi - lo) * es);
  };
  for (const auto& [lo, hi] : sent) {
    copy(at, lo);
    at = std::max(at, hi);
  }
  copy(at, host_elems_);
  host_->lane->synchronize();
  offload_stats_.d2h_wait_s += host_->lane->last_wait_s();
  offload_stats_.d2h_bytes += host_->grad.bytes;
  offload_stats_.d2h_overlapped_bytes += host_->sent_bytes;
  host_->sent.clear();
  host_->sent_bytes = 0;
}

void ShardedOptimizer::wait(comm::Work work) {
  const auto t0 = Clock::now();
  work.wait_on(allocator_->device().compute_stream());
  exposed_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
}

double ShardedOptimizer::take_exposed_s() {
  const double s = exposed_s_;
  exposed_s_ = 0.0;
  return s;
}

void ShardedOptimizer::set_tensor_parallel(comm::Communicator* tp,
                                           std::vector<std::pair<int64_t, int64_t>> replicated) {
  tp_ = tp != nullptr && tp->size() > 1 ? tp : nullptr;
  replicated_ = std::move(replicated);
}

GradNorm ShardedOptimizer::global_norm(const tensor::Tensor& grads) {
  memory::Device& device = allocator_->device();
  const double loss_scale = scaler_.scale();
  tensor::Tensor sq = tensor::Tensor::empty(*allocator_, tensor::Shape{1}, tensor::DType::kF32,
                                    memory::Category::kWorkspace);
  // Note [Streamed gradients]: the host shard is the gradient, reduced on the host with the
  // cpu device's own reductions.
  HostGradients* streamed = host_ != nullptr ? host_->streamed.get() : nullptr;
  if (streamed != nullptr) finish_streamed_gradients();
  auto squares = [&](int64_t lo, int64_t hi) -> double {
    if (streamed != nullptr) return streamed->squared_norm(lo, hi);
    kernels_->squared_norm(lo == 0 && hi == grads.numel() ? grads : grads.slice(lo, hi), sq);
    return tensor::to_host_f32(device, sq).at(0);
  };
  double total_sq = squares(0, end_ - begin_);
  if (tp_ != nullptr) {
    // Each tp rank counts 1/t of the replicated parameters, so the sum over the group
    // counts them once.
    double replicated_sq = 0.0;
    for (const auto& [first, second] : replicated_) {
      const int64_t b = std::max(first, begin_), e = std::min(second, end_);
      if (b >= e) continue;
      replicated_sq += squares(b - begin_, e - begin_);
    }
    total_sq -= replicated_sq * (1.0 - 1.0 / static_cast<double>(tp_->size()));
  }
  if (tp_ != nullptr || streamed != nullptr) {
    tensor::from_host_f32(device, std::vector<float>{static_cast<float>(total_sq)}, sq);
  }
  if (dp_ != nullptr && options_.zero_stage >= 1) {
    const comm::CommLabel label(dp_, "grad norm");  // Note [Comm records]
    wait(dp_->all_reduce(sq.data(), 1, comm::ElemType::kF32, comm::ReduceOp::kSum));
    total_sq = tensor::to_host_f32(device, sq).at(0);
  }
  if (tp_ != nullptr) {
    const comm::CommLabel label(tp_, "grad norm");
    wait(tp_->all_reduce(sq.data(), 1, comm::ElemType::kF32, comm::ReduceOp::kSum));
    total_sq = tensor::to_host_f32(device, sq).at(0);
  }
  GradNorm r;
  if (options_.fp16.enabled) {
    // This rank's count of inf/nan gradients, max over ranks.
    if (streamed != nullptr) {
      tensor::from_host_f32(device, std::vector<float>{streamed->nonfinite_count()}, sq);
    } else {
      kernels_->nonfinite_count(grads, sq);
    }
    if (dp_ != nullptr) {
      const comm::CommLabel label(dp_, "overflow");
      wait(dp_->all_reduce(sq.data(), 1, comm::ElemType::kF32, comm::ReduceOp::kMax));
    }
    if (tp_ != nullptr) {
      const comm::CommLabel label(tp_, "overflow");
      wait(tp_->all_reduce(sq.data(), 1, comm::ElemType::kF32, comm::ReduceOp::kMax));
    }
    r.overflow = tensor::to_host_f32(device, sq).at(0) != 0.0f || !std::isfinite(total_sq);
  }
  r.norm = std::sqrt(total_sq) / loss_scale;
  if (!r.overflow && options_.gradient_clipping > 0.0) {
    r.clip_coef = std::min(1.0, options_.gradient_clipping / (r.norm + 1e-6));
  }
  return r;
}

template <typename F>
void ShardedOptimizer::for_each_group_run(int64_t lo, int64_t hi, const kernels::AdamWArgs& base,
                                          double lr, F&& f) const {
  // The last run starting at or before the range's element lo.
  auto run = std::upper_bound(runs_.begin(), runs_.end(), begin_ + lo,
                              [](int64_t at, const ParamRun& r) { return at < r.begin_elems; });
  PORTER_ASSERT(run != runs_.begin(), "ShardedOptimizer: no parameter-group run at element ",
                begin_ + lo);
  --run;
  while (lo < hi) {
    const auto next = run + 1;
    const int64_t run_end = next == runs_.end() ? hi : std::min(hi, next->begin_elems - begin_);
    kernels::AdamWArgs args = base;
    args.weight_decay = static_cast<float>(run->weight_decay);
    args.lr = static_cast<float>(lr * run->lr_scale);
    f(lo, run_end, args);
    lo = run_end;
    run = next;
  }
}

void ShardedOptimizer::update(const tensor::Tensor& grads, double lr, const GradNorm& norm) {
  const auto t0 = Clock::now();
  if (offloaded() && host_->streamed) {
    finish_streamed_gradients();  // global_norm normally has
  } else if (offloaded()) {
    PORTER_CHECK(grads.dtype() == flat_->grad_dtype() && grads.numel() == end_ - begin_,
                 "ShardedOptimizer: the gradient shard is not the range in the gradients' dtype");
    finish_gradient_copies(grads);
  }
  if (norm.overflow) return;
  const config::OptimizerConfig& o = options_.adamw;
  kernels::AdamWArgs args;
  args.lr = static_cast<float>(lr);
  args.beta1 = static_cast<float>(o.beta1);
  args.beta2 = static_cast<float>(o.beta2);
  args.eps = static_cast<float>(o.eps);
  args.weight_decay = static_cast<float>(o.weight_decay);
  args.step = steps_ + 1;
  args.grad_scale = static_cast<float>(norm.clip_coef / scaler_.scale());
  tensor::Tensor params = working_;
  memory::Device& device = allocator_->device();
  const int64_t n = end_ - begin_, h = host_elems_;
  if (h > 0) {
    // Note [Optimizer offload]: the gradients are down (finish_gradient_copies), AdamW on the
    // host, the working copy up (with parameter offload it is the host shard: nothing goes up).
    // Note [Pipelined host update]: in pieces of the range, each piece's working copy going up
    // while the host updates the next.
    const auto t1 = Clock::now();
    const size_t gs = tensor::dtype_size(flat_->grad_dtype());
    const size_t ps = tensor::dtype_size(params.dtype());
    const int64_t piece = host_->params ? h : std::max<int64_t>(kHostUpdatePieceElems, (h + 7) / 8);
    for (int64_t lo = 0; lo < h; lo += piece) {
      const int64_t n_piece = std::min(piece, h - lo);
      const auto at = static_cast<size_t>(lo);
      for_each_group_run(lo, lo + n_piece, args, lr,
                         [&](int64_t b, int64_t e, const kernels::AdamWArgs& run_args) {
        CpuAdamArrays a;
        a.params = static_cast<float*>(host_->master.data) + b;
        a.exp_avg = static_cast<float*>(host_->exp_avg.data) + b;
        a.exp_avg_sq = static_cast<float*>(host_->exp_avg_sq.data) + b;
        a.grad = static_cast<const char*>(host_->grad.data) + static_cast<size_t>(b) * gs;
        a.grad_dtype = flat_->grad_dtype();
        a.out = static_cast<char*>(host_->out.data) + static_cast<size_t>(b) * ps;
        a.out_dtype = params.dtype();
        a.elems = e - b;
        host_->adam->update(a, run_args);
      });
      if (!host_->params) {
        // Over the link, on the offload stream, behind the host's update of the piece.
        host_->lane->to_device(static_cast<char*>(params.data()) + at * ps,
                               static_cast<char*>(host_->out.data) + at * ps,
                               static_cast<size_t>(n_piece) * ps);
      }
    }
    const auto t2 = Clock::now();
    const size_t out_bytes = static_cast<size_t>(h) * ps;
    if (!host_->params) {
      host_->lane->synchronize();  // compute (the all-gather below) reads the working copy
      offload_stats_.h2d_bytes += out_bytes;
    }
    offload_stats_.cpu_update_s += std::chrono::duration<double>(t2 - t1).count();
    offload_stats_.exposed_s += std::chrono::duration<double>(Clock::now() - t0).count();
    offload_stats_.update_begin = t1;
    offload_stats_.update_end = t2;
  }
  if (h < n) {
    // The device's part [h, n): all of the range without optimizer offload (Note [Partial
    // offload]).
    tensor::Tensor g = h > 0 ? grads.slice(h, n) : grads;
    // AdamW over the device's part, once per parameter-group run in it; every tensor here
    // is indexed from the part's start h.
    auto device_update = [&](tensor::Tensor& target, const tensor::Tensor& grad,
                             tensor::Tensor* out) {
      const int64_t len = n - h;
      for_each_group_run(h, n, args, lr,
                         [&](int64_t b, int64_t e, const kernels::AdamWArgs& run_args) {
        if (b == h && e == n) {
          kernels_->adamw(target, grad, exp_avg_, exp_avg_sq_, run_args, out);
          return;
        }
        const int64_t lo = b - h, hi = e - h;
        PORTER_ASSERT(hi <= len, "ShardedOptimizer: a run past the device part");
        tensor::Tensor t = target.slice(lo, hi), m = exp_avg_.slice(lo, hi),
                       v = exp_avg_sq_.slice(lo, hi);
        tensor::Tensor w = out != nullptr ? out->slice(lo, hi) : tensor::Tensor();
        kernels_->adamw(t, grad.slice(lo, hi), m, v, run_args, out != nullptr ? &w : nullptr);
      });
    };
    if (params_offloaded()) {
      // Note [Parameter offload]: AdamW on the device into a transient copy of the part, which
      // then goes to the host shard. f32 compute updates the parameters in place, so it starts
      // from the host shard.
      tensor::Tensor tmp = tensor::Tensor::empty(*allocator_, tensor::Shape{n - h}, params.dtype(),
                                         memory::Category::kParams);
      tensor::Tensor host_part = params.slice(h, n);
      const size_t bytes = static_cast<size_t>(tmp.nbytes());
      if (!has_master()) device.copy_sync(tmp.data(), host_part.data(), bytes);
      tensor::Tensor target = has_master() ? master_ : tmp;
      device_update(target, g, has_master() ? &tmp : nullptr);
      device.copy_sync(host_part.data(), tmp.data(), bytes);
      offload_stats_.param_d2h_bytes += bytes;
    } else {
      tensor::Tensor p = h > 0 ? params.slice(h, n) : params;
      tensor::Tensor target = has_master() ? master_ : p;
      device_update(target, g, has_master() ? &p : nullptr);
    }
  }
  // Stage 3 gathers each stage's parameters when they are next needed (zero/param_gatherer.h).
  if (dp_ != nullptr && options_.zero_stage >= 1 && options_.zero_stage <= 2) gather_params();
}

int64_t allgather_chunk_elems(int64_t bucket_elems, int world_size) {
  PORTER_CHECK(bucket_elems >= 1, "zero_optimization.allgather_bucket_size: expected >= 1, got ",
               bucket_elems);
  return std::max<int64_t>(1, bucket_elems / world_size);
}

// Note [Bucketed parameter all-gather].
void ShardedOptimizer::gather_params() {
  const tensor::Tensor& all = flat_->params();
  const int n = part_.world_size;
  const int64_t s = part_.shard_elems;
  const int64_t c = allgather_chunk_elems(options_.allgather_bucket_elems, n);
  const comm::ElemType type = nn::comm_type(all.dtype());
  const comm::CommLabel label(dp_, "params");
  if (c >= s) {  // one all-gather, in place
    wait(dp_->all_gather(working_.data(), all.data(), static_cast<size_t>(s), type));
    return;
  }
  const size_t es = tensor::dtype_size(all.dtype());
  tensor::Tensor staging = tensor::Tensor::empty(*allocator_, tensor::Shape{c * n}, all.dtype(),
                                         memory::Category::kComm);
  memory::Stream& compute = allocator_->device().compute_stream();
  auto* flat = static_cast<char*>(all.data());
  auto* mine = static_cast<const char*>(working_.data());
  auto* out = static_cast<char*>(staging.data());
  for (int64_t off = 0; off < s; off += c) {
    const int64_t len = std::min(c, s - off);
    // The comm stream waits for the compute stream at the call (Note [Comm stream]), so the
    // previous chunk's copies out of `staging` are done before this one overwrites it.
    wait(dp_->all_gather(mine + off * es, out, static_cast<size_t>(len), type));
    for (int r = 0; r < n; ++r) {
      const int64_t rank_begin = part_.begin(r);
      if (rank_begin == begin_) continue;  // this rank's own chunk is in place already
      compute.copy_async(flat + (rank_begin + off) * es, out + r * len * static_cast<int64_t>(es),
                         static_cast<size_t>(len) * es);
    }
  }
}

void ShardedOptimizer::finish_step(bool overflow) {
  if (options_.fp16.enabled) scaler_.update(overflow);
  if (!overflow) ++steps_;
}

void ShardedOptimizer::set_params(const std::vector<float>& padded) {
  if (!away_.empty()) throw_away("ShardedOptimizer::set_params");
  PORTER_CHECK_EQ(static_cast<int64_t>(padded.size()), part_.padded_elems,
                  "ShardedOptimizer::set_params: values for the padded buffer");
  memory::Device& device = allocator_->device();
  const std::vector<float> mine(padded.begin() + begin_, padded.begin() + end_);
  if (options_.zero_stage == 3) {
    tensor::from_host_f32(device, mine, working_);
  } else {
    tensor::Tensor params = flat_->params();
    tensor::from_host_f32(device, padded, params);
  }
  const size_t h = static_cast<size_t>(host_elems_);
  if (h > 0) std::memcpy(host_->master.data, mine.data(), host_->master.bytes);
  if (has_master() && h < mine.size()) {
    tensor::from_host_f32(device, std::vector<float>(mine.begin() + static_cast<long>(h), mine.end()),
                      master_);
  }
}

std::vector<ShardedOptimizer::StateTensor> ShardedOptimizer::state_tensors() const {
  if (!away_.empty()) throw_away("ShardedOptimizer::state_tensors");
  // The host's part first, then the device's (Note [Partial offload]); either may be absent.
  auto state = [](const char* name, const tensor::Tensor& host, const tensor::Tensor& device) {
    return host.defined() ? StateTensor{name, host, device} : StateTensor{name, device, {}};
  };
  std::vector<StateTensor> out;
  if (has_master()) out.push_back(state("master", host_master_, master_));
  out.push_back(state("exp_avg", host_exp_avg_, exp_avg_));
  out.push_back(state("exp_avg_sq", host_exp_avg_sq_, exp_avg_sq_));
  return out;
}

}  // namespace porter::zero
