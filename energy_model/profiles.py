"""Measured strong-scaling profiles: iterations/s per (global batch size, GPU count)."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ScalingProfile:
    """Iterations per second of one model at each global batch size and GPU count."""

    model_name: str
    # global_batch_size -> {gpus: iterations_per_s}; unsupported cells are left out.
    iterations_per_s: dict[int, dict[int, float]] = field(default_factory=dict)

    def batch_sizes(self) -> list[int]:
        """Global batch sizes that have at least one measurement."""
        return sorted(b for b, row in self.iterations_per_s.items() if row)

    def nearest_batch_size(self, global_batch_size: int) -> int:
        """The measured batch size closest to `global_batch_size` (in log space)."""
        sizes = self.batch_sizes()
        if not sizes:
            raise ValueError(f"profile {self.model_name!r} has no measurements")
        return min(sizes, key=lambda b: abs(math.log(b) - math.log(global_batch_size)))

    def samples_per_s(self, global_batch_size: int) -> dict[int, float]:
        """Samples/s at each measured GPU count for the nearest measured batch size."""
        batch = self.nearest_batch_size(global_batch_size)
        return {g: ips * batch for g, ips in sorted(self.iterations_per_s[batch].items())}


def load_scaling_profile(path: Path) -> ScalingProfile:
    """Read one `throughputs_*/<model>.csv` file (ElasticFlow artifact format)."""
    with path.open(newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader)
        if not header or header[0].strip() != "global_batch_size":
            raise ValueError(f"{path}: first column must be global_batch_size, got {header[:1]}")
        gpu_counts = [int(h) for h in header[1:]]
        table: dict[int, dict[int, float]] = {}
        for row in reader:
            if not row or not row[0].strip():
                continue
            batch = int(float(row[0]))
            cells: dict[int, float] = {}
            for gpus, cell in zip(gpu_counts, row[1:], strict=False):
                value = float(cell) if cell.strip() else math.nan
                # nan or 0 marks an unsupported configuration in these tables.
                if math.isfinite(value) and value > 0:
                    cells[gpus] = value
            table[batch] = cells
    return ScalingProfile(model_name=path.stem, iterations_per_s=table)


def load_scaling_profiles(directory: Path) -> dict[str, ScalingProfile]:
    """Read every `<model>.csv` in a `throughputs_*` directory, keyed by model name."""
    profiles = {p.stem: load_scaling_profile(p) for p in sorted(directory.glob("*.csv"))}
    if not profiles:
        raise FileNotFoundError(f"no <model>.csv scaling profiles in {directory}")
    return profiles
