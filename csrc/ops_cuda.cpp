// Torch glue of the CUDA kernels (built only when setup.py builds with CUDA, which defines
// COMMWEAVE_WITH_CUDA): input checks, output allocation on the current stream, and the CUDA
// registrations of the ops that bindings.cpp defines. The kernels are in dispatch_cuda.cu and
// combine_cuda.cu, behind the plain launchers of kernels_cuda.h.
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "combine.h"
#include "dispatch.h"
#include "kernels_cuda.h"

#include <limits>
#include <vector>

#define COMMWEAVE_CUDA_CALL(expr)                                                                   \
  do {                                                                                              \
    const cudaError_t err_ = (expr);                                                                \
    TORCH_CHECK(err_ == cudaSuccess, "commweave: ", #expr, " failed: ", cudaGetErrorString(err_)); \
  } while (0)

namespace commweave {
namespace {

cuda::Dtype dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf:
      return cuda::Dtype::kHalf;
    case at::kBFloat16:
      return cuda::Dtype::kBFloat16;
    case at::kFloat:
      return cuda::Dtype::kFloat;
    case at::kDouble:
      return cuda::Dtype::kDouble;
    default:
      TORCH_CHECK(false, "commweave: unsupported dtype ", t.scalar_type());
  }
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "commweave: ", name, " must be a CUDA tensor, got ", t.device());
}

// slot -> owning route, -1 where none: [E * C] int32 on the routes' device.
at::Tensor slot_owners_cuda(const at::Tensor& idx, const at::Tensor& loc, int64_t num_experts,
                            int64_t capacity, cudaStream_t stream) {
  check_slots(num_experts, capacity);
  auto owner = at::full({num_experts * capacity}, -1, idx.options());
  COMMWEAVE_CUDA_CALL(cuda::launch_slot_owners(idx.const_data_ptr<int32_t>(), loc.const_data_ptr<int32_t>(),
                                               idx.numel(), num_experts, capacity,
                                               owner.mutable_data_ptr<int32_t>(), stream));
  return owner;
}

}  // namespace

std::vector<int64_t> find_route_fault_cuda(const at::Tensor& indices, const at::Tensor& locations,
                                           int64_t num_experts, int64_t capacity) {
  check_routes(indices, locations, indices.size(1), indices);
  check_slots(num_experts, capacity);
  check_cuda(indices, "indices");
  const c10::cuda::CUDAGuard guard(indices.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto idx = indices.contiguous();
  const auto loc = locations.contiguous();
  auto claimant = at::full({num_experts * capacity}, std::numeric_limits<int32_t>::max(), idx.options());
  auto faults = at::full({3}, -1, idx.options().dtype(at::kLong));  // all ones: no fault
  COMMWEAVE_CUDA_CALL(cuda::launch_find_route_faults(
      idx.const_data_ptr<int32_t>(), loc.const_data_ptr<int32_t>(), idx.numel(), num_experts, capacity,
      claimant.mutable_data_ptr<int32_t>(),
      reinterpret_cast<unsigned long long*>(faults.mutable_data_ptr<int64_t>()), stream));
  const auto found = faults.cpu();  // the one synchronisation
  const int64_t* f = found.const_data_ptr<int64_t>();
  if (f[0] >= 0) {
    return {kBadIndex, f[0]};
  }
  if (f[1] >= 0) {
    return {kBadLocation, f[1]};
  }
  if (f[2] >= 0) {
    const int64_t slot = idx.view(-1)[f[2]].item<int64_t>() * capacity + loc.view(-1)[f[2]].item<int64_t>();
    return {kCollision, f[2], claimant[slot].item<int64_t>()};
  }
  return {};
}

at::Tensor dispatch_cuda(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& locations,
                         int64_t num_experts, int64_t capacity) {
  check_dispatch(x, indices, locations, num_experts, capacity);
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto x_c = x.contiguous();
  const auto idx = indices.contiguous();
  const auto loc = locations.contiguous();
  const int64_t num_tokens = x_c.size(0), d_model = x_c.size(1);
  auto out = at::empty({num_experts, capacity, d_model}, x_c.options());
  const auto owner = slot_owners_cuda(idx, loc, num_experts, capacity, stream);
  COMMWEAVE_CUDA_CALL(cuda::launch_dispatch(x_c.const_data_ptr(), owner.const_data_ptr<int32_t>(),
                                            out.mutable_data_ptr(), num_tokens, num_experts * capacity,
                                            d_model * x_c.element_size(), stream));
  return out;
}

at::Tensor dispatch_backward_cuda(const at::Tensor& grad, const at::Tensor& indices,
                                  const at::Tensor& locations, int64_t num_tokens) {
  check_dispatch_backward(grad, indices, locations, num_tokens);
  check_cuda(grad, "grad");
  const c10::cuda::CUDAGuard guard(grad.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto grad_c = grad.contiguous();
  const auto idx = indices.contiguous();
  const auto loc = locations.contiguous();
  const int64_t d_model = grad_c.size(2);
  auto out = at::empty({num_tokens, d_model}, grad_c.options());
  COMMWEAVE_CUDA_CALL(cuda::launch_dispatch_backward(
      dtype_of(grad_c), grad_c.const_data_ptr(), idx.const_data_ptr<int32_t>(), loc.const_data_ptr<int32_t>(),
      out.mutable_data_ptr(), idx.size(0), num_tokens, d_model, grad_c.size(0), grad_c.size(1), stream));
  return out;
}

at::Tensor combine_cuda(const at::Tensor& expert_output, const at::Tensor& indices,
                        const at::Tensor& locations, const at::Tensor& gates) {
  check_combine(expert_output, indices, locations, gates);
  check_cuda(expert_output, "expert_output");
  const c10::cuda::CUDAGuard guard(expert_output.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto o = combine_operands(expert_output, indices, locations, gates);
  auto out = at::empty({o.num_tokens, o.d_model}, o.expert.options());
  COMMWEAVE_CUDA_CALL(cuda::launch_combine(
      dtype_of(o.expert), o.acc_type == at::kDouble, o.expert.const_data_ptr(), o.idx.const_data_ptr<int32_t>(),
      o.loc.const_data_ptr<int32_t>(), o.gates_acc.const_data_ptr(), out.mutable_data_ptr(), o.k, o.num_tokens,
      o.d_model, o.num_experts, o.capacity, stream));
  return out;
}

std::tuple<at::Tensor, at::Tensor> combine_backward_cuda(const at::Tensor& grad,
                                                         const at::Tensor& expert_output,
                                                         const at::Tensor& indices,
                                                         const at::Tensor& locations,
                                                         const at::Tensor& gates, bool need_expert_grad,
                                                         bool need_gates_grad) {
  check_combine_backward(grad, expert_output, indices, locations, gates);
  check_cuda(expert_output, "expert_output");
  const c10::cuda::CUDAGuard guard(expert_output.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto grad_c = grad.contiguous();
  const auto o = combine_operands(expert_output, indices, locations, gates);
  auto [grad_expert, grad_gates] = combine_grad_outputs(o, need_expert_grad, need_gates_grad);
  COMMWEAVE_CUDA_CALL(cuda::launch_combine_backward(
      dtype_of(o.expert), o.acc_type == at::kDouble, grad_c.const_data_ptr(), o.expert.const_data_ptr(),
      o.idx.const_data_ptr<int32_t>(), o.loc.const_data_ptr<int32_t>(), o.gates_acc.const_data_ptr(),
      need_expert_grad ? grad_expert.mutable_data_ptr() : nullptr,
      need_gates_grad ? grad_gates.mutable_data_ptr() : nullptr, o.k, o.num_tokens, o.d_model, o.num_experts,
      o.capacity, stream));
  if (need_expert_grad) {
    const auto owner = slot_owners_cuda(o.idx, o.loc, o.num_experts, o.capacity, stream);
    COMMWEAVE_CUDA_CALL(cuda::launch_zero_unowned(owner.const_data_ptr<int32_t>(), grad_expert.mutable_data_ptr(),
                                                  o.num_experts * o.capacity,
                                                  o.d_model * o.expert.element_size(), stream));
  }
  return {grad_expert, need_gates_grad ? grad_gates.to(gates.scalar_type()) : grad_gates};
}

}  // namespace commweave

TORCH_LIBRARY_IMPL(commweave, CUDA, m) {
  m.impl("find_route_fault", &commweave::find_route_fault_cuda);
  m.impl("dispatch", &commweave::dispatch_cuda);
  m.impl("dispatch_backward", &commweave::dispatch_backward_cuda);
  m.impl("combine", &commweave::combine_cuda);
  m.impl("combine_backward", &commweave::combine_backward_cuda);
}
