// Background checkpoints (Note [Background checkpoints] in engine/checkpointer.h).
#include "engine/checkpointer.h"

#include <chrono>
#include <system_error>

#include "base/error.h"
#include "base/log.h"
#include "comm/agree.h"
#include "engine/checkpoint_snapshot.h"
#include "engine/engine.h"
#include "io/run_dir.h"

namespace porter::engine {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Checkpointer::Checkpointer(CheckpointerOptions options) : options_(std::move(options)) {}

Checkpointer::~Checkpointer() {
  if (!writer_.joinable()) return;
  writer_.join();
  if (error_) {
    try {
      std::rethrow_exception(error_);
    } catch (const std::exception& e) {
      PORTER_LOG_WARN("checkpoint: the write in flight failed: {}", e.what());
    }
  }
}

void Checkpointer::wait() {
  if (writer_.joinable()) writer_.join();
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void Checkpointer::save(const Engine& engine) {
  const int64_t step = engine.step();
  if (step == last_step_) return;
  wait();  // 1.
  const auto t0 = std::chrono::steady_clock::now();
  if (!snapshot_) snapshot_ = std::make_shared<CheckpointSnapshot>();
  engine.snapshot_checkpoint(*snapshot_);  // 2.
  std::shared_ptr<CheckpointSnapshot> snapshot = snapshot_;
  CheckpointRecord rec;
  rec.step = step;
  rec.snapshot_s = seconds_since(t0);
  rec.bytes = snapshot->bytes();
  rec.path = options_.run_dir / io::step_dir_name(step);
  const std::filesystem::path pending = io::pending_checkpoint_dir(options_.run_dir, step);
  const std::string key = "ckpt/" + std::to_string(step);
  if (options_.rank == 0) {  // 3.
    std::error_code ec;
    std::filesystem::remove_all(pending, ec);
    std::filesystem::create_directories(pending, ec);
    if (ec) {
      throw IoError("checkpoint: cannot create \"" + pending.string() + "\": " + ec.message());
    }
    if (options_.store) options_.store->set_string(key + "/open", "1");
  } else if (options_.store) {
    options_.store->get(key + "/open", options_.timeout);
  }
  last_step_ = step;
  records_.push_back(rec);
  const size_t index = records_.size() - 1;
  writer_ = std::thread([this, snapshot, pending, key, step, index] {  // 4.
    try {
      const auto w0 = std::chrono::steady_clock::now();
      write_snapshot(*snapshot, pending);
      records_[index].write_s = seconds_since(w0);
      const auto p0 = std::chrono::steady_clock::now();
      if (options_.store) {
        comm::count_votes(*options_.store, key + "/written", options_.world_size, true,
                          options_.timeout);
      }
      if (options_.rank == 0) {
        io::publish_checkpoint(options_.run_dir, step, options_.keep);
        records_[index].publish_s = seconds_since(p0);
      }
    } catch (...) {
      error_ = std::current_exception();
    }
  });
}

}  // namespace porter::engine
