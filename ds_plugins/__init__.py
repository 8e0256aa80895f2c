"""Parm for DeepSpeed: a drop-in MoE layer with dedicated MP+EP+ESP schedules, and fused dispatch/combine."""

from ds_plugins.config import ParmConfig
from ds_plugins.moe import ParmMoE

__all__ = ["ParmConfig", "ParmMoE"]
