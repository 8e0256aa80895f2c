// Row loops of the CPU kernels: a row is M contiguous elements of the model dim. The loops are plain
// element-wise code that the compiler vectorises for the ISA of the including file (kernels_cpu.h).
// There is no fused multiply-add: a product is rounded before it is summed, as in torch's
// mul-then-sum, so fp32 results match deepspeed's bit for bit.
#pragma once
#ifndef COMMWEAVE_CPU_ISA
#error "rows_cpu.h is included by kernels_cpu_impl.h, which names the ISA namespace"
#endif

#include "routes.h"

#include <cstdint>
#include <cstring>

namespace commweave::cpu::COMMWEAVE_CPU_ISA::rows {

// Elements per block of sum_rows beyond four rows: the block's accumulators stay close while the
// token's routes stream through, so each output element is written once, rounded once.
constexpr int64_t kBlock = 32;

template <bool Weighted, typename T, typename A>
inline void sum_block(T* __restrict out, const T* const* rows, const A* weights, int64_t n_rows,
                      int64_t offset, int64_t len) {
  A acc[kBlock];
  const T* __restrict first = rows[0] + offset;
  const A w0 = Weighted ? weights[0] : A(1);
  for (int64_t i = 0; i < len; ++i) {
    acc[i] = Weighted ? w0 * static_cast<A>(first[i]) : static_cast<A>(first[i]);
  }
  for (int64_t j = 1; j < n_rows; ++j) {
    const T* __restrict row = rows[j] + offset;
    const A w = Weighted ? weights[j] : A(1);
    for (int64_t i = 0; i < len; ++i) {
      acc[i] += Weighted ? w * static_cast<A>(row[i]) : static_cast<A>(row[i]);
    }
  }
  for (int64_t i = 0; i < len; ++i) {
    out[offset + i] = static_cast<T>(acc[i]);
  }
}

// Hand-vectorised "compute a row and stream it out" for a storage/accumulate type pair, where an ISA
// build has one (rows_bf16_avx2.h); `available` false means the generic loops below write an L1 row
// that memory_cpu.h's stream_copy then writes out.
template <typename T, typename A>
struct Fused {
  static constexpr bool available = false;
};

// dst = the sum of sum_rows below, computed and streamed by Fused; false where there is no fused
// version or it does not apply (alignment, row length, more than four rows).
template <bool Weighted, typename T, typename A>
inline bool fused_sum(T* dst, const T* const* rows, const A* weights, int64_t n_rows, int64_t n) {
  if constexpr (Fused<T, A>::available) {
    return Fused<T, A>::template sum<Weighted>(dst, rows, weights, n_rows, n);
  } else {
    return false;
  }
}

// dst = w * dy, streamed, and *dot = <dy, row>, by Fused; false where it does not apply.
template <typename T, typename A>
inline bool fused_scale_and_dot(T* dst, const A* dy, A w, const T* row, int64_t n, A* dot) {
  if constexpr (Fused<T, A>::available) {
    return Fused<T, A>::scale_and_dot(dst, dy, w, row, n, dot);
  } else {
    return false;
  }
}

// Term j of a sum: w * row[m] (a rounded product) or the plain widened element.
template <bool Weighted, typename A, typename T>
inline A term(const T* __restrict row, A w, int64_t m) {
  return Weighted ? w * static_cast<A>(row[m]) : static_cast<A>(row[m]);
}

// out = sum_j weights[j] * rows[j] (or the plain sum when !Weighted), summed in order j = 0, 1, ...
// in the accumulate type A and rounded once; zeros when n_rows == 0. Up to four rows (every top-k
// gate of DeepSpeed up to k = 4) are one element-wise loop the compiler keeps in vector registers;
// more go block by block.
template <bool Weighted, typename T, typename A>
inline void sum_rows(T* __restrict out, const T* const* rows, const A* weights, int64_t n_rows, int64_t n) {
  const T* __restrict r0 = n_rows > 0 ? rows[0] : nullptr;
  const T* __restrict r1 = n_rows > 1 ? rows[1] : nullptr;
  const T* __restrict r2 = n_rows > 2 ? rows[2] : nullptr;
  const T* __restrict r3 = n_rows > 3 ? rows[3] : nullptr;
  const A w0 = Weighted && n_rows > 0 ? weights[0] : A(1);
  const A w1 = Weighted && n_rows > 1 ? weights[1] : A(1);
  const A w2 = Weighted && n_rows > 2 ? weights[2] : A(1);
  const A w3 = Weighted && n_rows > 3 ? weights[3] : A(1);
  switch (n_rows) {
    case 0:
      std::memset(out, 0, n * sizeof(T));
      return;
    case 1:
      for (int64_t m = 0; m < n; ++m) {
        out[m] = static_cast<T>(term<Weighted>(r0, w0, m));
      }
      return;
    case 2:
      for (int64_t m = 0; m < n; ++m) {
        out[m] = static_cast<T>(term<Weighted>(r0, w0, m) + term<Weighted>(r1, w1, m));
      }
      return;
    case 3:
      for (int64_t m = 0; m < n; ++m) {
        out[m] = static_cast<T>(term<Weighted>(r0, w0, m) + term<Weighted>(r1, w1, m) +
                                term<Weighted>(r2, w2, m));
      }
      return;
    case 4:
      for (int64_t m = 0; m < n; ++m) {
        out[m] = static_cast<T>(term<Weighted>(r0, w0, m) + term<Weighted>(r1, w1, m) +
                                term<Weighted>(r2, w2, m) + term<Weighted>(r3, w3, m));
      }
      return;
    default:
      break;
  }
  int64_t offset = 0;
  for (; offset + kBlock <= n; offset += kBlock) {
    sum_block<Weighted>(out, rows, weights, n_rows, offset, kBlock);
  }
  if (offset < n) {
    sum_block<Weighted>(out, rows, weights, n_rows, offset, n - offset);
  }
}

// acc = row, widened to the accumulate type
template <typename A, typename T>
inline void widen(A* __restrict acc, const T* __restrict row, int64_t n) {
  for (int64_t m = 0; m < n; ++m) {
    acc[m] = static_cast<A>(row[m]);
  }
}

// out = w * a, rounded to the storage type
template <typename T, typename A>
inline void scale(T* __restrict out, const A* __restrict a, A w, int64_t n) {
  for (int64_t m = 0; m < n; ++m) {
    out[m] = static_cast<T>(w * a[m]);
  }
}

// out = w * a, rounded to the storage type, and <a, row> in the accumulate type, in one pass over a.
// The dot product keeps kBlock partial sums (lanes the compiler maps onto vector registers).
template <typename T, typename A>
inline A scale_and_dot(T* __restrict out, const A* __restrict a, A w, const T* __restrict row, int64_t n) {
  A lanes[kBlock] = {};
  int64_t m = 0;
  for (; m + kBlock <= n; m += kBlock) {
    for (int64_t i = 0; i < kBlock; ++i) {
      out[m + i] = static_cast<T>(w * a[m + i]);
      lanes[i] += a[m + i] * static_cast<A>(row[m + i]);
    }
  }
  A sum = 0;
  for (; m < n; ++m) {
    out[m] = static_cast<T>(w * a[m]);
    sum += a[m] * static_cast<A>(row[m]);
  }
  for (int64_t i = 0; i < kBlock; ++i) {
    sum += lanes[i];
  }
  return sum;
}

// <a, row> in the accumulate type
template <typename A, typename T>
inline A dot(const A* __restrict a, const T* __restrict row, int64_t n) {
  A sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t m = 0; m < n; ++m) {
    sum += a[m] * static_cast<A>(row[m]);
  }
  return sum;
}

// The live routes of token s: their rows in `buffer` [E * C, M] (and their gates, when given),
// in route order j = 0, 1, ...; returns how many there are.
template <typename T, typename A>
inline int64_t token_routes(int64_t s, const int32_t* idx, const int32_t* loc, const A* gates, int64_t k,
                            int64_t num_tokens, int64_t num_experts, int64_t capacity, const T* buffer,
                            int64_t d_model, const T** rows, A* weights) {
  int64_t live = 0;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t r = j * num_tokens + s;
    const int64_t slot = route_slot(idx[r], loc[r], num_experts, capacity);
    if (slot >= 0) {
      rows[live] = buffer + slot * d_model;
      if (gates != nullptr) {
        weights[live] = gates[r];
      }
      ++live;
    }
  }
  return live;
}

// Prefetch the rows of token s's live routes (skips anything out of range: the kernel checks later).
template <typename T>
inline void prefetch_routes(int64_t s, const int32_t* idx, const int32_t* loc, int64_t k, int64_t num_tokens,
                            int64_t num_experts, int64_t capacity, const T* buffer, int64_t d_model) {
  for (int64_t j = 0; j < k; ++j) {
    const int64_t r = j * num_tokens + s;
    if (idx[r] >= 0 && idx[r] < num_experts && loc[r] >= 0 && loc[r] < capacity) {
      prefetch_row(buffer + (idx[r] * capacity + loc[r]) * d_model, d_model * static_cast<int64_t>(sizeof(T)));
    }
  }
}

}  // namespace commweave::cpu::COMMWEAVE_CPU_ISA::rows

#ifdef COMMWEAVE_CPU_AVX2
#include "rows_bf16_avx2.h"
#endif
