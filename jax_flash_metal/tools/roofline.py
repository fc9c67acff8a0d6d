"""Roofline model of Apple GPUs for the kernel profile (``python -m jax_flash_metal.profile``).

This is a model, not a measurement: a launch's time is modelled as the largest of its compute
time (executed matmul FLOPs at peak FLOP/s), its device-memory time (device bytes at DRAM
bandwidth) and its threadgroup-memory time (threadgroup bytes at the threadgroup bandwidth of the
cores it can occupy). It ignores latency, occupancy, caches (device bytes are counted as if every
access went to DRAM, so re-read K/V rows that a real GPU serves from cache make the device figure
an upper bound), launch overhead, and non-matmul instructions (exp2, max, shuffles).

Figures per GPU (largest configuration of each chip), with their sources:

- Cores and GPU clock: philipturner/applegpuinfo reports (M1, M1 Max, M2 Max: "applegpuinfo
  #11, #2, #10" are github.com/philipturner/applegpuinfo/issues/11, /2, /10), hmc-tech.com GPU
  pages (M3 Max 40-core 1398 MHz, M4 10-core 1470 MHz, M4 Max 1678 MHz) and Apple's announcements
  for core counts.
- Peak FP32 FLOP/s = cores x 128 ALUs x 2 (FMA) x clock (the 128 FP32 ALUs per core of
  github.com/philipturner/metal-benchmarks, "Layout of a GPU core"). This reproduces the published
  figures: 2.617 TFLOPS M1 and 10.617 TFLOPS M1 Max (applegpuinfo), 13.6 TFLOPS M2 Max
  (applegpuinfo #10), 14.32 TFLOPS 40-core M3 Max and 3.76 TFLOPS M4 (hmc-tech.com). M4 Max:
  40 x 128 x 2 x 1.678 GHz, derived (no published figure for the 40-core part).
- Peak FP16 FLOP/s equals FP32 on M1 and later (metal-benchmarks overview table, "GFLOPS F16" =
  "GFLOPS F32"; hmc-tech.com lists equal FP16/FP32 for M3 and M4); simdgroup_matrix runs on the
  same ALUs, so the same peak applies to MMA.
- DRAM bandwidth: 68.25 GB/s M1 (LPDDR4X-4266, 128-bit; applegpuinfo #11 reports 68.3 GB/s),
  409.6 GB/s M1 Max and M2 Max (applegpuinfo #2, #10; Apple: "400GB/s"), 400 GB/s M3 Max and
  546 GB/s M4 Max (Apple, 30 Oct 2024 M4 Pro/Max announcement, as reported by macmegasite.com),
  120 GB/s M4 (Apple, 7 May 2024 M4 announcement, as reported by fonearena.com).
- On-chip memory per core (occupancy, ``occupancy``): metal-benchmarks "On-Chip Memory" table,
  Apple 7 and 8 (M1, M2): threadgroup ("Shared") memory ~52-60 KB (the lower bound, 52 KiB, is
  used), register file ~208 KB, at most 3072 threads. Apple 9 and later (M3, M4) allocate
  on-chip memory dynamically ("Dynamic Caching"); no per-core figure is published, so the
  Apple 7/8 figures are assumed there. One threadgroup may allocate at most 32 KiB (Apple's
  Metal Feature Set Tables, "Maximum total threadgroup memory allocation"). ALU use saturates at
  24 simdgroups per core (metal-benchmarks, "ALU Bottlenecks").
- Threadgroup-memory bandwidth per core: not published by Apple. Derived as 64 bytes per core per
  clock (metal-benchmarks "On-Chip Memory" table, "Shared BW/Cycle" = 64 B for Apple 7 and 8,
  i.e. M1 and M2) times the clock. For M3 and M4 (Apple 9 and later, not measured there) the same
  64 B/cycle is assumed, following the metal-benchmarks author's statement that per-core-cycle
  bandwidth ratios are the same across Apple GPU generations
  (github.com/philipturner/metal-flash-attention/issues/12).
"""

from __future__ import annotations

import dataclasses

THREADGROUP_BYTES_PER_CORE_CYCLE = 64  # metal-benchmarks "Shared BW/Cycle", Apple 7/8 (derived)
FP32_FLOPS_PER_CORE_CYCLE = 128 * 2    # 128 ALUs per core, one FMA (2 FLOPs) each per cycle
# On-chip memory per core, metal-benchmarks "On-Chip Memory" (Apple 7/8; assumed for Apple 9+).
APPLE7_THREADGROUP_MEMORY_PER_CORE = 52 * 1024  # "Shared Memory ~52-60 KB": the lower bound
APPLE7_REGISTER_FILE_PER_CORE = 208 * 1024      # "Register File ~208 KB"
APPLE7_MAX_THREADS_PER_CORE = 3072              # "Max Threads 384-3072"
SATURATING_SIMDGROUPS_PER_CORE = 24  # metal-benchmarks "ALU Bottlenecks": ALU use maxes out here
REGISTER_BUDGET = 128  # 32-bit registers per thread that still fit 24 simdgroups' worth (~208 KB)


@dataclasses.dataclass(frozen=True)
class Gpu:
    """Published (or derived, see the module docstring) figures of one Apple GPU."""

    name: str
    cores: int
    clock_ghz: float
    dram_gb_per_s: float  # DRAM (unified memory) bandwidth, GB/s (1e9 bytes)
    sources: str          # where cores, clock, peak and bandwidth come from
    threadgroup_memory_per_core: int = APPLE7_THREADGROUP_MEMORY_PER_CORE  # bytes
    register_file_per_core: int = APPLE7_REGISTER_FILE_PER_CORE            # bytes
    max_threads_per_core: int = APPLE7_MAX_THREADS_PER_CORE

    @property
    def peak_flops(self) -> float:
        """Peak FLOP/s for float32 and float16 alike (equal on M1 and later)."""
        return self.cores * FP32_FLOPS_PER_CORE_CYCLE * self.clock_ghz * 1e9

    @property
    def threadgroup_bytes_per_s_per_core(self) -> float:
        """Derived, not published: 64 B per core-cycle (module docstring)."""
        return THREADGROUP_BYTES_PER_CORE_CYCLE * self.clock_ghz * 1e9


_TG = "threadgroup bandwidth derived (metal-benchmarks Shared BW/Cycle)"
# name, cores, GPU clock (GHz), DRAM GB/s, sources of these figures and of the peak FLOP/s.
_TABLE = (
    ("M1", 8, 1.278, 68.25, "applegpuinfo #11 (8 cores, 1.278 GHz, 2.617 TFLOPS, 68.3 GB/s); "
     f"LPDDR4X-4266 x 128 bit = 68.25 GB/s; metal-benchmarks F16 = F32; {_TG}"),
    ("M1 Max", 32, 1.296, 409.6, "applegpuinfo #2 (32 cores, 1.296 GHz, 10.617 TFLOPS, "
     f"409.6 GB/s); metal-benchmarks overview (10620 GFLOPS F32 = F16); {_TG}"),
    ("M2 Max", 38, 1.398, 409.6, "applegpuinfo #10 (38 cores, 1.398 GHz, 13.6 TFLOPS, "
     f"409.6 GB/s); metal-benchmarks overview (>= 13600 GFLOPS F32 = F16); {_TG}"),
    ("M3 Max", 40, 1.398, 400.0, "hmc-tech.com 40-core M3 Max (1398 MHz, 14.32 TFLOPS FP32 = "
     f"FP16); Apple 400 GB/s (macmegasite.com 2024-10-30); {_TG} (assumed)"),
    ("M4", 10, 1.470, 120.0, "hmc-tech.com 10-core M4 (1470 MHz, 3.76 TFLOPS FP32 = FP16); "
     f"Apple 120 GB/s (fonearena.com 2024-05); {_TG} (assumed)"),
    ("M4 Max", 40, 1.678, 546.0, "Apple 40 cores, 546 GB/s (macmegasite.com 2024-10-30); "
     f"hmc-tech.com M4 Max 1678 MHz; peak derived 40 x 256 x 1.678 GHz; {_TG} (assumed)"),
)
GPUS = {row[0]: Gpu(*row) for row in _TABLE}


def model_launch(gpu: Gpu, *, executed_flops: float, useful_flops: float, device_bytes: float,
                 threadgroup_bytes: float, threadgroups: int) -> dict:
    """Modelled bound, time and percent of peak of one kernel launch on ``gpu``.

    executed_flops: matmul FLOPs the launch performs (MMA plus scalar fma FLOPs);
    useful_flops: the analytic FLOPs of the launch's share of attention; device_bytes and
    threadgroup_bytes: bytes read plus written; threadgroups: launched threadgroups (a launch
    with fewer threadgroups than cores leaves cores idle: compute and threadgroup bandwidth
    scale with min(threadgroups, cores)).
    Returns {"bound": "compute" | "device" | "threadgroup", "seconds": float,
    "percent_of_peak": useful FLOP/s over peak FLOP/s, in percent}.
    """
    active = min(max(threadgroups, 1), gpu.cores) / gpu.cores
    times = {
        "compute": executed_flops / (gpu.peak_flops * active),
        "device": device_bytes / (gpu.dram_gb_per_s * 1e9),
        "threadgroup": threadgroup_bytes / (gpu.threadgroup_bytes_per_s_per_core * gpu.cores
                                            * active),
    }
    bound = max(times, key=lambda name: times[name])
    seconds = times[bound]
    percent = 100.0 * useful_flops / seconds / gpu.peak_flops if seconds > 0 else 0.0
    return {"bound": bound, "seconds": seconds, "percent_of_peak": percent}


def occupancy(gpu: Gpu, *, threadgroup_bytes: int, threads_per_threadgroup: int,
              registers: int) -> dict:
    """Threadgroups and simdgroups of one kernel that fit on one core of ``gpu`` at once (a
    model, not a measurement).

    threadgroup_bytes: static threadgroup memory of one threadgroup; registers: estimated live
    32-bit registers per thread (``_ext.tile_shape(...)["registers"]``). A core holds as many
    threadgroups as its threadgroup memory, its thread limit and its register file all allow.
    Returns {"threadgroups": n, "simdgroups": n * simdgroups per threadgroup, "limit": "memory" |
    "threads" | "registers" (the binding one)}.
    """
    threads = max(threads_per_threadgroup, 1)
    limits = {
        "memory": (gpu.threadgroup_memory_per_core // threadgroup_bytes if threadgroup_bytes
                   else gpu.max_threads_per_core),
        "threads": gpu.max_threads_per_core // threads,
        "registers": gpu.register_file_per_core // (4 * max(registers, 1) * threads),
    }
    limit = min(limits, key=lambda name: limits[name])
    groups = limits[limit]
    return {"threadgroups": groups, "simdgroups": groups * -(-threads // 32), "limit": limit}
