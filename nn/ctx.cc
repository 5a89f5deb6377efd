// The save context: op dispatch per mode, the tape, and the recompute plan
// (Note [Save context] in ctx.h).
#include "nn/ctx.h"

#include <algorithm>
#include <set>

#include <sys/mman.h>

#include "base/check.h"
#include "base/error.h"

namespace porter::nn {

namespace {

// Skipped ops return tensors that point into a reserved, inaccessible address range: never
// read (Note [Save context]), but non-null so shapes, reshapes and slices work on them, and
// a read by mistake faults instead of returning garbage.
constexpr size_t kPlaceholderRangeBytes = size_t{1} << 36;

void* placeholder_address() {
  static void* const base = [] {
    void* p = mmap(nullptr, kPlaceholderRangeBytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    PORTER_ASSERT(p != MAP_FAILED, "cannot reserve the placeholder address range");
    return p;
  }();
  return base;
}

bool is_placeholder(const Tensor& t) {
  const auto* p = static_cast<const std::byte*>(t.data());
  const auto* s = static_cast<const std::byte*>(placeholder_address());
  return p != nullptr && p >= s && p < s + kPlaceholderRangeBytes;
}

}  // namespace

std::string_view op_kind_name(OpKind kind) {
  constexpr std::array<std::string_view, kNumOpKinds> kNames = {
      "matmul", "layernorm", "gelu", "attention", "dropout",
      "add",    "bias",      "embedding", "loss", "other"};
  return kNames[static_cast<size_t>(kind)];
}

std::string_view save_mode_name(SaveMode mode) {
  switch (mode) {
    case SaveMode::kSaveAll: return "save-all";
    case SaveMode::kCheckpoint: return "checkpoint";
    case SaveMode::kRecompute: return "recompute";
    case SaveMode::kBackward: return "backward";
  }
  return "?";
}

OpPolicy OpPolicy::keep_none() { return OpPolicy{}; }

OpPolicy OpPolicy::keep_all() {
  OpPolicy p;
  p.keep_.fill(true);
  return p;
}

OpPolicy OpPolicy::keep_only(std::initializer_list<OpKind> kinds) {
  OpPolicy p;
  for (OpKind k : kinds) p.keep_[static_cast<size_t>(k)] = true;
  return p;
}

OpPolicy OpPolicy::recompute_only(std::initializer_list<OpKind> kinds) {
  OpPolicy p = keep_all();
  for (OpKind k : kinds) p.keep_[static_cast<size_t>(k)] = false;
  return p;
}

std::string OpPolicy::to_string() const {
  // The shorter of the two spellings: "keep {matmul}" or "recompute {attention}".
  const int kept = static_cast<int>(std::count(keep_.begin(), keep_.end(), true));
  const bool list_kept = kept <= kNumOpKinds - kept;
  std::string s = list_kept ? "keep {" : "recompute {";
  bool first = true;
  for (int i = 0; i < kNumOpKinds; ++i) {
    if (keep_[i] != list_kept) continue;
    s += (first ? "" : ", ") + std::string(op_kind_name(static_cast<OpKind>(i)));
    first = false;
  }
  return s + "}";
}

void Tape::clear() {
  saved_.clear();
  plan_.clear();
  saved_refs_.clear();
}

size_t Tape::saved_bytes() const {
  // Views share an allocation; count each byte range once (by start address and length).
  std::set<std::pair<const void*, size_t>> seen;
  size_t total = 0;
  auto count = [&](const Tensor& t) {
    if (!t.defined() || t.numel() == 0 || is_placeholder(t)) return;
    if (seen.insert({t.data(), t.nbytes()}).second) total += t.nbytes();
  };
  for (const auto& [name, t] : saved_) count(t);
  for (const auto& rec : plan_)
    for (const auto& t : rec.kept) count(t);
  return total;
}

std::vector<std::string> Tape::plan_actions() const {
  std::vector<std::string> out;
  for (const auto& rec : plan_) {
    const char* a = rec.action == Action::kReplay ? "replay"
                    : rec.action == Action::kSkip ? "skip"
                                                  : "compute";
    out.push_back(rec.name + ":" + a);
  }
  return out;
}

Ctx::Ctx(Kernels& kernels, memory::CachingAllocator& allocator, DType compute_dtype)
    : kernels_(&kernels), allocator_(&allocator), dtype_(compute_dtype) {}

void Ctx::begin(int stage, Tape& tape, SaveMode mode, const OpPolicy& policy) {
  PORTER_CHECK(!active_, "Ctx::begin for stage ", stage, " while stage ", stage_,
               " is still running; call end() first");
  if (mode == SaveMode::kRecompute) {
    PORTER_CHECK(tape.has_plan(), "recompute of stage ", stage,
                 " without a checkpointed forward on this tape");
  }
  if (mode == SaveMode::kSaveAll || mode == SaveMode::kCheckpoint) tape.clear();
  tape_ = &tape;
  mode_ = mode;
  policy_ = policy;
  stage_ = stage;
  op_index_ = 0;
  dropout_site_ = 0;
  active_ = true;
}

void Ctx::end() {
  PORTER_CHECK(active_, "Ctx::end without begin");
  if (mode_ == SaveMode::kCheckpoint) {
    plan_recompute();
  } else if (mode_ == SaveMode::kRecompute) {
    if (op_index_ != static_cast<int>(tape_->plan_.size())) {
      throw InternalError("recompute of stage " + std::to_string(stage_) + " ran " +
                          std::to_string(op_index_) + " ops, its checkpointed forward ran " +
                          std::to_string(tape_->plan_.size()) +
                          ": the layer's forward must run the same ops every time");
    }
    tape_->plan_.clear();
    tape_->saved_refs_.clear();
  }
  active_ = false;
  tape_ = nullptr;
}

void Ctx::abort() noexcept {
  if (tape_ != nullptr) tape_->clear();
  active_ = false;
  tape_ = nullptr;
}

Tape::Ref Ctx::find_producer(const Tensor& t) const {
  const auto* p = static_cast<const std::byte*>(t.data());
  // Newest first: memory freed by an earlier op's output may be reused by a later one.
  for (int i = static_cast<int>(tape_->plan_.size()) - 1; i >= 0; --i) {
    const auto& rec = tape_->plan_[i];
    for (size_t s = 0; s < rec.out_begin.size(); ++s) {
      const auto* b = static_cast<const std::byte*>(rec.out_begin[s]);
      if (p >= b && p < b + rec.out_bytes[s]) return {i, static_cast<int>(s)};
    }
  }
  return {};
}

std::vector<Tensor> Ctx::op(OpKind kind, std::string_view name,
                            std::initializer_list<Tensor> inputs,
                            std::initializer_list<OutSpec> outputs, const Compute& compute) {
  PORTER_CHECK(active_ && mode_ != SaveMode::kBackward, "op '", name,
               "' outside a forward (mode ", save_mode_name(mode_), ")");
  const int index = op_index_++;
  std::vector<Tensor> outs;
  outs.reserve(outputs.size());

  if (mode_ == SaveMode::kRecompute) {
    if (index >= static_cast<int>(tape_->plan_.size()) || tape_->plan_[index].kind != kind ||
        tape_->plan_[index].name != name) {
      throw InternalError("recompute of stage " + std::to_string(stage_) + ": op " +
                          std::to_string(index) + " is '" + std::string(name) +
                          "', not what the checkpointed forward ran; the layer's forward must "
                          "run the same ops every time");
    }
    Tape::OpRecord& rec = tape_->plan_[index];
    if (rec.action != Tape::Action::kCompute) {
      size_t s = 0;
      for (const OutSpec& o : outputs) {
        if (rec.action == Tape::Action::kReplay && s < rec.kept.size() && rec.kept[s].defined() &&
            rec.kept[s].data() != nullptr) {
          outs.push_back(rec.kept[s]);
        } else {
          outs.push_back(Tensor::from_blob(placeholder_address(), o.shape, o.dtype));
        }
        ++s;
      }
      rec.kept.clear();  // ownership passes to whoever saves them again
      return outs;
    }
    for (const Tensor& in : inputs) {
      PORTER_ASSERT(!is_placeholder(in), "op '", name, "' of stage ", stage_,
                    " recomputes from an input its plan skipped");
    }
  }

  const bool may_keep = mode_ != SaveMode::kCheckpoint || policy_.keeps(kind);
  // Every forward output is activation memory, kept or not: the activation footprint is
  // what checkpoint policies trade (Note [Save context]).
  for (const OutSpec& o : outputs) {
    outs.push_back(Tensor::empty(*allocator_, o.shape, o.dtype, memory::Category::kActivations));
  }
  compute(outs);

  if (mode_ == SaveMode::kCheckpoint) {
    Tape::OpRecord rec{kind, std::string(name), {}, {}, {}, {}, Tape::Action::kCompute};
    for (const Tensor& in : inputs) rec.inputs.push_back(find_producer(in));
    for (const Tensor& t : outs) {
      rec.out_begin.push_back(t.data());
      rec.out_bytes.push_back(t.nbytes());
    }
    if (may_keep) rec.kept = outs;
    tape_->plan_.push_back(std::move(rec));
  }
  return outs;
}

void Ctx::plan_recompute() {
  auto& plan = tape_->plan_;
  std::vector<std::vector<bool>> needed(plan.size());
  for (size_t i = 0; i < plan.size(); ++i) needed[i].assign(plan[i].out_begin.size(), false);
  for (const Tape::Ref& r : tape_->saved_refs_)
    if (r.op >= 0) needed[r.op][r.slot] = true;
  for (int i = static_cast<int>(plan.size()) - 1; i >= 0; --i) {
    auto& rec = plan[i];
    bool any = std::find(needed[i].begin(), needed[i].end(), true) != needed[i].end();
    if (!any) {
      rec.action = Tape::Action::kSkip;
      rec.kept.clear();
    } else if (policy_.keeps(rec.kind)) {
      rec.action = Tape::Action::kReplay;
      for (size_t s = 0; s < rec.kept.size(); ++s)
        if (!needed[i][s]) rec.kept[s] = Tensor();
    } else {
      rec.action = Tape::Action::kCompute;
      rec.kept.clear();
      for (const Tape::Ref& r : rec.inputs)
        if (r.op >= 0) needed[r.op][r.slot] = true;
    }
    // Addresses are meaningless once the forward ends; recompute matches ops by position.
    rec.out_begin.assign(rec.out_begin.size(), nullptr);
    rec.inputs.clear();
  }
  // The saves themselves are made again by the recompute.
  tape_->saved_.clear();
  tape_->saved_refs_.clear();
}

void Ctx::save(std::string_view name, const Tensor& t) {
  PORTER_CHECK(active_ && mode_ != SaveMode::kBackward, "save('", name, "') outside a forward");
  for (const auto& [n, _] : tape_->saved_) {
    PORTER_CHECK(n != name, "stage ", stage_, " saves '", name, "' twice");
  }
  PORTER_ASSERT(!is_placeholder(t), "stage ", stage_, " saves '", name,
                "', which its recompute plan skipped");
  if (mode_ == SaveMode::kCheckpoint) {
    // Only the name (for the duplicate check) and the producer: holding the tensor would
    // keep it alive until end(). A kept op output holds it where the policy says so.
    tape_->saved_refs_.push_back(find_producer(t));
    tape_->saved_.emplace_back(std::string(name), Tensor());
    return;
  }
  tape_->saved_.emplace_back(std::string(name), t);
}

const Tensor& Ctx::saved(std::string_view name) const {
  PORTER_CHECK(active_ && tape_ != nullptr, "saved('", name, "') outside a stage");
  for (const auto& [n, t] : tape_->saved_)
    if (n == name) return t;
  std::string have;
  for (const auto& [n, _] : tape_->saved_) have += (have.empty() ? "" : ", ") + n;
  throw InvalidArgument("stage " + std::to_string(stage_) + " reads saved tensor '" +
                        std::string(name) + "', which its forward did not save (saved: " +
                        (have.empty() ? "none" : have) + ")");
}

PhiloxKey Ctx::dropout_key_for(int site, int64_t element_offset) const {
  PORTER_CHECK(element_offset >= 0 && element_offset % 4 == 0, "dropout element offset ",
               element_offset, " must be a non-negative multiple of 4 (Note [Dropout keys])");
  PhiloxKey key = dropout_key(run_.seed, static_cast<uint32_t>(stage_), run_.step,
                              run_.micro_batch, static_cast<uint32_t>(site));
  key.group_offset = static_cast<uint64_t>(element_offset / 4);
  return key;
}

const Tensor* Batch::find(std::string_view name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return &t;
  }
  return nullptr;
}

const Tensor& Batch::get(std::string_view name) const {
  if (const Tensor* t = find(name)) return *t;
  std::string names;
  for (const auto& [n, t] : tensors) names += (names.empty() ? "" : ", ") + n;
  throw InvalidArgument("the micro-batch has no tensor \"" + std::string(name) + "\"; it has " +
                        (names.empty() ? std::string("none") : names));
}

const Tensor& Ctx::batch(std::string_view name) const {
  if (batch_ == nullptr) {
    throw InvalidArgument("Ctx::batch(\"" + std::string(name) + "\"): no micro-batch is being run");
  }
  return batch_->get(name);
}

comm::ElemType comm_type(DType t) {
  switch (t) {
    case DType::kF32: return comm::ElemType::kF32;
    case DType::kBF16: return comm::ElemType::kBF16;
    case DType::kF16: return comm::ElemType::kF16;
    case DType::kI32: return comm::ElemType::kI32;
    case DType::kI64:
    case DType::kBool: break;
  }
  PORTER_CHECK(false, "no collective takes ", dtype_name(t), " tensors");
  return comm::ElemType::kF32;
}

comm::Work Ctx::tp_all_reduce(Tensor& t) {
  PORTER_CHECK(tp_ != nullptr, "tp_all_reduce without a tensor-parallel group");
  return tp_->all_reduce(t.data(), static_cast<size_t>(t.numel()), comm_type(t.dtype()),
                         comm::ReduceOp::kSum);
}

comm::Work Ctx::tp_all_gather(const Tensor& in, Tensor& out) {
  PORTER_CHECK(tp_ != nullptr, "tp_all_gather without a tensor-parallel group");
  PORTER_CHECK(out.numel() == in.numel() * tp_->size() && out.dtype() == in.dtype(),
               "tp_all_gather: out has ", out.numel(), " elements for ", tp_->size(), " x ",
               in.numel());
  return tp_->all_gather(in.data(), out.data(), static_cast<size_t>(in.numel()),
                         comm_type(in.dtype()));
}

comm::Work Ctx::tp_reduce_scatter(const Tensor& in, Tensor& out) {
  PORTER_CHECK(tp_ != nullptr, "tp_reduce_scatter without a tensor-parallel group");
  PORTER_CHECK(in.numel() == out.numel() * tp_->size() && out.dtype() == in.dtype(),
               "tp_reduce_scatter: in has ", in.numel(), " elements for ", tp_->size(), " x ",
               out.numel());
  return tp_->reduce_scatter(in.data(), out.data(), static_cast<size_t>(out.numel()),
                             comm_type(in.dtype()), comm::ReduceOp::kSum);
}

void Ctx::tp_wait(comm::Work& work) { work.wait_on(allocator_->device().compute_stream()); }

Tensor Ctx::workspace(Shape shape, DType dtype) {
  return Tensor::empty(*allocator_, shape, dtype, memory::Category::kWorkspace);
}

Tensor Ctx::linear(std::string_view name, const Tensor& x, const Tensor& w, const Tensor& b) {
  const int64_t n = x.numel() / x.dim(-1);
  std::vector<int64_t> dims = x.shape().to_vector();
  dims.back() = w.dim(0);
  Shape out_shape(dims);
  return op(OpKind::kMatmul, name, {x, w, b}, {{out_shape, x.dtype()}},
            [&](std::span<Tensor> out) {
              Tensor y = out[0].reshape({n, w.dim(0)});
              kernels_->matmul(x.reshape({n, x.dim(-1)}), w, y, MatmulSpec{false, true});
              if (b.data() != nullptr) kernels_->bias_add(y, b);
            })[0];
}

std::array<Tensor, 3> Ctx::layernorm(std::string_view name, const Tensor& x, const Tensor& gamma,
                                     const Tensor& beta, float eps) {
  const int64_t n = x.numel() / x.dim(-1);
  auto outs = op(OpKind::kLayerNorm, name, {x, gamma, beta},
                 {{x.shape(), x.dtype()}, {Shape{n}, DType::kF32}, {Shape{n}, DType::kF32}},
                 [&](std::span<Tensor> out) {
                   Tensor y = out[0].reshape({n, x.dim(-1)});
                   kernels_->layernorm_forward(x.reshape({n, x.dim(-1)}), gamma, beta, y, out[1],
                                               out[2], eps);
                 });
  return {outs[0], outs[1], outs[2]};
}

std::array<Tensor, 2> Ctx::rmsnorm(std::string_view name, const Tensor& x, const Tensor& gamma,
                                   float eps) {
  const int64_t n = x.numel() / x.dim(-1);
  auto outs = op(OpKind::kLayerNorm, name, {x, gamma},
                 {{x.shape(), x.dtype()}, {Shape{n}, DType::kF32}}, [&](std::span<Tensor> out) {
                   Tensor y = out[0].reshape({n, x.dim(-1)});
                   kernels_->rmsnorm_forward(x.reshape({n, x.dim(-1)}), gamma, y, out[1], eps);
                 });
  return {outs[0], outs[1]};
}

Tensor Ctx::swiglu(std::string_view name, const Tensor& gate, const Tensor& up) {
  return op(OpKind::kGelu, name, {gate, up}, {{gate.shape(), gate.dtype()}},
            [&](std::span<Tensor> out) { kernels_->swiglu_forward(gate, up, out[0]); })[0];
}

Tensor Ctx::rope_qkv(std::string_view name, const Tensor& q, const Tensor& k, const Tensor& v,
                     int heads, int kv_heads, double theta, bool packed) {
  const Shape shape{q.dim(0), q.dim(1), packed ? q.dim(2) + 2 * k.dim(2) : 3 * q.dim(2)};
  return op(OpKind::kOther, name, {q, k, v}, {{shape, q.dtype()}}, [&](std::span<Tensor> out) {
    kernels_->rope_qkv_forward(q, k, v, out[0], heads, kv_heads, theta);
  })[0];
}

Tensor Ctx::gelu(std::string_view name, const Tensor& x) {
  return op(OpKind::kGelu, name, {x}, {{x.shape(), x.dtype()}},
            [&](std::span<Tensor> out) { kernels_->gelu_forward(x, out[0]); })[0];
}

std::array<Tensor, 2> Ctx::attention(std::string_view name, const Tensor& qkv, int heads) {
  const int64_t b = qkv.dim(0), t = qkv.dim(1), c = qkv.dim(2) / 3;
  auto outs = op(OpKind::kAttention, name, {qkv},
                 {{Shape{b, t, c}, qkv.dtype()}, {Shape{b, heads, t, t}, DType::kF32}},
                 [&](std::span<Tensor> out) {
                   kernels_->attention_forward(qkv, out[0], out[1], heads);
                 });
  return {outs[0], outs[1]};
}

std::array<Tensor, 2> Ctx::flash_attention(std::string_view name, const Tensor& qkv, int heads,
                                           int kv_heads) {
  const int64_t b = qkv.dim(0), t = qkv.dim(1);
  const int64_t d = qkv.dim(2) / (heads + 2 * int64_t{kv_heads});
  auto outs = op(OpKind::kAttention, name, {qkv},
                 {{Shape{b, t, heads * d}, qkv.dtype()}, {Shape{b, heads, t}, DType::kF32}},
                 [&](std::span<Tensor> out) {
                   kernels_->flash_attention_forward(qkv, out[0], out[1], heads, kv_heads);
                 });
  return {outs[0], outs[1]};
}

Tensor Ctx::dropout(std::string_view name, const Tensor& x, float p, int64_t element_offset) {
  const int site = dropout_site_++;
  if (p == 0.0f || run_.eval) return x;
  const PhiloxKey key = dropout_key_for(site, element_offset);
  return op(OpKind::kDropout, name, {x}, {{x.shape(), x.dtype()}},
            [&](std::span<Tensor> out) { kernels_->dropout_forward(x, out[0], p, key); })[0];
}

Tensor Ctx::add(std::string_view name, const Tensor& a, const Tensor& b) {
  return op(OpKind::kAdd, name, {a, b}, {{a.shape(), a.dtype()}},
            [&](std::span<Tensor> out) { kernels_->add(a, b, out[0]); })[0];
}

}  // namespace porter::nn
