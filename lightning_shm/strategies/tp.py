"""``shm_tp``: Megatron-style tensor parallelism (optionally x data parallelism) over shared memory.

``devices = dp x tp``: ranks of a tensor-parallel group split the planned layers (Linear and
Conv1d / 2d / 3d, column / row; attention by whole heads) and see the same batch; data-parallel replicas of
each slice average their gradients with the shm_ddp reducer over their dp group. The
LightningModule is untouched: its layers are swapped for parallel ones in ``setup``, following a
plan given as data (see :mod:`lightning_shm.parallel.tp.plan`). A preset of
:class:`~lightning_shm.strategies.model_parallel.SHMModelParallel` (tp x dp replicate).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from lightning_shm.strategies.model_parallel import SHMModelParallel


class SHMTensorParallel(SHMModelParallel):
    """Tensor parallelism of size ``tensor_parallel_size`` times data parallelism of devices / tp.

    Args:
        tensor_parallel_size: ranks that split each planned layer; must divide ``devices``.
        plan: ``{module path pattern: "column" | "row" | "column_gathered" | "row_split_input" | "replicate" |
            "between" | "heads" | "on_heads" | {"style": ..., "head_dim": ..., "blocks": ...}}`` (or Hugging Face's
            and torch's words for them), and ``{parameter or buffer path pattern:
            "per_head" | {"style": "per_head", "dim": ...}}`` (each path component matched shell-style:
            ``*``, ``layer*``; the styles: :mod:`lightning_shm.parallel.tp.plan`); default: the
            module's ``tp_plan`` attribute, else derived for its Sequential (Linear / Conv1d-3d layers paired
            column -> row; a Linear followed by one at most 1/tp its size gathered instead, see ``derive_plan``)
            and for torch's transformer blocks wherever they sit (``torch_blocks_plan``).
        sequential: attribute path of the ``nn.Sequential`` a plan is derived from (default: the first one).
        **kwargs: ``tp_batch`` (how the ranks of a tp group come to compute on the same batch) and the
            rest of :class:`~lightning_shm.strategies.model_parallel.SHMModelParallel`.
    """

    def __init__(self, *args: Any, tensor_parallel_size: int = 2, plan: Optional[Mapping[str, Any]] = None,
                 sequential: Optional[str] = None, **kwargs: Any) -> None:
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
        super().__init__(*args, tensor_parallel_size=tensor_parallel_size, plan=plan, sequential=sequential, **kwargs)
        self.tensor_parallel_size = tensor_parallel_size
        self.plan = self.parallel_config.plan
        self.sequential = sequential
