// The host tier: where a tensor lives when it is not on the device (host memory of some
// kind), the copy lanes that move bytes between the device and it, and what they moved.
//
// Note [Host tier]
// Three things keep state off the device: the checkpoint stash (offload/stash.h), the
// offloaded optimizer (zero/sharded_optimizer.h) and the offloaded parameter shard
// (zero/param_gatherer.h). Each needs the same four things, which a HostTier provides:
//   memory   allocate(bytes) hands out a HostBlock (a move-only owner, freed through its
//            tier, deferred after the streams recorded on it: Note [Deferred free]);
//            block_bytes() is what a block really holds (a pool rounds up), limit_bytes()
//            and in_use_bytes() are the whole store's, for the checks that refuse a plan
//            before it runs; name() and limit_key() are how an error names the store and
//            its knob.
//   copies   open_lane(name) gives a HostLane: one copy stream of the device, with the
//            device -> host and host -> device copies, events and waits of one user. Each
//            user opens its own lanes (the stash two, the optimizer one, the gatherer one),
//            so their copies overlap one another as before.
//   figures  HostTierStats: bytes and copies each way, host waits and their time, and the
//            bytes held now and at most. A lane counts its own traffic (take_stats()); the
//            tier counts its blocks and the traffic of all its lanes (stats()). Stats add
//            with +=, so a run's total is the sum of its steps'.
//   links    on cpu the copy stream is throttled to the simulated link (Note [Simulated
//            link]); on cuda it is a real stream over PCIe or NVLink-C2C. The lane neither
//            knows nor cares.
// Two implementations exist: PinnedHostTier (the engine's pinned pool, within
// porter.device.pinned_limit; the default for all three users) and PageableHostTier
// (ordinary heap memory, for offload_optimizer.pin_memory / offload_param.pin_memory false).
// A further tier, file-backed (NVMe), is a third implementation and touches none of the
// users: its allocate() maps a region of a file (so a block has an address the copy streams
// and CpuAdam read and write like any host memory), limit_bytes() is the file's size,
// block_bytes() the mapped pages, and where copies must do more than copy_async (an explicit
// read into a bounce buffer, say) it returns a HostLane subclass from open_lane() whose
// to_host()/to_device() do it.
//
// How the users use it:
//   stash      allocates its pinned slots, arena and padding zeros from the tier, checks a
//              layout's pinned bytes against limit_bytes(), and copies on two lanes
//              ("offload.d2h", "offload.h2d"); StashStats' d2h_bytes and h2d_bytes are those
//              lanes' figures.
//   optimizer  allocates master, moments, gradient and working copies from the tier that
//              pin_memory names, and copies gradients down and the working copy up on one
//              lane ("optimizer offload"); the update's wait for the gradients is that lane's
//              wait.
//   gatherer   uploads this rank's part of a unit on a lane ("param h2d") of the tier that
//              holds the shard (ShardedOptimizer::param_tier()); GatherStats' h2d_bytes is
//              that lane's figure.
//
// Thread-safety: a tier is thread-safe (the stash frees blocks while copy streams run); a
// lane is driven by one thread, and its stats() may be read from any.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include "memory/device.h"
#include "memory/pinned_pool.h"
#include "memory/pooled_buffer.h"

namespace porter::memory {

class HostTier;

// Move-only owner of one block of a tier; returns it to its tier on destruction.
using HostBlock = PooledBuffer<HostTier>;

// What moved between the device and a tier, and what the tier held, over a window.
struct HostTierStats {
  uint64_t d2h_bytes = 0;
  uint64_t h2d_bytes = 0;
  int64_t d2h_copies = 0;
  int64_t h2d_copies = 0;
  int64_t waits = 0;        // host waits for a lane's copies
  double wait_s = 0.0;      // their time
  size_t held_bytes = 0;    // blocks held at the end of the window (block_bytes each)
  size_t peak_held_bytes = 0;
  // Folds a later window in: traffic and waits add, held is the later window's, the peak
  // takes the larger.
  HostTierStats& operator+=(const HostTierStats& later);
  bool operator==(const HostTierStats&) const = default;
};

// One user's copy stream between the device and a tier. Copies are queued in stream order
// (Note [Stream semantics]); the buffers must stay alive until they land (record an event, or
// record_stream the blocks).
class HostLane {
 public:
  HostLane(HostTier& tier, std::string name);
  virtual ~HostLane();
  HostLane(const HostLane&) = delete;
  HostLane& operator=(const HostLane&) = delete;

  Stream& stream() { return *stream_; }
  const std::string& name() const { return stream_->name(); }
  HostTier& tier() const { return *tier_; }

  // The lane's later work starts after `other`'s work so far (an event recorded on `other`
  // now, which the lane waits for).
  void after(Stream& other);
  void wait(const Event& event) { stream_->wait(event); }
  void record(Event& event) { stream_->record(event); }
  // Queues a copy of `bytes` from the device (or the tier) into the tier, or back.
  virtual void to_host(void* host_dst, const void* src, size_t bytes);
  virtual void to_device(void* device_dst, const void* host_src, size_t bytes);
  // Blocks until every copy queued so far landed (rethrowing the first error of the
  // stream's work); counted as a wait.
  void synchronize();
  // Makes `stream` wait for `event` (recorded on this lane); counted as a wait for the time
  // the call took (on cpu the compute stream is the host thread, which blocks).
  void wait_on(Stream& stream, const Event& event);
  // Returns the seconds the last synchronize() or wait_on() took.
  double last_wait_s() const { return last_wait_s_; }

  // This lane's traffic and waits since the last take_stats() (held bytes are the tier's).
  HostTierStats stats() const;
  HostTierStats take_stats();

 protected:
  // Counts a copy queued by a subclass's to_host / to_device.
  void count_copy(bool to_host, size_t bytes);

 private:
  void count_wait(double seconds);

  HostTier* tier_;  // not owned; outlives the lane
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Event> point_;  // after()
  double last_wait_s_ = 0.0;
  mutable std::mutex mu_;  // guards stats_
  HostTierStats stats_;
};

class HostTier {
 public:
  explicit HostTier(Device& device) : device_(&device) {}
  virtual ~HostTier();
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  Device& device() const { return *device_; }
  // How errors name the store ("pinned host memory") and the setting that bounds it.
  virtual std::string name() const = 0;
  virtual std::string limit_key() const = 0;
  // The whole store's bound and use (all its users, this tier object's blocks or not).
  virtual size_t limit_bytes() const = 0;
  virtual size_t in_use_bytes() const = 0;

  // A block of `bytes` (empty for 0), its contents unspecified unless the tier says
  // otherwise. Throws OutOfMemoryError when the store cannot provide it.
  HostBlock allocate(size_t bytes);
  // The bytes the store holds for the live block at `ptr` (at least its size).
  virtual size_t block_bytes(const void* ptr) const = 0;

  // A copy lane on a new copy stream of the device (Note [Host tier]).
  virtual std::unique_ptr<HostLane> open_lane(std::string name);

  // This tier object's blocks (held and peak) and the traffic of its lanes.
  HostTierStats stats() const;

  // For HostBlock (PooledBuffer's contract).
  void raw_free(void* ptr);
  virtual void record_stream(void* ptr, Stream& stream) = 0;

 protected:
  // A block of at least `bytes` from the store, or throws OutOfMemoryError.
  virtual void* store_allocate(size_t bytes) = 0;
  virtual void store_free(void* ptr) = 0;

 private:
  friend class HostLane;
  void add_traffic(const HostTierStats& s);

  Device* device_;  // not owned; outlives the tier
  mutable std::mutex mu_;  // guards the members below
  std::unordered_map<void*, size_t> held_;  // live blocks -> block_bytes
  HostTierStats stats_;
};

// Page-locked host memory from a PinnedPool (porter.device.pinned_limit): copies are
// asynchronous on cuda, and freed blocks wait for the streams recorded on them.
class PinnedHostTier final : public HostTier {
 public:
  explicit PinnedHostTier(PinnedPool& pool);
  std::string name() const override { return "pinned host memory"; }
  std::string limit_key() const override { return "porter.device.pinned_limit"; }
  size_t limit_bytes() const override { return pool_->stats().limit_bytes; }
  size_t in_use_bytes() const override { return pool_->stats().in_use_bytes; }
  size_t block_bytes(const void* ptr) const override { return pool_->block_bytes(ptr); }
  void record_stream(void* ptr, Stream& stream) override { pool_->record_stream(ptr, stream); }
  PinnedPool& pool() const { return *pool_; }

 protected:
  void* store_allocate(size_t bytes) override { return pool_->raw_allocate(bytes); }
  void store_free(void* ptr) override { pool_->raw_free(ptr); }

 private:
  PinnedPool* pool_;  // not owned; outlives the tier and its blocks
};

// Ordinary (pageable) heap memory, zero-filled, without a bound of its own. A copy to or from
// it may not overlap other work on cuda. A freed block is released at once: its user makes
// sure no copy still reads or writes it (record_stream is a usage error here).
class PageableHostTier final : public HostTier {
 public:
  explicit PageableHostTier(Device& device) : HostTier(device) {}
  std::string name() const override { return "pageable host memory"; }
  std::string limit_key() const override { return "the host's memory"; }
  size_t limit_bytes() const override { return SIZE_MAX; }
  size_t in_use_bytes() const override;
  size_t block_bytes(const void* ptr) const override;
  void record_stream(void* ptr, Stream& stream) override;

 protected:
  void* store_allocate(size_t bytes) override;
  void store_free(void* ptr) override;

 private:
  mutable std::mutex mu_;  // guards sizes_
  std::unordered_map<const void*, size_t> sizes_;
};

}  // namespace porter::memory
