// Names of the cost model's enums.
#include "checkpoint/costs.h"

namespace porter::checkpoint {

std::string_view save_option_name(SaveOption o) {
  switch (o) {
    case SaveOption::kKeep: return "keep";
    case SaveOption::kSelective: return "selective";
    case SaveOption::kCheckpoint: return "checkpoint";
  }
  return "?";
}

}  // namespace porter::checkpoint
