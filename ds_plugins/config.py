"""ParmConfig: the top-level ``"parm"`` section of a DeepSpeed JSON config, parsed once and validated.

    {
      "train_micro_batch_size_per_gpu": 8,
      "parm": {"enabled": true, "schedule": "auto", "overlap_chunks": 4, "skip_empty_slots": true,
               "timeout_s": 120}
    }

DeepSpeed keeps unknown top-level sections verbatim (parm.md §5.7), so the same file configures both.
Unknown keys inside ``"parm"`` are rejected, as DeepSpeed rejects unknown keys in its own sections.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from commweave import values
from ds_plugins import cost_cache

SCHEDULES = ("auto", "s1", "s2", "deepspeed")
"""auto: pick S1 or S2 per layer shape with the alpha-beta model (parm.md §2.9);
s1: MP off before the gate, on after combine (§2.3); s2: MP off after the gate, on before combine (§2.4);
deepspeed: the DeepSpeed-MoE order Parm measured against (§2.1): duplicated gate and all-to-all on every
MP rank and an all-reduce inside the tensor-sharded expert."""


def check_schedule(schedule: Any) -> str:
    if schedule not in SCHEDULES:
        raise ValueError(f"parm schedule={schedule!r} is not one of {SCHEDULES}")
    return schedule


def check_overlap_chunks(chunks: Any) -> int:
    # at most int32: the count travels in the layer's agreement (_layout caps the chunks at the slots)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= values.INT32_MAX:
        raise ValueError(f"parm overlap_chunks={chunks!r} must be an integer >= 1 and <= {values.INT32_MAX} "
                         "(the number of pipeline chunks the all-to-all and the all-gather / reduce-scatter "
                         "are overlapped in)")
    return chunks


def check_cost_cache_type(path: Any) -> str | None:
    """The type rule, the same on every rank; the file system's rules are ds_plugins.cost_cache.check."""
    if path is not None and (not isinstance(path, str) or not path):
        raise ValueError(f"parm cost_cache={path!r} must be a file path (string) or null")
    return path


@dataclass(frozen=True, kw_only=True, slots=True)
class ParmConfig:
    """Options of the ``"parm"`` section; every field is optional."""

    enabled: bool = False
    """Replace every ``deepspeed.moe.layer.MoE`` by a ``ParmMoE`` in ``ds_plugins.initialize``."""
    schedule: str = "auto"
    """One of :data:`SCHEDULES`."""
    overlap_chunks: int = 4
    """Pipeline depth r of the chunked all-to-all / all-gather overlap (parm.md §2.6)."""
    skip_empty_slots: bool = True
    """Run the expert MLPs only on the capacity slots that hold a token (at most 1/capacity_factor of them)
    instead of all E·C slots, as DeepSpeed does; exact, for every schedule (ds_plugins.overlap)."""
    debug: bool = False
    """Check every S2 and "deepspeed" forward that routing is bit-identical across the MP ranks (one extra
    all-gather)."""
    cost_cache: str | None = None
    """JSON file the "auto" selector reads its fitted alpha-beta parameters from, or writes them to."""
    timeout_s: float | None = None
    """Bound in seconds on every wait of commweave's communication (``comm.set_timeout``): a dead or frozen
    rank becomes an error naming the operation after this long. None: ``COMMWEAVE_TIMEOUT_S``, else 300."""

    def __post_init__(self) -> None:
        # One rule per type, as JSON gives them: booleans only as true/false, numbers only as numbers
        # ("60" or "4" are refused for timeout_s and overlap_chunks alike), paths as strings.
        for name in ("enabled", "skip_empty_slots", "debug"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"parm {name}={getattr(self, name)!r} must be true or false")
        check_schedule(self.schedule)
        check_overlap_chunks(self.overlap_chunks)
        if check_cost_cache_type(self.cost_cache) is not None:
            cost_cache.check(self.cost_cache)
        if self.timeout_s is not None:
            values.seconds(self.timeout_s, "parm timeout_s", what="the communication timeout")

    def agreed_values(self) -> dict[str, int]:
        """The section as integers for ``comm.agree`` (the path by its CRC-32; the timeout is compared by
        every agreement already)."""
        return dict(enabled=int(self.enabled), schedule=SCHEDULES.index(self.schedule),
                    overlap_chunks=self.overlap_chunks, skip_empty_slots=int(self.skip_empty_slots),
                    debug=int(self.debug), cost_cache=path_id(self.cost_cache))

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> ParmConfig:
        if not isinstance(section, Mapping):
            raise ValueError(f'the "parm" section must be a JSON object, got {type(section).__name__}')
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(section) - set(known))
        if unknown:
            raise ValueError(f'unknown key(s) {unknown} in the "parm" section; allowed keys: {known}')
        return cls(**section)

    @classmethod
    def from_deepspeed(cls, config: Mapping[str, Any] | str | os.PathLike | None) -> ParmConfig:
        """Parse the ``"parm"`` section of a DeepSpeed config given as a dict or a JSON file path."""
        if config is None:
            return cls()
        if isinstance(config, str | os.PathLike):
            try:
                with open(config) as f:
                    config = json.load(f)
            except OSError as e:
                raise ValueError(f"DeepSpeed config file {str(config)!r} cannot be read: {e.strerror}") from e
            except json.JSONDecodeError as e:
                raise ValueError(f"DeepSpeed config file {str(config)!r} is not valid JSON: {e}") from e
        if not isinstance(config, Mapping):
            raise ValueError("DeepSpeed config must be a dict or a JSON file path, "
                             f"got {type(config).__name__}")
        return cls.from_dict(config.get("parm", {}))


def path_id(path: str | None) -> int:
    """A path as an integer the ranks can compare (0: none)."""
    return 0 if path is None else 1 + zlib.crc32(os.fsencode(path))
