// CommunicatorBase: the identity, statistics, failure state and error messages that the Gloo
// and NCCL backends share (Note [Comm failure], Note [Comm failure state]).
#include "comm/communicator_base.h"

#include "base/check.h"
#include "base/log.h"

namespace porter::comm {

CommunicatorBase::CommunicatorBase(memory::Device& device, std::shared_ptr<Store> store,
                                   int rank, int size, const CommOptions& options)
    : device_(device),
      store_(std::move(store)),
      rank_(rank),
      size_(size),
      options_(options),
      compute_done_(device.create_event()) {}

CommStats CommunicatorBase::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CommunicatorBase::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = CommStats{};
}

void CommunicatorBase::add_stats(const CommStats& delta) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.ops += delta.ops;
  stats_.payload_bytes += delta.payload_bytes;
  stats_.busy_s += delta.busy_s;
}

void CommunicatorBase::finish_op(Work::State& state, std::exception_ptr err, double start,
                                 CommStats counted) {
  if (err) fail(err);
  const double end = now_s();
  counted.busy_s += end - start;
  add_stats(counted);
  const bool failed = err != nullptr;
  if (!state.finish(std::move(err), start, end) || state.record == nullptr) return;
  CommRecord& rec = *state.record;
  rec.failed = failed;
  auto at = [this](double s) {
    return t0_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  };
  rec.start = at(start);
  rec.end = at(end);
  std::lock_guard<std::mutex> lock(mu_);
  if (records_.size() >= kMaxCommRecords) {
    ++dropped_records_;
    return;
  }
  records_.push_back(std::move(rec));
}

std::vector<CommRecord> CommunicatorBase::take_records() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<CommRecord> out;
  out.swap(records_);
  return out;
}

uint64_t CommunicatorBase::dropped_records() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_records_;
}

void CommunicatorBase::open_stream() {
  stream_ = device_.create_stream(options_.group_name == "world"
                                      ? std::string("comm")
                                      : str_cat("comm:", options_.group_name));
}

void CommunicatorBase::drain_stream() noexcept {
  if (stream_ == nullptr) return;
  try {
    stream_->synchronize();  // ops still queued finish (or fail by their timeout)
  } catch (const std::exception& e) {
    PORTER_LOG_ERROR("rank {} of {}: comm stream error at destruction: {}", rank_,
                     options_.group_name, e.what());
  }
}

std::string CommunicatorBase::what(const OpInfo& op) const {
  if (!op.has_payload) {
    return str_cat("rank ", rank_, " of ", options_.group_name, ": ", op.name, " failed: ");
  }
  return str_cat("rank ", rank_, " of ", options_.group_name, ": ", op.name, " of ", op.count,
                 " ", elem_name(op.type), " failed: ");
}

TimeoutError CommunicatorBase::timeout_error(const OpInfo& op, int peer,
                                             std::string_view detail) const {
  const std::string head = str_cat(what(op), "timed out after ", options_.timeout.count(), " s");
  if (peer >= 0) {
    return TimeoutError(str_cat(head, " waiting for rank ", peer,
                                " (is it alive and issuing the same collectives? the limit is "
                                "porter.comm.timeout_s)",
                                detail));
  }
  return TimeoutError(str_cat(head,
                              " (is every rank alive and issuing the same collectives? the "
                              "limit is porter.comm.timeout_s)",
                              detail));
}

void CommunicatorBase::check_root(const OpInfo& op, int root) const {
  PORTER_CHECK(root >= 0 && root < size_, what(op), "root ", root, " is not a rank of ",
               options_.group_name, " (size ", size_, ")");
}

int CommunicatorBase::split_rank(const std::vector<int>& ranks, const std::string& name) const {
  const std::string head = str_cat("rank ", rank_, " of ", options_.group_name, ": split into '",
                                   name, "': ");
  PORTER_CHECK(!ranks.empty(), head, "the rank list is empty");
  PORTER_CHECK(!name.empty(), head, "the group name is empty");
  int sub_rank = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    PORTER_CHECK(ranks[i] >= 0 && ranks[i] < size_, head, "rank ", ranks[i], " is not in [0, ",
                 size_, ")");
    PORTER_CHECK(i == 0 || ranks[i - 1] < ranks[i], head, "ranks must be ascending and unique");
    if (ranks[i] == rank_) sub_rank = static_cast<int>(i);
  }
  PORTER_CHECK(sub_rank >= 0, head, "this rank is not in the list; only members call split");
  check_usable(OpInfo{"split", 0, ElemType::kU8, false});
  return sub_rank;
}

CommOptions CommunicatorBase::options_for_group(const std::string& name) const {
  CommOptions sub = options_;
  sub.group_name = name;
  return sub;
}

void CommunicatorBase::check_usable(const OpInfo& op) const {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable_locked(op);
}

void CommunicatorBase::check_usable_locked(const OpInfo& op) const {
  if (!failure_) return;
  std::string first;
  bool timeout = false;
  try {
    std::rethrow_exception(failure_);
  } catch (const TimeoutError& e) {
    first = e.what();
    timeout = true;
  } catch (const std::exception& e) {
    first = e.what();
  } catch (...) {
    first = "unknown error";
  }
  std::string msg = str_cat(what(op), "the communicator failed earlier: ", first);
  if (timeout) throw TimeoutError(msg);
  throw PeerError(msg);
}

void CommunicatorBase::fail(std::exception_ptr err) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_) failure_ = std::move(err);
    halt_locked();
  }
  halt();
}

void CommunicatorBase::abort(const std::string& reason) {
  fail(std::make_exception_ptr(
      PeerError(str_cat("rank ", rank_, " of ", options_.group_name, " aborted: ", reason))));
}

std::shared_ptr<Work::State> CommunicatorBase::start_op(const OpInfo& op, size_t payload_bytes) {
  check_usable(op);
  auto state = std::make_shared<Work::State>(op.name, payload_bytes);
  state->event = device_.create_event();
  if (recording_) {
    state->record = std::make_unique<CommRecord>();
    CommRecord& rec = *state->record;
    rec.op = op.name;
    rec.group = options_.group_name;
    rec.label = label_;
    rec.count = op.has_payload ? op.count : 0;
    rec.type = op.type;
    rec.has_payload = op.has_payload;
    rec.bytes = payload_bytes;
  }
  // Note [Comm stream]: the op sees everything queued on the compute stream before the call.
  device_.compute_stream().record(*compute_done_);
  stream_->wait(*compute_done_);
  return state;
}

}  // namespace porter::comm
