// The operator library `commweave` (torch.ops.commweave.*) and the Python module ds_plugins._C that
// loads it. Schemas and the CPU kernels are registered here, the CUDA kernels in ops_cuda.cpp (CUDA
// builds only); shape-only "fake" kernels for meta tensors and torch.compile, and autograd, are
// registered from Python in ds_plugins/dispatch.py (set_python_module points torch there).
#include <Python.h>

#include <torch/library.h>

#include "combine.h"
#include "dispatch.h"
#include "kernels_cpu.h"

TORCH_LIBRARY(commweave, m) {
  m.set_python_module("ds_plugins.dispatch");
  m.def("find_route_fault(Tensor indices, Tensor locations, int num_experts, int capacity) -> int[]");
  m.def("dispatch(Tensor x, Tensor indices, Tensor locations, int num_experts, int capacity) -> Tensor");
  m.def("dispatch_backward(Tensor grad, Tensor indices, Tensor locations, int num_tokens) -> Tensor");
  m.def("combine(Tensor expert_output, Tensor indices, Tensor locations, Tensor gates) -> Tensor");
  m.def(
      "combine_backward(Tensor grad, Tensor expert_output, Tensor indices, Tensor locations, "
      "Tensor gates, bool need_expert_grad, bool need_gates_grad) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(commweave, CPU, m) {
  m.impl("find_route_fault", &commweave::find_route_fault_cpu);
  m.impl("dispatch", &commweave::dispatch_cpu);
  m.impl("dispatch_backward", &commweave::dispatch_backward_cpu);
  m.impl("combine", &commweave::combine_cpu);
  m.impl("combine_backward", &commweave::combine_backward_cpu);
}

#ifdef COMMWEAVE_WITH_CUDA
#define COMMWEAVE_CUDA_KERNELS 1
#else
#define COMMWEAVE_CUDA_KERNELS 0
#endif

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {
      PyModuleDef_HEAD_INIT, "_C",
      "commweave's fused MoE dispatch/combine kernels; the ops are torch.ops.commweave.*", -1, nullptr};
  PyObject* m = PyModule_Create(&module);
  if (m != nullptr && (PyModule_AddIntConstant(m, "WITH_CUDA", COMMWEAVE_CUDA_KERNELS) != 0 ||
                       PyModule_AddStringConstant(m, "CPU_ISA", commweave::cpu::kernels().isa) != 0)) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
