"""Copies of the module's state that a callback or the module keeps, under layouts whose ranks hold pieces.

A hand-written EMA over ``pl_module.state_dict()`` trains right under every layout (each rank averages its
own pieces), but until 2026-12-03 its checkpoint state, and what the main process got back, were rank 0's
pieces: under shm_fsdp and tp2 tensors of the wrong shape, under a pipeline only stage 0's keys. Now such
copies are consolidated like the module's entries when written and cut to the rank's pieces when resumed.
"""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from lightning_shm import SHMPipeline
from lightning_shm.models import MNISTClassifier
from lightning_shm.parallel.placement import Placement, Split
from lightning_shm.parallel.state import ModelState
from lightning_shm.parallel.state_copies import localize_copies
from lightning_shm.strategies import model_parallel
from tests.helpers import GLOBAL_BATCH, LAYOUTS, SEED, flat_params, loader, mnist_like, reference_loader, trainer


class HandEMA(Callback):
    """An EMA of ``pl_module.state_dict()``, as users wrote them before Lightning had one."""

    def __init__(self) -> None:
        self.ema: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for k, v in pl_module.state_dict().items():
            self.ema[k] = v.detach().clone() if k not in self.ema else self.ema[k].mul_(0.5).add_(v.detach(), alpha=0.5)

    def state_dict(self) -> dict:
        return {"ema": self.ema}

    def load_state_dict(self, state_dict: dict) -> None:
        self.ema = state_dict["ema"]


class KeepsFirstWeights(MNISTClassifier):
    """Keeps its weights after the first step, in its own checkpoint entry (``on_save_checkpoint``)."""

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if not hasattr(self, "first"):
            self.first = {k: v.detach().clone() for k, v in self.state_dict().items() if k.endswith("weight")}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["first"] = self.first

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.first = checkpoint["first"]


class RankZeroEMA(HandEMA):
    """Averages on rank 0 only: the ranks do not agree it holds a copy, which stays rank 0's (with a warning)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 0:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def _fit(layout: str, epochs: int, dirpath: str, ckpt_path=None, ema_cls=HandEMA):
    pl.seed_everything(SEED)
    model, ema = KeepsFirstWeights(optimizer="adam", lr=0.01), ema_cls()
    ds = mnist_like(GLOBAL_BATCH * 2, seed=1)
    if layout == "one":
        dl, strategy, devices = reference_loader(ds, GLOBAL_BATCH, SEED), "auto", 1
    else:
        make, devices, dp = LAYOUTS[layout]
        dl, strategy = loader(ds, GLOBAL_BATCH // dp), make()
    t = trainer(strategy=strategy, devices=devices, max_epochs=epochs, precision="64-true", enable_checkpointing=True,
                callbacks=[ema, ModelCheckpoint(dirpath=dirpath, save_top_k=-1, filename="{epoch}")])
    t.fit(model, dl, ckpt_path=ckpt_path)
    return model, ema, torch.load(os.path.join(dirpath, f"epoch={epochs - 1}.ckpt"), weights_only=False)


def _ema_of(checkpoint: dict) -> dict:
    (state,) = [v["ema"] for k, v in checkpoint["callbacks"].items() if k.startswith("HandEMA")]
    return state


def _assert_same(ours: dict, one: dict) -> None:
    assert list(ours) == list(one)
    for k in one:
        assert ours[k].shape == one[k].shape, k
        assert torch.allclose(ours[k], one[k], rtol=0, atol=1e-10), (k, (ours[k] - one[k]).abs().max())


def test_copies_of_the_module_state_are_written_plain_and_resume_under_another_layout(tmp_path):
    one_model, one_ema, one_last = _fit("one", 2, str(tmp_path / "one"))
    one_first = torch.load(str(tmp_path / "one" / "epoch=0.ckpt"), weights_only=False)

    _, ema, ckpt = _fit("fsdp", 1, str(tmp_path / "fsdp"))  # row blocks
    _assert_same(_ema_of(ckpt), _ema_of(one_first))
    _assert_same(ckpt["first"], one_first["first"])
    _assert_same(ema.ema, _ema_of(one_first))  # what the main process got back

    model, ema, ckpt = _fit("pp2-1f1b", 2, str(tmp_path / "pp2"), ckpt_path=str(tmp_path / "fsdp" / "epoch=0.ckpt"))
    _assert_same(_ema_of(ckpt), _ema_of(one_last))
    _assert_same(ckpt["first"], one_last["first"])
    _assert_same(ema.ema, one_ema.ema)
    assert torch.allclose(flat_params(model), flat_params(one_model), rtol=0, atol=1e-10)


def test_a_copy_only_some_ranks_hold_is_kept_as_rank_0_holds_it_with_a_warning(tmp_path, monkeypatch):
    said = tmp_path / "warnings"  # what the workers warn (forked: pytest's record of warnings stays in them)
    monkeypatch.setattr(model_parallel, "rank_zero_warn", lambda msg: said.open("a").write(msg + "\n"))
    strategy = SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=2)
    pl.seed_everything(SEED)
    t = trainer(strategy=strategy, devices=2, max_epochs=1, precision="64-true", callbacks=[RankZeroEMA()])
    t.fit(KeepsFirstWeights(optimizer="adam", lr=0.01), loader(mnist_like(GLOBAL_BATCH, seed=1), GLOBAL_BATCH))
    assert re.search(r"\['RankZeroEMA\[2\]/ema'\] in the attributes .* on some ranks only", said.read_text())
    assert re.search(r"\['callbacks/RankZeroEMA/ema'\] in the checkpoint .* on some ranks only", said.read_text())
    ema = t.callbacks[-1].ema
    assert ema and all(k.startswith("net.1.") for k in ema)  # stage 0's layers


def test_resuming_cuts_full_copies_to_the_ranks_pieces_and_leaves_the_rest_and_the_originals():
    """A rank holding rows 0-1 of a 3-row Linear: only dicts of full-shaped entries are cut; per-entry
    scalars keyed like the state are not copies; the checkpoint's own containers are not modified."""
    rows = Placement((Split(SimpleNamespace(size=2, index=0), 0, (2, 1)),))
    state = ModelState(nn.Linear(4, 2), ["weight", "bias"], ["weight", "bias"], {"weight": rows, "bias": rows})
    full = {"weight": torch.arange(12.0).view(3, 4), "bias": torch.arange(3.0)}
    norms = {"weight": torch.tensor(1.0), "bias": torch.tensor(2.0)}
    checkpoint = {"state_dict": full, "callbacks": {"EMA": {"ema": full, "norms": norms}}, "first": [full]}
    out = localize_copies(checkpoint, state, skip=[("state_dict",)])
    assert out["state_dict"] is full and out["callbacks"]["EMA"]["norms"] is norms
    for ema in (out["callbacks"]["EMA"]["ema"], out["first"][0]):
        assert torch.equal(ema["weight"], full["weight"][:2]) and torch.equal(ema["bias"], full["bias"][:2])
    assert checkpoint["callbacks"]["EMA"]["ema"] is full and checkpoint["first"][0] is full
    assert full["weight"].shape == (3, 4)
