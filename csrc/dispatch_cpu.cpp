// CPU kernels of dispatch and its backward (the maths in dispatch.h). Both write every output row
// exactly once, in parallel over rows (at::parallel_for, OpenMP): the forward walks the E * C slots
// and copies the owning token's row or zeroes the slot; the backward walks the S tokens and gathers
// their live routes. No output buffer is zero-filled first.
#include "dispatch.h"
#include "rows_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cstring>
#include <type_traits>
#include <vector>

namespace commweave {

at::Tensor dispatch_cpu(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& locations,
                        int64_t num_experts, int64_t capacity) {
  check_dispatch(x, indices, locations, num_experts, capacity);
  const auto x_c = x.contiguous();
  const auto idx = indices.contiguous();
  const auto loc = locations.contiguous();
  const int64_t k = idx.size(0), num_tokens = idx.size(1), d_model = x_c.size(1);
  auto out = at::empty({num_experts, capacity, d_model}, x_c.options());
  const auto owner = slot_owners(idx.const_data_ptr<int32_t>(), loc.const_data_ptr<int32_t>(), k,
                                 num_tokens, num_experts, capacity);
  // A permutation of rows: copy bytes, whatever the dtype.
  const int64_t row = d_model * x_c.element_size();
  const auto* src = static_cast<const char*>(x_c.const_data_ptr());
  auto* dst = static_cast<char*>(out.mutable_data_ptr());
  at::parallel_for(0, num_experts * capacity, grain_rows(row), [&](int64_t begin, int64_t end) {
    for (int64_t slot = begin; slot < end; ++slot) {
      if (slot + rows::kAhead < end && owner[slot + rows::kAhead] >= 0) {
        rows::prefetch(src + (owner[slot + rows::kAhead] % num_tokens) * row, row);
      }
      const int32_t r = owner[slot];
      if (r < 0) {
        std::memset(dst + slot * row, 0, row);
      } else {
        std::memcpy(dst + slot * row, src + (r % num_tokens) * row, row);
      }
    }
  });
  return out;
}

namespace {

template <typename T>
void gather_sum(const T* grad, const int32_t* idx, const int32_t* loc, T* out, int64_t k,
                int64_t num_tokens, int64_t d_model, int64_t num_experts, int64_t capacity) {
  using A = typename Acc<T>::type;
  at::parallel_for(0, num_tokens, grain_rows(d_model * sizeof(T)), [&](int64_t begin, int64_t end) {
    std::vector<const T*> routes(k);
    for (int64_t s = begin; s < end; ++s) {
      if (s + rows::kAhead < end) {
        rows::prefetch_routes(s + rows::kAhead, idx, loc, k, num_tokens, num_experts, capacity, grad,
                              d_model);
      }
      const int64_t live = rows::token_routes<T, A>(s, idx, loc, nullptr, k, num_tokens, num_experts,
                                                    capacity, grad, d_model, routes.data(), nullptr);
      T* dst = out + s * d_model;
      if (live == 1) {
        std::memcpy(dst, routes[0], d_model * sizeof(T));  // a single route is a copy, exactly
      } else {
        rows::sum_rows<false, T, A>(dst, routes.data(), nullptr, live, d_model);
      }
    }
  });
}

}  // namespace

at::Tensor dispatch_backward_cpu(const at::Tensor& grad, const at::Tensor& indices,
                                 const at::Tensor& locations, int64_t num_tokens) {
  check_dispatch_backward(grad, indices, locations, num_tokens);
  const auto grad_c = grad.contiguous();
  const auto idx = indices.contiguous();
  const auto loc = locations.contiguous();
  const int64_t num_experts = grad_c.size(0), capacity = grad_c.size(1), d_model = grad_c.size(2);
  auto out = at::empty({num_tokens, d_model}, grad_c.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_c.scalar_type(), "dispatch_backward", [&] {
    gather_sum<scalar_t>(grad_c.const_data_ptr<scalar_t>(), idx.const_data_ptr<int32_t>(),
                         loc.const_data_ptr<int32_t>(), out.mutable_data_ptr<scalar_t>(), idx.size(0),
                         num_tokens, d_model, num_experts, capacity);
  });
  return out;
}

}  // namespace commweave
