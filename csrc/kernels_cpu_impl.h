// The CPU kernels that do arithmetic, compiled once per ISA into the namespace
// commweave::cpu::COMMWEAVE_CPU_ISA (kernels_cpu_base.cpp, kernels_cpu_avx2.cpp) and reached through
// the table of kernels_cpu.h. Maths in dispatch.h and combine.h. Parallel over tokens (parallel_rows,
// memory_cpu.h); every output row has one writer and is written once, computed in an L1-resident row
// and streamed out.
#pragma once
#ifndef COMMWEAVE_CPU_ISA
#error "define COMMWEAVE_CPU_ISA (the namespace of this build of the kernels) before including"
#endif

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels_cpu.h"
#include "memory_cpu.h"
#include "routes.h"
#include "rows_cpu.h"

namespace commweave::cpu::COMMWEAVE_CPU_ISA {
namespace {

// dispatch backward: the token's live routes summed in the accumulate type, rounded once.
template <typename T>
void gather_sum(const T* grad, const int32_t* idx, const int32_t* loc, T* out, int64_t k,
                int64_t num_tokens, int64_t d_model, int64_t num_experts, int64_t capacity) {
  using A = typename Acc<T>::type;
  const int64_t bytes = d_model * static_cast<int64_t>(sizeof(T));
  parallel_rows(num_tokens, bytes, [&](int64_t begin, int64_t end) {
    std::vector<const T*> routes(k);
    std::vector<T> row(d_model);
    for (int64_t s = begin; s < end; ++s) {
      if (s + kAhead < end) {
        rows::prefetch_routes(s + kAhead, idx, loc, k, num_tokens, num_experts, capacity, grad,
                              d_model);
      }
      const int64_t live = rows::token_routes<T, A>(s, idx, loc, nullptr, k, num_tokens, num_experts,
                                                    capacity, grad, d_model, routes.data(), nullptr);
      T* dst = out + s * d_model;
      if (live == 0) {
        stream_zero(dst, bytes);
      } else if (live == 1) {
        stream_copy(dst, routes[0], bytes);  // a single route is a copy, exactly
      } else if (!rows::fused_sum<false, T, A>(dst, routes.data(), nullptr, live, d_model)) {
        rows::sum_rows<false, T, A>(row.data(), routes.data(), nullptr, live, d_model);
        stream_copy(dst, row.data(), bytes);
      }
    }
  });
}

// combine forward: the token's k weighted routes summed in an fp32 (fp64) row, rounded once.
template <typename T, typename A>
void weighted_sum(const T* expert, const int32_t* idx, const int32_t* loc, const A* gates, T* out,
                  int64_t k, int64_t num_tokens, int64_t d_model, int64_t num_experts, int64_t capacity) {
  const int64_t bytes = d_model * static_cast<int64_t>(sizeof(T));
  parallel_rows(num_tokens, bytes, [&](int64_t begin, int64_t end) {
    std::vector<const T*> routes(k);
    std::vector<A> weights(k);
    std::vector<T> row(d_model);
    for (int64_t s = begin; s < end; ++s) {
      if (s + kAhead < end) {
        rows::prefetch_routes(s + kAhead, idx, loc, k, num_tokens, num_experts, capacity, expert,
                              d_model);
      }
      const int64_t live = rows::token_routes(s, idx, loc, gates, k, num_tokens, num_experts, capacity,
                                              expert, d_model, routes.data(), weights.data());
      T* dst = out + s * d_model;
      if (live == 0) {
        stream_zero(dst, bytes);
      } else if (!rows::fused_sum<true>(dst, routes.data(), weights.data(), live, d_model)) {
        rows::sum_rows<true>(row.data(), routes.data(), weights.data(), live, d_model);
        stream_copy(dst, row.data(), bytes);
      }
    }
  });
}

// combine backward: each grad_y row is read once (widened to the accumulate type, it stays in L1
// while the token's routes use it); per route, one pass makes gate * dy and takes <dy, route>.
template <typename T, typename A>
void weighted_sum_backward(const T* grad, const T* expert, const int32_t* idx, const int32_t* loc,
                           const A* gates, T* grad_expert, A* grad_gates, int64_t k, int64_t num_tokens,
                           int64_t d_model, int64_t num_experts, int64_t capacity) {
  const int64_t bytes = d_model * static_cast<int64_t>(sizeof(T));
  parallel_rows(num_tokens, bytes, [&](int64_t begin, int64_t end) {
    std::vector<A> scratch(std::is_same_v<T, A> ? 0 : d_model);
    std::vector<T> row(grad_expert != nullptr ? d_model : 0);
    for (int64_t s = begin; s < end; ++s) {
      if (grad_gates != nullptr && s + kAhead < end) {
        rows::prefetch_routes(s + kAhead, idx, loc, k, num_tokens, num_experts, capacity, expert,
                              d_model);
      }
      const A* dy = reinterpret_cast<const A*>(grad + s * d_model);
      if constexpr (!std::is_same_v<T, A>) {
        rows::widen(scratch.data(), grad + s * d_model, d_model);
        dy = scratch.data();
      }
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = j * num_tokens + s;
        const int64_t slot = route_slot(idx[r], loc[r], num_experts, capacity);
        if (slot < 0) {
          if (grad_gates != nullptr) {
            grad_gates[r] = 0;
          }
        } else if (grad_expert != nullptr) {
          T* dst = grad_expert + slot * d_model;
          const T* routed = expert + slot * d_model;
          if (grad_gates != nullptr &&
              rows::fused_scale_and_dot(dst, dy, gates[r], routed, d_model, &grad_gates[r])) {
            continue;
          }
          if (grad_gates != nullptr) {
            grad_gates[r] = rows::scale_and_dot(row.data(), dy, gates[r], routed, d_model);
          } else {
            rows::scale(row.data(), dy, gates[r], d_model);
          }
          stream_copy(dst, row.data(), bytes);
        } else {
          grad_gates[r] = rows::dot(dy, expert + slot * d_model, d_model);
        }
      }
    }
  });
}

// Calls f(T{}, A{}) with the storage type T of `dtype` and the accumulate type A of `acc`.
template <typename F>
void with_types(at::ScalarType dtype, at::ScalarType acc, F&& f) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "commweave", [&] {
    if (acc == at::kDouble) {
      f(scalar_t{}, double{});
    } else {
      f(scalar_t{}, typename Acc<scalar_t>::type{});
    }
  });
}

void dispatch_backward(at::ScalarType dtype, const void* grad, const int32_t* indices, const int32_t* locations,
                       void* grad_x, int64_t k, int64_t num_tokens, int64_t d_model, int64_t num_experts,
                       int64_t capacity) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "dispatch_backward", [&] {
    gather_sum<scalar_t>(static_cast<const scalar_t*>(grad), indices, locations,
                         static_cast<scalar_t*>(grad_x), k, num_tokens, d_model, num_experts, capacity);
  });
}

void combine(at::ScalarType dtype, at::ScalarType acc, const void* expert, const int32_t* indices,
             const int32_t* locations, const void* gates, void* y, int64_t k, int64_t num_tokens,
             int64_t d_model, int64_t num_experts, int64_t capacity) {
  with_types(dtype, acc, [&](auto t, auto a) {
    using T = decltype(t);
    using A = decltype(a);
    weighted_sum<T, A>(static_cast<const T*>(expert), indices, locations, static_cast<const A*>(gates),
                       static_cast<T*>(y), k, num_tokens, d_model, num_experts, capacity);
  });
}

void combine_backward(at::ScalarType dtype, at::ScalarType acc, const void* grad_y, const void* expert,
                      const int32_t* indices, const int32_t* locations, const void* gates, void* grad_expert,
                      void* grad_gates, int64_t k, int64_t num_tokens, int64_t d_model, int64_t num_experts,
                      int64_t capacity) {
  with_types(dtype, acc, [&](auto t, auto a) {
    using T = decltype(t);
    using A = decltype(a);
    weighted_sum_backward<T, A>(static_cast<const T*>(grad_y), static_cast<const T*>(expert), indices,
                                locations, static_cast<const A*>(gates), static_cast<T*>(grad_expert),
                                static_cast<A*>(grad_gates), k, num_tokens, d_model, num_experts, capacity);
  });
}

}  // namespace

#define COMMWEAVE_STRINGIFY(name) #name
#define COMMWEAVE_NAME(name) COMMWEAVE_STRINGIFY(name)
const Kernels kernels = {COMMWEAVE_NAME(COMMWEAVE_CPU_ISA), &dispatch_backward, &combine, &combine_backward};

}  // namespace commweave::cpu::COMMWEAVE_CPU_ISA
