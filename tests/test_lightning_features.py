"""Lightning features that see the whole model, under every layout: SWA, ModelSummary, clipping by hand.

Under FSDP, tensor and pipeline parallelism a rank holds only pieces of the model; callbacks that
copy or count the model must still behave as in one process.
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import (
    BasePredictionWriter,
    EMAWeightAveraging,
    ModelCheckpoint,
    ModelSummary,
    StochasticWeightAveraging,
)

from lightning_shm import SHMDDPStrategy, SHMModelParallel, SHMPipeline, SHMTensorParallel
from lightning_shm.models import MNISTClassifier
from tests.helpers import (
    GLOBAL_BATCH,
    SEED,
    fit_seeded,
    flat_params,
    layouts,
    loader,
    mnist_like,
    reference_loader,
    train_mnist,
    trainer,
)
from tests.helpers import LAYOUTS as LAYOUTS_BY_NAME

LAYOUTS = [  # (strategy factory, devices, batch per data-parallel replica)
    (lambda: "shm_ddp_fork", 2, GLOBAL_BATCH // 2),
    (lambda: "shm_fsdp_fork", 2, GLOBAL_BATCH // 2),
    (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, GLOBAL_BATCH),
    (lambda: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4), 2, GLOBAL_BATCH),
    (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2, tensor_parallel_size=2,
                              data_parallel="shard"), 4, GLOBAL_BATCH // 2),
]
IDS = ["ddp", "fsdp", "tp", "pipeline", "fsdp2xtp2"]


def _swa_run(strategy, devices, batch, ckpt_dir, ref=False):
    pl.seed_everything(SEED)
    model = MNISTClassifier(optimizer="sgd", lr=0.1)
    ds = mnist_like(GLOBAL_BATCH * 2, seed=1)
    dl = reference_loader(ds, batch, SEED) if ref else loader(ds, batch)
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1, annealing_epochs=1)
    ckpt = ModelCheckpoint(dirpath=ckpt_dir, save_last=True)
    t = trainer(strategy=strategy, devices=devices, max_epochs=4, callbacks=[swa, ckpt], enable_checkpointing=True)
    t.fit(model, dl)
    return flat_params(model), torch.load(ckpt.last_model_path, weights_only=False)


@pytest.mark.parametrize("strategy, devices, batch", LAYOUTS, ids=IDS)
def test_stochastic_weight_averaging_equals_one_process(tmp_path, strategy, devices, batch):
    ref, ref_ckpt = _swa_run("auto", 1, GLOBAL_BATCH, tmp_path / "one", ref=True)
    got, ckpt = _swa_run(strategy(), devices, batch, tmp_path / "ours")
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)
    # the checkpoint holds the plain average (what one process saves), which loads into a plain model
    (mine,) = [v for k, v in ckpt["callbacks"].items() if "StochasticWeightAveraging" in k]
    (theirs,) = [v for k, v in ref_ckpt["callbacks"].items() if "StochasticWeightAveraging" in k]
    assert mine["n_averaged"] == theirs["n_averaged"] > 1
    assert list(mine["average_model_state"]) == list(theirs["average_model_state"])
    for k, v in theirs["average_model_state"].items():
        torch.testing.assert_close(mine["average_model_state"][k], v, rtol=0, atol=2e-5)
    MNISTClassifier().load_state_dict(mine["average_model_state"])


class _SummaryProbe(pl.Callback):
    """In the workers: what ModelSummary reports on rank 0 must be the whole model, not rank 0's piece."""

    def on_train_start(self, trainer, pl_module):
        if trainer.is_global_zero:
            (cb,) = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
            summary = cb._summary(trainer, pl_module)
            assert summary.total_parameters == 218_698, summary.total_parameters
            assert summary.trainable_parameters == 218_698
            assert [row for name, row in summary._get_summary_data() if name == "Params"][0][0] == "218 K"


@pytest.mark.parametrize("strategy, devices, batch", LAYOUTS[1:], ids=IDS[1:])
def test_model_summary_counts_the_whole_model(strategy, devices, batch):
    pl.seed_everything(SEED)
    t = trainer(strategy=strategy(), devices=devices, max_epochs=1, enable_model_summary=True,
                callbacks=[ModelSummary(max_depth=2), _SummaryProbe()], limit_train_batches=1)
    t.fit(MNISTClassifier(), loader(mnist_like(GLOBAL_BATCH * 2), batch))
    assert t.state.finished


class _ClippedByHand(MNISTClassifier):
    """Manual optimization: two optimizers, the first clipped with ``self.clip_gradients`` (Lightning's
    clipping, which the strategies make global), the second stepped again on every other batch."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.automatic_optimization = False

    def configure_optimizers(self):
        body = [p for n, p in self.named_parameters() if not n.startswith("net.7")]
        head = [p for n, p in self.named_parameters() if n.startswith("net.7")]
        return torch.optim.Adam(body, lr=0.01), torch.optim.SGD(head, lr=0.1)

    def training_step(self, batch, batch_idx):
        body, head = self.optimizers()
        body.zero_grad()
        head.zero_grad()
        self.manual_backward(torch.nn.functional.cross_entropy(self(batch[0]), batch[1]))
        self.clip_gradients(body, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        body.step()
        head.step()
        if batch_idx % 2:
            head.zero_grad()
            self.manual_backward(torch.nn.functional.cross_entropy(self(batch[0]), batch[1]))
            head.step()


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp2"])
def test_manual_optimization_clipping_with_lightning_equals_one_process(layout):
    """``self.clip_gradients`` clips by the norm over every rank's pieces (torch.nn.utils.clip_grad_norm_
    called by the user would see this rank's pieces only: see README, Limits)."""
    strategy, devices, dp = layouts(layout)[layout]
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, model_cls=_ClippedByHand)
    got = train_mnist(strategy(), devices, "adam", batch=GLOBAL_BATCH // dp, model_cls=_ClippedByHand)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)


def _ema_run(strategy, devices, batch, ckpt_dir, *, ref=False, epochs=2, ckpt_path=None):
    pl.seed_everything(SEED)
    model = MNISTClassifier(optimizer="adam", lr=0.01)
    ds = mnist_like(GLOBAL_BATCH * 3, seed=1)
    dl = reference_loader(ds, batch, SEED) if ref else loader(ds, batch)
    ckpt = ModelCheckpoint(dirpath=ckpt_dir, save_last=True)
    t = trainer(strategy=strategy, devices=devices, max_epochs=epochs, precision="64-true", enable_checkpointing=True,
                callbacks=[EMAWeightAveraging(decay=0.9), ckpt], limit_val_batches=1)
    t.fit(model, dl, torch.utils.data.DataLoader(ds, batch_size=batch), ckpt_path=ckpt_path)
    return flat_params(model), float(t.callback_metrics["val_loss"]), torch.load(ckpt.last_model_path,
                                                                               weights_only=False)


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp2", "pp2-1f1b", "dp2xpp2-shard"])
def test_ema_weight_averaging_equals_one_process(tmp_path, layout):
    """Lightning's EMAWeightAveraging copies the module before the strategy cuts it (it failed: "The size
    of tensor a (256) must match the size of tensor b (128)"); the average, the validation with it, and
    the checkpoint (average in ``state_dict``, the trained weights in ``current_model_state``) are one
    process's."""
    strategy, devices, dp = layouts(layout)[layout]
    ref, ref_val, ref_ckpt = _ema_run("auto", 1, GLOBAL_BATCH, tmp_path / "ref", ref=True)
    got, val, ckpt = _ema_run(strategy(), devices, GLOBAL_BATCH // dp, tmp_path / "got")
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)
    assert val == pytest.approx(ref_val, abs=1e-9)
    for key in ("state_dict", "current_model_state"):
        assert list(ckpt[key]) == list(ref_ckpt[key])
        for k, v in ref_ckpt[key].items():
            torch.testing.assert_close(ckpt[key][k], v, rtol=0, atol=1e-9)


def test_ema_weight_averaging_resumes_as_uninterrupted(tmp_path):
    straight, _, _ = _ema_run("shm_fsdp_fork", 2, GLOBAL_BATCH // 2, tmp_path / "a", epochs=3)
    _, _, _ = _ema_run("shm_fsdp_fork", 2, GLOBAL_BATCH // 2, tmp_path / "b", epochs=1)
    resumed, _, _ = _ema_run("shm_fsdp_fork", 2, GLOBAL_BATCH // 2, tmp_path / "c", epochs=3,
                             ckpt_path=tmp_path / "b" / "last.ckpt")
    torch.testing.assert_close(resumed, straight, rtol=0, atol=0)


def test_model_pruning_is_refused_where_ranks_hold_pieces(no_worker_starts):
    """It prunes whole tensors (a rank holds pieces: it failed with a size mismatch); before any worker starts."""
    from lightning.pytorch.callbacks import ModelPruning

    from lightning_shm import SHMFSDPStrategy

    with pytest.raises(ValueError, match=r"ModelPruning prunes the module's tensors as whole ones, and under this "
                                         r"layout \(dp=2 \(shard\) x tp=1 x pp=1\) a rank holds pieces"):
        trainer(strategy=SHMFSDPStrategy(start_method="fork"), devices=2, max_epochs=1,
                callbacks=[ModelPruning("l1_unstructured", amount=0.3)]).fit(MNISTClassifier(),
                                                                              loader(mnist_like(8), 4))


def test_weight_averaging_swaps_write_the_pieces_between_the_layouts_write_barriers():
    """FSDP's rule: pieces change only between two barriers (nobody still reads the old values; nobody reads
    before every rank has written). The average's swaps into the module (around validation, at the end)
    must run inside ``state.before_load`` / ``state.after_load`` -- each write seen between them."""
    from types import SimpleNamespace

    from lightning_shm.parallel.state import ModelState
    from lightning_shm.strategies.swa import adapt_swa

    model = MNISTClassifier()
    events = []
    first = next(model.parameters())
    state = ModelState(model, list(model.state_dict()), [n for n, _ in model.named_parameters()], {},
                       before_load=lambda: events.append(("before", float(first.sum()))),
                       after_load=lambda: events.append(("after", float(first.sum()))))
    cb = EMAWeightAveraging(decay=0.9)
    cb.setup(None, model, "fit")
    adapt_swa(SimpleNamespace(callbacks=[cb]), model, state)
    with torch.no_grad():
        next(cb._average_model.module.parameters()).zero_()  # an average that differs from the weights
    trained = float(first.sum())
    cb._swap_models(model)  # the average in, for validation
    assert events == [("before", trained), ("after", 0.0)]
    events.clear()
    cb._swap_models(model)  # the trained weights back
    cb._copy_average_to_current(model)  # the end of training
    assert events == [("before", 0.0), ("after", trained), ("before", trained), ("after", 0.0)]


class _Votes(pl.Callback):
    """Lightning's boolean decisions as its callbacks take them: all / any of the ranks' votes."""

    def on_train_start(self, trainer, pl_module):
        vote = trainer.global_rank == 0
        decide = trainer.strategy.reduce_boolean_decision
        pl_module.log_dict({"all_of_one": float(decide(vote)), "any_of_one": float(decide(vote, all=False)),
                            "all_of_all": float(decide(True)), "any_of_none": float(decide(False, all=False))})


@pytest.mark.parametrize("name", ["tp2", "pp2", "dp2xtp2"])
def test_model_checkpoint_top_k_follows_the_monitored_score_as_in_one_process(tmp_path, name):
    """ModelCheckpoint saves a better score only when every rank agrees (``reduce_boolean_decision``); Lightning
    counts the votes with ``reduce``, which sums over the data-parallel group -- under tp / pp fewer ranks than
    ``world_size``, so no later score was ever "better": the best stayed epoch 0's checkpoint (measured under pp2:
    best epoch 0 at val_loss 1.70 while epoch 2 had 0.73)."""
    layouts = {"tp2": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, 1),
               "pp2": (lambda: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4), 2, 1),
               "dp2xtp2": (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2,
                                                    tensor_parallel_size=2), 4, 2)}

    def fit(strategy, devices, batch, ref):
        ckpt = ModelCheckpoint(dirpath=tmp_path / f"{name}-{ref}", monitor="val_loss", save_top_k=1,
                               filename="{epoch}")
        t, _ = fit_seeded(lambda: MNISTClassifier(optimizer="adam", lr=0.01), strategy, devices, batch, ref=ref,
                          validate=True, max_epochs=3, callbacks=[ckpt] + ([] if ref else [_Votes()]),
                          enable_checkpointing=True)
        return t

    one = fit("auto", 1, GLOBAL_BATCH, True)
    assert one.checkpoint_callback.best_model_path.endswith("epoch=2.ckpt")  # the score improves every epoch
    strategy, devices, dp = layouts[name]
    t = fit(strategy(), devices, GLOBAL_BATCH // dp, False)
    assert t.checkpoint_callback.best_model_path.endswith("epoch=2.ckpt")
    best, one_best = t.checkpoint_callback.best_model_score, one.checkpoint_callback.best_model_score
    assert float(best) == pytest.approx(float(one_best), abs=1e-9)
    assert {k: float(t.callback_metrics[k]) for k in ("all_of_one", "any_of_one", "all_of_all", "any_of_none")} == \
        {"all_of_one": 0.0, "any_of_one": 1.0, "all_of_all": 1.0, "any_of_none": 0.0}


@pytest.mark.parametrize("layout", ["fsdp", "tp2", "pp2-1f1b"])
def test_weights_only_checkpoints_hold_the_plain_module_as_in_one_process(tmp_path, layout):
    """``save_weights_only`` checkpoints -- ModelCheckpoint's, ``trainer.save_checkpoint(weights_only=True)`` in a
    callback and in the main process after the fit: the keys one process writes (no optimizer or callback states)
    and the whole module's weights, consolidated from the ranks' pieces."""
    def saved(root, strategy, devices, batch, ref=False):
        class SaveInside(pl.Callback):
            def on_train_epoch_end(self, trainer, pl_module):
                trainer.save_checkpoint(root / f"inside{trainer.current_epoch}.ckpt", weights_only=True)

        t, _ = fit_seeded(lambda: MNISTClassifier(optimizer="adam", lr=0.01), strategy, devices, batch, ref=ref,
                          max_epochs=2, enable_checkpointing=True, callbacks=[
                              ModelCheckpoint(dirpath=root, save_weights_only=True, save_top_k=-1), SaveInside()])
        t.save_checkpoint(root / "main.ckpt", weights_only=True)
        return {p.name: torch.load(p, weights_only=False) for p in sorted(root.iterdir())}

    one = saved(tmp_path / "one", "auto", 1, GLOBAL_BATCH, ref=True)
    assert sorted(one) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "inside0.ckpt", "inside1.ckpt", "main.ckpt"]
    assert "optimizer_states" not in one["main.ckpt"] and "callbacks" not in one["main.ckpt"]
    strategy, devices, dp = LAYOUTS_BY_NAME[layout]
    got = saved(tmp_path / "got", strategy(), devices, GLOBAL_BATCH // dp)
    assert sorted(got) == sorted(one)
    for name, want in one.items():
        assert set(got[name]) == set(want), name
        for key, tensor in want["state_dict"].items():
            torch.testing.assert_close(got[name]["state_dict"][key], tensor, rtol=0, atol=1e-12)


class _RowWriter(BasePredictionWriter):
    """Writes each rank's predictions as Lightning's docs show: one file per rank and batch, one per rank at the end."""

    def __init__(self, out_dir):
        super().__init__("batch_and_epoch")
        self.out_dir = out_dir

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        torch.save((prediction, batch_indices), self.out_dir / f"batch_{trainer.global_rank}_{batch_idx}.pt")

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        rows = (torch.cat(predictions), sum(batch_indices[0], []))
        torch.save(rows, self.out_dir / f"epoch_{trainer.global_rank}.pt")


def _written_rows(out_dir, prefix):
    rows = {}
    for path in sorted(out_dir.glob(f"{prefix}_*.pt")):
        outputs, indices = torch.load(path)
        for row, i in zip(outputs, indices):
            rows.setdefault(i, []).append(row)
    return rows


@pytest.mark.parametrize("layout", ["ddp", "tp2", "pp2-1f1b", "dp2xpp2-shard"])
def test_prediction_writer_files_hold_every_sample_once(tmp_path, layout):
    """The ranks of one model replica predict the same samples: only the replica's first one writes them, so the
    union of every rank's files is one process's predictions (under tp2 it held each sample twice)."""
    (strategy, devices, _), ds = LAYOUTS_BY_NAME[layout], mnist_like(30, seed=3)
    pl.seed_everything(SEED)
    model = MNISTClassifier()
    single = torch.cat(trainer(devices=1).predict(model, torch.utils.data.DataLoader(ds, batch_size=4)))
    trainer(strategy=strategy(), devices=devices, callbacks=[_RowWriter(tmp_path)]).predict(
        model, torch.utils.data.DataLoader(ds, batch_size=4), return_predictions=False)
    for prefix in ("batch", "epoch"):
        rows = _written_rows(tmp_path, prefix)
        assert sorted(rows) == list(range(30)) and all(len(r) == 1 for r in rows.values()), prefix
        assert torch.equal(torch.stack([rows[i][0] for i in range(30)]), single), prefix


class _SlowPrepare(pl.LightningDataModule):
    """``prepare_data`` (rank 0 alone, as Lightning calls it) writes the dataset after ``seconds`` -- a download, a
    tokenisation; ``setup`` reads it on every rank."""

    def __init__(self, path, seconds, fail=False):
        super().__init__()
        self.path, self.seconds, self.fail = path, seconds, fail

    def prepare_data(self):
        time.sleep(self.seconds)
        if self.fail:
            raise OSError("the download failed")
        torch.save(mnist_like(GLOBAL_BATCH, seed=1), self.path)

    def setup(self, stage):
        self.ds = torch.load(self.path, weights_only=False)

    def train_dataloader(self):
        return loader(self.ds, GLOBAL_BATCH // 2)


@pytest.mark.parametrize("strategy", [lambda t: SHMDDPStrategy(start_method="fork", timeout=t),
                                      lambda t: SHMTensorParallel(start_method="fork", tensor_parallel_size=2,
                                                                  timeout=t)], ids=["ddp", "tp"])
def test_prepare_data_may_take_longer_than_the_strategys_timeout(tmp_path, strategy):
    """Lightning waits for prepare_data without a deadline (an infinite barrier over torch.distributed, which the
    workers do not start); the other ranks' next barrier timed out after the strategy's ``timeout`` (then 300 s by
    default): a download of more than five minutes failed the fit."""
    t = trainer(strategy=strategy(3), devices=2, max_epochs=1)
    t.fit(MNISTClassifier(), datamodule=_SlowPrepare(tmp_path / "ds.pt", 6))
    assert t.global_step == (2 if isinstance(t.strategy, SHMTensorParallel) else 1)  # 24 samples, batches of 12


def test_a_failing_prepare_data_stops_the_ranks_waiting_for_it(tmp_path):
    start = time.monotonic()
    with pytest.raises(OSError, match="the download failed"):
        trainer(strategy=SHMDDPStrategy(start_method="fork"), devices=2, max_epochs=1).fit(
            MNISTClassifier(), datamodule=_SlowPrepare(tmp_path / "ds.pt", 0.5, fail=True))
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("name,replicas", [("ddp", 2), ("tp2", 1), ("dp2xpp2-shard", 2)])
def test_throughput_monitor_counts_samples_once_per_replica(tmp_path, name, replicas):
    """ThroughputMonitor's run-wide rates are a rank's times its meters' world size: the number of replicas, as
    the ranks of one tp / pp replica train the same samples (it was the number of ranks: tp2 counted every
    sample twice, dp2 x pp2 too). One replica: no run-wide rates, as in one process."""
    import csv

    from lightning.pytorch.callbacks import ThroughputMonitor
    from lightning.pytorch.loggers import CSVLogger

    make, devices, dp = LAYOUTS_BY_NAME[name]
    monitor = ThroughputMonitor(batch_size_fn=lambda b: b[0].shape[0], window_size=3)
    t = trainer(strategy=make(), devices=devices, max_steps=6, log_every_n_steps=1, callbacks=[monitor],
                logger=CSVLogger(tmp_path, name="", version=""))
    t.fit(MNISTClassifier(), loader(mnist_like(GLOBAL_BATCH * 6), GLOBAL_BATCH // dp))
    rows = [r for r in csv.DictReader(open(tmp_path / "metrics.csv")) if r.get("train/device/samples_per_sec")]
    assert len(rows) >= 3, rows
    for r in rows:
        assert float(r["train/samples"]) == float(r["train/batches"]) * GLOBAL_BATCH // dp  # the replica's batch
        run_wide = r.get("train/samples_per_sec") or None
        if replicas == 1:
            assert run_wide is None, r
        else:
            assert float(run_wide) == pytest.approx(float(r["train/device/samples_per_sec"]) * replicas, rel=1e-6)
