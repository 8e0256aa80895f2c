// CUDA kernels of combine and its backward (maths in combine.h). One thread block per token, 16-byte
// loads and stores where the row allows them, no atomics: every output row and every gate gradient has
// exactly one writer. The slots that no route owns are zeroed by launch_zero_unowned (dispatch_cuda.cu).
#include "cuda_common.cuh"

namespace commweave::cuda {
namespace {

// y[s] = sum_j gates[j, s] * expert[route (j, s)], products rounded, summed in route order.
template <typename T, typename A, int V>
__global__ void combine_kernel(const T* expert, const int32_t* indices, const int32_t* locations,
                               const A* gates, T* y, int64_t k, int64_t num_tokens, int64_t d_model,
                               int64_t num_experts, int64_t capacity) {
  using P = Pack<T, V>;
  const int64_t s = blockIdx.x;
  const int64_t packs = d_model / V;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    A acc[V];
    bool any = false;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = j * num_tokens + s;
      const int64_t slot = route_slot(indices, locations, r, num_experts, capacity);
      if (slot < 0) {
        continue;
      }
      const A gate = gates[r];
      const P in = reinterpret_cast<const P*>(expert + slot * d_model)[p];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const A term = mul(gate, widen<A>(in.v[i]));
        acc[i] = any ? add(acc[i], term) : term;
      }
      any = true;
    }
    P out;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      out.v[i] = narrow<T>(any ? acc[i] : A(0));
    }
    reinterpret_cast<P*>(y + s * d_model)[p] = out;
  }
}

// Token s: for each route j, grad_expert[route] = gate * dy and grad_gates[j, s] = <dy, expert[route]>.
// dy comes from DRAM for the first route and from L1/L2 for the others.
template <typename T, typename A, int V>
__global__ void combine_backward_kernel(const T* grad_y, const T* expert, const int32_t* indices,
                                        const int32_t* locations, const A* gates, T* grad_expert,
                                        A* grad_gates, int64_t k, int64_t num_tokens, int64_t d_model,
                                        int64_t num_experts, int64_t capacity) {
  using P = Pack<T, V>;
  __shared__ A partials[32];
  const int64_t s = blockIdx.x;
  const int64_t packs = d_model / V;
  const P* dy_row = reinterpret_cast<const P*>(grad_y + s * d_model);
  for (int64_t j = 0; j < k; ++j) {
    const int64_t r = j * num_tokens + s;
    const int64_t slot = route_slot(indices, locations, r, num_experts, capacity);
    if (slot < 0) {
      if (grad_gates != nullptr && threadIdx.x == 0) {
        grad_gates[r] = A(0);
      }
      continue;  // uniform across the block: no thread reaches block_sum for this route
    }
    const A gate = gates[r];
    const P* expert_row = reinterpret_cast<const P*>(expert + slot * d_model);
    P* grad_row = grad_expert == nullptr ? nullptr : reinterpret_cast<P*>(grad_expert + slot * d_model);
    A dot = 0;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const P dy = dy_row[p];
      if (grad_row != nullptr) {
        P out;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          out.v[i] = narrow<T>(mul(gate, widen<A>(dy.v[i])));
        }
        grad_row[p] = out;
      }
      if (grad_gates != nullptr) {
        const P x = expert_row[p];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          dot += widen<A>(dy.v[i]) * widen<A>(x.v[i]);
        }
      }
    }
    if (grad_gates != nullptr) {
      dot = block_sum(dot, partials);
      if (threadIdx.x == 0) {
        grad_gates[r] = dot;
      }
    }
  }
}

template <typename T, typename A>
cudaError_t combine_typed(const void* expert, const int32_t* indices, const int32_t* locations,
                          const void* gates, void* y, int64_t k, int64_t num_tokens, int64_t d_model,
                          int64_t num_experts, int64_t capacity, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = d_model % kVec == 0 && aligned16(expert) && aligned16(y);
  const int threads = block_threads(vec ? d_model / kVec : d_model);
  const auto* e = static_cast<const T*>(expert);
  const auto* g = static_cast<const A*>(gates);
  auto* out = static_cast<T*>(y);
  if (vec) {
    combine_kernel<T, A, kVec><<<num_tokens, threads, 0, stream>>>(e, indices, locations, g, out, k,
                                                                    num_tokens, d_model, num_experts, capacity);
  } else {
    combine_kernel<T, A, 1><<<num_tokens, threads, 0, stream>>>(e, indices, locations, g, out, k, num_tokens,
                                                                 d_model, num_experts, capacity);
  }
  return cudaGetLastError();
}

template <typename T, typename A>
cudaError_t combine_backward_typed(const void* grad_y, const void* expert, const int32_t* indices,
                                   const int32_t* locations, const void* gates, void* grad_expert,
                                   void* grad_gates, int64_t k, int64_t num_tokens, int64_t d_model,
                                   int64_t num_experts, int64_t capacity, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = d_model % kVec == 0 && aligned16(grad_y) && aligned16(expert) &&
                   (grad_expert == nullptr || aligned16(grad_expert));
  const int threads = block_threads(vec ? d_model / kVec : d_model);
  const auto* dy = static_cast<const T*>(grad_y);
  const auto* e = static_cast<const T*>(expert);
  const auto* g = static_cast<const A*>(gates);
  auto* ge = static_cast<T*>(grad_expert);
  auto* gg = static_cast<A*>(grad_gates);
  if (vec) {
    combine_backward_kernel<T, A, kVec><<<num_tokens, threads, 0, stream>>>(
        dy, e, indices, locations, g, ge, gg, k, num_tokens, d_model, num_experts, capacity);
  } else {
    combine_backward_kernel<T, A, 1><<<num_tokens, threads, 0, stream>>>(
        dy, e, indices, locations, g, ge, gg, k, num_tokens, d_model, num_experts, capacity);
  }
  return cudaGetLastError();
}

// Calls f(T{}, A{}) with the storage type T of `dtype` and the accumulate type A.
template <typename F>
cudaError_t with_types(Dtype dtype, bool acc_double, F&& f) {
  switch (dtype) {
    case Dtype::kHalf:
      return acc_double ? f(__half{}, double{}) : f(__half{}, float{});
    case Dtype::kBFloat16:
      return acc_double ? f(__nv_bfloat16{}, double{}) : f(__nv_bfloat16{}, float{});
    case Dtype::kFloat:
      return acc_double ? f(float{}, double{}) : f(float{}, float{});
    case Dtype::kDouble:
      return f(double{}, double{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_combine(Dtype dtype, bool acc_double, const void* expert, const int32_t* indices,
                           const int32_t* locations, const void* gates, void* y, int64_t k,
                           int64_t num_tokens, int64_t d_model, int64_t num_experts, int64_t capacity,
                           cudaStream_t stream) {
  if (!tokens_fit(k, num_tokens, num_experts, capacity) || d_model < 0) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0 || d_model == 0) {
    return cudaSuccess;
  }
  return with_types(dtype, acc_double, [&](auto t, auto a) {
    return combine_typed<decltype(t), decltype(a)>(expert, indices, locations, gates, y, k, num_tokens,
                                                   d_model, num_experts, capacity, stream);
  });
}

cudaError_t launch_combine_backward(Dtype dtype, bool acc_double, const void* grad_y, const void* expert,
                                    const int32_t* indices, const int32_t* locations, const void* gates,
                                    void* grad_expert, void* grad_gates, int64_t k, int64_t num_tokens,
                                    int64_t d_model, int64_t num_experts, int64_t capacity,
                                    cudaStream_t stream) {
  if (!tokens_fit(k, num_tokens, num_experts, capacity) || d_model < 0) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0 || (grad_expert == nullptr && grad_gates == nullptr)) {
    return cudaSuccess;
  }
  return with_types(dtype, acc_double, [&](auto t, auto a) {
    return combine_backward_typed<decltype(t), decltype(a)>(grad_y, expert, indices, locations, gates,
                                                            grad_expert, grad_gates, k, num_tokens, d_model,
                                                            num_experts, capacity, stream);
  });
}

}  // namespace commweave::cuda
