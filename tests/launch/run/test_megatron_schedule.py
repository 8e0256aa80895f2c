"""megatron-core's own pipeline schedule (``forward_backward_pipelining_without_interleaving``, 1F1B)
with ``atlas.enable_megatron(plan)`` on CPU ranks: pp = 2 stages in two data centers, dp = 2 replicas
taking turns on the WAN, two SGD steps; the losses equal the run without ATLAS exactly, and the
activations and gradients went over ATLAS's WAN groups (batched and unbatched p2p)."""

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from commweave import comm
from commweave.ledger import recording
from launch.run.runtime import enable_megatron
from tests.launch.plans import two_dc_plan

LO = {"GLOO_SOCKET_IFNAME": "lo"}
SEQ, MICRO_BATCH, HIDDEN, MICRO_BATCHES, STEPS, LR = 8, 2, 16, 4, 2, 0.5


@contextmanager
def _megatron_on_cpu():
    """Test shim: megatron-core 0.16.1's p2p allocates receive buffers on ``torch.cuda.current_device()``,
    its schedule counts tokens in a ``device="cuda"`` tensor and synchronises CUDA after batched p2p;
    on a CPU build of torch these go to the CPU and the synchronisation does nothing."""
    from megatron.core.pipeline_parallel import schedules

    def zeros(*args, device=None, **kw):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kw)

    saved = (torch.cuda.current_device, torch.cuda.synchronize, schedules.torch)
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    schedules.torch = SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    schedules.torch.zeros = zeros
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize, schedules.torch = saved


class _Stage(torch.nn.Module):
    """One pipeline stage: stage 0 reads the data, stage 1 the tensor Megatron hands it."""

    def __init__(self, config, stage: int) -> None:
        from megatron.core.enums import ModelType

        super().__init__()
        self.config, self.stage, self.input_tensor = config, stage, None
        self.model_type = ModelType.encoder_or_decoder
        torch.manual_seed(100 + stage)
        self.layer = torch.nn.Linear(HIDDEN, HIDDEN)

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, x):
        return torch.tanh(self.layer(x if self.stage == 0 else self.input_tensor))


def _batches(step: int, replica: int):
    for m in range(MICRO_BATCHES):
        g = torch.Generator().manual_seed(1000 * step + 10 * replica + m)
        x = torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=g)
        yield x, torch.sin(x.flip(-1))


def _forward_step(data_iterator, model):
    x, y = next(data_iterator)

    def loss_func(output):
        loss = torch.nn.functional.mse_loss(output, y)
        return loss, {"loss": loss.detach().clone()}     # Megatron divides the loss in place

    return model(x), loss_func


def _train(batched: bool, atlas: bool) -> tuple[list[float], int, int]:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving
    from megatron.core.transformer import TransformerConfig

    plan = two_dc_plan(pp=2, tp=1, dp=2, connections=2, sharing="temporal")
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=1,
                               pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                               use_cpu_initialization=True, batch_p2p_comm=batched)
    stage, replica = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
    assert (stage, replica, 0) == plan.coord(dist.get_rank())          # Megatron's order is the plan's
    model = _Stage(config, stage)
    handle = enable_megatron(plan) if atlas else None
    losses = []
    with recording() as led:
        for step in range(STEPS):
            model.zero_grad()
            out = forward_backward_pipelining_without_interleaving(
                forward_step_func=_forward_step, data_iterator=_batches(step, replica), model=[model],
                num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
            for p in model.parameters():          # data-parallel average, then SGD
                comm.all_reduce(p.grad, ps.get_data_parallel_group(), op="avg")
                p.data.add_(p.grad, alpha=-LR)
            losses.append(sum(float(o["loss"]) for o in out) / MICRO_BATCHES if out else None)
    if handle is not None:
        handle.undo()
    ps.destroy_model_parallel()
    me = dist.get_rank()
    pair = f"atlas-wan({min(me, plan.rank(1 - stage, replica))},{max(me, plan.rank(1 - stage, replica))})"
    return losses, led.calls("send", pair), led.calls("send", f"atlas-token(stage{stage},tp0,"
                                                      f"{'fwd' if stage == 0 else 'bwd'})")


def _reference(lr: float = LR) -> list[list[float]]:
    """One process, the same two layers: each step, every replica's mean loss, then SGD on the gradient
    averaged over micro-batches (Megatron divides each loss by their number) and replicas."""
    layers = []
    for stage in range(2):
        torch.manual_seed(100 + stage)
        layers.append(torch.nn.Linear(HIDDEN, HIDDEN))
    out = [[], []]
    for step in range(STEPS):
        for p in (q for layer in layers for q in layer.parameters()):
            p.grad = None
        for replica in range(2):
            total = 0.0
            for x, y in _batches(step, replica):
                loss = torch.nn.functional.mse_loss(torch.tanh(layers[1](torch.tanh(layers[0](x)))), y)
                (loss / (2 * MICRO_BATCHES)).backward()
                total += float(loss.detach())
            out[replica].append(total / MICRO_BATCHES)
        with torch.no_grad():
            for p in (q for layer in layers for q in layer.parameters()):
                p.add_(p.grad, alpha=-lr)
    return out


def _with_and_without(batched):
    with _megatron_on_cpu():
        return _train(batched, atlas=False), _train(batched, atlas=True)


@pytest.mark.slow
@pytest.mark.world_size(4, env=LO)
@pytest.mark.parametrize("batched", [True, False], ids=["batch_p2p_comm", "p2p_ops"])
def test_megatron_1f1b_with_atlas_equals_without(world, batched):
    results = world.run(_with_and_without, batched)
    reference = _reference()
    assert reference[0][1] != pytest.approx(_reference(lr=0.0)[0][1], rel=1e-3)   # the SGD steps matter
    for rank, ((plain, plain_wan, _), (atlas, atlas_wan, tokens)) in enumerate(results):
        assert atlas == plain                            # exact: the same tensors, another route
        if rank >= 2:                                    # stage 1 (the last) reports the losses
            assert atlas == pytest.approx(reference[rank - 2], rel=1e-5, abs=1e-7)
        assert plain_wan == 0 and atlas_wan == STEPS * MICRO_BATCHES      # one send per micro-batch
        assert tokens == STEPS * MICRO_BATCHES                           # and each took its turn
