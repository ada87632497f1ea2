"""Parameters initialised again after the layout cut the model (``parallel/init.py``).

A hook running after setup -- ``on_fit_start`` here -- hands ``torch.nn.init`` what the rank holds: under
shm_fsdp a row block, under tensor parallelism a slice. Drawn for the piece alone, every rank's rows came
from the same numbers and the fans from the piece's shape (0.24-0.57 off one process, see the module).
"""

from __future__ import annotations

import inspect
import os
import sys
import types

import pytest
import torch
from torch import nn

from lightning_shm import SHMModelParallel, SHMPipeline, SHMTensorParallel
from lightning_shm.models import MNISTClassifier
from lightning_shm.parallel.init import INITIALISERS, initialised_as_whole
from lightning_shm.parallel.placement import Placement, Split
from lightning_shm.parallel.state import ModelState
from lightning_shm.strategies import model_parallel
from tests.helpers import GLOBAL_BATCH, fit_seeded, flat_params, layouts


class InitialisedAtFitStart(MNISTClassifier):
    """Every Linear reset (kaiming weights, a bias bound from the weight's fan-in), then the first one drawn
    again through ``.data`` (xavier: both fans) and the last one's bias filled -- after setup, seeded."""

    def on_fit_start(self) -> None:
        torch.manual_seed(123)
        linears = [m for m in self.net if isinstance(m, nn.Linear)]
        for m in linears:
            m.reset_parameters()
        nn.init.xavier_uniform_(linears[0].weight.data)
        nn.init.normal_(linears[-1].bias, std=0.5)


RUNS = {**layouts("fsdp", "tp2", "fsdp-copy"),  # tp2's derived plan: the first Linear's columns, gathered
        "tp2-column-row": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2,  # a weight cut by
                                                     plan={"net.1": "column", "net.4": "row"}), 2, 1),  # columns
        "dp2xtp2-shard": (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2, tensor_parallel_size=2,
                                                   data_parallel="shard"), 4, 2)}


@pytest.mark.parametrize("name", list(RUNS))
def test_parameters_initialised_after_the_cut_equal_one_process(name):
    """Each rank draws the whole parameter from its stream, as one process does, and keeps its piece. Before
    2026-12-06: 0.24 off one process after reset_parameters(), 0.57 after xavier_uniform_ (fsdp, tp2)."""
    strategy, devices, dp = RUNS[name]
    _, ref = fit_seeded(InitialisedAtFitStart, "auto", 1, GLOBAL_BATCH, ref=True)
    _, got = fit_seeded(InitialisedAtFitStart, strategy(), devices, GLOBAL_BATCH // dp)
    torch.testing.assert_close(flat_params(got), flat_params(ref), rtol=0, atol=1e-12)


def test_a_pipeline_stage_initialising_its_layers_again_warns_once_naming_the_line(tmp_path, monkeypatch):
    """A stage holds only its layers: the draws one process makes for the others' cannot be made there."""
    said = tmp_path / "warnings"

    def warn(msg, stacklevel):  # what warnings.warn would print, in a file (the forked workers inherit the patch)
        frame = sys._getframe(stacklevel)
        said.open("a").write(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {msg}\n")

    monkeypatch.setattr(model_parallel, "warnings", types.SimpleNamespace(warn=warn))
    fit_seeded(InitialisedAtFitStart, SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=2), 2,
               GLOBAL_BATCH)
    source, first = inspect.getsourcelines(InitialisedAtFitStart.on_fit_start)
    line = first + next(i for i, src in enumerate(source) if "reset_parameters" in src)
    lines = said.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"test_init.py:{line} torch.nn.init.kaiming_uniform_ on a "
                                                   "parameter of this pipeline stage after the model was cut"), lines


class _OneGroup:
    """A group of ``size`` whose member ``index`` is this process (``Split.cut`` reads these two only)."""

    def __init__(self, size: int, index: int) -> None:
        self.size, self.index = size, index


def test_inside_a_piece_is_drawn_as_the_whole_and_outside_torch_is_itself_again():
    """Member 1 of 2 holding rows 3:6 of a [6, 4] weight: xavier draws the whole [6, 4] (its bound from fans
    4 and 6), the piece keeps rows 3:6; a whole parameter and any other tensor are torch's own business."""
    layer = nn.Linear(4, 6)
    whole, piece = layer.weight.detach().clone(), nn.Parameter(layer.weight.detach()[3:].clone())
    layer.weight = piece
    split = Placement((Split(_OneGroup(2, 1), 0, (3, 3)),))  # type: ignore[arg-type]
    state = ModelState(layer, ["weight", "bias"], ["weight", "bias"], {"weight": split})
    originals = {n: getattr(nn.init, n) for n in INITIALISERS}
    with initialised_as_whole(state):
        torch.manual_seed(0)
        nn.init.xavier_uniform_(layer.weight)
        fans = nn.init._calculate_fan_in_and_fan_out(layer.weight.data)
        bias = layer.bias.detach().clone()
        torch.manual_seed(0)
        nn.init.uniform_(layer.bias)  # whole: drawn as is
    torch.manual_seed(0)
    nn.init.xavier_uniform_(whole)
    assert torch.equal(layer.weight.detach(), whole[3:]) and fans == (4, 6)
    torch.manual_seed(0)
    assert torch.equal(layer.bias.detach(), torch.empty_like(bias).uniform_()) and not torch.equal(layer.bias, bias)
    assert {n: getattr(nn.init, n) for n in INITIALISERS} == originals
    assert nn.init._calculate_fan_in_and_fan_out(layer.weight) == (4, 3)  # torch's, on the piece again
