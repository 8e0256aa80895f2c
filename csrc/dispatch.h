// dispatch: x[S, M] -> [E, C, M], each live route copies its token into its slot, empty slots are 0;
// its backward gathers the k routed gradient rows of every token and sums them (in fp32 for
// fp16/bf16, fp64 for fp64). The same results as deepspeed's _sparse_encode and its autograd.
#pragma once

#include "routes.h"

namespace commweave {

inline void check_dispatch(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& locations,
                           int64_t num_experts, int64_t capacity) {
  check_data(x, "x [S, M]", 2);
  check_routes(indices, locations, x.size(0), x);
  check_slots(num_experts, capacity);
  check_bytes(x, "x [S, M]");
  checked_bytes({num_experts, capacity, x.size(1), x.element_size()}, "the output [E, C, M]");
}

inline void check_dispatch_backward(const at::Tensor& grad, const at::Tensor& indices,
                                    const at::Tensor& locations, int64_t num_tokens) {
  check_data(grad, "grad [E, C, M]", 3);
  check_routes(indices, locations, num_tokens, grad);
  check_slots(grad.size(0), grad.size(1));
  check_bytes(grad, "grad [E, C, M]");
  checked_bytes({num_tokens, grad.size(2), grad.element_size()}, "the output [S, M]");
}

at::Tensor dispatch_cpu(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& locations,
                        int64_t num_experts, int64_t capacity);
at::Tensor dispatch_backward_cpu(const at::Tensor& grad, const at::Tensor& indices,
                                 const at::Tensor& locations, int64_t num_tokens);

#ifdef COMMWEAVE_WITH_CUDA
at::Tensor dispatch_cuda(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& locations,
                         int64_t num_experts, int64_t capacity);
at::Tensor dispatch_backward_cuda(const at::Tensor& grad, const at::Tensor& indices,
                                  const at::Tensor& locations, int64_t num_tokens);
#endif

}  // namespace commweave
