// CUDA kernels of dispatch and its backward (maths in dispatch.h), plus the slot-owner map and the
// zeroing of unowned rows that combine's backward shares. One thread block per row, 16-byte loads and
// stores where the row allows them, no atomics: every output row has exactly one writer.
#include "cuda_common.cuh"

namespace commweave::cuda {
namespace {

__global__ void slot_owners_kernel(const int32_t* indices, const int32_t* locations, int64_t routes,
                                   int64_t num_experts, int64_t capacity, int32_t* owner) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r < routes) {
    const int64_t slot = route_slot(indices, locations, r, num_experts, capacity);
    if (slot >= 0) {
      owner[slot] = static_cast<int32_t>(r);
    }
  }
}

// One block per slot (grid-stride: E * C may exceed the grid): copy the owner's row, or zero it (when
// `rows` is null, zero unowned rows only).
template <typename U>
__global__ void slot_rows_kernel(const U* rows, const int32_t* owner, U* out, int64_t num_tokens,
                                 int64_t slots, int64_t units) {
  for (int64_t slot = blockIdx.x; slot < slots; slot += gridDim.x) {
    const int32_t r = owner[slot];
    U* dst = out + slot * units;
    if (r >= 0) {
      if (rows == nullptr) {
        continue;
      }
      const U* src = rows + (r % num_tokens) * units;
      for (int64_t i = threadIdx.x; i < units; i += blockDim.x) {
        dst[i] = src[i];
      }
    } else {
      const U zero{};
      for (int64_t i = threadIdx.x; i < units; i += blockDim.x) {
        dst[i] = zero;
      }
    }
  }
}

// One block per token: the sum of its live routes' rows, in the accumulate type, rounded once.
template <typename T, int V>
__global__ void sum_routes_kernel(const T* grad, const int32_t* indices, const int32_t* locations, T* out,
                                  int64_t k, int64_t num_tokens, int64_t d_model, int64_t num_experts,
                                  int64_t capacity) {
  using A = typename AccOf<T>::type;
  using P = Pack<T, V>;
  const int64_t s = blockIdx.x;
  const int64_t packs = d_model / V;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    A acc[V];
    bool any = false;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t slot = route_slot(indices, locations, j * num_tokens + s, num_experts, capacity);
      if (slot < 0) {
        continue;
      }
      const P in = reinterpret_cast<const P*>(grad + slot * d_model)[p];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        acc[i] = any ? add(acc[i], widen<A>(in.v[i])) : widen<A>(in.v[i]);
      }
      any = true;
    }
    P result;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      result.v[i] = any ? narrow<T>(acc[i]) : narrow<T>(A(0));
    }
    reinterpret_cast<P*>(out + s * d_model)[p] = result;
  }
}

// The widest unit (16, 8, 4, 2 or 1 bytes) that divides a row and the base pointers.
template <typename F>
cudaError_t with_unit(int64_t row_bytes, const void* a, const void* b, F&& launch) {
  const auto fits = [&](int64_t unit) {
    return row_bytes % unit == 0 && reinterpret_cast<uintptr_t>(a) % unit == 0 &&
           reinterpret_cast<uintptr_t>(b) % unit == 0;
  };
  if (fits(16)) return launch(uint4{});
  if (fits(8)) return launch(uint2{});
  if (fits(4)) return launch(uint32_t{});
  if (fits(2)) return launch(uint16_t{});
  return launch(uint8_t{});
}

template <typename T>
cudaError_t dispatch_backward_typed(const void* grad, const int32_t* indices, const int32_t* locations,
                                    void* grad_x, int64_t k, int64_t num_tokens, int64_t d_model,
                                    int64_t num_experts, int64_t capacity, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = d_model % kVec == 0 && aligned16(grad) && aligned16(grad_x);
  const int64_t packs = vec ? d_model / kVec : d_model;
  const auto* g = static_cast<const T*>(grad);
  auto* out = static_cast<T*>(grad_x);
  if (vec) {
    sum_routes_kernel<T, kVec><<<num_tokens, block_threads(packs), 0, stream>>>(
        g, indices, locations, out, k, num_tokens, d_model, num_experts, capacity);
  } else {
    sum_routes_kernel<T, 1><<<num_tokens, block_threads(packs), 0, stream>>>(
        g, indices, locations, out, k, num_tokens, d_model, num_experts, capacity);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_slot_owners(const int32_t* indices, const int32_t* locations, int64_t routes,
                               int64_t num_experts, int64_t capacity, int32_t* owner, cudaStream_t stream) {
  if (!routes_fit(routes, num_experts, capacity)) {
    return cudaErrorInvalidValue;
  }
  if (routes == 0) {
    return cudaSuccess;
  }
  constexpr int kThreads = 256;
  slot_owners_kernel<<<(routes + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      indices, locations, routes, num_experts, capacity, owner);
  return cudaGetLastError();
}

cudaError_t launch_dispatch(const void* x, const int32_t* owner, void* out, int64_t num_tokens, int64_t slots,
                            int64_t row_bytes, cudaStream_t stream) {
  if (slots < 0 || row_bytes < 0 || num_tokens < 0 || num_tokens > kIndexMax) {
    return cudaErrorInvalidValue;
  }
  if (slots == 0 || row_bytes == 0) {
    return cudaSuccess;
  }
  return with_unit(row_bytes, x, out, [&](auto unit) {
    using U = decltype(unit);
    const int64_t units = row_bytes / static_cast<int64_t>(sizeof(U));
    slot_rows_kernel<U><<<grid_blocks(slots), block_threads(units), 0, stream>>>(
        static_cast<const U*>(x), owner, static_cast<U*>(out), num_tokens, slots, units);
    return cudaGetLastError();
  });
}

cudaError_t launch_zero_unowned(const int32_t* owner, void* out, int64_t slots, int64_t row_bytes,
                                cudaStream_t stream) {
  if (slots < 0 || row_bytes < 0) {
    return cudaErrorInvalidValue;
  }
  if (slots == 0 || row_bytes == 0) {
    return cudaSuccess;
  }
  return with_unit(row_bytes, out, out, [&](auto unit) {
    using U = decltype(unit);
    const int64_t units = row_bytes / static_cast<int64_t>(sizeof(U));
    slot_rows_kernel<U><<<grid_blocks(slots), block_threads(units), 0, stream>>>(
        nullptr, owner, static_cast<U*>(out), 1, slots, units);
    return cudaGetLastError();
  });
}

cudaError_t launch_dispatch_backward(Dtype dtype, const void* grad, const int32_t* indices,
                                     const int32_t* locations, void* grad_x, int64_t k, int64_t num_tokens,
                                     int64_t d_model, int64_t num_experts, int64_t capacity,
                                     cudaStream_t stream) {
  if (!tokens_fit(k, num_tokens, num_experts, capacity) || d_model < 0) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0 || d_model == 0) {
    return cudaSuccess;
  }
  switch (dtype) {
    case Dtype::kHalf:
      return dispatch_backward_typed<__half>(grad, indices, locations, grad_x, k, num_tokens, d_model,
                                             num_experts, capacity, stream);
    case Dtype::kBFloat16:
      return dispatch_backward_typed<__nv_bfloat16>(grad, indices, locations, grad_x, k, num_tokens,
                                                    d_model, num_experts, capacity, stream);
    case Dtype::kFloat:
      return dispatch_backward_typed<float>(grad, indices, locations, grad_x, k, num_tokens, d_model,
                                            num_experts, capacity, stream);
    case Dtype::kDouble:
      return dispatch_backward_typed<double>(grad, indices, locations, grad_x, k, num_tokens, d_model,
                                             num_experts, capacity, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace commweave::cuda
