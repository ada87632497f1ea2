"""A whole state dict loaded by the module itself: before the cut it works under every layout; after it,
torch's refusal says why (``strategies/whole_loads.py``)."""

from __future__ import annotations

import pytest
import torch

from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, fit_seeded, flat_params, layouts

torch.manual_seed(5)
PRETRAINED = {k: v.double() for k, v in MNISTClassifier().state_dict().items()}  # weights a user brings


class LoadsInSetup(MNISTClassifier):
    def setup(self, stage):
        self.load_state_dict(PRETRAINED)


class LoadsAtFitStart(MNISTClassifier):
    def on_fit_start(self):
        self.load_state_dict(PRETRAINED)


RUNS = layouts("fsdp", "tp2", "pp2-1f1b")


@pytest.mark.parametrize("name", list(RUNS))
def test_whole_weights_loaded_in_setup_train_as_in_one_process(name):
    strategy, devices, dp = RUNS[name]
    _, ref = fit_seeded(LoadsInSetup, "auto", 1, GLOBAL_BATCH, ref=True)
    _, got = fit_seeded(LoadsInSetup, strategy(), devices, GLOBAL_BATCH // dp)
    torch.testing.assert_close(flat_params(got), flat_params(ref), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(RUNS))
def test_whole_weights_loaded_after_the_cut_are_refused_saying_where_they_load(name):
    """torch's own message ("size mismatch for net.1.weight", or a stage's "Unexpected key(s)") and a note."""
    strategy, devices, dp = RUNS[name]
    torch_says = "size mismatch for net.1.weight" if name != "pp2-1f1b" else "Unexpected key"
    with pytest.raises(RuntimeError, match=torch_says) as raised:
        fit_seeded(LoadsAtFitStart, strategy(), devices, GLOBAL_BATCH // dp)
    notes = getattr(raised.value, "__notes__", [])
    assert any(n.startswith("lightning_shm: this rank holds only its part of the model (") and
               "Load whole weights in setup() or configure_model()" in n for n in notes), notes
