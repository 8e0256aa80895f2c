"""Parm for DeepSpeed: a drop-in MoE layer with dedicated MP+EP+ESP schedules, and fused dispatch/combine."""

from ds_plugins.config import ParmConfig
from ds_plugins.engine import initialize
from ds_plugins.groups import ModelParallelUnit
from ds_plugins.moe import ParmMoE

__all__ = ["ModelParallelUnit", "ParmConfig", "ParmMoE", "initialize"]
