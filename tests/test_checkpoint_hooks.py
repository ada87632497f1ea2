"""A module's ``on_save_checkpoint`` shapes the files the user keeps, not the trained module the main process
takes over at the end of a fit (:func:`lightning_shm.strategies.main_state.end_checkpoint`)."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, LAYOUTS, fit_seeded, flat_params


class SavesTrainableOnly(MNISTClassifier):
    """Fine-tuning with a frozen first layer: checkpoints keep only what trains (``strict_loading = False``)."""

    def __init__(self):
        super().__init__(optimizer="adam", lr=0.01)
        self.net[1].requires_grad_(False)
        self.strict_loading = False

    def on_save_checkpoint(self, checkpoint):
        for key in [k for k in checkpoint["state_dict"] if k.startswith("net.1.")]:
            del checkpoint["state_dict"][key]


class SavesHalf(MNISTClassifier):
    """Writes its checkpoints in half precision."""

    def __init__(self):
        super().__init__(optimizer="adam", lr=0.01)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["state_dict"] = {k: v.half() for k, v in checkpoint["state_dict"].items()}


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp2", "pp2-1f1b"])
@pytest.mark.parametrize("model_cls", [SavesTrainableOnly, SavesHalf])
def test_the_main_process_takes_the_trained_module_whatever_on_save_checkpoint_writes(tmp_path, layout, model_cls):
    """Before: the fit failed at its end, "Missing key(s) in state_dict: "net.1.weight", "net.1.bias"" (the
    trainable-only checkpoint, every layout; Lightning's ddp_fork trained it), and the main process's weights were
    the half-precision ones (4.9e-04 off one process). The files the user asked for are still written the hook's
    way, and one resumes as the uninterrupted fit."""
    strategy, devices, dp = LAYOUTS[layout]
    _, ref = fit_seeded(model_cls, "auto", 1, GLOBAL_BATCH, ref=True, max_epochs=2)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}")
    _, got = fit_seeded(model_cls, strategy(), devices, GLOBAL_BATCH // dp, max_epochs=2, callbacks=[ckpt],
                        enable_checkpointing=True)
    torch.testing.assert_close(flat_params(got), flat_params(ref), rtol=0, atol=1e-12)
    saved = torch.load(os.path.join(tmp_path, "epoch=1.ckpt"), weights_only=False)["state_dict"]
    if model_cls is SavesHalf:
        assert {v.dtype for v in saved.values()} == {torch.float16}
    else:
        assert "net.1.weight" not in saved and "net.4.weight" in saved
        _, resumed = fit_seeded(model_cls, strategy(), devices, GLOBAL_BATCH // dp, max_epochs=2,
                                ckpt_path=os.path.join(tmp_path, "epoch=0.ckpt"))
        torch.testing.assert_close(flat_params(resumed), flat_params(ref), rtol=0, atol=1e-12)

