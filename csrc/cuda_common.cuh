// Device helpers shared by the CUDA kernels: element conversions, rounding-exact arithmetic, 16-byte
// packs, the route lookup and a block reduction. CUDA headers only (see kernels_cuda.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels_cuda.h"

namespace commweave::cuda {

// The accumulate type: fp32 for fp16/bf16/fp32 data, fp64 for fp64.
template <typename T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

template <typename A>
__device__ __forceinline__ A widen(float v) { return static_cast<A>(v); }
template <typename A>
__device__ __forceinline__ A widen(double v) { return static_cast<A>(v); }
template <typename A>
__device__ __forceinline__ A widen(__half v) { return static_cast<A>(__half2float(v)); }
template <typename A>
__device__ __forceinline__ A widen(__nv_bfloat16 v) { return static_cast<A>(__bfloat162float(v)); }

// Round to the storage type, to nearest even (from fp64 through fp32, as torch's CPU casts do).
template <typename T>
__device__ __forceinline__ T narrow(float v);
template <>
__device__ __forceinline__ float narrow<float>(float v) { return v; }
template <>
__device__ __forceinline__ double narrow<double>(float v) { return v; }
template <>
__device__ __forceinline__ __half narrow<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <typename T>
__device__ __forceinline__ T narrow(double v) {
  if constexpr (sizeof(T) == sizeof(double)) {
    return v;
  } else {
    return narrow<T>(static_cast<float>(v));
  }
}

// Products rounded before they are summed: nvcc would otherwise contract a * b + c into one fma, and
// the results would no longer match torch's mul-then-sum bit for bit.
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }

// V elements moved by one load or store: 16 bytes when the row allows it.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// Flat slot of route r, or -1 for a dropped (or, defensively, out-of-range) route.
__device__ __forceinline__ int64_t route_slot(const int32_t* indices, const int32_t* locations, int64_t r,
                                              int64_t num_experts, int64_t capacity) {
  const int32_t e = indices[r];
  const int32_t c = locations[r];
  if (e < 0 || e >= num_experts || c < 0 || c >= capacity) {
    return -1;
  }
  return static_cast<int64_t>(e) * capacity + c;
}

// Sum of v over the block (blockDim.x a multiple of 32), valid in thread 0. `shared` holds 32 values.
template <typename A>
__device__ A block_sum(A v, A* shared) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  __syncthreads();  // the previous call's readers are done with `shared`
  if (lane == 0) {
    shared[warp] = v;
  }
  __syncthreads();
  v = (warp == 0 && lane < static_cast<int>(blockDim.x >> 5)) ? shared[lane] : A(0);
  if (warp == 0) {
    for (int offset = 16; offset > 0; offset >>= 1) {
      v += __shfl_down_sync(0xffffffffu, v, offset);
    }
  }
  return v;
}

// Threads per block for rows of `packs` packs: whole warps, one pack per thread up to 256 threads.
inline int block_threads(int64_t packs) {
  const int64_t warps = (packs + 31) / 32;
  return static_cast<int>(32 * (warps < 1 ? 1 : (warps > 8 ? 8 : warps)));
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The sizes the kernels index with (the torch glue checks the same with clear messages, routes.h; these
// keep a direct caller of a launcher from undefined behaviour). Routes are numbered r = j * S + s in
// int32; E and C are int32 ranges, so the slot e * C + c (int64) cannot wrap; a grid has at most
// 2**31 - 1 blocks in x, which one block per token never exceeds once the routes fit int32.
constexpr int64_t kIndexMax = 2147483647;

inline bool routes_fit(int64_t routes, int64_t num_experts, int64_t capacity) {
  return routes >= 0 && routes <= kIndexMax && num_experts >= 0 && num_experts <= kIndexMax && capacity >= 0 &&
         capacity <= kIndexMax;
}

inline bool tokens_fit(int64_t k, int64_t num_tokens, int64_t num_experts, int64_t capacity) {
  return k >= 1 && num_tokens >= 0 && num_tokens <= kIndexMax / k && routes_fit(k * num_tokens, num_experts, capacity);
}

// Blocks for a grid-stride loop over `rows` rows: one block per row up to the grid's limit.
inline unsigned int grid_blocks(int64_t rows) { return static_cast<unsigned int>(rows < kIndexMax ? rows : kIndexMax); }

}  // namespace commweave::cuda
