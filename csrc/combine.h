// combine: expert_output[E, C, M] -> y[S, M] = sum_j gates[j, s] * expert_output[route (j, s)],
// accumulated in fp32 (fp64 when expert_output or gates is fp64) and returned in expert_output's
// dtype. Its backward, fused so that every grad_y row is read once:
//   grad_expert[e, c] = gates[j, s] * grad_y[s] for the route that owns (e, c), 0 for empty slots
//   grad_gates[j, s]  = <grad_y[s], expert_output[e, c]>, 0 for dropped routes.
// The same results as deepspeed's _sparse_decode and its autograd.
#pragma once

#include "routes.h"

#include <ATen/ops/empty.h>

#include <tuple>
#include <vector>

namespace commweave {

inline void check_combine(const at::Tensor& expert_output, const at::Tensor& indices,
                          const at::Tensor& locations, const at::Tensor& gates) {
  check_data(expert_output, "expert_output [E, C, M]", 3);
  check_slots(expert_output.size(0), expert_output.size(1));
  check_bytes(expert_output, "expert_output [E, C, M]");
  TORCH_CHECK(gates.dim() == 2, "commweave: gates must be [k, S], got ", gates.sizes());
  check_routes(indices, locations, gates.size(1), expert_output);
  TORCH_CHECK(gates.sizes() == indices.sizes(), "commweave: gates must have the shape of indices ",
              indices.sizes(), ", got ", gates.sizes());
  TORCH_CHECK(gates.scalar_type() == at::kFloat || gates.scalar_type() == at::kDouble,
              "commweave: gates must be fp32 or fp64, got ", gates.scalar_type());
  TORCH_CHECK(gates.device() == expert_output.device(), "commweave: gates must be on ",
              expert_output.device());
  checked_bytes({indices.size(1), expert_output.size(2), expert_output.element_size()}, "the output [S, M]");
}

// The dtype combine accumulates in (and converts the gates to before the kernels run).
inline at::ScalarType combine_acc_type(const at::Tensor& expert_output, const at::Tensor& gates) {
  return expert_output.scalar_type() == at::kDouble || gates.scalar_type() == at::kDouble ? at::kDouble
                                                                                         : at::kFloat;
}

// The operands every device's combine and backward run on: contiguous, gates in the accumulation dtype.
struct CombineOperands {
  at::Tensor expert, idx, loc, gates_acc;
  at::ScalarType acc_type;
  int64_t num_experts, capacity, d_model, k, num_tokens;
};

inline CombineOperands combine_operands(const at::Tensor& expert_output, const at::Tensor& indices,
                                        const at::Tensor& locations, const at::Tensor& gates) {
  const auto acc_type = combine_acc_type(expert_output, gates);
  auto expert = expert_output.contiguous();
  auto idx = indices.contiguous();
  return {expert,         idx,            locations.contiguous(), gates.to(acc_type).contiguous(), acc_type,
          expert.size(0), expert.size(1), expert.size(2),         idx.size(0),                     idx.size(1)};
}

// The backward's outputs, uninitialised; a gradient nobody asked for is empty (the autograd wrapper
// turns it into None).
inline std::tuple<at::Tensor, at::Tensor> combine_grad_outputs(const CombineOperands& o, bool need_expert_grad,
                                                               bool need_gates_grad) {
  const auto expert_shape = need_expert_grad ? std::vector<int64_t>{o.num_experts, o.capacity, o.d_model}
                                             : std::vector<int64_t>{0};
  const auto gates_shape = need_gates_grad ? std::vector<int64_t>{o.k, o.num_tokens} : std::vector<int64_t>{0};
  return {at::empty(expert_shape, o.expert.options()), at::empty(gates_shape, o.gates_acc.options())};
}

inline void check_combine_backward(const at::Tensor& grad, const at::Tensor& expert_output,
                                   const at::Tensor& indices, const at::Tensor& locations,
                                   const at::Tensor& gates) {
  check_combine(expert_output, indices, locations, gates);
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == indices.size(1) && grad.size(1) == expert_output.size(2)
                  && grad.scalar_type() == expert_output.scalar_type() && grad.device() == gates.device(),
              "commweave: grad must be ", expert_output.scalar_type(), " [S, M] = [", indices.size(1), ", ",
              expert_output.size(2), "] on ", gates.device(), ", got ", grad.scalar_type(), " ", grad.sizes());
  check_bytes(grad, "grad [S, M]");
}

at::Tensor combine_cpu(const at::Tensor& expert_output, const at::Tensor& indices,
                       const at::Tensor& locations, const at::Tensor& gates);
std::tuple<at::Tensor, at::Tensor> combine_backward_cpu(const at::Tensor& grad,
                                                        const at::Tensor& expert_output,
                                                        const at::Tensor& indices,
                                                        const at::Tensor& locations,
                                                        const at::Tensor& gates, bool need_expert_grad,
                                                        bool need_gates_grad);

#ifdef COMMWEAVE_WITH_CUDA
at::Tensor combine_cuda(const at::Tensor& expert_output, const at::Tensor& indices,
                        const at::Tensor& locations, const at::Tensor& gates);
std::tuple<at::Tensor, at::Tensor> combine_backward_cuda(const at::Tensor& grad,
                                                         const at::Tensor& expert_output,
                                                         const at::Tensor& indices,
                                                         const at::Tensor& locations,
                                                         const at::Tensor& gates, bool need_expert_grad,
                                                         bool need_gates_grad);
#endif

}  // namespace commweave
