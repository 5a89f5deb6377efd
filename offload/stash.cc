// The checkpoint stash (Note [Stash protocol] and Note [Stash partition] in stash.h).
#include "offload/stash.h"

#include <algorithm>
#include <cstring>
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

// A gather's interval, written by the callbacks around it on the tp comm stream. Those
// callbacks reach nothing but this (the comm stream is not the stash's to drain), hence its
// own lock.
struct GatherTiming {
  mutable std::mutex mu;
  GatherRecord record;  // start and end under mu
  bool done = false;    // the end callback ran; under mu
  bool is_done(Clock::time_point* end = nullptr) const {
    std::lock_guard<std::mutex> lock(mu);
    if (done && end != nullptr) *end = record.end;
    return done;
  }
};

// This rank's block of a partitioned entry (Note [Partition semantics]): its offset in the
// checkpoint's bytes, the bytes of it that exist, and the padding to slice_bytes.
struct Block {
  size_t offset = 0;
  size_t length = 0;
  size_t padding = 0;
};
Block block_of(const checkpoint::StashEntry& e, int rank) {
  Block b;
  b.offset = std::min(static_cast<size_t>(rank) * e.slice_bytes, e.bytes);
  b.length = std::min(e.slice_bytes, e.bytes - b.offset);
  b.padding = e.slice_bytes - b.length;
  return b;
}

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

struct CheckpointStash::Impl {
  memory::Device* device = nullptr;  // not owned
  std::unique_ptr<memory::Event> compute_point;  // recorded on compute, waited on by copies

  // Arenas (contiguous_memory_optimization).
  memory::HostBlock pinned_arena;
  memory::DeviceBuffer staging_arena;
  memory::DeviceBuffer slice_arena;  // device slices of partitioned entries
  // Zeros for the padding of this rank's blocks (Note [Partition semantics]); empty when no
  // block needs any.
  memory::HostBlock zeros;
  int rank = 0;  // in the tp group

  struct Entry {
    bool offloaded = false;
    bool prefetched = false;
    bool fetched = false;
    bool released = false;
    tensor::Shape shape;
    tensor::DType dtype = tensor::DType::kF32;
    size_t nbytes = 0;
    memory::HostBlock pinned;     // not contiguous: this entry's pinned slot
    void* host = nullptr;         // the pinned slot (own buffer or arena)
    tensor::Tensor staged;            // the device copy, once prefetched
    std::unique_ptr<memory::Event> d2h_done;
    std::unique_ptr<memory::Event> h2d_done;
    std::shared_ptr<CopyTiming> h2d_timing;
    // Partitioned entries.
    memory::DeviceBuffer slice;   // not contiguous: the device slice
    void* slice_ptr = nullptr;    // the device slice (own buffer or arena), until fetched
    tensor::Tensor gathered;          // not contiguous: the gathered copy, t x slice_bytes
    void* gathered_ptr = nullptr;
    comm::Work gather;            // issued by prefetch()
    bool gather_waited = false;   // the compute stream waited for it
    std::shared_ptr<GatherTiming> gather_timing;
  };
  std::vector<Entry> entries;
  bool active = false;
  int micro_batch = 0;

  // Accounting of what the stash holds right now (pinned slots, staging slots, slices).
  size_t pinned_current = 0;
  size_t staging_current = 0;
  size_t slice_current = 0;

  // Guards everything below: the copy streams' callbacks write records.
  mutable std::mutex mu;
  StashStats stats;
  std::vector<CopyRecord> copies;
  struct PendingWait {
    WaitRecord record;
    bool reached = false;  // the compute stream's callback ran
    std::shared_ptr<CopyTiming> copy;      // null for a device-partitioned entry
    std::shared_ptr<GatherTiming> gather;  // null for a plain host hold
  };
  // Until the compute stream reached the wait and the ends of its copy and gather are known.
  std::vector<std::shared_ptr<PendingWait>> pending_waits;
  std::vector<WaitRecord> waits;
  // Gathers whose end is not known yet, and the finished ones not taken.
  std::vector<std::shared_ptr<GatherTiming>> pending_gathers;
  std::vector<GatherRecord> gathers;

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
  void note_slice(size_t add, size_t remove) {
    slice_current = slice_current + add - remove;
    std::lock_guard<std::mutex> lock(mu);
    stats.slice_peak_bytes = std::max(stats.slice_peak_bytes, slice_current);
  }

  // Queues `bytes` from src to dst on `lane`, then `padding` zeros after them, bracketed by
  // timing callbacks.
  std::shared_ptr<CopyTiming> timed_copy(memory::HostLane& lane, CopyRecord::Direction dir,
                                         int stage, void* dst, const void* src, size_t bytes,
                                         size_t padding = 0) {
    memory::Stream& stream = lane.stream();
    const bool down = dir == CopyRecord::Direction::kD2H;
    auto timing = std::make_shared<CopyTiming>();
    timing->record.direction = dir;
    timing->record.stage = stage;
    timing->record.micro_batch = micro_batch;
    timing->record.bytes = bytes + padding;
    stream.host_callback([timing] { timing->record.start = Clock::now(); });
    if (down) {
      lane.to_host(dst, src, bytes);
      if (padding > 0) lane.to_host(static_cast<std::byte*>(dst) + bytes, zeros.data(), padding);
    } else {
      lane.to_device(dst, src, bytes);
    }
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

  // Moves the waits whose copies and gathers have finished into `waits`, and the finished
  // gathers into `gathers`. Caller holds mu. The wait is split at the copy's end: until then
  // it waited for the copy, after it for the gather.
  void resolve_waits_locked() {
    // Each predicate runs once per element (remove_if), so what it folds in is erased with it
    // even when a stream finishes meanwhile.
    std::erase_if(pending_gathers, [this](const std::shared_ptr<GatherTiming>& g) {
      std::lock_guard<std::mutex> lock(g->mu);
      if (!g->done) return false;
      stats.gather_busy_s += g->record.seconds();
      gathers.push_back(g->record);
      return true;
    });
    std::erase_if(pending_waits, [this](const std::shared_ptr<PendingWait>& w) {
      Clock::time_point gathered;
      if (!w->reached || (w->copy != nullptr && !w->copy->done) ||
          (w->gather != nullptr && !w->gather->is_done(&gathered))) {
        return false;
      }
      Clock::time_point copied = w->record.reached;
      if (w->copy != nullptr) {
        w->record.exposed_s = std::max(0.0, seconds_between(w->record.reached, w->copy->record.end));
        copied = std::max(copied, w->copy->record.end);
      }
      if (w->gather != nullptr) w->record.gather_exposed_s = std::max(0.0, seconds_between(copied, gathered));
      stats.exposed_wait_s += w->record.exposed_s;
      stats.gather_exposed_s += w->record.gather_exposed_s;
      waits.push_back(w->record);
      return true;
    });
  }

  // Waits for every gather issued and not waited on, so none still writes into a buffer about
  // to be freed; an error is logged, not thrown (the caller is unwinding already).
  void wait_for_gathers() noexcept {
    for (Entry& e : entries) {
      if (!e.gather.valid() || e.gather_waited) continue;
      try {
        e.gather.wait();
      } catch (const std::exception& ex) {
        PORTER_LOG_ERROR("rank {}: a checkpoint gather failed while aborting a micro-batch: {}", rank,
                         ex.what());
      }
      e.gather_waited = true;
    }
  }

  // Frees the micro-batch's slots. The copy streams and the gathers must be idle (or their
  // work irrelevant).
  void drop_entries() {
    for (Entry& e : entries) {
      e.staged = tensor::Tensor();
      e.pinned.reset();
      e.host = nullptr;
      e.slice.reset();
      e.slice_ptr = nullptr;
      e.gathered = tensor::Tensor();
      e.gathered_ptr = nullptr;
      e.gather = comm::Work();
      e.gather_waited = false;
      e.gather_timing.reset();
      e.offloaded = e.prefetched = e.fetched = e.released = false;
    }
    staging_current = 0;
    pinned_current = 0;
    slice_current = 0;
    std::lock_guard<std::mutex> lock(mu);
    // A gather that failed at its call never ran its end callback; nothing will finish it.
    std::erase_if(pending_gathers, [](const std::shared_ptr<GatherTiming>& g) { return !g->is_done(); });
    std::erase_if(pending_waits, [](const std::shared_ptr<PendingWait>& w) {
      return w->gather != nullptr && !w->gather->is_done();
    });
  }
};

CheckpointStash::CheckpointStash(memory::CachingAllocator& allocator, memory::HostTier& host,
                                 StashOptions options)
    : CheckpointStash(allocator, nullptr, &host, options) {}

CheckpointStash::CheckpointStash(memory::CachingAllocator& allocator, memory::PinnedPool& pinned,
                                 StashOptions options)
    : CheckpointStash(allocator, std::make_unique<memory::PinnedHostTier>(pinned), nullptr, options) {}

CheckpointStash::CheckpointStash(memory::CachingAllocator& allocator,
                                 std::unique_ptr<memory::HostTier> owned, memory::HostTier* host,
                                 StashOptions options)
    : allocator_(&allocator),
      owned_host_(std::move(owned)),
      host_(host != nullptr ? host : owned_host_.get()),
      options_(options),
      impl_(std::make_unique<Impl>()) {
  PORTER_CHECK(&host_->device() == &allocator.device(),
               "CheckpointStash: the host tier is over another device than the allocator");
  memory::Device& device = allocator.device();
  impl_->device = &device;
  impl_->compute_point = device.create_event();
  d2h_ = host_->open_lane("offload.d2h");
  h2d_ = host_->open_lane("offload.h2d");
}

CheckpointStash::~CheckpointStash() {
  abort();
  // The streams' queued callbacks write into impl_: let them run while it is alive.
  for (memory::Stream* s : {&d2h_->stream(), &h2d_->stream()}) {
    try {
      s->synchronize();
    } catch (const std::exception& ex) {
      PORTER_LOG_ERROR("offload stream '{}' failed: {}", s->name(), ex.what());
    }
  }
  // The arenas go back to their pools before the streams (and the events recorded on them)
  // go away; nothing the streams still run can touch them after abort().
  impl_->staging_arena.reset();
  impl_->slice_arena.reset();
  impl_->pinned_arena.reset();
  impl_->zeros.reset();
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
               "engine::make_run_options(config).plan, or plan_layout with the same contiguity)");
  // Note [Stash partition]: partitioned entries are gathered on the tp group the layout was
  // planned for.
  size_t partitioned = 0;
  for (const checkpoint::StashEntry& e : layout.entries) partitioned += e.partitioned ? 1 : 0;
  comm::Communicator* tp = options_.tp;
  if (partitioned > 0) {
    PORTER_CHECK(tp != nullptr, "CheckpointStash::prepare: the offload layout has ", partitioned,
                 " partitioned checkpoints (activation_checkpointing.partition_activations), but the "
                 "stash has no tensor-parallel communicator to gather them on (StashOptions::tp); pass "
                 "the tp group's communicator, or plan with partition ways 1");
    PORTER_CHECK(tp->size() == layout.ways, "CheckpointStash::prepare: the offload layout partitions ",
                 partitioned, " checkpoints ", layout.ways, " ways, but the tensor-parallel communicator "
                 "(StashOptions::tp, group '", tp->group_name(), "') has ", tp->size(),
                 " ranks; plan with partition ways = porter.model.tensor_parallel = the tp group's size");
  }
  const int rank = partitioned > 0 ? tp->rank() : 0;
  const size_t limit = host_->limit_bytes();
  const size_t in_use = host_->in_use_bytes();
  // The stash's own arena and zeros are given back before the new ones are taken, so they do
  // not count.
  const size_t own = impl_->pinned_arena.size_bytes() + impl_->zeros.size_bytes();
  const size_t others = in_use > own ? in_use - own : 0;
  if (layout.pinned_bytes > 0 && others + layout.pinned_bytes > limit) {
    throw OutOfMemoryError(
        str_cat("offload needs ", format_bytes(layout.pinned_bytes), " of ", host_->name(), " per ",
                "micro-batch for ", layout.entries.size(), " host-held checkpoints, but ",
                host_->limit_key(), " is ", format_bytes(limit),
                others > 0 ? str_cat(" (", format_bytes(others), " already in use)") : std::string(),
                "; raise ", host_->limit_key(), ", keep more checkpoints on device "
                "(porter.checkpointing.keep_last_on_device) or turn off "
                "activation_checkpointing.cpu_checkpointing"),
        layout.pinned_bytes);
  }
  size_t padding = 0;  // the most zeros one of this rank's blocks needs
  for (const checkpoint::StashEntry& e : layout.entries) {
    const size_t staged = layout.staged_bytes(e);
    PORTER_CHECK(staged <= layout.staging_slot_bytes || e.use_op < 0, "stash entry of stage ",
                 e.stage, " (", staged, " bytes staged) does not fit the staging slot of ",
                 layout.staging_slot_bytes, " bytes");
    PORTER_CHECK(e.use_op < 0 || (e.staging_slot >= 0 && e.staging_slot < layout.staging_slots),
                 "stash entry of stage ", e.stage, " has staging slot ", e.staging_slot, " of ",
                 layout.staging_slots);
    PORTER_CHECK(e.on_host || e.partitioned, "stash entry of stage ", e.stage,
                 " is neither on the host nor partitioned");
    PORTER_CHECK(!e.on_host || e.pinned_offset + layout.host_bytes(e) <= layout.pinned_bytes,
                 "stash entry of stage ", e.stage, " ends past the pinned arena");
    if (!e.partitioned) continue;
    PORTER_CHECK(e.slice_bytes == checkpoint::partition_slice_bytes(e.bytes, layout.ways),
                 "stash entry of stage ", e.stage, ": slice of ", e.slice_bytes, " bytes, but ",
                 e.bytes, " bytes in ", layout.ways, " ways make slices of ",
                 checkpoint::partition_slice_bytes(e.bytes, layout.ways));
    PORTER_CHECK(e.on_host || e.slice_bytes <= layout.slice_slot_bytes || !options_.contiguous,
                 "stash entry of stage ", e.stage, " (a slice of ", e.slice_bytes,
                 " bytes) does not fit the slice slot of ", layout.slice_slot_bytes, " bytes");
    PORTER_CHECK(e.on_host || !options_.contiguous || (e.slice_slot >= 0 && e.slice_slot < layout.slice_slots),
                 "stash entry of stage ", e.stage, " has slice slot ", e.slice_slot, " of ",
                 layout.slice_slots);
    padding = std::max(padding, block_of(e, rank).padding);
  }

  // Zeros first: if they do not fit, nothing has changed. Fresh from the pool (nothing queued
  // reads a buffer the pool hands out), so the host may write them.
  memory::HostBlock zeros;
  if (padding > 0) {
    zeros = host_->allocate(padding);
    std::memset(zeros.data(), 0, zeros.size_bytes());
  }
  memory::HostBlock pinned_arena;
  memory::DeviceBuffer staging_arena;
  memory::DeviceBuffer slice_arena;
  if (options_.contiguous) {
    auto take = [&] {
      pinned_arena = host_->allocate(layout.pinned_bytes);
      staging_arena = allocator_->allocate(layout.staging_arena_bytes(), memory::Category::kStaging);
      slice_arena = allocator_->allocate(layout.slice_arena_bytes(), memory::Category::kCheckpoints);
    };
    try {
      take();  // beside the old arenas, so a failure leaves the old layout usable
    } catch (const OutOfMemoryError&) {
      pinned_arena.reset();
      staging_arena.reset();
      slice_arena.reset();
      if (impl_->pinned_arena.empty() && impl_->staging_arena.empty() && impl_->slice_arena.empty()) throw;
      // Perhaps only one of them fits: give the old ones back and try once more. If that
      // fails too, the stash has no layout until the next successful prepare().
      impl_->pinned_arena.reset();
      impl_->staging_arena.reset();
      impl_->slice_arena.reset();
      layout_ = checkpoint::OffloadLayout{};
      impl_->entries.clear();
      take();
    }
  }
  impl_->pinned_arena = std::move(pinned_arena);
  impl_->staging_arena = std::move(staging_arena);
  impl_->slice_arena = std::move(slice_arena);
  impl_->zeros = std::move(zeros);
  impl_->rank = rank;
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
  impl_->stats.slice_peak_bytes =
      std::max(impl_->stats.slice_peak_bytes, impl_->slice_arena.size_bytes());
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

void CheckpointStash::offload(int entry, const tensor::Tensor& t) {
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
  // Every rank cuts the same blocks (Note [Partition semantics]), from the planned bytes.
  PORTER_CHECK(!le.partitioned || t.nbytes() == le.bytes, "partitioned hold of stage ", le.stage,
               "'s input: ", t.nbytes(), " bytes, but the plan partitioned ", le.bytes);
  e.shape = t.shape();
  e.dtype = t.dtype();
  e.nbytes = t.nbytes();
  memory::Stream& compute = impl_->device->compute_stream();
  const auto* src = static_cast<const std::byte*>(t.data());
  size_t bytes = e.nbytes;  // what goes to the host
  Block block;
  if (le.partitioned) {
    block = block_of(le, impl_->rank);
    src += block.offset;
    bytes = block.length;
  }
  if (le.partitioned && !le.on_host) {
    // Note [Stash partition]: the slice is written on the compute stream, so a_i may go at once.
    if (options_.contiguous) {
      e.slice_ptr = static_cast<std::byte*>(impl_->slice_arena.data()) +
                    static_cast<size_t>(le.slice_slot) * layout_.slice_slot_bytes;
    } else {
      e.slice = allocator_->allocate(le.slice_bytes, memory::Category::kCheckpoints);
      e.slice_ptr = e.slice.data();
      impl_->note_slice(le.slice_bytes, 0);
    }
    compute.copy_async(e.slice_ptr, src, block.length);
    if (block.padding > 0) {
      compute.copy_async(static_cast<std::byte*>(e.slice_ptr) + block.length, impl_->zeros.data(),
                         block.padding);
    }
    e.offloaded = true;
    return;
  }
  const size_t host_bytes = bytes + block.padding;
  if (options_.contiguous) {
    e.host = static_cast<std::byte*>(impl_->pinned_arena.data()) + le.pinned_offset;
  } else {
    e.pinned = host_->allocate(std::max<size_t>(host_bytes, 1));
    e.host = e.pinned.data();
    impl_->note_pinned(e.pinned.size_bytes(), 0);
  }
  d2h_->after(compute);
  impl_->timed_copy(*d2h_, CopyRecord::Direction::kD2H, le.stage, e.host, src, bytes, block.padding);
  d2h_->record(*e.d2h_done);
  // The allocator frees a_i only when the copy has read it (Note [Deferred free]).
  t.record_stream(d2h_->stream());
  if (!e.pinned.empty()) e.pinned.record_stream(d2h_->stream());
  e.offloaded = true;
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
  const size_t staged_bytes = layout_.staged_bytes(le);
  void* slot = nullptr;
  if (options_.contiguous) {
    slot = static_cast<std::byte*>(impl_->staging_arena.data()) +
           static_cast<size_t>(le.staging_slot) * layout_.staging_slot_bytes;
  }
  if (le.partitioned) {
    // The gathered copy: t x slice_bytes, a multiple of 16, held as i32 words until fetch()
    // views its first bytes as a_i.
    if (slot != nullptr) {
      e.gathered_ptr = slot;
    } else {
      e.gathered = tensor::Tensor::empty(*allocator_, tensor::Shape{static_cast<int64_t>(staged_bytes / 4)},
                                     tensor::DType::kI32, memory::Category::kStaging);
      e.gathered_ptr = e.gathered.data();
      impl_->note_staging(staged_bytes, 0);
    }
  } else if (slot != nullptr) {
    e.staged = tensor::Tensor::from_blob(slot, e.shape, e.dtype, memory::Category::kStaging);
  } else {
    e.staged = tensor::Tensor::empty(*allocator_, e.shape, e.dtype, memory::Category::kStaging);
    impl_->note_staging(e.nbytes, 0);
  }
  memory::Stream& compute = impl_->device->compute_stream();
  if (le.on_host) {
    // The slot may have been compute-stream memory a moment ago, and the pinned copy must
    // have landed. A host slice lands in its own block of the gathered copy.
    void* dst = le.partitioned
                    ? static_cast<std::byte*>(e.gathered_ptr) + static_cast<size_t>(impl_->rank) * le.slice_bytes
                    : e.staged.data();
    const size_t bytes = layout_.host_bytes(le);
    h2d_->after(compute);
    h2d_->wait(*e.d2h_done);
    e.h2d_timing = impl_->timed_copy(*h2d_, CopyRecord::Direction::kH2D, le.stage, dst, e.host,
                                     le.partitioned ? bytes : e.nbytes);
    h2d_->record(*e.h2d_done);
    // The pinned slot is free once the copy has read it.
    if (!e.pinned.empty()) {
      e.pinned.record_stream(h2d_->stream());
      impl_->note_pinned(0, e.pinned.size_bytes());
      e.pinned.reset();
    }
  }
  e.prefetched = true;
  if (le.partitioned) issue_gather(entry);
}

void CheckpointStash::issue_gather(int entry) {
  const checkpoint::StashEntry& le = layout_.entries[static_cast<size_t>(entry)];
  Impl::Entry& e = impl_->entries[static_cast<size_t>(entry)];
  comm::Communicator& tp = *options_.tp;
  memory::Stream& comm_stream = tp.stream();
  memory::Stream& compute = impl_->device->compute_stream();
  auto* own = static_cast<std::byte*>(e.gathered_ptr) + static_cast<size_t>(impl_->rank) * le.slice_bytes;
  // Note [Stash partition]: the gather reads the host slice only once the H2D copy landed,
  // and (as every collective) sees the compute stream's work so far: the device slice and the
  // gathered copy's memory. Its start callback runs once both waits passed.
  if (le.on_host) comm_stream.wait(*e.h2d_done);
  compute.record(*impl_->compute_point);
  comm_stream.wait(*impl_->compute_point);
  auto timing = std::make_shared<GatherTiming>();
  timing->record.stage = le.stage;
  timing->record.micro_batch = impl_->micro_batch;
  timing->record.bytes = static_cast<size_t>(layout_.ways - 1) * le.slice_bytes;
  comm_stream.host_callback([timing] {
    const Clock::time_point now = Clock::now();
    std::lock_guard<std::mutex> lock(timing->mu);
    timing->record.start = now;
  });
  {
    comm::CommLabel label(&tp, str_cat("checkpoint of stage ", le.stage));
    const void* in = le.on_host ? static_cast<const void*>(own) : e.slice_ptr;
    e.gather = tp.all_gather(in, e.gathered_ptr, le.slice_bytes, comm::ElemType::kU8);
  }
  comm_stream.host_callback([timing] {
    const Clock::time_point now = Clock::now();
    std::lock_guard<std::mutex> lock(timing->mu);
    timing->record.end = now;
    timing->done = true;
  });
  e.gather_timing = timing;
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->pending_gathers.push_back(timing);
  ++impl_->stats.gathers;
  impl_->stats.gathered_bytes += timing->record.bytes;
}

tensor::Tensor CheckpointStash::fetch(int entry) {
  check_entry(layout_, entry, "fetch");
  const checkpoint::StashEntry& le = layout_.entries[static_cast<size_t>(entry)];
  Impl::Entry& e = impl_->entries[static_cast<size_t>(entry)];
  PORTER_CHECK_T(UsageError, !e.fetched, "fetch of stage ", le.stage, "'s checkpoint twice");
  if (!e.prefetched) prefetch(entry);
  memory::Stream& compute = impl_->device->compute_stream();
  auto pending = std::make_shared<Impl::PendingWait>();
  pending->record.stage = le.stage;
  pending->record.micro_batch = impl_->micro_batch;
  pending->copy = e.h2d_timing;  // null for a device slice
  pending->gather = e.gather_timing;
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
  if (!le.partitioned) {
    compute.wait(*e.h2d_done);
    e.fetched = true;
    return e.staged;
  }
  // Note [Stash partition]: a failed gather throws here, naming the rank, group and op.
  e.gather.wait_on(compute);
  e.gather_waited = true;
  e.fetched = true;
  if (!le.on_host) {
    // Note [Partition semantics]: the gathered copy holds every byte of the slice. The comm
    // stream read it: the block is reused only after that stream's work so far.
    if (!e.slice.empty()) {
      e.slice.record_stream(options_.tp->stream());
      e.slice.reset();
      impl_->note_slice(0, le.slice_bytes);
    }
    e.slice_ptr = nullptr;
  }
  e.staged = options_.contiguous
                 ? tensor::Tensor::from_blob(e.gathered_ptr, e.shape, e.dtype, memory::Category::kStaging)
                 : e.gathered.reinterpret(e.shape, e.dtype);
  return e.staged;
}

void CheckpointStash::release(int entry) {
  check_entry(layout_, entry, "release");
  const checkpoint::StashEntry& le = layout_.entries[static_cast<size_t>(entry)];
  Impl::Entry& e = impl_->entries[static_cast<size_t>(entry)];
  PORTER_CHECK_T(UsageError, e.offloaded && !e.released, "release of stage ", le.stage,
                 "'s checkpoint, which is not stashed");
  // A prefetch that was never fetched may still be writing its slot.
  if (e.prefetched && !e.fetched) {
    if (le.partitioned) {
      if (e.gather.valid()) e.gather.wait_on(impl_->device->compute_stream());
      e.gather_waited = true;
    } else {
      impl_->device->compute_stream().wait(*e.h2d_done);
    }
  }
  if (e.prefetched && !options_.contiguous) {
    impl_->note_staging(0, le.partitioned ? layout_.staged_bytes(le) : e.nbytes);
  }
  e.staged = tensor::Tensor();
  e.gathered = tensor::Tensor();
  e.gathered_ptr = nullptr;
  if (!e.slice.empty()) {  // never read back (or never fetched)
    if (e.prefetched) e.slice.record_stream(options_.tp->stream());
    e.slice.reset();
    impl_->note_slice(0, le.slice_bytes);
  }
  e.slice_ptr = nullptr;
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
  for (Impl::Entry& e : impl_->entries) {
    e.offloaded = e.prefetched = e.fetched = e.released = false;
    e.gather = comm::Work();
    e.gather_waited = false;
    e.gather_timing.reset();
    e.h2d_timing.reset();
  }
  impl_->active = false;
}

void CheckpointStash::abort() noexcept {
  if (!impl_->active) return;
  for (memory::Stream* s : {&d2h_->stream(), &h2d_->stream()}) {
    try {
      s->synchronize();
    } catch (const std::exception& ex) {
      PORTER_LOG_ERROR("offload stream '{}' failed while aborting a micro-batch: {}", s->name(),
                       ex.what());
    }
  }
  // Note [Stash partition]: no gather may still write into the buffers freed below.
  impl_->wait_for_gathers();
  impl_->drop_entries();
  impl_->active = false;
}

void CheckpointStash::synchronize() {
  d2h_->synchronize();
  h2d_->synchronize();
  if (options_.tp != nullptr && layout_.any_partitioned()) options_.tp->stream().synchronize();
  impl_->device->compute_stream().synchronize();
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->resolve_waits_locked();
}

StashStats CheckpointStash::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->resolve_waits_locked();
  StashStats s = impl_->stats;
  s.d2h_bytes = d2h_->stats().d2h_bytes;
  s.h2d_bytes = h2d_->stats().h2d_bytes;
  return s;
}

memory::HostTierStats CheckpointStash::host_tier_stats() const {
  memory::HostTierStats s = d2h_->stats();
  s += h2d_->stats();
  return s;
}

void CheckpointStash::reset_stats() {
  d2h_->take_stats();
  h2d_->take_stats();
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->stats = StashStats{};
  impl_->stats.pinned_peak_bytes = impl_->pinned_arena.size_bytes();
  impl_->stats.staging_peak_bytes = impl_->staging_arena.size_bytes();
  impl_->stats.slice_peak_bytes = impl_->slice_arena.size_bytes();
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

std::vector<GatherRecord> CheckpointStash::take_gathers() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->resolve_waits_locked();
  return std::exchange(impl_->gathers, {});
}

}  // namespace porter::offload
