"""Parm for DeepSpeed: a drop-in MoE layer with dedicated MP+EP+ESP schedules, and fused dispatch/combine."""
