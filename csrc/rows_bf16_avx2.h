// bf16 rows with AVX2 intrinsics, for kernels_cpu_avx2.cpp only (included by rows_cpu.h after the
// target pragma). The generic loops spend more instructions converting bf16 than moving it; here a
// 32-byte load gives 16 elements as two fp32 vectors by interleaving zeros below each element (exact:
// bf16 is the top half of an fp32), and the fp32 results go back with the same in-lane order
// (packus), rounded to nearest even exactly as c10::BFloat16 does, straight to non-temporal stores.
// Same maths as the generic code: products rounded, then summed in route order; no FMA.
#pragma once

#include <immintrin.h>

namespace commweave::cpu::avx2::rows {

// The two halves of 16 bf16, as fp32: elements {0-3, 8-11} and {4-7, 12-15} (AVX2 unpacks per lane).
inline __m256 bf16_low(__m256i v) {
  return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
}
inline __m256 bf16_high(__m256i v) {
  return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
}

// fp32 -> bf16 bits in the low half of each 32-bit lane: round to nearest even, NaN -> 0x7FC0.
inline __m256i bf16_bits(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

// The inverse of bf16_low/bf16_high: 16 bf16 in their original order.
inline __m256i bf16_pack(__m256 low, __m256 high) {
  return _mm256_packus_epi32(bf16_bits(low), bf16_bits(high));
}

inline bool aligned32(const void* p) { return reinterpret_cast<uintptr_t>(p) % 32 == 0; }

template <int N, bool Weighted>
inline void sum_stream_n(c10::BFloat16* dst, const c10::BFloat16* const* rows, const float* weights,
                         int64_t n) {
  __m256 w[N];
  for (int j = 0; j < N; ++j) {
    w[j] = _mm256_set1_ps(Weighted ? weights[j] : 1.0f);
  }
  for (int64_t m = 0; m < n; m += 16) {
    __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
    for (int j = 0; j < N; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + m));
      __m256 a = bf16_low(v), b = bf16_high(v);
      if (Weighted) {
        a = _mm256_mul_ps(a, w[j]);
        b = _mm256_mul_ps(b, w[j]);
      }
      low = j == 0 ? a : _mm256_add_ps(low, a);
      high = j == 0 ? b : _mm256_add_ps(high, b);
    }
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + m), bf16_pack(low, high));
  }
}

template <>
struct Fused<c10::BFloat16, float> {
  static constexpr bool available = true;

  // dst = sum_j weights[j] * rows[j] (or the plain sum), streamed; false where it does not apply.
  template <bool Weighted>
  static bool sum(c10::BFloat16* dst, const c10::BFloat16* const* rows, const float* weights, int64_t n_rows,
                  int64_t n) {
    if (n % 16 != 0 || !aligned32(dst)) {
      return false;
    }
    switch (n_rows) {
      case 1:
        sum_stream_n<1, Weighted>(dst, rows, weights, n);
        return true;
      case 2:
        sum_stream_n<2, Weighted>(dst, rows, weights, n);
        return true;
      case 3:
        sum_stream_n<3, Weighted>(dst, rows, weights, n);
        return true;
      case 4:
        sum_stream_n<4, Weighted>(dst, rows, weights, n);
        return true;
      default:
        return false;
    }
  }

  // dst = w * dy (streamed) and the return value <dy, row>; dy is fp32 in natural order.
  static bool scale_and_dot(c10::BFloat16* dst, const float* dy, float w, const c10::BFloat16* row, int64_t n,
                            float* dot) {
    if (n % 16 != 0 || !aligned32(dst)) {
      return false;
    }
    const __m256 wv = _mm256_set1_ps(w);
    __m256 acc_low = _mm256_setzero_ps(), acc_high = _mm256_setzero_ps();
    for (int64_t m = 0; m < n; m += 16) {
      const __m256 d0 = _mm256_loadu_ps(dy + m), d1 = _mm256_loadu_ps(dy + m + 8);
      const __m256 d_low = _mm256_permute2f128_ps(d0, d1, 0x20);   // elements 0-3, 8-11
      const __m256 d_high = _mm256_permute2f128_ps(d0, d1, 0x31);  // elements 4-7, 12-15
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + m));
      acc_low = _mm256_add_ps(acc_low, _mm256_mul_ps(d_low, bf16_low(v)));
      acc_high = _mm256_add_ps(acc_high, _mm256_mul_ps(d_high, bf16_high(v)));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + m),
                          bf16_pack(_mm256_mul_ps(wv, d_low), _mm256_mul_ps(wv, d_high)));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(acc_low, acc_high));
    float sum = 0;
    for (float lane : lanes) {
      sum += lane;
    }
    *dot = sum;
    return true;
  }
};

}  // namespace commweave::cpu::avx2::rows
