"""ATLAS and BubbleTea: the deepspeed launcher patch for training across data centers."""
