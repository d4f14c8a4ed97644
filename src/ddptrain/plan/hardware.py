"""The machine a plan is for: the figures its estimates start from (``ddptrain plan --tflops ...``).
No torch here: the command line's parser reads the defaults before anything heavy is imported."""

from __future__ import annotations

import dataclasses
import math

from ..errors import ConfigError

# Each figure's flag, and whether 0 is a figure a machine can have (a restart that takes no time can).
FLAGS = {"tflops": "--tflops", "link_gbps": "--link-gbps", "node_gbps": "--node-gbps", "copy_gbs": "--copy-gbs",
         "write_gbs": "--write-gbs", "start_seconds": "--start-seconds", "rank_mttf_hours": "--rank-mttf-hours",
         "latency_us": "--latency-us", "memory_per_rank_gb": "--memory-per-rank"}


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
    latency_us: float = 5.0  # one message between two ranks, start to end (a step of a ring or a tree):
    # NCCL's per-step cost over InfiniBand, a few microseconds
    memory_per_rank_gb: float | None = None  # refuse a plan whose peak is above it

    def check(self) -> None:
        """ConfigError (one line, exit 2) for a figure no machine has, before anything is planned:
        a rate or a lifetime that is not a finite number above 0 would divide by zero (or plan
        forever) after the ranks ran; a start-up that is negative; a memory limit that is not above 0."""
        for name in FLAGS:
            value = getattr(self, name)
            if value is None:
                continue
            least_ok = 0.0 if name == "start_seconds" else math.nextafter(0.0, 1.0)
            if not (math.isfinite(value) and value >= least_ok):
                needs = "a number >= 0" if name == "start_seconds" else "a finite number > 0"
                raise ConfigError(f"{FLAGS[name]} must be {needs}, got {value:g} (a figure of the machine planned "
                                  "for; leave it out for the default)")
