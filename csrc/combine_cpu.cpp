// CPU kernels of combine and its backward (the maths in combine.h), in parallel over tokens
// (at::parallel_for, OpenMP). The forward sums a token's k weighted routes in an fp32 (fp64) row and
// rounds once. The backward reads each grad_y row once (widened to the accumulate type, it stays in
// L1 while the token's k routes use it), writes the routes' grad_expert rows and their gate
// gradients, then zeroes the slots no route owns: every grad_expert row is written exactly once.
#include "combine.h"
#include "rows_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <type_traits>
#include <vector>

namespace commweave {
namespace {

template <typename T, typename A>
void weighted_sum(const T* expert, const int32_t* idx, const int32_t* loc, const A* gates, T* out,
                  int64_t k, int64_t num_tokens, int64_t d_model, int64_t num_experts, int64_t capacity) {
  at::parallel_for(0, num_tokens, grain_rows(d_model * sizeof(T)), [&](int64_t begin, int64_t end) {
    std::vector<const T*> routes(k);
    std::vector<A> weights(k);
    for (int64_t s = begin; s < end; ++s) {
      if (s + rows::kAhead < end) {
        rows::prefetch_routes(s + rows::kAhead, idx, loc, k, num_tokens, num_experts, capacity, expert,
                              d_model);
      }
      const int64_t live = rows::token_routes(s, idx, loc, gates, k, num_tokens, num_experts, capacity,
                                              expert, d_model, routes.data(), weights.data());
      rows::sum_rows<true>(out + s * d_model, routes.data(), weights.data(), live, d_model);
    }
  });
}

template <typename T, typename A>
void weighted_sum_backward(const T* grad, const T* expert, const int32_t* idx, const int32_t* loc,
                           const A* gates, T* grad_expert, A* grad_gates, int64_t k, int64_t num_tokens,
                           int64_t d_model, int64_t num_experts, int64_t capacity) {
  at::parallel_for(0, num_tokens, grain_rows(d_model * sizeof(T)), [&](int64_t begin, int64_t end) {
    std::vector<A> scratch(std::is_same_v<T, A> ? 0 : d_model);
    for (int64_t s = begin; s < end; ++s) {
      if (grad_gates != nullptr && s + rows::kAhead < end) {
        rows::prefetch_routes(s + rows::kAhead, idx, loc, k, num_tokens, num_experts, capacity, expert,
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
        } else if (grad_expert != nullptr && grad_gates != nullptr) {
          grad_gates[r] = rows::scale_and_dot(grad_expert + slot * d_model, dy, gates[r],
                                              expert + slot * d_model, d_model);
        } else if (grad_expert != nullptr) {
          rows::scale(grad_expert + slot * d_model, dy, gates[r], d_model);
        } else {
          grad_gates[r] = rows::dot(dy, expert + slot * d_model, d_model);
        }
      }
    }
  });
}

}  // namespace

at::Tensor combine_cpu(const at::Tensor& expert_output, const at::Tensor& indices,
                       const at::Tensor& locations, const at::Tensor& gates) {
  check_combine(expert_output, indices, locations, gates);
  const auto expert = expert_output.contiguous();
  const auto idx = indices.contiguous();
  const auto loc = locations.contiguous();
  const auto acc_type = combine_acc_type(expert_output, gates);
  const auto gates_acc = gates.to(acc_type).contiguous();
  const int64_t num_experts = expert.size(0), capacity = expert.size(1), d_model = expert.size(2);
  const int64_t k = idx.size(0), num_tokens = idx.size(1);
  auto out = at::empty({num_tokens, d_model}, expert.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, expert.scalar_type(), "combine", [&] {
    auto run = [&](auto acc_zero) {
      using A = decltype(acc_zero);
      weighted_sum<scalar_t, A>(expert.const_data_ptr<scalar_t>(), idx.const_data_ptr<int32_t>(),
                                loc.const_data_ptr<int32_t>(), gates_acc.const_data_ptr<A>(),
                                out.mutable_data_ptr<scalar_t>(), k, num_tokens, d_model, num_experts,
                                capacity);
    };
    acc_type == at::kDouble ? run(double{}) : run(typename Acc<scalar_t>::type{});
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> combine_backward_cpu(const at::Tensor& grad,
                                                        const at::Tensor& expert_output,
                                                        const at::Tensor& indices,
                                                        const at::Tensor& locations,
                                                        const at::Tensor& gates, bool need_expert_grad,
                                                        bool need_gates_grad) {
  check_combine_backward(grad, expert_output, indices, locations, gates);
  const auto grad_c = grad.contiguous();
  const auto expert = expert_output.contiguous();
  const auto idx = indices.contiguous();
  const auto loc = locations.contiguous();
  const auto acc_type = combine_acc_type(expert_output, gates);
  const auto gates_acc = gates.to(acc_type).contiguous();
  const int64_t num_experts = expert.size(0), capacity = expert.size(1), d_model = expert.size(2);
  const int64_t k = idx.size(0), num_tokens = idx.size(1);
  // A gradient nobody asked for is returned empty (the autograd wrapper turns it into None).
  const auto expert_shape = need_expert_grad ? std::vector<int64_t>{num_experts, capacity, d_model}
                                             : std::vector<int64_t>{0};
  const auto gates_shape = need_gates_grad ? std::vector<int64_t>{k, num_tokens} : std::vector<int64_t>{0};
  auto grad_expert = at::empty(expert_shape, expert.options());
  auto grad_gates = at::empty(gates_shape, gates_acc.options());
  // Owners first: the slots no route owns get a zero gradient (this also re-checks for collisions).
  const auto owner = need_expert_grad ? slot_owners(idx.const_data_ptr<int32_t>(),
                                                    loc.const_data_ptr<int32_t>(), k, num_tokens,
                                                    num_experts, capacity)
                                      : std::vector<int32_t>{};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, expert.scalar_type(), "combine_backward", [&] {
    auto run = [&](auto acc_zero) {
      using A = decltype(acc_zero);
      weighted_sum_backward<scalar_t, A>(
          grad_c.const_data_ptr<scalar_t>(), expert.const_data_ptr<scalar_t>(),
          idx.const_data_ptr<int32_t>(), loc.const_data_ptr<int32_t>(), gates_acc.const_data_ptr<A>(),
          need_expert_grad ? grad_expert.mutable_data_ptr<scalar_t>() : nullptr,
          need_gates_grad ? grad_gates.mutable_data_ptr<A>() : nullptr, k, num_tokens, d_model,
          num_experts, capacity);
    };
    acc_type == at::kDouble ? run(double{}) : run(typename Acc<scalar_t>::type{});
  });
  if (need_expert_grad) {
    const int64_t row = d_model * expert.element_size();
    auto* dst = static_cast<char*>(grad_expert.mutable_data_ptr());
    at::parallel_for(0, num_experts * capacity, grain_rows(row), [&](int64_t begin, int64_t end) {
      for (int64_t slot = begin; slot < end; ++slot) {
        if (owner[slot] < 0) {
          std::memset(dst + slot * row, 0, row);
        }
      }
    });
  }
  return {grad_expert, need_gates_grad ? grad_gates.to(gates.scalar_type()) : grad_gates};
}

}  // namespace commweave
