"""The machine a plan is for: the figures its estimates start from (``ddptrain plan --tflops ...``).
No torch here: the command line's parser reads the defaults before anything heavy is imported."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The machine planned for (defaults: an H100 node of 8 GPUs, one 400 Gb/s NIC per GPU)."""

    tflops: float = 400.0  # achieved per rank: an H100's 989 dense bf16 TFLOP/s at 40% utilisation
    link_gbps: float = 400.0  # one rank's network bandwidth between nodes, Gbit/s
    node_gbps: float = 3600.0  # one rank's bandwidth inside a node (NVLink 4: 450 GB/s), Gbit/s
    copy_gbs: float = 20.0  # a snapshot's copy off the device (what blocks the step), GB/s per rank
    write_gbs: float = 10.0  # the file system's write bandwidth for the whole job, GB/s
    start_seconds: float = 60.0  # a restarted job's start-up before its first step (import, rendezvous, build)
    rank_mttf_hours: float = 50_000.0  # one GPU's mean time to failure (Llama 3: 419 unexpected
    # interruptions in 54 days on 16,384 GPUs, a job MTTF of 3.1 h)
    memory_per_rank_gb: float | None = None  # refuse a plan whose peak is above it
