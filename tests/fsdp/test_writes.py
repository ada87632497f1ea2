"""A rank writing its own rows in place outside the optimizer step (in a batch's hook or at the top of its step),
while the others read every rank's rows without a collective: the writes must be fenced off from the reads."""

from __future__ import annotations

import copy
import re
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_shm import SHMFSDPStrategy, SHMModelParallel
from lightning_shm.models import MNISTClassifier
from lightning_shm.parallel.fsdp import FSDPState
from lightning_shm.parallel.fsdp.rows import RowBlock
from lightning_shm.runtime import launch
from lightning_shm.runtime.errors import CollectiveMismatchError
from lightning_shm.runtime.ops import Coll, arg_name
from tests.helpers import GLOBAL_BATCH, fit_seeded, flat_params, logged_floats


class ShrinksARowBlockEachBatch(MNISTClassifier):
    """Scales ``net.4.weight`` by 0.9 in place, under ``no_grad``, at every batch -- in ``on_train_batch_start`` or at
    the top of ``training_step`` (``where``) -- as SwAV normalizes its prototypes; scaling is not idempotent, so a
    row scaled twice or read before its scaling shows. ``through``: "parameters" finds the weight in
    ``named_parameters()`` (the rank's rows under FSDP); "attribute" reads ``self.net[4].weight`` (the rank's rows
    under ``gather="copy"``). After each batch, a forward without gradient is logged (summed over ranks and
    batches), as an end-of-batch metric would be.

    ``slow_rank`` (the one rank the test slows down) arrives 0.2 s late at its write and at its end-of-batch read:
    a rank whose write is not fenced off from the others' reads either reads rows another rank has already
    scaled for the next batch, or lets the others compute with its rows before it scaled them."""

    def __init__(self, where: str = "step", through: str = "parameters", slow_rank: int = -1, **kw):
        super().__init__(optimizer="adam", lr=0.01, **kw)
        self.where, self.through, self.slow_rank = where, through, slow_rank

    def _shrink(self) -> None:
        if self.global_rank == self.slow_rank:
            time.sleep(0.2)
        w = self.net[4].weight if self.through == "attribute" else dict(self.named_parameters())["net.4.weight"]
        with torch.no_grad():
            w.mul_(0.9)

    def on_train_batch_start(self, batch, batch_idx):
        if self.where == "hook":
            self._shrink()

    def training_step(self, batch, batch_idx):
        if self.where == "step":
            self._shrink()
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_rank == self.slow_rank:
            time.sleep(0.2)
        x = batch[0].to(self.dtype)  # (a step fetching its batches gets them unconverted: tests/test_loader_iter.py)
        with torch.no_grad():
            self.log("after_batch", self(x).sum(), on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True,
                     batch_size=len(x))


GATHERS = {"view": dict(gather="view"), "copy": dict(gather="copy"),
           "copy-prefetch": dict(gather="copy", prefetch=True)}


def _fsdp(gather: str) -> tuple[Any, int]:
    if gather == "dp2xtp2-shard":  # FSDP over the dp ranks of each tp rank: rows of the tp slices
        return SHMModelParallel(start_method="fork", data_parallel_size=2, tensor_parallel_size=2,
                                data_parallel="shard"), 4
    return SHMFSDPStrategy(start_method="fork", **GATHERS[gather]), 2


@pytest.mark.parametrize("gather, through", [("view", "parameters"), ("copy", "parameters"), ("copy", "attribute"),
                                             ("copy-prefetch", "attribute"), ("dp2xtp2-shard", "parameters")])
@pytest.mark.parametrize("where, accumulate", [("step", 1), ("step", 2), ("hook", 1), ("hook", 2)])
def test_a_rank_writing_its_rows_in_a_batch_trains_as_one_process(gather, through, where, accumulate):
    """Before, the barriers sat only around optimizer steps and before a step whose hooks had written: rank 0
    computed with rank 1's rows before rank 1 scaled them (a write in the step: 0.04 off one process), or scaled
    its own while rank 1 still read them after a microbatch that stepped no optimizer or in an end-of-batch forward
    (the logged sum: -56.54 against -56.47)."""
    def make(slow_rank: int = -1):
        return lambda: ShrinksARowBlockEachBatch(where, through, slow_rank)

    t_ref, ref = fit_seeded(make(), "auto", 1, GLOBAL_BATCH, ref=True, accumulate_grad_batches=accumulate,
                            samples=GLOBAL_BATCH * 2 * accumulate)
    strategy, devices = _fsdp(gather)
    t, got = fit_seeded(make(slow_rank=1), strategy, devices, GLOBAL_BATCH // 2, accumulate_grad_batches=accumulate,
                        samples=GLOBAL_BATCH * 2 * accumulate)
    torch.testing.assert_close(flat_params(got), flat_params(ref), rtol=0, atol=1e-9)
    assert logged_floats(t)["after_batch"] == pytest.approx(logged_floats(t_ref)["after_batch"], rel=1e-9)


class OnlyRankZeroShrinks(ShrinksARowBlockEachBatch):
    def _shrink(self) -> None:
        if self.global_rank == 0:
            super()._shrink()


@pytest.mark.parametrize("gather", ["view", "copy"])
def test_a_write_on_some_ranks_only_stops_with_the_reason(gather):
    """Rank 0 waits for the others to write their rows before reading them; rank 1 goes on into the next collective.
    Whichever raises first names the write (the one process's model does not exist: its rows differ by rank)."""
    with pytest.raises(CollectiveMismatchError, match=r"wrote its rows of (FSDP unit 'net.4'|a parameter) in place"
                       ) as info:
        fit_seeded(lambda: OnlyRankZeroShrinks("step"), SHMFSDPStrategy(start_method="fork", gather=gather), 2,
                   GLOBAL_BATCH // 2)
    # the unit's message keeps the rank it met: the report shows that rank's call and loop position beside it
    notes = "\n".join(info.value.__notes__)
    other = 1 - int(re.search(r"raised in lightning_shm worker rank (\d)", notes).group(1))
    assert info.value.peer == other and f"rank {other} was here" in notes, notes


def _barriers_before_forwards(world, gather):
    """The barriers three forwards meet: after nothing was written, after net.4's rows were, after net.1's and
    net.4's were (the first gather's barrier covers every unit written before it)."""
    torch.manual_seed(0)
    model = MNISTClassifier()
    group = world.group()
    sharded = FSDPState(model, group, gather=gather)
    rows = dict(model.named_parameters())
    met, barrier = [], group.barrier
    group.barrier = lambda *a, **kw: (met.append(kw.get("why", 0)), barrier(*a, **kw))[1]
    x = torch.randn(4, 1, 28, 28)
    counts = []
    with torch.no_grad():
        for written in ([], ["net.4.weight"], ["net.1.weight", "net.4.weight"], []):
            for name in written:
                rows[name].mul_(0.9)
            before = len(met)
            model(x)
            counts.append(len(met) - before)
    sharded.close()
    return counts, {arg_name(Coll.BARRIER, why) for why in met}


@pytest.mark.parametrize("gather", ["view", "copy"])
def test_a_forward_meets_the_others_once_after_a_write_and_not_without_one(gather):
    for counts, reasons in launch(_barriers_before_forwards, 2, gather, start_method="fork"):
        assert counts == [0, 1, 1, 0]
        assert len(reasons) == 1 and "why: FSDP: this rank wrote its rows" in reasons.pop()  # it says why it waits


class MomentumTeacher(MNISTClassifier):
    """A frozen copy of the network, moved towards it after every batch through ``.data`` -- MoCo's and BYOL's
    ``p_k.data = p_k.data * m + p_q.data * (1 - m)`` ("assign") or DINO's ``p_k.data.mul_(m).add_(...)``
    ("inplace") -- at the end of the batch or at the top of the step (``where``); its output joins the loss, so a
    teacher that is not one process's changes the student too. ``slow_rank`` arrives 0.2 s late at the update."""

    def __init__(self, idiom: str, where: str, slow_rank: int = -1):
        super().__init__(optimizer="adam", lr=0.01)
        self.idiom, self.where, self.slow_rank = idiom, where, slow_rank
        self.teacher = copy.deepcopy(self.net).requires_grad_(False)

    def _momentum_update(self, m: float = 0.5) -> None:
        if self.global_rank == self.slow_rank:
            time.sleep(0.2)
        for q, k in zip(self.net.parameters(), self.teacher.parameters()):
            if self.idiom == "assign":
                k.data = k.data * m + q.data * (1 - m)
            else:
                k.data.mul_(m).add_(q.data, alpha=1 - m)

    def training_step(self, batch, batch_idx):
        if self.where == "step":
            self._momentum_update()
        x, y = batch[0].to(self.dtype), batch[1]
        out = self.net(x)
        with torch.no_grad():
            target = self.teacher(x)
        return F.cross_entropy(out, y) + 0.5 * F.mse_loss(out, target)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.where == "end":
            self._momentum_update()


@pytest.mark.parametrize("gather, idiom, where", [("view", "assign", "end"), ("view", "inplace", "step"),
                                                  ("copy", "assign", "step"), ("copy", "inplace", "step"),
                                                  ("dp2xtp2-shard", "assign", "end")])
def test_a_momentum_teacher_updated_through_data_trains_as_one_process(gather, idiom, where):
    """Before the rows were a :class:`RowBlock`, ``.data =`` moved the teacher's rows to private memory (the shared
    rows every forward reads stayed the initial weights: 0.046 off one process), and a write through ``.data``
    changed no version counter, so no rank waited for the others' rows (0.036 off)."""
    samples = GLOBAL_BATCH * 4
    _, ref = fit_seeded(lambda: MomentumTeacher(idiom, where), "auto", 1, GLOBAL_BATCH, ref=True, samples=samples)
    strategy, devices = _fsdp(gather)
    _, got = fit_seeded(lambda: MomentumTeacher(idiom, where, slow_rank=1), strategy, devices, GLOBAL_BATCH // 2,
                        samples=samples)
    torch.testing.assert_close(flat_params(got.teacher), flat_params(ref.teacher), rtol=0, atol=1e-9)
    torch.testing.assert_close(flat_params(got), flat_params(ref), rtol=0, atol=1e-9)


def test_a_row_block_is_a_parameter_whose_data_writes_count_and_stay_on_the_rows():
    """Worker-free: the behaviours the test above relies on, one by one."""
    rows = torch.zeros(6)
    p = RowBlock(rows[:4].view(2, 2))
    p.of = "rows 0:2 of 'w' (3, 2)"
    assert isinstance(p, torch.nn.Parameter) and p.requires_grad and type(p * 2) is torch.Tensor
    version = p._version
    p.data.add_(1.0)  # through .data: the parameter's version counter moves (a plain .data has its own)
    assert p._version > version and rows[:4].eq(1.0).all()
    p.data = torch.full((2, 2), 3.0)  # copied into the rows, not a new storage
    assert p.data_ptr() == rows.data_ptr() and rows.tolist() == [3.0] * 4 + [0.0] * 2
    p.data = p  # module.to(its own device) hands the parameter back: nothing to do
    with pytest.raises(ValueError, match=r"rows 0:2 of 'w' \(3, 2\).*shape \(2, 2\) torch.float32.*got \(3, 2\)"):
        p.data = torch.zeros(3, 2)  # the whole parameter, not this rank's rows
    with pytest.raises(ValueError, match="torch.float64"):
        p.data = torch.zeros(2, 2, dtype=torch.float64)
    twin = copy.deepcopy(p)  # a copy (of a model, an averaged model's) is nobody's rows
    assert type(twin) is torch.nn.Parameter and twin.data_ptr() != rows.data_ptr() and twin.eq(3.0).all()
    assert "rows 0:2 of 'w'" in repr(p)


class ChannelsLastAtFitStart(MNISTClassifier):
    """A small CNN that converts itself to channels_last in ``on_fit_start`` (after the strategy has sharded it):
    ``nn.Module._apply`` assigns every 4-d parameter's ``.data``."""

    def __init__(self):
        super().__init__(optimizer="adam", lr=0.01)
        self.net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                       torch.nn.Flatten(), torch.nn.Linear(4 * 14 * 14, 10))

    def on_fit_start(self):
        self.to(memory_format=torch.channels_last)


@pytest.mark.parametrize("gather", ["view", "copy"])
def test_a_module_converting_its_memory_format_after_setup_trains_as_one_process(gather):
    """Before the rows were a :class:`RowBlock`, the conversion gave the convolution's rows private storage: every
    forward read the shared rows, which the optimizer no longer updated (0.012 off one process after 3 steps)."""
    samples = GLOBAL_BATCH * 3
    _, ref = fit_seeded(ChannelsLastAtFitStart, "auto", 1, GLOBAL_BATCH, ref=True, samples=samples)
    strategy, devices = _fsdp(gather)
    _, got = fit_seeded(ChannelsLastAtFitStart, strategy, devices, GLOBAL_BATCH // 2, samples=samples)
    torch.testing.assert_close(flat_params(got), flat_params(ref), rtol=0, atol=1e-9)


def _what_each_row_block_is(world):
    torch.manual_seed(0)
    model = MNISTClassifier()
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    sharded = FSDPState(model, world.group())
    described = {n: (p.of, p.shape[0]) for n, p in model.named_parameters()}
    sharded.close()
    return full, described


def test_each_row_block_names_its_own_parameter_and_rows():
    """What a refused ``.data =`` names (``RowBlock.of``): each block's own parameter, not its unit's last one."""
    for rank, (full, described) in enumerate(launch(_what_each_row_block_is, 2, start_method="fork")):
        for name, (of, rows) in described.items():
            first = 0 if rank == 0 else full[name][0] - rows
            assert of == f"rows {first}:{first + rows} of {name!r} {full[name]}", of
