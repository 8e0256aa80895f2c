// The CPU kernels for x86-64 with AVX2 and F16C, chosen at run time by kernels() (kernels_cpu.h).
// Every header with inline functions comes first, so those stay baseline code (an AVX2 duplicate could
// be the copy the linker keeps for all files); only what follows the pragma, the templates and
// launchers in the namespace commweave::cpu::avx2, is compiled for AVX2 + F16C. No "fma": products
// stay rounded (rows_cpu.h).
#if defined(__x86_64__)
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels_cpu.h"
#include "memory_cpu.h"
#include "routes.h"

#pragma GCC target("avx2,f16c")
#define COMMWEAVE_CPU_ISA avx2
#define COMMWEAVE_CPU_AVX2 1
#include "kernels_cpu_impl.h"
#endif
