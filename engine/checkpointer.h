// Periodic training checkpoints written in the background into a run directory.
//
// Note [Background checkpoints]
// Checkpointer::save(engine), called by every rank after the same step:
// 1. waits for the previous save's write to finish (and rethrows its error), so at most one
//    snapshot is held at a time;
// 2. takes the snapshot (Engine::snapshot_checkpoint): the device-to-host copy of this rank's
//    state into host memory. Only this part holds up training: the snapshot is the state
//    after the step, and the next step does not change it. The snapshot's buffers are kept
//    from one save to the next (pageable host memory: the whole state may exceed the pinned
//    limit), so after the first save the copy touches pages that are already there; the
//    host-memory preflight counts them (Note [Host fit] in engine/host_fit.h);
// 3. rank 0 clears and creates DIR/.step-<N>.tmp and tells the others through the store
//    ("ckpt/<N>/open"), so that no rank writes into a directory rank 0 is about to remove;
// 4. starts a thread that writes the snapshot into DIR/.step-<N>.tmp (io/state_file.h: every
//    file fsynced), votes that this rank is done (comm/agree.h), and on rank 0, once every
//    rank is done, publishes it (Note [Run directory] in io/run_dir.h: the rename, latest,
//    and the removal of checkpoints beyond keep_checkpoints).
// wait() joins the write in flight; the end of a run calls it so that the last checkpoint is
// complete (published, on rank 0) before porter reports success. A step already saved is not
// saved again (the last periodic save and the final one may fall on the same step).
// The write's store calls use the comm timeout: a rank that dies mid-write leaves the others'
// writes waiting at most that long, and the checkpoint unpublished (the previous one stays
// latest).
#pragma once

#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <thread>
#include <vector>

#include "comm/store.h"

namespace porter::engine {

class Engine;
struct CheckpointSnapshot;

struct CheckpointerOptions {
  std::filesystem::path run_dir;  // --save DIR
  int64_t keep = 2;               // porter.train.keep_checkpoints
  comm::Store* store = nullptr;   // the world's store; null for one rank
  int rank = 0;
  int world_size = 1;
  comm::Seconds timeout{300};
};

struct CheckpointRecord {
  int64_t step = 0;
  double snapshot_s = 0;  // the device-to-host copy, on the training thread
  double write_s = 0;     // this rank's files, in the background (up to this rank's vote)
  double publish_s = 0;   // rank 0: waiting for the others, the rename and latest
  uint64_t bytes = 0;     // this rank's snapshot
  std::filesystem::path path;  // DIR/step-<N>
};

class Checkpointer {
 public:
  explicit Checkpointer(CheckpointerOptions options);
  ~Checkpointer();  // joins the write in flight (its error, if any, is logged)
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  void save(const Engine& engine);  // Note [Background checkpoints]
  // The engine's state at `step` is already in the run directory (it was resumed from there):
  // a save at that step writes nothing.
  void mark_saved(int64_t step) { last_step_ = step; }
  void wait();                      // the write in flight; rethrows its error
  // Finished saves, oldest first (write_s and publish_s are final after wait()).
  const std::vector<CheckpointRecord>& records() const { return records_; }
  int64_t last_saved_step() const { return last_step_; }

 private:
  CheckpointerOptions options_;
  std::vector<CheckpointRecord> records_;
  std::shared_ptr<CheckpointSnapshot> snapshot_;  // reused: the writer holds it until joined
  std::thread writer_;
  std::exception_ptr error_;
  int64_t last_step_ = -1;
};

}  // namespace porter::engine
