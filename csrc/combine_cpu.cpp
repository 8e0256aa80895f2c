// combine and its backward on the CPU (the maths in combine.h): input checks, outputs, and the kernels
// of kernels_cpu.h for the running CPU's ISA. The backward's kernel writes the rows of the slots that
// routes own; the slots no route owns are zeroed here, so every grad_expert row is written once.
#include "combine.h"
#include "kernels_cpu.h"
#include "memory_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

namespace commweave {

at::Tensor combine_cpu(const at::Tensor& expert_output, const at::Tensor& indices,
                       const at::Tensor& locations, const at::Tensor& gates) {
  check_combine(expert_output, indices, locations, gates);
  const auto o = combine_operands(expert_output, indices, locations, gates);
  auto out = at::empty({o.num_tokens, o.d_model}, o.expert.options());
  cpu::kernels().combine(o.expert.scalar_type(), o.acc_type, o.expert.const_data_ptr(),
                         o.idx.const_data_ptr<int32_t>(), o.loc.const_data_ptr<int32_t>(),
                         o.gates_acc.const_data_ptr(), out.mutable_data_ptr(), o.k, o.num_tokens, o.d_model,
                         o.num_experts, o.capacity);
  return out;
}

std::tuple<at::Tensor, at::Tensor> combine_backward_cpu(const at::Tensor& grad,
                                                        const at::Tensor& expert_output,
                                                        const at::Tensor& indices,
                                                        const at::Tensor& locations,
                                                        const at::Tensor& gates, bool need_expert_grad,
                                                        bool need_gates_grad) {
  check_combine_backward(grad, expert_output, indices, locations, gates);
  const auto grad_c = grad.contiguous();
  const auto o = combine_operands(expert_output, indices, locations, gates);
  auto [grad_expert, grad_gates] = combine_grad_outputs(o, need_expert_grad, need_gates_grad);
  // Owners first: the slots no route owns get a zero gradient (this also re-checks for collisions).
  const auto owners = need_expert_grad ? slot_owners(o.idx.const_data_ptr<int32_t>(),
                                                     o.loc.const_data_ptr<int32_t>(), o.k, o.num_tokens,
                                                     o.num_experts, o.capacity)
                                       : at::Tensor();
  cpu::kernels().combine_backward(o.expert.scalar_type(), o.acc_type, grad_c.const_data_ptr(),
                                  o.expert.const_data_ptr(), o.idx.const_data_ptr<int32_t>(),
                                  o.loc.const_data_ptr<int32_t>(), o.gates_acc.const_data_ptr(),
                                  need_expert_grad ? grad_expert.mutable_data_ptr() : nullptr,
                                  need_gates_grad ? grad_gates.mutable_data_ptr() : nullptr, o.k, o.num_tokens,
                                  o.d_model, o.num_experts, o.capacity);
  if (need_expert_grad) {
    const int64_t row = o.d_model * o.expert.element_size();
    auto* dst = static_cast<char*>(grad_expert.mutable_data_ptr());
    const int32_t* owner = owners.const_data_ptr<int32_t>();
    parallel_rows(o.num_experts * o.capacity, row, [&](int64_t begin, int64_t end) {
      for (int64_t slot = begin; slot < end; ++slot) {
        if (owner[slot] < 0) {
          stream_zero(dst + slot * row, row);
        }
      }
    });
  }
  return {grad_expert, need_gates_grad ? grad_gates.to(gates.scalar_type()) : grad_gates};
}

}  // namespace commweave
