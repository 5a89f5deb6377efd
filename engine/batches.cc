// A step's micro-batches: their checks against what the engine was planned for, and their
// ids on the device (engine_impl.h).
#include <optional>

#include "base/check.h"
#include "engine/engine_impl.h"

namespace porter::engine {

tensor::Tensor upload_ids(memory::CachingAllocator& alloc, const std::vector<int32_t>& ids,
                          int64_t batch, int64_t seq) {
  tensor::Tensor t = tensor::Tensor::empty(alloc, tensor::Shape{batch, seq}, tensor::DType::kI32,
                                           memory::Category::kWorkspace);
  if (!ids.empty()) alloc.device().copy_sync(t.data(), ids.data(), t.nbytes());
  return t;
}

void check_batches(const RunOptions& run, Model& model,
                   const std::vector<io::HostBatch>& micro_batches, size_t expected_count) {
  const int64_t b = run.shape.micro_batch;
  const int64_t t = run.shape.seq;
  if (expected_count > 0) {
    PORTER_CHECK(micro_batches.size() == expected_count, "train_step: ", micro_batches.size(),
                 " micro-batches, but gradient_accumulation_steps is ", expected_count,
                 "; pass one HostBatch per accumulation step");
  } else {
    PORTER_CHECK(!micro_batches.empty(), "evaluate: no micro-batches");
  }
  // Note [Model capabilities]: only a model with a vocabulary bounds the ids.
  const std::optional<int64_t> vocab = model.vocab_size();
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    const io::HostBatch& mb = micro_batches[i];
    PORTER_CHECK(mb.batch == b && mb.seq == t, "micro-batch ", i, " is (", mb.batch, ", ",
                 mb.seq, "), the engine was planned for (train_micro_batch_size_per_gpu, "
                 "porter.model.seq_len) = (", b, ", ", t, ")");
    const size_t n = static_cast<size_t>(b * t);
    PORTER_CHECK(mb.tokens.size() == n && mb.targets.size() == n, "micro-batch ", i, " has ",
                 mb.tokens.size(), " tokens and ", mb.targets.size(), " targets; (", b, ", ", t,
                 ") needs ", n, " of each");
    if (!vocab) continue;
    for (size_t j = 0; j < n; ++j) {
      PORTER_CHECK(mb.tokens[j] >= 0 && mb.tokens[j] < *vocab && mb.targets[j] >= 0 &&
                       mb.targets[j] < *vocab,
                   "micro-batch ", i, " position ", j, ": token ", mb.tokens[j], " / target ",
                   mb.targets[j], " outside the vocabulary [0, ", *vocab, ")");
    }
  }
}

}  // namespace porter::engine
