"""BubbleTea: prefill inference in the bubbles of pipeline training (atlas.md §1.8).

- :mod:`.timeline`  bubble extraction: an iteration's ops per GPU -> idle windows (simulated or real)
- :mod:`.packer`    chunked prefill packed into the windows: earliest fit, guard band
- :mod:`.model`     the inference model interface (ModelSpec, PrefillModel) and a small causal LM with
                    exact chunked prefill into a KV cache
- :mod:`.server`    a rank's prefill service as the training process sees it: submit, windows, results
- :mod:`.service`   the service itself: queue, model, cost model, packer, window rule, memory cap; its CPU
                    runner, a SCHED_IDLE process
- :mod:`.device`    devices, the low-priority stream, the memory cap, the in-process stream runner
- :mod:`.engine`    the DeepSpeed PipelineEngine extension (``enable(engine, server)``)
- :mod:`.simulate`  BubbleTea in the what-if simulator (``python -m launch.plan TOPOLOGY --bubbletea``)
- :mod:`.hf`        Hugging Face causal LMs from a local directory; results carry a ``DynamicCache``
- :mod:`.endpoint`  requests from outside: an HTTP endpoint (aiohttp) on a data center's first rank
- :mod:`.remote`    another rank of the data center behind the first rank's endpoint

The engine extension imports DeepSpeed; import it as ``launch.bubbletea.engine`` where DeepSpeed exists,
and ``launch.bubbletea.hf`` where ``transformers`` is (``pip install commweave[bubbletea]``).
"""

from launch.bubbletea.model import CausalLM, KVCache, LMConfig, ModelSpec, PrefillModel, Weights
from launch.bubbletea.packer import Chunk, Packing, Placement, Request, check_placements, pack
from launch.bubbletea.server import PrefillResult, PrefillServer
from launch.bubbletea.simulate import BubbleTeaEstimate, InferenceSpec, simulate_bubbletea
from launch.bubbletea.timeline import Op, Window, extract_windows, from_simulation, utilisation

__all__ = ["BubbleTeaEstimate", "CausalLM", "Chunk", "InferenceSpec", "KVCache", "LMConfig", "ModelSpec",
           "Op", "Packing", "Placement", "PrefillModel", "PrefillResult", "PrefillServer", "Request",
           "Weights",
           "Window", "check_placements", "extract_windows", "from_simulation", "pack", "simulate_bubbletea",
           "utilisation"]
