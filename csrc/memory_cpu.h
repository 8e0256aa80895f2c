// Memory traffic helpers of the CPU kernels, which move rows of a few KB between random places.
//  - prefetch_row: ask for a row a few iterations ahead; rows this short end before the hardware
//    prefetcher ramps up.
//  - stream_copy / stream_zero: write a whole output row with non-temporal stores. A plain store to a
//    line not in cache first reads it (read-for-ownership), so every output byte would cost a read and
//    a write; the outputs here are far larger than the caches and not read back soon. glibc's memcpy
//    streams only copies larger than a sizeable part of the cache, so rows of a few KB need it done
//    here. store_fence() orders the streamed stores; each chunk of parallel_rows ends with it.
//  - parallel_rows: rows split over the threads in chunks taken from a shared counter, so that a
//    thread slowed by other work on a shared machine takes fewer chunks instead of holding all back.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace commweave {

constexpr int64_t kAhead = 2;  // rows (tokens, slots) to prefetch ahead

inline void prefetch_row(const void* row, int64_t bytes) {
  const auto* p = static_cast<const char*>(row);
  for (int64_t off = 0; off < bytes; off += 64) {
    __builtin_prefetch(p + off);
  }
}

inline void stream_copy(void* dst, const void* src, int64_t bytes) {
#if defined(__x86_64__)
  if (reinterpret_cast<uintptr_t>(dst) % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
      bytes % 64 == 0) {
    auto* d = static_cast<__m128i*>(dst);
    const auto* s = static_cast<const __m128i*>(src);
    for (int64_t i = 0; i < bytes / 16; i += 4) {
      const __m128i a = _mm_load_si128(s + i), b = _mm_load_si128(s + i + 1);
      const __m128i c = _mm_load_si128(s + i + 2), e = _mm_load_si128(s + i + 3);
      _mm_stream_si128(d + i, a);
      _mm_stream_si128(d + i + 1, b);
      _mm_stream_si128(d + i + 2, c);
      _mm_stream_si128(d + i + 3, e);
    }
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

inline void stream_zero(void* dst, int64_t bytes) {
#if defined(__x86_64__)
  if (reinterpret_cast<uintptr_t>(dst) % 16 == 0 && bytes % 64 == 0) {
    auto* d = static_cast<__m128i*>(dst);
    const __m128i zero = _mm_setzero_si128();
    for (int64_t i = 0; i < bytes / 16; ++i) {
      _mm_stream_si128(d + i, zero);
    }
    return;
  }
#endif
  std::memset(dst, 0, bytes);
}

inline void store_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// f(begin, end) over [0, rows) in chunks of about 256 KB (at least 8 chunks per thread when there are
// enough rows), on at::parallel_for's threads; serial below 64 KB in all, where waking a thread costs
// more than it saves. Every chunk ends with store_fence() for the streamed rows.
template <typename F>
void parallel_rows(int64_t rows, int64_t row_bytes, const F& f) {
  const int64_t threads = at::get_num_threads();
  const int64_t bytes = std::max<int64_t>(row_bytes, 1);
  if (rows * bytes < (int64_t{64} << 10) || threads == 1) {
    f(0, rows);
    store_fence();
    return;
  }
  const int64_t chunk = std::max<int64_t>(
      1, std::min<int64_t>((int64_t{256} << 10) / bytes, (rows + 8 * threads - 1) / (8 * threads)));
  const int64_t chunks = (rows + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      f(c * chunk, std::min(rows, (c + 1) * chunk));
      store_fence();
    }
  });
}

}  // namespace commweave
