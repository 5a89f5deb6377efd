// Parameter groups resolved into runs of the flat buffer (Note [Parameter groups]).
#include "zero/param_groups.h"

#include "base/check.h"
#include "base/error.h"

namespace porter::zero {

std::vector<ParamGroupOf> param_groups_of(const nn::ParamLayout& layout,
                                          const config::PorterOptimizerConfig& groups,
                                          double weight_decay) {
  const std::vector<config::ParamGroupConfig>& pg = groups.param_groups;
  std::vector<ParamGroupOf> out;
  for (const nn::ParamEntry& e : layout.entries()) {
    const int64_t rank = e.shape.rank();
    ParamGroupOf p{e.name, weight_decay, 1.0};
    bool grouped = false;
    for (size_t g = 0; g < pg.size() && !grouped; ++g) {
      for (const std::string& pattern : pg[g].params) {
        if (config::param_pattern_matches(pattern, e.name, rank)) {
          p.weight_decay = pg[g].weight_decay.value_or(weight_decay);
          p.lr_scale = pg[g].lr_scale;
          grouped = true;
          break;
        }
      }
    }
    if (!grouped) {
      for (const std::string& pattern : groups.no_decay) {
        if (config::param_pattern_matches(pattern, e.name, rank)) {
          p.weight_decay = 0.0;
          break;
        }
      }
    }
    out.push_back(std::move(p));
  }
  // A group pattern that matches no parameter at all (one whose parameters an earlier group
  // took matched them all the same, and is not reported).
  for (size_t g = 0; g < pg.size(); ++g) {
    for (size_t j = 0; j < pg[g].params.size(); ++j) {
      bool any = false;
      for (const nn::ParamEntry& e : layout.entries()) {
        any = any || config::param_pattern_matches(pg[g].params[j], e.name, e.shape.rank());
      }
      if (any) continue;
      std::string names;
      for (size_t i = 0; i < layout.entries().size() && i < 4; ++i) {
        names += (i > 0 ? ", \"" : "\"") + layout.entries()[i].name + "\"";
      }
      throw InvalidArgument("porter.optimizer.param_groups[" + std::to_string(g) + "].params[" +
                            std::to_string(j) + "]: \"" + pg[g].params[j] +
                            "\" matches no parameter of the model (" +
                            std::to_string(layout.entries().size()) + " parameters, named " +
                            "like " + names + "); fix the pattern or drop it");
    }
  }
  return out;
}

std::vector<ParamRun> resolve_param_groups(const nn::ParamLayout& layout, int64_t padded_elems,
                                           const config::PorterOptimizerConfig& groups,
                                           double weight_decay) {
  PORTER_CHECK(padded_elems >= layout.total_elems(), "resolve_param_groups: padded_elems ",
               padded_elems, " below the layout's ", layout.total_elems());
  const std::vector<ParamGroupOf> of = param_groups_of(layout, groups, weight_decay);
  std::vector<ParamRun> runs;
  for (size_t i = 0; i < of.size(); ++i) {
    const int64_t begin = i == 0 ? 0 : layout.entries()[i].offset_elems;
    if (!runs.empty() && runs.back().weight_decay == of[i].weight_decay &&
        runs.back().lr_scale == of[i].lr_scale) {
      continue;
    }
    runs.push_back({begin, of[i].weight_decay, of[i].lr_scale});
  }
  if (runs.empty()) runs.push_back({0, weight_decay, 1.0});
  return runs;
}

}  // namespace porter::zero
