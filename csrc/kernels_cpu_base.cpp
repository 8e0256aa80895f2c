// The CPU kernels for the baseline ISA of the build (x86-64: SSE2), the fallback of kernels().
#define COMMWEAVE_CPU_ISA base
#include "kernels_cpu_impl.h"
