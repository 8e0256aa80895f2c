// find_route_fault on the GPU: the checks of find_route_fault_cpu (routes.h) as two passes of one
// thread per route with atomicMin, so that the Python wrapper pays one small copy to the host per call
// instead of a dozen tensor ops and a sync.
#include "cuda_common.cuh"

namespace commweave::cuda {
namespace {

// Range faults, and the first claimant of every slot.
__global__ void claim_kernel(const int32_t* indices, const int32_t* locations, int64_t routes,
                             int64_t num_experts, int64_t capacity, int32_t* claimant,
                             unsigned long long* faults) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= routes) {
    return;
  }
  const int32_t e = indices[r];
  const int32_t c = locations[r];
  if (e < -1 || e >= num_experts) {
    atomicMin(&faults[0], static_cast<unsigned long long>(r));
  } else if (e >= 0) {
    if (c < 0 || c >= capacity) {
      atomicMin(&faults[1], static_cast<unsigned long long>(r));
    } else {
      atomicMin(&claimant[static_cast<int64_t>(e) * capacity + c], static_cast<int32_t>(r));
    }
  }
}

// A live route that is not its slot's first claimant collides with an earlier one.
__global__ void collision_kernel(const int32_t* indices, const int32_t* locations, int64_t routes,
                                 int64_t num_experts, int64_t capacity, const int32_t* claimant,
                                 unsigned long long* faults) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= routes) {
    return;
  }
  const int64_t slot = route_slot(indices, locations, r, num_experts, capacity);
  if (slot >= 0 && claimant[slot] != r) {
    atomicMin(&faults[2], static_cast<unsigned long long>(r));
  }
}

}  // namespace

cudaError_t launch_find_route_faults(const int32_t* indices, const int32_t* locations, int64_t routes,
                                     int64_t num_experts, int64_t capacity, int32_t* claimant,
                                     unsigned long long* faults, cudaStream_t stream) {
  if (!routes_fit(routes, num_experts, capacity)) {
    return cudaErrorInvalidValue;
  }
  if (routes == 0) {
    return cudaSuccess;
  }
  constexpr int kThreads = 256;
  const int64_t blocks = (routes + kThreads - 1) / kThreads;
  claim_kernel<<<blocks, kThreads, 0, stream>>>(indices, locations, routes, num_experts, capacity, claimant,
                                                faults);
  collision_kernel<<<blocks, kThreads, 0, stream>>>(indices, locations, routes, num_experts, capacity,
                                                    claimant, faults);
  return cudaGetLastError();
}

}  // namespace commweave::cuda
