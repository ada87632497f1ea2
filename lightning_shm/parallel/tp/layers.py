"""Tensor-parallel layers, each built from the full (unsharded) layer of rank 0's initialisation.

Which rank holds which slice (tp=2, Linear(784, 256) -> LayerNorm(256) -> ReLU -> Linear(256, 64))::

    ColumnParallelLinear   W [256, 784]: rank 0 rows 0..127, rank 1 rows 128..255; bias split alike
                           in: x [B, 784] on both ranks           out: y_r [B, 128]
    ShardedLayerNorm       w, b [256]: rank 0 0..127, rank 1 128..255 (sharded with the features)
    ReLU                   elementwise, runs on the shard unchanged
    RowParallelLinear      W [64, 256]: rank 0 columns 0..127, rank 1 columns 128..255; bias [64] replicated
                           in: y_r [B, 128]      partial [B, 64] --all-reduce--> out [B, 64] on both

Convolutions (``Conv1d``, ``Conv2d``, ``Conv3d``) split channels the same way: a column convolution its output
channels (weight dim 0), a row one its input channels (weight dim 1; partial outputs summed, the bias added once);
a BatchNorm between them normalises each of the rank's channels exactly as one process does
(statistics are per channel), so it is only sliced. Transposed convolutions (``ConvTranspose1d`` / ``2d`` / ``3d``,
a decoder's upsampling) too, on their weight's other dims: it is ``[C_in, C_out, *kernel]``, so a column one cuts
dim 1 and a row one dim 0.

Each is an instance of the layer type it replaces (``nn.Linear``, ``nn.Conv2d``, ``nn.LayerNorm``, ...), as torch's
own tensor parallelism keeps the module: code that classifies modules by type -- the usual
``configure_optimizers`` giving Linear weights weight decay and LayerNorm's none -- sees the layers it built.
Their sizes (``out_features``, ``in_channels``, ``normalized_shape``) are this rank's, like their weights.

In inference torch's ``nn.TransformerEncoder``, given a ``src_key_padding_mask``, hands its layers a nested
tensor (each sample its own length, the padding dropped). The Linear layers take its samples' rows stacked,
``[sum L_i, in]``, and give a nested tensor of the same lengths back (:func:`on_rows`): a planned encoder
layer validates on one process's path.

``sizes`` say how many features (channels) each rank holds; attention splits by whole heads, so
its sizes are multiples of the head dimension. Each layer lists ``split_dims`` (parameter or buffer
-> dimension it is split along), from which checkpoints are consolidated.
"""

from __future__ import annotations

import copy
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lightning_shm.parallel.placement import Split
from lightning_shm.parallel.replaced import carry_over
from lightning_shm.parallel.tp.layernorm import distributed_layer_norm
from lightning_shm.parallel.tp.mappings import copy_to_tp, gather_from_tp, reduce_from_tp, split_to_tp
from lightning_shm.parallel.tp.rng import SplitRegionRandom
from lightning_shm.runtime import Group, even_split


def _slice(t: Optional[torch.Tensor], dim: int, sizes: Sequence[int], group: Group, blocks: int = 1
           ) -> Optional[nn.Parameter]:
    """This rank's slice of ``t`` along ``dim``, as a parameter of its own -- cut as a checkpoint's whole tensor is
    cut for it (:class:`~lightning_shm.parallel.placement.Split`). ``blocks``: ``dim`` is that many equal parts
    stacked (a fused q, k, v projection's rows): the rank's slice of each, side by side."""
    if t is None:
        return None
    p = nn.Parameter(Split(group, dim, tuple(sizes), blocks).cut(t.detach()), requires_grad=t.requires_grad)
    carry_over(t, p)
    return p


def _replicate(t: Optional[torch.Tensor]) -> Optional[nn.Parameter]:
    if t is None:
        return None
    p = nn.Parameter(t.detach().clone(), requires_grad=t.requires_grad)
    carry_over(t, p)
    return p


def on_rows(x: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``forward`` of a nested ``x``'s samples ``[L_i, ..., in]`` stacked into one tensor of their rows, its
    output cut back into samples of the same lengths (torch builds such an ``x`` in inference only)."""
    samples = x.unbind()
    out = forward(torch.cat(samples))
    return torch.nested.as_nested_tensor(list(out.split([s.shape[0] for s in samples])), layout=torch.strided)


class ColumnParallelLinear(nn.Linear):
    """Output features split across the group; input replicated. Output stays sharded, or with
    ``gather_output`` is all-gathered so the layers after it run replicated (plan style
    ``"column_gathered"``): ``y_r [B, H_r]`` --all-gather--> ``y [B, H]`` on every rank.

    ``blocks``: the output is that many equal parts the module's forward cuts apart -- a fused q, k, v projection
    (``.chunk(3, -1)``, ``reshape(B, T, 3, -1, head_dim)``), a fused gate and up projection (``.chunk(2, -1)``) --
    and the rank holds its slice of each (``sizes`` per part; tp=2, ``Linear(E, 3E)``)::

        W [3E, E]: rank 0 rows q 0..E/2, k E..3E/2, v 2E..5E/2      out: y_r [B, 3 E/2] = [q_r | k_r | v_r]

    so the forward cuts this rank's q, k and v (its heads) where it would cut the whole ones. A contiguous slice
    would give rank 0 all of q and half of k."""

    split_dims = {"weight": 0, "bias": 0}
    split_blocks: dict[str, int] = {}

    def __init__(self, full: nn.Linear, group: Group, sizes: Optional[Sequence[int]] = None,
                 gather_output: bool = False, random: Optional[SplitRegionRandom] = None, blocks: int = 1) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate the whole weight
        self.group, self.gather_output, self.random = group, gather_output, random
        self.in_features, self.full_out_features = full.in_features, full.out_features
        self.sizes = list(sizes or even_split_sizes(full.out_features // blocks, group.size))
        self.blocks = blocks
        if blocks > 1:
            self.split_blocks = {"weight": blocks, "bias": blocks}
        self.out_features = blocks * self.sizes[group.index]
        self.weight = _slice(full.weight, 0, self.sizes, group, blocks)
        self.bias = _slice(full.bias, 0, self.sizes, group, blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_nested:
            return on_rows(x, self.forward)
        y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)
        if self.gather_output:
            return gather_from_tp(y, self.group, tuple(self.sizes))
        _enter(self.random)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} of {self.full_out_features}, tp={self.group.size}"
                + (", output gathered" if self.gather_output else "")
                + (f", a slice of each of {self.blocks} blocks" if self.blocks > 1 else ""))


class KVHeadsLinear(nn.Linear):
    """Grouped-query attention's k or v projection with fewer kv heads than tp ranks (multi-query attention's one,
    Qwen2's two at tp4): each kv head serves the ranks holding its group's q heads, so each rank computes the rows
    of its kv head only -- a head several ranks compute alike, as Megatron and vLLM replicate kv heads. The layer
    keeps the whole weight (replicated, whole in checkpoints); each rank's gradient has its head's rows only, from
    its q heads, and a hook sums it over the tp ranks (:func:`~.plan.apply_plan`): every rank then steps the whole
    weight with one process's gradient (tp=4, 2 kv heads of 8 features)::

        W [16, E] on every rank        ranks 0, 1: rows 0..7 (kv head 0)   ranks 2, 3: rows 8..15 (kv head 1)
        in: x [B, T, E] on every rank  out: y_r [B, T, 8]                  (backward: dx summed, as a column layer's)
    """

    split_dims: dict[str, int] = {}  # nothing cut: the weight is held whole by every tp rank

    def __init__(self, full: nn.Linear, group: Group, start: int, n: int,
                 random: Optional[SplitRegionRandom] = None) -> None:
        nn.Module.__init__(self)
        self.group, self.random, self.start = group, random, start
        self.in_features, self.out_features, self.full_out_features = full.in_features, n, full.out_features
        self.weight, self.bias = full.weight, full.bias  # the very parameters: nothing to copy or consolidate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_nested:
            return on_rows(x, self.forward)
        rows = slice(self.start, self.start + self.out_features)
        y = F.linear(copy_to_tp(x, self.group), self.weight[rows], None if self.bias is None else self.bias[rows])
        _enter(self.random)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} of {self.full_out_features} (rows {self.start}.."
                f"{self.start + self.out_features - 1}, a kv head other ranks compute too), tp={self.group.size}")


class RowParallelLinear(nn.Linear):
    """Input features split across the group; partial outputs summed by an all-reduce; bias replicated.

    ``split_input`` (plan style ``"row_split_input"``): the input comes whole on every rank -- after a gathered
    column layer, as Phi-3 plans its fused projections -- and the layer takes the rank's features of it itself;
    their gradient is all-gathered back into the whole input's (tp=2, ``Linear(256, 64)``)::

        x [B, 256] on both --rank 0 keeps 0..127, rank 1 128..255--> partial [B, 64] --all-reduce--> [B, 64]
        backward: dx_r [B, 128] --all-gather--> dx [B, 256] on both
    """

    split_dims = {"weight": 1}

    def __init__(self, full: nn.Linear, group: Group, sizes: Optional[Sequence[int]] = None,
                 random: Optional[SplitRegionRandom] = None, split_input: bool = False) -> None:
        nn.Module.__init__(self)
        self.group, self.random, self.split_input = group, random, split_input
        self.full_in_features, self.out_features = full.in_features, full.out_features
        self.sizes = list(sizes or even_split_sizes(full.in_features, group.size))
        self.in_features = self.sizes[group.index]
        self.weight = _slice(full.weight, 1, self.sizes, group)
        self.bias = _replicate(full.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_nested:
            return on_rows(x, self.forward)
        if self.split_input:
            if x.shape[-1] != self.full_in_features:
                raise ValueError(f"a 'row_split_input' Linear takes the whole input of {self.full_in_features} "
                                 f"features and splits it itself, but got {x.shape[-1]}: after a column layer whose "
                                 "output stays split (this rank's features), plan it 'row'")
            x = split_to_tp(x, self.group, tuple(self.sizes))
        else:
            _leave(self.random)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} of {self.full_in_features}, out={self.out_features}, tp={self.group.size}"
                + (", input split here" if self.split_input else ""))


class RowParallelEmbedding(nn.Embedding):
    """The vocabulary split across the group (Megatron's vocab-parallel embedding, torch's ``RowwiseParallel`` on
    an ``nn.Embedding``): the table's rows are its largest dimension, so each rank holds a block of them. Every id
    lives on exactly one rank; the others look up zeros, and an all-reduce sums the lookups -- each value plus
    zeros, so one process's rows exactly::

        table W [V, D]: rank 0 rows 0..V_0-1, rank 1 rows V_0..V-1
        ids [B, T] on both ranks -> rows of the ids this rank holds, zeros elsewhere [B, T, D]
                                 --all-reduce--> [B, T, D] on both (backward: each rank's rows get their ids' grads)
    """

    split_dims = {"weight": 0}

    def __init__(self, full: nn.Embedding, group: Group, sizes: Optional[Sequence[int]] = None,
                 random: Optional[SplitRegionRandom] = None) -> None:
        nn.Module.__init__(self)  # not nn.Embedding's: it would allocate the whole table
        self.group, self.full_num_embeddings, self.embedding_dim = group, full.num_embeddings, full.embedding_dim
        self.sizes = list(sizes or even_split_sizes(full.num_embeddings, group.size))
        self.first, self.num_embeddings = sum(self.sizes[:group.index]), self.sizes[group.index]
        pad = full.padding_idx
        self.padding_idx = pad - self.first if pad is not None and 0 <= pad - self.first < self.num_embeddings else None
        self.max_norm, self.norm_type = full.max_norm, full.norm_type  # None: the plan refuses a max_norm
        self.scale_grad_by_freq, self.sparse = full.scale_grad_by_freq, full.sparse  # False: refused too
        self.weight = _slice(full.weight, 0, self.sizes, group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        elsewhere = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(elsewhere, 0), self.weight, self.padding_idx)
        return reduce_from_tp(rows.masked_fill(elsewhere.unsqueeze(-1), 0), self.group)

    def extra_repr(self) -> str:
        return (f"rows {self.first}..{self.first + self.num_embeddings - 1} of {self.full_num_embeddings}, "
                f"dim={self.embedding_dim}, tp={self.group.size}")


class _SplitConv:
    """What the column and row convolutions of every dimension (Conv1d, Conv2d, Conv3d) share: the full layer's
    geometry, and its forward (torch's own ``_conv_forward``) over this rank's piece of the weight, whose output and
    input channels are dims ``out_dim`` and ``in_dim`` (``[C_out, C_in, *kernel]``)."""

    out_dim, in_dim = 0, 1

    def _init_split(self, full: nn.modules.conv._ConvNd, group: Group, random: Optional[SplitRegionRandom]) -> None:
        nn.Module.__init__(self)  # type: ignore[arg-type]
        kind = type(full).__name__
        if full.groups != 1:
            raise ValueError(f"a grouped {kind} (groups={full.groups}) cannot be split by channels here")
        if full.padding_mode != "zeros":
            raise ValueError(f"{kind} padding_mode={full.padding_mode!r}: only 'zeros' is supported")
        self.group, self.random = group, random
        self.stride, self.padding, self.dilation = full.stride, full.padding, full.dilation
        self.kernel_size, self.groups, self.padding_mode = full.kernel_size, 1, full.padding_mode
        self.transposed, self.output_padding = full.transposed, full.output_padding

    def _conv(self, x: torch.Tensor, bias: Optional[torch.Tensor], output_size: Optional[list[int]]) -> torch.Tensor:
        return self._conv_forward(x, self.weight, bias)  # type: ignore[attr-defined]


class _Transposed(_SplitConv):
    """A transposed convolution (ConvTranspose1d / 2d / 3d, a decoder's upsampling): its weight is
    ``[C_in, C_out, *kernel]``, the transpose of a convolution's, and ``output_size`` (the caller's, as in one
    process) picks its output padding."""

    out_dim, in_dim = 1, 0

    def _conv(self, x: torch.Tensor, bias: Optional[torch.Tensor], output_size: Optional[list[int]]) -> torch.Tensor:
        n = len(self.kernel_size)
        padding = self._output_padding(x, output_size, self.stride, self.padding,  # type: ignore[attr-defined]
                                       self.kernel_size, n, self.dilation)
        return _CONV_TRANSPOSE[n](x, self.weight, bias, self.stride, self.padding,  # type: ignore[attr-defined]
                                  padding, 1, self.dilation)


_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


class _ColumnConv(_SplitConv):
    """Output channels split across the group; input replicated; output channels stay sharded."""

    def __init_subclass__(cls, **kw: object) -> None:
        super().__init_subclass__(**kw)
        cls.split_dims = {"weight": cls.out_dim, "bias": 0}

    def __init__(self, full: nn.modules.conv._ConvNd, group: Group, sizes: Optional[Sequence[int]] = None,
                 random: Optional[SplitRegionRandom] = None) -> None:
        self._init_split(full, group, random)
        self.sizes = list(sizes or even_split_sizes(full.out_channels, group.size))
        self.in_channels, self.out_channels = full.in_channels, self.sizes[group.index]
        self.weight = _slice(full.weight, self.out_dim, self.sizes, group)
        self.bias = _slice(full.bias, 0, self.sizes, group)

    def forward(self, x: torch.Tensor, output_size: Optional[list[int]] = None) -> torch.Tensor:
        y = self._conv(copy_to_tp(x, self.group), self.bias, output_size)
        _enter(self.random)
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_channels}, out={self.out_channels} of {sum(self.sizes)} channels, tp={self.group.size}"


class _RowConv(_SplitConv):
    """Input channels split; partial outputs summed by an all-reduce; the (replicated) bias added once."""

    def __init_subclass__(cls, **kw: object) -> None:
        super().__init_subclass__(**kw)
        cls.split_dims = {"weight": cls.in_dim}

    def __init__(self, full: nn.modules.conv._ConvNd, group: Group, sizes: Optional[Sequence[int]] = None,
                 random: Optional[SplitRegionRandom] = None) -> None:
        self._init_split(full, group, random)
        self.sizes = list(sizes or even_split_sizes(full.in_channels, group.size))
        self.in_channels, self.out_channels = self.sizes[group.index], full.out_channels
        self.weight = _slice(full.weight, self.in_dim, self.sizes, group)
        self.bias = _replicate(full.bias)

    def forward(self, x: torch.Tensor, output_size: Optional[list[int]] = None) -> torch.Tensor:
        _leave(self.random)
        y = reduce_from_tp(self._conv(x, None, output_size), self.group)
        return y if self.bias is None else y + self.bias.view(-1, *([1] * (y.dim() - 2)))

    def extra_repr(self) -> str:
        return f"in={self.in_channels} of {sum(self.sizes)}, out={self.out_channels} channels, tp={self.group.size}"


class ColumnParallelConv1d(_ColumnConv, nn.Conv1d):
    """A column Conv1d: [B, C_in, L] in, this rank's output channels [B, C_out_r, L'] out."""


class ColumnParallelConv2d(_ColumnConv, nn.Conv2d):
    """A column Conv2d: [B, C_in, H, W] in, this rank's output channels [B, C_out_r, H', W'] out."""


class ColumnParallelConv3d(_ColumnConv, nn.Conv3d):
    """A column Conv3d: [B, C_in, D, H, W] in, this rank's output channels out."""


class RowParallelConv1d(_RowConv, nn.Conv1d):
    """A row Conv1d: this rank's input channels [B, C_in_r, L] in, the summed [B, C_out, L'] out on every rank."""


class RowParallelConv2d(_RowConv, nn.Conv2d):
    """A row Conv2d: this rank's input channels [B, C_in_r, H, W] in, the summed [B, C_out, H', W'] out."""


class RowParallelConv3d(_RowConv, nn.Conv3d):
    """A row Conv3d: this rank's input channels in, the summed output on every rank."""


class ColumnParallelConvTranspose1d(_ColumnConv, _Transposed, nn.ConvTranspose1d):
    """A column ConvTranspose1d: [B, C_in, L] in, this rank's output channels [B, C_out_r, L'] out."""


class ColumnParallelConvTranspose2d(_ColumnConv, _Transposed, nn.ConvTranspose2d):
    """A column ConvTranspose2d: [B, C_in, H, W] in, this rank's output channels [B, C_out_r, H', W'] out."""


class ColumnParallelConvTranspose3d(_ColumnConv, _Transposed, nn.ConvTranspose3d):
    """A column ConvTranspose3d: [B, C_in, D, H, W] in, this rank's output channels out."""


class RowParallelConvTranspose1d(_RowConv, _Transposed, nn.ConvTranspose1d):
    """A row ConvTranspose1d: this rank's input channels in, the summed [B, C_out, L'] out on every rank."""


class RowParallelConvTranspose2d(_RowConv, _Transposed, nn.ConvTranspose2d):
    """A row ConvTranspose2d: this rank's input channels in, the summed [B, C_out, H', W'] out on every rank."""


class RowParallelConvTranspose3d(_RowConv, _Transposed, nn.ConvTranspose3d):
    """A row ConvTranspose3d: this rank's input channels in, the summed output on every rank."""


COLUMN_CONV = {nn.Conv1d: ColumnParallelConv1d, nn.Conv2d: ColumnParallelConv2d, nn.Conv3d: ColumnParallelConv3d,
               nn.ConvTranspose1d: ColumnParallelConvTranspose1d, nn.ConvTranspose2d: ColumnParallelConvTranspose2d,
               nn.ConvTranspose3d: ColumnParallelConvTranspose3d}
ROW_CONV = {nn.Conv1d: RowParallelConv1d, nn.Conv2d: RowParallelConv2d, nn.Conv3d: RowParallelConv3d,
            nn.ConvTranspose1d: RowParallelConvTranspose1d, nn.ConvTranspose2d: RowParallelConvTranspose2d,
            nn.ConvTranspose3d: RowParallelConvTranspose3d}


class ShardedLayerNorm(nn.LayerNorm):
    """LayerNorm whose normalised features are split like the preceding column layer's outputs."""

    split_dims = {"weight": 0, "bias": 0}

    def __init__(self, full: nn.LayerNorm, group: Group, sizes: Sequence[int]) -> None:
        nn.Module.__init__(self)
        if len(full.normalized_shape) != 1 or not full.elementwise_affine or full.bias is None:
            raise ValueError(f"only LayerNorm over one dimension with weight and bias can be sharded, got {full}")
        if full.normalized_shape[0] != sum(sizes):
            raise ValueError(f"LayerNorm over {full.normalized_shape[0]} features follows a column layer with "
                             f"{sum(sizes)} outputs")
        self.group, self.sizes, self.eps = group, list(sizes), full.eps
        self.normalized_shape, self.elementwise_affine = (self.sizes[group.index],), True
        self.weight = _slice(full.weight, 0, self.sizes, group)
        self.bias = _slice(full.bias, 0, self.sizes, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return distributed_layer_norm(x, self.weight, self.bias, self.eps, self.group, self.sizes)

    def extra_repr(self) -> str:
        return f"{self.sizes[self.group.index]} of {sum(self.sizes)} features, eps={self.eps}, tp={self.group.size}"


def sliced_batchnorm(full: nn.modules.batchnorm._NormBase, group: Group, sizes: Sequence[int]) -> nn.Module:
    """The same BatchNorm (or InstanceNorm) over this rank's channels only: exact without communication, since
    its statistics, affine parameters and running buffers are all per channel. A data-parallel SyncBatchNorm
    stays one over its own group (the replicas' same channels): the copy shares that group."""
    if full.num_features != sum(sizes):
        raise ValueError(f"{type(full).__name__}({full.num_features}) follows a column layer with {sum(sizes)} "
                         "output channels")
    dp = getattr(full, "group", None)
    bn = _channel_slice(full, group, sizes, {id(dp): dp} if dp is not None else None)
    bn.num_features = sizes[group.index]
    for name in ("running_mean", "running_var"):
        if getattr(full, name) is not None:
            setattr(bn, name, Split(group, 0, tuple(sizes)).cut(getattr(full, name).detach()))
    bn.split_dims = {**bn.split_dims, "running_mean": 0, "running_var": 0}
    return bn


def _channel_slice(full: nn.Module, group: Group, sizes: Sequence[int], memo: Optional[dict] = None) -> nn.Module:
    """A copy of ``full`` holding this rank's rows of its ``weight`` and ``bias`` (per-channel parameters, or a
    grouped conv's per-output-channel kernels); the caller sets its channel counts."""
    part = copy.deepcopy(full, memo)
    for name in ("weight", "bias"):
        if getattr(full, name) is not None:
            setattr(part, name, _slice(getattr(full, name), 0, sizes, group))
    part.split_dims = {"weight": 0, "bias": 0}
    part.sizes = list(sizes)
    return part


def sliced_groupnorm(full: nn.GroupNorm, group: Group, sizes: Sequence[int]) -> nn.Module:
    """The same GroupNorm over this rank's channels only: exact without communication when every rank's
    channels are whole groups (:func:`groups_fit` -- the plan checks it), since a group's statistics are
    over its own channels and the affine parameters are per channel. ``GroupNorm(8, 32)`` at tp=2: each
    rank runs ``GroupNorm(4, 16)`` on its 16 channels."""
    if not groups_fit(full, sizes):
        raise ValueError(f"GroupNorm({full.num_groups}, {full.num_channels}) cannot run on channels split as "
                         f"{list(sizes)}: a group of {full.num_channels // max(full.num_groups, 1)} channels would "
                         "span two ranks")
    n = sizes[group.index]
    gn = _channel_slice(full, group, sizes)
    gn.num_channels, gn.num_groups = n, n // (full.num_channels // full.num_groups)
    return gn


def sliced_grouped_conv(full: nn.modules.conv._ConvNd, group: Group, sizes: Sequence[int]) -> nn.Module:
    """A grouped convolution with as many output as input channels (a depthwise conv, ``groups=C``; ResNeXt's
    ``groups=32``) over this rank's channels only: each group reads and writes its own channels, so when every
    rank's channels are whole groups (:func:`conv_groups_fit` -- the plan checks it) the rank's groups compute
    exactly one process's channels, without communication. ``Conv2d(16, 16, 3, groups=16)`` at tp=2: each
    rank runs ``Conv2d(8, 8, 3, groups=8)`` on its 8 channels (weight ``[16, 1, 3, 3]`` -> ``[8, 1, 3, 3]``)."""
    if not conv_groups_fit(full, sizes):
        raise ValueError(f"{type(full).__name__}({full.in_channels}, {full.out_channels}, groups={full.groups}) cannot "
                         f"run on channels split as {list(sizes)}")
    n = sizes[group.index]
    conv = _channel_slice(full, group, sizes)
    conv.in_channels = conv.out_channels = n
    conv.groups = n // (full.in_channels // full.groups)
    return conv


def conv_groups_fit(conv: nn.modules.conv._ConvNd, sizes: Sequence[int]) -> bool:
    """``conv`` is grouped, keeps its channel count, and every rank's channels are whole groups of it."""
    return conv.groups > 1 and conv.out_channels == conv.in_channels and _whole_groups(conv.in_channels,
                                                                                        conv.groups, sizes)


def groups_fit(gn: nn.GroupNorm, sizes: Sequence[int]) -> bool:
    """Every rank's channels are whole groups of ``gn``."""
    return _whole_groups(gn.num_channels, gn.num_groups, sizes)


def _whole_groups(channels: int, groups: int, sizes: Sequence[int]) -> bool:
    return sum(sizes) == channels and all(n % (channels // groups) == 0 for n in sizes)


def _enter(random: Optional[SplitRegionRandom]) -> None:
    if random is not None:  # what follows runs on this rank's features: its own random stream
        random.enter()


def _leave(random: Optional[SplitRegionRandom]) -> None:
    if random is not None:  # back to replicated activations: the group's shared stream
        random.leave()


def even_split_sizes(n: int, parts: int) -> list[int]:
    b = even_split(n, parts)
    return [b[i + 1] - b[i] for i in range(parts)]
