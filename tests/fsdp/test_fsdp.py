"""shm_fsdp: parity with one process and with shm_ddp, shard sizes, memory, checkpoints, errors."""

from __future__ import annotations

import copy
import functools
import math
import time

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning_shm  # noqa: F401
from lightning_shm import SHMFSDPStrategy, SHMModelParallel
from lightning_shm.models import MNISTClassifier
from lightning_shm.parallel.fsdp import FSDPState, UnitPolicy, find_units
from lightning_shm.parallel.state import ModelState
from lightning_shm.runtime import launch
from tests.helpers import (
    GLOBAL_BATCH,
    SEED,
    CompiledClassifier,
    MeanOverTokens,
    SchedClassifier,
    StepsEveryOptimizer,
    check_plain_checkpoint,
    fit_adam64,
    fit_seeded,
    flat_params,
    loader,
    mnist_like,
    reference_loader,
    train_mnist,
    trainer,
)


@pytest.fixture(scope="module")
def references():
    return {opt: train_mnist("auto", 1, opt, batch=GLOBAL_BATCH, ref=True) for opt in ("sgd", "adam")}


# ---------------------------------------------------------------------- parity
@pytest.mark.parametrize("world_size", [2, 3, 4])  # 3: every unit's shards are uneven (padded)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fsdp_equals_one_process_and_ddp(references, world_size, optimizer):
    got = train_mnist("shm_fsdp_fork", world_size, optimizer, batch=GLOBAL_BATCH // world_size)
    torch.testing.assert_close(got, references[optimizer], rtol=0, atol=1e-5)
    ddp = train_mnist("shm_ddp_fork", world_size, optimizer, batch=GLOBAL_BATCH // world_size)
    torch.testing.assert_close(got, ddp, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kwargs", [dict(gather="copy"), dict(gather="copy", reshard_after_forward=False),
                                    dict(unit_policy=100_000), dict(gather="copy", prefetch=True)],
                         ids=["copy", "copy-no-reshard", "merged-units", "copy-prefetch"])
def test_fsdp_variants_equal_one_process(references, kwargs):
    got = train_mnist(SHMFSDPStrategy(start_method="fork", **kwargs), 2, "adam", batch=GLOBAL_BATCH // 2)
    torch.testing.assert_close(got, references["adam"], rtol=0, atol=1e-5)


def test_a_compiled_model_equals_one_process_uncompiled(references):
    """torch.compile'd Sequential (eager backend): dynamo traces the units' forward hooks too; the result
    must not change."""
    got = train_mnist("shm_fsdp_fork", 2, "sgd", batch=GLOBAL_BATCH // 2, model_cls=CompiledClassifier)
    torch.testing.assert_close(got, references["sgd"], rtol=0, atol=1e-5)


def test_global_norm_clipping_scheduler_and_accumulation():
    kw = dict(model_cls=SchedClassifier, gradient_clip_val=0.05, accumulate=2)
    ref = train_mnist("auto", 1, "sgd", batch=GLOBAL_BATCH, ref=True, **kw)
    got = train_mnist("shm_fsdp_fork", 3, "sgd", batch=GLOBAL_BATCH // 3, **kw)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- sharding and memory
def test_default_units_are_the_parameter_owning_children_of_the_sequential():
    units = find_units(MNISTClassifier(), UnitPolicy())
    assert [u.name for u in units] == ["net.1", "net.2", "net.4", "net.5", "net.7"]
    assert [u.numel for u in units] == [200_960, 512, 16_448, 128, 650]
    merged = find_units(MNISTClassifier(), UnitPolicy(min_unit_params=100_000))
    assert [u.numel for u in merged] == [200_960, 512 + 16_448 + 128 + 650]


def _shard_and_step(world, reshard, gather="copy", twice=False):
    torch.manual_seed(0)
    model = MNISTClassifier(optimizer="adam")
    if twice:  # a frozen unit in the middle, which backward passes through (freed by its input's gradient hook)
        model.net[4].requires_grad_(False)
    sharded = FSDPState(model, world.group(), reshard_after_forward=reshard, gather=gather)
    opt = model.configure_optimizers()
    sharded.watch([opt])
    x = torch.randn(16, 1, 28, 28)
    sharded.stats.reset_peak()
    seen = []  # where net.1's full weight lived during its forward
    hook = model.net[1].register_forward_pre_hook(lambda m, _: seen.append(m.weight.data_ptr()))  # after the unit's
    loss = nn.functional.cross_entropy(model(x), torch.zeros(16, dtype=torch.long))
    hook.remove()
    unit = sharded.units[0]
    in_common = unit.common is not None and unit.common.data_ptr() == seen[0]
    live_before_backward = sharded.stats.live
    gen = world.group()._barrier.gen
    if twice:  # the graph kept for a second backward: each gathers the units again and frees them after
        loss.backward(retain_graph=True)
    loss.backward()
    backward_barriers = world.group()._barrier.gen - gen  # the group's barriers passed during backward
    opt.step()  # ends with the barrier (watch): every shard written before anyone gathers
    with torch.no_grad():
        sharded.stats.reset_peak()
        model(x)
        forward_only_peak = sharded.stats.peak
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return (shapes, sharded.persistent_bytes(opt), sharded.stats.live, forward_only_peak,
            [u.numel * 4 for u in sharded.units], [n for n, p in model.named_parameters()
                                                  if any(p is q for q in opt.param_groups[0]["params"])],
            live_before_backward, backward_barriers, in_common)


FULL = {"net.1.weight": (256, 784), "net.1.bias": (256,), "net.2.weight": (256,), "net.2.bias": (256,),
        "net.4.weight": (64, 256), "net.4.bias": (64,), "net.5.weight": (64,), "net.5.bias": (64,),
        "net.7.weight": (10, 64), "net.7.bias": (10,)}


@pytest.mark.parametrize("gather", ["view", "copy"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_each_rank_holds_its_rows_of_every_parameter_under_its_own_name(world_size, gather):
    for rank, (shapes, persistent, live, fwd_peak, unit_bytes, opt_names, _, barriers, in_common) in enumerate(
            launch(_shard_and_step, world_size, True, gather, start_method="fork")):
        assert list(shapes) == list(FULL)  # the module's own names, in its order
        for name, full in FULL.items():  # rows split like even_split: the first rows % W ranks get one more
            rows = full[0] // world_size + (1 if rank < full[0] % world_size else 0)
            assert shapes[name] == (rows, *full[1:]), name
        mine = sum(math.prod(s) for s in shapes.values()) * 4
        one_row_each = sum(math.prod(full[1:]) for full in FULL.values()) * 4
        assert abs(mine - 218_698 * 4 / world_size) <= one_row_each  # 1/W of the model, within a row per parameter
        # Adam: exp_avg and exp_avg_sq like each parameter's rows, plus one float32 `step` per parameter
        assert persistent == {"params": mine, "grads": mine, "optimizer": 2 * mine + 10 * 4}
        assert live == 0  # nothing unsharded survives a step
        if gather == "copy":
            assert fwd_peak == max(unit_bytes) and not in_common  # one unit's private full parameters at a time
        else:
            assert fwd_peak == 0 and in_common  # the forward computed on the shared rows: no private copy
        assert opt_names == list(FULL)  # configure_optimizers saw the module's own parameters
        # backward: one reduce-scatter per unit (weight and bias together, one round each), nothing else
        assert barriers == len(unit_bytes) == 5


@pytest.mark.parametrize("twice", [False, True], ids=["one-backward", "two-backwards"])
@pytest.mark.parametrize("reshard", [True, False])
def test_units_are_freed_after_forward_or_kept_until_backward(reshard, twice):
    """gather="copy": ZeRO-3 frees every unit after its forward and gathers it again for backward; without
    resharding the units stay gathered from forward to backward. Either way nothing full survives the step, also
    after a second backward through the kept graph (which gathers them again)."""
    (_, _, live, fwd_peak, unit_bytes, _, before_backward, _, _), _ = launch(_shard_and_step, 2, reshard, "copy",
                                                                             twice, start_method="fork")
    assert before_backward == (0 if reshard else sum(unit_bytes))
    assert live == 0 and fwd_peak == max(unit_bytes)  # a no-grad forward frees each unit at once either way


def _steps_with_prefetch(world, prefetch):
    torch.manual_seed(0)
    model = MNISTClassifier(optimizer="adam")
    sharded = FSDPState(model, world.group(), prefetch=prefetch, gather="copy")
    opt = model.configure_optimizers()
    sharded.watch([opt])
    state = ModelState(model, list(MNISTClassifier().state_dict()), list(FULL), sharded.placements(),
                       before_load=sharded.before_shards_written, after_load=sharded.after_shards_written)
    torch.manual_seed(1 + world.rank)
    outs, peaks = [], []
    for _ in range(3):
        x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
        sharded.begin_step()
        sharded.stats.reset_peak()
        nn.functional.cross_entropy(model(x), y).backward()
        peaks.append(sharded.stats.peak)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            outs.append(model(x))
    # a forward cut short leaves a prefetched gather behind; new weights must not be served from it
    with torch.no_grad():
        model.net[1](model.net[0](x))
    torch.manual_seed(7)  # the same new weights on every rank
    other = MNISTClassifier(optimizer="adam")
    state.load_full_state_dict(other.state_dict())
    with torch.no_grad():
        outs.append(model(x) - other(x))
    live = sharded.stats.live
    started = sharded.prefetcher.started if sharded.prefetcher else 0
    sharded.close()
    return torch.cat([p.detach().reshape(-1) for p in sharded.shards()]), outs, peaks, live, started


def test_prefetch_changes_nothing_but_the_peak():
    plain = launch(_steps_with_prefetch, 2, False, start_method="fork")
    pre = launch(_steps_with_prefetch, 2, True, start_method="fork")
    for (s0, o0, p0, live0, n0), (s1, o1, p1, live1, n1) in zip(plain, pre):
        assert torch.equal(s0, s1)  # bitwise: the same copies, only earlier and on another thread
        for a, b in zip(o0, o1):
            assert torch.equal(a, b)
        assert torch.equal(o1[-1], torch.zeros_like(o1[-1]))  # the stale prefetch was dropped
        assert n0 == 0 and n1 > 0 and live0 == live1 == 0
        # full parameters alive at once: net.1 alone without prefetch; net.1 plus the prefetched net.2 with it
        assert p0 == [200_960 * 4] * 3 and p1 == [(200_960 + 512) * 4] * 3


def _held_grad_sink(world):
    """A held "view" unit: its blocks share the storage of the held full parameters, so a block must not
    be taken for one of them (its offset would land its gradient on other rows)."""
    torch.manual_seed(0)
    model = MNISTClassifier()
    sharded = FSDPState(model, world.group())
    unit = sharded.units[2]  # net.4: Linear(256, 64)
    sharded.hold()
    shard = unit.blocks[0].shard
    took_block = sharded.grad_sink(shard, torch.ones_like(shard))
    weight = unit.params_of(unit.held)[0]  # what the module computes with while held
    took_weight = sharded.grad_sink(weight, torch.full(weight.shape, float(world.rank + 1)))
    sharded.release()
    return took_block, took_weight, shard.grad


def test_a_held_view_units_gradient_sink_takes_full_parameters_not_blocks():
    for took_block, took_weight, grad in launch(_held_grad_sink, 2, start_method="fork"):
        assert not took_block and took_weight
        torch.testing.assert_close(grad, torch.full_like(grad, 1.5))  # the mean of 1 and 2, this rank's rows


def _forward_between_backward_and_step(world):
    """Rank 1 runs a forward without gradients after backward, late; rank 0 steps at once. The step must
    wait: rank 1 gathers rank 0's shards and must see the weights before the step, as one process would."""
    torch.manual_seed(0)
    model = MNISTClassifier()
    sharded = FSDPState(model, world.group())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sharded.watch([opt])
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    sharded.begin_step()
    nn.functional.cross_entropy(model(x), y).backward()
    if world.rank == 1:
        time.sleep(0.3)
        with torch.no_grad():
            late = model(x)
    opt.step()
    sharded.close()
    return late if world.rank == 1 else None


def test_no_rank_writes_shards_another_still_reads():
    torch.manual_seed(0)
    plain = MNISTClassifier()
    x = torch.randn(8, 1, 28, 28)
    with torch.no_grad():
        expected = plain(x)
    got = launch(_forward_between_backward_and_step, 2, start_method="fork")[1]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


class _HeadKeptAlone(nn.Module):
    """One unit of every layer (a large ``min_unit_params``); the Linear inside its middle layer is kept under a
    second name: the head runs inside the unit's run and alone -- a placement of the unit."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Sequential(nn.Linear(16, 16)), nn.Tanh(),
                                 nn.Linear(16, 4))
        self.head = self.net[2][0]

    def forward(self, x):
        return self.net(x).pow(2).mean() + self.head(x.repeat(1, 2)).pow(2).mean()


def _placed_head(world, gather):
    torch.manual_seed(0)
    model = _HeadKeptAlone()
    plain = copy.deepcopy(model)
    sharded = FSDPState(model, world.group(), policy=10**6, gather=gather)
    x = torch.randn(6, 8) + world.rank  # a batch per rank
    boom = model.net[2].register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        model(x)  # the unit's run opened and never closed
    boom.remove()
    sharded.begin_step()
    sharded.stats.reset_peak()
    gen = world.group()._barrier.gen
    model(x).backward()
    barriers = world.group()._barrier.gen - gen
    grads: dict[str, torch.Tensor] = {}  # one process: the mean of every rank's batch's gradients
    for r in range(world.size):
        plain.zero_grad()
        plain(x - world.rank + r).backward()
        for n, p in plain.named_parameters():
            grads[n] = grads.get(n, 0) + p.grad / world.size
    unit = sharded.units[0]
    want = {}
    for b, (n, g) in zip(unit.blocks, grads.items()):
        lo = b.row_start(world.rank)
        want[n] = g[lo:lo + b.rows[world.rank]]
    return barriers, sharded.stats.peak, unit.numel * 4, {n: p.grad for n, p in model.named_parameters()}, want


@pytest.mark.parametrize("gather", ["view", "copy"])
def test_a_layer_of_a_unit_called_alone_gathers_it_once_and_inside_the_run_not_again(gather):
    """Called inside the unit's run the head finds the unit gathered (no second copy, no second reduce-scatter);
    called alone it gathers it (one more reduce-scatter). A forward that raised inside the run leaves nothing
    open for the next step."""
    for barriers, peak, unit_bytes, mine, want in launch(_placed_head, 2, gather, start_method="fork"):
        assert barriers == 2  # one reduce-scatter per application of the unit: the run, the head alone
        assert peak == (unit_bytes if gather == "copy" else 0)
        assert list(mine) == list(want)
        for n in want:
            torch.testing.assert_close(mine[n], want[n], rtol=0, atol=1e-6)


def _step_scope(world):
    torch.manual_seed(0)
    model = MNISTClassifier()
    plain = copy.deepcopy(model)
    sharded = FSDPState(model, world.group())
    x = torch.randn(4, 1, 28, 28)
    with sharded.step_scope():
        inside = tuple(model.net[7].weight.shape)  # read by attribute in the step: the full parameter
        head = nn.functional.linear(model.net[:7](x), model.net[7].weight, model.net[7].bias)
    outside = tuple(model.net[7].weight.shape)  # between steps: the rank's rows
    with pytest.raises(RuntimeError, match="boom"), sharded.step_scope():
        raise RuntimeError("boom")
    after_failure = [n for n in ("weight", "bias") if n in model.net[7].__dict__]  # nothing left shown
    # every rank scaling the shared rows in place would scale some twice: refused, once all are hidden again
    with pytest.raises(RuntimeError, match=r"(?s)the step \(through a module's attribute\) changed parameter\(s\) "
                                           r"\['net.7.weight'\] in place.*the step through named_parameters\(\)"
                       ), sharded.step_scope(), torch.no_grad():
        model.net[7].weight.mul_(1.0)
    # assigning its .data (MoCo's momentum update) would give it a storage of its own, which the next gather replaces
    with pytest.raises(RuntimeError, match=r"\['net.7.weight'\] in place or assigned their .data"), \
            sharded.step_scope():
        model.net[7].weight.data = model.net[7].weight.data * 1.0
    # nor a write through its .data (DINO's momentum update), which a plain tensor's own version counter hid
    with pytest.raises(RuntimeError, match=r"\['net.7.weight'\] in place or assigned their .data"), \
            sharded.step_scope():
        model.net[7].weight.data.mul_(1.0)
    after_failure += [n for n in ("weight", "bias") if n in model.net[1].__dict__]
    head.pow(2).mean().backward()
    plain_head = nn.functional.linear(plain.net[:7](x), plain.net[7].weight, plain.net[7].bias)
    plain_head.pow(2).mean().backward()
    rows = sharded.units[-1].blocks[0].rows
    lo = sum(rows[:world.rank])
    grad, want = model.net[7].weight.grad.clone(), plain.net[7].weight.grad[lo:lo + rows[world.rank]]
    # a whole step's backward: each unit's reduce-scatter as soon as backward has passed its layer
    events = []
    for u in sharded.units:
        u.reduce_scatter = (lambda f, name: lambda *a, **k: (events.append(f"reduce {name}"), f(*a, **k))[1])(
            u.reduce_scatter, u.name)
    model.net[1].register_full_backward_hook(lambda *_: events.append("backward net.1"))
    sharded.begin_step()
    with sharded.step_scope():
        loss = nn.functional.cross_entropy(model(x), torch.zeros(4, dtype=torch.long))
    loss.backward()
    return inside, outside, after_failure, grad, want, events


def test_the_step_scope_shows_full_parameters_and_sends_their_gradients_to_the_rows():
    for inside, outside, after_failure, grad, want, events in launch(_step_scope, 2, start_method="fork"):
        assert inside == (10, 64) and outside == (5, 64) and after_failure == []
        torch.testing.assert_close(grad, want, rtol=0, atol=1e-6)  # the same batch on both ranks: the mean is it
        # the layers' own gathers: net.7's gradient left before backward reached net.1 (an edge made when the
        # step began would run after every other node: every unit's full gradient alive at once)
        assert events == ["reduce net.7", "reduce net.5", "reduce net.4", "reduce net.2", "backward net.1",
                          "reduce net.1"]


# ---------------------------------------------------------------------- checkpoints
def test_checkpoint_is_plain_and_resumes_on_ddp_and_other_world_size(tmp_path):
    ds = mnist_like(GLOBAL_BATCH * 4)
    straight, _ = fit_adam64("shm_fsdp_fork", 2, 3, GLOBAL_BATCH // 2, ds)
    _, path = fit_adam64("shm_fsdp_fork", 2, 1, GLOBAL_BATCH // 2, ds, ckpt_dir=tmp_path)
    _, plain, adam = check_plain_checkpoint(path)
    assert adam.state[plain.net[1].weight]["exp_avg"].shape == (256, 784)
    for strategy, devices in (("shm_ddp_fork", 2), ("shm_fsdp_fork", 3)):
        resumed, _ = fit_adam64(strategy, devices, 3, GLOBAL_BATCH // devices, ds, ckpt_path=path)
        torch.testing.assert_close(resumed, straight, rtol=0, atol=1e-6)


def test_save_checkpoint_in_the_main_process_after_fit(tmp_path):
    pl.seed_everything(0)
    model = MNISTClassifier()
    t = trainer(strategy="shm_fsdp_fork", devices=2, max_epochs=1)
    t.fit(model, loader(mnist_like(48), 12))
    t.save_checkpoint(tmp_path / "main.ckpt")  # main process: the plain, fully trained module
    restored = MNISTClassifier.load_from_checkpoint(tmp_path / "main.ckpt")
    torch.testing.assert_close(flat_params(restored), flat_params(model))


def test_validate_and_predict_run_on_shards():
    pl.seed_everything(0)
    model = MNISTClassifier()
    ds = mnist_like(50)
    single = trainer(devices=1).predict(model, DataLoader(ds, batch_size=10))
    ours = trainer(strategy="shm_fsdp_fork", devices=2).predict(model, DataLoader(ds, batch_size=10))
    assert torch.equal(torch.cat(ours), torch.cat(single))
    v1 = trainer(devices=1).validate(model, DataLoader(ds, batch_size=10), verbose=False)[0]
    v2 = trainer(strategy="shm_fsdp_fork", devices=2).validate(model, DataLoader(ds, batch_size=10), verbose=False)[0]
    assert v2["val_acc"] == pytest.approx(v1["val_acc"]) and v2["val_loss"] == pytest.approx(v1["val_loss"], abs=1e-5)


# ---------------------------------------------------------------------- errors
class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 1))  # 3 parameters


class TinyRegression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))  # weights of 3 and 1 rows

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_more_ranks_than_rows_leaves_some_ranks_empty_blocks_and_stays_exact():
    """4 ranks, a Linear(3, 1): one rank holds its single row, three hold empty blocks -- still one process."""
    ds = torch.utils.data.TensorDataset(torch.randn(16, 2, generator=torch.Generator().manual_seed(0)),
                                        torch.randn(16, 1, generator=torch.Generator().manual_seed(1)))

    def run(strategy, devices, batch, ref=False):
        pl.seed_everything(SEED)
        model = TinyRegression()
        dl = reference_loader(ds, batch, SEED) if ref else loader(ds, batch)
        trainer(strategy=strategy, devices=devices, max_epochs=2).fit(model, dl)
        return flat_params(model)

    torch.testing.assert_close(run("shm_fsdp_fork", 4, 2), run("auto", 1, 8, ref=True), rtol=0, atol=1e-6)


def test_policy_selecting_nothing_fails_before_launch():
    strategy = SHMFSDPStrategy(start_method="fork", unit_policy=lambda name, module: False)
    with pytest.raises(ValueError, match="no module with parameters"):
        trainer(strategy=strategy, devices=2, max_epochs=1).fit(Tiny(), DataLoader(torch.randn(8, 2)))


def test_copy_options_without_a_copy_are_refused_at_construction():
    """prefetch / reshard_after_forward shape gather="copy"'s private copies; "view" makes none."""
    for kwargs in (dict(prefetch=True), dict(reshard_after_forward=False)):
        with pytest.raises(ValueError, match="gather='view' makes none"):
            SHMFSDPStrategy(**kwargs)
        SHMFSDPStrategy(gather="copy", **kwargs)  # fine
    with pytest.raises(ValueError, match=r"gather must be one of \('view', 'copy'\), got 'zero'"):
        SHMFSDPStrategy(gather="zero")


def test_bad_policy_type():
    for bad in ("layers", {int}, set()):
        with pytest.raises(ValueError, match="unit policy must be None, an int .*, a set of nn.Module classes"):
            SHMFSDPStrategy(unit_policy=bad)


def test_a_set_of_module_classes_makes_their_instances_units_and_reaches_the_fork_servers_workers():
    """Lightning's ``FSDPStrategy(auto_wrap_policy={Block})``: the same set is a unit policy here, selecting what the
    callable ``isinstance(module, Block)`` selects. Such a callable written inline (a lambda) cannot be pickled for
    the workers of the default fork server; the set can."""
    from lightning_shm.models.transformer import Block

    model = MNISTClassifier(arch="transformer", dim=16, depth=2, heads=2)
    units = [u.name for u in find_units(model, UnitPolicy.parse({Block}))]
    assert units == [u.name for u in find_units(model, UnitPolicy.parse(lambda name, m: isinstance(m, Block)))]
    assert {"net.1", "net.2"} <= set(units) and not any(u.startswith(("net.1.", "net.2.")) for u in units)
    ref = train_mnist("auto", 1, "sgd", batch=GLOBAL_BATCH, ref=True)
    got = train_mnist(SHMFSDPStrategy(unit_policy={nn.Linear, nn.LayerNorm}), 2, "sgd", batch=GLOBAL_BATCH // 2)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- the module's own parameters in optimizers
class DecayGroups(MNISTClassifier):
    """The usual split: weight decay on matrices only, none on biases and norm weights -- chosen by name."""

    def configure_optimizers(self):
        named = list(self.named_parameters())
        decay = [p for n, p in named if n.endswith(".weight") and p.dim() > 1]
        rest = [p for n, p in named if not (n.endswith(".weight") and p.dim() > 1)]
        assert [n for n, _ in named] == [f"net.{i}.{w}" for i in (1, 2, 4, 5, 7) for w in ("weight", "bias")]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.5}, {"params": rest, "weight_decay": 0.0}],
                                 lr=1e-2)


class TwoOptimizers(StepsEveryOptimizer):
    """Two optimizers over slices of ``parameters()`` by position, stepped by hand (manual optimization)."""

    def configure_optimizers(self):
        params = list(self.parameters())
        return torch.optim.SGD(params[:4], lr=0.1, momentum=0.9), torch.optim.Adam(params[4:], lr=1e-2)


@pytest.mark.parametrize("model_cls", [DecayGroups, TwoOptimizers], ids=["by-name", "by-position"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_parameter_groups_mean_what_they_mean_in_one_process(tmp_path, model_cls, world_size):
    """Groups chosen by name or position see the module's own parameters: the updates are one process's,
    and the main process's checkpoint holds the optimizer state one process would save."""

    def run(strategy, devices, batch, ref=False):
        pl.seed_everything(SEED)
        model = model_cls()
        ds = mnist_like(GLOBAL_BATCH * 3, seed=1)
        dl = reference_loader(ds, batch, SEED) if ref else loader(ds, batch)
        t = trainer(strategy=strategy, devices=devices, max_epochs=1, precision="64-true")
        t.fit(model, dl)
        path = tmp_path / f"{devices}.ckpt"
        t.save_checkpoint(path)
        return flat_params(model), torch.load(path, weights_only=False)["optimizer_states"]

    ref, ref_opt = run("auto", 1, GLOBAL_BATCH, ref=True)
    got, got_opt = run("shm_fsdp_fork", world_size, GLOBAL_BATCH // world_size)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    assert len(got_opt) == len(ref_opt)
    for mine, theirs in zip(got_opt, ref_opt):
        assert [g["params"] for g in mine["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
        assert sorted(mine["state"]) == sorted(theirs["state"])
        for i, st in theirs["state"].items():
            for k, v in st.items():
                torch.testing.assert_close(mine["state"][i][k], v, rtol=0, atol=1e-6)


class _Tokens(nn.Module):
    def forward(self, x):
        return (x.view(x.shape[0], -1)[:, ::16].clamp(-2, 2) * 3 + 6).long().clamp(0, 12)


class RenormalisedEmbedding(MNISTClassifier):
    """``nn.Embedding(max_norm=...)`` renormalises the rows it looks up, in place, during forward."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = nn.Sequential(_Tokens(), nn.Embedding(13, 16, max_norm=0.5), MeanOverTokens(), nn.Linear(16, 10))


class _ShrinksThroughData(nn.Linear):
    def forward(self, x):
        self.weight.data.mul_(0.99)  # through .data: a plain tensor's has a version counter of its own
        return super().forward(x)


class ShrinkingLinear(MNISTClassifier):
    """The first Linear scales its weight in place through ``.data`` at every forward."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net[1] = _ShrinksThroughData(self.net[1].in_features, self.net[1].out_features)


@pytest.mark.parametrize("gather", ["view", "copy"])
@pytest.mark.parametrize("model_cls", [RenormalisedEmbedding, ShrinkingLinear], ids=["max_norm", "data"])
def test_a_forward_changing_parameters_in_place_is_refused(gather, model_cls):
    """The ranks' renormalisations of the shared rows raced ("view": 0.01 and 0.27 off one process, other runs
    exact) or stayed in a private copy ("copy": 2.9 off). A write through ``.data`` went unseen until 2026-12-05
    (the full parameter was a plain tensor, whose ``.data`` has its own version counter): every rank scaled the
    shared rows ("view"), or a copy the next gather dropped ("copy")."""
    with pytest.raises(RuntimeError, match=r"the forward changed parameter\(s\) \['net.1.weight'\] in place"):
        train_mnist(SHMFSDPStrategy(start_method="fork", gather=gather), 2, "adam", batch=GLOBAL_BATCH // 2,
                    model_cls=model_cls)


@pytest.mark.parametrize("policy", [lambda name, m: name == "net.1",  # a module on the first stage only
                                    lambda name, m: isinstance(m, nn.Linear) and m.out_features == 10],  # the last
                         ids=["first-stage", "last-stage"])
def test_a_unit_policy_selecting_modules_of_one_stage_shards_every_stage(policy):
    """The stage holding none of the selected modules gives its parameters units of their own, as the whole model
    does. Until 2026-12-04 it was refused there ("the FSDP unit policy selected no module with parameters"),
    after the policy had passed the check on the whole model."""
    ref = train_mnist("auto", 1, "sgd", batch=GLOBAL_BATCH, ref=True)
    strategy = SHMModelParallel(start_method="fork", data_parallel_size=2, pipeline_parallel_size=2,
                                data_parallel="shard", microbatches=2, unit_policy=policy, split_points=[4])
    got = train_mnist(strategy, 4, "sgd", batch=GLOBAL_BATCH // 2)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_a_unit_policy_selecting_nothing_is_refused(no_worker_starts):
    with pytest.raises(ValueError, match="the FSDP unit policy selected no module with parameters in MNISTClassifier"):
        train_mnist(SHMFSDPStrategy(start_method="fork", unit_policy=lambda name, m: False), 2, "sgd",
                    batch=GLOBAL_BATCH // 2)


class _TwoBackwards(MNISTClassifier):
    """Manual optimization: two losses of one forward, each with a backward of its own, the first keeping the
    graph (``retain_graph=True``); ``frozen``: a middle layer frozen (a unit backward passes through)."""

    def __init__(self, frozen: bool = False):
        super().__init__(optimizer="adam", lr=0.01)
        self.automatic_optimization = False
        if frozen:
            self.net[4].requires_grad_(False)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        out = self(batch[0])
        loss = nn.functional.cross_entropy(out, batch[1])
        self.manual_backward(loss, retain_graph=True)
        self.manual_backward(out.pow(2).mean())
        opt.step()
        return loss


@pytest.mark.parametrize("kw", [{}, {"gather": "copy"}, {"gather": "copy", "reshard_after_forward": False},
                                {"gather": "copy", "prefetch": True}],
                         ids=["view", "copy", "copy-kept", "copy-prefetch"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen-middle"])
def test_a_graph_kept_for_a_second_backward_trains_as_one_process(kw, frozen):
    """Under "copy" the first backward freed each unit's gathered copy and the second read the empty storage:
    "setStorage: sizes [10, 64] ... out of bounds for storage of size 0". Each backward through a unit's forward
    now gathers it again (and frees it after)."""
    make = functools.partial(_TwoBackwards, frozen)
    _, ref = fit_seeded(make, "auto", 1, GLOBAL_BATCH, ref=True)
    _, got = fit_seeded(make, SHMFSDPStrategy(start_method="fork", **kw), 2, GLOBAL_BATCH // 2)
    torch.testing.assert_close(flat_params(got), flat_params(ref), rtol=0, atol=1e-12)
