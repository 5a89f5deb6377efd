// ZeRO stage 3's parameter gathers (Note [Stage 3 gather] in param_gatherer.h).
#include "zero/param_gatherer.h"

#include <algorithm>
#include <chrono>

#include "base/check.h"
#include "base/error.h"
#include "nn/ctx.h"
#include "kernels/kernels.h"

namespace porter::zero {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

ParamGatherer::ParamGatherer(nn::FlatParams& flat, memory::CachingAllocator& allocator,
                             comm::Communicator* dp, const Partition& part, tensor::Tensor shard,
                             std::vector<ParamUnit> units, int64_t max_live_elems,
                             std::function<void()> rebind, memory::HostTier* shard_tier)
    : ParamGatherer(flat, allocator, dp, part, std::move(shard), std::move(units), max_live_elems,
                    std::move(rebind), nullptr, shard_tier) {}

ParamGatherer::ParamGatherer(nn::FlatParams& flat, memory::CachingAllocator& allocator,
                             comm::Communicator* dp, const Partition& part, tensor::Tensor shard,
                             std::vector<ParamUnit> units, int64_t max_live_elems,
                             std::function<void()> rebind, bool shard_on_host)
    : ParamGatherer(flat, allocator, dp, part, std::move(shard), std::move(units), max_live_elems,
                    std::move(rebind),
                    shard_on_host ? std::make_unique<memory::PageableHostTier>(allocator.device())
                                  : nullptr,
                    nullptr) {}

ParamGatherer::ParamGatherer(nn::FlatParams& flat, memory::CachingAllocator& allocator,
                             comm::Communicator* dp, const Partition& part, tensor::Tensor shard,
                             std::vector<ParamUnit> units, int64_t max_live_elems,
                             std::function<void()> rebind,
                             std::unique_ptr<memory::HostTier> owned_tier,
                             memory::HostTier* shard_tier)
    : flat_(&flat),
      allocator_(&allocator),
      dp_(dp != nullptr && dp->size() > 1 ? dp : nullptr),
      part_(part),
      rank_(dp != nullptr ? dp->rank() : 0),
      shard_(std::move(shard)),
      units_(std::move(units)),
      state_(units_.size()),
      max_live_elems_(max_live_elems),
      rebind_(std::move(rebind)),
      owned_tier_(std::move(owned_tier)) {
  if (shard_tier == nullptr) shard_tier = owned_tier_.get();
  if (shard_tier != nullptr) {
    PORTER_CHECK(&shard_tier->device() == &allocator.device(),
                 "ParamGatherer: the shard's host tier is over another device than the allocator");
    h2d_ = shard_tier->open_lane("param h2d");
  }
  PORTER_CHECK(shard_.defined() && shard_.numel() == part.shard_elems,
               "ParamGatherer: the working shard has ", shard_.defined() ? shard_.numel() : 0,
               " elements, the partition's shard ", part.shard_elems);
  for (const ParamUnit& u : units_) {
    PORTER_CHECK(u.lo >= 0 && u.lo <= u.hi && u.hi <= part.padded_elems, "ParamGatherer: unit '",
                 u.name, "' [", u.lo, ", ", u.hi, ") outside the padded buffer of ",
                 part.padded_elems);
  }
}

ParamGatherer::~ParamGatherer() {
  // The buffers may still be written by a broadcast only after a failure, and then the
  // communicator was aborted: its stream is drained before it is destroyed. An upload may be
  // in flight after a failure too.
  for (UnitState& s : state_) s.works.clear();
  if (h2d_) {
    try {
      h2d_->stream().synchronize();
    } catch (...) {  // the failure was reported by the step that made it
    }
  }
}

void ParamGatherer::wait_upload(UnitState& st) {
  if (!st.uploading) return;
  h2d_->wait_on(allocator_->device().compute_stream(), *st.uploaded);
  stats_.exposed_s += h2d_->last_wait_s();
  st.uploading = false;
}

void ParamGatherer::issue(int u, tensor::Tensor buffer) {
  const ParamUnit& un = units_[static_cast<size_t>(u)];
  UnitState& st = state_[static_cast<size_t>(u)];
  const size_t esize = tensor::dtype_size(buffer.dtype());
  char* base = static_cast<char*>(buffer.data());
  // This rank's part, from its shard: on the compute stream, or from the host on the upload
  // stream, which the comm stream then waits for (Note [Stage 3 gather]).
  const int64_t mine_lo = std::max(un.lo, part_.begin(rank_));
  const int64_t mine_hi = std::min(un.hi, part_.end(rank_));
  if (mine_lo < mine_hi) {
    void* dst = base + static_cast<size_t>(mine_lo - un.lo) * esize;
    const void* src = static_cast<const char*>(shard_.data()) +
                      static_cast<size_t>(mine_lo - part_.begin(rank_)) * esize;
    const size_t bytes = static_cast<size_t>(mine_hi - mine_lo) * esize;
    if (h2d_) {
      // The upload starts after compute's work so far: the buffer's allocation, and the reads
      // of a persistent unit refilled in place.
      if (!st.uploaded) st.uploaded = allocator_->device().create_event();
      allocator_->device().compute_stream().record(*st.uploaded);
      h2d_->wait(*st.uploaded);
      h2d_->to_device(dst, src, bytes);
      h2d_->record(*st.uploaded);
      // No record_stream on h2d_: every path that drops the buffer (wait, release, abort)
      // waits for the upload first, and the stream may go before the persistent buffers do.
      st.uploading = true;
      if (dp_ != nullptr) dp_->stream().wait(*st.uploaded);
    } else {
      allocator_->device().compute_stream().copy_async(dst, src, bytes);
    }
  }
  if (dp_ != nullptr) {
    const comm::CommLabel label(dp_, "gather " + un.name);  // Note [Comm records]
    const int first = static_cast<int>(un.lo / part_.shard_elems);
    const int last = static_cast<int>((un.hi - 1) / part_.shard_elems);
    for (int q = first; q <= last && un.hi > un.lo; ++q) {
      const int64_t lo = std::max(un.lo, part_.begin(q));
      const int64_t hi = std::min(un.hi, part_.end(q));
      if (lo >= hi) continue;
      st.works.push_back(dp_->broadcast(base + static_cast<size_t>(lo - un.lo) * esize,
                                        static_cast<size_t>(hi - lo), nn::comm_type(buffer.dtype()), q));
    }
    buffer.record_stream(dp_->stream());
    stats_.gathered_bytes += static_cast<uint64_t>(un.elems() - std::max<int64_t>(0, mine_hi - mine_lo)) * esize;
  }
  ++stats_.gathers;
  st.buffer = std::move(buffer);
}

void ParamGatherer::gather(int u) {
  if (!away_.empty()) throw_away("ParamGatherer::gather");
  PORTER_CHECK(u >= 0 && u < num_units(), "ParamGatherer::gather: no unit ", u);
  const ParamUnit& un = units_[static_cast<size_t>(u)];
  UnitState& st = state_[static_cast<size_t>(u)];
  if (st.buffer.defined()) throw InternalError("stage 3: unit '" + un.name + "' gathered twice");
  if (!un.persistent && live_elems_ + un.elems() > max_live_elems_) {
    throw InternalError("stage 3: gathering '" + un.name + "' makes " +
                        std::to_string(live_elems_ + un.elems()) +
                        " live parameter elements, over zero_optimization.stage3_max_live_parameters = " +
                        std::to_string(max_live_elems_));
  }
  tensor::Tensor buffer = tensor::Tensor::empty(*allocator_, tensor::Shape{un.elems()}, flat_->param_dtype(),
                                        memory::Category::kParams);
  if (!un.persistent) {
    live_elems_ += un.elems();
    live_bytes_ += buffer.nbytes();
    stats_.peak_live_elems = std::max(stats_.peak_live_elems, live_elems_);
    stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, live_bytes_);
  }
  issue(u, std::move(buffer));
}

void ParamGatherer::wait(int u) {
  PORTER_CHECK(u >= 0 && u < num_units(), "ParamGatherer::wait: no unit ", u);
  UnitState& st = state_[static_cast<size_t>(u)];
  if (!st.buffer.defined()) {
    throw InternalError("stage 3: waiting for '" + units_[static_cast<size_t>(u)].name +
                        "', which was not gathered");
  }
  if (!st.works.empty()) {
    memory::Stream& compute = allocator_->device().compute_stream();
    const auto t0 = Clock::now();
    for (comm::Work& w : st.works) w.wait_on(compute);
    stats_.exposed_s += std::chrono::duration<double>(Clock::now() - t0).count();
    for (comm::Work& w : st.works) {
      if (w.done()) stats_.busy_s += w.end_s() - w.start_s();
    }
    st.works.clear();
  }
  wait_upload(st);
  if (!st.bound) bind(u);
}

void ParamGatherer::bind(int u) {
  const ParamUnit& un = units_[static_cast<size_t>(u)];
  UnitState& st = state_[static_cast<size_t>(u)];
  for (size_t i : un.entries) {
    const nn::ParamEntry& e = flat_->layout().entries().at(i);
    const int64_t off = e.offset_elems - un.lo;
    flat_->set_param_view(i, st.buffer.slice(off, off + e.shape.numel()).reshape(e.shape));
  }
  st.bound = true;
  rebind_();
}

void ParamGatherer::unbind(int u) {
  for (size_t i : units_[static_cast<size_t>(u)].entries) flat_->clear_param_view(i);
  state_[static_cast<size_t>(u)].bound = false;
  rebind_();
}

void ParamGatherer::release(int u) {
  PORTER_CHECK(u >= 0 && u < num_units(), "ParamGatherer::release: no unit ", u);
  const ParamUnit& un = units_[static_cast<size_t>(u)];
  UnitState& st = state_[static_cast<size_t>(u)];
  if (!st.buffer.defined()) {
    throw InternalError("stage 3: releasing '" + un.name + "', which was not gathered");
  }
  // An evicted prefetch is still being written: wait for it before the buffer goes.
  if (!st.works.empty()) {
    const auto t0 = Clock::now();
    for (comm::Work& w : st.works) w.wait_on(allocator_->device().compute_stream());
    stats_.exposed_s += std::chrono::duration<double>(Clock::now() - t0).count();
    for (comm::Work& w : st.works) {
      if (w.done()) stats_.busy_s += w.end_s() - w.start_s();
    }
    st.works.clear();
  }
  wait_upload(st);
  if (st.bound) unbind(u);
  if (!un.persistent) {
    live_elems_ -= un.elems();
    live_bytes_ -= st.buffer.nbytes();
  }
  st.buffer = tensor::Tensor();
}

void ParamGatherer::refresh_persistent() {
  if (!away_.empty()) throw_away("ParamGatherer::refresh_persistent");
  for (int u = 0; u < num_units(); ++u) {
    const ParamUnit& un = units_[static_cast<size_t>(u)];
    if (!un.persistent || un.elems() == 0) continue;
    UnitState& st = state_[static_cast<size_t>(u)];
    if (st.buffer.defined()) {
      tensor::Tensor buffer = std::move(st.buffer);  // refilled in place
      issue(u, std::move(buffer));
    } else {
      gather(u);
    }
    wait(u);
  }
}

void ParamGatherer::gather_all() {
  if (!away_.empty()) throw_away("ParamGatherer::gather_all");
  for (int u = 0; u < num_units(); ++u) {
    if (units_[static_cast<size_t>(u)].persistent || live(u) || units_[static_cast<size_t>(u)].elems() == 0) continue;
    gather(u);
  }
  for (int u = 0; u < num_units(); ++u) {
    if (live(u)) wait(u);
  }
}

void ParamGatherer::release_all() {
  for (int u = 0; u < num_units(); ++u) {
    if (!units_[static_cast<size_t>(u)].persistent && live(u)) release(u);
  }
}

void ParamGatherer::abort() {
  if (h2d_) {
    try {
      h2d_->stream().synchronize();  // no upload may write a buffer dropped below
    } catch (...) {       // the step that failed reports the error
    }
  }
  for (int u = 0; u < num_units(); ++u) {
    state_[static_cast<size_t>(u)].uploading = false;
    UnitState& st = state_[static_cast<size_t>(u)];
    if (units_[static_cast<size_t>(u)].persistent || !st.buffer.defined()) continue;
    st.works.clear();
    if (st.bound) unbind(u);
    live_elems_ -= units_[static_cast<size_t>(u)].elems();
    live_bytes_ -= st.buffer.nbytes();
    st.buffer = tensor::Tensor();
  }
}

void ParamGatherer::for_each_state(const std::function<void(tensor::Tensor&)>& f) {
  for (size_t u = 0; u < units_.size(); ++u) {
    if (units_[u].persistent) f(state_[u].buffer);
  }
}

void ParamGatherer::set_away(std::string why, tensor::Tensor shard) {
  PORTER_CHECK(live_elems_ == 0, "ParamGatherer::set_away: ", live_elems_,
               " gathered elements are live (only between steps)");
  away_ = std::move(why);
  bool changed = false;
  for (size_t u = 0; u < units_.size(); ++u) {
    UnitState& st = state_[u];
    if (!units_[u].persistent || st.buffer.defined() == st.bound) continue;
    // Bound to a buffer that went away, or a buffer back that is not bound yet.
    if (st.bound) {
      for (size_t i : units_[u].entries) flat_->clear_param_view(i);
    } else {
      for (size_t i : units_[u].entries) {
        const nn::ParamEntry& e = flat_->layout().entries().at(i);
        const int64_t off = e.offset_elems - units_[u].lo;
        flat_->set_param_view(i, st.buffer.slice(off, off + e.shape.numel()).reshape(e.shape));
      }
    }
    st.bound = !st.bound;
    changed = true;
  }
  if (!away_.empty()) {
    if (shard_.owns_memory()) shard_ = tensor::Tensor();  // the optimizer moves it
  } else {
    PORTER_CHECK(shard.defined() && shard.numel() == part_.shard_elems,
                 "ParamGatherer::set_away: the working shard back has ",
                 shard.defined() ? shard.numel() : 0, " elements, the partition's shard ",
                 part_.shard_elems);
    shard_ = std::move(shard);
  }
  if (changed) rebind_();
}

void ParamGatherer::throw_away(const char* what) const {
  throw UsageError(std::string(what) + ": " + away_);
}

void ParamGatherer::check() {
  if (h2d_) h2d_->stream().synchronize();
}

GatherStats& GatherStats::operator+=(const GatherStats& s) {
  gathers += s.gathers;
  gathered_bytes += s.gathered_bytes;
  h2d_bytes += s.h2d_bytes;
  busy_s += s.busy_s;
  exposed_s += s.exposed_s;
  peak_live_elems = std::max(peak_live_elems, s.peak_live_elems);
  peak_live_bytes = std::max(peak_live_bytes, s.peak_live_bytes);
  return *this;
}

memory::HostTierStats ParamGatherer::host_tier_stats() const {
  return h2d_ ? h2d_->stats() : memory::HostTierStats{};
}

GatherStats ParamGatherer::take_stats() {
  GatherStats s = stats_;
  if (h2d_) {
    const uint64_t up = h2d_->stats().h2d_bytes;
    s.h2d_bytes = up - h2d_taken_bytes_;
    h2d_taken_bytes_ = up;
  }
  stats_ = GatherStats{};
  stats_.peak_live_elems = live_elems_;
  stats_.peak_live_bytes = live_bytes_;
  return s;
}

}  // namespace porter::zero
