"""shm_model_parallel: data (replicated or sharded) x tensor x pipeline parallelism composed.

Every combination must train exactly like one process on the global batch, checkpoint in the plain
format and resume under any other layout, combine logs over the data-parallel ranks only, and hold
1/(dp x tp x pp) of the model per rank when sharded.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import EarlyStopping
from torch.utils.data import DataLoader

from lightning_shm import SHMDDPStrategy, SHMFSDPStrategy, SHMModelParallel, SHMPipeline, SHMTensorParallel
from lightning_shm.models import MNISTClassifier
from lightning_shm.runtime import CollectiveMismatchError, DeadlockError, Topology, launch
from tests.helpers import (
    GLOBAL_BATCH,
    LAYOUTS,
    SEED,
    SchedClassifier,
    check_plain_checkpoint,
    fit_adam64,
    flat_params,
    loader,
    mnist_like,
    train_mnist,
    trainer,
)

# (dp, tp, pp, data_parallel)
GRIDS = [(2, 2, 1, "replicate"), (2, 2, 1, "shard"), (2, 1, 2, "shard"), (1, 2, 2, "replicate"),
         (2, 2, 2, "replicate")]


def mp(dp, tp, pp, data_parallel="replicate", **kw):
    return SHMModelParallel(start_method="fork", data_parallel_size=dp, tensor_parallel_size=tp,
                            pipeline_parallel_size=pp, data_parallel=data_parallel,
                            **({"microbatches": 2} if pp > 1 else {}), **kw)


@pytest.fixture(scope="module")
def references():
    return {opt: train_mnist("auto", 1, opt, batch=GLOBAL_BATCH, ref=True) for opt in ("sgd", "adam")}


@pytest.mark.parametrize("dp, tp, pp, data_parallel", GRIDS, ids=[f"dp{d}xtp{t}xpp{p}-{m}" for d, t, p, m in GRIDS])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_every_combination_equals_one_process(references, dp, tp, pp, data_parallel, optimizer):
    got = train_mnist(mp(dp, tp, pp, data_parallel), dp * tp * pp, optimizer, batch=GLOBAL_BATCH // dp)
    torch.testing.assert_close(got, references[optimizer], rtol=0, atol=2e-5)


def test_clipping_accumulation_and_schedules_across_every_axis():
    """Clipping by the global norm must count FSDP shards, tp slices and pp stages once each."""
    kw = dict(model_cls=SchedClassifier, gradient_clip_val=0.05, accumulate=2)
    ref = train_mnist("auto", 1, "sgd", batch=GLOBAL_BATCH, ref=True, **kw)
    got = train_mnist(mp(2, 2, 2, "shard", schedule="zero_bubble"), 8, "sgd", batch=GLOBAL_BATCH // 2, **kw)
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)


def test_checkpoint_saved_under_3d_resumes_under_other_layouts(tmp_path):
    ds = mnist_like(GLOBAL_BATCH * 4)
    straight, _ = fit_adam64("shm_ddp_fork", 2, 3, GLOBAL_BATCH // 2, ds)
    _, path = fit_adam64(mp(2, 2, 2, "shard"), 8, 1, GLOBAL_BATCH // 2, ds, ckpt_dir=tmp_path)
    _, plain, adam = check_plain_checkpoint(path)
    assert adam.state[plain.net[1].weight]["exp_avg"].shape == (256, 784)
    for strategy, devices, batch in (("shm_ddp_fork", 2, GLOBAL_BATCH // 2), (mp(1, 2, 2), 4, GLOBAL_BATCH)):
        resumed, _ = fit_adam64(strategy, devices, 3, batch, ds, ckpt_path=path)
        torch.testing.assert_close(resumed, straight, rtol=0, atol=1e-12)


def test_fsdp_under_a_pipeline_cut_inside_a_linear(references, tmp_path):
    """dp2 shard x pp2 with the first Linear's rows divided between the stages (by parameter count it
    is always cut: it holds 92% of the MLP) and each stage's rows sharded again over dp: parity, and a
    plain checkpoint that resumes under shm_ddp."""
    cut = dict(split_linear=True, balance="params")
    got = train_mnist(mp(2, 1, 2, "shard", **cut), 4, "adam", batch=GLOBAL_BATCH // 2)
    torch.testing.assert_close(got, references["adam"], rtol=0, atol=2e-5)
    ds = mnist_like(GLOBAL_BATCH * 4)
    straight, _ = fit_adam64("shm_ddp_fork", 2, 3, GLOBAL_BATCH // 2, ds)
    _, path = fit_adam64(mp(2, 1, 2, "shard", **cut), 4, 1, GLOBAL_BATCH // 2, ds, ckpt_dir=tmp_path)
    _, plain, adam = check_plain_checkpoint(path)
    assert adam.state[plain.net[1].weight]["exp_avg"].shape == (256, 784)
    resumed, _ = fit_adam64("shm_ddp_fork", 2, 3, GLOBAL_BATCH // 2, ds, ckpt_path=path)
    torch.testing.assert_close(resumed, straight, rtol=0, atol=1e-12)


class _Blocks(torch.nn.Module):
    """Two column -> row pairs without biases: every parameter is split by tp, each stage holds one pair."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])


def _persistent(world, dp, tp, pp):
    """Parameter elements and Adam state one rank keeps between steps under FSDP x tp x pp."""
    import lightning_shm.parallel.compose as compose
    from lightning_shm.parallel.ddp import broadcast_module_state

    torch.manual_seed(0)
    model = _Blocks()
    broadcast_module_state(model, world.group())
    config = compose.ParallelConfig(dp, tp, pp, "shard", split_points=[2] if pp > 1 else None, balance="params")
    groups = Topology(world.size, dp=dp, tp=tp, pp=pp).groups(world)
    compose.parallelize(model, config, world, groups, training=True)
    opt = torch.optim.Adam(model.parameters())
    model.net.zero_grad()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    state = sum(v.numel() for st in opt.state.values() for v in st.values() if v.dim())
    return sum(p.numel() for p in model.parameters()), state


@pytest.mark.parametrize("dp, tp, pp", [(2, 1, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2)])
def test_sharded_layouts_hold_their_share_of_the_model(dp, tp, pp):
    full = 4 * 64 * 64
    for params, adam in launch(_persistent, dp * tp * pp, dp, tp, pp, start_method="fork"):
        assert params == full // (dp * tp * pp)  # 64 rows split evenly by tp and dp, one pair per stage
        assert adam == 2 * params  # exp_avg and exp_avg_sq of the rank's rows only


class DataParallelLogging(MNISTClassifier):
    """Rank-dependent logged values: they must be averaged over the data-parallel group, not tp / pp ranks."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        dp_rank = self.trainer.strategy.distributed_sampler_kwargs["rank"]
        self.log("dp_rank_mean", float(dp_rank), sync_dist=True, on_step=False, on_epoch=True)
        return loss


def test_logging_and_metrics_combine_over_data_parallel_ranks_only():
    pl.seed_everything(0)
    model = DataParallelLogging()
    ds = mnist_like(GLOBAL_BATCH * 4)
    t = trainer(strategy=mp(2, 2, 2), devices=8, max_epochs=1)
    t.fit(model, loader(ds, GLOBAL_BATCH // 2), DataLoader(ds, batch_size=GLOBAL_BATCH // 2))
    assert float(t.callback_metrics["dp_rank_mean"]) == pytest.approx(0.5)
    one = trainer(devices=1).validate(model, DataLoader(ds, batch_size=GLOBAL_BATCH), verbose=False)[0]
    ours = trainer(strategy=mp(2, 2, 1), devices=4).validate(model, DataLoader(ds, batch_size=GLOBAL_BATCH // 2),
                                                             verbose=False)[0]
    assert ours["val_acc"] == pytest.approx(one["val_acc"]) and ours["val_loss"] == pytest.approx(one["val_loss"],
                                                                                                  abs=1e-5)
    predicted = trainer(strategy=mp(2, 1, 2, "shard"), devices=4).predict(model, DataLoader(ds, batch_size=10))
    single = trainer(devices=1).predict(model, DataLoader(ds, batch_size=10))
    assert torch.equal(torch.cat(predicted), torch.cat(single))


def test_bad_grid_names_every_size():
    with pytest.raises(ValueError, match=r"devices=6 must equal data_parallel_size x tensor_parallel_size x "
                                         r"pipeline_parallel_size = 2 x 2 x 2 = 8"):
        trainer(strategy=mp(2, 2, 2), devices=6)
    with pytest.raises(ValueError, match=r"data_parallel must be one of \('replicate', 'shard'\), got 'zero'"):
        mp(1, 1, 1, "zero")


@pytest.mark.parametrize("make, said", [
    (lambda: SHMDDPStrategy(microbatches=8),
     r"microbatches=8 does nothing without a pipeline: .* use Trainer\(accumulate_grad_batches=8\)\. Layout: "
     r"pipeline_parallel_size=1, tensor_parallel_size=1, data_parallel='replicate'"),
    (lambda: SHMFSDPStrategy(find_unused_parameters=True, bucket_cap_mb=50),
     r"bucket_cap_mb=50, find_unused_parameters=True do nothing when sharded \(shm_ddp's gradient reducer"),
    (lambda: SHMDDPStrategy(unit_policy={torch.nn.Linear}, gather="copy", reshard_after_forward=False),
     r"unit_policy=\{<class 'torch.nn.modules.linear.Linear'>\}, reshard_after_forward=False, gather='copy' do "
     r"nothing without sharding"),
    (lambda: SHMTensorParallel(tensor_parallel_size=2, schedule="zero_bubble", split_points=[3]),
     r"schedule='zero_bubble', split_points=\[3\] do nothing without a pipeline \(pipeline_parallel_size > 1\)\. "
     r"Layout: pipeline_parallel_size=1, tensor_parallel_size=2"),
    (lambda: SHMModelParallel(data_parallel_size=2, plan={"net.1": "column"}, balance="params"),
     r"balance='params' does nothing without a pipeline .*; plan=\{'net.1': 'column'\} does nothing without tensor "
     r"parallelism"),
], ids=["microbatches", "reducer-when-sharded", "fsdp-when-replicated", "pipeline-under-tp", "plan-and-balance"])
def test_arguments_that_do_nothing_in_the_layout_are_named_in_a_warning(make, said):
    """Each was taken in silence and did nothing: ``SHMDDPStrategy(microbatches=8)`` trained on whole batches (no
    accumulation), ``SHMFSDPStrategy(find_unused_parameters=True)`` as without it. A warning, pointing at the line
    that made the strategy: a sweep over layouts may keep a pipeline's arguments at pipeline_parallel_size=1."""
    with pytest.warns(UserWarning, match=said) as caught:
        make()
    assert [os.path.basename(w.filename) for w in caught] == ["test_model_parallel.py"]


def test_arguments_of_the_layout_chosen_are_taken_without_a_word(recwarn):
    SHMPipeline(pipeline_parallel_size=2, microbatches=8, schedule="zero_bubble", balance="params")
    SHMFSDPStrategy(unit_policy={torch.nn.Linear}, gather="copy", reshard_after_forward=False, prefetch=True)
    SHMDDPStrategy(find_unused_parameters=True, bucket_cap_mb=1, microbatches=4)  # a default given is no setting
    SHMModelParallel(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel="shard",
                     plan={"net.1": "column", "net.3": "row"}, microbatches=2, unit_policy={torch.nn.Linear})
    assert not recwarn.list


def test_pipeline_cut_never_splits_a_tensor_parallel_pair():
    """Explicit split points inside a column -> row pair would send split features across stages."""
    with pytest.raises(ValueError, match=r"split point 3 is refused: it falls between a tensor-parallel column layer "
                                         r"and its row layer"):
        trainer(strategy=mp(1, 2, 2, split_points=[3], plan={"net.1": "column", "net.4": "row"}), devices=4,
                max_epochs=1).fit(
            MNISTClassifier(), loader(mnist_like(16), 8))


class _OwnSampler(MNISTClassifier):
    """Builds its own DistributedSampler (``use_distributed_sampler=False``): from ``trainer.world_size`` /
    ``global_rank`` (``per="world"``) or from the strategy's ``distributed_sampler_kwargs`` (``per="dp"``)."""

    def __init__(self, per, dp, **kw):
        super().__init__(**kw)
        self.per, self.dp = per, dp

    def train_dataloader(self):
        ds = mnist_like(GLOBAL_BATCH * 2, seed=1)
        kw = (dict(num_replicas=self.trainer.world_size, rank=self.trainer.global_rank) if self.per == "world"
              else getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or dict(num_replicas=1, rank=0))
        sampler = torch.utils.data.DistributedSampler(ds, seed=SEED, **kw)
        if self.dp == 2:  # inside a batch sampler
            return DataLoader(ds, batch_sampler=torch.utils.data.BatchSampler(sampler, GLOBAL_BATCH // 2, False))
        return DataLoader(ds, batch_size=GLOBAL_BATCH // self.dp, sampler=sampler)


@pytest.mark.parametrize("dp, tp, pp, tp_batch", [(1, 2, 1, "auto"), (1, 1, 2, "broadcast"), (2, 1, 2, "auto")])
def test_a_sampler_that_splits_a_replicas_ranks_is_refused(dp, tp, pp, tp_batch):
    """Under tp / pp a sampler built from world_size gave the ranks of one replica different samples: the replica
    trained on a mix or on its first rank's share, half the epoch's samples (2 steps of 4, 0.06 off one process)."""
    expected = rf"num_replicas={dp}, rank=\d\), which counts data-parallel replicas"  # whichever replica fails first
    with pytest.raises(ValueError, match=r"but their loader's DistributedSampler gives each different samples "
                                         r"\(rank \d: num_replicas=" + f"{dp * tp * pp}, rank=\\d; .*" + expected):
        trainer(strategy=mp(dp, tp, pp, tp_batch=tp_batch), devices=dp * tp * pp, max_epochs=1,
                use_distributed_sampler=False).fit(_OwnSampler("world", dp))


def test_a_sampler_built_from_the_strategys_kwargs_trains_as_one_process():
    def fit(strategy, devices, dp):
        pl.seed_everything(SEED)
        model = _OwnSampler("dp", dp, optimizer="adam", lr=0.01)
        trainer(strategy=strategy, devices=devices, max_epochs=1, precision="64-true",
                use_distributed_sampler=False).fit(model)
        return flat_params(model).double()

    torch.testing.assert_close(fit(mp(2, 1, 2, "shard"), 4, 2), fit("auto", 1, 1), rtol=0, atol=1e-12)


class _RankShards(torch.utils.data.Sampler):
    """A sampler of the user's own (a bucketing one, say) that takes every ``world``-th index from ``rank``."""

    def __init__(self, n, rank, world):
        self.n, self.rank, self.world = n, rank, world

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(SEED)).tolist()
        return iter(order[self.rank::self.world])

    def __len__(self):
        return len(range(self.rank, self.n, self.world))


class _OwnShardingSampler(MNISTClassifier):
    def train_dataloader(self):
        ds = mnist_like(GLOBAL_BATCH * 2, seed=1)
        return DataLoader(ds, batch_size=GLOBAL_BATCH, sampler=_RankShards(len(ds), self.global_rank,
                                                                           self.trainer.world_size))


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_a_custom_sampler_sharding_by_global_rank_is_refused(tp, pp):
    """A split loader gathered each replica rank's rows of its own batch: a batch mixing two shards, half the
    dataset per epoch (2 steps of 4, 0.060 off one process under tp2, pp2 and dp2 x pp2), silently."""
    with pytest.raises(ValueError, match=r"their loader's _RankShards gave them different first batches"):
        trainer(strategy=mp(1, tp, pp), devices=tp * pp, max_epochs=1, use_distributed_sampler=False).fit(
            _OwnShardingSampler())


class _UnevenShards(MNISTClassifier):
    """Cuts its dataset by data-parallel rank itself, rank r taking 24 * (4 + r) samples: 8 and 10 batches of 12."""

    def train_dataloader(self):
        rank = self.trainer.strategy.distributed_sampler_kwargs["rank"]
        return DataLoader(torch.utils.data.Subset(mnist_like(24 * 8), range(24 * (4 + rank))), batch_size=12)


@pytest.mark.parametrize("dp, pp", [(2, 1), (2, 2)])
def test_data_parallel_ranks_with_epochs_of_different_lengths_are_refused_at_the_start(dp, pp):
    """Their epochs would end at different steps: the run stopped there with a CollectiveMismatchError naming two
    collectives (vote and all_reduce), not why."""
    with pytest.raises(ValueError, match=r"gives the data-parallel ranks \[8, 10\] batches in epoch 0"):
        trainer(strategy=mp(dp, 1, pp), devices=dp * pp, max_epochs=1, use_distributed_sampler=False).fit(
            _UnevenShards())
    t = trainer(strategy=mp(dp, 1, pp), devices=dp * pp, max_steps=4, use_distributed_sampler=False)
    t.fit(_UnevenShards())  # ends before the shorter epoch does
    assert t.global_step == 4


class _UnevenWhenReloaded(MNISTClassifier):
    """Builds its loader anew each epoch: 4 batches of 12 on every data-parallel rank, from epoch 1 one more per
    rank above 0."""

    def train_dataloader(self):
        rank = self.trainer.strategy.distributed_sampler_kwargs["rank"]
        n = 4 + (rank if self.current_epoch >= 1 else 0)
        return DataLoader(mnist_like(12 * n, seed=rank), batch_size=12)


@pytest.mark.parametrize("dp, pp", [(2, 1), (2, 2)])
def test_a_reloaded_loader_giving_the_ranks_epochs_of_different_lengths_is_refused_at_that_epoch(dp, pp):
    """Checked where the loader is reloaded too: before, a CollectiveMismatchError at the reloaded epoch's end."""
    kw = dict(devices=dp * pp, reload_dataloaders_every_n_epochs=1, use_distributed_sampler=False)
    with pytest.raises(ValueError, match=r"gives the data-parallel ranks \[4, 5\] batches in epoch 1"):
        trainer(strategy=mp(dp, 1, pp), max_epochs=3, **kw).fit(_UnevenWhenReloaded())
    t = trainer(strategy=mp(dp, 1, pp), max_steps=7, **kw)
    t.fit(_UnevenWhenReloaded())  # the 3 steps left end before the shorter epoch does
    assert t.global_step == 7


class _UnevenEvalShards(MNISTClassifier):
    """Validates and tests on a shard of its own per data-parallel rank (``by="dp"``), per global rank
    (``"global"``) or on all 108 samples (``"all"``, one process): 48 and 60 samples, 4 and 5 batches of 12; the
    accuracy is a torchmetrics metric, gathered over the replicas at the epoch's end, beside a value logged with
    ``sync_dist``."""

    def __init__(self, by: str) -> None:
        super().__init__()
        self.by, self.acc = by, torchmetrics.classification.MulticlassAccuracy(10, average="micro")

    def _shard(self):
        r = self.trainer.strategy.distributed_sampler_kwargs["rank"] if self.by == "dp" else self.global_rank
        part = range(108) if self.by == "all" else range(48) if r == 0 else range(48, 108)
        return DataLoader(torch.utils.data.Subset(mnist_like(108, seed=3), part), batch_size=12)

    val_dataloader = test_dataloader = _shard

    def validation_step(self, batch, batch_idx):
        logits = self(batch[0])
        self.acc.update(logits, batch[1])
        self.log("mean_logit", logits.mean(), sync_dist=True)  # weighted by each rank's samples at the epoch's end

    test_step = validation_step

    def on_validation_epoch_end(self):
        self.log("acc", self.acc.compute())
        self.acc.reset()

    on_test_epoch_end = on_validation_epoch_end


def _evaluated(strategy, devices, by):
    pl.seed_everything(SEED)
    model, t = _UnevenEvalShards(by), trainer(strategy=strategy, devices=devices, use_distributed_sampler=False)
    return {f"{loop} {k}": v for loop, run in (("validate", t.validate(model)), ("test", t.test(model)))
            for k, v in run[0].items()}


@pytest.mark.parametrize("dp, pp", [(2, 1), (2, 2)])
def test_replicas_validating_different_numbers_of_batches_evaluate_as_one_process(dp, pp):
    """As under Lightning's ddp: each replica evaluates its own shard, the metric gathers them. Until 2026-12-07 the
    ranks' votes on stop requests every 4 steps met the shorter rank's metric gather: a CollectiveMismatchError.
    Such a loop has no stop points (a Ctrl-C in it waits for the next training step, or stops at once)."""
    got, ref = _evaluated(mp(dp, 1, pp), dp * pp, "dp"), _evaluated("auto", 1, "all")
    assert len(got) == 4 and got == pytest.approx(ref, abs=1e-6)  # validate's and test's acc and mean_logit


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_ranks_of_one_replica_loading_different_numbers_of_batches_are_refused(tp, pp):
    """They compute every step together: before, a CollectiveMismatchError naming two collectives, at the shorter
    rank's end."""
    strategy = mp(1, tp, pp, tp_batch="off") if tp > 1 else mp(1, tp, pp)
    with pytest.raises(ValueError, match=r"the validation loader gives the ranks \[0, 1\] of one model replica "
                                         r"\[4, 5\] batches"):
        trainer(strategy=strategy, devices=2, use_distributed_sampler=False).validate(_UnevenEvalShards("global"))

    class UnevenTrainingShards(_UnevenShards):
        def train_dataloader(self):
            return DataLoader(torch.utils.data.Subset(mnist_like(24 * 8), range(24 * (4 + self.global_rank))),
                              batch_size=12)

    with pytest.raises(ValueError, match=r"the training loader gives the ranks \[0, 1\] of one model replica "
                                         r"\[8, 10\] batches"):
        trainer(strategy=mp(1, tp, pp), devices=2, max_epochs=1, use_distributed_sampler=False).fit(
            UnevenTrainingShards())


class _Stream(torch.utils.data.IterableDataset):
    """A stream that shards itself: every ``world``-th sample from ``rank``; with ``noise`` each sample's image gets
    noise drawn by (global rank, index), as a loader worker's random augmentation seeded per rank does."""

    def __init__(self, rank, world, noise):
        self.ds, self.rank, self.world, self.noise = mnist_like(GLOBAL_BATCH * 2, seed=1), rank, world, noise

    def __iter__(self):
        from lightning.pytorch.utilities import rank_zero_only

        for i in range(self.rank, len(self.ds), self.world):
            x, y = self.ds[i]
            if self.noise:
                g = torch.Generator().manual_seed(1000 * rank_zero_only.rank + i)
                x = x + 0.1 * torch.randn(x.shape, generator=g, dtype=x.dtype)
            yield x, y


class _Streaming(MNISTClassifier):
    """Streams its data, sharded by ``trainer.global_rank`` / ``world_size`` (``per="world"``) or by the strategy's
    ``distributed_sampler_kwargs`` (``per="dp"``) -- what a node split of a streaming dataset is given."""

    def __init__(self, per, noise=False, **kw):
        super().__init__(**kw)
        self.per, self.noise = per, noise

    def train_dataloader(self):
        kw = (dict(num_replicas=self.trainer.world_size, rank=self.trainer.global_rank) if self.per == "world"
              else getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or dict(num_replicas=1, rank=0))
        stream = _Stream(kw["rank"], kw["num_replicas"], self.noise)
        return DataLoader(stream, batch_size=GLOBAL_BATCH // kw["num_replicas"])


@pytest.mark.parametrize("dp, tp, pp", [(1, 2, 1), (2, 1, 2)])
def test_a_stream_sharded_by_global_rank_is_refused(dp, tp, pp):
    """Each rank of a replica streamed another shard and the replica trained on its first rank's batches alone: half
    the samples per epoch under tp2, pp2 and dp2 x pp2, silently."""
    with pytest.raises(ValueError, match=r"but their IterableDataset gave them first batches with different "
                                         r"integer values or shapes .* by trainer.strategy.distributed_sampler_kwargs"):
        trainer(strategy=mp(dp, tp, pp), devices=dp * tp * pp, max_epochs=1).fit(_Streaming("world"))


@pytest.mark.parametrize("layout", ["dp2xpp2-by-kwargs", "tp2-noise-per-rank"])
def test_a_stream_sharded_by_the_strategys_kwargs_trains_as_one_process(layout):
    """Sharded by the data-parallel rank, the stream trains as one process; images augmented per rank (floats) are not
    refused: the replica trains on its first member's draws (the one process draws rank 0's)."""
    dp, tp, pp, noise = (2, 1, 2, False) if layout.startswith("dp2") else (1, 2, 1, True)

    def fit(strategy, devices):
        pl.seed_everything(SEED)
        model = _Streaming("dp", noise, optimizer="adam", lr=0.01)
        trainer(strategy=strategy, devices=devices, max_epochs=1, precision="64-true").fit(model)
        return flat_params(model).double()

    strategy = mp(dp, tp, pp, "shard" if dp > 1 else "replicate")
    torch.testing.assert_close(fit(strategy, dp * tp * pp), fit("auto", 1), rtol=0, atol=1e-12)


class GathersPredictions(MNISTClassifier):
    """Appends each validation batch's predictions; gathers them at the epoch's end, as users compute AUROC."""

    def on_validation_epoch_start(self):
        self.preds = []

    def validation_step(self, batch, batch_idx):
        self.preds.append(self(batch[0]).softmax(-1)[:, 0])

    def on_validation_epoch_end(self):
        gathered = self.all_gather(torch.cat(self.preds)).reshape(-1)
        self.log("gathered_rows", float(len(gathered)))
        self.log("gathered_sum", gathered.double().sum())


@pytest.mark.parametrize("dp, tp, pp", [(1, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)])
def test_predictions_gathered_at_the_epochs_end_hold_each_sample_once(dp, tp, pp):
    """Until 2026-12-03 ``self.all_gather`` gathered every rank: tp members and pipeline stages (which all hold the
    replica's predictions) contributed them again -- 96 rows for 48 samples, their sum doubled."""
    ds = mnist_like(48, seed=3)
    pl.seed_everything(SEED)
    one = trainer(devices=1).validate(GathersPredictions(), DataLoader(ds, batch_size=GLOBAL_BATCH), verbose=False)
    pl.seed_everything(SEED)
    ours = trainer(strategy=mp(dp, tp, pp), devices=dp * tp * pp).validate(
        GathersPredictions(), DataLoader(ds, batch_size=GLOBAL_BATCH // dp), verbose=False)
    assert ours[0]["gathered_rows"] == one[0]["gathered_rows"] == 48
    assert ours[0]["gathered_sum"] == pytest.approx(one[0]["gathered_sum"], rel=1e-6)



class _BarrierOnRankZeroOnly(MNISTClassifier):
    """A hook that calls a collective on one rank only: rank 0 waits in the world's barrier while the other ranks
    go on into the step and wait there for rank 0 in other groups (at a batch's end they would meet the world's
    vote on ``trainer.should_stop`` instead, and after an overridden ``on_train_batch_start`` the vote on its -1:
    a mismatch in one group, reported at once). Batch 1's transfer comes before those hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.transfers = 0

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.transfers += 1
        if self.global_rank == 0 and self.transfers == 2:
            self.trainer.strategy.barrier("rank 0 only")
        return batch


def test_ranks_that_took_different_paths_stop_with_a_deadlock_not_at_the_timeout():
    """Before the deadlock check this run waited for the strategy's whole timeout (30 minutes by default)."""
    strategy = SHMModelParallel(start_method="fork", data_parallel_size=2, pipeline_parallel_size=2, microbatches=2,
                                timeout=60)
    said = r"deadlock: ranks \[0(, \d)+\] wait for each other \(rank 0 waits in a collective"
    with pytest.raises(DeadlockError, match=said) as info:
        trainer(strategy=strategy, devices=4, max_steps=3).fit(_BarrierOnRankZeroOnly(),
                                                              loader(mnist_like(96), 8))
    # rank 0's stack -- the worker's own traceback if it found the cycle first, else where the launcher saw it
    said = "\n".join(info.value.__notes__) + str(info.value.__cause__)
    assert "in on_after_batch_transfer" in said and "was here" in said, said
    # and where each rank's loop stood, the reported rank's and those on the cycle with it
    assert "rank 0 was in `fit`, its train loop (epoch 0, global step 1)" in said, said


class _StopsOnRankZeroAfterTheEpochsVote(EarlyStopping):
    """A stop decided on rank 0 alone where no vote on the flag follows: an ``EarlyStopping`` subclass deciding
    by itself runs after the module's epoch end (Lightning calls the monitoring callbacks last), after the
    ranks' vote there (tests/test_stop_votes.py); rank 0's fit ends, rank 1 starts epoch 1."""

    def __init__(self) -> None:
        super().__init__(monitor="train_loss")

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            trainer.should_stop = True


class _BarrierOnRankZeroAtFitEnd(MNISTClassifier):
    def on_fit_end(self):
        if self.global_rank == 0:
            self.trainer.strategy.barrier("rank 0 only")


class _BarrierOnRankZeroAtFitStart(MNISTClassifier):
    def on_fit_start(self):
        if self.global_rank == 0:
            self.trainer.strategy.barrier("rank 0 only")


@pytest.mark.parametrize("case, layout", [("stop", "ddp"), ("stop", "fsdp"), ("stop", "pp2-1f1b"),
                                          ("fit_end", "ddp"), ("fit_start", "ddp")])
def test_ranks_on_different_paths_are_reported_with_each_ranks_loop_position(case, layout):
    """The collectives the ranks meet (the end-of-fit gathers against a vote, a loader's gathers against the
    end-of-fit gathers) name the runtime's calls alone; the report holds both ranks' loop positions, a stopping
    rank's with what to do."""
    make, devices, dp = LAYOUTS[layout]
    stop = case == "stop"
    with pytest.raises(CollectiveMismatchError) as info:
        trainer(strategy=make(), devices=devices, max_epochs=2,
                callbacks=[_StopsOnRankZeroAfterTheEpochsVote()] if stop else []).fit(
            {"stop": MNISTClassifier, "fit_end": _BarrierOnRankZeroAtFitEnd,
             "fit_start": _BarrierOnRankZeroAtFitStart}[case](), loader(mnist_like(96), 24 // dp))
    said = "\n".join(info.value.__notes__)
    if stop:
        assert ("rank 0 had finished `fit` and was gathering what the main process gets back (epoch 1, global step "
                "4), trainer.should_stop=True -- set on some ranks only") in said, said
        assert "reduce_boolean_decision(stop, all=False)" in said
        assert "saving a checkpoint" not in said  # the end-of-fit gathers are no save of the program's
        assert "rank 1 was in `fit`, its train loop (epoch 1, global step 4), trainer.should_stop=False" in said
    elif case == "fit_end":  # Lightning's stage reads "train" there: the strategy says the loop had ended
        assert ("rank 0 was in `fit`, past its train loop (the fit's end: on_train_end, on_fit_end) (epoch 2, global "
                "step 8)") in said, said
        assert ("rank 1 had finished `fit` and was gathering what the main process gets back (epoch 2, global step "
                "8)") in said, said
    else:  # rank 1 went on to the training data's length check (a reduce)
        assert "rank 0 was in `fit`, before its train loop ran a step (the fit's start" in said, said
        assert "rank 1 was in `fit`, before its train loop ran a step" in said, said
    if case != "stop":  # both ranks met the mismatch: neither stopped because of the other
        assert "met the same mismatch on their side" in said and "stopped because" not in said, said
    assert "rank 1 was here" in said or "rank 0 was here" in said  # the other rank's call beside the reported one


def test_a_loop_position_that_cannot_be_read_leaves_the_error_it_explains():
    from lightning_shm.strategies.loop_position import note_loop_position

    exc = CollectiveMismatchError("the ranks' collectives differ")
    note_loop_position(object(), exc)  # no Trainer state to read: a note says so, the error stays the same
    assert exc.__notes__ == ["(this rank's loop position could not be read: AttributeError: 'object' object has no "
                             "attribute 'state')"]
    other = ValueError("the step's own error")
    note_loop_position(object(), other)  # not an error of ranks taking different paths: nothing added
    assert not hasattr(other, "__notes__")
