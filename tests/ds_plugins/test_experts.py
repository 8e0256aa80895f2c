"""ESP sharding through the expert protocol: the shards' partial sums add up to the unsharded expert,
gradients too, for the two-layer MLP, SwiGLU and a user's expert that implements the protocol."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_plugins import experts
from ds_plugins.experts import SwiGLU


class ReluSquaredMLP(nn.Module):
    """A user's expert with the protocol: y = W2 · relu(W1 · x)² + b (Primer's squared ReLU)."""

    def __init__(self, m: int, h: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(h, m) / m ** 0.5)
        self.w2 = nn.Parameter(torch.randn(m, h) / h ** 0.5)
        self.b = nn.Parameter(torch.randn(m))

    def forward(self, x):
        return F.linear(F.relu(F.linear(x, self.w1)).square(), self.w2) + self.b

    def esp_partition(self):
        return {"w1": 0, "w2": 1}

    def esp_forward(self, x, esp_size):
        return experts.shared_bias(F.linear(F.relu(F.linear(x, self.w1)).square(), self.w2), self.b, esp_size)


EXPERTS = {
    "mlp": lambda: nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6)),
    "swiglu": lambda: SwiGLU(6, 12),
    "geglu-bias": lambda: SwiGLU(6, 12, activation=nn.GELU(), bias=True),
    "user": lambda: ReluSquaredMLP(6, 12),
}


def _make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return EXPERTS[kind]()


@pytest.mark.parametrize("kind", list(EXPERTS))
@pytest.mark.parametrize("s", [1, 2, 3, 4])
def test_partial_sums_add_up_to_the_expert(kind, s):
    full = [_make(kind) for _ in range(2)]
    x = torch.randn(2, 5, 6, requires_grad=True)
    want = torch.stack([f(x[e]) for e, f in enumerate(full)])
    want.square().sum().backward()
    got, xs, shards = 0, [], []
    for q in range(s):
        mods = nn.ModuleList(_make(kind) for _ in range(2))
        for mod in mods:
            experts.check_shardable(mod, s)
            experts.shard_(mod, q, s)
        xq = x.detach().clone().requires_grad_()
        part = torch.stack(experts.partial_sums(mods, xq.unbind(0), s))
        got = got + part
        shards.append(mods)
        xs.append(xq)
    torch.testing.assert_close(got, want.detach())
    # gradient of sum(y^2): dL/dy = 2y is the same on every shard (the reduce-scatter's dual is an all-gather)
    for q, mods in enumerate(shards):
        torch.stack(experts.partial_sums(mods, xs[q].unbind(0), s)).backward(2 * want.detach())
    for e in range(2):
        grads = {name: p.grad for name, p in full[e].named_parameters()}
        for mods in shards:
            for name, p in mods[e].named_parameters():
                tag = getattr(p, "esp_shard", None)
                if tag is not None:
                    torch.testing.assert_close(p.grad, tag.block(grads[name]))
                else:  # a replicated output bias: every copy gets the full gradient
                    torch.testing.assert_close(p.grad, grads[name])
    torch.testing.assert_close(sum(xq.grad for xq in xs), x.grad)


def test_shard_keeps_parameter_objects_and_tags_them():
    mod = _make("mlp")
    w1, b2 = mod[0].weight, mod[2].bias
    experts.shard_(mod, 1, 2)
    assert mod[0].weight is w1 and w1.shape == (6, 6) and mod[2].bias is b2 and b2.shape == (6,)
    assert w1.tensor_model_parallel and w1.partition_dim == 0 and mod[2].weight.partition_dim == 1
    assert w1.esp_shard.dim == 0 and w1.esp_shard.rank == 1 and not hasattr(b2, "esp_shard")
    assert mod[0].out_features == 6 and experts.ffn_size(mod, 6) == 12
    swiglu = _make("swiglu")
    experts.shard_(swiglu, 0, 4)
    assert swiglu.w1.weight.shape == (3, 6) and swiglu.w2.weight.shape == (6, 3)
    assert experts.ffn_size(swiglu, 6) == 12


@pytest.mark.parametrize(("expert", "reason"), [
    (nn.Linear(6, 6), "neither an nn.Sequential of three modules nor a module with esp_partition"),
    (nn.Sequential(nn.Linear(6, 12), nn.Softmax(-1), nn.Linear(12, 6)), "Softmax is not one of"),
    (nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 5)), "do not form M->H->M"),
    (nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 6)),
     r"parameter 0.weight of shape \(10, 6\) does not split into 4 equal blocks along dim 0"),
    (SwiGLU(6, 10), r"parameter w1.weight of shape \(10, 6\) does not split into 4"),
])
def test_unsupported_experts_are_refused_with_esp(expert, reason):
    with pytest.raises(ValueError, match=reason):
        experts.check_shardable(expert, 4)
    experts.check_shardable(expert, 1)  # anything runs unsharded


def test_swiglu_refuses_a_non_elementwise_activation():
    with pytest.raises(ValueError, match="SwiGLU activation=Softmax must be one of the element-wise"):
        SwiGLU(6, 12, activation=nn.Softmax(-1))
