// find_route_fault: the value checks of the Python wrappers (ds_plugins/dispatch.py), in one serial pass
// over the k * S routes instead of a dozen tensor ops: tens of microseconds at S = 16384.
#include "routes.h"

#include <ATen/ops/full.h>

#include <vector>

namespace commweave {

std::vector<int64_t> find_route_fault_cpu(const at::Tensor& indices, const at::Tensor& locations,
                                      int64_t num_experts, int64_t capacity) {
  TORCH_CHECK(indices.device().is_cpu(), "commweave: find_route_fault runs on CPU routes");
  check_routes(indices, locations, indices.size(1), indices);
  check_slots(num_experts, capacity);
  const auto idx = indices.contiguous();
  const auto loc = locations.contiguous();
  const int32_t* e = idx.const_data_ptr<int32_t>();
  const int32_t* c = loc.const_data_ptr<int32_t>();
  const int64_t routes = idx.numel();
  int64_t bad_index = -1, bad_location = -1;
  for (int64_t r = 0; r < routes && bad_index < 0; ++r) {
    if (e[r] < -1 || e[r] >= num_experts) {
      bad_index = r;
    } else if (e[r] >= 0 && bad_location < 0 && (c[r] < 0 || c[r] >= capacity)) {
      bad_location = r;
    }
  }
  if (bad_index >= 0) {
    return {kBadIndex, bad_index};
  }
  if (bad_location >= 0) {
    return {kBadLocation, bad_location};
  }
  auto table = at::full({num_experts * capacity}, -1, idx.options());  // sizes checked above
  int32_t* owner = table.mutable_data_ptr<int32_t>();
  for (int64_t r = 0; r < routes; ++r) {
    if (e[r] >= 0) {
      int32_t& slot_owner = owner[static_cast<int64_t>(e[r]) * capacity + c[r]];
      if (slot_owner >= 0) {
        return {kCollision, r, slot_owner};
      }
      slot_owner = static_cast<int32_t>(r);
    }
  }
  return {};
}

}  // namespace commweave
