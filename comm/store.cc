// The in-memory store (ranks that are threads of one process) and the prefix view over any
// store. TcpStore lives in tcp_store.cc. Semantics: Note [Store semantics] in store.h.
#include "comm/store.h"

#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>

#include "base/check.h"
#include "base/error.h"

namespace porter::comm {

namespace {

std::string join_keys(const std::vector<std::string>& keys) {
  std::string out = "[";
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i > 0) out += ", ";
    out += "\"" + keys[i] + "\"";
  }
  return out + "]";
}

int64_t decode_i64(const Bytes& b) {
  uint64_t u = 0;
  for (size_t i = 0; i < 8; ++i) {
    u |= static_cast<uint64_t>(static_cast<uint8_t>(b[i])) << (8 * i);
  }
  return static_cast<int64_t>(u);
}

Bytes encode_i64(int64_t v) {
  Bytes b(8);
  const auto u = static_cast<uint64_t>(v);
  for (size_t i = 0; i < 8; ++i) b[i] = static_cast<char>((u >> (8 * i)) & 0xff);
  return b;
}

}  // namespace

// --- PrefixStore -------------------------------------------------------------------------

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> inner)
    : prefix_(std::move(prefix)), inner_(std::move(inner)) {
  PORTER_CHECK(inner_ != nullptr, "PrefixStore(\"", prefix_, "\"): the inner store is null");
}

void PrefixStore::set(const std::string& key, const Bytes& value) {
  inner_->set(prefix_ + "/" + key, value);
}

Bytes PrefixStore::get(const std::string& key, Seconds timeout) {
  return inner_->get(prefix_ + "/" + key, timeout);
}

void PrefixStore::wait(const std::vector<std::string>& keys, Seconds timeout) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const auto& k : keys) full.push_back(prefix_ + "/" + k);
  inner_->wait(full, timeout);
}

int64_t PrefixStore::add(const std::string& key, int64_t delta) {
  return inner_->add(prefix_ + "/" + key, delta);
}

bool PrefixStore::check(const std::string& key) { return inner_->check(prefix_ + "/" + key); }

// --- InMemoryStore -----------------------------------------------------------------------

// Lock rule: every access to `values` holds `mu`; every change notifies `cv` (all waiters
// re-check their keys, which is cheap for the handful of ranks that share one store).
struct InMemoryStore::State {
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, Bytes> values;

  // Blocks until every key exists or the deadline passes; returns the keys still missing.
  std::vector<std::string> wait_locked(std::unique_lock<std::mutex>& lock,
                                       const std::vector<std::string>& keys, Seconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(timeout);
    auto missing = [&] {
      std::vector<std::string> out;
      for (const auto& k : keys) {
        if (values.find(k) == values.end()) out.push_back(k);
      }
      return out;
    };
    while (true) {
      auto m = missing();
      if (m.empty()) return m;
      if (cv.wait_until(lock, deadline) == std::cv_status::timeout) return missing();
    }
  }
};

InMemoryStore::InMemoryStore(Seconds default_timeout)
    : state_(std::make_unique<State>()), default_timeout_(default_timeout) {
  PORTER_CHECK(default_timeout.count() > 0,
               "InMemoryStore: the default timeout must be > 0 s, got ", default_timeout.count(),
               " s");
}

InMemoryStore::~InMemoryStore() = default;

void InMemoryStore::set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->values[key] = value;
  }
  state_->cv.notify_all();
}

Bytes InMemoryStore::get(const std::string& key, Seconds timeout) {
  if (timeout.count() <= 0) timeout = default_timeout_;
  std::unique_lock<std::mutex> lock(state_->mu);
  auto missing = state_->wait_locked(lock, {key}, timeout);
  if (!missing.empty()) {
    throw TimeoutError(str_cat("InMemoryStore: get timed out after ", timeout.count(),
                               " s; keys still missing: ", join_keys(missing),
                               ". A rank that should set them is slow or failed; raise "
                               "porter.comm.timeout_s if it is only slow"));
  }
  return state_->values.at(key);
}

void InMemoryStore::wait(const std::vector<std::string>& keys, Seconds timeout) {
  if (timeout.count() <= 0) timeout = default_timeout_;
  std::unique_lock<std::mutex> lock(state_->mu);
  auto missing = state_->wait_locked(lock, keys, timeout);
  if (!missing.empty()) {
    throw TimeoutError(str_cat("InMemoryStore: wait timed out after ", timeout.count(),
                               " s; keys still missing: ", join_keys(missing),
                               ". A rank that should set them is slow or failed; raise "
                               "porter.comm.timeout_s if it is only slow"));
  }
}

int64_t InMemoryStore::add(const std::string& key, int64_t delta) {
  int64_t result = 0;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->values.find(key);
    if (it == state_->values.end()) {
      result = delta;
    } else {
      PORTER_CHECK_EQ(it->second.size(), size_t{8}, "InMemoryStore: add(\"", key,
                      "\") on a value that is not an 8-byte counter (it was set() with other "
                      "bytes); use a separate key for counters");
      // Wrap-around like the wire protocol: two's complement on unsigned arithmetic.
      result = static_cast<int64_t>(static_cast<uint64_t>(decode_i64(it->second)) +
                                    static_cast<uint64_t>(delta));
    }
    state_->values[key] = encode_i64(result);
  }
  state_->cv.notify_all();
  return result;
}

bool InMemoryStore::check(const std::string& key) {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->values.count(key) != 0;
}

}  // namespace porter::comm
