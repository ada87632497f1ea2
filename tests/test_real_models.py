"""The models users bring -- a transformer and a CNN with BatchNorm -- under every strategy.

Each run is compared with one process on the global batch (same init, same seed). Where BatchNorm
makes "one process" ambiguous the reference says which process it is:

* shm_ddp / shm_fsdp without ``sync_batchnorm``: each rank normalises its own part of the batch,
  as torch DDP does -- the reference is Lightning's own DDP (gloo; ``ddp_fork``);
* ``sync_batchnorm=True``: statistics of the global batch -- one process, exactly;
* shm_tp: BatchNorm between a column and a row conv is per channel -- one process, exactly;
* shm_pipeline: BatchNorm sees one microbatch at a time (as in GPipe) -- one process accumulating
  gradients over the same microbatches.
"""

from __future__ import annotations

import functools
import itertools

import lightning.pytorch as pl
import pytest
import torch
import torchvision
from torch.utils.data import DataLoader

from lightning_shm import SHMDDPStrategy, SHMFSDPStrategy, SHMModelParallel, SHMPipeline, SHMTensorParallel
from lightning_shm.models import MNISTClassifier
from lightning_shm.models.transformer import TRANSFORMER_TP_PLAN, Block, Head, RowEmbedding
from tests.helpers import (
    GLOBAL_BATCH,
    LAYOUTS,
    SEED,
    STEPS,
    KeepsWarnings,
    fit_seeded,
    flat_params,
    layouts,
    loader,
    mnist_like,
    reference_loader,
    train_mnist,
    trainer,
)

TRANSFORMER = functools.partial(MNISTClassifier, arch="transformer", dim=16, depth=6, heads=4)
CNN = functools.partial(MNISTClassifier, arch="cnn", channels=(8, 16), cnn_hidden=32)
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
OPTIMIZERS = ["sgd", "adam"]


@pytest.fixture(scope="module")
def transformer_refs():
    return {opt: train_mnist("auto", 1, opt, batch=GLOBAL_BATCH, ref=True, model_cls=TRANSFORMER)
            for opt in OPTIMIZERS}


# ---------------------------------------------------------------------- transformer
TRANSFORMER_RUNS = {
    "ddp": (lambda: SHMDDPStrategy(start_method="fork"), 2, 2),
    "fsdp-unit-per-block": (lambda: SHMFSDPStrategy(start_method="fork"), 2, 2),
    "tp2": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, 1),
    "tp4-one-head-each": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=4), 4, 1),
    "dp2xtp2xpp2-shard": (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2, tensor_parallel_size=2,
                                                   pipeline_parallel_size=2, data_parallel="shard",
                                                   microbatches=2), 8, 2),
}


@pytest.mark.parametrize("name", list(TRANSFORMER_RUNS))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_transformer_equals_one_process(transformer_refs, name, optimizer):
    strategy, devices, dp = TRANSFORMER_RUNS[name]
    got = train_mnist(strategy(), devices, optimizer, batch=GLOBAL_BATCH // dp, model_cls=TRANSFORMER)
    torch.testing.assert_close(got, transformer_refs[optimizer], rtol=0, atol=1e-5)


@pytest.mark.parametrize("schedule, P", list(itertools.product(SCHEDULES, [2, 4])))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_transformer_pipelined_between_blocks_equals_one_process(transformer_refs, schedule, P, optimizer):
    strategy = SHMPipeline(start_method="fork", pipeline_parallel_size=P, microbatches=4, schedule=schedule)
    got = train_mnist(strategy, P, optimizer, batch=GLOBAL_BATCH, model_cls=TRANSFORMER)
    torch.testing.assert_close(got, transformer_refs[optimizer], rtol=0, atol=1e-5)


def test_attention_splits_on_whole_heads_even_when_uneven():
    """3 heads of 4 over tp=2: ranks hold 2 and 1 heads (8 and 4 features), not 6 and 6 features -- a
    split in the middle of a head would mix two heads' dimensions in one rank's attention."""
    three_heads = functools.partial(MNISTClassifier, arch="transformer", dim=12, depth=2, heads=3)
    ref = train_mnist("auto", 1, "sgd", batch=GLOBAL_BATCH, ref=True, model_cls=three_heads)
    got = train_mnist(SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, "sgd", batch=GLOBAL_BATCH,
                      model_cls=three_heads)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_transformer_checkpoint_of_3d_run_loads_into_one_process(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0)
    model = TRANSFORMER()
    ckpt = ModelCheckpoint(dirpath=tmp_path)
    strategy = SHMModelParallel(start_method="fork", tensor_parallel_size=2, pipeline_parallel_size=2, microbatches=2)
    t = trainer(strategy=strategy, devices=4, max_epochs=1, enable_checkpointing=True, callbacks=[ckpt])
    t.fit(model, loader(mnist_like(GLOBAL_BATCH * 2), GLOBAL_BATCH))
    plain = MNISTClassifier.load_from_checkpoint(ckpt.best_model_path)
    assert plain.hparams.arch == "transformer"
    torch.testing.assert_close(flat_params(plain), flat_params(model))


# ---------------------------------------------------------------------- CNN with BatchNorm
@pytest.fixture(scope="module")
def cnn_refs():
    """One process on the global batch (BatchNorm over all of it) and Lightning's DDP on 2 ranks (each rank's
    BatchNorm over its half), parameters and BatchNorm buffers."""
    one = {opt: train_mnist("auto", 1, opt, batch=GLOBAL_BATCH, ref=True, model_cls=CNN, buffers=True)
           for opt in OPTIMIZERS}
    gloo = train_mnist("ddp_fork", 2, "sgd", batch=GLOBAL_BATCH // 2, model_cls=CNN, buffers=True)
    return one, gloo


# dp2 x tp2: each data-parallel replica's BatchNorm sliced over its tp ranks (the running statistics consolidated)
CNN_DP_RUNS = {"shm_ddp_fork": 2, "shm_fsdp_fork": 2, "dp2xtp2": 4}


def _cnn_dp_strategy(name):
    if name == "dp2xtp2":
        return SHMModelParallel(start_method="fork", data_parallel_size=2, tensor_parallel_size=2)
    return name


@pytest.mark.parametrize("strategy", list(CNN_DP_RUNS))
def test_cnn_without_sync_batchnorm_equals_lightning_ddp(cnn_refs, strategy):
    """Per-rank batch statistics, rank 0's running statistics on every rank -- as torch DDP."""
    _, gloo = cnn_refs
    got = train_mnist(_cnn_dp_strategy(strategy), CNN_DP_RUNS[strategy], "sgd", batch=GLOBAL_BATCH // 2,
                      model_cls=CNN, buffers=True)
    torch.testing.assert_close(got, gloo, rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy", list(CNN_DP_RUNS))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_cnn_with_sync_batchnorm_equals_one_process_on_the_global_batch(cnn_refs, strategy, optimizer):
    one, gloo = cnn_refs
    got = train_mnist(_cnn_dp_strategy(strategy), CNN_DP_RUNS[strategy], optimizer, batch=GLOBAL_BATCH // 2,
                      model_cls=CNN, buffers=True, sync_batchnorm=True)
    torch.testing.assert_close(got, one[optimizer], rtol=0, atol=1e-5)  # parameters and running statistics
    assert (got - gloo).abs().max() > 1e-4 or optimizer == "adam"  # and not what per-rank statistics give


class TorchSyncCNN(MNISTClassifier):
    """The CNN with its BatchNorms converted by torch's own ``nn.SyncBatchNorm.convert_sync_batchnorm``."""

    def __init__(self, **kw):
        super().__init__(**{**dict(arch="cnn", channels=(8, 16), cnn_hidden=32), **kw})
        self.net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(self.net)


@pytest.mark.parametrize("name, devices, dp", [("shm_ddp_fork", 2, 2), ("dp2xtp2", 4, 2), ("tp2", 2, 1)])
def test_cnn_with_torchs_own_sync_batchnorm_equals_one_process_on_the_global_batch(cnn_refs, name, devices, dp):
    """torch's SyncBatchNorm syncs over torch.distributed, which the workers do not start: each rank normalised
    its own samples (0.111 off one process under shm_ddp and shm_fsdp), and tp refused it between a column and a
    row conv. It is now synced over the data-parallel group, as ``Trainer(sync_batchnorm=True)`` does."""
    one, _ = cnn_refs
    tp2 = SHMTensorParallel(start_method="fork", tensor_parallel_size=2)
    strategy = tp2 if name == "tp2" else _cnn_dp_strategy(name)
    got = train_mnist(strategy, devices, "sgd", batch=GLOBAL_BATCH // dp, model_cls=TorchSyncCNN, buffers=True)
    torch.testing.assert_close(got, one["sgd"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_cnn_conv_column_row_with_sliced_batchnorm_equals_one_process(cnn_refs, optimizer):
    one, _ = cnn_refs
    strategy = SHMTensorParallel(start_method="fork", tensor_parallel_size=2)
    got = train_mnist(strategy, 2, optimizer, batch=GLOBAL_BATCH, model_cls=CNN, buffers=True)
    torch.testing.assert_close(got, one[optimizer], rtol=0, atol=1e-5)


class BetweenCNN(MNISTClassifier):
    """The CNN with its first BatchNorm -- between the column and the row convolution of tp's derived plan --
    replaced: a GroupNorm of 4 groups of 2 channels (whole groups on each of 2 ranks), an InstanceNorm with
    running statistics, a depthwise convolution (MobileNet's) or one of 4 groups (ResNeXt's). Before 2026-12-04
    the norms ended the pair (a CNN normalised only by them was refused: "the plan splits no layer") and the
    plan made the convolutions the pair's row layer, then refused them in the workers."""

    between = "group"

    def __init__(self, **kw):
        super().__init__(**{**dict(arch="cnn", channels=(8, 16), cnn_hidden=32), **kw})
        self.net[1] = {"group": lambda: torch.nn.GroupNorm(4, 8),
                       "instance": lambda: torch.nn.InstanceNorm2d(8, affine=True, track_running_stats=True),
                       "depthwise": lambda: torch.nn.Conv2d(8, 8, 3, padding=1, groups=8),
                       "grouped": lambda: torch.nn.Conv2d(8, 8, 3, padding=1, groups=4)}[self.between]()
        self.net[1].register_forward_hook(self._sees_every_channel)

    @staticmethod
    def _sees_every_channel(module, args, output):  # a hook on it sees the whole tensor, as in one process
        assert args[0].shape[1] == output.shape[1] == 8, (args[0].shape, output.shape)


@pytest.mark.parametrize("between", ["group", "instance", "depthwise", "grouped"])
@pytest.mark.parametrize("name, devices, dp", [("tp2", 2, 1), ("dp2xtp2", 4, 2)])
def test_cnn_with_group_norm_instance_norm_or_grouped_conv_between_split_convolutions_equals_one_process(
        monkeypatch, between, name, devices, dp):
    monkeypatch.setattr(BetweenCNN, "between", between)
    # with dp > 1 an InstanceNorm's running statistics are rank 0's, as under torch DDP (sync_batchnorm converts
    # BatchNorms only): compared where a replica holds every sample
    buffers = dp == 1 or between != "instance"
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, model_cls=BetweenCNN, buffers=buffers)
    tp2 = SHMTensorParallel(start_method="fork", tensor_parallel_size=2)
    strategy = tp2 if name == "tp2" else _cnn_dp_strategy(name)
    got = train_mnist(strategy, devices, "adam", batch=GLOBAL_BATCH // dp, model_cls=BetweenCNN, buffers=buffers,
                      sync_batchnorm=dp > 1)  # the second BatchNorm: over the global batch, as in one process
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)  # parameters and running statistics


class ResBlock(torch.nn.Module):
    """conv1 -> norm -> relu -> conv2, plus the input: a ResNet block in its own forward, not a Sequential."""

    def __init__(self, c: int, norm: str) -> None:
        super().__init__()
        self.conv1, self.conv2 = torch.nn.Conv2d(c, 2 * c, 3, padding=1), torch.nn.Conv2d(2 * c, c, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(2 * c) if norm == "batch" else torch.nn.GroupNorm(4, 2 * c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(torch.relu(self.bn1(self.conv1(x))))


class ResNetLike(MNISTClassifier):
    """Two ResBlocks between a strided stem and a head; the plan splits each block's convolutions."""

    norm, between = "group", True

    def __init__(self, **kw):
        super().__init__(**{**dict(arch="cnn", channels=(8, 16), cnn_hidden=32), **kw})
        self.net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1, stride=2), ResBlock(4, self.norm),
                                       ResBlock(4, self.norm), torch.nn.Flatten(), torch.nn.Linear(4 * 14 * 14, 10))
        self.tp_plan = {"net.*.conv1": "column", "net.*.conv2": "row", **({"net.*.bn1": "between"} if self.between
                                                                          else {})}


@pytest.mark.parametrize("norm", ["group", "batch"])
def test_a_norm_a_blocks_own_forward_runs_between_split_convolutions_equals_one_process(monkeypatch, norm):
    """Planned 'between', the block's norm runs on the rank's channels (since 2026-12-04; before, no plan could say
    so, and it failed in the workers with torch's "running_mean should contain 16 elements not 8")."""
    monkeypatch.setattr(ResNetLike, "norm", norm)
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, model_cls=ResNetLike, buffers=True)
    got = train_mnist(SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, "adam", batch=GLOBAL_BATCH,
                      model_cls=ResNetLike, buffers=True)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_a_norm_the_plan_leaves_out_says_to_plan_it_between(monkeypatch):
    monkeypatch.setattr(ResNetLike, "between", False)
    with pytest.raises(ValueError, match=r"GroupNorm 'net.1.bn1' got 4 of its 8 features: its block's forward runs "
                                         r"it on the output of column layer 'net.1.conv1'.*Plan it "
                                         r"\{'net.1.bn1': 'between'\}"):
        train_mnist(SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, "adam", batch=GLOBAL_BATCH,
                    model_cls=ResNetLike)


def test_cnn_pipeline_equals_one_process_over_the_same_microbatches():
    M = 4
    samples = GLOBAL_BATCH * STEPS
    ref = train_mnist("auto", 1, "sgd", batch=GLOBAL_BATCH // M, ref=True, model_cls=CNN, buffers=True,
                      accumulate=M, samples=samples)
    got = train_mnist(SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=M), 2, "sgd",
                      batch=GLOBAL_BATCH, model_cls=CNN, buffers=True, samples=samples)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


class BufferSpread(MNISTClassifier):
    """Every rank must evaluate with the same BatchNorm statistics (rank 0's), as under torch DDP."""

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        stats = torch.cat([b.reshape(-1).float() for n, b in self.named_buffers() if "running" in n])
        gathered = self.all_gather(stats)
        self.log("buffer_spread", (gathered - gathered[0]).abs().max(), reduce_fx="max")


@pytest.mark.parametrize("strategy", ["shm_ddp_fork", "shm_fsdp_fork"])
def test_every_rank_validates_with_rank_0s_batchnorm_statistics(strategy):
    pl.seed_everything(0)
    model = BufferSpread(arch="cnn", channels=(8, 16), cnn_hidden=32)
    ds = mnist_like(GLOBAL_BATCH * 4)
    t = trainer(strategy=strategy, devices=2, max_epochs=2)
    t.fit(model, loader(ds, GLOBAL_BATCH // 2), DataLoader(ds, batch_size=GLOBAL_BATCH // 2))
    assert float(t.callback_metrics["buffer_spread"]) == 0.0


# ---------------------------------------------------------------------- the user's own activation checkpointing
class _Checkpointed(torch.nn.Module):
    """A block whose forward runs under ``torch.utils.checkpoint``: its activations are recomputed in backward."""

    def __init__(self, inner: torch.nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)


def _checkpointed_transformer(reentrant: bool):
    def build(**kw):
        model = TRANSFORMER(**kw)
        for i, block in enumerate(model.net):
            if isinstance(block, Block):
                model.net[i] = _Checkpointed(block, reentrant)
        model.tp_plan = {k.replace("net.*.", "net.*.inner."): v for k, v in TRANSFORMER_TP_PLAN.items()}
        return model
    return build


CHECKPOINTED_RUNS = {
    **{k: TRANSFORMER_RUNS[k] for k in ("ddp", "fsdp-unit-per-block", "tp2", "dp2xtp2xpp2-shard")},
    **layouts("fsdp-copy", "pp2-1f1b"),
    "fsdp-copy-linear-units": (lambda: SHMFSDPStrategy(start_method="fork", gather="copy",
                                                       unit_policy={torch.nn.Linear}), 2, 2),
}


@pytest.mark.parametrize("name", list(CHECKPOINTED_RUNS))
@pytest.mark.parametrize("reentrant", [False, True])
def test_blocks_checkpointed_by_the_user_equal_one_process(name, reentrant):
    """FSDP frees a unit's full parameters after forward and gathers them again for backward; the
    recomputed forward inside backward must see the full parameters, not the rank's rows. Units inside the
    checkpointed block (each Linear) under ``gather="copy"``: the non-reentrant replay's saved views were freed with
    the replay's gather ("setStorage: ... out of bounds for storage of size 0") until 2026-12-07."""
    strategy, devices, dp = CHECKPOINTED_RUNS[name]
    build = _checkpointed_transformer(reentrant)
    ref = train_mnist("auto", 1, "sgd", batch=GLOBAL_BATCH, ref=True, model_cls=build)
    got = train_mnist(strategy(), devices, "sgd", batch=GLOBAL_BATCH // dp, model_cls=build)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- torch's own transformer layers
class TorchEncoder(MNISTClassifier):
    """``nn.TransformerEncoderLayer`` blocks (built on ``nn.MultiheadAttention``), as users write them."""

    tp_plan = {"net.*.linear1": "column", "net.*.linear2": "row"}  # the attention's fused in_proj stays whole

    def __init__(self, **kw):
        super().__init__(**kw)
        d = 16
        self.net = torch.nn.Sequential(RowEmbedding(d), *[torch.nn.TransformerEncoderLayer(
            d, 4, 32, dropout=0.0, batch_first=True) for _ in range(3)], Head(d, 10))


class TorchEncoderNoPlan(TorchEncoder):
    """The same model without a plan: the one derived for its Sequential splits each layer's feed-forward pair."""

    tp_plan = None


class TorchEncoderStack(TorchEncoderNoPlan):
    """The blocks as one ``nn.TransformerEncoder`` child of the Sequential: the derived plan splits each block's
    feed-forward pair (until 2026-12-06 it found "no layer to split" there)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        stack = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True),
                                            3)
        self.net = torch.nn.Sequential(self.net[0], stack, self.net[-1])


TORCH_ENCODER_RUNS = {**{k: TRANSFORMER_RUNS[k] for k in ("ddp", "fsdp-unit-per-block", "tp2")},
                      **layouts("fsdp-copy", "pp2-zero-bubble", "dp2xpp2-shard"),
                      "tp2-derived": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, 1),
                      "tp2-derived-stack": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2),
                                            2, 1)}


@pytest.mark.parametrize("name", list(TORCH_ENCODER_RUNS))
def test_torch_transformer_encoder_layers_equal_one_process(name):
    """Trained, then validated: in evaluation the layer takes torch's fast path, which reads every weight
    itself (FSDP's unit must hold the whole layer; tp's split linear1 / linear2 see their pieces)."""
    strategy, devices, dp = TORCH_ENCODER_RUNS[name]
    model_cls = {"tp2-derived": TorchEncoderNoPlan, "tp2-derived-stack": TorchEncoderStack}.get(name, TorchEncoder)
    _trained_and_validated_as_one_process(model_cls, strategy(), devices, dp, GLOBAL_BATCH * STEPS)


def _trained_and_validated_as_one_process(model_cls, strategy, devices, dp, samples, **trainer_kw):
    """Adam in float64 on ``samples`` synthetic samples, then validation on them: weights and validation loss
    within 1e-9 of one process's (``trainer_kw`` for the strategy's run). Returns the run's callback metrics."""

    def fit(strategy, devices, batch, ref, **kw):
        pl.seed_everything(SEED)
        model = model_cls(optimizer="adam", lr=0.01)
        ds = mnist_like(samples, seed=1)
        t = trainer(strategy=strategy, devices=devices, max_epochs=1, precision="64-true", **kw)
        t.fit(model, reference_loader(ds, batch, SEED) if ref else loader(ds, batch),
              DataLoader(ds, batch_size=GLOBAL_BATCH // dp))
        return flat_params(model), float(t.callback_metrics["val_loss"]), t.callback_metrics

    ref, ref_loss, _ = fit("auto", 1, GLOBAL_BATCH, True)
    got, loss, metrics = fit(strategy, devices, GLOBAL_BATCH // dp, False, **trainer_kw)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)
    assert loss == pytest.approx(ref_loss, abs=1e-9)
    return metrics


# ---------------------------------------------------------------------- torchvision's models, as users build them
class TorchvisionViT(MNISTClassifier):
    """torchvision's ``VisionTransformer``, small (16 patches of 7 x 7, 2 layers of width 32): a class token and
    position embedding as bare parameters, ``nn.MultiheadAttention`` blocks (whose fast path in evaluation reads
    their weights itself), each block's MLP an ``nn.Sequential`` -- split by the plan; attention stays whole."""

    tp_plan = {"net.encoder.layers.*.mlp.0": "column", "net.encoder.layers.*.mlp.3": "row"}

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = torchvision.models.VisionTransformer(image_size=28, patch_size=7, num_layers=2, num_heads=2,
                                                        hidden_dim=32, mlp_dim=64, num_classes=10)

    def forward(self, x):
        return self.net(x.expand(-1, 3, -1, -1))  # its patch embedding takes three channels


class TorchvisionResNet(TorchvisionViT):
    """torchvision's ``ResNet`` of one ``BasicBlock`` per stage (4.9M parameters): BatchNorm everywhere, the
    blocks' residual adds and downsampling branches in their own forward."""

    tp_plan = None

    def __init__(self, **kw):
        MNISTClassifier.__init__(self, **kw)
        self.net = torchvision.models.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=10)


class TorchvisionResNetSplit(TorchvisionResNet):
    """Each stage's block split as torch's ``parallelize_module`` plans are written: shell-style components."""

    tp_plan = {"net.layer*.0.conv1": "column", "net.layer*.0.bn1": "between", "net.layer[1-4].0.conv2": "row"}


TORCHVISION_RUNS = {
    "vit-ddp": (TorchvisionViT, LAYOUTS["ddp"]), "vit-fsdp": (TorchvisionViT, LAYOUTS["fsdp"]),
    "vit-fsdp-copy": (TorchvisionViT, LAYOUTS["fsdp-copy"]), "vit-tp2": (TorchvisionViT, LAYOUTS["tp2"]),
    "vit-dp2xtp2": (TorchvisionViT, (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2,
                                                              tensor_parallel_size=2), 4, 2)),
    "resnet-ddp-sync-bn": (TorchvisionResNet, LAYOUTS["ddp"]),
    "resnet-fsdp-sync-bn": (TorchvisionResNet, LAYOUTS["fsdp"]),
    "resnet-tp2": (TorchvisionResNetSplit, LAYOUTS["tp2"]),
}


@pytest.mark.parametrize("name", list(TORCHVISION_RUNS))
def test_torchvision_models_equal_one_process(name):
    """Not built around an nn.Sequential: data parallelism and FSDP take them as they are, tensor parallelism
    with a plan (a pipeline needs the user's Sequential of their parts). The ResNet with ``sync_batchnorm``:
    statistics of the global batch, one process's."""
    model_cls, (strategy, devices, dp) = TORCHVISION_RUNS[name]
    kw = {"sync_batchnorm": True} if model_cls is TorchvisionResNet else {}  # tp2's one replica needs none
    _trained_and_validated_as_one_process(model_cls, strategy(), devices, dp, GLOBAL_BATCH * 3, **kw)


class TorchvisionSwin(TorchvisionViT):
    """torchvision's ``SwinTransformer``, small (patches of 4 x 4, two stages of one block, windows of 4): its
    attention passes ``self.qkv.weight`` and ``self.proj.weight`` to a function itself, never calling them."""

    tp_plan = None

    def __init__(self, **kw):
        MNISTClassifier.__init__(self, **kw)
        self.net = torchvision.models.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                                      window_size=[4, 4], stochastic_depth_prob=0.0, num_classes=10)


def _swin_units(name, m):
    """The attention blocks as units (they gather their children's weights), not their children; every other
    Linear, LayerNorm and Conv2d a unit of its own."""
    if isinstance(m, torchvision.models.swin_transformer.ShiftedWindowAttention):
        return True
    return isinstance(m, (torch.nn.Linear, torch.nn.LayerNorm, torch.nn.Conv2d)) and ".attn." not in name + "."


def test_a_block_reading_its_childrens_weights_is_named_under_copy_gathers_and_trains_as_one_unit():
    """Under ``gather="copy"`` the children's units never gathered, and the step failed with torch's "shape '[48,
    16, 3, 2, 8]' is invalid for input of size 18432", unexplained: the failure's second run took any open
    holder's forward as the place of a legitimate read, and the attention block holds a parameter of its own.
    Now the error names the block and the unit policy that works; under the default view gather and under
    shm_ddp the model trains as one process as it is."""
    with pytest.raises(ValueError, match=r"The forward of \['net.features.1.0.attn'\] reads them itself, without "
                                         r"calling the modules that hold them"):
        _trained_and_validated_as_one_process(TorchvisionSwin, LAYOUTS["fsdp-copy"][0](), 2, 2, GLOBAL_BATCH)
    copy_units = SHMFSDPStrategy(start_method="fork", gather="copy", unit_policy=_swin_units)
    for strategy in (copy_units, LAYOUTS["fsdp"][0](), LAYOUTS["ddp"][0]()):
        _trained_and_validated_as_one_process(TorchvisionSwin, strategy, 2, 2, GLOBAL_BATCH * 2)


# ---------------------------------------------------------------------- 1-d and 3-d convolutions
class _AsSequence(torch.nn.Module):
    """[B, 1, 28, 28] -> [B, 28, 28]: the image's rows as 28 channels of a 28-step signal."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1, 2)


class _AsVolume(torch.nn.Module):
    """[B, 1, 28, 28] -> [B, 1, 4, 7, 28]: a volume of four 7-row slabs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(-1, 1, 4, 7, 28)


class _ResidualConv1d(torch.nn.Module):
    """conv1 -> BatchNorm1d -> ReLU -> conv2, plus the input: a block whose own forward runs the norm on conv1's
    output, so a plan must say it runs 'between'."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv1d(channels, 2 * channels, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm1d(2 * channels)
        self.conv2 = torch.nn.Conv1d(2 * channels, channels, 3, padding="same")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(torch.relu(self.bn1(self.conv1(x))))


class Conv1dClassifier(MNISTClassifier):
    """A 1-D CNN over a signal, as audio and time-series models are: its derived plan pairs the two plain Conv1d
    around a BatchNorm1d, a depthwise Conv1d and pooling; the residual block's pair is planned, its norm
    'between'."""

    def __init__(self, **kw):
        super().__init__(**kw)
        nn = torch.nn
        self.net = nn.Sequential(_AsSequence(), nn.Conv1d(28, 16, 5, padding=2), nn.BatchNorm1d(16), nn.GELU(),
                                 nn.Conv1d(16, 16, 3, padding=1, groups=16), nn.MaxPool1d(2), nn.Conv1d(16, 8, 1),
                                 _ResidualConv1d(8), nn.Flatten(), nn.Linear(8 * 14, 10))
        self.tp_plan = {"net.1": "column", "net.6": "row", "net.7.conv1": "column", "net.7.bn1": "between",
                        "net.7.conv2": "row"}


class Conv3dClassifier(MNISTClassifier):
    """A 3-D CNN over a volume (video and medical imaging models): Conv3d, BatchNorm3d, ReLU, MaxPool3d, Conv3d,
    its plan derived."""

    def __init__(self, **kw):
        super().__init__(**kw)
        nn = torch.nn
        self.net = nn.Sequential(_AsVolume(), nn.Conv3d(1, 8, 3, padding=1), nn.BatchNorm3d(8), nn.ReLU(),
                                 nn.MaxPool3d(2), nn.Conv3d(8, 4, 1), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(4 * 2 * 3 * 14, 10))
        self.tp_plan = None


@pytest.mark.parametrize("model_cls, name", [
    (Conv1dClassifier, "tp2"), (Conv1dClassifier, "dp2xtp2-shard"), (Conv3dClassifier, "tp2"),
    (Conv3dClassifier, "tp3-uneven"),
])
def test_1d_and_3d_convolutions_split_by_tensor_parallelism_equal_one_process(model_cls, name):
    """Until 2026-12-07 tensor parallelism split Linear and Conv2d only: a Conv1d / Conv3d model got "the plan
    splits no layer". Weights and validation loss (BatchNorm's running statistics at work) within 1e-9 of one
    process."""
    strategy, devices, dp = {
        "tp2": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, 1),
        "tp3-uneven": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=3), 3, 1),  # 8 -> 3, 3, 2
        "dp2xtp2-shard": (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2, tensor_parallel_size=2,
                                                   data_parallel="shard"), 4, 2),
    }[name]
    # data-parallel replicas normalise over the global batch, as one process does, with sync_batchnorm
    _trained_and_validated_as_one_process(model_cls, strategy(), devices, dp, GLOBAL_BATCH * 2,
                                          sync_batchnorm=dp > 1)


# ---------------------------------------------------------------------- a vocabulary split by tensor parallelism
class _Tokens(torch.nn.Module):
    """[B, 1, 28, 28] -> [B, 49] token ids: the image pooled to 7 x 7, each cell's intensity in 16 levels, offset
    by its position -- a vocabulary of 784 words, and id 0 (position 0 dark, as most images are there) for the
    padding row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        levels = (torch.nn.functional.avg_pool2d(x, 4).flatten(1).clamp(0, 1) * 15).round().long()
        return levels + 16 * torch.arange(49)


class _MeanOverTokens(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


class TokenClassifier(MNISTClassifier):
    """An embedding table as language models open with (its largest layer), then an MLP: the plan splits the
    table's vocabulary ('row') and the MLP's pair, as a transformer's embedding and blocks are split."""

    def __init__(self, **kw):
        super().__init__(**kw)
        nn = torch.nn
        self.net = nn.Sequential(_Tokens(), nn.Embedding(784, 32, padding_idx=0), _MeanOverTokens(), nn.Linear(32, 64),
                                 nn.ReLU(), nn.Linear(64, 10))
        self.tp_plan = {"net.1": "row", "net.3": "column", "net.5": "row"}


class TiedTokenClassifier(MNISTClassifier):
    """The table also scores the vocabulary, as a language model's output layer tied to its embedding does (one
    tensor, two layers): both split by the vocabulary, each rank's piece held by both."""

    def __init__(self, **kw):
        super().__init__(**kw)
        nn = torch.nn
        embed, scores = nn.Embedding(784, 32, padding_idx=0), nn.Linear(32, 784, bias=False)
        scores.weight = embed.weight
        self.net = nn.Sequential(_Tokens(), embed, _MeanOverTokens(), scores, nn.Tanh(), nn.Linear(784, 10))
        self.tp_plan = {"net.1": "row", "net.3": "column_gathered"}


@pytest.mark.parametrize("model_cls", [TokenClassifier, TiedTokenClassifier])
@pytest.mark.parametrize("name", ["tp2", "tp3-uneven", "dp2xtp2-shard", "tp2xpp2", "tp2xpp2-cut-after-table",
                                  "dp2xtp2xpp2-shard-cut-after-table"])
def test_an_embedding_split_by_its_vocabulary_equals_one_process(name, model_cls):
    """Each rank holds a block of the table's rows and looks up the ids it holds; an all-reduce sums the lookups
    (until 2026-12-07 an nn.Embedding could not be split: "only nn.Linear and nn.Conv1d / Conv2d / Conv3d"; a table
    tied to an output layer could not be split either)."""
    strategy, devices, dp = {
        "tp2": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, 1),
        "tp3-uneven": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=3), 3, 1),  # 262, 261, 261
        "dp2xtp2-shard": (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2, tensor_parallel_size=2,
                                                   data_parallel="shard"), 4, 2),
        "tp2xpp2": (lambda: SHMModelParallel(start_method="fork", tensor_parallel_size=2, pipeline_parallel_size=2,
                                             microbatches=2), 4, 1),
        # the table on stage 0, the layer tied to it on stage 1: each stage holds the rank's piece, their gradients
        # summed over the two (until 2026-12-07 the stages summed the whole tensors the pieces had replaced)
        "tp2xpp2-cut-after-table": (lambda: SHMModelParallel(start_method="fork", tensor_parallel_size=2,
                                                             pipeline_parallel_size=2, microbatches=2,
                                                             split_points=[2]), 4, 1),
        # and FSDP keeps the piece whole, as it keeps a tied tensor's copies on two stages
        "dp2xtp2xpp2-shard-cut-after-table": (lambda: SHMModelParallel(
            start_method="fork", data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2,
            data_parallel="shard", microbatches=2, split_points=[2]), 8, 2),
    }[name]
    _trained_and_validated_as_one_process(model_cls, strategy(), devices, dp, GLOBAL_BATCH * 2)


# ---------------------------------------------------------------------- a recurrent model
class _LastStep(torch.nn.Module):
    """An LSTM over the image's 28 rows, its last step's output: the RNN keeps its weights in ``_flat_weights``
    (refreshed when a weight attribute is set), which its kernel reads instead of the attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(28, 32, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x.flatten(1, 2))[0][:, -1]  # [B, 1, 28, 28] -> [B, 28 rows, 28] -> [B, 32]


class LSTMClassifier(MNISTClassifier):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = torch.nn.Sequential(_LastStep(), torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


@pytest.mark.parametrize("name", ["ddp", "fsdp", "fsdp-copy", "tp2", "pp2-1f1b", "dp2xpp2-shard"])
def test_an_lstm_equals_one_process(name):
    strategy, devices, dp = LAYOUTS[name]
    _trained_and_validated_as_one_process(LSTMClassifier, strategy(), devices, dp, GLOBAL_BATCH * 3)


@pytest.mark.parametrize("model, policy", [
    ("encoder", lambda name, m: isinstance(m, torch.nn.Linear)),
    ("attention", lambda name, m: isinstance(m, (torch.nn.Linear, torch.nn.MultiheadAttention)))])
@pytest.mark.parametrize("gather", ["view", "copy"])
def test_units_of_layers_torch_attention_reads_itself_are_gathered_around_it(model, policy, gather):
    """nn.MultiheadAttention never calls out_proj (nor the encoder layer's fast path its Linear layers): a unit
    of such a layer is also gathered around the module that reads it (a placement). Until 2026-12-04 such a
    policy was refused ("TransformerEncoderLayer 'net.1' reads 'net.1.self_attn.out_proj.weight' in its own
    forward ...")."""
    model_cls = {"encoder": TorchEncoder, "attention": TorchAttention}[model]
    strategy = SHMFSDPStrategy(start_method="fork", unit_policy=policy, gather=gather)
    _trained_and_validated_as_one_process(model_cls, strategy, 2, 2, GLOBAL_BATCH * STEPS)


@pytest.mark.parametrize("model, strategy, match", [
    ("encoder", lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2,
                                          plan={"net.*.self_attn.out_proj": "column_gathered"}),
     r"'net.1.self_attn.out_proj' \(column_gathered\) is part of nn.MultiheadAttention 'net.1.self_attn', whose "
     r"forward reads its weights itself"),
])
def test_layers_that_torch_attention_reads_itself_are_not_split_apart(no_worker_starts, model, strategy, match):
    """nn.MultiheadAttention never calls out_proj (nor the encoder layer's fast path its Linear layers): a split of
    their own would not see the read."""
    module = {"encoder": TorchEncoder, "attention": TorchAttention}[model]()
    with pytest.raises(ValueError, match=match):
        trainer(strategy=strategy(), devices=2, max_epochs=1).fit(module, loader(mnist_like(8), 4))


class _AttentionBlock(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.attn = torch.nn.LayerNorm(d), torch.nn.MultiheadAttention(d, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return x + self.attn(h, h, h, need_weights=False)[0]


class TorchAttention(MNISTClassifier):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = torch.nn.Sequential(RowEmbedding(16), _AttentionBlock(16), Head(16, 10))


class PooledByAttention(MNISTClassifier):
    """Modules torch's attention reads itself, outside the Sequential: a ``nn.TransformerEncoderLayer`` after it
    and an attention-pooling head (``nn.MultiheadAttention`` with a learned query). Until 2026-12-04 shm_fsdp
    gave each of their children a unit of its own and refused the model ("MultiheadAttention 'pool' reads
    'pool.out_proj.weight' in its own forward ...") although no unit policy was given."""

    def __init__(self, **kw):
        super().__init__(**kw)
        d = 16
        self.net = torch.nn.Sequential(RowEmbedding(d), torch.nn.LayerNorm(d))
        self.enc = torch.nn.TransformerEncoderLayer(d, 4, 32, dropout=0.0, batch_first=True)
        self.query = torch.nn.Parameter(torch.randn(1, 1, d) * 0.1)
        self.pool = torch.nn.MultiheadAttention(d, 4, batch_first=True)
        self.head = torch.nn.Linear(d, 10)

    def forward(self, x):
        h = self.enc(self.net(x))
        return self.head(self.pool(self.query.expand(len(h), -1, -1), h, h, need_weights=False)[0][:, 0])


@pytest.mark.parametrize("name", ["fsdp", "fsdp-copy", "dp2xpp2-shard", "tp2"])
def test_attention_modules_outside_the_sequential_equal_one_process(name):
    """Trained, then validated (the encoder layer's evaluation fast path reads every weight itself; under tp2 the
    derived plan splits the encoder layer, so its fast path must not run on the pieces)."""
    strategy, devices, dp = layouts(name)[name]
    _trained_and_validated_as_one_process(PooledByAttention, strategy(), devices, dp, GLOBAL_BATCH * 3)


class PaddedEncoder(MNISTClassifier):
    """Sequences of different lengths through torch's ``nn.TransformerEncoder`` with a ``src_key_padding_mask``
    (an image's first 10-28 rows as tokens, the rest padding at the end). In evaluation the encoder hands its
    layers a nested tensor (``enable_nested_tensor``, torch's default): under tp, whose layers take the slow
    path, the row layer's all-reduce failed on it ("view: For now nested view cannot change or infer the
    implicit batch dimension"). ``val_nested`` logs whether the first layer got one."""

    tp_plan = {"enc.layers.*.linear1": "column", "enc.layers.*.linear2": "row"}

    def __init__(self, **kw):
        super().__init__(**kw)
        d = 16
        self.net = torch.nn.Sequential(torch.nn.Flatten(1), torch.nn.Unflatten(1, (28, 28)), torch.nn.Linear(28, d))
        self.enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(d, 4, 32, dropout=0.0,
                                                                                batch_first=True), 2)
        self.head = torch.nn.Linear(d, 10)
        self.enc.layers[0].register_forward_pre_hook(self._note_nested)
        self.nested = False

    def _note_nested(self, module, args):
        self.nested = args[0].is_nested

    def forward(self, x):
        lengths = 28 - 2 * (x.flatten(1)[:, 0].abs() * 10).long().clamp(max=9)
        pad = torch.arange(28, device=x.device)[None] >= lengths[:, None]
        h = self.enc(self.net(x), src_key_padding_mask=pad).masked_fill(pad[..., None], 0)
        return self.head(h.sum(1) / lengths[:, None])

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.log("val_nested", float(self.nested), sync_dist=True)


@pytest.mark.parametrize("name", ["tp2", "tp2-gathered", "tp2-heads", "dp2xtp2", "fsdp"])
def test_padded_sequences_through_torchs_transformer_encoder_equal_one_process(name):
    """Trained, then validated on torch's nested-tensor path (each sample its own length); "gathered": the
    feed-forward's first layer all-gathers its output, the second runs whole; "heads": the attention split by its
    heads too (each sample of the nested tensor attended on its own)."""
    gathered = {"enc.layers.*.linear1": "column_gathered"}
    heads = {**PaddedEncoder.tp_plan, "enc.layers.*.self_attn": "heads"}
    strategy, devices, dp = {
        **layouts("fsdp"), "tp2": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, 1),
        "tp2-gathered": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2, plan=gathered), 2, 1),
        "tp2-heads": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2, plan=heads), 2, 1),
        "dp2xtp2": (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2, tensor_parallel_size=2),
                    4, 2)}[name]
    metrics = _trained_and_validated_as_one_process(PaddedEncoder, strategy(), devices, dp, GLOBAL_BATCH * 2)
    assert metrics["val_nested"] == 1.0, "the encoder never handed its layers a nested tensor: the test lost its point"


# ---------------------------------------------------------------------- a language model shaped like nanoGPT
class TinyGPT(pl.LightningModule):
    """Token and position embeddings before the Sequential of blocks, a final LayerNorm and a head tied to the
    token embedding after it (both holders of the tie outside the Sequential); next-token loss, AdamW. Until
    2026-12-04 shm_fsdp and every sharded layout refused it ("'wte.weight' and 'lm_head.weight' are one
    parameter, but FSDP unit 'wte' holds it and 'lm_head.weight' runs in no unit"); then FSDP kept the tied
    embedding whole on every rank. It logs how many rows of it the rank holds (``self.wte.weight`` in the step is
    the full parameter under shm_fsdp's "view": see FSDPState.step_scope)."""

    tp_plan = TRANSFORMER_TP_PLAN
    V, T, D = 32, 12, 16

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(self.V, self.D), torch.nn.Embedding(self.T, self.D)
        self.net = torch.nn.Sequential(*[Block(self.D, 4) for _ in range(4)])
        self.ln_f = torch.nn.LayerNorm(self.D)
        self.lm_head = torch.nn.Linear(self.D, self.V, bias=False)
        self.lm_head.weight = self.wte.weight

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        x, y = idx[:, :-1], idx[:, 1:]
        logits = self.lm_head(self.ln_f(self.net(self.wte(x) + self.wpe(torch.arange(x.shape[1])))))
        self.log("wte_rows", float(dict(self.named_parameters())["wte.weight"].shape[0]))  # the registered one
        return torch.nn.functional.cross_entropy(logits.reshape(-1, self.V), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


# the blocks as the model's tp_plan splits them, and the vocabulary of the tied pair, in Hugging Face's words
_VOCAB_SPLIT = {**TRANSFORMER_TP_PLAN, "wte": "rowwise", "lm_head": "colwise_rep"}


@pytest.mark.parametrize("name", ["fsdp", "fsdp-copy", "dp2xpp2-shard", "tp2xpp2", "tp2-vocab", "tp2xpp2-vocab",
                                  "dp2xtp2-shard-vocab"])
def test_a_gpt_with_its_head_tied_to_the_embedding_equals_one_process(name):
    """shm_fsdp shards the tied embedding like any parameter (a unit gathered at both holders); a pipeline keeps
    it whole on its stages, which sum its gradients. Planned by the vocabulary (``*-vocab``), each tp rank holds
    half the table's rows, which both the embedding and the output layer hold (on every stage of a pipeline, their
    gradients summed over the stages)."""
    runs = {**layouts("fsdp", "fsdp-copy", "dp2xpp2-shard"),
            "tp2xpp2": (lambda: SHMModelParallel(start_method="fork", tensor_parallel_size=2, pipeline_parallel_size=2,
                                                 microbatches=2), 4, 1),
            "tp2-vocab": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2, plan=_VOCAB_SPLIT),
                          2, 1),
            "tp2xpp2-vocab": (lambda: SHMModelParallel(start_method="fork", tensor_parallel_size=2,
                                                       pipeline_parallel_size=2, microbatches=2, plan=_VOCAB_SPLIT), 4,
                              1),
            "dp2xtp2-shard-vocab": (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2,
                                                             tensor_parallel_size=2, data_parallel="shard",
                                                             plan=_VOCAB_SPLIT), 4, 2)}
    strategy, devices, dp = runs[name]

    def fit(strategy, devices, batch, ref):
        pl.seed_everything(SEED)
        model = TinyGPT()
        ds = torch.utils.data.TensorDataset(torch.randint(0, TinyGPT.V, (72, TinyGPT.T + 1),
                                                          generator=torch.Generator().manual_seed(1)))
        t = trainer(strategy=strategy, devices=devices, max_epochs=1, precision="64-true")
        t.fit(model, reference_loader(ds, batch, SEED) if ref else loader(ds, batch))
        assert model.lm_head.weight is model.wte.weight
        return flat_params(model), t.callback_metrics["wte_rows"].item()

    ref, _ = fit("auto", 1, 24, True)
    got, rows = fit(strategy(), devices, 24 // dp, False)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)
    # the registered table's rows: halved by FSDP's shards (without a pipeline) and by the vocabulary split
    halvings = name.startswith(("fsdp", "dp2xtp2-shard")) + name.endswith("-vocab")
    assert rows == TinyGPT.V >> halvings


# ---------------------------------------------------------------------- Llama's block, planned as torch's tutorial
class _LlamaAttention(torch.nn.Module):
    """Llama's attention: no biases, rotary embeddings applied through complex numbers (a complex buffer), causal
    scaled-dot-product attention; heads counted from the width the rank holds."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))

        def rotate(t: torch.Tensor) -> torch.Tensor:
            c = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2)) * freqs_cis.view(1, T, 1, -1)
            return torch.view_as_real(c).flatten(3).type_as(t)

        o = torch.nn.functional.scaled_dot_product_attention(rotate(q).transpose(1, 2), rotate(k).transpose(1, 2),
                                                             v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, T, -1))


class _LlamaFeedForward(torch.nn.Module):
    """SwiGLU: two column layers (w1, w3) multiplied elementwise into one row layer (w2)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2 = torch.nn.Linear(dim, hidden, bias=False), torch.nn.Linear(hidden, dim, bias=False)
        self.w3 = torch.nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class _LlamaBlock(torch.nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, tokens: int = 28) -> None:
        super().__init__()
        self.attention, self.feed_forward = _LlamaAttention(dim, heads), _LlamaFeedForward(dim, 64)
        self.attention_norm, self.ffn_norm = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        angles = torch.outer(torch.arange(tokens).float(),
                             1.0 / 10000 ** (torch.arange(0, dim // heads, 2).float() / (dim // heads)))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), self.freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class _LastToken(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, -1]


def _llama_plan() -> dict:
    """torch's tensor-parallel tutorial's plan for Llama's layers (without sequence parallelism), as it is written
    there, plus the output layer gathered."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    layer = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
             "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
             "feed_forward.w2": RowwiseParallel(), "feed_forward.w3": ColwiseParallel()}
    return {**{f"net.*.{k}": v for k, v in layer.items()}, "net.6": ColwiseParallel(output_layouts=Replicate())}


class LlamaClassifier(MNISTClassifier):
    """The image's 28 rows as tokens through two Llama blocks and a final RMSNorm; the last token classifies."""

    def __init__(self, **kw):
        super().__init__(**kw)
        nn = torch.nn
        self.net = nn.Sequential(nn.Flatten(1, 2), nn.Linear(28, 32), _LlamaBlock(), _LlamaBlock(), nn.RMSNorm(32),
                                 _LastToken(), nn.Linear(32, 10))
        self.tp_plan = _llama_plan()

    def on_train_start(self) -> None:  # the features of wq this rank computes (rank 0: a pipeline's first stage)
        if hasattr(self.net[2], "attention"):  # a later stage holds a placeholder
            self.log("wq_features", float(self.net[2].attention.wq.out_features))


# tensor parallelism alone, beside sharded data parallelism, and in front of a pipeline: name -> (strategy, devices,
# data-parallel ranks)
TP_RUNS = {
    "tp2": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, 1),
    "tp3-uneven": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=3), 3, 1),
    "dp2xtp2-shard": (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2, tensor_parallel_size=2,
                                               data_parallel="shard"), 4, 2),
    "tp2xpp2": (lambda: SHMModelParallel(start_method="fork", tensor_parallel_size=2, pipeline_parallel_size=2,
                                         microbatches=2), 4, 1),
}


@pytest.mark.parametrize("name", ["tp2", "dp2xtp2-shard", "tp2xpp2"])
def test_llama_blocks_planned_as_torchs_tutorial_equal_one_process(name):
    """RMSNorm, rotary embeddings from a complex buffer, SwiGLU (two column layers into one row layer), causal
    attention, split with the plan torch's tutorial writes for Llama."""
    strategy, devices, dp = TP_RUNS[name]
    metrics = _trained_and_validated_as_one_process(LlamaClassifier, strategy(), devices, dp, GLOBAL_BATCH * 2)
    assert metrics["wq_features"] == 16  # of 32: split


# ---------------------------------------------------------------------- transposed convolutions: a decoder's layers
class UpsamplingClassifier(MNISTClassifier):
    """A decoder's shape: the image encoded to [B, 8, 7, 7], two transposed convolutions upsample it to 28 x 28 with
    a BatchNorm2d between -- the layers a VAE's decoder or a DCGAN's generator stacks --, pooled into the classifier.
    The plan derived for the Sequential pairs the two (column, row) and slices the norm between."""

    def __init__(self, **kw):
        super().__init__(**kw)
        nn = torch.nn
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 392), nn.Unflatten(1, (8, 7, 7)),
                                 nn.ConvTranspose2d(8, 16, 4, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                 nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                                 nn.Flatten(), nn.Linear(128, 10))

    def on_train_start(self) -> None:  # the output channels of the first transposed convolution this rank computes
        if isinstance(self.net[3], torch.nn.ConvTranspose2d):  # a later pipeline stage holds a placeholder
            self.log("upsampled_channels", float(self.net[3].out_channels))


class _UpsampledTo(torch.nn.Module):
    """Two ConvTranspose1d whose output lengths the forward gives (``output_size`` picks the output padding), a
    GroupNorm of 6 groups between them in the block's own forward (planned "between")."""

    def __init__(self) -> None:
        super().__init__()
        self.up1 = torch.nn.ConvTranspose1d(28, 12, 3, stride=2)
        self.norm = torch.nn.GroupNorm(6, 12)
        self.up2 = torch.nn.ConvTranspose1d(12, 4, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 28, 28] -> [B, 12, 58] -> [B, 4, 116]
        h = torch.relu(self.norm(self.up1(x, output_size=[58])))  # 57 without it
        return self.up2(h, output_size=[116])  # 115 without it


class Upsampling1dClassifier(MNISTClassifier):
    """A forward hook on the first transposed convolution sees its whole output, as in one process."""

    def __init__(self, **kw):
        super().__init__(**kw)
        nn = torch.nn
        self.net = nn.Sequential(nn.Flatten(1, 2), _UpsampledTo(), nn.Flatten(), nn.Linear(4 * 116, 10))
        self.tp_plan = {"net.1.up1": "column", "net.1.norm": "between", "net.1.up2": "row"}
        self.net[1].up1.register_forward_hook(self._seen)

    def _seen(self, module, args, output):
        self.hooked_channels = output.shape[1]

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("hooked_channels", float(self.hooked_channels))
        return loss

    def on_train_start(self) -> None:
        self.log("upsampled_channels", float(self.net[1].up1.out_channels))


class Upsampling3dClassifier(MNISTClassifier):
    def __init__(self, **kw):
        super().__init__(**kw)
        nn = torch.nn
        self.net = nn.Sequential(nn.Unflatten(2, (4, 7)), nn.ConvTranspose3d(1, 6, 2, stride=2), nn.ReLU(),
                                 nn.ConvTranspose3d(6, 2, 1), nn.AdaptiveAvgPool3d(2), nn.Flatten(), nn.Linear(16, 10))

    def on_train_start(self) -> None:
        if isinstance(self.net[1], torch.nn.ConvTranspose3d):  # a later pipeline stage holds a placeholder
            self.log("upsampled_channels", float(self.net[1].out_channels))


@pytest.mark.parametrize("model_cls, name, channels", [
    (UpsamplingClassifier, "tp2", 8), (UpsamplingClassifier, "tp3-uneven", 6),  # 16 as 6, 5, 5
    (UpsamplingClassifier, "dp2xtp2-sync-batchnorm", 8), (Upsampling1dClassifier, "tp2", 6),
    (Upsampling1dClassifier, "tp3-uneven", 4), (Upsampling3dClassifier, "tp2", 3),
    (Upsampling3dClassifier, "tp2xpp2", 3)])
def test_transposed_convolutions_split_by_tensor_parallelism_equal_one_process(model_cls, name, channels):
    """A column ConvTranspose cuts its weight's dim 1 (a transposed convolution's weight is [C_in, C_out, *k]), a
    row one dim 0 and sums the partial outputs; ``output_size`` passes through. Until 2026-12-07 they stayed whole
    (a plan naming one: "only nn.Linear and nn.Conv1d / Conv2d / Conv3d can be 'column'")."""
    strategy, devices, dp, kw = {
        "tp2": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, 1, {}),
        "tp3-uneven": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=3), 3, 1, {}),
        "dp2xtp2-sync-batchnorm": (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2,
                                                            tensor_parallel_size=2), 4, 2, {"sync_batchnorm": True}),
        "tp2xpp2": (lambda: SHMModelParallel(start_method="fork", tensor_parallel_size=2, pipeline_parallel_size=2,
                                             microbatches=2, split_points=[4]), 4, 1, {}),  # the pair on stage 0
    }[name]
    metrics = _trained_and_validated_as_one_process(model_cls, strategy(), devices, dp, GLOBAL_BATCH * 2, **kw)
    assert metrics["upsampled_channels"] == channels
    if model_cls is Upsampling1dClassifier:
        assert metrics["hooked_channels"] == 12  # whole


# ---------------------------------------------------------------------- torch's attention split by its heads
class _Tokens28(torch.nn.Module):
    """The image's 28 rows as tokens: [B, 28, 28], or [28, B, 28] for layers without ``batch_first``."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1, 2)
        return x if self.batch_first else x.transpose(0, 1)


class _MeanOverRows(torch.nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.dim = 1 if batch_first else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(self.dim)


def _token_model(*blocks: torch.nn.Module) -> torch.nn.Sequential:
    """The image's rows as 28 tokens of 32 features through ``blocks``, their mean classified."""
    return torch.nn.Sequential(_Tokens28(True), torch.nn.Linear(28, 32), *blocks, _MeanOverRows(True),
                               torch.nn.Linear(32, 10))


class HeadSplitEncoder(MNISTClassifier):
    """Two ``nn.TransformerEncoderLayer`` of 4 heads, each attention split by its heads, the feed-forward pair by
    features."""

    tp_plan = {"net.*.self_attn": "heads", "net.*.linear1": "column", "net.*.linear2": "row"}

    def __init__(self, batch_first: bool = True, **kw):
        super().__init__(**kw)
        nn = torch.nn
        layer = functools.partial(nn.TransformerEncoderLayer, 32, 4, 64, dropout=0.0, batch_first=batch_first)
        self.net = nn.Sequential(_Tokens28(batch_first), nn.Linear(28, 32), layer(), layer(),
                                 _MeanOverRows(batch_first), nn.Linear(32, 10))

    def on_train_start(self) -> None:  # the heads this rank computes (rank 0: a pipeline's first stage)
        if isinstance(self.net[2], torch.nn.TransformerEncoderLayer):
            self.log("heads", float(self.net[2].self_attn.num_heads))


class SequenceFirstHeadSplitEncoder(HeadSplitEncoder):
    def __init__(self, **kw):
        super().__init__(batch_first=False, **kw)


class AttentionCalledByTheModule(MNISTClassifier):
    """An ``nn.MultiheadAttention`` the forward calls itself, asking for the weights (averaged over the heads, and
    per head) with a key padding mask and a 3-D float mask that differs per head (the weights enter the loss), with
    the causal hint, and on unbatched samples."""

    tp_plan = {"attn": "heads"}

    def __init__(self, **kw):
        super().__init__(**kw)
        self.proj = torch.nn.Linear(28, 32)
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x.flatten(1, 2))
        B, L, _ = h.shape
        padding = torch.arange(L) >= L - 3  # the last 3 rows
        c = x.flatten(1, 2)[..., :1]
        per_head = torch.sin(c @ c.transpose(1, 2)).repeat_interleave(4, dim=0) * torch.arange(1, 5).repeat(B).view(
            -1, 1, 1)  # [B * 4 heads, L, L]
        out, averaged = self.attn(h, h, h, key_padding_mask=padding.expand(B, L), attn_mask=per_head)
        out2, each = self.attn(h, h, h, average_attn_weights=False)
        causal = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=h.dtype)
        out3, _ = self.attn(h, h, h, attn_mask=causal, is_causal=True, need_weights=False)  # SDPA's causal path
        out4 = torch.stack([self.attn(s, s, s)[0] for s in h[:, :8]])  # unbatched: each sample's [8, E] alone
        pooled = out.mean(1) + out2.mean(1) + out3.mean(1) + out4[:, 0]
        return self.net(pooled) * (1 + averaged[:, 0, :10]) + each[:, 1, 0, :10]  # [B, 10]

    def on_train_start(self) -> None:
        self.log("heads", float(self.attn.num_heads))


@pytest.mark.parametrize("model_cls, name, heads", [
    (HeadSplitEncoder, "tp2", 2), (HeadSplitEncoder, "tp3-uneven", 2), (HeadSplitEncoder, "dp2xtp2-shard", 2),
    (HeadSplitEncoder, "tp2xpp2", 2), (SequenceFirstHeadSplitEncoder, "tp2", 2),
    (AttentionCalledByTheModule, "tp2", 2), (AttentionCalledByTheModule, "tp3-uneven", 2),
    (AttentionCalledByTheModule, "dp2xtp2-shard", 2)])
def test_torch_attention_split_by_its_heads_equals_one_process(model_cls, name, heads):
    """``"heads"`` splits an ``nn.MultiheadAttention``: each rank its heads' rows of the fused q, k, v weight and
    their columns of the output projection, whose partial outputs are summed (4 heads at tp3: 2, 1, 1). Until
    2026-12-07 its fused ``in_proj_weight`` stayed whole on every rank."""
    strategy, devices, dp = TP_RUNS[name]
    metrics = _trained_and_validated_as_one_process(model_cls, strategy(), devices, dp, GLOBAL_BATCH * 2)
    assert metrics["heads"] == heads


class TorchDecoder(MNISTClassifier):
    """Six learned queries decode the image's rows through torch's ``nn.TransformerDecoder`` -- causal self-attention,
    cross-attention to the rows past a memory padding mask -- run by the forward outside the Sequential, the head
    after it. No plan: the derived one splits each decoder layer's feed-forward pair and both its attentions."""

    def __init__(self, **kw):
        super().__init__(**kw)
        nn = torch.nn
        self.rows = nn.Linear(28, 32)
        self.queries = nn.Parameter(torch.randn(6, 32) * 0.1)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2)
        self.net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = self.rows(x.flatten(1, 2))  # [B, 28 rows, 32]
        B = memory.shape[0]
        causal = torch.nn.Transformer.generate_square_subsequent_mask(6, dtype=memory.dtype)
        out = self.decoder(self.queries.expand(B, -1, -1), memory, tgt_mask=causal, tgt_is_causal=True,
                           memory_key_padding_mask=(torch.arange(28) >= 25).expand(B, 28))
        return self.net(out.mean(1))

    def on_train_start(self) -> None:
        layer = self.decoder.layers[1]
        self.log("heads", float(layer.multihead_attn.num_heads + layer.self_attn.num_heads))
        self.log("features", float(layer.linear1.out_features))


class TorchSeq2Seq(TorchDecoder):
    """torch's ``nn.Transformer``: the rows encoded, the queries decoded from them."""

    def __init__(self, **kw):
        super().__init__(**kw)
        del self.decoder
        self.transformer = torch.nn.Transformer(32, 4, 1, 1, 64, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        src = self.rows(x.flatten(1, 2))
        return self.net(self.transformer(src, self.queries.expand(src.shape[0], -1, -1)).mean(1))

    def on_train_start(self) -> None:
        layer, encoder = self.transformer.decoder.layers[0], self.transformer.encoder.layers[0]
        self.log("heads", float(layer.multihead_attn.num_heads + encoder.self_attn.num_heads))
        self.log("features", float(layer.linear1.out_features))


@pytest.mark.parametrize("model_cls, name, heads, features", [
    (TorchDecoder, "tp2", 4, 32), (TorchDecoder, "tp3-uneven", 4, 22), (TorchDecoder, "dp2xtp2-shard", 4, 32),
    (TorchDecoder, "tp2xpp2", 4, 32), (TorchSeq2Seq, "tp2", 4, 32)])
def test_torchs_transformer_blocks_outside_the_sequential_split_by_the_derived_plan_equal_one_process(
        model_cls, name, heads, features):
    """torch's decoder layers and ``nn.Transformer`` held by the module, not the Sequential: each rank computes its
    heads of every attention (4 at tp3: 2, 1, 1 -- rank 0's 2 + 2) and its features of every feed-forward pair
    (64 at tp3: 22, 21, 21).
    Until 2026-12-07 the derived plan split only blocks that were the Sequential's children: "the plan splits no
    layer"."""
    strategy, devices, dp = TP_RUNS[name]
    metrics = _trained_and_validated_as_one_process(model_cls, strategy(), devices, dp, GLOBAL_BATCH * 2)
    assert (metrics["heads"], metrics["features"]) == (heads, features)


# ---------------------------------------------------------------------- fused projections: one Linear, several parts
class _FusedAttention(torch.nn.Module):
    """timm's ViT attention: q, k and v from one Linear, cut apart by ``reshape(B, N, 3, -1, head_dim)``; with
    ``qk_norm`` (timm's, Qwen3's, OLMo 2's) q and k normalised per head by a LayerNorm(head_dim) of whole
    parameters."""

    def __init__(self, dim: int = 32, heads: int = 4, qk_norm: bool = False) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        norm = (lambda: torch.nn.LayerNorm(self.head_dim)) if qk_norm else torch.nn.Identity
        self.q_norm, self.k_norm = norm(), norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)  # [B, heads, N, head_dim]: this rank's heads
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, heads, N, head_dim]
        return self.proj(out.transpose(1, 2).flatten(2))


class _FusedSwiGLU(torch.nn.Module):
    """Llama's feed-forward with its gate and up projections as one Linear, cut apart by ``.chunk(2, -1)``."""

    def __init__(self, dim: int = 32, hidden: int = 48) -> None:
        super().__init__()
        self.w13, self.w2 = torch.nn.Linear(dim, 2 * hidden), torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, -1)
        return self.w2(torch.nn.functional.silu(gate) * up)


class _FusedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(32), _FusedAttention(), nn.LayerNorm(32), \
            _FusedSwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class FusedProjections(MNISTClassifier):
    """Two blocks whose attention and feed-forward each project with one fused Linear, planned with its blocks. A
    forward hook on the first fused q, k, v layer reads its v part, which scales the logits."""

    tp_plan = {"net.*.attn.qkv": {"style": "column", "blocks": 3}, "net.*.attn.proj": "row",
               "net.*.mlp.w13": {"style": "column", "blocks": 2}, "net.*.mlp.w2": "row"}
    hooked = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = _token_model(_FusedBlock(), _FusedBlock())
        if self.hooked:
            self.net[2].attn.qkv.register_forward_hook(self._v_part)

    def _v_part(self, module, args, out) -> None:
        self.v_energy = out[..., 64:].pow(2).mean((1, 2))  # [B, N, 96]: q, k, v of 32 features each -> [B]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.net(x)
        return logits * (1 + self.v_energy[:, None]) if self.hooked else logits

    def on_train_start(self) -> None:  # rank 0's parts (a later pipeline stage holds a placeholder)
        if isinstance(self.net[2], _FusedBlock):
            self.log("qkv_features", float(self.net[2].attn.qkv.out_features))
            self.log("w13_features", float(self.net[2].mlp.w13.out_features))


class FusedProjectionsPipelined(FusedProjections):
    hooked = False  # the hook's layer and the step reading what it kept sit on two stages


@pytest.mark.parametrize("model_cls, name, qkv, w13", [
    (FusedProjections, "tp2", 48, 48), (FusedProjections, "tp3-uneven", 48, 32),
    (FusedProjections, "dp2xtp2-shard", 48, 48), (FusedProjectionsPipelined, "tp2xpp2", 48, 48)])
def test_fused_projections_split_by_their_blocks_equal_one_process(model_cls, name, qkv, w13):
    """A fused q, k, v Linear planned ``{"style": "column", "blocks": 3}``: each rank holds its heads' rows of q, of
    k and of v (4 heads at tp3: 2, 1, 1 -> rank 0's 3 x 16 features); a fused gate and up Linear with blocks 2
    (48 hidden at tp3: 16 of each). A hook on the layer sees its whole output, q, k and v in place. Until
    2026-12-07 such a layer planned ``"column"`` gave rank 0 all of q and half of k, and the model trained
    otherwise than in one process without an error; planned so now, it is refused, naming the blocks."""
    strategy, devices, dp = TP_RUNS[name]
    metrics = _trained_and_validated_as_one_process(model_cls, strategy(), devices, dp, GLOBAL_BATCH * 2)
    assert (metrics["qkv_features"], metrics["w13_features"]) == (qkv, w13)


PARTED = "after the first optimizer step the ranks' copies of"


class QKNormed(KeepsWarnings, MNISTClassifier):
    """Two attention layers normalising q and k per head (``qk_norm``), planned ``"on_heads"`` or not; logs
    whether the strategy warned that the ranks' copies parted, naming the style."""

    def __init__(self, planned: bool = True, **kw):
        super().__init__(**kw)
        self.net = _token_model(_FusedAttention(qk_norm=True), torch.nn.GELU(), _FusedAttention(qk_norm=True))
        self.tp_plan = {"net.[24].qkv": {"style": "column", "blocks": 3}, "net.[24].proj": "row",
                        **({"net.[24].[qk]_norm": "on_heads"} if planned else {})}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("parted", float(any(PARTED in str(w.message) and "'on_heads'" in str(w.message)
                                     for w in self._caught)))
        return loss


@pytest.mark.parametrize("name", ["tp2", "tp3-uneven", "dp2xtp2-shard", "tp2xpp2"])
def test_norms_on_the_ranks_heads_planned_on_heads_equal_one_process(name):
    """Each rank normalises its own heads, so the norms' whole parameters get each rank's gradient from its heads
    only; "on_heads" sums it over the tp ranks (as a pipeline's microbatches and FSDP's shards take it too)."""
    strategy, devices, dp = TP_RUNS[name]
    metrics = _trained_and_validated_as_one_process(QKNormed, strategy(), devices, dp, GLOBAL_BATCH * 2)
    assert metrics.get("parted", 0.0) == 0.0


def test_norms_on_the_ranks_heads_left_unplanned_part_the_ranks_and_the_strategy_says_what_to_plan():
    """Until 2026-12-07 there was no plan for them: each rank stepped its copy with its heads' gradient (3.8e-2 off
    one process after 2 steps), and the warning that the copies parted named only gradients set by hand."""
    _, ref = fit_seeded(functools.partial(QKNormed, optimizer="adam", lr=0.01), "auto", 1, GLOBAL_BATCH, ref=True)
    strategy, devices, _ = TP_RUNS["tp2"]
    t, got = fit_seeded(functools.partial(QKNormed, False, optimizer="adam", lr=0.01), strategy(), devices,
                        GLOBAL_BATCH)
    assert float(t.callback_metrics["parted"]) == 1.0
    assert float((flat_params(got) - flat_params(ref)).abs().max()) > 1e-4


# ---------------------------------------------------------------------- grouped-query attention: fewer kv heads
class _GroupedQueryAttention(torch.nn.Module):
    """Llama 3's / Qwen2's attention as Hugging Face writes it: 12 q heads, ``kv_heads`` k and v heads, q head ``h``
    attending with kv head ``h // (12 / kv_heads)``. ``repeat``: k and v repeated by the stored
    ``num_key_value_groups`` (Hugging Face's ``repeat_kv``), by q's heads over k's (``"ratio"``), or paired by
    torch's SDPA (``"sdpa"``: ``enable_gqa=True``)."""

    def __init__(self, dim: int, kv_heads: int, repeat: str, heads: int = 12, head_dim: int = 4) -> None:
        super().__init__()
        self.head_dim, self.num_key_value_groups, self.repeat = head_dim, heads // kv_heads, repeat
        self.q_proj = torch.nn.Linear(dim, heads * head_dim, bias=False)
        self.k_proj, self.v_proj = (torch.nn.Linear(dim, kv_heads * head_dim) for _ in range(2))
        self.o_proj = torch.nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.repeat != "sdpa":
            n_rep = self.num_key_value_groups if self.repeat == "stored" else q.shape[1] // k.shape[1]
            k, v = (t.repeat_interleave(n_rep, dim=1) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               enable_gqa=self.repeat == "sdpa")
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class _GQABlock(torch.nn.Module):
    def __init__(self, kv_heads: int, repeat: str) -> None:
        super().__init__()
        self.norm, self.attn = torch.nn.RMSNorm(24), _GroupedQueryAttention(24, kv_heads, repeat)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


class GroupedQueryAttention(MNISTClassifier):
    """Hugging Face's stored repeat with 4 kv heads, torch's ``enable_gqa`` with 3, one kv head (multi-query
    attention, Falcon's, Gemma 2B's) repeated by q's heads over k's, and 2 kv heads with ``enable_gqa``, planned as
    Hugging Face plans Llama (q, k, v ``"colwise"``, o ``"rowwise"``)."""

    tp_plan = {"net.*.attn.[qkv]_proj": "colwise", "net.*.attn.o_proj": "rowwise"}

    def __init__(self, **kw):
        super().__init__(**kw)
        nn = torch.nn
        self.net = nn.Sequential(_Tokens28(True), nn.Linear(28, 24), _GQABlock(4, "stored"), _GQABlock(3, "sdpa"),
                                 _GQABlock(1, "ratio"), _GQABlock(2, "sdpa"), _MeanOverRows(True), nn.Linear(24, 10))

    def on_train_start(self) -> None:  # rank 0's heads (a pipeline's later stage holds a placeholder)
        for i in (2, 3, 4, 5):
            if isinstance(self.net[i], _GQABlock):
                attn = self.net[i].attn
                self.log(f"heads{i}", float(attn.q_proj.out_features // 4 * 100 + attn.k_proj.out_features // 4))


@pytest.mark.parametrize("name, heads", [("tp2", (602, 802, 601, 601)), ("tp3-uneven", (602, 401, 401, 301)),
                                         ("dp2xtp2-shard", (602, 802, 601, 601)), ("tp2xpp2", (602, 802, 601, 601))])
def test_grouped_query_attention_splits_by_kv_groups_equal_one_process(name, heads):
    """A rank holds whole kv groups: kv heads split evenly, q heads (and o's input) 12 / kv times as many -- 3 kv heads
    at tp2 as 2 + 1 with q as 8 + 4 (logged as 100 x q heads + kv heads of rank 0). Fewer kv heads than ranks: each
    rank computes its group's kv head, which other ranks compute too, and some of the group's q heads -- the one kv
    head of multi-query attention on every rank, q as 6 + 6 at tp2 (its k and v weights whole on every rank, their
    gradients summed over the ranks); 2 kv heads at tp3, kv head 0 on ranks 0 and 1 with q as 3 + 3, kv head 1 on
    rank 2 with 6. Until 2026-12-07 q was split on its own (6 + 6 with 3 kv heads): with
    ``enable_gqa`` rank 0's q heads 0-5 attended with its kv heads 0-1 three by three, where one process pairs them
    four by four -- otherwise than one process without an error (4.0e-2 after 2 steps); with the stored repeat the
    shapes failed; with one kv head the plan was refused."""
    strategy, devices, dp = TP_RUNS[name]
    metrics = _trained_and_validated_as_one_process(GroupedQueryAttention, strategy(), devices, dp, GLOBAL_BATCH * 2)
    logged = {i: int(metrics[f"heads{i}"]) for i in (2, 3, 4, 5) if f"heads{i}" in metrics}
    assert logged and logged == {i: heads[i - 2] for i in logged}


# ---------------------------------------------------------------------- Phi-3: fused projections gathered
class _Phi3Attention(torch.nn.Module):
    """Phi-3's attention as Hugging Face writes it: q, k and v from one Linear of unequal parts -- 8 q heads, 2 kv
    heads of 4 -- cut apart at the widths it stored, k and v repeated by the stored group size."""

    def __init__(self, dim: int = 32, heads: int = 8, kv_heads: int = 2, head_dim: int = 4) -> None:
        super().__init__()
        self.head_dim, self.num_heads, self.num_key_value_heads = head_dim, heads, kv_heads
        self.qkv_proj = torch.nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o_proj = torch.nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv_proj(x)
        q_end, kv = self.num_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        q, k, v = qkv[..., :q_end], qkv[..., q_end:q_end + kv], qkv[..., q_end + kv:]
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = (t.view(B, T, self.num_key_value_heads, self.head_dim).transpose(1, 2)
                .repeat_interleave(self.num_heads // self.num_key_value_heads, dim=1) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class _Phi3MLP(torch.nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 48) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(dim, 2 * hidden, bias=False)
        self.down_proj = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * torch.nn.functional.silu(gate))


class _Phi3Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.input_layernorm, self.self_attn = nn.RMSNorm(32), _Phi3Attention()
        self.post_attention_layernorm, self.mlp = nn.RMSNorm(32), _Phi3MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


# Hugging Face's Phi3Config.base_model_tp_plan (Transformers 5), its "layers" our "net"
PHI3_TP_PLAN = {"net.*.self_attn.qkv_proj": "colwise_gather_output", "net.*.self_attn.o_proj": "rowwise_split_input",
                "net.*.mlp.gate_up_proj": "colwise_gather_output", "net.*.mlp.down_proj": "rowwise_split_input"}


class Phi3Shaped(MNISTClassifier):
    """Two Phi-3 decoder layers planned with Hugging Face's plan for Phi-3, word for word. A forward hook on the
    first ``down_proj`` scales its output by its input's energy: it sees both whole, as in one process."""

    tp_plan = PHI3_TP_PLAN

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = _token_model(_Phi3Layer(), _Phi3Layer())
        self.net[2].mlp.down_proj.register_forward_hook(self._scaled)

    @staticmethod
    def _scaled(module, args, out):
        return out * (1 + 0.01 * args[0].pow(2).sum(-1, keepdim=True))

    def on_train_start(self) -> None:  # rank 0's pieces (a pipeline's later stage holds a placeholder)
        if isinstance(self.net[2], _Phi3Layer):
            layer = self.net[2]
            self.log("pieces", float(layer.self_attn.qkv_proj.out_features * 10_000
                                     + layer.self_attn.o_proj.in_features * 100 + layer.mlp.down_proj.in_features))


@pytest.mark.parametrize("name, pieces", [("tp2", (24, 16, 24)), ("tp3-uneven", (16, 11, 16)),
                                          ("dp2xtp2-shard", (24, 16, 24)), ("tp2xpp2", (24, 16, 24))])
def test_phi3_planned_with_hugging_faces_plan_equals_one_process(name, pieces):
    """Phi-3's fused ``qkv_proj`` holds q, k and v of unequal widths (8 q and 2 kv heads: 32 + 8 + 8), which no split
    into equal blocks fits; Hugging Face's plan gathers its output (``"colwise_gather_output"``) and has ``o_proj``
    split its whole input itself (``"rowwise_split_input"``), the fused gate and up projection and ``down_proj``
    alike. Each rank computes its share of each Linear (rank 0's: qkv's output, o's and down's input features, split
    evenly: whole heads matter only where split features meet the attention's code).
    Until 2026-12-07 the plan was refused: "a plan style must be one of ..." (and torch's ``RowwiseParallel(
    input_layouts=Replicate())`` on a Linear: "a row layer here takes the split output of a column layer")."""
    strategy, devices, dp = TP_RUNS[name]
    metrics = _trained_and_validated_as_one_process(Phi3Shaped, strategy(), devices, dp, GLOBAL_BATCH * 2)
    assert int(metrics["pieces"]) == pieces[0] * 10_000 + pieces[1] * 100 + pieces[2]


class _Olmo2Attention(torch.nn.Module):
    """OLMo 2's attention as Hugging Face writes it: q and k RMS-normed across all their heads right after their
    projections, before the heads are viewed (``RMSNorm(H * head_dim)``); 8 q heads, 2 kv heads of 4."""

    def __init__(self, dim: int = 32, heads: int = 8, kv_heads: int = 2, head_dim: int = 4) -> None:
        super().__init__()
        nn = torch.nn
        self.head_dim, self.num_key_value_groups = head_dim, heads // kv_heads
        self.q_proj, self.o_proj = nn.Linear(dim, heads * head_dim, bias=False), nn.Linear(heads * head_dim, dim)
        self.k_proj, self.v_proj = (nn.Linear(dim, kv_heads * head_dim, bias=False) for _ in range(2))
        self.q_norm, self.k_norm = nn.RMSNorm(heads * head_dim), nn.RMSNorm(kv_heads * head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x)), self.v_proj(x)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(self.num_key_value_groups, dim=1) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class _SwiGLU(torch.nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 48) -> None:
        super().__init__()
        nn = torch.nn
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Olmo2Layer(torch.nn.Module):
    """OLMo 2's post-norm block: the norms on the sublayers' outputs, before the residual sum."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.self_attn, self.post_attention_layernorm = _Olmo2Attention(), nn.RMSNorm(32)
        self.mlp, self.post_feedforward_layernorm = _SwiGLU(), nn.RMSNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x))
        return x + self.post_feedforward_layernorm(self.mlp(x))


# Hugging Face's Olmo2Config.base_model_tp_plan (Transformers 5), its "layers" our "net"
OLMO2_TP_PLAN = {"net.*.self_attn.[qkv]_proj": "colwise_gather_output", "net.*.self_attn.o_proj": "rowwise_split_input",
                 "net.*.mlp.gate_proj": "colwise", "net.*.mlp.up_proj": "colwise", "net.*.mlp.down_proj": "rowwise"}


class Olmo2Shaped(MNISTClassifier):
    """Two OLMo 2 decoder layers planned with Hugging Face's plan for OLMo 2, word for word."""

    tp_plan = OLMO2_TP_PLAN

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = _token_model(_Olmo2Layer(), _Olmo2Layer())

    def on_train_start(self) -> None:  # rank 0's pieces (a pipeline's later stage holds a placeholder)
        if isinstance(self.net[2], _Olmo2Layer):
            attn = self.net[2].self_attn
            self.log("pieces", float(attn.q_proj.out_features * 10_000 + attn.k_proj.out_features * 100
                                     + attn.o_proj.in_features))


@pytest.mark.parametrize("name, pieces", [("tp2", (16, 4, 16)), ("tp3-uneven", (11, 3, 11)),
                                          ("dp2xtp2-shard", (16, 4, 16)), ("tp2xpp2", (16, 4, 16))])
def test_olmo2_planned_with_hugging_faces_plan_equals_one_process(name, pieces):
    """OLMo 2 normalises q and k across all heads before viewing them, so Hugging Face's plan gathers q, k and v
    and has ``o_proj`` split its whole input; the feed-forward is a plain column -> row pair. Gathered, q, k and v
    need neither whole heads nor kv groups on a rank: k's 2 kv heads at tp3 are split 3 + 3 + 2 features. Until
    2026-12-07 the plan was refused ("a plan style must be one of ..."), and a gathered k with fewer kv heads than
    ranks was refused as grouped-query attention ("its kv heads, whose layer must be 'column'")."""
    strategy, devices, dp = TP_RUNS[name]
    metrics = _trained_and_validated_as_one_process(Olmo2Shaped, strategy(), devices, dp, GLOBAL_BATCH * 2)
    assert int(metrics["pieces"]) == pieces[0] * 10_000 + pieces[1] * 100 + pieces[2]


class _NeoXAttention(torch.nn.Module):
    """GPT-NeoX's (Pythia's) attention as Hugging Face writes it: one Linear for q, k and v laid out per head -- each
    head's q, k and v side by side -- viewed into heads first (``view(B, T, -1, 3 * head_size)``), then cut
    ``.chunk(3, -1)``; 8 heads of 4."""

    def __init__(self, dim: int = 32, heads: int = 8) -> None:
        super().__init__()
        self.head_size = dim // heads
        self.query_key_value, self.dense = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.query_key_value(x).view(B, T, -1, 3 * self.head_size).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(B, T, -1))


class _NeoXMLP(torch.nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.dense_h_to_4h, self.dense_4h_to_h = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(torch.nn.functional.gelu(self.dense_h_to_4h(x)))


class _NeoXLayer(torch.nn.Module):
    """GPT-NeoX's parallel residual: attention and MLP both read the layer's input."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(32), nn.LayerNorm(32)
        self.attention, self.mlp = _NeoXAttention(), _NeoXMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attention(self.input_layernorm(x)) + self.mlp(self.post_attention_layernorm(x))


class NeoXShaped(MNISTClassifier):
    """Two GPT-NeoX layers planned with Hugging Face's words, the fused projection one part on whole heads of its
    layout (12 features: a head's q, k and v) and the output projection on whole heads of 4."""

    tp_plan = {"net.*.attention.query_key_value": {"style": "colwise", "blocks": 1, "head_dim": 12},
               "net.*.attention.dense": {"style": "rowwise", "head_dim": 4},
               "net.*.mlp.dense_h_to_4h": "colwise", "net.*.mlp.dense_4h_to_h": "rowwise"}

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = _token_model(_NeoXLayer(), _NeoXLayer())

    def on_train_start(self) -> None:  # rank 0's heads (a pipeline's later stage holds a placeholder)
        if isinstance(self.net[2], _NeoXLayer):
            self.log("qkv_features", float(self.net[2].attention.query_key_value.out_features))


@pytest.mark.parametrize("name, qkv", [("tp2", 48), ("tp3-uneven", 36), ("dp2xtp2-shard", 48), ("tp2xpp2", 48)])
def test_gpt_neox_fused_projection_laid_out_per_head_equals_one_process(name, qkv):
    """GPT-NeoX lays its fused projection out per head, so a rank's whole heads are one contiguous run of it: one
    part (``blocks: 1``) on whole heads of 12 features (3 + 3 + 2 heads at tp3: rank 0's 36). The check asking a
    fused projection for its blocks names this layout beside q | k | v side by side (``blocks: 3``): planned with
    blocks 3, each rank's slice of each third mixes heads' q, k and v, and the shapes still fit."""
    strategy, devices, dp = TP_RUNS[name]
    metrics = _trained_and_validated_as_one_process(NeoXShaped, strategy(), devices, dp, GLOBAL_BATCH * 2)
    assert metrics["qkv_features"] == qkv


class _FalconAttention(torch.nn.Module):
    """Falcon's attention (its new decoder architecture) as Hugging Face writes it: one Linear for q, k and v laid out
    per kv group -- each group's 2 q heads, then its k and its v head -- viewed into groups (``view(B, T, -1, 2 + 2,
    head_dim)``), k and v broadcast to the group's q heads; 8 q heads of 4 in 4 groups."""

    def __init__(self, dim: int = 32, heads: int = 8, kv_heads: int = 4) -> None:
        super().__init__()
        self.head_dim, self.per_kv = dim // heads, heads // kv_heads
        self.query_key_value = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.dense = torch.nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.query_key_value(x).view(B, T, -1, self.per_kv + 2, self.head_dim)
        q = qkv[:, :, :, :-2]
        k, v = (torch.broadcast_to(qkv[:, :, :, [i]], q.shape) for i in (-2, -1))
        q, k, v = (t.flatten(2, 3).transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(B, T, -1))


class _FalconLayer(torch.nn.Module):
    """Falcon's parallel attention and MLP, each after its own LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_attn, self.ln_mlp = torch.nn.LayerNorm(32), torch.nn.LayerNorm(32)
        self.self_attention, self.mlp = _FalconAttention(), _NeoXMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.self_attention(self.ln_attn(x)) + self.mlp(self.ln_mlp(x))


class FalconShaped(MNISTClassifier):
    """Two Falcon layers, the fused projection one part on whole kv groups (16 features: 2 q heads, k and v) and the
    output projection on the groups' q heads (8 features)."""

    tp_plan = {"net.*.self_attention.query_key_value": {"style": "column", "blocks": 1, "head_dim": 16},
               "net.*.self_attention.dense": {"style": "row", "head_dim": 8},
               "net.*.mlp.dense_h_to_4h": "column", "net.*.mlp.dense_4h_to_h": "row"}

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = _token_model(_FalconLayer(), _FalconLayer())

    def on_train_start(self) -> None:  # rank 0's groups (a pipeline's later stage holds a placeholder)
        if isinstance(self.net[2], _FalconLayer):
            attention = self.net[2].self_attention
            self.log("pieces", float(attention.query_key_value.out_features * 100 + attention.dense.in_features))


@pytest.mark.parametrize("name, pieces", [("tp2", (32, 16)), ("tp3-uneven", (32, 16)), ("dp2xtp2-shard", (32, 16)),
                                          ("tp2xpp2", (32, 16))])
def test_falcon_fused_projection_laid_out_per_kv_group_equals_one_process(name, pieces):
    """Falcon lays its fused projection out per kv group, so a rank's whole groups are one contiguous run of it: one
    part on whole groups of 16 features, the output projection on their 2 q heads (tp3: groups 2 + 1 + 1, rank 0's 32
    and 16 features). With 2 q heads per kv head the projection gives 2 x the output projection's input, and the
    refusal asking for its blocks names this layout beside the others: planned ``blocks: 2``, each rank's slice of
    each half mixes the groups' q, k and v, the shapes still fit, and the model trains 4.0e-2 off one process
    (``/tmp/pm/falcon.py tp2 blocks2``, a local probe, 2026-12-08)."""
    strategy, devices, dp = TP_RUNS[name]
    metrics = _trained_and_validated_as_one_process(FalconShaped, strategy(), devices, dp, GLOBAL_BATCH * 2)
    assert int(metrics["pieces"]) == pieces[0] * 100 + pieces[1]


class _Qwen3Attention(torch.nn.Module):
    """Qwen3's (Gemma 3's) attention as Hugging Face writes it: q and k normalised per head (``RMSNorm(head_dim)``
    after the heads are viewed), 8 q heads of 4 and ``kv_heads`` k and v heads, paired by torch's SDPA."""

    def __init__(self, kv_heads: int, dim: int = 32, heads: int = 8, head_dim: int = 4) -> None:
        super().__init__()
        nn = torch.nn
        self.head_dim = head_dim
        self.q_proj, self.o_proj = nn.Linear(dim, heads * head_dim, bias=False), nn.Linear(heads * head_dim, dim)
        self.k_proj, self.v_proj = (nn.Linear(dim, kv_heads * head_dim, bias=False) for _ in range(2))
        self.q_norm, self.k_norm = nn.RMSNorm(head_dim), nn.RMSNorm(head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class _Qwen3Layer(torch.nn.Module):
    """``gated``: the attention's output scaled by a zero-initialised parameter (ReZero, DiT's adaLN-Zero), so
    every gradient inside the attention is zero at the first step."""

    def __init__(self, kv_heads: int, gated: bool = False) -> None:
        super().__init__()
        nn = torch.nn
        self.input_layernorm, self.self_attn = nn.RMSNorm(32), _Qwen3Attention(kv_heads)
        self.post_attention_layernorm, self.mlp = nn.RMSNorm(32), _SwiGLU()
        self.gate = nn.Parameter(torch.zeros(())) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x))
        x = x + (attn if self.gate is None else self.gate * attn)
        return x + self.mlp(self.post_attention_layernorm(x))


# Hugging Face's Qwen3Config.base_model_tp_plan (Transformers 5), its "layers" our "net"
QWEN3_TP_PLAN = {"net.*.self_attn.[qkv]_proj": "colwise", "net.*.self_attn.[qk]_norm": "replicated_with_grad_allreduce",
                 "net.*.self_attn.o_proj": "rowwise", "net.*.mlp.gate_proj": "colwise", "net.*.mlp.up_proj": "colwise",
                 "net.*.mlp.down_proj": "rowwise"}


class Qwen3Shaped(MNISTClassifier):
    """A Qwen3 decoder layer of 2 kv heads and one of 1 (multi-query attention, as Gemma 3 1B), planned with Hugging
    Face's plan for Qwen3 word for word; ``gated``: each attention behind a zero-initialised scale."""

    tp_plan = QWEN3_TP_PLAN
    gated = False

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = _token_model(_Qwen3Layer(2, self.gated), _Qwen3Layer(1, self.gated))


class Qwen3Gated(Qwen3Shaped):
    gated = True


@pytest.mark.parametrize("model_cls, name", [(Qwen3Shaped, "tp2"), (Qwen3Shaped, "tp3-uneven"),
                                             (Qwen3Shaped, "dp2xtp2-shard"), (Qwen3Shaped, "tp2xpp2"),
                                             (Qwen3Gated, "tp2")])
def test_qwen3_planned_with_hugging_faces_plan_equals_one_process(model_cls, name):
    """q_norm and k_norm run on the rank's heads: "replicated_with_grad_allreduce" (our "on_heads") sums their
    gradients over the tp ranks. With fewer kv heads than ranks a rank's k_norm normalises a kv head other ranks
    compute too -- with one kv head every rank computes the same one, from the same input -- and its gradient comes
    from the rank's q heads only: summed, it is one process's. Until 2026-12-07 the words got "a plan style must
    be one of ...". Behind a zero-initialised gate every rank's first gradients of them are zero -- alike, and
    summed harmlessly: the check that stops a module on whole features waits for a nonzero one."""
    strategy, devices, dp = TP_RUNS[name]
    _trained_and_validated_as_one_process(model_cls, strategy(), devices, dp, GLOBAL_BATCH * 2)


# ---------------------------------------------------------------------- tensors with an entry per head
class _PerHeadAttention(torch.nn.Module):
    """5 heads of 4 with a tensor holding an entry per head: gpt-oss's attention sinks (a learned logit per head the
    softmax also normalises over, ``[H]``), ALiBi's slopes (a buffer ``[H]``: a distance penalty per head), or T5's
    relative position bias (an ``nn.Embedding(buckets, H)``: a learned bias per distance and head)."""

    def __init__(self, kind: str, heads: int = 5, head_dim: int = 4) -> None:
        super().__init__()
        self.kind, self.head_dim = kind, head_dim
        self.q, self.k, self.v = (torch.nn.Linear(24, heads * head_dim) for _ in range(3))
        self.o = torch.nn.Linear(heads * head_dim, 24)
        if kind == "sinks":
            self.sinks = torch.nn.Parameter(torch.randn(heads))
        elif kind == "alibi":
            self.register_buffer("slopes", 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads))
        else:
            self.relative_bias = torch.nn.Embedding(8, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5  # [B, heads, T, T]: this rank's heads
        distance = (torch.arange(T)[None, :] - torch.arange(T)[:, None]).abs()
        if self.kind == "sinks":
            sinks = self.sinks.reshape(1, -1, 1, 1).expand(B, -1, T, -1)
            weights = torch.cat([scores, sinks], -1).softmax(-1)[..., :-1]
        elif self.kind == "alibi":
            weights = (scores - self.slopes[:, None, None] * distance).softmax(-1)
        else:
            weights = (scores + self.relative_bias(distance.clamp(max=7)).permute(2, 0, 1)).softmax(-1)
        return self.o((weights @ v).transpose(1, 2).reshape(B, T, -1))


class PerHeadTensors(MNISTClassifier):
    """The three attentions, their per-head tensors planned ``"per_head"`` (T5's table on its dim of heads, 1)."""

    tp_plan = {"net.[234].[qkv]": "column", "net.[234].o": "row", "net.2.sinks": "per_head",
               "net.3.slopes": "per_head", "net.4.relative_bias.weight": {"style": "per_head", "dim": 1}}

    def __init__(self, **kw):
        super().__init__(**kw)
        nn = torch.nn
        self.net = nn.Sequential(_Tokens28(True), nn.Linear(28, 24), _PerHeadAttention("sinks"),
                                 _PerHeadAttention("alibi"), _PerHeadAttention("t5"), _MeanOverRows(True),
                                 nn.Linear(24, 10))

    def on_train_start(self) -> None:  # rank 0's entries (a pipeline's later stage holds a placeholder)
        if isinstance(self.net[2], _PerHeadAttention):
            self.log("sinks", float(self.net[2].sinks.numel()))


@pytest.mark.parametrize("name, heads", [("tp2", 3), ("tp3-uneven", 2), ("dp2xtp2-shard", 2), ("tp2xpp2", 3)])
def test_tensors_with_an_entry_per_head_planned_per_head_equal_one_process(name, heads):
    """Each rank keeps its heads' entries (5 heads: 3 + 2 at tp2, 2 + 2 + 1 at tp3; sharded, rank 0 holds 2 of its
    3 between steps), consolidated whole in checkpoints. Until 2026-12-07 there was no way to split them: whole,
    they met the rank's heads with every head's entries and torch failed on a shape."""
    strategy, devices, dp = TP_RUNS[name]
    metrics = _trained_and_validated_as_one_process(PerHeadTensors, strategy(), devices, dp, GLOBAL_BATCH * 2)
    assert metrics["sinks"] == heads
