"""The links between GPUs kareus prices collectives on: bandwidth and ring-step latency."""

from __future__ import annotations

import dataclasses

DATASHEET_A100 = "NVIDIA A100 Tensor Core GPU datasheet (2021) and A100 whitepaper (2020)"
DATASHEET_H100 = "NVIDIA H100 Tensor Core GPU datasheet (2023) and Hopper whitepaper (2022)"


@dataclasses.dataclass(frozen=True)
class InterconnectSpec:
    """A GPU-to-GPU link: bandwidth per direction and latency of one ring step."""

    name: str
    bandwidth_gbs: float  # per direction, per GPU
    latency_us: float  # per step of a ring collective (an all-reduce over p GPUs: 2(p - 1))
    source: str


_NCCL_STEP = (
    "latency of one ring step with the Simple protocol, from NCCL's own tuning model "
    "(NVIDIA/nccl src/graph/tuning.cc, hwLat: NVLink 3.4 us, PCIe 5.7 us, network 9.6 us)"
)
NVLINK3 = InterconnectSpec(
    "NVLink 3 (A100 SXM4)",
    300.0,
    3.4,
    f"{DATASHEET_A100}: 12 links x 25 GB/s per direction = 600 GB/s total; {_NCCL_STEP}",
)
NVLINK4 = InterconnectSpec(
    "NVLink 4 (H100/H200 SXM5)",
    450.0,
    3.4,
    f"{DATASHEET_H100}: 18 links x 25 GB/s per direction = 900 GB/s total; {_NCCL_STEP} "
    "(one NVLink figure for every generation)",
)
IB_HDR = InterconnectSpec(
    "InfiniBand HDR, one 200 Gb/s port per GPU (DGX A100)",
    25.0,
    9.6,
    "NVIDIA DGX A100 datasheet (2020): 8 single-port ConnectX-6 VPI HDR 200 Gb/s "
    "InfiniBand adapters for the compute fabric, one per GPU: 25 GB/s per direction; "
    f"{_NCCL_STEP}; every step priced at the network's (uncalibrated)",
)
IB_NDR = InterconnectSpec(
    "InfiniBand NDR, one 400 Gb/s port per GPU (DGX H100/H200)",
    50.0,
    9.6,
    "NVIDIA DGX H100 and DGX H200 datasheets (2023, 2024): 8 single-port ConnectX-7 NDR "
    "400 Gb/s adapters for the compute fabric, one per GPU: 50 GB/s per direction; "
    f"{_NCCL_STEP}; uncalibrated",
)
PCIE4 = InterconnectSpec(
    "PCIe 4.0 x16",
    32.0,
    5.7,
    "PCI-SIG PCIe 4.0 specification: 16 GT/s x 16 lanes, about 32 GB/s per direction; "
    f"{_NCCL_STEP}",
)
