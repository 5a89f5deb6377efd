// Parameter groups of the optimizer: porter.optimizer's patterns resolved against a model's
// flat layout into runs of elements that share a weight decay and a learning-rate scale.
//
// Note [Parameter groups]
// porter.optimizer.param_groups is a list of {params: [patterns], weight_decay, lr_scale};
// porter.optimizer.no_decay a list of patterns (config/config.h has the pattern syntax). Each
// parameter of the layout, in layout order, gets
//   1. the first group one of whose patterns it matches: that group's weight_decay (the
//      optimizer's when the group gives none) and lr_scale;
//   2. else, when it matches a no_decay pattern: weight_decay 0, lr_scale 1;
//   3. else the optimizer's weight_decay, lr_scale 1.
// A group pattern that matches no parameter is an error (a misspelt name would otherwise
// train the group's parameters at the default settings); a no_decay pattern may match none
// (the default's "wpe" names the GPT's position table, which a Llama has not).
// The flat buffer (Note [Flat partition] in zero/partition.h) is then cut into runs
//   [runs[i].begin_elems, runs[i + 1].begin_elems), the last ending at padded_elems,
// each the elements of consecutive parameters with equal (weight_decay, lr_scale), an
// entry's alignment gap and the partition's tail padding going with the parameter before
// them. The runs are resolved once, over the whole buffer, so that they do not depend on the
// ZeRO stage, the rank count or the offload split: a rank's optimizer cuts its range at the
// run boundaries inside it and calls AdamW once per piece with that run's weight decay and
// lr x lr_scale. AdamW is elementwise, so each element's bits are those of one call over the
// whole buffer with its group's values. The padding elements (zero parameters and gradients)
// stay zero under any decay.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "nn/layer.h"

namespace porter::zero {

struct ParamRun {
  int64_t begin_elems = 0;  // in the padded flat buffer
  double weight_decay = 0.0;
  double lr_scale = 1.0;
  bool operator==(const ParamRun&) const = default;
};

// The runs of Note [Parameter groups] over [0, padded_elems) (padded_elems >= the layout's
// total_elems()), sorted, the first at 0; `weight_decay` is the optimizer's. Throws
// InvalidArgument naming porter.optimizer.param_groups[i].params[j] for a group pattern that
// matches no parameter.
std::vector<ParamRun> resolve_param_groups(const nn::ParamLayout& layout, int64_t padded_elems,
                                           const config::PorterOptimizerConfig& groups,
                                           double weight_decay);

// Which group each parameter of `layout` falls in, by name: (weight_decay, lr_scale), for
// reports and tests.
struct ParamGroupOf {
  std::string name;
  double weight_decay = 0.0;
  double lr_scale = 1.0;
};
std::vector<ParamGroupOf> param_groups_of(const nn::ParamLayout& layout,
                                          const config::PorterOptimizerConfig& groups,
                                          double weight_decay);

}  // namespace porter::zero
