"""commweave's shared core: the collective wrapper with its byte ledger, and the alpha-beta cost model.

Feature code lives in ds_plugins (Parm), megatron_patches (WallFacer) and launch (ATLAS, BubbleTea).
"""

__version__ = "0.1.0"
