"""Steps that fetch their own batches (Lightning's ``training_step(self, dataloader_iter)`` flavor): Lightning moves
no batch, so the strategy hands each one out as ``batch_to_device`` would, and a pipeline calls the step once per
microbatch with an iterator holding that microbatch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lightning_shm import SHMFSDPStrategy, SHMModelParallel, SHMPipeline, SHMTensorParallel
from lightning_shm.models import MNISTClassifier
from lightning_shm.strategies.loader_iter import OneMicrobatch, PreparedBatches
from tests.fsdp.test_writes import ShrinksARowBlockEachBatch
from tests.helpers import GLOBAL_BATCH, fit_seeded, flat_params, layouts, logged_floats, train_mnist
from tests.test_outside_reads import FirstLayerReadInTheStep
from tests.tp.test_strategy import RankAugmented


def _fetch(module: torch.nn.Module, dataloader_iter) -> tuple[torch.Tensor, torch.Tensor]:
    (x, y), _, _ = next(dataloader_iter)
    return x.to(module.dtype), y  # in this flavor Lightning converts nothing either


class FetchesItsBatches(MNISTClassifier):
    """The MNIST module with every step fetching its batch; its losses logged with ``sync_dist`` (and the batch
    size, which Lightning cannot see in this flavor)."""

    def __init__(self, **kw):
        super().__init__(**{"optimizer": "adam", "lr": 0.01, **kw})

    def training_step(self, dataloader_iter):
        x, y = _fetch(self, dataloader_iter)
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(x))
        return loss

    def validation_step(self, dataloader_iter):
        x, y = _fetch(self, dataloader_iter)
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True, batch_size=len(x))

    def predict_step(self, dataloader_iter):
        return self(_fetch(self, dataloader_iter)[0])


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "pp2-1f1b", "dp2xpp2-shard"])
def test_a_step_fetching_its_batches_trains_and_validates_as_one_process(layout):
    """Before, every layout failed: validation (and a pipeline's training) indexed the batch_idx such a step is not
    given (an IndexError)."""
    make, devices, dp = layouts(layout)[layout]
    t_ref, ref = fit_seeded(FetchesItsBatches, "auto", 1, GLOBAL_BATCH, ref=True, validate=True)
    t, got = fit_seeded(FetchesItsBatches, make(), devices, GLOBAL_BATCH // dp, validate=True)
    torch.testing.assert_close(flat_params(got), flat_params(ref), rtol=0, atol=1e-9)
    for key in ("train_loss", "val_loss"):
        assert logged_floats(t)[key] == pytest.approx(logged_floats(t_ref)[key], rel=1e-9), key


def test_a_pipeline_predicts_with_a_step_fetching_its_batches():
    """The last stage calls the step once over the whole batch, its iterator holding that batch."""
    _, ref = fit_seeded(FetchesItsBatches, "auto", 1, GLOBAL_BATCH, ref=True)
    x = torch.randn(10, 1, 28, 28, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(10, dtype=torch.long)),
                                         batch_size=5)
    t, got = fit_seeded(FetchesItsBatches, SHMPipeline(start_method="fork", pipeline_parallel_size=2,
                                                       microbatches=2), 2, GLOBAL_BATCH)
    predicted = torch.cat(t.predict(got, loader))
    torch.testing.assert_close(predicted, ref(x), rtol=0, atol=1e-9)


class FetchesTwoBatches(FetchesItsBatches):
    def training_step(self, dataloader_iter):
        _fetch(self, dataloader_iter)
        return super().training_step(dataloader_iter)


def test_a_pipeline_refuses_a_step_fetching_two_batches_per_call():
    """A pipeline cuts one fetched batch into microbatches; a StopIteration would have ended the epoch silently."""
    with pytest.raises(RuntimeError, match=r"training_step\(dataloader_iter\) asked for a second batch in one call.*"
                                           r"cuts it into 2 microbatch\(es\)"):
        fit_seeded(FetchesTwoBatches, SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=2), 2,
                   GLOBAL_BATCH)


def test_tp_members_fetching_their_batches_compute_on_the_first_members():
    """Before, ``tp_batch`` did nothing to such a step: "broadcast" let the members compute the halves of each
    layer on their own augmentations (0.046 off one process), "check" passed."""
    ref = train_mnist("auto", 1, "sgd", batch=GLOBAL_BATCH, ref=True, data=RankAugmented,  # rank 0's augmentation
                      model_cls=FetchesItsBatches)
    got = train_mnist(SHMTensorParallel(start_method="fork", tensor_parallel_size=2, tp_batch="broadcast"), 2, "sgd",
                      batch=GLOBAL_BATCH, data=RankAugmented, model_cls=FetchesItsBatches)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"model replica \(tp members, pipeline stages\) received different batches"):
        train_mnist(SHMTensorParallel(start_method="fork", tensor_parallel_size=2, tp_batch="check"), 2, "sgd",
                    batch=GLOBAL_BATCH, data=RankAugmented, model_cls=FetchesItsBatches)


class ShrinksAndFetches(ShrinksARowBlockEachBatch):
    def training_step(self, dataloader_iter):
        self._shrink()  # at the top of the step, before it fetches
        return FetchesItsBatches.training_step(self, dataloader_iter)


def test_fsdp_fences_a_write_at_the_top_of_a_step_fetching_its_batches():
    """No batch_to_device, so no barrier before the batch: with gradient accumulation (no optimizer step, whose
    first barrier would fence the step's top), rank 0 scaled its rows for the next batch while the late rank 1
    still read them in its end-of-batch forward (the logged sum -20.89 against one process's -20.36). The barrier
    now comes at the step's start (a write in ``on_train_batch_start`` of such a step is still not fenced)."""
    # 4 batches: the stop vote before a step (a collective every stop_check_every=4 batches, by the batch_idx
    # Lightning's hooks get -- in this flavor the previous batch's: 0, 0, 1, 2) fences the first two
    kw = dict(samples=GLOBAL_BATCH * 4, accumulate_grad_batches=2)
    t_ref, ref = fit_seeded(ShrinksAndFetches, "auto", 1, GLOBAL_BATCH, ref=True, **kw)
    t, got = fit_seeded(lambda: ShrinksAndFetches(slow_rank=1), SHMFSDPStrategy(start_method="fork"), 2,
                        GLOBAL_BATCH // 2, **kw)
    torch.testing.assert_close(flat_params(got), flat_params(ref), rtol=0, atol=1e-9)
    assert logged_floats(t)["after_batch"] == pytest.approx(logged_floats(t_ref)["after_batch"], rel=1e-9)


class FetchesAndReadsAPiece(MNISTClassifier):
    def training_step(self, dataloader_iter):
        (x, y), batch_idx, _ = next(dataloader_iter)
        return FirstLayerReadInTheStep.training_step(self, (x.to(self.dtype), y), batch_idx)


def test_a_failing_step_fetching_its_batches_runs_again_on_the_same_batch_to_say_what_it_read():
    """The failure's second run (tests/test_outside_reads.py) gets the batches the first fetched, not the next ones
    (here there are none: it would have stopped at its fetch, naming nothing)."""
    with pytest.raises(ValueError, match=r"(?s)training_step computed with \['net.1.weight', 'net.1.bias'\]"):
        fit_seeded(FetchesAndReadsAPiece, SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2,
                   GLOBAL_BATCH, samples=GLOBAL_BATCH)


class _LightningLike:
    """What Lightning's ``dataloader_iter`` yields and offers: ``(batch, batch_idx, dataloader_idx)``, ``done``."""

    def __init__(self, batches):
        self.batches, self.fetched = list(batches), 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.done:
            raise StopIteration
        self.fetched += 1
        return self.batches[self.fetched - 1], self.fetched - 1, 0

    @property
    def done(self):
        return self.fetched == len(self.batches)


def test_the_iterators_a_step_gets_offer_what_lightnings_does():
    """A step may read ``dataloader_iter.done`` (stop fetching at the epoch's end) or ``fetched``."""
    it = PreparedBatches(_LightningLike(["a", "b"]), str.upper)
    assert next(it) == ("A", 0, 0) and (it.done, it.fetched) == (False, 1)
    assert next(it) == ("B", 1, 0) and (it.done, it.fetched) == (True, 2)
    assert list(it.replay()) == [("A", 0, 0), ("B", 1, 0)]  # the same prepared batches again
    assert copy.copy(it).fetched == 2  # copy builds the object before its attributes: no delegation to a missing inner
    one = OneMicrobatch("mb", 3, 0, "validation_step", 2)
    assert not one.done and next(one) == ("mb", 3, 0) and one.done


def test_which_flavor_a_step_is_follows_the_step_in_use():
    """The strategy reads a step's signature once per step function: a strategy fitting another module, or a
    module whose step was rebound, is not given the flavor read before (a cache keyed by the module's id was)."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    class GivenItsBatch(BoringModel):
        def training_step(self, batch):
            return super().training_step(batch, 0)

    class Fetching(BoringModel):
        def training_step(self, dataloader_iter):
            return super().training_step(next(dataloader_iter)[0], 0)

    strategy, batches = SHMModelParallel(), iter([(torch.ones(2), 0, 0)])
    for module, fetches in ((GivenItsBatch(), False), (Fetching(), True), (GivenItsBatch(), False)):
        strategy._lightning_module = module
        assert isinstance(strategy._fetching("training_step", (batches,)), PreparedBatches) is fetches
    module.training_step = Fetching.training_step.__get__(module)  # the same module, its step rebound
    assert isinstance(strategy._fetching("training_step", (batches,)), PreparedBatches)
