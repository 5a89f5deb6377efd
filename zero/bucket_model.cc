// The reducer's comm buffers, replayed (bucket_model.h). Every rule mirrors GradReducer
// (zero/reducer.cc): a change there changes this replay, and EngineBucketPrediction tests
// check the two agree to the byte.
#include "zero/bucket_model.h"

#include <algorithm>
#include <deque>
#include <unordered_map>

#include "base/check.h"

namespace porter::zero {

namespace {

constexpr size_t kMaxInFlight = 2;  // GradReducer's packed buckets in flight

class BucketReplay {
 public:
  BucketReplay(const std::vector<Bucket>& buckets, const Partition& part,
               const ReducerOptions& options)
      : buckets_(buckets), part_(part), options_(options), n_(part.world_size),
        elem_(tensor::dtype_size(options.grad_dtype)),
        live_(buckets.size(), 0), issued_(buckets.size(), false) {
    // Each stage's buckets, in bucket order, so a replay is linear in stages and buckets.
    for (size_t b = 0; b < buckets.size(); ++b) {
      allocated_before_[buckets[b].alloc_before].push_back(b);
      ready_after_[buckets[b].ready_after].push_back(b);
    }
  }

  size_t alive() const { return alive_; }
  size_t peak() const { return peak_; }
  void reset_peak() { peak_ = alive_; }

  // before_backward: stages 2 and 3 allocate the contiguous buffer of each bucket whose
  // highest writer's backward comes next.
  void before_backward(int stage) {
    if (options_.zero_stage < 2) return;
    const auto it = allocated_before_.find(stage);
    if (it == allocated_before_.end()) return;
    for (size_t b : it->second) {
      if (live_[b] != 0) continue;
      live_[b] = static_cast<size_t>(buckets_[b].elems()) * elem_;
      add(live_[b]);
    }
  }

  // after_backward: the buckets this backward completed are issued, unless the reduction
  // waits for the end of the micro-batch (overlap_comm off with more than one rank).
  void after_backward(int stage) {
    if (!options_.overlap_comm && n_ > 1) return;
    const auto it = ready_after_.find(stage);
    if (it == ready_after_.end()) return;
    for (size_t b : it->second) issue(b);
  }

  // end_micro_batch: what was not issued is, then every reduction completes.
  void end_micro_batch() {
    for (size_t b = 0; b < buckets_.size(); ++b)
      if (!issued_[b]) issue(b);
    while (!pending_.empty()) complete_oldest();
    for (size_t& l : live_) {
      sub(l);
      l = 0;
    }
  }

 private:
  void add(size_t bytes) {
    alive_ += bytes;
    peak_ = std::max(peak_, alive_);
  }
  void sub(size_t bytes) {
    PORTER_CHECK(bytes <= alive_, "bucket replay: freeing more than is alive");
    alive_ -= bytes;
  }
  void complete_oldest() {
    sub(pending_.front());
    pending_.pop_front();
  }

  // GradReducer::issue: the contiguous buffer (stages 2 and 3) is moved into the issue and
  // freed at its end, unless the all-reduce keeps it as its result; a packed bucket is
  // allocated beside it first.
  void issue(size_t b) {
    issued_[b] = true;
    const size_t contiguous = live_[b];
    live_[b] = 0;
    if (n_ == 1 || options_.zero_stage == 0) {  // into the shard, or all-reduced in place
      sub(contiguous);
      return;
    }
    const BucketBlocks bb = bucket_blocks(buckets_[b].lo, buckets_[b].hi, part_);
    while (pending_.size() >= kMaxInFlight) complete_oldest();
    if (bb.use_all_reduce(buckets_[b].elems())) {
      pending_.push_back(contiguous);  // the reduced buffer (a flat-buffer view below stage 2)
      return;
    }
    const size_t packed = static_cast<size_t>(bb.block) * static_cast<size_t>(n_) * elem_;
    add(packed);
    sub(contiguous);
    pending_.push_back(packed);
  }

  const std::vector<Bucket>& buckets_;
  const Partition& part_;
  const ReducerOptions& options_;
  const int n_;
  const size_t elem_;  // bytes of a gradient element
  std::unordered_map<int, std::vector<size_t>> allocated_before_, ready_after_;
  std::vector<size_t> live_;     // contiguous buffers
  std::vector<bool> issued_;
  std::deque<size_t> pending_;   // bytes each pending reduction holds
  size_t alive_ = 0;
  size_t peak_ = 0;
};

}  // namespace

std::vector<BucketBytes> bucket_bytes(const std::vector<Bucket>& buckets, const Partition& part,
                                      const ReducerOptions& options, int num_stages) {
  PORTER_CHECK(num_stages >= 1, "bucket_bytes: num_stages ", num_stages);
  std::vector<BucketBytes> out(static_cast<size_t>(num_stages));
  BucketReplay r(buckets, part, options);
  for (int s = num_stages - 1; s >= 0; --s) {
    BucketBytes& b = out[static_cast<size_t>(s)];
    b.between = r.alive();
    r.before_backward(s);
    b.during = r.alive();
    r.reset_peak();
    r.after_backward(s);
    if (s == 0) r.end_micro_batch();
    b.after = r.peak();
  }
  return out;
}

}  // namespace porter::zero
