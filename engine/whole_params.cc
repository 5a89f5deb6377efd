#include "engine/whole_params.h"

#include <algorithm>
#include <memory>

#include "base/check.h"
#include "comm/communicator.h"
#include "models/factory.h"
#include "tensor/tensor.h"

namespace porter::engine {

std::vector<float> whole_params_host(Engine& eng, comm::Communicator* tp) {
  // Every rank: at stage 3 this is a collective over the data-parallel ranks.
  std::vector<float> mine = eng.params_host();
  const int t = eng.tp_size();
  if (t == 1) return eng.dp_rank() == 0 ? mine : std::vector<float>{};
  PORTER_CHECK(tp != nullptr && tp->size() == t, "whole_params_host: the tensor-parallel "
               "communicator of ", t, " ranks");
  if (eng.dp_rank() != 0) return {};
  config::ModelConfig whole_config = eng.config().porter.model;
  whole_config.tensor_parallel = 1;
  whole_config.sequence_parallel = false;
  const std::unique_ptr<models::Transformer> whole_model = models::build_model(whole_config);
  const models::Transformer& whole = *whole_model;
  const int64_t p = whole.layout().total_elems();
  std::vector<std::unique_ptr<models::Transformer>> parts;
  int64_t part_elems = 0;  // the largest rank's layout; every rank pads to it
  for (int r = 0; r < t; ++r) {
    parts.push_back(models::build_model(eng.config().porter.model, r));
    part_elems = std::max(part_elems, parts.back()->layout().total_elems());
  }
  PORTER_CHECK_EQ(static_cast<int64_t>(mine.size()), parts[eng.tp_rank()]->layout().total_elems(),
                  "whole_params_host: this rank's parameters");
  mine.resize(static_cast<size_t>(part_elems), 0.0f);

  // All-gather the parts in chunks through device buffers (the communicator's memory).
  std::vector<float> all(static_cast<size_t>(part_elems) * static_cast<size_t>(t), 0.0f);
  constexpr int64_t kChunkElems = int64_t{1} << 20;
  for (int64_t begin = 0; begin < part_elems; begin += kChunkElems) {
    const int64_t n = std::min(kChunkElems, part_elems - begin);
    tensor::Tensor in = tensor::Tensor::empty(eng.allocator(), tensor::Shape{n}, tensor::DType::kF32,
                                      memory::Category::kComm);
    tensor::Tensor out = tensor::Tensor::empty(eng.allocator(), tensor::Shape{n * t}, tensor::DType::kF32,
                                       memory::Category::kComm);
    tensor::from_host_f32(eng.device(), std::vector<float>(mine.begin() + begin, mine.begin() + begin + n), in);
    {
      const comm::CommLabel label(tp, "whole params");
      tp->all_gather(in.data(), out.data(), static_cast<size_t>(n), comm::ElemType::kF32).wait();
    }
    const std::vector<float> got = tensor::to_host_f32(eng.device(), out);
    for (int r = 0; r < t; ++r) {
      std::copy(got.begin() + r * n, got.begin() + (r + 1) * n,
                all.begin() + static_cast<int64_t>(r) * part_elems + begin);
    }
  }

  // Where shard_values took each element from: the index + 1 of the whole element (0 for
  // padding), carried through it as two floats of 24 bits each (exact in f32).
  std::vector<float> values(static_cast<size_t>(p), 0.0f);
  std::vector<char> set(static_cast<size_t>(p), 0);
  std::vector<float> code(static_cast<size_t>(p));
  for (int r = 0; r < t; ++r) {
    for (int64_t i = 0; i < p; ++i) code[static_cast<size_t>(i)] = static_cast<float>((i + 1) & 0xffffff);
    const std::vector<float> low = parts[static_cast<size_t>(r)]->shard_values(code);
    for (int64_t i = 0; i < p; ++i) code[static_cast<size_t>(i)] = static_cast<float>((i + 1) >> 24);
    const std::vector<float> high = parts[static_cast<size_t>(r)]->shard_values(code);
    const float* part = all.data() + static_cast<int64_t>(r) * part_elems;
    for (size_t j = 0; j < low.size(); ++j) {
      const int64_t source = (static_cast<int64_t>(high[j]) << 24 | static_cast<int64_t>(low[j])) - 1;
      if (source < 0 || set[static_cast<size_t>(source)]) continue;  // padding, or replicated
      values[static_cast<size_t>(source)] = part[j];
      set[static_cast<size_t>(source)] = 1;
    }
  }
  // Every element of the whole layout's parameters came from some rank (the alignment
  // padding between them stays 0).
  for (const nn::ParamEntry& e : whole.layout().entries()) {
    for (int64_t i = 0; i < e.shape.numel(); ++i) {
      PORTER_ASSERT(set[static_cast<size_t>(e.offset_elems + i)], "whole_params_host: element ", i,
                    " of '", e.name, "' is on no tensor-parallel rank");
    }
  }
  return values;
}

}  // namespace porter::engine
