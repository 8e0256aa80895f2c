"""Megatron's parallel state for the rank-side cases, made once per (TP, CP) layout and world process.

``parallel_state.initialize_model_parallel`` makes every group of its layout on every rank (TP, CP, DP,
their products, embedding groups, gloo twins: ~25 at P = 8), and ``destroy_model_parallel`` forgets all
but four of them without destroying them. Made afresh per case, a world process held ~220 gloo groups
(448 gloo run-loop threads) by the end of tests/megatron_patches, and the group making itself (a store
round per group on every rank) was a large share of those cases' time.

:func:`initialize` makes a layout's groups on its first use in the process and keeps Megatron's module
state (its private upper-case globals); a later use of that layout puts the kept state back, so the case
runs over the same group objects it would have got, with no group made. :func:`release` puts back the
state from before :func:`initialize`, which is what ``destroy_model_parallel`` leaves (nothing
initialised), so code that checks ``model_parallel_is_initialized`` sees the same thing.
"""

from __future__ import annotations

_kept: dict[tuple[int, int], dict] = {}
_before: list[dict] = []


def _state(ps) -> dict:
    return {n: v for n, v in vars(ps).items()
            if n.startswith("_") and not n.startswith("__") and n.isupper()}


def initialize(tp: int, cp: int) -> None:
    """Megatron's parallel state for TP = ``tp`` and CP = ``cp`` (pipeline 1), on every rank."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized() or _before:
        raise RuntimeError("Megatron's parallel state is already initialised: release() it first")
    _before.append(_state(ps))
    if (tp, cp) in _kept:
        vars(ps).update(_kept[(tp, cp)])
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    _kept[(tp, cp)] = _state(ps)


def release() -> None:
    """Megatron's parallel state as before :func:`initialize` (its groups stay kept for the next use)."""
    from megatron.core import parallel_state as ps

    vars(ps).update(_before.pop())
