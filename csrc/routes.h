// Routes in DeepSpeed's sparse format, shared by the dispatch and combine ops.
//
// Shape legend (ds_plugins/reference.py): S tokens, M model dim, E experts, C capacity, k routes.
//   indices[k, S]   int32  expert of route j of token s, -1 = dropped by the capacity
//   locations[k, S] int32  slot of the route in its expert's buffer, 0 <= loc < C when live
// Route r = j * S + s; the flat slot of a live route is e * C + c, a row of the [E * C, M] buffer.
//
// The Python wrappers (ds_plugins/dispatch.py) raise ValueError on bad input before calling in;
// the checks here keep the ops memory-safe when they are called directly through torch.ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <vector>

namespace commweave {

// The type combine and the backward sums accumulate in: fp32 for fp16/bf16/fp32, fp64 for fp64.
template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

// Size limits, the same as the Python wrappers' (commweave/values.py; issue 22). Expert indices and
// locations are int32, so E or C beyond INT32_MAX would address nothing, and with both bounded E * C stays
// below 2**62: it cannot wrap in int64 (2**32 * 2**32 wraps to 0, an empty slot table that the first live
// route then writes past). Every buffer is also bounded by kMaxAllocBytes before it is allocated: x86-64
// gives a process 2**47 bytes of addresses, so no larger allocation can succeed on any machine. These
// checks are TORCH_CHECK_VALUE: a ValueError in Python, as the wrappers raise.
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxAllocBytes = int64_t{1} << 47;

// The product of sizes (the last one usually an element size), checked against overflow and the bound.
inline int64_t checked_bytes(std::initializer_list<int64_t> sizes, const char* what) {
  int64_t total = 1;
  for (const int64_t size : sizes) {
    TORCH_CHECK_VALUE(size >= 0, "commweave: ", what, " has a negative size ", size);
    TORCH_CHECK_VALUE(!__builtin_mul_overflow(total, size, &total), "commweave: the size of ", what,
                      " overflows int64");
  }
  TORCH_CHECK_VALUE(total <= kMaxAllocBytes, "commweave: ", what, " would take ", total,
                    " bytes, more than 2**47 (what a process can address)");
  return total;
}

// E and C of a slot table [E * C] int32 (dispatch's owners, the route check's claimants).
inline void check_slots(int64_t num_experts, int64_t capacity) {
  TORCH_CHECK_VALUE(num_experts >= 1 && num_experts <= kInt32Max, "commweave: num_experts must be in [1, ",
                    kInt32Max, "] (expert indices are int32), got ", num_experts);
  TORCH_CHECK_VALUE(capacity >= 0 && capacity <= kInt32Max, "commweave: capacity must be in [0, ", kInt32Max,
                    "] (locations are int32), got ", capacity);
  checked_bytes({num_experts, capacity, int64_t{sizeof(int32_t)}}, "the slot table [E * C] int32");
}

// The contiguous copy of a data tensor that a kernel reads or writes.
inline void check_bytes(const at::Tensor& t, const char* what) {
  int64_t total = t.element_size();
  for (const int64_t size : t.sizes()) {
    TORCH_CHECK_VALUE(!__builtin_mul_overflow(total, size, &total), "commweave: the size of ", what,
                      " overflows int64");
  }
  TORCH_CHECK_VALUE(total <= kMaxAllocBytes, "commweave: ", what, " ", t.sizes(), " would take ", total,
                    " bytes, more than 2**47 (what a process can address)");
}

inline void check_routes(const at::Tensor& indices, const at::Tensor& locations, int64_t num_tokens,
                         const at::Tensor& data) {
  TORCH_CHECK(indices.dim() == 2 && indices.scalar_type() == at::kInt,
              "commweave: indices must be int32 [k, S], got ", indices.scalar_type(), " ",
              indices.sizes());
  TORCH_CHECK(locations.sizes() == indices.sizes() && locations.scalar_type() == at::kInt,
              "commweave: locations must be int32 with the shape of indices ", indices.sizes(),
              ", got ", locations.scalar_type(), " ", locations.sizes());
  TORCH_CHECK(indices.size(0) >= 1, "commweave: indices [k, S] needs k >= 1");
  TORCH_CHECK(indices.size(1) == num_tokens, "commweave: indices [k, S] has S = ", indices.size(1),
              " but the tokens number ", num_tokens);
  TORCH_CHECK_VALUE(indices.size(0) <= kInt32Max && num_tokens <= kInt32Max / indices.size(0),
                    "commweave: k * S must fit in int32 (routes are numbered j * S + s), got k = ",
                    indices.size(0), ", S = ", num_tokens);
  TORCH_CHECK(indices.device() == data.device() && locations.device() == data.device(),
              "commweave: indices and locations must be on ", data.device());
}

inline void check_data(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.dim() == dim, "commweave: ", name, " must be ", dim, "-D, got ", t.sizes());
  const auto type = t.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf || type == at::kDouble,
              "commweave: ", name, " must be fp16, bf16, fp32 or fp64, got ", type);
}

// Flat slot of a route, or -1 for a dropped one; throws on an index or location out of range.
inline int64_t route_slot(int32_t expert, int32_t location, int64_t num_experts, int64_t capacity) {
  if (expert < 0) {
    TORCH_CHECK(expert == -1, "commweave: expert index ", expert, " is neither -1 nor in [0, ",
                num_experts, ")");
    return -1;
  }
  TORCH_CHECK(expert < num_experts && location >= 0 && location < capacity, "commweave: route to expert ",
              expert, " location ", location, " is outside [0, ", num_experts, ") x [0, ", capacity, ")");
  return expert * capacity + location;
}

// slot -> the route r = j * S + s that claims it, -1 where no route does: [E * C] int32, allocated
// through torch (a size that cannot be had is its allocator's error naming the bytes, not
// std::bad_alloc). One serial pass over the k * S routes (tens of microseconds); throws when two live
// routes claim one slot.
inline at::Tensor slot_owners(const int32_t* indices, const int32_t* locations, int64_t k, int64_t num_tokens,
                              int64_t num_experts, int64_t capacity) {
  check_slots(num_experts, capacity);
  auto table = at::empty({num_experts * capacity}, at::TensorOptions().dtype(at::kInt));
  int32_t* owner = table.mutable_data_ptr<int32_t>();
  std::fill_n(owner, num_experts * capacity, -1);
  for (int64_t r = 0; r < k * num_tokens; ++r) {
    const int64_t slot = route_slot(indices[r], locations[r], num_experts, capacity);
    if (slot < 0) {
      continue;
    }
    TORCH_CHECK(owner[slot] < 0, "commweave: routes ", owner[slot], " and ", r, " both claim expert ",
                slot / capacity, " location ", slot % capacity);
    owner[slot] = static_cast<int32_t>(r);
  }
  return table;
}

// The first fault in a set of routes, for the Python wrappers' error messages: {} when there is none,
// {kBadIndex, r} (an expert index outside [-1, E)), {kBadLocation, r} (a live route's location outside
// [0, C)), {kCollision, r, earlier} (route r claims the slot of an earlier route); r = j * S + s, the
// first such route in that order, index faults before location faults before collisions.
enum RouteFault : int64_t { kBadIndex = 1, kBadLocation = 2, kCollision = 3 };
std::vector<int64_t> find_route_fault_cpu(const at::Tensor& indices, const at::Tensor& locations,
                                      int64_t num_experts, int64_t capacity);

}  // namespace commweave
