"""Parameters shared between layers -- one layer applied twice (ALBERT-style) and weights tied between
two layers (GPT-2's embedding / head) -- under every strategy.

Every parallelism gives layers to owners (pipeline stages, FSDP units, tensor-parallel pieces); a
parameter held by two layers must stay with one owner, or each copy trains on its own layers' gradient
only -- unless the copies' gradients are summed, as pipeline stages do for weights tied between layers
they hold apart (GPT-2's embedding and head at the Sequential's two ends). What must hold: where the
layout allows it the run equals one process; where it cannot (a module placed twice on two stages, a
split tied layer) the run is refused before any worker starts, naming the parameter.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from torch import nn

import lightning_shm
from lightning_shm import SHMDDPStrategy, SHMFSDPStrategy, SHMModelParallel, SHMPipeline, SHMTensorParallel
from lightning_shm.models import MNISTClassifier
from lightning_shm.parallel.compose import ParallelConfig, _cut_rules, parallelize
from lightning_shm.parallel.ddp import GradReducer, broadcast_module_state
from lightning_shm.parallel.fsdp import UnitPolicy, find_units
from lightning_shm.parallel.pipeline.row_cut import plan_row_cuts
from lightning_shm.parallel.pipeline.stage import PipelineStage
from lightning_shm.parallel.sequential import layers_of, shared_spans
from lightning_shm.parallel.tp import derive_plan, plan_for
from lightning_shm.runtime import Topology, launch
from tests.helpers import (
    GLOBAL_BATCH,
    MeanOverTokens,
    fit_seeded,
    flat_params,
    layouts,
    loader,
    mnist_like,
    reference_loader,
    train_mnist,
    trainer,
)


class AppliedTwice(MNISTClassifier):
    """``net.3`` and ``net.7`` are one Linear: the layer runs twice per forward, another Linear between."""

    def __init__(self, **kw):
        super().__init__(**kw)
        shared = nn.Linear(32, 32)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), shared, nn.ReLU(), nn.Linear(32, 32),
                                 nn.ReLU(), shared, nn.ReLU(), nn.Linear(32, 10))


class Tied(MNISTClassifier):
    """``net.3`` and ``net.7`` are two Linear layers with one weight (each its own bias)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        a, b = nn.Linear(32, 32), nn.Linear(32, 32)
        b.weight = a.weight
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), a, nn.ReLU(), nn.Linear(32, 32),
                                 nn.ReLU(), b, nn.ReLU(), nn.Linear(32, 10))


class TiedToEmbedding(MNISTClassifier):
    """GPT-2's tie: an input embedding outside the Sequential, applied in ``forward``, and the Sequential's
    output layer with the embedding's weight. Until 2026-12-04 shm_fsdp refused it (no unit runs around both
    holders) suggesting a policy that cannot select the LightningModule, the pipelines failed with a
    CollectiveMismatchError (the last stage counted the weight as its own, the first as an outside one), and
    the derived tensor-parallel plan split the output layer and refused itself."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.embed = nn.Embedding(10, 32)
        # a derived tp plan pairs net.0 / net.2 and would pair net.6 / net.8 (the Flatten parts the middle one)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 16),
                                 nn.Flatten(), nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 10, bias=False))
        self.net[8].weight = self.embed.weight

    def forward(self, x):
        tokens = (x.flatten(1)[:, :16].sigmoid() * 10).long().clamp(max=9)  # [B, 16] ids from the pixels
        return self.net(self.embed(tokens).mean(1))


class EmbeddingAndHeadTied(MNISTClassifier):
    """GPT-2's tie inside the Sequential: its first layer embeds token ids, its last layer's weight is that
    embedding's -- no pipeline cut keeps the two on one stage. Until 2026-12-04 every pipeline refused it ("9
    layers cannot be cut into 2 chunks that each hold a parameter without starting one at [1, ..., 8]"); now each
    holding stage keeps a copy and the stages sum its gradient, as Megatron's embedding group does."""

    def __init__(self, **kw):
        super().__init__(**kw)
        embed, head = nn.Embedding(10, 32), nn.Linear(32, 10, bias=False)
        head.weight = embed.weight
        self.net = nn.Sequential(embed, nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.Tanh(), MeanOverTokens(),
                                 nn.Linear(32, 32), nn.Tanh(), head)

    def forward(self, x):
        return self.net((x.flatten(1)[:, :16].sigmoid() * 10).long().clamp(max=9))  # [B, 16] ids from the pixels


class KeptUnderSecondNames(MNISTClassifier):
    """Layers of the Sequential the module also keeps under other names -- ``self.features = self.net[:4]``
    (a slice: a new Sequential of the same layers) and ``self.classifier = self.net[-1]`` -- called in the step
    for an auxiliary loss, with a learned input scale registered between them. Until 2026-12-04 pipelines failed
    with a CollectiveMismatchError: the stage holding a layer counted it as its own, the others as an outside
    parameter (summed over the stages in a positional all-reduce, which also needs one order on every stage)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.features = self.net[:4]
        self.scale = nn.Parameter(torch.ones(784))
        self.classifier = self.net[-1]
        self.probe = nn.Parameter(torch.randn(4, self.net[-1].in_features) * 0.1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x.flatten(1) * self.scale
        loss = nn.functional.cross_entropy(self.net(x), y)
        return loss + 0.05 * self.features(x * 0.5).pow(2).mean() + 0.1 * self.classifier(self.probe).pow(2).mean()


MODELS = {"applied-twice": AppliedTwice, "tied": Tied, "tied-to-embedding": TiedToEmbedding,
          "second-names": KeptUnderSecondNames, "tied-ends": EmbeddingAndHeadTied}
RUNS = layouts("ddp", "fsdp", "tp2", "pp2-1f1b", "pp2-zero-bubble", "dp2xpp2-shard")


@pytest.fixture(scope="module")
def references():
    return {name: train_mnist("auto", 1, "sgd", batch=GLOBAL_BATCH, ref=True, model_cls=cls)
            for name, cls in MODELS.items()}


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("model", list(MODELS))
def test_shared_parameters_train_as_in_one_process(references, model, run):
    strategy, devices, dp = RUNS[run]
    got = train_mnist(strategy(), devices, "sgd", batch=GLOBAL_BATCH // dp, model_cls=MODELS[model])
    torch.testing.assert_close(got, references[model], rtol=0, atol=1e-5)


def test_tied_linear_weight_gradients_computed_into_the_buckets_add_up(references, monkeypatch):
    """With every Linear's weight gradient written into the DDP buckets by the layer itself, the two
    layers holding one weight must add their products, not overwrite each other's."""
    monkeypatch.setattr(GradReducer, "direct_min_numel", 0)
    got = train_mnist(SHMDDPStrategy(start_method="fork"), 2, "sgd", batch=GLOBAL_BATCH // 2, model_cls=Tied)
    torch.testing.assert_close(got, references["tied"], rtol=0, atol=1e-5)


def _fit_tied(strategy, devices, epochs, batch, ckpt_dir=None, ckpt_path=None, model_cls=Tied):
    pl.seed_everything(1)
    model = model_cls(optimizer="adam", lr=1e-3)
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir)] if ckpt_dir else []
    t = trainer(strategy=strategy, devices=devices, max_epochs=epochs, enable_checkpointing=bool(callbacks),
                callbacks=callbacks, precision="64-true")
    t.fit(model, loader(mnist_like(48, seed=1), batch), ckpt_path=ckpt_path)
    return flat_params(model), (callbacks[0].best_model_path if callbacks else None)


TIED_NAMES = {Tied: ("net.3", "net.7"), TiedToEmbedding: ("embed", "net.8"),
              KeptUnderSecondNames: ("features.1", "net.1"), EmbeddingAndHeadTied: ("net.0", "net.8")}


@pytest.mark.parametrize("model_cls", list(TIED_NAMES))
@pytest.mark.parametrize("run", ["fsdp", "pp2-1f1b", "dp2xpp2-shard"])
def test_tied_checkpoint_is_plain_and_resumes(tmp_path, run, model_cls):
    """One entry per name of the tied weight (as one process saves it), one optimizer state for it, and a
    resumed run equal to an uninterrupted one."""
    strategy, devices, dp = RUNS[run]
    whole, _ = _fit_tied(strategy(), devices, 2, 24 // dp, model_cls=model_cls)
    _, path = _fit_tied(strategy(), devices, 1, 24 // dp, ckpt_dir=tmp_path, model_cls=model_cls)
    resumed, _ = _fit_tied(strategy(), devices, 2, 24 // dp, ckpt_path=path, model_cls=model_cls)
    torch.testing.assert_close(resumed, whole, rtol=0, atol=1e-12)
    ckpt = torch.load(path, weights_only=False)
    plain = model_cls(optimizer="adam", lr=1e-3)
    assert list(ckpt["state_dict"]) == list(plain.state_dict())
    a, b = TIED_NAMES[model_cls]
    assert torch.equal(ckpt["state_dict"][f"{a}.weight"], ckpt["state_dict"][f"{b}.weight"])
    torch.optim.Adam(plain.parameters(), lr=1e-3).load_state_dict(ckpt["optimizer_states"][0])
    single = model_cls.load_from_checkpoint(path)
    assert single.get_submodule(a).weight is single.get_submodule(b).weight


def test_a_layer_applied_twice_keeps_both_positions():
    """``named_children()`` lists a module once: a stage or plan built from it would drop the second
    application and shift every later layer (seen: the pipeline's chunks ran 7 of 8 layers)."""
    seq = AppliedTwice().net
    assert [n for n, _ in layers_of(seq)] == [str(i) for i in range(10)]
    stage = PipelineStage(seq, [0, 2], [1])
    assert stage.chunk_names[1] == [str(i) for i in range(2, 10)]
    x = torch.randn(3, 32)
    torch.testing.assert_close(stage.chunks[1](x), seq[2:](x), rtol=0, atol=0)
    assert [(s.positions, s.names) for s in shared_spans(layers_of(seq))] == [
        ((3, 7), ("3.weight", "7.weight")), ((3, 7), ("3.bias", "7.bias"))]


class KeptInsideABlock(KeptUnderSecondNames):
    """A layer inside a block of the Sequential, kept under a second name and called alone in the step: under
    shm_fsdp (before 2026-12-04) that call computed with the rank's rows of the block's unit -- 0.045 off one
    process after 3 Adam steps, silently."""

    def __init__(self, **kw):
        super().__init__(**kw)
        del self.features, self.classifier, self.probe
        self.net[4] = nn.Sequential(nn.Linear(256, 64), nn.Tanh())
        self.head = self.net[4][0]

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x.flatten(1) * self.scale), y)
        return loss + 0.1 * self.head(torch.full((2, 256), 0.1, dtype=x.dtype)).pow(2).mean()


def _placements(model, policy=None):
    return {u.name: [n for n, _ in u.placements] for u in find_units(model, UnitPolicy.parse(policy))}


def test_fsdp_gives_a_shared_parameter_one_unit_gathered_at_every_holder():
    """The first unit to claim a shared parameter holds it; every other module holding it under another name
    gets that unit's hooks (a placement) -- no unit spans the layers between two holders (until 2026-12-04 the
    units from net.3 to net.7 were joined, and a tied embedding outside the Sequential was kept whole on every
    rank). A layer placed twice needs none: its unit's own hooks run at both placements."""
    assert _placements(Tied()) == {"net.1": [], "net.3": ["net.7"], "net.5": [], "net.7": [], "net.9": []}
    assert _placements(AppliedTwice()) == {"net.1": [], "net.3": [], "net.5": [], "net.9": []}
    assert _placements(TiedToEmbedding())["net.8"] == ["embed"]
    assert _placements(Tied(), lambda n, m: isinstance(m, nn.Linear))["net.3"] == ["net.7"]
    # a layer held under a second name (or placed twice) is a unit of its own even where units merge layers
    # (its hooks then open and close around every call); a layer inside one is a placement of its unit
    assert _placements(KeptUnderSecondNames(), 100_000) == {"net.1": [], "net.2": [], "net.4+net.5+net.6": [],
                                                            "net.7": []}
    assert _placements(AppliedTwice(), 100_000) == {"net.1+net.2": [], "net.3": [], "net.5+net.6": [], "net.9": []}
    assert _placements(KeptInsideABlock(), 100_000) == {"net.1": [], "net.2+net.3+net.4+net.5+net.6+net.7": ["head"]}


@pytest.mark.parametrize("model_cls, policy", [(Tied, "linear"), (KeptUnderSecondNames, 100_000),
                                               (KeptInsideABlock, None), (KeptInsideABlock, 100_000)],
                         ids=["tied-linear-units", "second-names-one-unit", "inside-a-block",
                              "inside-a-block-one-unit"])
@pytest.mark.parametrize("gather", ["view", "copy"])
def test_a_holder_outside_its_parameters_unit_gathers_it(model_cls, policy, gather):
    """Units that separate a tied weight's holders (was refused), and a unit's layer called alone under a second
    name (was silently computed on the rank's rows)."""
    policy = (lambda n, m: isinstance(m, nn.Linear)) if policy == "linear" else policy
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, model_cls=model_cls)
    got = train_mnist(SHMFSDPStrategy(start_method="fork", unit_policy=policy, gather=gather), 2, "adam",
                      batch=GLOBAL_BATCH // 2, model_cls=model_cls)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)


def test_derived_tensor_parallel_plan_leaves_tied_layers_whole():
    a, b = nn.Linear(64, 64), nn.Linear(64, 64)
    b.weight = a.weight
    seq = nn.Sequential(a, nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), b)
    plan = {n: lp.style for n, lp in derive_plan(seq, 2).items()}
    assert plan == {"2": "column", "4": "row"}


class TiedHeadAlone(TiedToEmbedding):
    """The tied layer and a Tanh as the last stage: under dp x pp sharded, a stage whose only parameter FSDP keeps
    whole -- no unit to form, which is not the mistake of a unit policy selecting nothing."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 10, bias=False))
        self.net[2].weight = self.embed.weight


@pytest.mark.parametrize("model_cls, name", [(TiedHeadAlone, "dp2xpp2-shard"), (KeptUnderSecondNames, "pp2")])
def test_a_stage_holding_only_parameters_every_rank_holds_clips_with_the_others(model_cls, name):
    """The last stage of TiedHeadAlone holds only the tied weight, which FSDP keeps whole (no unit to form: not
    the mistake of a unit policy selecting nothing); every layer of KeptUnderSecondNames' first stage is also
    kept under a second name, so every stage holds it. Such a stage's gradients are every rank's whole ones;
    until 2026-12-04 it decided alone that clipping needed no collective, and the others waited in theirs
    (CollectiveMismatchError)."""
    strategy = (SHMModelParallel(start_method="fork", data_parallel_size=2, pipeline_parallel_size=2,
                                 data_parallel="shard", microbatches=2, split_points=[1]) if name == "dp2xpp2-shard"
                else SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4, split_points=[4]))
    dp = 2 if name == "dp2xpp2-shard" else 1
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, model_cls=model_cls, gradient_clip_val=0.05)
    got = train_mnist(strategy, 2 * dp, "adam", batch=GLOBAL_BATCH // dp, model_cls=model_cls,
                      gradient_clip_val=0.05)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)


def test_the_derived_plan_for_a_model_leaves_a_layer_tied_to_a_module_outside_the_sequential_whole():
    plan = {n: lp.style for n, lp in plan_for(TiedToEmbedding(), None, 2).items()}
    assert plan == {"net.0": "column", "net.2": "row"}  # net.6 / net.8 would pair: net.8 holds the embedding


class BatchNormTwice(MNISTClassifier):
    """One BatchNorm1d at two places, a Linear between."""

    def __init__(self, **kw):
        super().__init__(**kw)
        bn = nn.BatchNorm1d(32)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), bn, nn.ReLU(), nn.Linear(32, 32), bn, nn.ReLU(),
                                 nn.Linear(32, 10))


@pytest.mark.parametrize("strategy", [SHMDDPStrategy, SHMFSDPStrategy])
def test_a_batchnorm_placed_twice_syncs_as_one_module_in_the_models_dtype(strategy):
    """sync_batchnorm converts it once, for both places (it had converted the first only: the tie broke),
    into the model's dtype (the SyncBatchNorm had stayed float32 in a float64 model)."""
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, model_cls=BatchNormTwice, buffers=True)
    got = train_mnist(strategy(start_method="fork"), 2, "adam", batch=GLOBAL_BATCH // 2, model_cls=BatchNormTwice,
                      buffers=True, sync_batchnorm=True)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)


class AppliedAtBothEnds(MNISTClassifier):
    """One Linear placed first and last: a module placed twice keeps one stage (its copies would keep their own
    buffers and hooks' state), and no cut leaves it one."""

    def __init__(self, **kw):
        super().__init__(**kw)
        shared = nn.Linear(32, 32)
        self.net = nn.Sequential(shared, nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), shared)

    def forward(self, x):
        return self.net(x.flatten(1)[:, :32])


@pytest.mark.parametrize("model, strategy, devices, match", [
    (AppliedTwice, lambda: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=2,
                                       split_points=[5]), 2,
     r"split point 5 is refused: layers 3 and 7 share one parameter \(net.3.weight = net.7.weight\): both must sit "
     r"on one pipeline stage"),
    (AppliedAtBothEnds, lambda: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=2), 2,
     r"5 layers cannot be cut into 2 chunks that each hold a parameter without starting one at \[1, 2, 3, 4\], where "
     r"layers 0 and 4 share one parameter \(net.0.weight = net.4.weight\)"),
    (Tied, lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2,
                                     plan={"net.5": "column", "net.7": "row"}), 2,
     r"'net.7' \(row\) holds 'net.7.weight', which is also 'net.3.weight'"),
], ids=["pipeline-cut-between-applications", "pipeline-no-cut-left", "tp-splits-tied"])
def test_layouts_that_would_separate_a_shared_parameter_are_refused(no_worker_starts, model, strategy, devices,
                                                                    match):
    with pytest.raises(ValueError, match=match):
        trainer(strategy=strategy(), devices=devices, max_epochs=1).fit(model(), loader(mnist_like(8), 4))


@pytest.mark.parametrize("model, strategy, devices", [
    ("tied", lambda: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=2, split_points=[5]), 2),
    ("tied-ends", lambda: SHMPipeline(start_method="fork", pipeline_parallel_size=4, microbatches=4), 4),
    ("tied-ends", lambda: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4, virtual_stages=2,
                                      schedule="interleaved_1f1b"), 2),
    ("tied-ends", lambda: SHMModelParallel(start_method="fork", tensor_parallel_size=2, pipeline_parallel_size=2,
                                           microbatches=2), 4),
], ids=["split-points-between-tied", "pp4-middle-stages-hold-none", "interleaved", "tp2xpp2"])
def test_tied_weights_on_several_stages_train_as_in_one_process(references, model, strategy, devices):
    """Each stage holding a layer of the tie keeps a copy; the stages sum the copies' gradients (a stage holding
    none adds zeros). Until 2026-12-04 split points between tied layers were refused."""
    got = train_mnist(strategy(), devices, "sgd", batch=GLOBAL_BATCH, model_cls=MODELS[model])
    torch.testing.assert_close(got, references[model], rtol=0, atol=1e-5)


def _stage_of_a_tie(world):
    """What each of 2 stages holds of EmbeddingAndHeadTied's tie, and what the pipeline logged on it."""
    torch.manual_seed(0)
    model, logged = EmbeddingAndHeadTied(), []
    broadcast_module_state(model, world.group())
    groups = Topology(world.size, dp=1, tp=1, pp=2).groups(world)
    state = parallelize(model, ParallelConfig(1, 1, 2, balance="params", microbatches=2), world, groups,
                        training=True, log=logged.append)
    held = sorted(n for n, _ in model.named_parameters() if n in ("net.0.weight", "net.8.weight"))
    return held, state.outside.names, [state.state.copies(p) for n, p in model.named_parameters() if n in held], \
        [m for m in logged if "tied" in m], sorted(state.outside.tie_groups)


def test_each_stage_holding_a_tied_layer_keeps_a_copy_counted_twice_and_logged():
    first, last = launch(_stage_of_a_tie, 2, start_method="fork")
    assert first[4] == last[4] == []  # held by every stage: in the pipeline group's all-reduce, no group of its own
    assert first[:3] == (["net.0.weight"], ["net.0.weight"], [2])
    assert last[:3] == (["net.8.weight"], ["net.8.weight"], [2])
    assert first[3] == ["pipeline: tied weights ['net.0.weight'] sit on several stages: each keeps a copy, and the "
                        "stages sum their gradients every step"]


class ThreeTiesOnFourStages(MNISTClassifier):
    """Eight Linear layers, two per stage at P=4, with three ties between stages: net.0 = net.7 (stages 0 and 3),
    net.1 = net.4 (0 and 2), net.5 = net.6 (2 and 3) -- overlapping holder sets, stage 1 holding none."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = nn.Sequential(*(nn.Linear(16, 16, bias=False) for _ in range(8)))
        for a, b in ((0, 7), (1, 4), (5, 6)):
            self.net[b].weight = self.net[a].weight


def _sum_ties_over_their_holders(world):
    torch.manual_seed(0)
    model = ThreeTiesOnFourStages()
    groups = Topology(world.size, dp=1, tp=1, pp=4).groups(world)
    state = parallelize(model, ParallelConfig(1, 1, 4, split_points=[2, 4, 6], microbatches=4), world, groups,
                        training=True, log=lambda _: None)
    held = dict(model.named_parameters())
    for p in held.values():
        p.grad = torch.full_like(p, float(world.rank + 1))  # stage s's part of each gradient: s + 1 everywhere
    before = dict(groups.pp.traffic)
    state.outside.sum_grads()
    sums = {n: sorted(set(p.grad.flatten().tolist())) for n, p in held.items()}
    pp_bytes = groups.pp.traffic.get("all_reduce", 0) - before.get("all_reduce", 0)
    ties = {h: (list(g.ranks), g.traffic.get("all_reduce", 0)) for h, g in state.outside.tie_groups.items()}
    return sums, pp_bytes, ties


def test_a_tie_on_some_stages_is_summed_over_those_alone():
    """Megatron's embedding group: a tie's gradient is summed over the stages holding it, in a group of theirs;
    a stage holding none takes no part (until 2026-12-06 it added zeros to the pipeline group's all-reduce, the
    tie's bytes passing through every stage). Overlapping holder sets run one after another in one order."""
    results = launch(_sum_ties_over_their_holders, 4, start_method="fork")
    flag = 4  # one float32 used-flag per tied weight rides with its gradient
    one = 16 * 16 * 4 + flag
    expected = [  # per stage: the summed gradient of each tied weight it holds, its tie groups and their bytes
        ({"net.0.weight": [5.0], "net.1.weight": [4.0]}, {(0, 2): ([0, 2], one), (0, 3): ([0, 3], one)}),
        ({"net.2.weight": [2.0], "net.3.weight": [2.0]}, {}),  # untied: its own gradient, untouched
        ({"net.4.weight": [4.0], "net.5.weight": [7.0]}, {(0, 2): ([0, 2], one), (2, 3): ([2, 3], one)}),
        ({"net.6.weight": [7.0], "net.7.weight": [5.0]}, {(0, 3): ([0, 3], one), (2, 3): ([2, 3], one)}),
    ]
    for stage, ((sums, pp_bytes, ties), (want_sums, want_ties)) in enumerate(zip(results, expected)):
        assert sums == want_sums, stage
        assert ties == want_ties, stage
        assert pp_bytes == 0, stage  # no parameter outside the Sequential: nothing over the whole pipeline group


class _Backbone(nn.Module):
    """A Sequential one level down with an ALBERT-style tie inside it, and an embedding beside it tied to its
    output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 32)
        a, b = nn.Linear(32, 32), nn.Linear(32, 32)
        b.weight = a.weight
        self.layers = nn.Sequential(a, nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), b, nn.Tanh(),
                                    nn.Linear(32, 10, bias=False))
        self.layers[-1].weight = self.embed.weight

    def forward(self, x):
        return self.layers(self.embed((x.flatten(1)[:, :16].sigmoid() * 10).long().clamp(max=9)).mean(1))


class NestedTies(MNISTClassifier):
    def __init__(self, **kw):
        super().__init__(**kw)
        del self.net
        self.model = _Backbone()

    def forward(self, x):
        return self.model(x)


@pytest.mark.parametrize("name", ["fsdp", "pp2", "dp2xpp2-shard"])
def test_ties_inside_and_beside_a_named_sequential_train_as_in_one_process(name):
    runs = {"fsdp": (lambda: SHMFSDPStrategy(start_method="fork", sequential="model.layers"), 2, 2),
            "pp2": (lambda: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4,
                                        sequential="model.layers"), 2, 1),
            "dp2xpp2-shard": (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2,
                                                       pipeline_parallel_size=2, data_parallel="shard", microbatches=2,
                                                       sequential="model.layers"), 4, 2)}
    strategy, devices, dp = runs[name]
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, model_cls=NestedTies)
    got = train_mnist(strategy(), devices, "adam", batch=GLOBAL_BATCH // dp, model_cls=NestedTies)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)


def _fit_with_norms_and_ema(model_cls, strategy, devices, batch, ref):
    class Logged(model_cls):
        def on_before_optimizer_step(self, optimizer):
            self.log_dict(lightning_shm.grad_norm(self, 2))

    pl.seed_everything(1)
    model = Logged(optimizer="adam", lr=0.01)
    ds = mnist_like(GLOBAL_BATCH * 3, seed=1)
    t = trainer(strategy=strategy, devices=devices, max_epochs=1, precision="64-true",
                callbacks=[EMAWeightAveraging(decay=0.9)])
    t.fit(model, reference_loader(ds, batch, 1) if ref else loader(ds, batch), loader(ds, GLOBAL_BATCH, shuffle=False))
    return flat_params(model), {k: float(v) for k, v in t.callback_metrics.items()}


@pytest.mark.parametrize("model_cls", [TiedToEmbedding, KeptUnderSecondNames])
@pytest.mark.parametrize("run", ["pp2-1f1b", "dp2xpp2-shard"])
def test_grad_norms_and_an_ema_of_tied_or_second_named_parameters_equal_one_process(model_cls, run):
    """A stage may hold such a parameter under another name than the plain module's (the tied embedding's own,
    a second name's): until 2026-12-04 its per-parameter gradient norm was left out (the logged total 0.55 off
    one process) and EMAWeightAveraging averaged it in float64 where one process (and the other stage) averaged
    in the callback's float32 copy (the final weights 9e-9 off, the validation loss on the average 2e-9)."""
    strategy, devices, dp = RUNS[run]
    ref, ref_logged = _fit_with_norms_and_ema(model_cls, "auto", 1, GLOBAL_BATCH, True)
    got, logged = _fit_with_norms_and_ema(model_cls, strategy(), devices, GLOBAL_BATCH // dp, False)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    assert set(logged) == set(ref_logged)
    for k, v in ref_logged.items():
        assert logged[k] == pytest.approx(v, abs=1e-12), k


def test_a_tied_weight_on_two_of_four_stages_counts_once_in_the_clipped_norm():
    """Global-norm clipping adds each stage's squared norms over the pipeline group and counts a parameter held
    by several stages once (its placement's copies: the 2 stages holding the embedding and the head, not 4)."""
    def make():
        return EmbeddingAndHeadTied(optimizer="adam", lr=0.01)

    _, ref = fit_seeded(make, "auto", 1, GLOBAL_BATCH, ref=True, gradient_clip_val=0.05)
    _, got = fit_seeded(make, SHMPipeline(start_method="fork", pipeline_parallel_size=4, microbatches=4), 4,
                        GLOBAL_BATCH, gradient_clip_val=0.05)
    torch.testing.assert_close(flat_params(got), flat_params(ref), rtol=0, atol=1e-9)


def test_tied_layers_keep_one_stage_where_a_cut_allows_it():
    """Cutting a tie apart costs a copy per holding stage and an all-reduce of its gradient per step: the planner
    does so only where no cut keeps its holders together, or where the split points ask for it."""
    config = ParallelConfig(pipeline_parallel_size=2, microbatches=2)
    assert sorted(_cut_rules(Tied(), config, {})) == [4, 5, 6, 7]
    assert _cut_rules(EmbeddingAndHeadTied(), config, {}) == {}
    assert _cut_rules(Tied(), ParallelConfig(pipeline_parallel_size=2, microbatches=2, split_points=[5]), {}) == {}
    assert sorted(_cut_rules(AppliedTwice(), config, {})) == [4, 5, 6, 7]  # a module placed twice: never apart


def test_a_row_cut_never_splits_a_tied_linear():
    """``split_linear`` cuts the Linear holding the ideal boundary into two pieces of new parameters: a tied weight
    cut so would lose its tie. With ties allowed apart, no forbidden cut protects it any more."""
    a, b = nn.Linear(64, 64), nn.Linear(64, 64)
    b.weight = a.weight
    untied = nn.Linear(64, 64)
    costs = [1.0, 0.0, 1.0, 0.0, 0.1]  # the ideal boundary (1.05 of 2.1) falls inside the third layer
    assert plan_row_cuts([a, nn.ReLU(), untied, nn.ReLU(), nn.Linear(64, 10)], costs, 2) == [(0, 0), (2, 3)]
    assert plan_row_cuts([a, nn.ReLU(), b, nn.ReLU(), nn.Linear(64, 10)], costs, 2) is None
