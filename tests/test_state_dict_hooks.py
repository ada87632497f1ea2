"""A module whose state-dict hooks save a tensor under another key (``weight`` as ``w``: a checkpoint kept
loadable by older code), under every layout.

Placements follow the tensors' names, so the consolidated checkpoint missed the renamed key's placement: shm_fsdp
and dp2 x pp2 sharded saved a rank's row block as the whole tensor and failed at the end of the fit ("size
mismatch for net.1.weight: copying a param with shape torch.Size([32, 784]) from checkpoint"), and tensor
parallelism, which replaces the Linear by its own layer, dropped the hooks ("the checkpoint lacks
['net.1.weight']" resuming one process's checkpoint). Keys are now matched to tensors by identity
(``ModelState``), and a replaced layer keeps the model's state-dict hooks (``carry_over_module``).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, SEED, flat_params, layouts, loader, mnist_like, reference_loader, trainer


class SavedAsW(nn.Linear):
    """Saves its weight as ``w``, and loads it from ``w``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._register_state_dict_hook(SavedAsW._save)
        self._register_load_state_dict_pre_hook(SavedAsW._load)

    @staticmethod
    def _save(module, state_dict, prefix, local_metadata):
        state_dict[prefix + "w"] = state_dict.pop(prefix + "weight")

    @staticmethod
    def _load(state_dict, prefix, *args):
        if prefix + "w" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "w")


class RenamesAKey(MNISTClassifier):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = nn.Sequential(nn.Flatten(), SavedAsW(784, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                                 nn.Linear(32, 10))


def _fit(strategy, devices, batch, epochs, ref=False, ckpt_path=None, save=None):
    pl.seed_everything(SEED)
    model = RenamesAKey(optimizer="adam", lr=0.01)
    data = mnist_like(GLOBAL_BATCH * 2, seed=1)
    t = trainer(strategy=strategy, devices=devices, max_epochs=epochs, precision="64-true")
    t.fit(model, reference_loader(data, batch, SEED) if ref else loader(data, batch), ckpt_path=ckpt_path)
    if save is not None:
        t.save_checkpoint(save)
    return flat_params(model)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    path = tmp_path_factory.mktemp("one") / "epoch1.ckpt"
    _fit("auto", 1, GLOBAL_BATCH, 1, ref=True, save=path)
    return _fit("auto", 1, GLOBAL_BATCH, 2, ref=True), path


@pytest.mark.parametrize("name", ["ddp", "fsdp", "fsdp-copy", "tp2", "pp2-1f1b", "dp2xpp2-shard"])
def test_renamed_keys_save_whole_and_resume_as_one_process(one_process, tmp_path, name):
    straight, saved_by_one = one_process
    strategy, devices, dp = layouts(name)[name]
    _fit(strategy(), devices, GLOBAL_BATCH // dp, 1, save=tmp_path / "layout.ckpt")
    mine = torch.load(tmp_path / "layout.ckpt", weights_only=False)["state_dict"]
    theirs = torch.load(saved_by_one, weights_only=False)["state_dict"]
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in theirs.items()}
    assert mine["net.1.w"].shape == (64, 784)
    resumed = _fit(strategy(), devices, GLOBAL_BATCH // dp, 2, ckpt_path=saved_by_one)
    torch.testing.assert_close(resumed, straight, rtol=0, atol=1e-12)



def test_a_key_is_mapped_to_its_tensors_name_only_where_it_names_none_of_them():
    """Placements are keyed by a tensor's name -- for a tied one, possibly its first holder's only (as the
    data-parallel placements are). A key naming the tensor keeps its own placement; a key a hook renamed
    (``w``) takes the placement of the tensor it holds. Mapped to the tensor's last name, the renamed key took
    ``b.weight``'s placement (none) and stayed whole."""
    from types import SimpleNamespace

    from lightning_shm.parallel.placement import Placement, Split
    from lightning_shm.parallel.state import ModelState

    module = nn.Module()
    module.a, module.b = SavedAsW(4, 3, bias=False), nn.Linear(4, 3, bias=False)
    module.b.weight = module.a.weight  # tied: names a.weight and b.weight
    rows = Placement((Split(SimpleNamespace(size=2, index=1), 0, (2, 1)),))  # this rank holds row 2 of 3
    state = ModelState(module, list(module.state_dict()), ["a.weight"], {"a.weight": rows})
    full = torch.arange(12.0).view(3, 4)
    assert list(module.state_dict()) == ["a.w", "b.weight"]
    got = state.localize({"a.w": full, "b.weight": full}, ["a.w", "b.weight"])
    assert torch.equal(got["a.w"], full[2:])  # renamed: the tensor's (first) name's placement
    assert torch.equal(got["b.weight"], full)  # a name of the tensor: its own placement (whole)
