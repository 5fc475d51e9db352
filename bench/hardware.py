"""Hardware peaks the bench judges its numbers against, each with its source.

These are datasheet or spec numbers, not measurements. The bench measures the
host<->device copy ceiling itself (``bench/probe.py``) and reports achieved
bandwidth against that measurement; the constants here are only for context
(MFU, "how far from the link's theoretical rate").
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HardwarePeak", "PEAKS", "PCIE_GEN5_X16_GB_S", "peak_for"]


PCIE_GEN5_X16_GB_S = 32e9 * 16 * (128 / 130) / 8 / 1e9
"""PCIe Gen5 x16, one direction, theoretical: 32 GT/s x 16 lanes x 128b/130b / 8 = 63.0 GB/s.
Source: PCI-SIG PCIe 5.0 base specification (32 GT/s, 128b/130b encoding)."""


@dataclass(frozen=True, kw_only=True)
class HardwarePeak:
    name: str
    """Short name matched against ``torch.cuda.get_device_name()`` (lower case substring)."""
    bf16_dense_tflops: float
    """Dense BF16 tensor-core peak, TFLOP/s (no sparsity)."""
    hbm_tb_s: float
    """HBM bandwidth, TB/s."""
    host_link_gb_s: float
    """Host link, one direction, theoretical GB/s."""
    source: str
    """Where the numbers come from."""


PEAKS: dict[str, HardwarePeak] = {
    "h100": HardwarePeak(
        name="h100",
        bf16_dense_tflops=989.0,
        hbm_tb_s=3.35,
        host_link_gb_s=PCIE_GEN5_X16_GB_S,
        source="NVIDIA H100 Tensor Core GPU datasheet, SXM5 column "
        "(nvidia.com/en-us/data-center/h100): BF16 1,979 TFLOPS with sparsity = 989 dense; "
        "HBM3 3.35 TB/s; PCIe Gen5 x16 host link",
    ),
    "h200": HardwarePeak(
        name="h200",
        bf16_dense_tflops=989.0,
        hbm_tb_s=4.8,
        host_link_gb_s=PCIE_GEN5_X16_GB_S,
        source="NVIDIA H200 Tensor Core GPU datasheet, SXM column "
        "(nvidia.com/en-us/data-center/h200): BF16 1,979 TFLOPS with sparsity = 989 dense; "
        "HBM3e 4.8 TB/s; PCIe Gen5 x16 host link",
    ),
}


def peak_for(device_name: str) -> HardwarePeak | None:
    """The datasheet peak for a device name such as ``"NVIDIA H100 80GB HBM3"``, or None."""
    low = device_name.lower()
    for key, peak in PEAKS.items():
        if key in low:
            return peak
    return None
