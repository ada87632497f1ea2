"""Each rank of a model replica (tp members, pipeline stages) loads its share of the replica's batch; the
shares are gathered.

Every rank of a replica computes on the *same* batch. Loading it on every rank (what the sampler
alone gives) does the data pipeline's work ``tp x pp`` times over; broadcasting the first member's batch
(:mod:`lightning_shm.parallel.tp.inputs`) keeps that duplicated work on the critical path. Here the
group's batch of ``L`` indices is cut like :func:`~lightning_shm.runtime.ops.even_split`, member
``r`` loads and collates only its rows, and the members all-gather them::

    batch sampler (same on every member)   [i0 ... i(L-1)]
    member r's loader                      rows even_split(L, T)[r] .. [r+1]   -> collate -> [L_r, ...]
    all_gather(_v) over the replica        [L_0 | L_1 | ... | L_(T-1)]         -> [L, ...] on every member

The result equals loading the whole batch on one rank as long as the collate function works sample
by sample (torch's ``default_collate`` does: it stacks) and the dataset draws nothing from the global
random streams. Each sample is produced once, so loader workers seeded per rank cannot give the members
different inputs. A dataset that does draw as it loads (random augmentations; seen by loading sample 0 once,
in a loader without workers) would have every member draw its share's numbers from one state -- each share
augmented as the first: "auto" broadcasts instead (:func:`why_not_splittable`), and each member's loader
workers are seeded apart (:func:`_member_seeds`). Every pass starts with the members' default generators made
one (:func:`~lightning_shm.parallel.tp.rng.share_stream`), so a sampler drawing from it gives them one order.
A batch with fewer samples than members (a short last batch) is loaded by every member and the
strategy broadcasts the first member's copy, as it does for loaders it cannot split.

The gather runs inside the loader's iteration, so Lightning's hooks (``on_before_batch_transfer``
on) already see the whole batch. Members call it at the same points of the same loop, in order.

An ``IterableDataset`` has neither indices to split nor a sampler to check: its loader is broadcast, and
a :class:`StreamLoader` has the members compare the first batch of every pass, so that a stream sharded by
global rank (each member another shard, the replica training on one) is refused instead of halving the epoch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any, Iterator, Optional, Sequence

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, default_collate

from lightning_shm.parallel.streams import call_seed, draws_of, generators_of
from lightning_shm.parallel.tp.rng import share_stream
from lightning_shm.runtime import Group
from lightning_shm.runtime.ops import barrier_reason, even_split


class MemberBatches:
    """A batch sampler yielding member ``group.index``'s rows of each batch of ``batches``.

    ``pending`` holds, in order, the row counts of every batch handed out and not yet gathered: a
    loader with workers draws indices ahead of the batches it returns. The members compare the first
    batch of every pass (one object all-gather per epoch): a sampler that shards by something other than
    the data-parallel rank -- a custom one given ``trainer.global_rank`` -- gave them different indices, and
    the gathered batch mixed their rows while each epoch covered part of the dataset, silently.
    """

    def __init__(self, batches: Any, group: Group) -> None:
        self.batches, self.group, self.size, self.index = batches, group, group.size, group.index
        self.pending: deque[tuple[int, ...]] = deque()

    @property
    def sampler(self) -> Any:  # Lightning calls set_epoch on it (a DistributedSampler)
        return getattr(self.batches, "sampler", None)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        for i, indices in enumerate(self.batches):
            indices = list(indices)
            if i == 0:
                _check_same_indices(indices, self.group, self.batches)
            if len(indices) < self.size:  # too few to split: everyone loads them, member 0's copy wins
                self.pending.append((len(indices),) + (0,) * (self.size - 1))
                yield indices
                continue
            b = even_split(len(indices), self.size)
            self.pending.append(tuple(b[k + 1] - b[k] for k in range(self.size)))
            yield indices[b[self.index]:b[self.index + 1]]


def _first_differing(seen: Sequence[Any]) -> Optional[int]:
    """The first member whose value differs from member 0's, or None."""
    return next((j for j, s in enumerate(seen) if s != seen[0]), None)


def _check_same_indices(indices: list[int], group: Group, batches: Any) -> None:
    seen = group.all_gather_object(indices, _INDICES)
    other = _first_differing(seen)
    if other is not None:
        sampler = getattr(batches, "sampler", batches)
        raise ValueError(
            f"the ranks {list(group.ranks)} compute one model replica (tensor-parallel members and pipeline stages) "
            f"on one batch, but their loader's {type(sampler).__name__} gave them different first batches (rank "
            f"{group.ranks[0]}: {seen[0][:8]}..., rank {group.ranks[other]}: {seen[other][:8]}...): it shards by "
            "something other than the data-parallel rank -- build it from trainer.strategy.distributed_sampler_kwargs "
            "(num_replicas, rank), not from trainer.world_size / global_rank.")


class SplitLoader(DataLoader):
    """A DataLoader whose batches are the tp group's, each member having loaded only its rows; each pass starts
    from member 0's default generator, with workers of the member's own seeds (see the module)."""

    def __init__(self, *args: Any, group: Group, member_batches: MemberBatches, **kwargs: Any) -> None:
        super().__init__(*args, batch_sampler=member_batches, **kwargs)
        self.tp_group = group
        self.member_batches = member_batches
        self.seeds_from: Optional[torch.Generator] = self.generator  # the loader's own; None: the global stream

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        pending = self.member_batches.pending
        pending.clear()  # rows drawn ahead by an iteration that was stopped early
        share_stream(self.tp_group)  # a sampler (or the workers' seed) drawing from it now gives every member one order
        # torch draws the workers' base seed when it starts them: every pass, or the first with persistent workers
        starts = self.num_workers and not (self.persistent_workers and self._iterator is not None)
        if starts and self.tp_group.index:
            self.generator = _member_seeds(self.seeds_from, self.tp_group.index)
        for part in super().__iter__():
            yield gather_rows(part, pending.popleft(), self.tp_group)


def _member_seeds(source: Optional[torch.Generator], member: int) -> torch.Generator:
    """The generator member ``member`` (> 0) of a split loader's group draws its workers' base seed from.

    Torch seeds worker ``k`` of a loader with ``base + k``, ``base`` drawn from the loader's generator (or the
    global stream), which every member holds alike: member 1's worker ``k`` would draw the same numbers for its
    rows of a batch as member 0's for its own -- a random augmentation applied alike to both shares. Member 0
    keeps torch's base (its rows augmented as one process's); every other member draws ``base`` from the same
    source (its stream advancing as member 0's does) and hashes it with its index::

        member 0   base = draw(source)                 workers: base + k
        member m   base = call_seed(draw(source), m)   workers: base + k
    """
    draw = int(torch.empty((), dtype=torch.int64).random_(generator=source).item())
    return torch.Generator().manual_seed(call_seed(draw, member))


_TAG = "_lightning_shm_group_batch"
# what a replica's members gather (a member on another path meets a gather of another reason: a mismatch)
_INDICES = barrier_reason("the replica members' sample indices, compared")
_ROWS = barrier_reason("the replica members' rows of a list in a split batch")
_SAMPLES = barrier_reason("the replica members' samples, compared")
_SAMPLERS = barrier_reason("the replica members' DistributedSampler settings, compared")


def is_group_batch(tensors: Sequence[torch.Tensor]) -> bool:
    """True if every tensor is one :func:`gather_rows` produced (the same on every member already);
    a tensor a hook made from it afterwards is not, and gets broadcast."""
    return bool(tensors) and all(getattr(t, _TAG, False) for t in tensors)


def why_not_splittable(loader: Any, auto: bool) -> Optional[str]:
    """None if ``loader`` can be split row by row, else the reason (for the error or the fallback)."""
    if type(loader) is not DataLoader:
        return f"the loader is a {type(loader).__name__}, not a torch DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return "the dataset is iterable (no indices to split)"
    if type(loader.batch_sampler) is not BatchSampler:
        return f"its batch sampler is a {type(loader.batch_sampler).__name__}, not a BatchSampler"
    if not getattr(loader, "in_order", True):
        return "it returns batches out of order (in_order=False)"
    if auto and loader.collate_fn is not default_collate:
        return "its collate_fn is not torch's default_collate (a batch-level collate needs the whole batch)"
    if loader.num_workers == 0 and (drawn := _draws_at_load(loader.dataset)):
        return (f"its dataset draws from random streams ({', '.join(drawn)}) as it loads a sample "
                "(random augmentations), and loading in this process each member would draw its rows' numbers "
                "from the same state -- its share of a batch augmented as every other member's, where one "
                "process draws each row's own (loader workers are seeded apart per member: num_workers > 0)")
    return None


def _draws_at_load(dataset: Any) -> list[str]:
    """The streams loading ``dataset[0]`` draws from -- global, or a generator the dataset keeps (every member holds
    a copy of it, in the same state) -- each put back. Only for a loader without workers: this process loads its
    samples anyway, so nothing it opens (a file, a database) reaches a worker unforked."""
    try:
        return draws_of(lambda: dataset[0], generators_of(dataset))
    except Exception:  # no sample 0 (keys of its own, an empty dataset): nothing known, nothing changed
        return []


def _loading_kwargs(loader: DataLoader) -> dict[str, Any]:
    """How ``loader`` loads (workers, collate, memory), for a loader rebuilt around its dataset."""
    return dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
                prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers,
                pin_memory_device=loader.pin_memory_device)


def split_loader(loader: DataLoader, group: Group) -> SplitLoader:
    """``loader`` rebuilt so that this member loads only its rows of each batch (see the module doc)."""
    return SplitLoader(loader.dataset, group=group, member_batches=MemberBatches(loader.batch_sampler, group),
                       **_loading_kwargs(loader))


def gather_rows(part: Any, rows: Sequence[int], group: Group) -> Any:
    """The group's batch from every member's ``part`` (``rows[m]`` rows on member ``m``), on every member.

    A batch too small to split (every member loaded all of it) is returned as loaded and untagged:
    the strategy's ``batch_to_device`` broadcasts member 0's copy, as for any batch not gathered here.
    """
    if not any(rows[1:]):
        return part
    return _gather(part, rows, group)


def _gather(obj: Any, rows: Sequence[int], group: Group) -> Any:
    """``obj`` (what default_collate returns: tensors in dicts, lists, tuples, namedtuples, and lists --
    tuples, from a namedtuple or tuple sample -- of per-sample values such as strings) with every
    member's rows. Members traverse equal structures in the same order, so their collectives match."""
    if isinstance(obj, torch.Tensor):
        out = _gather_tensor(obj, rows, group)
        setattr(out, _TAG, True)
        return out
    if isinstance(obj, Mapping):
        return type(obj)({k: _gather(v, rows, group) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)) and obj and not any(isinstance(x, (torch.Tensor, Mapping, list, tuple))
                                                          for x in obj):
        gathered = _gather_list(obj, rows, group)  # per-sample values (file names, ids)
        return gathered if isinstance(obj, list) else tuple(gathered)  # a tuple inside a namedtuple sample
    if isinstance(obj, (list, tuple)):
        items = [_gather(x, rows, group) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    raise ValueError(f"tp_batch='split' cannot gather a batch holding a {type(obj).__name__}; "
                     "use tp_batch='broadcast'")


def _gather_tensor(t: torch.Tensor, rows: Sequence[int], group: Group) -> torch.Tensor:
    mine = rows[group.index]
    if t.dim() == 0 or t.shape[0] != mine:
        raise ValueError(
            f"tp_batch='split': a batch tensor of shape {tuple(t.shape)} does not have this rank's {mine} rows "
            f"(rows per member {list(rows)}); its collate_fn does not batch along dim 0. Use tp_batch='broadcast'.")
    if len(set(rows)) == 1:  # equal shares: gather straight into the [T, rows, ...] result
        return group.all_gather(t.contiguous()).view(-1, *t.shape[1:])
    return torch.cat(group.all_gather_v(t.reshape(-1))).view(-1, *t.shape[1:])


def _gather_list(xs: Sequence[Any], rows: Sequence[int], group: Group) -> list:
    if len(xs) != rows[group.index]:
        raise ValueError(f"tp_batch='split': a {type(xs).__name__} of {len(xs)} items in the batch is not this rank's "
                         f"{rows[group.index]} rows (rows per member {list(rows)}). Use tp_batch='broadcast'.")
    return [x for member in group.all_gather_object(xs, _ROWS) for x in member]


class StreamLoader(DataLoader):
    """A plain DataLoader over an ``IterableDataset`` whose replica members compare the first batch of every pass.

    An iterable dataset has no sampler to inspect and no indices to split: every member loads the whole batch
    and ``batch_to_device`` broadcasts the first member's. A stream that shards itself by
    ``trainer.global_rank`` / ``world_size`` (a node split, ``split_dataset_by_node``) counts tp members and
    pipeline stages as data-parallel replicas: each member streams another shard, and the replica trains on
    its first member's alone -- half the epoch at tp=2 or pp=2, silently. Random augmentations drawn per rank
    also make the members' batches differ, but in float tensors only; so the members compare the shapes of
    every tensor and the values of the integer ones (labels, ids, tokens) -- one small all-gather per pass.
    """

    def __init__(self, *args: Any, group: Group, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tp_group = group

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        for i, batch in enumerate(super().__iter__()):
            if i == 0:
                _check_same_samples(batch, self.tp_group)
            yield batch


def stream_loader(loader: DataLoader, group: Group) -> StreamLoader:
    """``loader`` (a plain DataLoader over an IterableDataset) rebuilt as a :class:`StreamLoader`."""
    return StreamLoader(loader.dataset, group=group, batch_size=loader.batch_size, drop_last=loader.drop_last,
                        in_order=loader.in_order, **_loading_kwargs(loader))


def _samples_print(batch: Any) -> list[tuple]:
    """Per tensor of ``batch``: its shape, and for an integer or bool tensor two sums of its values."""
    prints: list[tuple] = []

    def add(t: torch.Tensor) -> None:
        if t.is_floating_point() or t.is_complex():
            prints.append(tuple(t.shape))
        else:
            flat = t.detach().reshape(-1).long()
            prints.append((tuple(t.shape), int(flat.sum()), int(flat[::7].sum())))

    apply_to_collection(batch, torch.Tensor, add)
    return prints


def _check_same_samples(batch: Any, group: Group) -> None:
    seen = group.all_gather_object(_samples_print(batch), _SAMPLES)
    other = _first_differing(seen)
    if other is not None:
        raise ValueError(
            f"the ranks {list(group.ranks)} compute one model replica (tensor-parallel members and pipeline stages) "
            f"on one batch, but their IterableDataset gave them first batches with different integer values or "
            f"shapes (rank {group.ranks[0]}: {seen[0]}, rank {group.ranks[other]}: {seen[other]}; per tensor: shape, "
            f"sums), and the replica would train on rank {group.ranks[0]}'s alone, skipping the others' samples. A "
            "stream that shards itself by trainer.global_rank / world_size counts tp members and pipeline stages as "
            "data-parallel replicas: shard it by trainer.strategy.distributed_sampler_kwargs (num_replicas, rank). "
            "If the members' draws differ on purpose (random masking at load time), pass tp_batch='broadcast' to "
            "train on the first member's batch.")


def check_replica_samplers(loader: Any, group: Group, expected: Mapping[str, int]) -> None:
    """Raise if the ranks of one model replica would load different samples through a ``DistributedSampler`` the
    user built (Lightning keeps one it finds): one made from ``trainer.world_size`` / ``global_rank`` counts the
    tp members and pipeline stages as data-parallel replicas, so each loads another part of the dataset, and the
    replica -- which computes on one batch (its first member's, or every member's rows gathered) -- would see only
    part of each epoch. ``expected``: the strategy's ``distributed_sampler_kwargs`` (num_replicas, rank). Every
    member calls this for the same loader (one object all-gather)."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler):
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    mine = (sampler.num_replicas, sampler.rank) if isinstance(sampler, DistributedSampler) else None
    seen = group.all_gather_object(mine, _SAMPLERS)
    if all(s == seen[0] for s in seen):
        return
    found = "; ".join(f"rank {r}: " + ("no DistributedSampler" if s is None else f"num_replicas={s[0]}, rank={s[1]}")
                      for r, s in zip(group.ranks, seen))
    raise ValueError(
        f"the ranks {list(group.ranks)} compute one model replica (tensor-parallel members and pipeline stages) on "
        f"one batch, but their loader's DistributedSampler gives each different samples ({found}). Build it from "
        f"trainer.strategy.distributed_sampler_kwargs (here num_replicas={expected['num_replicas']}, "
        f"rank={expected['rank']}), which counts data-parallel replicas, not from trainer.world_size / global_rank.")
