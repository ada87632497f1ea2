from lightning_shm.parallel.fsdp.policy import UnitPolicy, UnitSpec, find_units
from lightning_shm.parallel.fsdp.sharded import FSDPState
from lightning_shm.parallel.fsdp.unit import FSDPUnit, MemoryStats

__all__ = ["FSDPUnit", "MemoryStats", "FSDPState", "UnitPolicy", "UnitSpec", "find_units"]
