// The gradient reducer (Notes [Gradient reduction], [Gradient buckets], [Bucketed
// reduce-scatter]).
#include "zero/reducer.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "base/check.h"
#include "nn/ctx.h"

namespace porter::zero {

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMaxInFlight = 2;  // packed (reduce-scatter) buckets in flight at once

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

GradReducer::GradReducer(nn::FlatParams& flat, kernels::Kernels& kernels,
                         memory::CachingAllocator& allocator, comm::Communicator* dp,
                         const Partition& part, std::vector<Bucket> buckets,
                         std::vector<int> entry_stage, const ReducerOptions& options,
                         std::function<void()> rebind, GradSink* sink)
    : flat_(&flat),
      kernels_(&kernels),
      allocator_(&allocator),
      dp_(dp),
      part_(part),
      buckets_(std::move(buckets)),
      options_(options),
      rebind_(std::move(rebind)),
      sink_(sink) {
  PORTER_CHECK(options.zero_stage >= 0 && options.zero_stage <= 3, "GradReducer runs stages 0..3, got ",
               options.zero_stage);
  PORTER_CHECK(options.predivide_factor > 0.0,
               "gradient_predivide_factor: expected > 0, got ", options.predivide_factor);
  if (dp_ != nullptr) {
    n_ = dp_->size();
    rank_ = dp_->rank();
  }
  PORTER_CHECK_EQ(n_, part.world_size, "the partition's world size");
  PORTER_CHECK(sink == nullptr || options.zero_stage >= 2,
               "GradReducer: streamed gradients need ZeRO stage 2 or 3, got stage ",
               options.zero_stage);
  PORTER_CHECK_EQ(flat.padded_elems(), part.padded_elems, "the flat buffers' padded size");
  const auto& entries = flat.layout().entries();
  PORTER_CHECK_EQ(entry_stage.size(), entries.size(), "entry_stage");
  bucket_entries_.resize(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    blocks_.push_back(bucket_blocks(buckets_[b].lo, buckets_[b].hi, part_));
    for (size_t i = 0; i < entries.size(); ++i) {
      const int s = entry_stage[i];
      if (s >= buckets_[b].first_stage && s <= buckets_[b].last_stage) {
        bucket_entries_[b].push_back(i);
      }
    }
  }
  live_.resize(buckets_.size());
  issued_.assign(buckets_.size(), false);
  if (options_.zero_stage >= 2) {
    shard_begin_ = part_.begin(rank_);
    if (sink_ == nullptr) {  // Note [Streamed gradients]: no device shard otherwise
      shard_ = tensor::Tensor::empty(allocator, tensor::Shape{part_.shard_elems},
                                     options_.grad_dtype, memory::Category::kGrads);
    }
    // Every entry starts unbound: a gradient written outside a live bucket fails loudly.
    for (size_t i = 0; i < entries.size(); ++i) flat_->set_grad_view(i, tensor::Tensor());
  } else {
    PORTER_CHECK(flat.grads().defined(), "stages 0 and 1 need the flat gradient buffer");
    PORTER_CHECK(flat.grad_dtype() == options_.grad_dtype, "GradReducer: the flat gradient buffer is ",
                 tensor::dtype_name(flat.grad_dtype()), ", the options say ",
                 tensor::dtype_name(options_.grad_dtype));
    shard_begin_ = options_.zero_stage == 1 ? part_.begin(rank_) : 0;
    shard_ = options_.zero_stage == 1
                 ? flat.grads().slice(part_.begin(rank_), part_.end(rank_))
                 : flat.grads();
  }
}

GradReducer::~GradReducer() { abort(); }

void GradReducer::for_each_state(const std::function<void(tensor::Tensor&)>& f) {
  if (options_.zero_stage >= 2 && sink_ == nullptr) f(shard_);
}

void GradReducer::set_away(std::string why) {
  PORTER_CHECK(pending_.empty() && std::none_of(live_.begin(), live_.end(),
                                                [](const tensor::Tensor& t) { return t.defined(); }),
               "GradReducer::set_away: a reduction is in flight (only between steps)");
  away_ = std::move(why);
  if (options_.zero_stage >= 2) return;  // the shard is the reducer's own
  if (!away_.empty()) {
    shard_ = tensor::Tensor();  // a view of the flat gradient buffer, which is away too
  } else {
    shard_ = options_.zero_stage == 1 ? flat_->grads().slice(part_.begin(rank_), part_.end(rank_))
                                      : flat_->grads();
  }
}

void GradReducer::throw_away(const char* what) const {
  throw UsageError(std::string(what) + ": " + away_);
}

void GradReducer::zero_grads() {
  if (!away_.empty()) throw_away("GradReducer::zero_grads");
  first_ = true;
  if (sink_ != nullptr) return;  // the first micro-batch's parts replace the sink's copy
  tensor::Tensor all = options_.zero_stage >= 2 ? shard_ : flat_->grads();
  kernels_->fill(all, 0.0f);
}

std::optional<float> GradReducer::post_scale() const {
  const double f = options_.predivide_factor;
  if (!last_ || n_ == 1 || options_.prescale_gradients || f == static_cast<double>(n_)) {
    return std::nullopt;
  }
  return static_cast<float>(f / n_);
}

void GradReducer::add_to_shard(const tensor::Tensor& part, int64_t at) {
  if (sink_ != nullptr) {
    sink_->add(part, at, first_, post_scale());
    return;
  }
  tensor::Tensor dst = shard_.slice(at, at + part.numel());
  kernels_->accumulate(dst, part);  // contiguous_gradients: micro-batches sum here
}

void GradReducer::begin_micro_batch(bool last) {
  last_ = last;
  // Stage 2 moves every micro-batch's buckets into the shard, even on one rank.
  reducing_ = options_.zero_stage >= 2 || (n_ > 1 && last);
  std::fill(issued_.begin(), issued_.end(), false);
}

void GradReducer::bind_bucket(size_t b, const tensor::Tensor& buffer) {
  const auto& entries = flat_->layout().entries();
  for (size_t i : bucket_entries_[b]) {
    if (!buffer.defined()) {
      flat_->set_grad_view(i, tensor::Tensor());
      continue;
    }
    const nn::ParamEntry& e = entries[i];
    const int64_t off = e.offset_elems - buckets_[b].lo;
    flat_->set_grad_view(i, buffer.slice(off, off + e.shape.numel()).reshape(e.shape));
  }
}

void GradReducer::before_backward(int chain_stage) {
  if (options_.zero_stage < 2) return;
  bool changed = false;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (buckets_[b].alloc_before != chain_stage || live_[b].defined()) continue;
    tensor::Tensor buf = tensor::Tensor::empty(*allocator_, tensor::Shape{buckets_[b].elems()},
                                       options_.grad_dtype, memory::Category::kComm);
    kernels_->fill(buf, 0.0f);
    bind_bucket(b, buf);
    live_[b] = std::move(buf);
    changed = true;
  }
  if (changed) rebind_();
}

void GradReducer::after_backward(int chain_stage) {
  bool changed = false;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (buckets_[b].ready_after != chain_stage) continue;
    if (options_.zero_stage >= 2) {
      bind_bucket(b, tensor::Tensor());
      changed = true;
    }
    if (!reducing_ || (!options_.overlap_comm && n_ > 1)) continue;
    tensor::Tensor contiguous = std::move(live_[b]);
    live_[b] = tensor::Tensor();
    issue(b, std::move(contiguous));
  }
  if (changed) rebind_();
}

void GradReducer::prescale(tensor::Tensor& t) {
  const double f = options_.predivide_factor;
  const double s = options_.prescale_gradients ? 1.0 / n_ : (f != 1.0 ? 1.0 / f : 1.0);
  if (s != 1.0) kernels_->scale(t, static_cast<float>(s));
}

void GradReducer::issue(size_t b, tensor::Tensor contiguous) {
  const Bucket& bk = buckets_[b];
  issued_[b] = true;
  // The local gradients of the bucket: stage 2's contiguous buffer, else the flat buffer.
  tensor::Tensor local = options_.zero_stage >= 2 ? contiguous : flat_->grads().slice(bk.lo, bk.hi);
  if (n_ == 1) {  // stage 2 on one rank: the bucket is the shard's [lo, hi)
    add_to_shard(local, bk.lo);
    finished(b);
    return;
  }
  prescale(local);
  const comm::CommLabel label(dp_, "bucket " + std::to_string(b));  // Note [Comm records]
  const comm::ElemType type = nn::comm_type(options_.grad_dtype);
  Pending p;
  p.bucket = b;
  // Stages 1-3 keep a shard; reduce_scatter false only changes the packed bucket's collective
  // (Note [Reduce-scatter off]).
  if (options_.zero_stage == 0) {
    p.work = dp_->all_reduce(local.data(), static_cast<size_t>(local.numel()), type,
                             comm::ReduceOp::kSum);
  } else if (blocks_[b].use_all_reduce(bk.elems())) {
    // Cheaper than the packed reduce-scatter (Note [Bucketed reduce-scatter]).
    while (pending_.size() >= kMaxInFlight) complete_oldest();
    p.work = dp_->all_reduce(local.data(), static_cast<size_t>(local.numel()), type,
                             comm::ReduceOp::kSum);
    if (options_.zero_stage >= 2) local.record_stream(dp_->stream());  // a bucket buffer
    p.reduced = std::move(local);
    contiguous = tensor::Tensor();
  } else {
    while (pending_.size() >= kMaxInFlight) complete_oldest();
    const BucketBlocks& bb = blocks_[b];
    p.packed = tensor::Tensor::empty(*allocator_, tensor::Shape{bb.block * n_}, options_.grad_dtype,
                                 memory::Category::kComm);
    kernels_->fill(p.packed, 0.0f);
    memory::Stream& compute = allocator_->device().compute_stream();
    for (int r = 0; r < n_; ++r) {
      if (bb.size(r) == 0) continue;
      tensor::Tensor src = local.slice(bb.lo[static_cast<size_t>(r)] - bk.lo,
                                   bb.hi[static_cast<size_t>(r)] - bk.lo);
      tensor::Tensor dst = p.packed.slice(r * bb.block, r * bb.block + bb.size(r));
      compute.copy_async(dst.data(), src.data(), src.nbytes());
    }
    local = tensor::Tensor();
    contiguous = tensor::Tensor();  // stage 2: freed in compute-stream order, after the pack
    auto* base = static_cast<char*>(p.packed.data());
    const auto es = static_cast<int64_t>(tensor::dtype_size(options_.grad_dtype));
    if (options_.reduce_scatter) {
      p.work = dp_->reduce_scatter(base, base + rank_ * bb.block * es, static_cast<size_t>(bb.block),
                                   type, comm::ReduceOp::kSum);
    } else {
      // Every block reduced on every rank; complete() keeps this rank's, as above.
      p.work = dp_->all_reduce(base, static_cast<size_t>(bb.block * n_), type,
                               comm::ReduceOp::kSum);
    }
    p.packed.record_stream(dp_->stream());
  }
  ++stats_.buckets;
  pending_.push_back(std::move(p));
}

// The post-scale of bucket b's part of the shard, then on_ready (Note [Ready gradients]).
void GradReducer::finished(size_t b) {
  if (!last_ || sink_ != nullptr) return;  // a sink applied the post-scale itself
  const int64_t lo = std::max(buckets_[b].lo, shard_begin_) - shard_begin_;
  const int64_t hi = std::min(buckets_[b].hi, shard_begin_ + shard_.numel()) - shard_begin_;
  if (lo >= hi) return;
  if (const std::optional<float> s = post_scale()) {
    tensor::Tensor part = shard_.slice(lo, hi);
    kernels_->scale(part, *s);
  }
  if (on_ready_) on_ready_(lo, hi);
}

void GradReducer::complete_oldest() {
  Pending p = std::move(pending_.front());
  pending_.pop_front();
  const auto t0 = Clock::now();
  p.work.wait_on(allocator_->device().compute_stream());
  stats_.reduce_exposed_s += seconds_since(t0);
  stats_.reduce_busy_s += std::max(0.0, p.work.end_s() - p.work.start_s());
  complete(p);
  finished(p.bucket);
}

// Pending p's result into the shard (nothing to do where it reduced in place).
void GradReducer::complete(Pending& p) {
  if (!p.packed.defined() && !p.reduced.defined()) return;
  const BucketBlocks& bb = blocks_[p.bucket];
  const int64_t m = bb.size(rank_);
  if (m == 0) return;
  if (p.reduced.defined() && options_.zero_stage < 2) return;  // in place in the flat buffer
  const int64_t from = bb.lo[static_cast<size_t>(rank_)] - buckets_[p.bucket].lo;
  tensor::Tensor mine = p.packed.defined()
                        ? p.packed.slice(rank_ * bb.block, rank_ * bb.block + m)
                        : p.reduced.slice(from, from + m);
  const int64_t at = bb.lo[static_cast<size_t>(rank_)] - shard_begin_;
  if (options_.zero_stage >= 2) {
    add_to_shard(mine, at);
  } else {
    tensor::Tensor dst = shard_.slice(at, at + m);
    allocator_->device().compute_stream().copy_async(dst.data(), mine.data(), mine.nbytes());
  }
}

void GradReducer::end_micro_batch() {
  if (reducing_) {
    for (size_t b = 0; b < buckets_.size(); ++b) {
      if (issued_[b]) continue;
      tensor::Tensor contiguous = std::move(live_[b]);
      live_[b] = tensor::Tensor();
      issue(b, std::move(contiguous));
    }
    while (!pending_.empty()) complete_oldest();
    first_ = false;
  }
  for (tensor::Tensor& t : live_) t = tensor::Tensor();
  // The post-scale ran per bucket as each completed (finished()); with more than one rank
  // every bucket is reduced in the last micro-batch, so every part of the shard was scaled.
}

void GradReducer::abort() noexcept {
  while (!pending_.empty()) {
    try {
      pending_.front().work.wait();
    } catch (...) {
    }
    pending_.pop_front();
  }
  bool bound = false;
  for (size_t b = 0; b < live_.size(); ++b) {
    if (!live_[b].defined()) continue;
    live_[b] = tensor::Tensor();
    try {
      bind_bucket(b, tensor::Tensor());
      bound = true;
    } catch (...) {
    }
  }
  if (bound && rebind_) {
    try {
      rebind_();
    } catch (...) {
    }
  }
}

ReducerStats GradReducer::take_stats() {
  ReducerStats s = stats_;
  stats_ = ReducerStats{};
  return s;
}

}  // namespace porter::zero
