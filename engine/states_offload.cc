// Engine::offload_states and reload_states: the model states moved to host memory between
// training phases (an RL rollout's generation needs the device) and back, bit for bit
// (docs/engine.md, "Offloading the model states between phases").
//
// Note [Offloaded model states]
// What moves is every model-state buffer that lives on the device between steps, each owned
// by one object, which hands it out through for_each_state (for_each_buffer):
//   flat buffers   FlatParams: the working parameters (stages 0-2) and the flat gradient
//                  buffer (stages 0 and 1)
//   optimizer      ShardedOptimizer: the device part of the f32 master and both AdamW moments
//                  (none with the optimizer wholly offloaded), and at stage 3 the working
//                  shard (unless parameter offload keeps it in host memory)
//   gradients      GradReducer: the gradient shard of stages 2 and 3 (none when it streams to
//                  the host, Note [Streamed gradients])
//   persistent     ParamGatherer: stage 3's persistent units
// What lives in host memory already (the offloaded optimizer's arrays, the offloaded
// parameter shard, the streamed gradient shard) stays where it is. Everything else that
// pointed into the moved buffers is a view, and views are never copied: each object drops
// its own on set_away(why) (the optimizer's working range of the flat buffer, the reducer's
// shard of the flat gradients at stages 0 and 1, the gatherer's bindings of the persistent
// units and its working shard) and takes them again from the buffers' new addresses on
// set_away(""); the model's layers are bound again (Model::bind) both ways. A device
// allocation cannot come back at its old address (the caching allocator hands out whatever
// fits), so nothing may keep a raw pointer into a model state across the move; the layer
// contract (Note [Layer contract]) already forbids it, as ZeRO rebinds the layers whenever a
// gradient bucket or a stage-3 gather changes a view.
//
// offload_states(pin_memory):
//   1. visits the buffers (the order above, fixed) and takes a host block for each from the
//      engine's pinned host tier (the pinned pool, within porter.device.pinned_limit, beside
//      the stash and the offloaded optimizer: Note [Host tier]) with pin_memory, else from a
//      pageable tier of its own. A shortfall throws OutOfMemoryError naming the limit before
//      anything moved.
//   2. queues each buffer's copy to the host on a lane of that tier ("states offload"), after
//      the compute stream's work so far, drops the objects' references and views, binds the
//      layers to nothing, waits for the copies, and only then lets the device blocks go (a
//      copy error puts every buffer back, untouched, and rethrows). Then empty_cache().
// reload_states():
//   1. allocates every buffer again (same shape, dtype and category) before copying anything:
//      a device that cannot take them now (the generation phase still holds memory) throws
//      OutOfMemoryError, and the states stay in host memory, intact, for a later try;
//   2. copies them up on the lane, waits, hands the objects their buffers and views back,
//      binds the layers, and frees the host blocks.
// Neither communicates, so ranks call them independently, and the bytes are the bytes: the
// run after reload_states is bitwise the run that never offloaded. While the states are away
// the objects' accessors throw UsageError with the message below (so every path into the
// states fails loudly, whatever Engine method took it), and train_step and evaluate check
// first. offload_states twice, or reload_states with the states on the device, throws
// UsageError: an RL loop that loses track of where its states are should hear of it.
#include <chrono>
#include <string>
#include <vector>

#include "base/check.h"
#include "base/error.h"
#include "base/log.h"
#include "base/units.h"
#include "engine/engine.h"
#include "engine/engine_impl.h"
#include "memory/host_tier.h"

namespace porter::engine {

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kAway =
    "the model states are in host memory (Engine::offload_states); call reload_states() first";

size_t model_state_bytes(const memory::MemoryStats& s) {
  return s[memory::Category::kParams].current_bytes + s[memory::Category::kGrads].current_bytes +
         s[memory::Category::kOptimizer].current_bytes;
}

// The span of an offload or a reload, from `start_us` to now, on the compute lane.
TraceSpan states_span(const TraceRecorder& trace, const char* name, int64_t start_us,
                      int64_t step) {
  TraceSpan span;
  span.name = name;
  span.category = "states";
  span.lane = "compute";
  span.start_us = start_us;
  span.dur_us = trace.now_us() - start_us;
  span.step = step;
  return span;
}

}  // namespace

struct Engine::StatesOffload {
  struct Copy {
    memory::HostBlock block;  // the bytes (empty for an undefined or empty buffer)
    bool defined = false;
    tensor::Shape shape;
    tensor::DType dtype = tensor::DType::kF32;
    memory::Category category = memory::Category::kParams;
  };
  // The tiers before their lanes and blocks, so that they go after them.
  std::unique_ptr<memory::PageableHostTier> pageable;  // offload_states(false)
  std::unique_ptr<memory::HostLane> pinned_lane, pageable_lane;
  std::vector<Copy> copies;  // while offloaded: one per slot, in slots() order
  StatesOffloadStats stats;

  memory::HostTier& tier(Impl& im, bool pinned) {
    if (pinned) return *im.host;
    if (!pageable) pageable = std::make_unique<memory::PageableHostTier>(im.pinned->device());
    return *pageable;
  }
  memory::HostLane& lane(Impl& im, bool pinned) {
    std::unique_ptr<memory::HostLane>& l = pinned ? pinned_lane : pageable_lane;
    if (!l) l = tier(im, pinned).open_lane("states offload");
    return *l;
  }

  // Every model-state buffer on the device (Note [Offloaded model states]), as the members
  // holding them: their addresses stay put while the buffers come and go.
  static std::vector<tensor::Tensor*> slots(Impl& im) {
    std::vector<tensor::Tensor*> out;
    auto add = [&out](tensor::Tensor& t) { out.push_back(&t); };
    im.flat->for_each_buffer(add);
    im.optimizer->for_each_state(add);
    im.reducer->for_each_state(add);
    if (im.gatherer) im.gatherer->for_each_state(add);
    return out;
  }
  // Every view taken again from the buffers (`why` empty) or dropped, and the layers bound.
  static void set_away(Impl& im, Model& model, const std::string& why) {
    im.flat->set_away(why);
    im.optimizer->set_away(why);
    im.reducer->set_away(why);
    if (im.gatherer) {
      im.gatherer->set_away(why, why.empty() ? im.optimizer->working() : tensor::Tensor());
    }
    model.bind(*im.flat);
  }
};

void Engine::StatesOffloadDeleter::operator()(StatesOffload* s) const { delete s; }

bool Engine::states_offloaded() const {
  return states_offload_ != nullptr && states_offload_->stats.offloaded;
}

StatesOffloadStats Engine::states_offload_stats() const {
  return states_offload_ != nullptr ? states_offload_->stats : StatesOffloadStats{};
}

void Engine::check_states_on_device(const char* what) const {
  if (states_offloaded()) throw UsageError(std::string("Engine::") + what + ": " + kAway);
}

void Engine::offload_states(bool pin_memory) {
  if (pending_ != nullptr) throw_step_begun("offload_states");
  Impl& im = *impl_;
  if (!states_offload_) states_offload_.reset(new StatesOffload);
  StatesOffload& so = *states_offload_;
  if (so.stats.offloaded) {
    throw UsageError("Engine::offload_states: the model states are in host memory already "
                     "(offloaded after step " + std::to_string(step_) +
                     "); call reload_states() first");
  }
  const auto t0 = Clock::now();
  const int64_t start_us = trace_ != nullptr ? trace_->now_us() : 0;
  const memory::MemoryStats before = allocator_->stats();
  std::vector<tensor::Tensor*> slots = StatesOffload::slots(im);
  // 1. The host blocks, before anything moves.
  memory::HostTier& tier = so.tier(im, pin_memory);
  std::vector<StatesOffload::Copy> copies(slots.size());
  uint64_t bytes = 0;
  for (size_t k = 0; k < slots.size(); ++k) {
    const tensor::Tensor& t = *slots[k];
    StatesOffload::Copy& c = copies[k];
    c.defined = t.defined();
    if (!c.defined) continue;
    PORTER_ASSERT(t.owns_memory(), "offload_states: a model state that is not an allocation");
    c.shape = t.shape();
    c.dtype = t.dtype();
    c.category = t.category();
    if (t.nbytes() == 0) continue;
    try {
      c.block = tier.allocate(t.nbytes());
    } catch (const OutOfMemoryError& e) {
      size_t need = 0;
      for (const tensor::Tensor* s : slots) need += s->defined() ? s->nbytes() : 0;
      throw OutOfMemoryError("Engine::offload_states: the model states (" + format_bytes(need) +
                                 ") do not fit in " + tier.name() + ": " + e.what() +
                                 " (raise " + tier.limit_key() +
                                 ", or offload_states(false) for pageable memory)",
                             e.requested_bytes());
    }
    bytes += t.nbytes();
  }
  // 2. The copies, the references and views dropped; the device blocks go once the copies
  // landed (`leaving` holds them until then).
  memory::HostLane& lane = so.lane(im, pin_memory);
  lane.after(device_->compute_stream());
  std::vector<tensor::Tensor> leaving(slots.size());
  try {
    for (size_t k = 0; k < slots.size(); ++k) {
      if (!copies[k].block.empty()) {
        lane.to_host(copies[k].block.data(), slots[k]->data(), slots[k]->nbytes());
      }
      leaving[k] = std::move(*slots[k]);
      *slots[k] = tensor::Tensor();
    }
    StatesOffload::set_away(im, *model_, kAway);
    lane.synchronize();
  } catch (...) {
    // Nothing was freed: every buffer goes back where it was.
    try {
      lane.synchronize();
    } catch (...) {  // the error below is the one reported
    }
    for (size_t k = 0; k < slots.size(); ++k) {
      if (leaving[k].defined()) *slots[k] = std::move(leaving[k]);
    }
    StatesOffload::set_away(im, *model_, "");
    throw;
  }
  leaving.clear();
  allocator_->empty_cache();
  const memory::MemoryStats after = allocator_->stats();
  so.copies = std::move(copies);
  StatesOffloadStats& st = so.stats;
  st.offloaded = true;
  st.pinned = pin_memory;
  ++st.offloads;
  st.device_bytes_before = model_state_bytes(before);
  st.device_bytes_after = model_state_bytes(after);
  st.reserved_bytes_before = before.reserved_bytes;
  st.reserved_bytes_after = after.reserved_bytes;
  st.offload_bytes = bytes;
  st.host_bytes = 0;
  for (const StatesOffload::Copy& c : so.copies) {
    if (!c.block.empty()) st.host_bytes += tier.block_bytes(c.block.data());
  }
  st.offload_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (st.device_bytes_after != 0) {
    // Something outside the engine's objects still holds a view of a model state (a layer
    // that kept a parameter past bind, against Note [Layer contract]): its blocks stay.
    PORTER_LOG_WARN("offload_states: {} of model states still on the device after the move",
                    format_bytes(st.device_bytes_after));
  }
  if (trace_ != nullptr) {
    TraceSpan span = states_span(*trace_, "offload states", start_us, step_);
    span.args = {{"bytes", static_cast<double>(bytes)},
                 {"device_bytes_before", static_cast<double>(st.device_bytes_before)},
                 {"device_bytes_after", static_cast<double>(st.device_bytes_after)},
                 {"reserved_bytes_after", static_cast<double>(st.reserved_bytes_after)}};
    span.text_args = {{"host", tier.name()}};
    trace_->span(std::move(span));
  }
}

void Engine::reload_states() {
  Impl& im = *impl_;
  if (!states_offloaded()) {
    throw UsageError("Engine::reload_states: the model states are on the device (there was no "
                     "offload_states() since the last reload)");
  }
  StatesOffload& so = *states_offload_;
  const auto t0 = Clock::now();
  const int64_t start_us = trace_ != nullptr ? trace_->now_us() : 0;
  std::vector<tensor::Tensor*> slots = StatesOffload::slots(im);
  PORTER_ASSERT(slots.size() == so.copies.size(), "reload_states: ", slots.size(),
                " model-state slots, ", so.copies.size(), " offloaded");
  // 1. Every buffer allocated before anything is copied: an OutOfMemoryError leaves the
  // states in host memory, intact.
  try {
    for (size_t k = 0; k < slots.size(); ++k) {
      const StatesOffload::Copy& c = so.copies[k];
      if (c.defined) *slots[k] = tensor::Tensor::empty(*allocator_, c.shape, c.dtype, c.category);
    }
  } catch (...) {
    for (tensor::Tensor* s : slots) *s = tensor::Tensor();
    throw;
  }
  // 2. The copies up; then the views from the buffers' new addresses.
  memory::HostLane& lane = so.lane(im, so.stats.pinned);
  uint64_t bytes = 0;
  try {
    lane.after(device_->compute_stream());
    for (size_t k = 0; k < slots.size(); ++k) {
      const StatesOffload::Copy& c = so.copies[k];
      if (c.block.empty()) continue;
      lane.to_device(slots[k]->data(), c.block.data(), slots[k]->nbytes());
      bytes += slots[k]->nbytes();
    }
    lane.synchronize();
  } catch (...) {
    try {
      lane.synchronize();
    } catch (...) {  // the error below is the one reported
    }
    for (tensor::Tensor* s : slots) *s = tensor::Tensor();
    throw;
  }
  StatesOffload::set_away(im, *model_, "");
  so.copies.clear();
  StatesOffloadStats& st = so.stats;
  st.offloaded = false;
  ++st.reloads;
  st.reload_bytes = bytes;
  st.device_bytes_reloaded = model_state_bytes(allocator_->stats());
  st.reload_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (trace_ != nullptr) {
    TraceSpan span = states_span(*trace_, "reload states", start_us, step_);
    span.args = {{"bytes", static_cast<double>(bytes)},
                 {"device_bytes", static_cast<double>(st.device_bytes_reloaded)}};
    trace_->span(std::move(span));
  }
}

}  // namespace porter::engine
