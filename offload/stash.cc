// The checkpoint stash (Note [Stash protocol] in stash.h).
#include "offload/stash.h"

#include <algorithm>
#include <exception>
#include <string>
#include <utility>

#include "base/check.h"
#include "base/error.h"
#include "base/log.h"
#include "base/units.h"

namespace porter::offload {

namespace {

// A copy's interval, written by the callbacks around it on its stream.
struct CopyTiming {
  CopyRecord record;
  bool done = false;  // the end callback ran
};

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

struct CheckpointStash::Impl {
  memory::Device* device = nullptr;  // not owned
  std::unique_ptr<memory::Event> compute_point;  // recorded on compute, waited on by copies

  // Arenas (contiguous_memory_optimization).
  memory::PinnedBuffer pinned_arena;
  memory::DeviceBuffer staging_arena;

  struct Entry {
    bool offloaded = false;
    bool prefetched = false;
    bool fetched = false;
    bool released = false;
    nn::Shape shape;
    nn::DType dtype = nn::DType::kF32;
    size_t nbytes = 0;
    memory::PinnedBuffer pinned;  // not contiguous: this entry's pinned slot
    void* host = nullptr;         // the pinned slot (own buffer or arena)
    nn::Tensor staged;            // the device copy, once prefetched
    std::unique_ptr<memory::Event> d2h_done;
    std::unique_ptr<memory::Event> h2d_done;
    std::shared_ptr<CopyTiming> h2d_timing;
  };
  std::vector<Entry> entries;
  bool active = false;
  int micro_batch = 0;

  // Accounting of what the stash holds right now (pinned slots, staging slots).
  size_t pinned_current = 0;
  size_t staging_current = 0;

  // Guards everything below: the copy streams' callbacks write records.
  mutable std::mutex mu;
  StashStats stats;
  std::vector<CopyRecord> copies;
  struct PendingWait {
    WaitRecord record;
    bool reached = false;  // the compute stream's callback ran
    std::shared_ptr<CopyTiming> copy;
  };
  // Until both the compute stream reached the wait and the copy's end is known.
  std::vector<std::shared_ptr<PendingWait>> pending_waits;
  std::vector<WaitRecord> waits;

  void note_pinned(size_t add, size_t remove) {
    pinned_current = pinned_current + add - remove;
    std::lock_guard<std::mutex> lock(mu);
    stats.pinned_peak_bytes = std::max(stats.pinned_peak_bytes, pinned_current);
  }
  void note_staging(size_t add, size_t remove) {
    staging_current = staging_current + add - remove;
    std::lock_guard<std::mutex> lock(mu);
    stats.staging_peak_bytes = std::max(stats.staging_peak_bytes, staging_current);
  }

  // Queues `bytes` from src to dst on `stream`, bracketed by timing callbacks.
  std::shared_ptr<CopyTiming> timed_copy(memory::Stream& stream, CopyRecord::Direction dir,
                                         int stage, void* dst, const void* src, size_t bytes) {
    auto timing = std::make_shared<CopyTiming>();
    timing->record.direction = dir;
    timing->record.stage = stage;
    timing->record.micro_batch = micro_batch;
    timing->record.bytes = bytes;
    stream.host_callback([timing] { timing->record.start = Clock::now(); });
    stream.copy_async(dst, src, bytes);
    stream.host_callback([this, timing] {
      const Clock::time_point end = Clock::now();
      std::lock_guard<std::mutex> lock(mu);
      timing->record.end = end;
      timing->done = true;
      stats.copy_busy_s += timing->record.seconds();
      copies.push_back(timing->record);
    });
    return timing;
  }

  // Moves the waits whose copies have finished into `waits`. Caller holds mu.
  void resolve_waits_locked() {
    auto ready = [](const std::shared_ptr<PendingWait>& w) { return w->reached && w->copy->done; };
    for (const std::shared_ptr<PendingWait>& w : pending_waits) {
      if (!ready(w)) continue;
      w->record.exposed_s = std::max(0.0, seconds_between(w->record.reached, w->copy->record.end));
      stats.exposed_wait_s += w->record.exposed_s;
      waits.push_back(w->record);
    }
    std::erase_if(pending_waits, ready);
  }

  // Frees the micro-batch's slots. The copy streams must be idle (or their work irrelevant).
  void drop_entries() {
    for (Entry& e : entries) {
      e.staged = nn::Tensor();
      e.pinned.reset();
      e.host = nullptr;
      e.offloaded = e.prefetched = e.fetched = e.released = false;
    }
    staging_current = 0;
    pinned_current = 0;
  }
};

CheckpointStash::CheckpointStash(memory::CachingAllocator& allocator, memory::PinnedPool& pinned,
                                 StashOptions options)
    : allocator_(&allocator), pinned_(&pinned), options_(options), impl_(std::make_unique<Impl>()) {
  memory::Device& device = allocator.device();
  impl_->device = &device;
  impl_->compute_point = device.create_event();
  d2h_ = device.create_stream("offload.d2h");
  h2d_ = device.create_stream("offload.h2d");
}

CheckpointStash::~CheckpointStash() {
  abort();
  // The streams' queued callbacks write into impl_: let them run while it is alive.
  for (memory::Stream* s : {d2h_.get(), h2d_.get()}) {
    try {
      s->synchronize();
    } catch (const std::exception& ex) {
      PORTER_LOG_ERROR("offload stream '{}' failed: {}", s->name(), ex.what());
    }
  }
  // The arenas go back to their pools before the streams (and the events recorded on them)
  // go away; nothing the streams still run can touch them after abort().
  impl_->staging_arena.reset();
  impl_->pinned_arena.reset();
}

void CheckpointStash::prepare(const checkpoint::OffloadLayout& layout) {
  PORTER_CHECK_T(UsageError, !impl_->active, "CheckpointStash::prepare during a micro-batch");
  // Note [One contiguity]: the prediction of a layout is of its own contiguity, so the stash
  // runs no other.
  auto on_off = [](bool b) { return b ? "true" : "false"; };
  PORTER_CHECK(layout.contiguous == options_.contiguous,
               "CheckpointStash::prepare: the offload layout was planned with "
               "activation_checkpointing.contiguous_memory_optimization = ",
               on_off(layout.contiguous), " but the stash runs with ", on_off(options_.contiguous),
               ", so the plan's staging and pinned bytes are not what the stash would allocate; "
               "plan with the engine's offload options (make_plan with "
               "checkpoint::offload_options(config), or plan_layout with the same contiguity)");
  const memory::PinnedStats ps = pinned_->stats();
  // The stash's own arena is given back before the new one is taken, so it does not count.
  const size_t own = impl_->pinned_arena.size_bytes();
  const size_t others = ps.in_use_bytes > own ? ps.in_use_bytes - own : 0;
  if (layout.pinned_bytes > 0 && others + layout.pinned_bytes > ps.limit_bytes) {
    throw OutOfMemoryError(
        str_cat("offload needs ", format_bytes(layout.pinned_bytes), " of pinned host memory per ",
                "micro-batch for ", layout.entries.size(), " host-held checkpoints, but ",
                "porter.device.pinned_limit is ", format_bytes(ps.limit_bytes),
                others > 0 ? str_cat(" (", format_bytes(others), " already in use)") : std::string(),
                "; raise porter.device.pinned_limit, keep more checkpoints on device "
                "(porter.checkpointing.keep_last_on_device) or turn off "
                "activation_checkpointing.cpu_checkpointing"),
        layout.pinned_bytes);
  }
  for (const checkpoint::StashEntry& e : layout.entries) {
    PORTER_CHECK(e.bytes <= layout.staging_slot_bytes || e.use_op < 0, "stash entry of stage ",
                 e.stage, " (", e.bytes, " bytes) does not fit the staging slot of ",
                 layout.staging_slot_bytes, " bytes");
    PORTER_CHECK(e.use_op < 0 || (e.staging_slot >= 0 && e.staging_slot < layout.staging_slots),
                 "stash entry of stage ", e.stage, " has staging slot ", e.staging_slot, " of ",
                 layout.staging_slots);
    PORTER_CHECK(e.pinned_offset + e.bytes <= layout.pinned_bytes, "stash entry of stage ", e.stage,
                 " ends past the pinned arena");
  }

  memory::PinnedBuffer pinned_arena;
  memory::DeviceBuffer staging_arena;
  if (options_.contiguous) {
    auto take = [&] {
      pinned_arena = pinned_->allocate(layout.pinned_bytes);
      staging_arena = allocator_->allocate(layout.staging_arena_bytes(), memory::Category::kStaging);
    };
    try {
      take();  // beside the old arenas, so a failure leaves the old layout usable
    } catch (const OutOfMemoryError&) {
      pinned_arena.reset();
      staging_arena.reset();
      if (impl_->pinned_arena.empty() && impl_->staging_arena.empty()) throw;
      // Perhaps only one of them fits: give the old ones back and try once more. If that
      // fails too, the stash has no layout until the next successful prepare().
      impl_->pinned_arena.reset();
      impl_->staging_arena.reset();
      layout_ = checkpoint::OffloadLayout{};
      impl_->entries.clear();
      take();
    }
  }
  impl_->pinned_arena = std::move(pinned_arena);
  impl_->staging_arena = std::move(staging_arena);
  layout_ = layout;
  impl_->entries.clear();
  impl_->entries.resize(layout.entries.size());
  for (Impl::Entry& e : impl_->entries) {
    e.d2h_done = impl_->device->create_event();
    e.h2d_done = impl_->device->create_event();
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->stats.pinned_peak_bytes =
      std::max(impl_->stats.pinned_peak_bytes, impl_->pinned_arena.size_bytes());
  impl_->stats.staging_peak_bytes =
      std::max(impl_->stats.staging_peak_bytes, impl_->staging_arena.size_bytes());
}

void CheckpointStash::begin(int micro_batch) {
  PORTER_CHECK_T(UsageError, !impl_->active,
                 "CheckpointStash::begin: the previous micro-batch did not end");
  impl_->active = true;
  impl_->micro_batch = micro_batch;
}

namespace {

void check_entry(const checkpoint::OffloadLayout& layout, int entry, const char* what) {
  PORTER_CHECK_T(UsageError, entry >= 0 && static_cast<size_t>(entry) < layout.entries.size(),
                 "CheckpointStash::", what, ": no entry ", entry, " in a layout of ",
                 layout.entries.size());
}

}  // namespace

void CheckpointStash::offload(int entry, const nn::Tensor& t) {
  check_entry(layout_, entry, "offload");
  PORTER_CHECK_T(UsageError, impl_->active, "CheckpointStash::offload outside a micro-batch");
  const checkpoint::StashEntry& le = layout_.entries[static_cast<size_t>(entry)];
  Impl::Entry& e = impl_->entries[static_cast<size_t>(entry)];
  PORTER_CHECK_T(UsageError, !e.offloaded, "checkpoint of stage ", le.stage,
                 " offloaded twice in one micro-batch");
  PORTER_CHECK_T(UsageError, t.owns_memory(), "offload of stage ", le.stage,
                 "'s input: the tensor must own allocator memory");
  PORTER_CHECK(t.nbytes() <= le.bytes, "offload of stage ", le.stage, "'s input: ", t.nbytes(),
               " bytes, but the plan sized its slot for ", le.bytes);
  e.shape = t.shape();
  e.dtype = t.dtype();
  e.nbytes = t.nbytes();
  if (options_.contiguous) {
    e.host = static_cast<std::byte*>(impl_->pinned_arena.data()) + le.pinned_offset;
  } else {
    e.pinned = pinned_->allocate(std::max<size_t>(e.nbytes, 1));
    e.host = e.pinned.data();
    impl_->note_pinned(e.pinned.size_bytes(), 0);
  }
  memory::Stream& compute = impl_->device->compute_stream();
  compute.record(*impl_->compute_point);
  d2h_->wait(*impl_->compute_point);
  impl_->timed_copy(*d2h_, CopyRecord::Direction::kD2H, le.stage, e.host, t.data(), e.nbytes);
  d2h_->record(*e.d2h_done);
  // The allocator frees a_i only when the copy has read it (Note [Deferred free]).
  t.record_stream(*d2h_);
  if (!e.pinned.empty()) e.pinned.record_stream(*d2h_);
  e.offloaded = true;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stats.d2h_bytes += e.nbytes;
  }
  if (options_.synchronize_boundary) {
    WaitRecord w{le.stage, impl_->micro_batch, Clock::now(), 0.0};
    e.d2h_done->synchronize();
    w.exposed_s = seconds_between(w.reached, Clock::now());
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stats.exposed_wait_s += w.exposed_s;
    impl_->waits.push_back(w);
  }
}

void CheckpointStash::prefetch(int entry) {
  check_entry(layout_, entry, "prefetch");
  const checkpoint::StashEntry& le = layout_.entries[static_cast<size_t>(entry)];
  Impl::Entry& e = impl_->entries[static_cast<size_t>(entry)];
  PORTER_CHECK_T(UsageError, e.offloaded, "prefetch of stage ", le.stage,
                 "'s checkpoint before it was offloaded");
  PORTER_CHECK_T(UsageError, !e.prefetched, "prefetch of stage ", le.stage, "'s checkpoint twice");
  if (options_.contiguous) {
    void* slot = static_cast<std::byte*>(impl_->staging_arena.data()) +
                 static_cast<size_t>(le.staging_slot) * layout_.staging_slot_bytes;
    e.staged = nn::Tensor::from_blob(slot, e.shape, e.dtype, memory::Category::kStaging);
  } else {
    e.staged = nn::Tensor::empty(*allocator_, e.shape, e.dtype, memory::Category::kStaging);
    impl_->note_staging(e.nbytes, 0);
  }
  memory::Stream& compute = impl_->device->compute_stream();
  // The slot may have been compute-stream memory a moment ago, and the pinned copy must
  // have landed.
  compute.record(*impl_->compute_point);
  h2d_->wait(*impl_->compute_point);
  h2d_->wait(*e.d2h_done);
  e.h2d_timing = impl_->timed_copy(*h2d_, CopyRecord::Direction::kH2D, le.stage, e.staged.data(),
                                   e.host, e.nbytes);
  h2d_->record(*e.h2d_done);
  e.prefetched = true;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stats.h2d_bytes += e.nbytes;
  }
  // The pinned slot is free once the copy has read it.
  if (!e.pinned.empty()) {
    e.pinned.record_stream(*h2d_);
    impl_->note_pinned(0, e.pinned.size_bytes());
    e.pinned.reset();
  }
}

nn::Tensor CheckpointStash::fetch(int entry) {
  check_entry(layout_, entry, "fetch");
  const checkpoint::StashEntry& le = layout_.entries[static_cast<size_t>(entry)];
  Impl::Entry& e = impl_->entries[static_cast<size_t>(entry)];
  PORTER_CHECK_T(UsageError, !e.fetched, "fetch of stage ", le.stage, "'s checkpoint twice");
  if (!e.prefetched) prefetch(entry);
  memory::Stream& compute = impl_->device->compute_stream();
  auto pending = std::make_shared<Impl::PendingWait>();
  pending->record.stage = le.stage;
  pending->record.micro_batch = impl_->micro_batch;
  pending->copy = e.h2d_timing;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->pending_waits.push_back(pending);
  }
  // On cpu the callback runs inline (the compute stream is this thread); on cuda when the
  // stream reaches it.
  Impl* impl = impl_.get();
  compute.host_callback([impl, pending] {
    const Clock::time_point now = Clock::now();
    std::lock_guard<std::mutex> lock(impl->mu);
    pending->record.reached = now;
    pending->reached = true;
  });
  compute.wait(*e.h2d_done);
  e.fetched = true;
  return e.staged;
}

void CheckpointStash::release(int entry) {
  check_entry(layout_, entry, "release");
  const checkpoint::StashEntry& le = layout_.entries[static_cast<size_t>(entry)];
  Impl::Entry& e = impl_->entries[static_cast<size_t>(entry)];
  PORTER_CHECK_T(UsageError, e.offloaded && !e.released, "release of stage ", le.stage,
                 "'s checkpoint, which is not stashed");
  // A prefetch that was never fetched may still be writing its slot.
  if (e.prefetched && !e.fetched) impl_->device->compute_stream().wait(*e.h2d_done);
  if (e.prefetched && !options_.contiguous) impl_->note_staging(0, e.nbytes);
  e.staged = nn::Tensor();
  if (!e.pinned.empty()) {  // never read back: free it once the D2H copy landed
    impl_->note_pinned(0, e.pinned.size_bytes());
    e.pinned.reset();
  }
  e.host = nullptr;
  e.released = true;
}

void CheckpointStash::end() {
  PORTER_CHECK_T(UsageError, impl_->active, "CheckpointStash::end outside a micro-batch");
  for (size_t i = 0; i < impl_->entries.size(); ++i) {
    const Impl::Entry& e = impl_->entries[i];
    if (!e.offloaded || !e.released) {
      const int stage = layout_.entries[i].stage;
      abort();
      throw InternalError(str_cat("micro-batch ended with the checkpoint of stage ", stage,
                                  e.offloaded ? " not released" : " never offloaded",
                                  " (Note [Stash protocol])"));
    }
  }
  for (Impl::Entry& e : impl_->entries) e.offloaded = e.prefetched = e.fetched = e.released = false;
  impl_->active = false;
}

void CheckpointStash::abort() noexcept {
  if (!impl_->active) return;
  for (memory::Stream* s : {d2h_.get(), h2d_.get()}) {
    try {
      s->synchronize();
    } catch (const std::exception& ex) {
      PORTER_LOG_ERROR("offload stream '{}' failed while aborting a micro-batch: {}", s->name(),
                       ex.what());
    }
  }
  impl_->drop_entries();
  impl_->active = false;
}

void CheckpointStash::synchronize() {
  d2h_->synchronize();
  h2d_->synchronize();
  impl_->device->compute_stream().synchronize();
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->resolve_waits_locked();
}

StashStats CheckpointStash::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->resolve_waits_locked();
  return impl_->stats;
}

void CheckpointStash::reset_stats() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->stats = StashStats{};
  impl_->stats.pinned_peak_bytes = impl_->pinned_arena.size_bytes();
  impl_->stats.staging_peak_bytes = impl_->staging_arena.size_bytes();
}

std::vector<CopyRecord> CheckpointStash::take_copies() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return std::exchange(impl_->copies, {});
}

std::vector<WaitRecord> CheckpointStash::take_waits() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->resolve_waits_locked();
  return std::exchange(impl_->waits, {});
}

}  // namespace porter::offload
