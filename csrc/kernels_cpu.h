// The CPU kernels that do arithmetic (kernels_cpu_impl.h), behind launchers over raw pointers and sizes
// like kernels_cuda.h. They are compiled twice: for the baseline ISA (kernels_cpu_base.cpp) and, on
// x86-64, for AVX2 + F16C (kernels_cpu_avx2.cpp), where the fp16/bf16 conversions become single
// instructions; kernels() picks the widest set the running CPU has, unless the environment variable
// COMMWEAVE_CPU_ISA=base asks for the baseline (tests run both). No FMA in either: see rows_cpu.h.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace commweave::cpu {

struct Kernels {
  const char* isa;  // "base" or "avx2"
  // grad_x[s] = sum of the token's live routed rows of grad [E * C, M] (dispatch.h).
  void (*dispatch_backward)(at::ScalarType dtype, const void* grad, const int32_t* indices,
                            const int32_t* locations, void* grad_x, int64_t k, int64_t num_tokens,
                            int64_t d_model, int64_t num_experts, int64_t capacity);
  // y[s] = sum_j gates[j, s] * expert[route (j, s)], gates in the accumulate type acc (combine.h).
  void (*combine)(at::ScalarType dtype, at::ScalarType acc, const void* expert, const int32_t* indices,
                  const int32_t* locations, const void* gates, void* y, int64_t k, int64_t num_tokens,
                  int64_t d_model, int64_t num_experts, int64_t capacity);
  // grad_expert[route] = gate * dy[s] (unowned slots untouched) and grad_gates[j, s] = <dy[s], route>;
  // either output may be null (combine.h).
  void (*combine_backward)(at::ScalarType dtype, at::ScalarType acc, const void* grad_y, const void* expert,
                           const int32_t* indices, const int32_t* locations, const void* gates,
                           void* grad_expert, void* grad_gates, int64_t k, int64_t num_tokens,
                           int64_t d_model, int64_t num_experts, int64_t capacity);
};

namespace base {
extern const Kernels kernels;
}
#if defined(__x86_64__)
namespace avx2 {
extern const Kernels kernels;
}
#endif

inline const Kernels& kernels() {
#if defined(__x86_64__)
  static const bool use_avx2 = [] {
    const char* forced = std::getenv("COMMWEAVE_CPU_ISA");
    const bool base_asked = forced != nullptr && std::strcmp(forced, "base") == 0;
    return !base_asked && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }();
  if (use_avx2) {
    return avx2::kernels;
  }
#endif
  return base::kernels;
}

}  // namespace commweave::cpu
