// One trace file of every rank (Note [Train trace] in train_trace.h).
#include "cli/train_trace.h"

#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"

namespace porter::cli {
namespace {

std::string key(int rank, const std::string& what) {
  return "porter/train/trace/" + std::to_string(rank) + "/" + what;
}

void publish(const TraceShare& share, const engine::TraceRecorder& trace, int64_t sync_us) {
  const std::string events = trace.events_json(share.rank);
  const size_t chunk = std::max<size_t>(1, share.chunk_bytes);
  const size_t chunks = (events.size() + chunk - 1) / chunk;
  for (size_t i = 0; i < chunks; ++i) {
    share.store->set_string(key(share.rank, std::to_string(i)), events.substr(i * chunk, chunk));
  }
  // Last: rank 0 reads the chunks once it sees the meta.
  const nlohmann::json meta = {
      {"sync_us", sync_us}, {"dropped", trace.dropped()}, {"chunks", chunks}};
  share.store->set_string(key(share.rank, "meta"), meta.dump());
}

engine::TraceRank collect(const TraceShare& share, int rank, int64_t sync0_us) {
  const nlohmann::json meta =
      nlohmann::json::parse(share.store->get_string(key(rank, "meta"), share.timeout));
  engine::TraceRank r;
  r.rank = rank;
  r.shift_us = sync0_us - meta.at("sync_us").get<int64_t>();
  r.dropped = meta.at("dropped").get<uint64_t>();
  const size_t chunks = meta.at("chunks").get<size_t>();
  for (size_t i = 0; i < chunks; ++i) {
    r.events += share.store->get_string(key(rank, std::to_string(i)), share.timeout);
  }
  return r;
}

}  // namespace

int64_t sync_trace_clock(comm::Communicator* world, const engine::TraceRecorder& trace) {
  if (world != nullptr && world->size() > 1) world->barrier().wait();
  return trace.now_us();
}

void share_trace(const TraceShare& share, const engine::TraceRecorder& trace, int64_t sync_us,
                 const std::string& path) {
  if (share.store == nullptr || share.world_size == 1) {
    engine::write_trace_file(
        path, {engine::TraceRank{share.rank, trace.events_json(share.rank), 0, trace.dropped()}});
    return;
  }
  if (share.rank != 0) {
    if (share.kept(share.rank)) publish(share, trace, sync_us);
    return;
  }
  std::vector<engine::TraceRank> ranks;
  for (int r = 0; r < share.world_size; ++r) {
    if (!share.kept(r)) continue;
    if (r == 0) {
      ranks.push_back({0, trace.events_json(0), 0, trace.dropped()});
    } else {
      ranks.push_back(collect(share, r, sync_us));
    }
  }
  engine::write_trace_file(path, ranks);
}

}  // namespace porter::cli
