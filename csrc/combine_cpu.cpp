// combine and its backward on the CPU (the maths in combine.h): input checks, outputs, and the kernels
// of kernels_cpu.h for the running CPU's ISA. The backward's kernel writes the rows of the slots that
// routes own; the slots no route owns are zeroed here, so every grad_expert row is written once.
#include "combine.h"
#include "kernels_cpu.h"
#include "memory_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <vector>

namespace commweave {

at::Tensor combine_cpu(const at::Tensor& expert_output, const at::Tensor& indices,
                       const at::Tensor& locations, const at::Tensor& gates) {
  check_combine(expert_output, indices, locations, gates);
  const auto expert = expert_output.contiguous();
  const auto idx = indices.contiguous();
  const auto loc = locations.contiguous();
  const auto acc_type = combine_acc_type(expert_output, gates);
  const auto gates_acc = gates.to(acc_type).contiguous();
  const int64_t num_experts = expert.size(0), capacity = expert.size(1), d_model = expert.size(2);
  const int64_t k = idx.size(0), num_tokens = idx.size(1);
  auto out = at::empty({num_tokens, d_model}, expert.options());
  cpu::kernels().combine(expert.scalar_type(), acc_type, expert.const_data_ptr(), idx.const_data_ptr<int32_t>(),
                         loc.const_data_ptr<int32_t>(), gates_acc.const_data_ptr(), out.mutable_data_ptr(), k,
                         num_tokens, d_model, num_experts, capacity);
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
  const auto expert = expert_output.contiguous();
  const auto idx = indices.contiguous();
  const auto loc = locations.contiguous();
  const auto acc_type = combine_acc_type(expert_output, gates);
  const auto gates_acc = gates.to(acc_type).contiguous();
  const int64_t num_experts = expert.size(0), capacity = expert.size(1), d_model = expert.size(2);
  const int64_t k = idx.size(0), num_tokens = idx.size(1);
  // A gradient nobody asked for is returned empty (the autograd wrapper turns it into None).
  const auto expert_shape = need_expert_grad ? std::vector<int64_t>{num_experts, capacity, d_model}
                                             : std::vector<int64_t>{0};
  const auto gates_shape = need_gates_grad ? std::vector<int64_t>{k, num_tokens} : std::vector<int64_t>{0};
  auto grad_expert = at::empty(expert_shape, expert.options());
  auto grad_gates = at::empty(gates_shape, gates_acc.options());
  // Owners first: the slots no route owns get a zero gradient (this also re-checks for collisions).
  const auto owner = need_expert_grad ? slot_owners(idx.const_data_ptr<int32_t>(),
                                                    loc.const_data_ptr<int32_t>(), k, num_tokens,
                                                    num_experts, capacity)
                                      : std::vector<int32_t>{};
  cpu::kernels().combine_backward(expert.scalar_type(), acc_type, grad_c.const_data_ptr(), expert.const_data_ptr(),
                                  idx.const_data_ptr<int32_t>(), loc.const_data_ptr<int32_t>(),
                                  gates_acc.const_data_ptr(),
                                  need_expert_grad ? grad_expert.mutable_data_ptr() : nullptr,
                                  need_gates_grad ? grad_gates.mutable_data_ptr() : nullptr, k, num_tokens,
                                  d_model, num_experts, capacity);
  if (need_expert_grad) {
    const int64_t row = d_model * expert.element_size();
    auto* dst = static_cast<char*>(grad_expert.mutable_data_ptr());
    parallel_rows(num_experts * capacity, row, [&](int64_t begin, int64_t end) {
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
