"""Where each rank sits: its pipeline (model-parallel) group and its data-parallel group.

"cluster" puts one model replica on consecutive ranks (8 ranks, 2 partitions: [0,1], [2,3],
...), so pipeline traffic stays inside a host; "spread" puts the pipeline ranks of a replica
dp_size apart ([0,4], [1,5], ...), so data-parallel reductions stay inside a host.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List


@dataclass(frozen=True)
class Topology:
    rank: int
    size: int
    pp_size: int
    placement: str

    @property
    def dp_size(self) -> int:
        return self.size // self.pp_size

    def global_rank(self, pp_rank: int, dp_rank: int) -> int:
        if self.placement == "cluster":
            return dp_rank * self.pp_size + pp_rank
        return pp_rank * self.dp_size + dp_rank

    @property
    def pp_rank(self) -> int:
        return self.rank % self.pp_size if self.placement == "cluster" else self.rank // self.dp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.pp_size if self.placement == "cluster" else self.rank % self.dp_size

    def pp_group_of(self, dp_rank: int) -> List[int]:
        return [self.global_rank(p, dp_rank) for p in range(self.pp_size)]

    def dp_group_of(self, pp_rank: int) -> List[int]:
        return [self.global_rank(pp_rank, d) for d in range(self.dp_size)]

    @property
    def pp_group(self) -> List[int]:
        return self.pp_group_of(self.dp_rank)

    @property
    def dp_group(self) -> List[int]:
        return self.dp_group_of(self.pp_rank)
