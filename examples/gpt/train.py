"""One run of the job: build the model, train it with DeepSpeed, evaluate, time, count bytes, sample.

Every rank runs :func:`train`; the result it returns on every rank is the world's: losses averaged
over the ranks' tokens, step times the slowest rank's, bytes per step the mean over ranks of what a
rank sent, per collective kind (commweave.ledger for commweave's own collectives, and
``commweave.comm.trace_torch_distributed`` for DeepSpeed's: its MoE, its gradient reduction, ZeRO).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from dataclasses import dataclass, field

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE

import ds_plugins
from commweave import comm, ledger
from examples.gpt import data
from examples.gpt.layout import expert_parallel_rank, name_deepspeed_groups
from examples.gpt.model import ByteGPT, init_weights


@dataclass
class Result:
    name: str
    losses: list[float] = field(default_factory=list)       # mean train cross entropy per step
    evals: list[tuple[int, float]] = field(default_factory=list)   # (steps done, held-out loss), from 0
    step_ms: list[float] = field(default_factory=list)      # slowest rank, per timed step
    sent: dict[str, float] = field(default_factory=dict)    # kind -> bytes per step per rank (mean)
    sent_by_group: dict[str, float] = field(default_factory=dict)   # "kind@group" -> same
    schedules: list[str] = field(default_factory=list)      # what each MoE layer ran
    tokens_per_step: int = 0
    sample: bytes = b""

    @property
    def ms_per_step(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / (self.ms_per_step / 1e3)


@contextlib.contextmanager
def counted(book: ledger.Ledger):
    """Count every collective into ``book``: commweave's through the ledger, DeepSpeed's by tracing
    torch.distributed (DeepSpeed's comm backend caches its all-gather and reduce-scatter functions at
    init, so they are re-read from the traced module for the duration)."""
    backend = deepspeed.comm.comm.cdb
    cached = backend.all_gather_function, backend.reduce_scatter_function
    with ledger.recording(book), comm.trace_torch_distributed():
        backend.all_gather_function = backend.get_all_gather_function()
        backend.reduce_scatter_function = backend.get_reduce_scatter_function()
        try:
            yield book
        finally:
            backend.all_gather_function, backend.reduce_scatter_function = cached


@contextlib.contextmanager
def no_grad_eval(engine):
    """``engine.eval()`` under ``torch.no_grad()``, back to training mode afterwards."""
    engine.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        engine.train()


def _world_mean(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    comm.all_reduce(t, dist.group.WORLD)
    return (t / dist.get_world_size()).tolist()


class Job:
    """What both runs share: the arguments, the corpus, the held-out set, the groups."""

    def __init__(self, args, corpus: data.Corpus, mpu) -> None:
        self.args, self.corpus, self.mpu = args, corpus, mpu
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.eval_set = data.eval_batches(corpus, args.eval_batches, args.batch, args.seq, args.seed)

    def build(self, team_size: int) -> ByteGPT:
        a = self.args
        torch.manual_seed(a.seed)
        model = ByteGPT(layers=a.layers, hidden=a.hidden, heads=a.heads, ffn=a.ffn, experts=a.experts,
                        ep=a.ep, k=a.k, capacity_factor=a.capacity_factor, seq=a.seq,
                        aux_loss_coef=a.aux_loss_coef, cp_group=self.mpu.cp_group, team_size=team_size,
                        mp_group=self.mpu.get_tensor_model_parallel_group())
        init_weights(model, a.seed, expert_parallel_rank(a.tp, a.ep) * a.experts // a.ep)
        return model

    def batch(self, window: torch.Tensor, device):
        tokens, targets, positions = data.shard(window, self.world, self.rank)
        return tokens.to(device), positions.to(device), targets.to(device)

    def evaluate(self, engine) -> float:
        with no_grad_eval(engine):
            ce = [engine(*self.batch(w, engine.device))[1].item() for w in self.eval_set]
        return _world_mean([statistics.fmean(ce)], engine.device)[0]

    def sample(self, engine, count: int) -> bytes:
        """``count`` bytes sampled (temperature 0.8) after a held-out prompt, one distributed forward each:
        the last position is in chunk 2P-1, which zigzag gives to rank 0; rank 0 broadcasts the byte."""
        window = self.eval_set[0][0, : self.args.seq].clone()
        g = torch.Generator().manual_seed(self.args.seed)
        out = []
        with no_grad_eval(engine):
            for _ in range(count):
                padded = torch.cat([window, window[-1:]])[None]     # a dummy target for the last byte
                tokens, _, positions = data.shard(padded, self.world, self.rank)
                logits = engine.module.logits(tokens.to(engine.device), positions.to(engine.device))
                byte = torch.zeros(1, dtype=torch.long, device=engine.device)
                if self.rank == 0:
                    probs = torch.softmax(logits[-1, 0].float().cpu() / 0.8, dim=-1)
                    byte[0] = torch.multinomial(probs, 1, generator=g).item()
                comm.broadcast(byte, 0, dist.group.WORLD)
                out.append(int(byte.item()))
                window = torch.cat([window[1:], byte.cpu()])
        return bytes(out)

    def train(self, name: str, ds_config: dict, team_size: int, progress=None) -> Result:
        a = self.args
        engine, *_ = ds_plugins.initialize(model=(model := self.build(team_size)),
                                           model_parameters=model.parameters(), mpu=self.mpu,
                                           config=copy.deepcopy(ds_config))
        name_deepspeed_groups(engine)
        res = Result(name, tokens_per_step=a.batch * a.seq)
        book, local_ms = ledger.Ledger(), []
        res.evals.append((0, self.evaluate(engine)))
        for step in range(a.steps):
            inputs = self.batch(data.train_batch(self.corpus, step, a.batch, a.seq, a.seed), engine.device)
            timed = step >= a.warmup_steps
            start = time.perf_counter()
            with counted(book if timed else ledger.Ledger()):
                loss, ce, _ = engine(*inputs)
                engine.backward(loss)
                engine.step()
            deepspeed.get_accelerator().synchronize()
            if timed:
                local_ms.append((time.perf_counter() - start) * 1e3)
            res.losses.append(_world_mean([ce.item()], engine.device)[0])
            if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
                res.evals.append((step + 1, self.evaluate(engine)))
            if progress is not None:
                progress.set_postfix(loss=f"{res.losses[-1]:.3f}", held_out=f"{res.evals[-1][1]:.3f}")
                progress.update(1)
        # Parm's layers name the schedule they ran (its "deepspeed" order included); stock MoE says so
        res.schedules = [f"parm:{m.last_schedule}" if getattr(m, "last_schedule", None) else "deepspeed-moe"
                         for m in engine.module.modules() if isinstance(m, MoE)]
        res.sample = self.sample(engine, a.sample_bytes)
        self._gather_timing(res, local_ms, book, a.steps - a.warmup_steps, engine.device)
        return res

    def _gather_timing(self, res: Result, local_ms: list[float], book: ledger.Ledger, steps: int,
                       device) -> None:
        mine = torch.tensor(local_ms, dtype=torch.float64, device=device)
        every_ms = mine.new_empty(self.world * len(local_ms))
        comm.all_gather(every_ms, mine, dist.group.WORLD)
        res.step_ms = every_ms.view(self.world, -1).amax(0).tolist()   # the slowest rank, step by step
        books = [None] * self.world   # small dicts of report metadata
        dist.all_gather_object(books, book.as_dict())
        for entries in books:
            for key, entry in entries.items():
                per_step = entry["sent"] / steps / self.world
                if not per_step:
                    continue
                res.sent_by_group[key] = res.sent_by_group.get(key, 0.0) + per_step
                kind = key.split("@")[0]
                res.sent[kind] = res.sent.get(kind, 0.0) + per_step
