// dispatch and its backward on the CPU (the maths in dispatch.h). Both write every output row exactly
// once, in parallel (parallel_rows, memory_cpu.h); no output buffer is zero-filled first. The forward is a
// row permutation, done here: it walks the E * C slots and copies the owning token's row or zeroes the
// slot. The backward gathers each token's routes and sums them: kernels_cpu.h, per ISA.
#include "dispatch.h"
#include "kernels_cpu.h"
#include "memory_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

namespace commweave {

at::Tensor dispatch_cpu(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& locations,
                        int64_t num_experts, int64_t capacity) {
  check_dispatch(x, indices, locations, num_experts, capacity);
  const auto x_c = x.contiguous();
  const auto idx = indices.contiguous();
  const auto loc = locations.contiguous();
  const int64_t k = idx.size(0), num_tokens = idx.size(1), d_model = x_c.size(1);
  auto out = at::empty({num_experts, capacity, d_model}, x_c.options());
  const auto owners = slot_owners(idx.const_data_ptr<int32_t>(), loc.const_data_ptr<int32_t>(), k,
                                  num_tokens, num_experts, capacity);
  const int32_t* owner = owners.const_data_ptr<int32_t>();
  // A permutation of rows: copy bytes, whatever the dtype.
  const int64_t row = d_model * x_c.element_size();
  const auto* src = static_cast<const char*>(x_c.const_data_ptr());
  auto* dst = static_cast<char*>(out.mutable_data_ptr());
  parallel_rows(num_experts * capacity, row, [&](int64_t begin, int64_t end) {
    for (int64_t slot = begin; slot < end; ++slot) {
      if (slot + kAhead < end && owner[slot + kAhead] >= 0) {
        prefetch_row(src + (owner[slot + kAhead] % num_tokens) * row, row);
      }
      const int32_t r = owner[slot];
      if (r < 0) {
        stream_zero(dst + slot * row, row);
      } else {
        stream_copy(dst + slot * row, src + (r % num_tokens) * row, row);
      }
    }
  });
  return out;
}

at::Tensor dispatch_backward_cpu(const at::Tensor& grad, const at::Tensor& indices,
                                 const at::Tensor& locations, int64_t num_tokens) {
  check_dispatch_backward(grad, indices, locations, num_tokens);
  const auto grad_c = grad.contiguous();
  const auto idx = indices.contiguous();
  const auto loc = locations.contiguous();
  const int64_t num_experts = grad_c.size(0), capacity = grad_c.size(1), d_model = grad_c.size(2);
  auto out = at::empty({num_tokens, d_model}, grad_c.options());
  cpu::kernels().dispatch_backward(grad_c.scalar_type(), grad_c.const_data_ptr(), idx.const_data_ptr<int32_t>(),
                                   loc.const_data_ptr<int32_t>(), out.mutable_data_ptr(), idx.size(0),
                                   num_tokens, d_model, num_experts, capacity);
  return out;
}

}  // namespace commweave
