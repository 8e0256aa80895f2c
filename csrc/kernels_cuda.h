// Launchers of the CUDA kernels (dispatch_cuda.cu, combine_cuda.cu). Plain C++ over raw pointers, sizes
// and a stream: the .cu files include only CUDA's own headers, so CI compiles them with nvcc alone
// (traps.md: torch's CUDA headers do not compile without a CUDA build of torch). The torch glue is
// ops_cuda.cpp. Shapes follow ds_plugins/reference.py; every launcher returns the launch's error.
//
// Routes are indices/locations [k, S] int32. Live routes are assumed in range and collision-free (the
// Python wrapper checks that on the host); a route outside [0, E) x [0, C) is skipped, never followed.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace commweave::cuda {

enum class Dtype { kHalf, kBFloat16, kFloat, kDouble };

// The route faults find_route_fault_cpu reports (routes.h), found in parallel: faults[0] = the first
// route whose index is outside [-1, E), faults[1] = the first live route whose location is outside
// [0, C), faults[2] = the first route whose slot an earlier route claims, and claimant[slot] = the first
// route claiming each slot. The caller fills faults with all ones (none) and claimant with INT32_MAX.
cudaError_t launch_find_route_faults(const int32_t* indices, const int32_t* locations, int64_t routes,
                                     int64_t num_experts, int64_t capacity, int32_t* claimant,
                                     unsigned long long* faults, cudaStream_t stream);

// owner[e * C + c] = the route r = j * S + s that claims slot (e, c); the caller fills owner with -1.
cudaError_t launch_slot_owners(const int32_t* indices, const int32_t* locations, int64_t routes,
                               int64_t num_experts, int64_t capacity, int32_t* owner, cudaStream_t stream);

// dispatch forward: out row `slot` = x row (owner % S), or zeros where owner < 0. A copy of bytes.
cudaError_t launch_dispatch(const void* x, const int32_t* owner, void* out, int64_t num_tokens, int64_t slots,
                            int64_t row_bytes, cudaStream_t stream);

// The rows of `out` [slots, row_bytes] that no route owns are set to zero; the others are left alone.
cudaError_t launch_zero_unowned(const int32_t* owner, void* out, int64_t slots, int64_t row_bytes,
                                cudaStream_t stream);

// dispatch backward: grad_x[s] = sum over the live routes j of grad[route (j, s)], in fp32 (fp64).
cudaError_t launch_dispatch_backward(Dtype dtype, const void* grad, const int32_t* indices,
                                     const int32_t* locations, void* grad_x, int64_t k, int64_t num_tokens,
                                     int64_t d_model, int64_t num_experts, int64_t capacity,
                                     cudaStream_t stream);

// combine forward: y[s] = sum_j gates[j, s] * expert[route (j, s)]; gates are in the accumulate type,
// fp64 when acc_double, else fp32.
cudaError_t launch_combine(Dtype dtype, bool acc_double, const void* expert, const int32_t* indices,
                           const int32_t* locations, const void* gates, void* y, int64_t k,
                           int64_t num_tokens, int64_t d_model, int64_t num_experts, int64_t capacity,
                           cudaStream_t stream);

// combine backward, one block per token reading grad_y[s] once: grad_expert[route] = gate * grad_y[s]
// (when grad_expert is not null; unowned slots are left to launch_zero_unowned) and
// grad_gates[j, s] = <grad_y[s], expert[route]>, 0 for dropped routes (when grad_gates is not null).
cudaError_t launch_combine_backward(Dtype dtype, bool acc_double, const void* grad_y, const void* expert,
                                    const int32_t* indices, const int32_t* locations, const void* gates,
                                    void* grad_expert, void* grad_gates, int64_t k, int64_t num_tokens,
                                    int64_t d_model, int64_t num_experts, int64_t capacity,
                                    cudaStream_t stream);

}  // namespace commweave::cuda
