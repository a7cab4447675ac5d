"""Accelerator profiles: peak compute, memory bandwidth and size, interconnect.

Figures are the vendors' dense (no sparsity) peaks for one device; memory
sizes are what ``nvidia-smi`` reports as total, which is what vLLM's
``gpu_memory_utilization`` is a fraction of. ``cpu`` is not a table entry: it
is measured on the current machine (see ``calibrate``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from llmsched.core.errors import ConfigError
from llmsched.executor.platform import Platform
from llmsched.executor.sim.fitted_kernels import KERNEL_FITS

# What a profile file ``llmsched calibrate`` wrote says it is (see ``llmsched.sim.profile_file``).
PROFILE_FORMAT = "llmsched-hardware-profile/1"

log = logging.getLogger(__name__)
# Profile files already warned about: a run that loads one per scenario warns once.
_warned: set[str] = set()

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One accelerator as the cost model sees it (all rates per device)."""

    name: str
    description: str
    # Dense matmul peaks in FLOP/s; fp8 is None where the hardware has no fp8
    # tensor cores (fp8 weights then run as weight-only quantisation at bf16).
    peak_flops_bf16: float
    peak_flops_fp8: float | None
    mem_bandwidth: float  # bytes/s
    mem_capacity: float  # bytes
    # Per-device, per-direction interconnect bandwidth (NVLink) in bytes/s, and
    # the fixed cost of one collective (launch + synchronisation).
    link_bandwidth: float
    collective_latency_s: float
    # Host time per kernel launched outside a CUDA graph. The GPU profiles use
    # 5 us: a bare launch costs a few microseconds (NVIDIA's "Getting Started
    # with CUDA Graphs" blog times launch-bound kernels at that scale) and
    # vLLM's compiled eager path adds wrapper or dispatcher work on top; pure
    # PyTorch eager (vLLM's enforce_eager) costs more: vllm-omni PR #7881
    # measured ~2,700 eager launches taking 42-90 ms of host time, 15-33 us
    # each. 0 means not modelled: the cpu profile, JSON profiles without it.
    kernel_launch_s: float = 0.0
    # Batch limits a deployment defaults to; None: what vLLM 0.33 picks for
    # this device (by kind, name and memory, see engine/batch_defaults.py).
    default_max_num_batched_tokens: int | None = None
    default_max_num_seqs: int | None = None
    # False where the runtime has no CUDA graphs (the cpu profile runs plain
    # PyTorch eagerly): deployments then default to launching every step
    # eagerly, and the host cost is layer_overhead_s below.
    cuda_graphs: bool = True
    # Host time one decoder layer costs per step whatever the batch: Python
    # and operator dispatch of the layer's few dozen eager ops. A CPU pays it
    # on the same cores that do the math, so nothing hides it. 0 on GPUs,
    # whose host costs are the kernel launches above.
    layer_overhead_s: float = 0.0
    # Steps of at most this many tokens have their weight GEMMs' time inside
    # layer_overhead_s rather than added to it (measured on a CPU, see
    # CostModel._layer_overhead); 0: never.
    layer_overhead_covers_tokens: int = 0
    # Whether the engine thread's host path (step_overhead_s,
    # request_overhead_s) runs beside the model under async scheduling.
    # False on a CPU whose model threads take every core: the next step's
    # host work then waits for the forward to leave a core free.
    host_overlaps_model: bool = True
    # Host time of one step outside the layers whatever the batch: building
    # the step's input tensors and attention metadata, launching the
    # sampler, turning its output into token lists. None: the deployment's
    # default (0.5 ms, vLLM with CUDA graphs); the cpu profile measures it.
    step_overhead_s: float | None = None
    # Host time per request scheduled in a step: its row of the inputs and
    # block table, its sampling state, its output list. A CPU pays it on
    # the cores that do the math; 0 on GPUs, where it overlaps the kernels.
    request_overhead_s: float = 0.0
    # Bytes/s at which decode attention streams the cached KV. None: the
    # memory bandwidth at the memory efficiency (GPU paged-attention kernels
    # stream at close to HBM speed); a CPU's eager gather-then-matmul
    # attention reaches a measured fraction of it.
    decode_kv_bandwidth: float | None = None
    # Default efficiencies measured for this device (Efficiency field
    # names); keys not given keep Efficiency's defaults.
    efficiency: dict | None = None
    # Kernel efficiencies and floors fitted to measured operator timings
    # (KernelFit fields, see kernel_fit.py); None: the plain roofline.
    kernel_fit: dict | None = None
    # Measured efficiencies that follow the work's size, for the plain
    # roofline (a CPU's oneDNN GEMMs reach 0.65 of the matmul peak at 64
    # rows and 0.9 at 2048; its prefill attention kernel 0.6 at
    # 256-token prompts and 0.9 at 4096): ``{"gemm": [[rows, eff], ...],
    # "attention": [[keys per query token, eff], ...]}``, interpolated in
    # log2 between points and flat beyond them. A kind given here replaces
    # ``efficiency``'s constant for the dense linears and LM head (gemm) or
    # for prefill attention; None: the constants.
    efficiency_curves: dict | None = None

    def gemm_peak(self, fp8: bool) -> float:
        """Matmul peak for bf16, or fp8 when the weights are fp8 and the device has fp8 units."""
        if fp8 and self.peak_flops_fp8:
            return self.peak_flops_fp8
        return self.peak_flops_bf16

    def platform(self, world_size: int = 1) -> Platform:
        """The platform vLLM's default batch limits are chosen for."""
        if self.name == "cpu":
            return Platform("cpu", world_size=world_size)
        return Platform(
            "cuda", f"{self.name} {self.description}", int(self.mem_capacity), world_size=world_size
        )

    def to_dict(self) -> dict:
        """Plain-dict form (for reports and JSON profiles)."""
        return asdict(self)


BUILTIN_HARDWARE: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(
        name="h100",
        description="NVIDIA H100 SXM 80GB (HBM3, NVLink 4)",
        peak_flops_bf16=989.4e12,
        peak_flops_fp8=1978.9e12,
        mem_bandwidth=3.35e12,
        mem_capacity=81559 * MiB,
        link_bandwidth=450e9,
        collective_latency_s=8e-6,
        kernel_launch_s=5e-6,
        kernel_fit=KERNEL_FITS["h100"],
    ),
    "h200": HardwareProfile(
        name="h200",
        description="NVIDIA H200 SXM 141GB (HBM3e, NVLink 4)",
        peak_flops_bf16=989.4e12,
        peak_flops_fp8=1978.9e12,
        mem_bandwidth=4.8e12,
        mem_capacity=143771 * MiB,
        link_bandwidth=450e9,
        collective_latency_s=8e-6,
        kernel_launch_s=5e-6,
    ),
    "a100": HardwareProfile(
        name="a100",
        description="NVIDIA A100 SXM 80GB (HBM2e, NVLink 3)",
        peak_flops_bf16=312e12,
        peak_flops_fp8=None,
        mem_bandwidth=2.039e12,
        mem_capacity=81920 * MiB,
        link_bandwidth=300e9,
        collective_latency_s=10e-6,
        kernel_launch_s=5e-6,
        kernel_fit=KERNEL_FITS["a100"],
    ),
    "b200": HardwareProfile(
        name="b200",
        description="NVIDIA B200 180GB (HBM3e, NVLink 5)",
        peak_flops_bf16=2250e12,
        peak_flops_fp8=4500e12,
        mem_bandwidth=8.0e12,
        mem_capacity=183359 * MiB,
        link_bandwidth=900e9,
        collective_latency_s=6e-6,
        kernel_launch_s=5e-6,
    ),
}

# The spec-sheet roofline without the measured-kernel fit: what the a100 and
# h100 profiles priced before it (comparisons, and tests that pin those figures).
for _name in ("a100", "h100"):
    BUILTIN_HARDWARE[f"{_name}-roofline"] = replace(
        BUILTIN_HARDWARE[_name],
        name=f"{_name}-roofline",
        description=BUILTIN_HARDWARE[_name].description + ", plain roofline",
        kernel_fit=None,
    )

ALIASES = {
    "h100-sxm": "h100",
    "h100-80gb": "h100",
    "h200-sxm": "h200",
    "a100-80gb": "a100",
    "a100-sxm": "a100",
    "b200-180gb": "b200",
}


def known_hardware() -> list[str]:
    """Names accepted by ``load_hardware`` (a JSON profile path is accepted too)."""
    return sorted([*BUILTIN_HARDWARE, "cpu"])


def hardware_from_dict(data: dict, source: str = "profile") -> HardwareProfile:
    """A profile from a dict with HardwareProfile's field names; names what is missing."""
    names = {f.name for f in fields(HardwareProfile)}
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"{source}: unknown hardware fields {sorted(unknown)}; known: {sorted(names)}")
    required = {
        "peak_flops_bf16",
        "mem_bandwidth",
        "mem_capacity",
        "link_bandwidth",
        "collective_latency_s",
    }
    missing = required - set(data)
    if missing:
        raise ConfigError(f"{source}: missing hardware fields {sorted(missing)}")
    data = {"name": source, "description": source, "peak_flops_fp8": None, **data}
    for key in ("peak_flops_bf16", "mem_bandwidth", "mem_capacity", "link_bandwidth"):
        if not isinstance(data[key], (int, float)) or data[key] <= 0:
            raise ConfigError(f"{source}: {key}={data[key]!r} must be a positive number")
    for key in ("kernel_launch_s", "layer_overhead_s", "step_overhead_s", "request_overhead_s"):
        v = data.get(key, 0.0)
        if v is None and key == "step_overhead_s":
            continue
        if not isinstance(v, (int, float)) or v < 0:
            raise ConfigError(f"{source}: {key}={v!r} must be a number >= 0")
    kv_bw = data.get("decode_kv_bandwidth")
    if kv_bw is not None and (not isinstance(kv_bw, (int, float)) or kv_bw <= 0):
        raise ConfigError(f"{source}: decode_kv_bandwidth={kv_bw!r} must be a positive number")
    if not isinstance(data.get("host_overlaps_model", True), bool):
        raise ConfigError(f"{source}: host_overlaps_model must be true or false")
    covers = data.get("layer_overhead_covers_tokens", 0)
    if isinstance(covers, bool) or not isinstance(covers, int) or covers < 0:
        raise ConfigError(f"{source}: layer_overhead_covers_tokens={covers!r} must be an integer >= 0")
    kfit = data.get("kernel_fit")
    if kfit is not None:
        if not isinstance(kfit, dict):
            raise ConfigError(f"{source}: kernel_fit must be an object of KernelFit fields")
        from llmsched.executor.sim.kernel_fit import KernelFit

        KernelFit.from_dict(kfit)  # names what is wrong
    eff = data.get("efficiency")
    if eff is not None and not isinstance(eff, dict):
        raise ConfigError(f"{source}: efficiency must be an object of Efficiency fields")
    check_efficiency_curves(data.get("efficiency_curves"), source)
    return HardwareProfile(**data)


EFFICIENCY_CURVE_KINDS = ("gemm", "attention")


def check_efficiency_curves(curves: object, source: str) -> None:
    """Raise ConfigError naming what is wrong with an ``efficiency_curves`` value (None is fine)."""
    if curves is None:
        return
    what = f"{source}: efficiency_curves"
    if not isinstance(curves, dict):
        raise ConfigError(f"{what} must be an object of kind -> [[size, efficiency], ...]")
    unknown = set(curves) - set(EFFICIENCY_CURVE_KINDS)
    if unknown:
        known = ", ".join(EFFICIENCY_CURVE_KINDS)
        raise ConfigError(f"{what} kinds {sorted(unknown)} unknown; known: {known}")
    for kind, points in curves.items():
        ok = isinstance(points, (list, tuple)) and points
        ok = ok and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, (int, float)) for v in p)
            for p in points
        )
        if not ok:
            raise ConfigError(f"{what}[{kind!r}] must be a non-empty list of [size, efficiency]")
        sizes = [p[0] for p in points]
        if any(x <= 0 for x in sizes) or sizes != sorted(set(sizes)):
            raise ConfigError(f"{what}[{kind!r}] sizes {sizes} must be positive and increasing")
        if any(not 0.0 < p[1] <= 1.0 for p in points):
            raise ConfigError(f"{what}[{kind!r}] efficiencies must be in (0, 1]")


def is_profile_file(data: object) -> bool:
    """Whether parsed JSON is a profile file (rather than bare HardwareProfile fields)."""
    return isinstance(data, dict) and data.get("format") == PROFILE_FORMAT


def profile_from_file_data(data: dict, source: str) -> HardwareProfile:
    """The profile of a parsed profile file, warning when its calibration did not settle."""
    hw = data.get("hardware")
    if not isinstance(hw, dict):
        raise ConfigError(f"{source}: a profile file needs a 'hardware' object")
    cal = data.get("calibration") or {}
    if cal.get("settled") is False and source not in _warned:
        _warned.add(source)
        log.warning("%s: calibrated unsettled: %s", source, "; ".join(cal.get("problems", [])))
    return hardware_from_dict(hw, source=source)


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A built-in profile by name or a JSON file (a calibrated profile file or bare fields).

    ``cpu``, this machine measured, is the simulator's: ``llmsched.sim.load_hardware``.
    """
    key = name_or_path.strip().lower()
    key = ALIASES.get(key, key)
    if key in BUILTIN_HARDWARE:
        return BUILTIN_HARDWARE[key]
    if key == "cpu":
        raise ConfigError(
            "hardware 'cpu' is measured on this machine by the simulator's calibration: "
            "load it with llmsched.sim.load_hardware"
        )
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"hardware profile {str(path)!r} is not valid JSON: {e}") from e
        if is_profile_file(data):
            return profile_from_file_data(data, source=path.stem)
        return hardware_from_dict(data, source=path.stem)
    raise ConfigError(
        f"unknown hardware {name_or_path!r}; known: {', '.join(known_hardware())} "
        "(or a JSON file: one `llmsched calibrate` wrote, or HardwareProfile fields)"
    )


def with_overrides(hw: HardwareProfile, **overrides: float) -> HardwareProfile:
    """A copy of ``hw`` with some figures replaced (what-if studies)."""
    return replace(hw, **overrides)
