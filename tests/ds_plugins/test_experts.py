"""ESP sharding of a two-layer MLP: the shards' partial sums add up to the unsharded expert, gradients too."""

import pytest
import torch
from torch import nn

from ds_plugins import experts


def _mlp(m=6, h=12, act=None):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(m, h), act or nn.GELU(), nn.Linear(h, m))


@pytest.mark.parametrize("s", [1, 2, 3, 4])
def test_partial_sums_add_up_to_the_expert(s):
    full = [_mlp() for _ in range(2)]
    x = torch.randn(2, 5, 6, requires_grad=True)
    want = torch.stack([f(x[e]) for e, f in enumerate(full)])
    want.square().sum().backward()
    got, xs = 0, []
    shards = []
    for q in range(s):
        mods = nn.ModuleList(_mlp() for _ in range(2))
        for mod in mods:
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
    h = 12 // s
    for e in range(2):
        for q, mods in enumerate(shards):
            rows = slice(q * h, (q + 1) * h)
            torch.testing.assert_close(mods[e][0].weight.grad, full[e][0].weight.grad[rows])
            torch.testing.assert_close(mods[e][2].weight.grad, full[e][2].weight.grad[:, rows])
            torch.testing.assert_close(mods[e][2].bias.grad, full[e][2].bias.grad)  # every copy: full grad
    torch.testing.assert_close(sum(xq.grad for xq in xs), x.grad)


def test_shard_keeps_parameter_objects_and_tags_them():
    mod = _mlp()
    w1, b2 = mod[0].weight, mod[2].bias
    experts.shard_(mod, 1, 2)
    assert mod[0].weight is w1 and w1.shape == (6, 6) and mod[2].bias is b2 and b2.shape == (6,)
    assert w1.tensor_model_parallel and w1.partition_dim == 0 and mod[2].weight.partition_dim == 1


@pytest.mark.parametrize(("expert", "reason"), [
    (nn.Linear(6, 6), "not an nn.Sequential of three modules"),
    (nn.Sequential(nn.Linear(6, 12), nn.Softmax(-1), nn.Linear(12, 6)), "Softmax is not one of"),
    (nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 5)), "do not form M->H->M"),
    (nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 6)), "FFN size 10 is not divisible by the ESP"),
])
def test_unsupported_experts_are_refused_with_esp(expert, reason):
    with pytest.raises(ValueError, match=reason):
        experts.check_shardable(expert, 4)
    experts.check_shardable(expert, 1)  # anything runs unsharded
