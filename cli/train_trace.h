// `porter train --trace` with several ranks: the clocks aligned at the rendezvous, and every
// rank's trace in one file written by rank 0 (Note [Trace of several ranks] in
// engine/trace.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "comm/communicator.h"
#include "comm/store.h"
#include "engine/trace.h"

namespace porter::cli {

// Note [Train trace]
// With --trace every rank records (--trace-rank R: only rank R attaches its recorder to the
// engine). Right after the engine is built, every rank passes a barrier of the world
// communicator and notes its recorder's time (sync_us). After the last step every kept rank
// r > 0 sets, in the run's store, "porter/train/trace/<r>/meta" = {"sync_us", "dropped",
// "chunks"} and its events (TraceRecorder::events_json) cut into chunks of at most
// kTraceChunkBytes under ".../<r>/<i>" (TcpStore frames are limited to 1 GiB, and one huge
// value would be held twice in memory on the server); rank 0 gets them (within the timeout),
// shifts rank r's timestamps by sync_0 - sync_r (about 0 on one host, where steady_clock is
// shared, but computed) and writes the one file. A run that fails writes rank 0's events
// alone, since its peers may be gone.
inline constexpr size_t kTraceChunkBytes = size_t{16} << 20;

struct TraceShare {
  comm::Store* store = nullptr;  // not owned; null for one rank
  int rank = 0;
  int world_size = 1;
  std::optional<int> only_rank;  // --trace-rank
  comm::Seconds timeout{300};    // for rank 0's gets
  size_t chunk_bytes = kTraceChunkBytes;
  bool kept(int r) const { return !only_rank || *only_rank == r; }
};

// The barrier and this rank's recorder time after it (Note [Train trace]); `world` may be
// null (one rank).
int64_t sync_trace_clock(comm::Communicator* world, const engine::TraceRecorder& trace);

// Every rank calls it after its last step: ranks r > 0 publish their events if kept, and
// rank 0 collects the kept ranks' and writes `path`. Throws IoError, TimeoutError.
void share_trace(const TraceShare& share, const engine::TraceRecorder& trace, int64_t sync_us,
                 const std::string& path);

}  // namespace porter::cli
