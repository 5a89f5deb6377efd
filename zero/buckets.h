// Gradient buckets: which stages' gradients are reduced together, when a bucket's buffer is
// needed and when it is complete, and how a bucket is laid out for reduce_scatter.
// See docs/zero.md, "Buckets".
//
// Note [Gradient buckets]
// Stage s's parameters occupy the flat range [lo_s, hi_s) (consecutive stages abut). Buckets
// group consecutive stages in backward order (last stage first) while their ranges add up to
// at most reduce_bucket_size elements; a stage larger than that is a bucket of its own, and a
// stage without parameters joins no bucket. A bucket covers the union [lo, hi) of its stages'
// ranges. Backward writes a stage's parameter gradients in that stage's backward, but a model
// may let another stage write them too (tied embeddings: the head's backward writes the
// embedding's wte gradient); writers(s) lists every stage whose backward writes into stage
// s's range. So a bucket is needed from the backward of its highest writer (alloc_before)
// and complete after the backward of its lowest writer (ready_after), backward running from
// the last stage down to 0.
//
// Note [Bucketed reduce-scatter]
// A bucket [lo, hi) does not cover whole shards, and reduce_scatter needs N equal blocks. Rank
// r's part of the bucket is its intersection I_r = [lo, hi) ∩ [r*S, (r+1)*S) (often empty).
// The bucket is packed into N blocks of B = max_r |I_r| elements: block r holds the gradients
// of I_r followed by zeros. reduce_scatter(packed, count B) leaves in rank r's block the sum
// over ranks of I_r's gradients, which rank r adds into its gradient shard at I_r.lo - r*S.
// Layers write into a contiguous bucket buffer (plain views, like the flat buffer); the pack is
// one copy per non-empty intersection on the compute stream. Payload per rank: N*B elements
// (between hi - lo and N * (hi - lo) when the bucket straddles few shards).
// A ring reduce-scatter of N*B elements sends (N-1)*B per rank; a ring all-reduce of the
// unpacked bucket sends 2(N-1)/N*(hi - lo). When N*B > 2*(hi - lo) (a bucket inside one or two
// shards of many) the bucket is all-reduced in place instead and each rank keeps I_r of the
// result (use_all_reduce()), so no bucket costs more than twice the ideal (N-1)/N*(hi - lo).
// Both give every element the same set of summands; only the ring's order differs, which is
// exact for N = 2 (a + b == b + a) and within rounding otherwise.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "nn/layer.h"
#include "zero/partition.h"

namespace porter::zero {

struct StageRange {
  int64_t lo = 0;  // flat elements [lo, hi) holding the stage's parameters
  int64_t hi = 0;
};

struct Bucket {
  int64_t lo = 0, hi = 0;      // flat range
  int first_stage = 0;         // stages [first_stage, last_stage]
  int last_stage = 0;
  int alloc_before = 0;        // the first backward (highest stage) that writes into it
  int ready_after = 0;         // the last backward (lowest stage) that writes into it
  int64_t elems() const { return hi - lo; }
};

// Note [Gradient buckets]. ranges[s] for every stage; writers[s] the stages writing into
// stage s's range (s itself is added). Throws InvalidArgument for ranges that do not abut in
// stage order or a bucket_elems < 1.
// The parameters one chain stage declares (Layer::params()), with its name for errors.
struct StageParams {
  std::string name;
  std::vector<nn::ParamSpec> params;
};
// Each chain stage's flat range (its entries, each rounded up to kParamAlignElems) and the
// stage owning each layout entry. Buckets follow stages, so the layout must list stage 0's
// parameters first, then stage 1's, ... (TransformerModel and ChainModel do); anything else throws
// InvalidArgument naming the first entry out of order.
struct StageLayout {
  std::vector<StageRange> ranges;  // per stage
  std::vector<int> entry_stage;    // per layout entry
};
StageLayout stage_layout(const nn::ParamLayout& layout, const std::vector<StageParams>& stages);

std::vector<Bucket> plan_buckets(const std::vector<StageRange>& ranges,
                                 const std::vector<std::vector<int>>& writers,
                                 int64_t bucket_elems);

// Note [Bucketed reduce-scatter].
struct BucketBlocks {
  int64_t block = 0;                // B
  std::vector<int64_t> lo, hi;      // I_r per rank (flat), lo == hi when empty
  int64_t size(int r) const { return hi[static_cast<size_t>(r)] - lo[static_cast<size_t>(r)]; }
  // Whether the all-reduce of the unpacked bucket sends fewer bytes (see the Note above).
  bool use_all_reduce(int64_t bucket_elems) const {
    return static_cast<int64_t>(lo.size()) * block > 2 * bucket_elems;
  }
};
BucketBlocks bucket_blocks(int64_t lo, int64_t hi, const Partition& part);

}  // namespace porter::zero
