"""``torch.save`` of what holds a rank's pieces of parameters, in a worker of a layout that cuts them: warned.

``pl_module.state_dict()`` there holds the rank's pieces; a callback saving it itself wrote rank 0's rows without
a word, and the file failed where it was loaded ("size mismatch for net.1.weight ... [128, 784] ... [256, 784]";
``strategies/piece_saves.py``). What the warning offers instead gives whole weights.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, LAYOUTS, fit_seeded

WARNED = "lightning_shm: torch.save of"


class _Saves(pl.Callback):
    """At the fit's end: rank 0 saves ``pl_module.state_dict()`` itself (``how="own"``) or a whole layer's
    (``"whole_layer"``), or every rank takes the
    strategy's whole state dict and rank 0 saves it (``"strategy"``), or every rank calls
    ``trainer.save_checkpoint`` (``"checkpoint"``). Records the warnings each rank saw during the fit (the
    workers' never reach pytest) on the module, which comes back to the main process."""

    def __init__(self, path, how):
        self.path, self.how = path, how

    def on_train_start(self, trainer, pl_module):  # the fit's own checkpoints are saved meanwhile
        self._recording = warnings.catch_warnings(record=True)
        self._seen = self._recording.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer, pl_module):
        if self.how == "own":
            if trainer.is_global_zero:
                torch.save(pl_module.state_dict(), self.path)
                torch.save({"model": pl_module.state_dict()}, self.path)  # a second save: warned once
        elif self.how == "whole_layer":  # a layer the layout keeps whole (tp's derived plan: all but net.1)
            if trainer.is_global_zero:
                torch.save(pl_module.net[4].state_dict(), self.path)
        elif self.how == "strategy":
            whole = trainer.strategy.lightning_module_state_dict()  # every rank: collective
            if trainer.is_global_zero:
                torch.save(whole, self.path)
        else:
            trainer.save_checkpoint(self.path)
        self._recording.__exit__(None, None, None)
        pl_module.warned = [str(w.message) for w in self._seen if WARNED in str(w.message)]


def _fit(layout, path, how, extra=(), **kw):
    make, devices, dp = LAYOUTS[layout]
    return fit_seeded(MNISTClassifier, make(), devices, GLOBAL_BATCH // dp, callbacks=[_Saves(path, how), *extra],
                      **kw)


@pytest.mark.parametrize("layout", ["fsdp", "fsdp-copy", "tp2"])
def test_saving_the_ranks_pieces_itself_warns_naming_them(tmp_path, layout):
    path = tmp_path / "own.pt"
    _, model = _fit(layout, path, "own")
    assert len(model.warned) == 1, model.warned  # rank 0's (the one that saved), once
    assert "'net.1.weight' [128, 784] of [256, 784]" in model.warned[0], model.warned
    assert "trainer.strategy.lightning_module_state_dict()" in model.warned[0]
    assert torch.load(path)["model"]["net.1.weight"].shape == (128, 784)  # what the warning says: rank 0's rows


@pytest.mark.parametrize("layout, how", [("fsdp", "strategy"), ("tp2", "strategy"), ("fsdp", "checkpoint"),
                                         ("ddp", "own"), ("tp2", "whole_layer")])
def test_whole_weights_are_saved_without_a_word(tmp_path, layout, how):
    """The ways the warning names, and a layout holding whole parameters; Lightning's own checkpoints too."""
    path = tmp_path / "whole.pt"
    _, model = _fit(layout, path, how, [ModelCheckpoint(dirpath=tmp_path / "ckpts")], enable_checkpointing=True)
    assert model.warned == [], model.warned
    saved = torch.load(path, weights_only=False)
    if how == "whole_layer":
        MNISTClassifier().net[4].load_state_dict(saved)
        return
    state = {"checkpoint": lambda: saved["state_dict"], "own": lambda: saved["model"]}.get(how, lambda: saved)()
    MNISTClassifier().load_state_dict(state)  # the whole model's shapes
    assert list((tmp_path / "ckpts").glob("*.ckpt")), "Lightning's own checkpoint was written during the fit"
