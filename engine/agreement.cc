// What the ranks of a world agree on before they compute: the profiled costs and bandwidths
// the plan is made from (Note [Agreed costs]), and the kernel table (Note [Kernel table
// agreement]).
#include <chrono>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/engine_impl.h"

namespace porter::engine {

using Clock = std::chrono::steady_clock;

// Note [Agreed costs]: every rank of the world must run the same schedule: the ranks of a
// tp group because their layers' collectives pair up op by op, and at ZeRO stage 3 the ranks
// of a dp group because their parameter gathers do (Note [Gather plan]). Profiled times and
// measured bandwidths differ from rank to rank, so every time is replaced by its maximum and
// every bandwidth by its minimum over the world (all-reduced over the tp group, then over the
// dp group) before planning; the plan is a function of the costs, so every rank gets the same
// one. Bytes are exact and equal on every rank already.
void Engine::agree_max(std::vector<double>& values, const char* label) {
  Impl& im = *impl_;
  for (comm::Communicator* c : {im.tp_comm(), im.comm()}) {
    if (c == nullptr || values.empty()) continue;
    const comm::CommLabel l(c, label);
    c->all_reduce(values.data(), values.size(), comm::ElemType::kF64, comm::ReduceOp::kMax).wait();
  }
}

double Engine::agree_bandwidth(double bytes_per_s, const char* label) {
  // The slowest rank's: the maximum of seconds per byte (0 stays unknown only if every rank's is).
  std::vector<double> v{bytes_per_s > 0.0 ? 1.0 / bytes_per_s : 0.0};
  agree_max(v, label);
  return v[0] > 0.0 ? 1.0 / v[0] : 0.0;
}

void Engine::agree_on_costs() {
  Impl& im = *impl_;
  if (im.tp_comm() == nullptr && im.comm() == nullptr) return;
  std::vector<double> times;
  for (const checkpoint::StageCost& st : im.costs.stages) {
    times.push_back(st.backward_s);
    for (const checkpoint::OptionCost& o : st.options) {
      times.push_back(o.forward_s);
      times.push_back(o.recompute_s);
    }
  }
  agree_max(times, "profile");
  size_t i = 0;
  for (checkpoint::StageCost& st : im.costs.stages) {
    st.backward_s = times[i++];
    for (checkpoint::OptionCost& o : st.options) {
      o.forward_s = times[i++];
      o.recompute_s = times[i++];
    }
  }
}

// The tp group's all-gather bandwidth, bytes/s received, from one all-gather of `bytes`
// (the largest checkpoint) after a warm-up; the same figure on every rank (the maximum time).
double Engine::measure_tp_bytes_per_s(size_t bytes) {
  comm::Communicator* tp = impl_->tp_comm();
  if (tp == nullptr || bytes == 0) return 0.0;
  const size_t slice = (bytes + static_cast<size_t>(tp->size()) - 1) / static_cast<size_t>(tp->size());
  tensor::Tensor buf = tensor::Tensor::empty(*allocator_, tensor::Shape{static_cast<int64_t>(slice) * tp->size()},
                                     tensor::DType::kI32 /* bytes / 4 */, memory::Category::kWorkspace);
  const size_t count = slice / 4;
  const comm::CommLabel label(tp, "link probe");
  char* base = static_cast<char*>(buf.data());
  tp->all_gather(base + count * 4 * static_cast<size_t>(tp->rank()), base, count,
                 comm::ElemType::kI32).wait();
  const auto t0 = Clock::now();
  tp->all_gather(base + count * 4 * static_cast<size_t>(tp->rank()), base, count,
                 comm::ElemType::kI32).wait();
  std::vector<double> seconds{std::chrono::duration<double>(Clock::now() - t0).count()};
  tp->all_reduce(seconds.data(), 1, comm::ElemType::kF64, comm::ReduceOp::kMax).wait();
  const double received = static_cast<double>(count * 4) * (tp->size() - 1);
  return seconds[0] > 0.0 ? received / seconds[0] : 0.0;
}

// Note [Kernel table agreement]
// Each rank records its own kernel choices as its kernels first meet each problem (Note
// [Kernel table] in kernels/kernel_table.cc). After the first step, world rank 0's table replaces
// every other rank's: broadcast over the tensor-parallel group, then over the data-parallel
// group, so every rank ends with world rank 0's. Under kernel_choice "exact" this changes no
// bits (any recorded candidate gives the same ones) but makes every rank's checkpoint and
// report hold one table; under "fastest" it makes every later step compute the same way on
// every rank. A collective: every rank's first train_step calls it.
void Engine::agree_kernel_table() {
  Impl& im = *impl_;
  kernels::KernelTable& table = kernels_->kernel_table();
  for (comm::Communicator* c : {im.tp_comm(), im.comm()}) {
    if (c == nullptr) continue;
    const comm::CommLabel l(c, "kernel table");
    std::string text = c->rank() == 0 ? table.to_json().dump() : std::string();
    // Through device buffers: NCCL reads device memory only.
    auto broadcast = [&](void* host, size_t bytes, comm::ElemType type, size_t count) {
      memory::DeviceBuffer buf = allocator_->allocate(bytes, memory::Category::kWorkspace);
      device_->copy_sync(buf.data(), host, bytes);
      c->broadcast(buf.data(), count, type, 0).wait();
      device_->copy_sync(host, buf.data(), bytes);
    };
    int64_t n = static_cast<int64_t>(text.size());
    broadcast(&n, sizeof n, comm::ElemType::kI64, 1);
    text.resize(static_cast<size_t>(n));
    if (n > 0) broadcast(text.data(), text.size(), comm::ElemType::kU8, text.size());
    if (c->rank() != 0 && n > 0) {
      const nlohmann::json agreed = nlohmann::json::parse(text);
      table.pin(agreed, "rank 0's table (" + agreed.value("origin", std::string("measured")) + ")");
    }
  }
}

}  // namespace porter::engine
