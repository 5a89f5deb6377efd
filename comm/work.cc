// Work: a handle on a collective queued on a comm stream (Note [Comm stream]); CommLabel, the
// scoped label of Note [Comm records].
#include "base/check.h"
#include "comm/communicator.h"
#include "comm/work_state.h"

namespace porter::comm {
namespace {

void check_valid(const std::shared_ptr<Work::State>& state, const char* what) {
  PORTER_CHECK_T(UsageError, state != nullptr, "Work::", what,
                 " on an empty Work (default-constructed, not returned by a collective)");
}

}  // namespace

bool Work::done() const {
  if (state_ == nullptr) return true;
  return state_->event->query();
}

void Work::wait() {
  check_valid(state_, "wait()");
  if (state_->device_wait) {
    state_->device_wait(*state_);
  } else {
    state_->event->synchronize();
  }
  if (auto err = state_->get_error()) std::rethrow_exception(err);
}

void Work::wait_on(memory::Stream& stream) {
  check_valid(state_, "wait_on()");
  stream.wait(*state_->event);
  // On cpu the compute stream's wait() blocked until the op finished, so its error is known.
  if (state_->event->query()) {
    if (auto err = state_->get_error()) std::rethrow_exception(err);
  }
}

double Work::start_s() const {
  check_valid(state_, "start_s()");
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->start_s;
}

double Work::end_s() const {
  check_valid(state_, "end_s()");
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->end_s;
}

std::string_view Work::op() const {
  check_valid(state_, "op()");
  return state_->op;
}

size_t Work::payload_bytes() const {
  check_valid(state_, "payload_bytes()");
  return state_->payload_bytes;
}

CommLabel::CommLabel(Communicator* comm, std::string label) : comm_(comm) {
  if (comm_ == nullptr) return;
  previous_ = comm_->label();
  comm_->set_label(std::move(label));
}

CommLabel::~CommLabel() {
  if (comm_ != nullptr) comm_->set_label(std::move(previous_));
}

}  // namespace porter::comm
