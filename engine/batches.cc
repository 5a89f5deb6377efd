// A step's micro-batches: their checks against what the engine was planned for, and their
// ids on the device (engine_impl.h).
#include <algorithm>
#include <climits>
#include <optional>
#include <string>

#include "base/check.h"
#include "engine/engine_impl.h"

namespace porter::engine {

io::HostBatch synthetic_batch(const RunOptions& run, const Model& model) {
  io::HostBatch mb;
  for (const BatchField& f : model.batch_spec(run)) {
    const int64_t n = f.shape.numel();
    if ((f.name == "tokens" || f.name == "targets") && f.dtype == tensor::DType::kI32 &&
        f.shape.rank() == 2) {
      const int64_t vocab = std::max<int64_t>(1, model.vocab_size().value_or(run.shape.model.vocab));
      mb.batch = f.shape[0];
      mb.seq = f.shape[1];
      std::vector<int32_t>& ids = f.name == "tokens" ? mb.tokens : mb.targets;
      const int64_t mul = f.name == "tokens" ? 7 : 5, add = f.name == "tokens" ? 3 : 1;
      for (int64_t i = 0; i < n; ++i) ids.push_back(static_cast<int32_t>((i * mul + add) % vocab));
      continue;
    }
    switch (f.dtype) {
      case tensor::DType::kF32: {
        std::vector<float> v(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<float>((i * 7 + 3) % 16) / 16.0f - 0.5f;
        mb.tensors.push_back(io::HostTensor::of(f.name, f.shape, std::move(v)));
        break;
      }
      default: {
        std::vector<std::byte> zeros(static_cast<size_t>(n) * tensor::dtype_size(f.dtype));
        mb.tensors.push_back(io::HostTensor::of_bytes(f.name, f.shape, f.dtype, zeros.data()));
        break;
      }
    }
  }
  return mb;
}

namespace {

// Whether field `f` comes from a token batch's `tokens` / `targets` vector (no named tensor
// of that name): the (batch, seq) i32 fields of Model::batch_spec's default.
bool is_token_vector(const io::HostBatch& mb, const BatchField& f) {
  return (f.name == "tokens" || f.name == "targets") && f.dtype == tensor::DType::kI32 &&
         f.shape.rank() == 2 && mb.find(f.name) == nullptr;
}

// The host tensor of field `f` in `mb`: a token batch's vector as (batch, seq) i32, else the
// named tensor (check_batch has found it).
io::HostTensor host_tensor(const io::HostBatch& mb, const BatchField& f) {
  if (!is_token_vector(mb, f)) return *mb.find(f.name);
  io::HostTensor t;
  t.name = f.name;
  t.shape = tensor::Shape{mb.batch, mb.seq};
  t.dtype = tensor::DType::kI32;
  t.data = f.name == "tokens" ? mb.tokens.data() : mb.targets.data();
  return t;
}

std::string field_names(const std::vector<BatchField>& spec) {
  std::string out;
  for (const BatchField& f : spec) {
    out += (out.empty() ? "" : ", ") + f.name + " " + std::string(tensor::dtype_name(f.dtype)) +
           " " + f.shape.to_string();
  }
  return out;
}

}  // namespace

nn::Batch upload_batch(memory::CachingAllocator& alloc, const io::HostBatch& mb,
                       const std::vector<BatchField>& spec) {
  nn::Batch out;
  for (const BatchField& f : spec) {
    const io::HostTensor host = host_tensor(mb, f);  // check_batch has found it
    const io::HostTensor* h = &host;
    tensor::Tensor t = tensor::Tensor::empty(alloc, f.shape, f.dtype, memory::Category::kWorkspace);
    if (h->dtype == f.dtype) {
      if (t.nbytes() > 0) alloc.device().copy_sync(t.data(), h->data, t.nbytes());
    } else {  // i64 -> i32, checked by check_batches
      std::vector<int32_t> narrow(static_cast<size_t>(t.numel()));
      const auto* wide = static_cast<const int64_t*>(h->data);
      for (size_t i = 0; i < narrow.size(); ++i) narrow[i] = static_cast<int32_t>(wide[i]);
      if (t.nbytes() > 0) alloc.device().copy_sync(t.data(), narrow.data(), t.nbytes());
    }
    out.tensors.emplace_back(f.name, std::move(t));
  }
  return out;
}

void check_batches(const RunOptions& run, Model& model,
                   const std::vector<io::HostBatch>& micro_batches, size_t expected_count) {
  if (expected_count > 0) {
    PORTER_CHECK(micro_batches.size() == expected_count, "train_step: ", micro_batches.size(),
                 " micro-batches, but gradient_accumulation_steps is ", expected_count,
                 "; pass one HostBatch per accumulation step");
  } else {
    PORTER_CHECK(!micro_batches.empty(), "evaluate: no micro-batches");
  }
  const std::vector<BatchField> spec = model.batch_spec(run);
  for (size_t i = 0; i < micro_batches.size(); ++i) check_batch(spec, model, micro_batches[i], i);
}

void check_batch(const std::vector<BatchField>& spec, Model& model, const io::HostBatch& mb,
                 size_t i) {
  // Note [Model capabilities]: only a model with a vocabulary bounds the ids.
  const std::optional<int64_t> vocab = model.vocab_size();
  {
    for (const BatchField& f : spec) {
      if (is_token_vector(mb, f)) {
        // A token batch's vectors: (micro_batch, seq_len) i32 each, as the engine was planned.
        PORTER_CHECK(mb.batch == f.shape[0] && mb.seq == f.shape[1], "micro-batch ", i, " is (",
                     mb.batch, ", ", mb.seq, "), the engine was planned for "
                     "(train_micro_batch_size_per_gpu, porter.model.seq_len) = (", f.shape[0],
                     ", ", f.shape[1], ")");
        PORTER_CHECK(static_cast<int64_t>(mb.tokens.size()) == f.shape.numel() &&
                         static_cast<int64_t>(mb.targets.size()) == f.shape.numel(),
                     "micro-batch ", i, " has ", mb.tokens.size(), " tokens and ",
                     mb.targets.size(), " targets; (", f.shape[0], ", ", f.shape[1], ") needs ",
                     f.shape.numel(), " of each");
        continue;
      }
      const io::HostTensor* h = mb.find(f.name);
      PORTER_CHECK(h != nullptr, "micro-batch ", i, " has no tensor \"", f.name,
                   "\"; the model takes ", field_names(spec));
      const bool narrows = h->dtype == tensor::DType::kI64 && f.dtype == tensor::DType::kI32;
      PORTER_CHECK(h->dtype == f.dtype || narrows, "micro-batch ", i, " tensor \"", f.name,
                   "\" is ", tensor::dtype_name(h->dtype), "; the model takes ",
                   tensor::dtype_name(f.dtype));
      PORTER_CHECK(h->shape == f.shape, "micro-batch ", i, " tensor \"", f.name, "\" is ",
                   h->shape.to_string(), "; the model takes ", f.shape.to_string(),
                   " (its first dimension is train_micro_batch_size_per_gpu)");
      PORTER_CHECK(h->data != nullptr || f.shape.numel() == 0, "micro-batch ", i, " tensor \"",
                   f.name, "\" has no data");
      if (narrows) {
        const auto* wide = static_cast<const int64_t*>(h->data);
        for (int64_t j = 0; j < f.shape.numel(); ++j) {
          PORTER_CHECK(wide[j] >= INT32_MIN && wide[j] <= INT32_MAX, "micro-batch ", i,
                       " tensor \"", f.name, "\" element ", j, " = ", wide[j],
                       " does not fit the model's i32");
        }
      }
    }
    if (!vocab) return;
    for (const BatchField& f : spec) {
      if (f.name != "tokens" && f.name != "targets") continue;
      const io::HostTensor h = host_tensor(mb, f);
      if (h.dtype != tensor::DType::kI32) continue;
      const auto* ids = static_cast<const int32_t*>(h.data);
      for (int64_t j = 0; j < h.shape.numel(); ++j) {
        PORTER_CHECK(ids[j] >= 0 && ids[j] < *vocab, "micro-batch ", i, " position ", j, ": ",
                     f.name == "tokens" ? "token " : "target ", ids[j],
                     " outside the vocabulary [0, ", *vocab, ")");
      }
    }
  }
}

}  // namespace porter::engine
