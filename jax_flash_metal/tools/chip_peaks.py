"""Published peak figures of Apple-silicon GPUs, for the self-check's speed report.

``PEAKS`` maps a chip (the MTLDevice name without "Apple ") to (float32 TFLOP/s of its largest
GPU configuration or None where Apple published none, memory bandwidth in GB/s of that
configuration, source). Sources: Apple Newsroom announcements of each chip (M1: 10 Nov 2020;
M1 Pro and M1 Max: 18 Oct 2021; M1 Ultra: 8 Mar 2022; M2: 6 Jun 2022; M2 Pro and M2 Max:
17 Jan 2023; M2 Ultra: 5 Jun 2023; M3 family: 30 Oct 2023; M4: 7 May 2024; M4 Pro and M4 Max:
30 Oct 2024) and the Mac technical specifications pages for bandwidths. Apple quotes no
TFLOP/s for M3 and M4 chips. Binned parts (fewer GPU cores) get the figure scaled by their
share of cores; bandwidth is that of the largest configuration (some binned M3 Max and M4 Max
parts have less).
"""

from __future__ import annotations

PEAKS: dict[str, tuple[float | None, float, str]] = {
    "M1": (2.6, 68.25, "Apple Newsroom 2020-11-10"),
    "M1 Pro": (5.2, 200.0, "Apple Newsroom 2021-10-18"),
    "M1 Max": (10.4, 400.0, "Apple Newsroom 2021-10-18"),
    "M1 Ultra": (21.0, 800.0, "Apple Newsroom 2022-03-08"),
    "M2": (3.6, 100.0, "Apple Newsroom 2022-06-06"),
    "M2 Pro": (6.8, 200.0, "Apple Newsroom 2023-01-17"),
    "M2 Max": (13.6, 400.0, "Apple Newsroom 2023-01-17"),
    "M2 Ultra": (27.2, 800.0, "Apple Newsroom 2023-06-05"),
    "M3": (None, 100.0, "Apple Newsroom 2023-10-30"),
    "M3 Pro": (None, 150.0, "Apple Newsroom 2023-10-30"),
    "M3 Max": (None, 400.0, "Apple Newsroom 2023-10-30"),
    "M4": (None, 120.0, "Apple Newsroom 2024-05-07"),
    "M4 Pro": (None, 273.0, "Apple Newsroom 2024-10-30"),
    "M4 Max": (None, 546.0, "Apple Newsroom 2024-10-30"),
}


def peak(device_name: str, cores: int, max_cores: int) -> dict:
    """{chip, tflops (float32, or None), gb_per_s (or None), source} for an MTLDevice name
    such as "Apple M2 Pro"; ``cores`` the GPU's cores, ``max_cores`` its chip's largest
    configuration (the published TFLOP/s scale by cores / max_cores). Unknown chips: Nones."""
    chip = device_name.removeprefix("Apple ").strip()
    if chip not in PEAKS:
        return {"chip": chip, "tflops": None, "gb_per_s": None, "source": None}
    tflops, bandwidth, source = PEAKS[chip]
    if tflops is not None and 0 < cores < max_cores:
        tflops *= cores / max_cores
    return {"chip": chip, "tflops": tflops, "gb_per_s": bandwidth, "source": source}
