"""Parm for DeepSpeed: a drop-in MoE layer with dedicated MP+EP+ESP schedules, and fused dispatch/combine.

Importing it makes a plain ``deepspeed.initialize`` with ``"parm": {"enabled": true}`` warn that Parm is
off (ds_plugins.engine.warn_if_parm_ignored): ``ds_plugins.initialize`` is the call that switches it on.
"""

from ds_plugins.config import ParmConfig
from ds_plugins.engine import initialize, install_plain_initialize_warning
from ds_plugins.groups import ModelParallelUnit
from ds_plugins.moe import ParmMoE

install_plain_initialize_warning()

__all__ = ["ModelParallelUnit", "ParmConfig", "ParmMoE", "initialize"]
