"""The devices' peak FLOP/s, one row per device, each row citing the vendor's datasheet.

MFU divides the FLOP/s a run achieves by its device's peak for the precision it computes
in. NVIDIA's datasheets print tensor-core figures with 2:4 structured sparsity (a footnote
says so); training runs dense, so every tensor figure below is half the printed one (the
A100 datasheet prints both). ``fp32`` is the CUDA cores' rate; ``tf32``, ``bf16`` and
``fp16`` the tensor cores' with FP32 accumulation, which is what PyTorch's matmuls use. A
figure nobody publishes is left out: the lookup then says n/a and why, never a guess.

Example::

    peak = peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    peak.flops, peak.source      # 9.895e14, "NVIDIA H100 datasheet: ..."
    peak_flops("cpu", "fp32").reason            # "no peak FLOP/s is known for cpu ..."
    peak_flops("NVIDIA L4", "bf16", override_tflops=100.0).flops   # 1e14, your figure
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True)
class Device:
    name: str
    matches: str  # a regular expression over torch.cuda.get_device_name()
    tflops: dict[str, float]  # dense TFLOP/s by precision
    source: str


def _dense(fp32: float, tf32: float, bf16: float, fp16: float) -> dict[str, float]:
    return {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16}


def _datasheet(name: str, url: str) -> str:
    return f"{name}, {url}"


_H100 = _datasheet(
    "NVIDIA H100 datasheet",
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet",
)
_H200 = _datasheet(
    "NVIDIA H200 datasheet",
    "https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446",
)

# Order matters: the first row whose pattern matches the device's name wins.
TABLE: tuple[Device, ...] = (
    Device("H200 NVL", r"H200 NVL", _dense(60, 417.5, 835.5, 835.5), _H200),
    Device("H200 SXM", r"H200", _dense(67, 494.5, 989.5, 989.5), _H200),
    Device("H100 NVL", r"H100 NVL", _dense(60, 417.5, 835.5, 835.5), _H100),
    Device("H100 PCIe", r"H100 PCIe", _dense(51, 378, 756.5, 756.5), _H100),
    # The SXM5 board names its memory: "NVIDIA H100 80GB HBM3".
    Device("H100 SXM", r"H100.*(SXM|HBM3)", _dense(67, 494.5, 989.5, 989.5), _H100),
    Device(
        "A100",
        r"A100",
        _dense(19.5, 156, 312, 312),
        _datasheet(
            "NVIDIA A100 datasheet",
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
        ),
    ),
    Device(
        "L40S",
        r"L40S",
        _dense(91.6, 183, 362.05, 362.05),
        _datasheet(
            "NVIDIA L40S datasheet", "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"
        ),
    ),
    Device(
        "L4",
        r"\bL4\b",
        _dense(30.3, 60, 121, 121),
        _datasheet(
            "NVIDIA L4 datasheet",
            "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet",
        ),
    ),
    # AWS's variant of the A10 (G5 instances): its tensor rates differ from the A10's and
    # neither NVIDIA nor AWS publishes them, so only the row's name is known.
    Device("A10G", r"A10G", {}, "NVIDIA and AWS publish no peak rates for the A10G"),
    Device(
        "RTX 4090",
        r"RTX 4090",
        _dense(82.6, 82.6, 165.2, 165.2),
        _datasheet(
            "NVIDIA Ada GPU architecture whitepaper v2.1",
            "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/"
            "nvidia-ada-gpu-architecture.pdf",
        ),
    ),
)


@dataclass(frozen=True)
class Peak:
    flops: float | None  # FLOP/s; None: unknown, ``reason`` says why
    source: str  # where the figure comes from, or why there is none

    @property
    def reason(self) -> str:
        return self.source


def find_device(device_name: str) -> Device | None:
    """The table's row for a ``torch.cuda.get_device_name()``; None for any other device."""
    return next((d for d in TABLE if re.search(d.matches, device_name)), None)


def peak_flops(
    device_name: str, precision: str | None, override_tflops: float | None = None
) -> Peak:
    """The device's dense peak in FLOP/s for ``precision`` (one of ``PRECISIONS``), or the
    override (``peak_tflops=``, for a device or precision the table lacks)."""
    if override_tflops is not None:
        if override_tflops <= 0:
            raise ValueError(f"peak_tflops must be above 0, got {override_tflops}")
        return Peak(override_tflops * 1e12, "peak_tflops given")
    give = "give peak_tflops= for MFU"
    if "MIG" in device_name:  # a slice has a share of the SMs the table does not know
        return Peak(
            None, f"{device_name} is a MIG slice, whose share of the peak is unknown; {give}"
        )
    row = find_device(device_name)
    if row is None:
        return Peak(None, f"no peak FLOP/s is known for {device_name}; {give}")
    if precision not in row.tflops:
        why = row.source if not row.tflops else f"{row.name} has no {precision} figure"
        return Peak(None, f"{why}; {give}")
    return Peak(row.tflops[precision] * 1e12, f"{row.name} {precision}, {row.source}")
