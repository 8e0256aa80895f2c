"""The wheels benchmarks/gpu_check.sh installs on the GPU machine, and a check that they resolve there.

The GPU machine (the device tool's kind nvidia-h200) has Python 3.12, torch 2.11+cu130, nvcc 13.0 and
pytest, reaches no package index, and lacks deepspeed and megatron-core. Their wheels and those of their
missing requirements travel in .whl/ (git-ignored), fetched on a networked machine by
benchmarks/fetch_gpu_wheels.sh::

    python -m benchmarks.gpu_wheels --list            # NAME==VERSION, one a line
    python -m benchmarks.gpu_wheels --check .whl      # the carried set resolves on the GPU image
    python -m benchmarks.gpu_wheels --check           # without wheels: from the local installs' metadata

A requirement is met by a carried wheel (its version inside the specifier) or by a package the image
already holds (device/KINDS.md lists names only, so those versions cannot be checked here). Every carried
wheel must install on CPython 3.12, manylinux x86_64, one version per name.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import Tag
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

# Pinned to what this project is tested against on CPU (deepspeed, megatron-core) and what those need
# beyond the image: pydantic's closure and hjson. deepspeed publishes an sdist only, so
# fetch_gpu_wheels.sh builds its pure-Python wheel locally.
WHEELS = {
    "deepspeed": "0.19.8",
    "megatron-core": "0.16.1",
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    "typing-extensions": "4.16.0",
    "hjson": "3.1.0",
}
ROOTS = ("deepspeed", "megatron-core")

# Python packages on the image 'cuda' (device/KINDS.md, read 2026-11-17), names only.
_IMAGE_NAMES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning
pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers
toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
"""
IMAGE = {canonicalize_name(n) for n in _IMAGE_NAMES.split()}

# Versions on the image where device/KINDS.md records them (a session's pip list, 2026-11).
IMAGE_VERSIONS = {"torch": "2.11.0", "numpy": "2.5.2", "triton": "3.6.0", "safetensors": "0.8.0",
                  "transformers": "5.17.0", "huggingface-hub": "1.33.0", "accelerate": "1.15.0"}

# The GPU machine's interpreter and platform, for markers and wheel tags.
TARGET_ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
              "implementation_name": "cpython", "platform_python_implementation": "CPython",
              "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
              "os_name": "posix"}
TARGET_TAGS = {Tag(interp, abi, plat)
               for interp, abis in (("cp312", ("cp312", "abi3", "none")), ("py3", ("none",)),
                                    ("py312", ("none",)), ("cp3", ("none",)))
               for abi in abis
               for plat in ["any", "linux_x86_64", "manylinux1_x86_64", "manylinux2010_x86_64",
                            "manylinux2014_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(5, 40))]}


def _requirements(requires_dist: list[str]) -> list[Requirement]:
    """The Requires-Dist entries that apply on the GPU machine (no extras)."""
    reqs = [Requirement(r) for r in requires_dist]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({**TARGET_ENV, "extra": ""})]


def _carried(whl_dir: Path) -> tuple[dict[str, tuple[Version, list[Requirement]]], list[str]]:
    problems, found = [], {}
    for path in sorted(whl_dir.glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(path.name)
        if not tags & TARGET_TAGS:
            problems.append(f"{path.name}: no tag installs on CPython 3.12 manylinux x86_64")
        if name in found:
            problems.append(f"two wheels of {name}: {found[name][0]} and {version} (pip stops on both)")
        with zipfile.ZipFile(path) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            message = Parser().parsestr(z.read(meta).decode(), headersonly=True)
            found[name] = (version, _requirements(message.get_all("Requires-Dist") or []))
    return found, problems


def _installed() -> tuple[dict[str, tuple[Version, list[Requirement]]], list[str]]:
    """The pinned distributions as installed here: their requirement graph stands in for the wheels'."""
    notes, found = [], {}
    for name, pin in WHEELS.items():
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            notes.append(f"{name} is not installed here: its requirements are not checked")
            continue
        if Version(dist.version) != Version(pin):
            notes.append(f"{name} {dist.version} is installed here, not {pin}: requirements read from "
                         f"{dist.version}")
        found[canonicalize_name(name)] = (Version(pin), _requirements(dist.requires or []))
    return found, notes


def check(whl_dir: Path | None) -> tuple[list[str], list[str]]:
    """(problems, notes): problems make the GPU install fail; notes say what could not be checked."""
    if whl_dir is not None:
        found, problems = _carried(whl_dir)
        notes = []
        for name, pin in WHEELS.items():
            have = found.get(canonicalize_name(name))
            if have is None:
                problems.append(f"{name}=={pin} is not in {whl_dir} (run benchmarks/fetch_gpu_wheels.sh)")
            elif have[0] != Version(pin):
                problems.append(f"{name} {have[0]} in {whl_dir}, the pin is {pin}")
        extra = set(found) - {canonicalize_name(n) for n in WHEELS}
        problems += [f"{name} in {whl_dir} is not in the pinned list" for name in sorted(extra)]
    else:
        found, notes = _installed()
        problems = []
    for name, (_, reqs) in sorted(found.items()):
        for req in reqs:
            dep = canonicalize_name(req.name)
            if dep in found:
                if not req.specifier.contains(found[dep][0], prereleases=True):
                    problems.append(f"{name} needs {req}, the carried {dep} is {found[dep][0]}")
            elif dep in IMAGE:
                known = IMAGE_VERSIONS.get(dep)
                if known is not None and not req.specifier.contains(Version(known), prereleases=True):
                    problems.append(f"{name} needs {req}, the image has {dep} {known}")
                elif known is None and req.specifier:
                    notes.append(f"{name} needs {req}: {dep} is on the image, version unrecorded")
            else:
                problems.append(f"{name} needs {req}: neither carried nor on the image")
    return problems, notes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_wheels", description=__doc__.split("\n")[0])
    p.add_argument("--list", action="store_true", help="print NAME==VERSION lines")
    p.add_argument("--check", nargs="?", const="", metavar="WHL_DIR",
                   help="check the carried wheels (or, with no folder, the local metadata)")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(f"{name}=={version}" for name, version in WHEELS.items()))
        return 0
    if args.check is None:
        p.error("give --list or --check")
    problems, notes = check(Path(args.check) if args.check else None)
    for note in notes:
        print(f"note: {note}")
    for problem in problems:
        print(f"problem: {problem}")
    print(f"{'FAIL' if problems else 'PASS'} gpu wheels: {len(problems)} problems, {len(notes)} notes")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
