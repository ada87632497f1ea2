"""shm_tp end to end: plans, parity (tp and dp x tp), distributed inference, checkpoints, errors."""

from __future__ import annotations

import inspect
import pickle
import re
from functools import partial

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning_shm  # noqa: F401
from lightning_shm import SHMDDPStrategy, SHMModelParallel, SHMTensorParallel
from lightning_shm.models import MNISTClassifier, build_mlp
from lightning_shm.parallel.tp import LayerSplit, TensorParallelState, check_plan, derive_plan, plan_for, resolve_plan
from lightning_shm.parallel.tp.loading import gather_rows, is_group_batch
from lightning_shm.parallel.tp.plan import parse_plan
from lightning_shm.runtime import launch
from tests.helpers import (
    GLOBAL_BATCH,
    InBatchNegatives,
    PerRankDraws,
    SchedClassifier,
    check_plain_checkpoint,
    fit_adam64,
    fit_seeded,
    flat_params,
    loader,
    mnist_like,
    train_mnist,
    trainer,
)


def tp(size, **kw):
    return SHMTensorParallel(start_method="fork", tensor_parallel_size=size, **kw)


def _styles(plan):
    return {k: v.style for k, v in plan.items()}


def test_derived_plan_pairs_linears_column_row_gathers_before_small_ones_and_replicates_the_rest():
    # 784-16-512-10: the second Linear (8,192 weights) is over 1/tp of the first (12,544): a column -> row pair
    assert _styles(derive_plan(build_mlp([16, 512]), 2, "net")) == {"net.1": "column", "net.4": "row"}
    # the reference MLP (200,704 / 16,384 / 640 weights): the first Linear gathered, the small ones replicated
    assert _styles(derive_plan(build_mlp(), 2, "net")) == {"net.1": "column_gathered"}
    assert _styles(derive_plan(build_mlp(), 8, "net")) == {"net.1": "column_gathered"}  # 16,384 * 8 <= 200,704
    assert _styles(derive_plan(build_mlp(), 16, "net")) == {"net.1": "column", "net.4": "row"}  # 16,384 * 16 > it
    assert _styles(derive_plan(build_mlp([64, 32, 16]), 2)) == {"1": "column_gathered"}
    # a Linear larger than 1/tp of the gathered one (8 -> 20000: 160,000 weights) starts a new pair
    assert _styles(derive_plan(build_mlp([256, 8, 20000]), 2)) == {"1": "column_gathered", "7": "column",
                                                                        "10": "row"}
    cnn = nn.Sequential(nn.Conv2d(1, 64, 3), nn.ReLU(), nn.Conv2d(64, 1, 1))  # Conv2d pairs are never gathered
    assert _styles(derive_plan(cnn, 2)) == {"0": "column", "2": "row"}
    # a GroupNorm between them when every rank's channels are whole groups; an InstanceNorm (per channel) always
    # and a grouped Conv2d keeping its channels, on whole groups (never a pair's own layer)
    for norm, paired in [(nn.GroupNorm(8, 64), True), (nn.GroupNorm(1, 64), False), (nn.InstanceNorm2d(64), True),
                         (nn.Conv2d(64, 64, 3, groups=64), True), (nn.Conv2d(64, 64, 3, groups=4), True),
                         (nn.Conv2d(64, 128, 3, groups=4), False), (nn.Conv2d(64, 64, 3, groups=64, bias=False), True)]:
        cnn = nn.Sequential(nn.Conv2d(1, 64, 3), norm, nn.ReLU(), nn.Conv2d(64 if paired else 128, 1, 1))
        assert _styles(derive_plan(cnn, 2)) == ({"0": "column", "3": "row"} if paired else {}), norm
    # a grouped first layer is no column layer: the pair starts at the next plain one
    cnn = nn.Sequential(nn.Conv2d(8, 8, 3, groups=8), nn.Conv2d(8, 32, 1), nn.ReLU(), nn.Conv2d(32, 8, 1))
    assert _styles(derive_plan(cnn, 2)) == {"1": "column", "3": "row"}
    # 1-d and 3-d convolutions pair as 2-d ones do, each with one of its own dimensions, over their norms,
    # grouped convolutions and pooling
    audio = nn.Sequential(nn.Conv1d(1, 16, 5), nn.BatchNorm1d(16), nn.GELU(), nn.Conv1d(16, 16, 3, groups=16),
                          nn.MaxPool1d(2), nn.Conv1d(16, 4, 1), nn.Flatten(), nn.Linear(40, 10))
    assert _styles(derive_plan(audio, 2)) == {"0": "column", "5": "row"}
    video = nn.Sequential(nn.Conv3d(1, 8, 3), nn.InstanceNorm3d(8, affine=True), nn.AdaptiveAvgPool3d(2),
                          nn.Conv3d(8, 4, 1))
    assert _styles(derive_plan(video, 2)) == {"0": "column", "3": "row"}
    mixed = nn.Sequential(nn.Conv1d(1, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1))  # no pair across dimensions
    assert _styles(derive_plan(mixed, 2)) == {}
    wrong_norm = nn.Sequential(nn.Conv1d(1, 8, 3), nn.BatchNorm2d(8), nn.Conv1d(8, 4, 1))
    assert _styles(derive_plan(wrong_norm, 2)) == {}
    # torch's encoder layer: its feed-forward pair and its attention's heads (whole with fewer heads than tp ranks);
    # a Linear on each side stays unpaired
    encoder = nn.Sequential(nn.Linear(28, 16), nn.TransformerEncoderLayer(16, 4, 32), nn.Linear(16, 10))
    assert _styles(derive_plan(encoder, 2)) == {"1.linear1": "column", "1.linear2": "row", "1.self_attn": "heads"}
    assert _styles(derive_plan(encoder, 8)) == {"1.linear1": "column", "1.linear2": "row"}
    # a stack of them (nn.TransformerEncoder): each block's
    encoder[1] = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32), 2, enable_nested_tensor=False)
    assert _styles(derive_plan(encoder, 2)) == {f"1.layers.{j}.{n}": s for j in (0, 1) for n, s in (
        ("linear1", "column"), ("linear2", "row"), ("self_attn", "heads"))}
    # applied twice (one block's parameters at two places), it stays whole: split, the two would stop sharing
    twice = nn.Sequential(nn.Linear(28, 16), encoder[1], encoder[1], nn.Linear(16, 10))
    assert _styles(derive_plan(twice, 2)) == {}


class _Seq2Seq(nn.Module):
    """torch's blocks outside any Sequential, as a sequence-to-sequence or decoder model holds them."""

    def __init__(self, head: bool = True) -> None:
        super().__init__()
        self.tr = nn.Transformer(16, 4, 1, 1, 32, batch_first=True)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 4, 32, batch_first=True), 1)
        if head:
            self.net = nn.Sequential(nn.Linear(16, 10))


class _OwnForward(nn.TransformerEncoderLayer):
    def forward(self, src, *args, **kwargs):  # a forward of its own: the plan for torch's may not fit it
        return super().forward(src, *args, **kwargs) * 2


class _OwnInit(nn.TransformerDecoderLayer):
    def __init__(self) -> None:  # torch's forward, its own arguments
        super().__init__(16, 4, 32, batch_first=True, norm_first=True)


def test_derived_plan_splits_torchs_transformer_blocks_wherever_they_sit():
    """Their forward is torch's, so each block's output is whole on every rank whatever runs around it: each
    encoder and decoder layer's feed-forward pair, its self-attention and a decoder's cross-attention by heads
    (until 2026-12-07 only blocks that were children of the Sequential were split; a model holding them elsewhere
    got "the plan splits no layer")."""
    block = {"linear1": "column", "linear2": "row", "self_attn": "heads"}
    cross = {**block, "multihead_attn": "heads"}
    want = {**{f"tr.encoder.layers.0.{k}": v for k, v in block.items()},
            **{f"tr.decoder.layers.0.{k}": v for k, v in cross.items()},
            **{f"dec.layers.0.{k}": v for k, v in cross.items()}}
    assert _styles(plan_for(_Seq2Seq(), None, 2)) == want
    assert _styles(plan_for(_Seq2Seq(head=False), None, 2)) == want  # no Sequential at all: the blocks' plan
    assert _styles(plan_for(_OwnInit(), None, 2)) == cross  # the module itself one
    with pytest.raises(ValueError, match="has no top-level nn.Sequential"):  # nor blocks: refused as before
        plan_for(nn.Module(), None, 2)
    with pytest.raises(ValueError, match="has no submodule 'body'"):  # a Sequential named: it must be there
        plan_for(_Seq2Seq(head=False), None, 2, "body")
    # nested in a user's module inside the Sequential; a subclass with torch's forward is planned, one with its
    # own forward stays whole
    model = nn.Sequential(nn.Linear(28, 16), nn.ModuleDict({"own": _OwnForward(16, 4, 32), "init": _OwnInit()}))
    assert _styles(plan_for(model, None, 2)) == {f"1.init.{k}": v for k, v in cross.items()}
    # a block a module outside it also holds a parameter of stays whole: split, the two would stop sharing
    tied = _Seq2Seq()
    tied.probe = nn.Linear(16, 32)
    tied.probe.weight = tied.dec.layers[0].linear1.weight
    assert _styles(plan_for(tied, None, 2)) == {k: v for k, v in want.items() if not k.startswith("dec.")}


@pytest.fixture(scope="module")
def references():
    return {opt: train_mnist("auto", 1, opt, batch=GLOBAL_BATCH, ref=True) for opt in ("sgd", "adam")}


@pytest.mark.parametrize("devices, size", [(2, 2), (4, 4), (3, 3), (4, 2)],
                         ids=["tp2", "tp4", "tp3-uneven", "dp2xtp2"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_tensor_parallel_equals_one_process(references, devices, size, optimizer):
    """The derived plan: the reference MLP's first Linear split with its output gathered."""
    dp = devices // size
    got = train_mnist(tp(size), devices, optimizer, batch=GLOBAL_BATCH // dp)
    torch.testing.assert_close(got, references[optimizer], rtol=0, atol=1e-5)


@pytest.mark.parametrize("devices, size", [(2, 2), (3, 3), (4, 2)], ids=["tp2", "tp3-uneven", "dp2xtp2"])
def test_column_row_pair_with_split_layernorm_equals_one_process(references, devices, size):
    """The Megatron pair on the same MLP: column, split LayerNorm, ReLU, row (the wide MLP's derived plan)."""
    dp = devices // size
    got = train_mnist(tp(size, plan={"net.1": "column", "net.4": "row"}), devices, "adam", batch=GLOBAL_BATCH // dp)
    torch.testing.assert_close(got, references["adam"], rtol=0, atol=1e-5)


class RankAugmented(PerRankDraws):
    """Noise drawn per sample and rank: the halves of a column layer would see different images."""

    def draw(self, x, y, g):
        return x + 0.5 * torch.randn(x.shape, generator=g), y


def test_tp_ranks_fed_different_batches_are_stopped_or_given_the_first_members():
    ref = train_mnist("auto", 1, "sgd", batch=GLOBAL_BATCH, ref=True, data=RankAugmented)  # rank 0's augmentation
    got = train_mnist(tp(2, tp_batch="broadcast"), 2, "sgd", batch=GLOBAL_BATCH, data=RankAugmented)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"model replica \(tp members, pipeline stages\) received different "
                                         r"batches: member 1's"):
        train_mnist(tp(2, tp_batch="check"), 2, "sgd", batch=GLOBAL_BATCH, data=RankAugmented)
    # what the two prevent: the halves of each layer computed on different inputs, silently
    off = train_mnist(tp(2, tp_batch="off"), 2, "sgd", batch=GLOBAL_BATCH, data=RankAugmented)
    assert (off - ref).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"tp_batch must be one of \('auto', 'split', 'broadcast', 'check', 'off'\), "
                                         r"got 'x'"):
        tp(2, tp_batch="x")


class SameInputs(MNISTClassifier):
    """Fails a training step whose inputs differ between the ranks (all of one tp group here)."""

    def training_step(self, batch, batch_idx):
        if self.trainer.world_size > 1:
            x, y = batch
            every_rank = self.trainer.strategy.group
            sums = self.all_gather(torch.stack([x.double().sum(), y.double().sum()]), group=every_rank)  # [W, 2]
            assert torch.equal(sums, sums[:1].expand_as(sums)), f"ranks computed on different inputs: {sums.tolist()}"
        return super().training_step(batch, batch_idx)


class Served(torch.utils.data.Dataset):
    """Appends every index it loads to ``log_dir/rank<global rank>``."""

    def __init__(self, ds, log_dir):
        self.ds, self.log_dir = ds, log_dir

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        from lightning.pytorch.utilities import rank_zero_only

        with open(self.log_dir / f"rank{rank_zero_only.rank}", "a") as f:
            f.write(f"{i}\n")
        return self.ds[i]


def test_split_loading_each_rank_loads_its_rows_and_every_rank_computes_on_the_whole_batch(tmp_path):
    # 47 samples in batches of 23: member 0 loads 12 rows and member 1 11 (unequal shares: all_gather_v),
    # then a last batch of 1 sample, too small to split: both load it, member 0's copy is used
    kw = dict(batch=23, samples=47, model_cls=SameInputs)
    ref = train_mnist("auto", 1, "sgd", ref=True, **kw)
    got = train_mnist(tp(2), 2, "sgd", data=partial(Served, log_dir=tmp_path), **kw)  # default tp_batch="auto"
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    served = [[int(i) for i in (tmp_path / f"rank{r}").read_text().split()] for r in (0, 1)]
    assert [s[0] for s in served] == [0, 0]  # each member's look at whether loading draws (it does not: split)
    served = [s[1:] for s in served]
    assert (len(served[0]), len(served[1])) == (12 + 12 + 1, 11 + 11 + 1)
    assert set(served[0]) | set(served[1]) == set(range(47)) and len(set(served[0]) & set(served[1])) == 1
    # a pipeline seeded per rank: each sample is augmented once, by the rank that loads it, and every
    # rank computes on the same gathered batch -- which SameInputs fails when the ranks load by themselves;
    # the last batch (1 sample) is loaded by both ranks with different noise: member 0's is used
    train_mnist(tp(2), 2, "sgd", batch=GLOBAL_BATCH, samples=GLOBAL_BATCH * 2 + 1, data=RankAugmented,
                model_cls=SameInputs)
    with pytest.raises(AssertionError, match="ranks computed on different inputs"):
        train_mnist(tp(2, tp_batch="off"), 2, "sgd", batch=GLOBAL_BATCH, data=RankAugmented, model_cls=SameInputs)


def _gather_rows(world):
    g, rows = world.group(), (3, 2)
    r = g.index
    part = {"x": torch.arange(rows[r] * 2.0).view(rows[r], 2) + 100 * r, "name": [f"s{r}{i}" for i in range(rows[r])]}
    out = gather_rows(part, rows, g)
    # gathered tensors are marked as the group's batch (the strategy does not broadcast them again);
    # a tensor made from one afterwards, or a batch too small to split (left to the broadcast), is not
    small = {"x": torch.zeros(1, 2) + r}
    marks = [is_group_batch([out["x"]]), is_group_batch([out["x"] * 1]),
             gather_rows(small, (1, 0), g) is small and not is_group_batch([small["x"]])]
    with pytest.raises(ValueError, match=r"a batch tensor of shape \(\) does not have this rank's \d rows"):
        gather_rows({"n": torch.tensor(1.0)}, rows, g)  # a per-batch value: not rows, nothing to gather
    return out, marks


def test_gathered_rows_are_the_members_shares_in_member_order():
    for out, marks in launch(_gather_rows, 2, start_method="fork"):
        assert marks == [True, False, True]
        assert torch.equal(out["x"], torch.cat([torch.arange(6.0).view(3, 2), torch.arange(4.0).view(2, 2) + 100]))
        assert out["name"] == ["s00", "s01", "s02", "s10", "s11"]


def test_split_refuses_loaders_it_cannot_split():
    class OwnLoader(DataLoader):
        pass

    with pytest.raises(ValueError, match=r"tp_batch='split' cannot split this loader's batches over the ranks of a "
                                         r"replica \(tp members and pipeline stages\): the loader is a OwnLoader, "
                                         r"not a torch DataLoader"):
        trainer(strategy=tp(2, tp_batch="split"), devices=2, max_steps=1).fit(
            MNISTClassifier(), OwnLoader(mnist_like(8), batch_size=4))


def test_user_plan_as_data_and_global_norm_clipping():
    plan = {"net.1": "column", "net.4": "row", "net.7": "replicate"}
    kw = dict(model_cls=SchedClassifier, gradient_clip_val=0.05)
    ref = train_mnist("auto", 1, "sgd", batch=GLOBAL_BATCH, ref=True, **kw)
    got = train_mnist(tp(2, plan=plan), 2, "sgd", batch=GLOBAL_BATCH, **kw)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_a_plan_of_torchs_parallel_styles_trains_as_the_same_plan_in_words():
    """A module written for Lightning's ``ModelParallelStrategy`` keeps its ``parallelize_module`` plan: torch's
    ``ColwiseParallel()`` is "column", ``ColwiseParallel(output_layouts=Replicate())`` "column_gathered",
    ``RowwiseParallel()`` "row" (until 2026-12-07: "expected a style"). The plan pickles, as a spawned worker gets it.
    (Hugging Face's words: ``test_hugging_faces_words_for_the_styles_are_taken``.)"""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch_plan = {"net.1": ColwiseParallel(), "net.2": "between", "net.4": RowwiseParallel(),
                  "net.7": ColwiseParallel(output_layouts=Replicate())}
    words = {"net.1": "column", "net.2": "between", "net.4": "row", "net.7": "column_gathered"}
    assert {k: v.style for k, v in parse_plan(pickle.loads(pickle.dumps(torch_plan))).items()} == words
    got = train_mnist(tp(2, plan=torch_plan), 2, "adam", batch=GLOBAL_BATCH)
    torch.testing.assert_close(got, train_mnist(tp(2, plan=words), 2, "adam", batch=GLOBAL_BATCH), rtol=0, atol=0)


def test_torchs_tutorial_plan_for_an_embedding_and_its_tied_output_layer_trains_as_the_plan_in_words():
    """torch's tensor-parallel tutorial plans the token embedding ``RowwiseParallel(input_layouts=Replicate())`` (its
    input is the ids, whole on every rank) and the output layer ``ColwiseParallel(output_layouts=Replicate())``;
    until 2026-12-07 the first was refused ("has no counterpart here"). On a Linear it is "row_split_input", which
    takes a whole input: between a column layer and its row layer it is refused by name."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from tests.test_real_models import TiedTokenClassifier, TokenClassifier

    embedding = RowwiseParallel(input_layouts=Replicate())
    for model_cls, torch_plan, words in [
        (TokenClassifier, {"net.1": embedding, "net.3": ColwiseParallel(), "net.5": RowwiseParallel()},
         {"net.1": "row", "net.3": "column", "net.5": "row"}),
        (TiedTokenClassifier, {"net.1": embedding, "net.3": ColwiseParallel(output_layouts=Replicate())},
         {"net.1": "row", "net.3": "column_gathered"})]:
        assert _styles(resolve_plan(model_cls(), pickle.loads(pickle.dumps(torch_plan)))) == words
        both = {"net.1": "row", "net.[1]": embedding}  # the words and torch's style, matching one embedding: agreed
        assert _styles(resolve_plan(model_cls(), both)) == {"net.1": "row"}
        got = train_mnist(tp(2, plan=torch_plan), 2, "adam", batch=GLOBAL_BATCH, model_cls=model_cls)
        want = train_mnist(tp(2, plan=words), 2, "adam", batch=GLOBAL_BATCH, model_cls=model_cls)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"'row_split_input' layer 'net.4' sits between column layer 'net.1' and its "
                                         r"row layer: it needs the whole input features"):
        trainer(strategy=tp(2, plan={"net.1": ColwiseParallel(), "net.4": embedding}), devices=2,
                max_epochs=1).fit(MNISTClassifier(), loader(mnist_like(8), 4))


@pytest.mark.parametrize("size, pieces", [(2, [128, 128]), (3, [86, 85, 85])])
def test_a_row_layer_splitting_its_whole_input_after_a_gathered_one_equals_one_process(size, pieces):
    """``"row_split_input"`` (Megatron's ``input_is_parallel=False``): the layer after a gathered column layer takes
    a whole input and keeps the rank's features of it, its input's gradient all-gathered back. The reference MLP's
    first Linear gathered, the LayerNorm and ReLU whole, the second splitting their 256 features itself. Hugging
    Face's words for the pair -- Transformers 5's, which its Phi-3 plan uses, and 4's -- and torch's styles are the
    same plan. Until 2026-12-07 "rowwise_split_input" got "a plan style must be one of ...", and the torch style
    on a Linear "a row layer here takes the split output of a column layer"."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    words = {"net.1": "column_gathered", "net.4": "row_split_input"}
    for same in ({"net.1": "colwise_gather_output", "net.4": "rowwise_split_input"},
                 {"net.1": "colwise_rep", "net.4": "rowwise_rep"},
                 {"net.1": ColwiseParallel(output_layouts=Replicate()), "net.4": RowwiseParallel(
                     input_layouts=Replicate())}):
        assert _styles(resolve_plan(MNISTClassifier(), same)) == words
    splits = check_plan(MNISTClassifier(), resolve_plan(MNISTClassifier(), words), size)
    assert splits["net.4"] == LayerSplit("row_split_input", tuple(pieces))
    ref = train_mnist("auto", 1, "sgd", batch=GLOBAL_BATCH, ref=True)
    got = train_mnist(tp(size, plan=words), size, "sgd", batch=GLOBAL_BATCH)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_hugging_faces_words_for_the_styles_are_taken():
    """Transformers 5's tp_plan words (its Qwen3, Gemma 3, Phi-3 plans) and 4's, each for the style it names, beside
    ours in one plan; those for experts held as 3-D parameters and for sequence parallelism have no counterpart."""
    hf = {"colwise": "column", "local_colwise": "column", "rowwise": "row", "local_rowwise": "row",
          "colwise_rep": "column_gathered", "colwise_gather_output": "column_gathered",
          "rowwise_rep": "row_split_input", "rowwise_split_input": "row_split_input", "embedding_rowwise": "row",
          "replicated_with_grad_allreduce": "on_heads", "between": "between"}
    assert {k: v.style for k, v in parse_plan(hf).items()} == hf
    for word in ("packed_colwise", "moe_tp_experts", "sequence_parallel"):
        with pytest.raises(ValueError, match=f"plan entry 'x': a plan style must be one of .*got '{word}'"):
            parse_plan({"x": word})


class _LowRankQueries(nn.Module):
    """DeepSeek's MLA query path: a down projection and its norm on the whole features, then an up projection to 4
    heads of 4 (column) and the output projection (row); ``gate``: the output scaled by it, a parameter."""

    def __init__(self, gate: float = 1.0) -> None:
        super().__init__()
        self.head_dim = 4
        self.q_a_proj, self.q_a_layernorm = nn.Linear(16, 6), nn.LayerNorm(6)
        self.q_b_proj, self.o = nn.Linear(6, 16), nn.Linear(16, 16)
        self.gate = nn.Parameter(torch.tensor(gate))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate * self.o(torch.tanh(self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))))


@pytest.mark.parametrize("gate", [1.0, 0.0])
def test_on_heads_for_a_module_on_whole_features_is_stopped_naming_it(gate):
    """"on_heads" (Hugging Face's "replicated_with_grad_allreduce") sums a module's gradient over the tp ranks: right
    for qk-norm, which runs on the rank's heads. Hugging Face also plans MLA's down projection and its norm so; here
    they run on whole features before the column layer, whose input's gradient is summed already, so each rank holds
    one process's gradient and the sum would count it twice, silently. At the first backward the ranks find its
    gradient the same on each, and stop. (A k_norm on one kv head every rank computes has the same input on each
    rank, but a gradient from the rank's q heads: that one is summed, ``test_qwen3_planned_...``.) Behind a
    zero-initialised gate the first gradients are zero on every rank: the second step's stop it."""
    plan = {"net.2.q_a_proj": "replicated_with_grad_allreduce", "net.2.q_a_layernorm": "replicated_with_grad_allreduce",
            "net.2.q_b_proj": "colwise", "net.2.o": "rowwise"}
    with pytest.raises(ValueError, match=r"'net.2.q_a_(proj|layernorm)' is planned 'on_heads' \(Hugging Face: "
                                         r"'replicated_with_grad_allreduce'\), which sums its gradients over the tp "
                                         r"ranks, but every tp rank got the same gradient: it runs on whole features "
                                         r"\(before a column layer\).*count it 2 times. Leave it out of the plan"):
        trainer(strategy=tp(2), devices=2, max_steps=3).fit(_one_attention(_LowRankQueries(gate), plan),
                                                            loader(mnist_like(16), 4))


def test_a_row_layer_splitting_its_input_given_a_split_one_says_to_plan_it_row():
    """After a column layer whose output stays split, "row_split_input" would cut the rank's 8 features again (rank
    0 the first 8 of them, rank 1 past their end); it says what to plan instead."""
    plan = {"net.2.q_b_proj": "colwise", "net.2.o": "rowwise_split_input"}
    with pytest.raises(ValueError, match=r"a 'row_split_input' Linear takes the whole input of 16 features and splits "
                                         r"it itself, but got 8: after a column layer whose output stays split \(this "
                                         r"rank's features\), plan it 'row'"):
        trainer(strategy=tp(2), devices=2, max_steps=1).fit(_one_attention(_LowRankQueries(), plan),
                                                            loader(mnist_like(8), 4))


class _StoredHeads(nn.Module):
    """Attention over the image's rows, its head count stored at construction as torch's Llama stores n_heads."""

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, 4
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (layer(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for layer in (self.q, self.k,
                                                                                                    self.v))
        return self.o(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, -1))


class _Block(nn.Module):
    """The attention and an MLP pair of the block's own: the note names the innermost module (the attention)."""

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.attn, self.fc1, self.fc2 = _StoredHeads(n_heads), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.fc2(torch.relu(self.fc1(x)))


class _StoredHeadsClassifier(MNISTClassifier):
    def __init__(self, n_heads: int = 4, **kw):
        super().__init__(**kw)
        self.net = nn.Sequential(nn.Flatten(1, 2), nn.Linear(28, 16), _Block(n_heads), _LastRow(), nn.Linear(16, 10))
        self.tp_plan = {"net.2.attn.[qkv]": "column", "net.2.attn.o": "row", "net.2.fc1": "column",
                        "net.2.fc2": "row"}


class _LastRow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, -1]


@pytest.mark.parametrize("strategy, n_heads", [("tp2", 4), ("shm_ddp", 5)])
def test_a_head_count_stored_at_construction_gets_a_note_on_what_the_rank_holds(strategy, n_heads):
    """torch says only "shape '[4, 28, 4, 4]' is invalid for input of size 896": the note names the module, its
    column layers' widths on the rank and the fix. Under shm_ddp (no layer split) the same error is the user's own
    (5 heads of 4 in 16 features) and gets no note."""
    with pytest.raises(RuntimeError, match=r"shape '\[4, 28, (4|5), 4\]' is invalid for input of size") as info:
        trainer(strategy=tp(2) if strategy == "tp2" else SHMDDPStrategy(start_method="fork"), devices=2,
                max_steps=1).fit(_StoredHeadsClassifier(n_heads), loader(mnist_like(8), 4))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    said = ("'net.2.attn' (_StoredHeads) holds column layers split by tensor parallelism; this rank computes part of "
            "their outputs (q 8 of 16, k 8 of 16, v 8 of 16 features)")
    assert (said in notes) == (strategy == "tp2"), notes
    assert ("view(B, T, -1, self.head_dim)" in notes) == (strategy == "tp2"), notes


class _NanoGPTAttention(nn.Module):
    """nanoGPT's: q, k and v from one Linear, cut at the width stored at construction."""

    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.n_embd, self.n_head = n_embd, 4
        self.c_attn, self.c_proj = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(B, T, C))


class _NanoGPTClassifier(MNISTClassifier):
    tp_plan = {"net.2.c_attn": {"style": "column", "blocks": 3}, "net.2.c_proj": "row"}

    def __init__(self, n_embd: int = 16, **kw):
        super().__init__(**kw)
        self.net = nn.Sequential(nn.Flatten(1, 2), nn.Linear(28, 16), _NanoGPTAttention(n_embd), _LastRow(),
                                 nn.Linear(16, 10))


@pytest.mark.parametrize("strategy, n_embd, error, match", [
    ("tp2", 16, ValueError, r"not enough values to unpack \(expected 3, got 2\)"),
    ("shm_ddp", 12, ValueError, r"too many values to unpack \(expected 3"),
    ("tp2", 0, RuntimeError, "split_size can only be 0 if dimension size is 0")])
def test_a_fused_projection_cut_at_a_stored_width_gets_a_note_on_what_the_rank_holds(strategy, n_embd, error, match):
    """nanoGPT's ``self.c_attn(x).split(self.n_embd, dim=2)`` on a rank holding half of q, k and v gives two pieces:
    Python says only "not enough values to unpack (expected 3, got 2)". The note names the module, the rank's share
    of each part and the fix. Under shm_ddp the same kind of error (a wrong n_embd: four pieces) is the user's own,
    and so is another error in the same module under tp: no note."""
    with pytest.raises(error, match=match) as info:
        trainer(strategy=tp(2) if strategy == "tp2" else SHMDDPStrategy(start_method="fork"), devices=2,
                max_steps=1).fit(_NanoGPTClassifier(n_embd), loader(mnist_like(8), 4))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    said = ("'net.2' (_NanoGPTAttention) holds column layers split by tensor parallelism; this rank computes part of "
            "their outputs (c_attn 3 x 8 of 3 x 16 features). A forward that cuts a fused projection's output at a "
            "width fixed at construction")
    assert (said in notes) == (n_embd == 16), notes
    assert (".chunk(3, dim=2)" in notes) == (n_embd == 16), notes


class _StoredRepeatAttention(nn.Module):
    """Hugging Face's grouped-query attention: k and v repeated by a count stored at construction."""

    def __init__(self, kv: int) -> None:
        super().__init__()
        self.head_dim, self.num_key_value_groups = 4, 4 // kv
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(16, 16), nn.Linear(16, 4 * kv), nn.Linear(16, 4 * kv)
        self.o_proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, 4).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        k, v = (t.repeat_interleave(self.num_key_value_groups, dim=1) for t in (k, v))
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class _OneAttention(MNISTClassifier):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = nn.Sequential(nn.Flatten(1, 2), nn.Linear(28, 16), nn.Identity(), _LastRow(), nn.Linear(16, 10))


def _one_attention(attention: nn.Module, tp_plan: dict) -> MNISTClassifier:
    """The image's rows as tokens through ``attention`` (16 features), planned ``tp_plan``."""
    model = _OneAttention()
    model.net[2], model.tp_plan = attention, tp_plan
    return model


@pytest.mark.parametrize("strategy, kv", [("tp2", 1), ("tp2", 2), ("shm_ddp", 1)])
def test_a_stored_kv_repeat_with_fewer_kv_heads_than_ranks_gets_a_note_on_the_heads_the_rank_holds(strategy, kv):
    """Multi-query attention at tp2: each rank computes the one kv head and 2 of the 4 q heads; Hugging Face's
    ``repeat_kv(k, self.num_key_value_groups)`` makes 4 kv heads of it, and torch says only that the sizes 2 and 4
    must match. The note names the module, the rank's heads and the fix. A model repeating by a wrong count (the
    user's own error: 8 kv heads against 4 q heads under shm_ddp, 4 against 2 under tp2 with 2 kv heads, one on each
    rank) gets none."""
    model = _one_attention(_StoredRepeatAttention(kv), {"net.2.[qkv]_proj": "column", "net.2.o_proj": "row"})
    own = strategy == "shm_ddp" or kv == 2
    if own:
        model.net[2].num_key_value_groups *= 2
    with pytest.raises(RuntimeError, match=r"size of tensor a \(\d\) must match the size of tensor b \(\d\)") as info:
        trainer(strategy=tp(2) if strategy == "tp2" else SHMDDPStrategy(start_method="fork"), devices=2,
                max_steps=1).fit(model, loader(mnist_like(8), 4))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    said = ("'net.2' (_StoredRepeatAttention) is grouped-query attention with fewer kv heads than tp ranks: this rank "
            "computes one kv head (k_proj, v_proj), which other ranks compute too, and some of its group's q heads "
            "(features on this rank: q_proj 8 of 16, k_proj 4 of 4, v_proj 4 of 4). A forward that repeats k and v "
            "by a count fixed at construction")
    assert (said in notes) != own, notes
    assert ("repeat by q.shape[1] // k.shape[1], or let scaled_dot_product_attention pair the heads (enable_gqa=True)"
            in notes) != own, notes


class _SinksAttention(nn.Module):
    """4 heads of 4 with gpt-oss's attention sinks (a logit per head, joined to the scores) or ALiBi's slopes."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.head_dim, self.kind = 4, kind
        self.q, self.k, self.v, self.o = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.register_buffer("per_head", torch.linspace(0.1, 1.0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        s = q @ k.transpose(-1, -2)
        if self.kind == "sinks":
            s = torch.cat([s, self.per_head.reshape(1, -1, 1, 1).expand(B, -1, T, -1)], -1)[..., :-1]
        else:
            s = s - self.per_head[:, None, None]
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1))


@pytest.mark.parametrize("kind, match", [("sinks", "Sizes of tensors must match except in dimension 3"),
                                         ("alibi", r"The size of tensor a \(2\) must match the size of tensor b "
                                                   r"\(4\)")])
def test_a_tensor_with_an_entry_per_head_left_out_of_the_plan_gets_a_note_naming_it_and_per_head(kind, match):
    """Left whole, the sinks (or slopes) meet the rank's 2 heads with all 4 entries; torch says only that sizes
    differ. The note names the tensor and the style that cuts it."""
    with pytest.raises(RuntimeError, match=match) as info:
        model = _one_attention(_SinksAttention(kind), {"net.2.[qkv]": "column", "net.2.o": "row"})
        trainer(strategy=tp(2), devices=2, max_steps=1).fit(model, loader(mnist_like(8), 4))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert ("'net.2' (_SinksAttention) holds column layers split by tensor parallelism (features on this rank: q 8 of "
            "16, k 8 of 16, v 8 of 16), and holds 'net.2.per_head' (shape [4]) with as many entries as a column "
            "layer's heads, whole on every rank") in notes, notes
    assert "Plan it 'per_head'" in notes, notes


class _PortedFromModelParallel(MNISTClassifier):
    """Lightning's ModelParallelStrategy recipe: the module parallelizes itself with the mesh it is given."""

    def configure_model(self):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp_mesh = self.device_mesh["tensor_parallel"]
        parallelize_module(self.net, tp_mesh, {"1": ColwiseParallel(), "4": RowwiseParallel()})


def test_a_module_parallelizing_itself_with_lightnings_device_mesh_is_told_what_takes_its_place():
    """Its configure_model failed with Python's "'NoneType' object is not subscriptable" alone."""
    with pytest.raises(TypeError, match="'NoneType' object is not subscriptable") as info:
        trainer(strategy=tp(2), devices=2, max_steps=1).fit(_PortedFromModelParallel(), loader(mnist_like(8), 4))
    notes = "\n".join(info.value.__notes__)
    assert "configure_model reads self.device_mesh, which Lightning's ModelParallelStrategy gives" in notes, notes
    assert "SHMTensorParallel(plan=...) or as the module's tp_plan attribute" in notes, notes


@pytest.mark.parametrize("style, said", [
    ("SequenceParallel()", r"SequenceParallel\(.*\) has no counterpart here: ColwiseParallel\(\) is 'column'"),
    ("RowwiseParallel(output_layouts=Shard(1))", r"RowwiseParallel\(.*Shard\(dim=1\).*\) has no counterpart"),
    ("ColwiseParallel(input_layouts=Shard(1))", r"ColwiseParallel\(.*Shard\(dim=1\).*\) has no counterpart"),
    ("ColwiseParallel(use_local_output=False)", r"ColwiseParallel\(.*\) has no counterpart.*use_local_output=True"),
])
def test_torchs_parallel_styles_without_a_counterpart_fail_before_launch(style, said):
    from torch.distributed.tensor import Shard  # noqa: F401 - the styles' arguments
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel  # noqa: F401

    plan = {"net.1": eval(style), "net.4": "row"}
    with pytest.raises(ValueError, match=r"plan entry 'net.1': " + said):
        trainer(strategy=tp(2, plan=plan), devices=2, max_epochs=1).fit(MNISTClassifier(), loader(mnist_like(8), 4))


def _param_bytes(world):
    pl.seed_everything(0)
    m = MNISTClassifier()
    tpm = TensorParallelState(m, world.group(), check_plan(m, plan_for(m, None, world.size), world.size))
    return tpm.parameter_bytes(), {n: tuple(p.shape) for n, p in m.named_parameters()}


def test_each_rank_holds_its_slices():
    (b0, shapes), (b1, _) = launch(_param_bytes, 2, start_method="fork")
    assert shapes["net.1.weight"] == (128, 784) and shapes["net.1.bias"] == (128,)  # the gathered column layer
    assert shapes["net.2.weight"] == (256,) and shapes["net.4.weight"] == (64, 256)  # replicated
    assert shapes["net.7.weight"] == (10, 64)
    full = 218_698 * 4
    assert b0 == b1 and b0 < 0.55 * full  # about half of the big matrices per rank


def test_distributed_inference_matches_one_process():
    pl.seed_everything(0)
    model = MNISTClassifier()
    ds = mnist_like(43)
    single = trainer(devices=1).predict(model, DataLoader(ds, batch_size=10))
    ours = trainer(strategy=tp(2), devices=4).predict(model, DataLoader(ds, batch_size=10))
    assert torch.equal(torch.cat(ours), torch.cat(single))
    even = mnist_like(44)  # validation pads a DistributedSampler to a multiple of dp: use a multiple
    v1 = trainer(devices=1).validate(model, DataLoader(even, batch_size=10), verbose=False)[0]
    v2 = trainer(strategy=tp(2), devices=4).validate(model, DataLoader(even, batch_size=10), verbose=False)[0]
    assert v2["val_acc"] == pytest.approx(v1["val_acc"]) and v2["val_loss"] == pytest.approx(v1["val_loss"], abs=1e-5)


def test_checkpoint_is_plain_and_resumable(tmp_path):
    ds = mnist_like(GLOBAL_BATCH * 4)
    straight, _ = fit_adam64("shm_ddp_fork", 2, 3, GLOBAL_BATCH // 2, ds)
    _, path = fit_adam64(tp(2), 4, 1, GLOBAL_BATCH // 2, ds, ckpt_dir=tmp_path)
    _, plain, adam = check_plain_checkpoint(path)
    assert adam.state[plain.net[4].weight]["exp_avg"].shape == (64, 256)
    for strategy, devices, batch in ((tp(2), 2, GLOBAL_BATCH), ("shm_ddp_fork", 2, GLOBAL_BATCH // 2)):
        resumed, _ = fit_adam64(strategy, devices, 3, batch, ds, ckpt_path=path)
        torch.testing.assert_close(resumed, straight, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- errors, before any worker starts
class Seq(pl.LightningModule):
    def __init__(self, *layers):
        super().__init__()
        self.net = nn.Sequential(*layers)


class _TiedHead(nn.Module):
    """An embedding whose table is also the output layer's weight, as language models tie them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight


class _FusedQKV(nn.Module):
    """q, k and v projected by one Linear (nanoGPT's c_attn, timm's qkv), the heads' output by another."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)


class _Sinks(nn.Module):
    """Attention projections of 4 heads of 2 (k and v of ``kv``), a per-head parameter and a per-head table."""

    def __init__(self, kv: int = 4) -> None:
        super().__init__()
        self.head_dim = 2
        self.q, self.k, self.v, self.o = nn.Linear(4, 8), nn.Linear(4, 2 * kv), nn.Linear(4, 2 * kv), nn.Linear(8, 4)
        self.sinks, self.kv_scale, self.table = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.ones(kv)), \
            nn.Embedding(3, 4)


class _GroupNormBlock(nn.Module):
    """conv1 -> GroupNorm(2, 8) -> conv2 in its own forward (the plan must say where the norm runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.gn, self.conv2 = nn.Conv2d(1, 8, 1), nn.GroupNorm(2, 8), nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.gn(self.conv1(x)))


@pytest.mark.parametrize(
    "layers, plan, match",
    [
        ((nn.Linear(4, 8), nn.ReLU()), {"net.0": "column"}, "column layer 'net.0' is not followed by a row"),
        ((nn.Linear(4, 8), nn.Linear(8, 2)), {"net.0": "column"}, "Linear 'net.1' sits between column layer 'net.0'"),
        ((nn.Linear(4, 8), nn.Linear(8, 2)), {"net.1": "row"}, "row layer 'net.1' has no column layer before it"),
        ((nn.Linear(4, 8), nn.Softmax(-1), nn.Linear(8, 2)), {"net.0": "column", "net.2": "row"},
         r"'net.1' \(Softmax\) cannot run on features split by column layer 'net.0'"),
        ((nn.ReLU(), nn.Linear(8, 2)), {"net.0": "column"},
         "'net.0' is a ReLU; only nn.Linear, nn.Conv1d / Conv2d / Conv3d and nn.ConvTranspose1d / 2d / 3d can be "
         "'column'"),
        ((nn.Linear(4, 3), nn.Linear(3, 2)), None, "column layer 'net.0' has 3 output features, fewer than tp=4"),
        ((nn.Linear(4, 8), nn.Linear(8, 2)), {"net.9": "row"}, r"plan pattern 'net.9' matches no module of Seq"),
        ((nn.Linear(4, 8), nn.Linear(8, 2)), {"net.0": "diagonal"}, "must be one of"),
        ((nn.Conv2d(1, 8, 1), nn.GroupNorm(2, 8), nn.Conv2d(8, 2, 1)), {"net.0": "column", "net.2": "row"},
         r"GroupNorm 'net.1' \(2 groups of 4 channels\) sits between column layer 'net.0' and its row layer, which "
         r"split the channels as \[2, 2, 2, 2\]: a group would span two ranks"),
        ((nn.Conv2d(1, 8, 1, groups=1), nn.Conv2d(8, 8, 3, groups=8), nn.Conv2d(8, 2, 1)),
         {"net.0": "column", "net.1": "row"}, r"'net.1' \(row\) is a Conv2d with groups=8: a column or row layer"),
        ((nn.Conv2d(1, 8, 1), nn.Conv2d(8, 8, 3, groups=2), nn.Conv2d(8, 2, 1)), {"net.0": "column", "net.2": "row"},
         r"grouped Conv2d 'net.1' \(8 -> 8 channels, groups=2\) sits between column layer 'net.0' and its row layer, "
         r"which split the channels as \[2, 2, 2, 2\]"),
        ((nn.Linear(4, 8), nn.LayerNorm(8)), {"net.1": "between"},
         r"'net.1' \(LayerNorm, 8 features\) is planned 'between'.*must hold exactly one column layer with 8 output "
         r"features, found none"),
        ((nn.Linear(4, 8), nn.ReLU()), {"net.1": "between"}, r"'net.1' \(ReLU\) is planned 'between', which only"),
        ((_GroupNormBlock(),), {"net.0.conv1": "column", "net.0.gn": "between", "net.0.conv2": "row"},
         r"GroupNorm 'net.0.gn' \(2 groups of 4 channels\) sits between column layer 'net.0.conv1' and its row layer, "
         r"which split the channels as \[2, 2, 2, 2\]"),
        ((nn.Conv2d(1, 8, 1), nn.Flatten()), {"net.0": "column_gathered"},
         "'net.0' is a Conv2d; only nn.Linear can be 'column_gathered'"),
        ((nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)),
         {"net.0": "column", "net.1": "column_gathered", "net.2": "row"},
         "'column_gathered' layer 'net.1' sits between column layer 'net.0' and its row layer"),
        ((nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)),
         {"net.0": "column", "net.1": "row_split_input", "net.2": "row"},
         "'row_split_input' layer 'net.1' sits between column layer 'net.0' and its row layer"),
        ((nn.Conv2d(1, 8, 1), nn.Flatten()), {"net.0": "row_split_input"},
         r"'net.0' is a Conv2d; only nn.Linear \(and an nn.Embedding, as 'row'\) can be 'row_split_input'"),
        ((nn.Embedding(10, 8), nn.Linear(8, 2)), {"net.0": "column"},
         r"'net.0' is an nn.Embedding planned 'column': an embedding splits its vocabulary.*plan it 'row'"),
        ((nn.Embedding(10, 8, max_norm=1.0, scale_grad_by_freq=True), nn.Linear(8, 2)), {"net.0": "row"},
         r"'net.0' \(row\) is an nn.Embedding with max_norm=1.0 \(renormalises the rows it looks up in place\), "
         r"scale_grad_by_freq=True \(scales by how often each id occurs in the batch\): a rank looks up only"),
        ((nn.Embedding(3, 8), nn.Linear(8, 2)), {"net.0": "row"},
         r"row layer 'net.0' has 3 embeddings, fewer than tp=4"),
        ((nn.Linear(4, 8), nn.Embedding(10, 8), nn.Linear(8, 2)), {"net.0": "column", "net.1": "row", "net.2": "row"},
         r"embedding 'net.1' sits between column layer 'net.0' and its row layer"),
        ((nn.ConvTranspose2d(1, 8, 1), nn.Conv2d(8, 2, 1)), {"net.0": "column", "net.1": "row"},
         r"row layer 'net.1' \(Conv2d\) cannot follow column layer 'net.0' \(ConvTranspose2d\)"),
        ((nn.ConvTranspose2d(1, 8, 1), nn.ConvTranspose2d(8, 8, 1, groups=2), nn.ConvTranspose2d(8, 2, 1)),
         {"net.0": "column", "net.2": "row"}, "ConvTranspose2d 'net.1' sits between column layer 'net.0' and its row"),
        ((nn.ConvTranspose2d(1, 8, 1), nn.ConvTranspose2d(8, 2, 1, groups=2)), {"net.0": "column", "net.1": "row"},
         r"'net.1' \(row\) is a ConvTranspose2d with groups=2: a column or row layer splits a plain convolution's "
         r"channels. Leave it replicated$"),
        ((nn.Linear(4, 8),), {"net.0": "heads"}, r"'net.0' is a Linear; only an nn.MultiheadAttention can be 'heads'"),
        ((nn.MultiheadAttention(8, 4),), {"net.0": "column"},
         r"'net.0' is an nn.MultiheadAttention planned 'column': it splits by its heads -- plan it 'heads'"),
        ((nn.MultiheadAttention(8, 4, kdim=6, vdim=6),), {"net.0": "heads"},
         r"'net.0' \(heads\) is an nn.MultiheadAttention with kdim=6 / vdim=6 \(separate q, k and v weights\)"),
        ((nn.MultiheadAttention(8, 2),), {"net.0": "heads"}, r"'net.0' \(heads\) has 2 heads, fewer than tp=4"),
        ((_TiedHead(),), {"net.0.embed": "row"},
         r"'net.0.embed' \(row\) holds 'net.0.embed.weight', which is also 'net.0.head.weight'"),
        ((_TiedHead(),), {"net.0.embed": "row", "net.0.head": "row"},  # the head's row cuts the other dimension
         r"'net.0.embed' \(row\) holds 'net.0.embed.weight', which is also 'net.0.head.weight'.*or plan the other "
         r"holder to cut the tensor alike"),
        ((_FusedQKV(),), {"net.0.qkv": "column", "net.0.proj": "row"},
         r"column layer 'net.0.qkv' gives 24 output features, 3 x the 8 that row layer 'net.0.proj' beside it takes. "
         r"If its module's forward cuts the whole output into 3 parts side by side.*plan it \{'style': 'column', "
         r"'blocks': 3\}.*If it views the heads first, each head's parts together \(view\(B, T, -1, 3 \* head_dim\), "
         r"then cut -- GPT-NeoX / Pythia, BLOOM\).*plan it \{'style': 'column', 'blocks': 1, 'head_dim': 3 \* "
         r"head_dim\} \(blocks 3 would mix the heads' parts.*If it views kv groups first, each group's q heads then "
         r"its k and v \(view\(B, T, -1, q heads per kv head \+ 2, head_dim\) -- Falcon\).*plan it \{'style': "
         r"'column', 'blocks': 1, 'head_dim': \(q heads per kv head \+ 2\) \* head_dim\} and the row layer "
         r"\{'style': 'row', 'head_dim': q heads per kv head \* head_dim\}"),
        ((_FusedQKV(),), {"net.0.qkv": {"style": "column", "blocks": 5}, "net.0.proj": "row"},
         r"column layer 'net.0.qkv' has 24 output features, not 5 equal blocks"),
        ((_FusedQKV(),), {"net.0.qkv": {"style": "column", "blocks": 3, "head_dim": 4}, "net.0.proj": "row"},
         r"column layer 'net.0.qkv' has 2 heads of 4 \(8 output features in each of 3 blocks\), fewer than tp=4"),
        ((nn.Linear(4, 24), nn.Linear(24, 2)), {"net.0": {"style": "column", "blocks": 3}, "net.1": "row"},
         r"column layer 'net.0' is planned with blocks=3, for an output the module's forward cuts into parts; in an "
         r"nn.Sequential the next layer takes it whole"),
        ((nn.Conv2d(1, 24, 1), nn.Conv2d(24, 2, 1)), {"net.0": {"style": "column", "blocks": 3}, "net.1": "row"},
         r"'net.0' is a Conv2d planned with blocks=3; only an nn.Linear \(a fused projection\) takes blocks"),
        ((nn.Linear(4, 8), nn.ReLU()), {"net.1": "on_heads"},
         r"'net.1' \(ReLU\) is planned 'on_heads', which sums its parameters' gradients over the tp ranks, but it "
         r"holds no trainable parameter of its own"),
        ((nn.Linear(4, 8),), {"net.0": {"style": "column_gathered", "blocks": 2}},
         r"plan entry 'net.0': blocks apply to a 'column' layer .*got style 'column_gathered'"),
        ((_Sinks(),), {"net.0.sinks": "per_head"}, r"'net.0.sinks' \(per_head\) has 4 entries along dim 0 \(shape "
         r"\[4\]\), but no column layer beside it has 4 heads to split them as: none is planned"),
        ((_Sinks(),), {"net.0.[qkv]": "column", "net.0.o": "row", "net.0.table.weight": "per_head"},
         r"'net.0.table.weight' \(per_head\) has 3 entries along dim 0 \(shape \[3, 4\]\), but no column layer "
         r"beside it has 3 heads to split them as: 'net.0.q' 4 heads \(8 features\)"),
        ((_Sinks(),), {"net.0.[qkv]": "column", "net.0.o": "row", "net.0.table.weight": {"style": "per_head",
                                                                                         "dim": 2}},
         r"'net.0.table.weight' \(per_head\) has shape \[3, 4\]: no dimension 2"),
        ((_Sinks(),), {"net.0.table": "per_head"}, r"plan pattern 'net.0.table' matches no parameter or buffer of Seq "
         r".*it names the module\(s\) \['net.0.table'\]: 'per_head' names a tensor, e.g. 'net.0.table.weight'"),
        ((_Sinks(),), {"net.0.sinks": "column"}, r"plan pattern 'net.0.sinks' matches no module of Seq .*it names the "
         r"tensor\(s\) \['net.0.sinks'\], which only 'per_head' takes"),
        ((_Sinks(),), {"net.0.q": {"style": "column", "dim": 1}},
         r"plan entry 'net.0.q': dim is the dimension of heads of a 'per_head' tensor \(an int\), got 1 with style "
         r"'column'"),
        ((_Sinks(kv=2),), {"net.0.[qkv]": "column", "net.0.o": "row", "net.0.kv_scale": "per_head"},
         r"'net.0.kv_scale' \(per_head\) has 2 entries along dim 0, one per kv head of 'net.0.k', which several tp "
         r"ranks compute alike"),
    ],
)
def test_bad_plans_fail_before_launch(layers, plan, match):
    with pytest.raises(ValueError, match=match):
        trainer(strategy=tp(4, plan=plan), devices=4, max_epochs=1).fit(Seq(*layers), DataLoader(torch.randn(8, 4)))


class _FlatBlock(nn.Module):
    """Attention and feed-forward projections side by side in one block, as minimal GPTs write them."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)


def test_a_column_layer_matching_a_row_layer_beside_it_or_saying_its_blocks_needs_none():
    """The fused-projection check asks for blocks only where no row layer beside a column one takes its width: fc1's
    32 features are 4 x o's 8, but fc2 takes 32. ``blocks: 1`` says a wider output is one part."""
    flat = Seq(_FlatBlock())
    plan = {"net.0.[qkv]": "column", "net.0.o": "row", "net.0.fc1": "column", "net.0.fc2": "row"}
    splits = check_plan(flat, resolve_plan(flat, plan), 2)
    assert (splits["net.0.fc1"].sizes, splits["net.0.fc1"].blocks) == ((16, 16), 1)
    fused = Seq(_FusedQKV())
    plan = {"net.0.qkv": {"style": "column", "blocks": 1}, "net.0.proj": "row"}
    assert check_plan(fused, resolve_plan(fused, plan), 2)["net.0.qkv"].sizes == (12, 12)
    plan["net.0.qkv"] = {"style": "column", "blocks": 3}
    assert check_plan(fused, resolve_plan(fused, plan), 2)["net.0.qkv"] == LayerSplit("column", (4, 4), 3)


class _GQA(nn.Module):
    """Grouped-query attention's projections: ``heads`` q heads and ``kv`` k / v heads of 2 features."""

    def __init__(self, heads: int, kv: int) -> None:
        super().__init__()
        self.head_dim = 2
        self.q, self.k, self.v = nn.Linear(8, 2 * heads), nn.Linear(8, 2 * kv), nn.Linear(8, 2 * kv)
        self.o = nn.Linear(2 * heads, 8)


@pytest.mark.parametrize("heads, kv, tp, q, k", [
    (12, 3, 2, (16, 8), (4, 2)),  # kv 2 + 1 heads, q 4 x as many: 8 + 4
    (12, 4, 3, (12, 6, 6), (4, 2, 2)),  # kv 2 + 1 + 1, q 6 + 3 + 3
    (8, 2, 2, (8, 8), (2, 2)),  # tp divides the kv heads: the even split, as without groups
    (6, 4, 2, (6, 6), (4, 4)),  # 4 does not divide 6: not grouped-query attention, each split on its own
])
def test_grouped_query_attention_is_split_by_whole_kv_groups(heads, kv, tp, q, k):
    """Each rank's q heads are the ones that attend with the kv heads it holds; o takes q's split."""
    m = Seq(_GQA(heads, kv))
    splits = check_plan(m, resolve_plan(m, {"net.0.[qkv]": "column", "net.0.o": "row"}), tp)
    assert (splits["net.0.q"].sizes, splits["net.0.k"].sizes) == (q, k)
    assert splits["net.0.v"].sizes == k and splits["net.0.o"].sizes == q


@pytest.mark.parametrize("heads, kv, tp, q, starts", [
    (14, 2, 4, (8, 6, 8, 6), (0, 0, 2, 2)),  # Qwen2.5-0.5B's 14 / 2 at tp4: each kv head on 2 ranks, 7 q heads as 4 + 3
    (12, 3, 4, (4, 4, 8, 8), (0, 0, 2, 4)),  # 3 kv heads on 4 ranks: kv head 0 on two of them
    (8, 1, 3, (6, 6, 4), (0, 0, 0)),  # multi-query attention: its one kv head on every rank
])
def test_fewer_kv_heads_than_ranks_each_rank_computes_its_groups_kv_head(heads, kv, tp, q, starts):
    """A kv head serves the ranks holding its group's q heads: they each compute it (its rows of the whole weight)."""
    m = Seq(_GQA(heads, kv))
    splits = check_plan(m, resolve_plan(m, {"net.0.[qkv]": "column", "net.0.o": "row"}), tp)
    assert splits["net.0.q"].sizes == q and splits["net.0.o"].sizes == q
    assert splits["net.0.k"] == splits["net.0.v"] == LayerSplit("kv_heads", (2,) * tp, starts=starts)


class _FlatHeads(_GQA):
    """q, k, v and o of 2 heads beside a feed-forward pair 4 times as wide, in one module: not grouped-query."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)


def test_attention_of_one_head_count_beside_a_wider_feed_forward_is_not_taken_for_grouped_query_attention():
    m = Seq(_FlatHeads())
    plan = {"net.0.[qkv]": "column", "net.0.o": "row", "net.0.fc1": "column", "net.0.fc2": "row"}
    assert check_plan(m, resolve_plan(m, plan), 2)["net.0.fc1"].sizes == (8, 8)
    with pytest.raises(ValueError, match=r"column layer 'net.0.q' has 2 heads of 2 \(4 output features\), fewer than "
                       r"tp=4: every rank needs a whole head"):
        check_plan(m, resolve_plan(m, plan), 4)


def test_fewer_kv_heads_than_ranks_needs_a_q_head_on_each_rank_a_column_layer_and_no_forward_hook():
    m = Seq(_GQA(4, 2))
    with pytest.raises(ValueError, match=r"column layer 'net.0.q' has 4 heads of 2 beside layers with 2 \(kv heads of "
                       r"grouped-query attention\) at tp=8: each kv head is shared by 4 ranks, .* 2 heads per kv head, "
                       r"fewer than the 4 ranks sharing one. Use a tp size of at most 4"):
        check_plan(m, resolve_plan(m, {"net.0.[qkv]": "column", "net.0.o": "row"}), 8)
    plan = {"net.0.[qv]": "column", "net.0.k": "column_gathered", "net.0.o": "row"}
    with pytest.raises(ValueError, match=r"\['net.0.k'\] is 'column_gathered' beside 'column' layer\(s\) \['net.0.q', "
                       r"'net.0.v'\] of grouped-query attention \(4 q heads, 2 kv heads\): a rank's q heads would meet "
                       r"every kv head.*all 'column_gathered' \(o 'row_split_input'\)"):
        check_plan(m, resolve_plan(m, plan), 4)
    gathered = {"net.0.[qkv]": "column_gathered", "net.0.o": "row_split_input"}  # OLMo 2's: whole outputs, even
    assert {n: sp.sizes for n, sp in check_plan(m, resolve_plan(m, gathered), 4).items()} == {
        "net.0.q": (2, 2, 2, 2), "net.0.k": (1, 1, 1, 1), "net.0.v": (1, 1, 1, 1), "net.0.o": (2, 2, 2, 2)}
    m.net[0].k.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match=r"'net.0.k' computes a kv head that several tp ranks compute alike .* "
                       r"and it has forward hooks: they would see this rank's kv head"):
        check_plan(m, resolve_plan(m, {"net.0.[qkv]": "column", "net.0.o": "row"}), 4)


def test_devices_not_divisible_by_tp_size():
    with pytest.raises(ValueError, match=r"devices \(world_size=6\) must be divisible by tp\*pp = 4\*1 = 4"):
        trainer(strategy=tp(4), devices=6)


def test_model_without_sequential():
    class NoSeq(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)

    with pytest.raises(ValueError, match="has no top-level nn.Sequential"):
        trainer(strategy=tp(2), devices=2, max_epochs=1).fit(NoSeq(), DataLoader(torch.randn(8, 2)))


def test_a_compiled_sequential_is_named_not_missed():
    model = MNISTClassifier()
    model.net = torch.compile(model.net)
    with pytest.raises(ValueError, match="'net' is a torch.compile'd nn.Sequential"):
        trainer(strategy=tp(2), devices=2, max_epochs=1).fit(model, loader(mnist_like(16), 8))


def test_a_plan_that_splits_nothing_is_refused():
    """Every rank of the tp group would compute the whole model on the same batch (seen: a Sequential whose
    Linear layers were compiled one by one got an empty derived plan)."""
    model = MNISTClassifier()
    for i, child in enumerate(model.net):
        if isinstance(child, nn.Linear):
            model.net[i] = torch.compile(child)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 but the plan splits no layer of MNISTClassifier.*"
                                         r"\['net.1', 'net.4', 'net.7'\] are torch.compile'd"):
        trainer(strategy=tp(2), devices=2, max_epochs=1).fit(model, loader(mnist_like(16), 8))
    one = MNISTClassifier()
    one.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))  # one Linear: no pair, nothing gathered
    with pytest.raises(ValueError, match="splits no layer of MNISTClassifier: the plan derived for its nn.Sequential"):
        trainer(strategy=tp(2), devices=2, max_epochs=1).fit(one, loader(mnist_like(16), 8))
    with pytest.raises(ValueError, match=r"the plan given \(plan=\) splits no layer"):
        trainer(strategy=tp(2, plan={}), devices=2, max_epochs=1).fit(MNISTClassifier(), loader(mnist_like(16), 8))
    own = MNISTClassifier()
    own.tp_plan = {}
    with pytest.raises(ValueError, match=r"the plan given \(MNISTClassifier.tp_plan\) splits no layer"):
        trainer(strategy=tp(2), devices=2, max_epochs=1).fit(own, loader(mnist_like(16), 8))


# ---------------------------------------------------------------------- plans by qualified name on nested models
def test_transformer_plan_expands_over_every_block():
    from lightning_shm.parallel.tp import check_plan, resolve_plan

    model = MNISTClassifier(arch="transformer", dim=16, depth=3, heads=4)
    plan = resolve_plan(model, model.tp_plan)
    assert sorted(plan) == sorted(f"net.{b}.{m}" for b in (1, 2, 3)
                                  for m in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.fc1", "mlp.fc2"))
    splits = check_plan(model, plan, 2)
    assert splits["net.2.attn.q"].sizes == (8, 8) and splits["net.2.attn.o"].role == "row"
    assert splits["net.1.mlp.fc1"].sizes == (32, 32)


@pytest.mark.parametrize("plan, tp, model_kw, match", [
    ({"net.*.attn.qq": "column"}, 2, {}, r"plan pattern 'net.\*.attn.qq' matches no module of MNISTClassifier"),
    ({"net.0": "column"}, 2, {},
     r"'net.0' is a RowEmbedding; only nn.Linear, nn.Conv1d / Conv2d / Conv3d and nn.ConvTranspose1d / 2d / 3d can "
     r"be 'column'"),
    ({"net.*.attn.q": "column"}, 4, dict(heads=2),
     r"column layer 'net.1.attn.q' has 2 heads of 8 \(16 output features\), fewer than tp=4"),
    ({"net.*.attn.q": {"style": "column", "head_dim": 5}}, 2, {},
     r"column layer 'net.1.attn.q' has 16 output features, not a multiple of head_dim=5"),
    ({"net.*.attn.q": {"style": "diagonal"}}, 2, {}, r"plan entry 'net.\*.attn.q': a plan style must be one of"),
    ({"net.*.mlp.fc1": "column"}, 2, {},
     r"Linear 'net.1.mlp.fc2' sits between column layer 'net.1.mlp.fc1' and its row layer"),
], ids=["no-match", "wrong-type", "fewer-heads-than-tp", "not-whole-heads", "bad-style", "unpaired-in-sequential"])
def test_bad_plans_on_nested_models_fail_before_any_worker_starts(plan, tp, model_kw, match):
    model = MNISTClassifier(arch="transformer", dim=16, depth=1, **{"heads": 4, **model_kw})
    with pytest.raises(ValueError, match=match):
        trainer(strategy=tp_strategy(tp, plan=plan), devices=tp, max_epochs=1).fit(model, loader(mnist_like(8), 4))


def test_conv_channels_fewer_than_tp_fail_before_any_worker_starts():
    model = MNISTClassifier(arch="cnn", channels=(2, 4), cnn_hidden=8)
    with pytest.raises(ValueError, match=r"column layer 'net.0' has 2 output channels, fewer than tp=4"):
        trainer(strategy=tp_strategy(4), devices=4, max_epochs=1).fit(model, loader(mnist_like(8), 4))


def tp_strategy(size, **kw):
    return SHMTensorParallel(start_method="fork", tensor_parallel_size=size, **kw)


class _DropoutBetween(MNISTClassifier):
    """Hidden 31 (16 + 15 per rank) with a Dropout after each ReLU: one on split features, one replicated."""

    def __init__(self, **kw):
        super().__init__(hidden_sizes=[31, 31], **kw)
        self.net = nn.Sequential(*[x for m in self.net for x in ([m, nn.Dropout(0.3)] if isinstance(m, nn.ReLU)
                                                                  else [m])])


class _SaveRankParameters(pl.Callback):
    def __init__(self, folder):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        torch.save(dict(pl_module.named_parameters()), self.folder / f"{trainer.global_rank}.pt")


def test_dropout_between_split_layers_keeps_the_ranks_replicated_parameters_equal(tmp_path):
    """Dropout on unevenly split features once advanced the ranks' random streams differently: every
    later replicated mask, and with it the replicated parameters, differed between tp ranks."""
    train_mnist(tp(2, plan={"net.1": "column", "net.5": "row"}), 2, "sgd", batch=GLOBAL_BATCH,
                model_cls=_DropoutBetween, callbacks=[_SaveRankParameters(tmp_path)])
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in range(2))
    assert r0["net.1.weight"].shape == (16, 784) and r1["net.1.weight"].shape == (15, 784)
    replicated = ["net.5.bias", "net.6.weight", "net.6.bias", "net.9.weight", "net.9.bias"]
    for name in replicated:
        assert torch.equal(r0[name], r1[name]), name


class GradientPenalty(MNISTClassifier):
    """A penalty on the gradient of the logits with respect to the input (WGAN-GP, input-gradient regularisation):
    a double backward through the tensor-parallel layers' communication."""

    def training_step(self, batch, batch_idx):
        x = batch[0].clone().requires_grad_(True)
        out = self(x)
        g, = torch.autograd.grad(out.logsumexp(-1).sum(), x, create_graph=True)
        return nn.functional.cross_entropy(out, batch[1]) + 0.5 * g.pow(2).sum(dim=(1, 2, 3)).mean()


@pytest.mark.parametrize("arch, dp", [("mlp", 1), ("mlp", 2), ("cnn", 1)])
def test_a_gradient_penalty_on_the_input_equals_one_process(arch, dp):
    """It failed in the all-reduce of f's backward (out= under create_graph); with a plain identity for g's and a
    slice for the gathered column's backward it trained 0.057 off one process (the MLP's gathered column layer),
    0.059 (the CNN's column and row convolutions)."""
    model_cls = partial(GradientPenalty, arch=arch, channels=(8, 16), cnn_hidden=32)
    strategy = tp(2) if dp == 1 else SHMModelParallel(start_method="fork", data_parallel_size=2, tensor_parallel_size=2)
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, model_cls=model_cls)
    got = train_mnist(strategy, 2 * dp, "adam", batch=GLOBAL_BATCH // dp, model_cls=model_cls)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-7)


@pytest.mark.parametrize("devices, size", [(2, 2), (4, 2)], ids=["tp2", "dp2xtp2"])
def test_in_batch_negatives_gathered_with_sync_grads_train_as_one_process(devices, size):
    """``self.all_gather`` gathers over the data-parallel ranks, as ``sync_dist`` and metrics combine: until
    2026-12-03 it gathered over every rank, so each tp member contributed the replica's rows again and every
    positive met its own copy as a negative (47 negatives for one process's 23; 0.040 off it after 2 Adam steps)."""
    one, ref = fit_seeded(InBatchNegatives, "auto", 1, GLOBAL_BATCH, ref=True)
    ours, got = fit_seeded(InBatchNegatives, tp(size), devices, GLOBAL_BATCH // (devices // size))
    assert float(ours.callback_metrics["negatives"]) == float(one.callback_metrics["negatives"]) == GLOBAL_BATCH - 1
    torch.testing.assert_close(flat_params(got), flat_params(ref), rtol=0, atol=1e-10)



class _RunsTheModelOnRankZero(pl.Callback):
    """Runs the module on a sample at each epoch's end on rank 0 alone (an image-logging callback)."""

    @pl.utilities.rank_zero_only
    def on_train_epoch_end(self, trainer, pl_module):
        with torch.no_grad():
            pl_module(torch.zeros(2, 1, 28, 28, dtype=pl_module.dtype))


def test_a_model_run_on_rank_zero_alone_is_stopped_naming_the_line_that_ran_it():
    """Its tp layers' collectives wait for the other member, which meets another collective: the mismatch said where
    rank 0 was in four frames of the tp layer and torch's module call, not which line of the program ran the model.
    Both members meet the mismatch; whichever reaches the main process first is reported (the order varies with the
    machine's load): rank 1's report names rank 0's line in its note, rank 0's in its own traceback."""
    from lightning_shm.runtime import CollectiveMismatchError, DeadlockError

    with pytest.raises((CollectiveMismatchError, DeadlockError)) as raised:
        fit_seeded(MNISTClassifier, tp(2), 2, GLOBAL_BATCH, callbacks=[_RunsTheModelOnRankZero()])
    lines, first = inspect.getsourcelines(_RunsTheModelOnRankZero)
    line = first + next(i for i, text in enumerate(lines) if "pl_module(torch.zeros" in text)
    own_line = f'{__file__}", line {line}, in on_train_epoch_end'
    notes = raised.value.__notes__
    if "raised in lightning_shm worker rank 0" in notes:
        assert own_line in str(raised.value.__cause__), raised.value.__cause__
    else:
        where = next(n for n in notes if n.startswith("rank 0 was here"))
        assert "frames of libraries ..." in where
        assert where.splitlines()[-1].endswith(own_line)


class _ReducingMLP(nn.Module):
    """fc1 (column) -> GELU -> ``op`` -> fc2 (row), in the block's own forward, on [B, 28, 16] tokens."""

    def __init__(self, op) -> None:
        super().__init__()
        self.fc1, self.fc2, self.op = nn.Linear(16, 32), nn.Linear(32, 16), op

    def forward(self, x):
        return x + self.fc2(self.op(nn.functional.gelu(self.fc1(x))))


class _ReducingConv(nn.Module):
    """conv1 (column) -> ReLU -> ``op`` -> conv2 (row) on [B, 1, 28, 28] images."""

    def __init__(self, op) -> None:
        super().__init__()
        self.conv1, self.conv2, self.op = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 1, 3, padding=1), op

    def forward(self, x):
        return self.conv2(self.op(torch.relu(self.conv1(x))))


def _reducing(op, conv: bool = False):
    class Reducing(MNISTClassifier):
        tp_plan = {"net.0.conv1": "column", "net.0.conv2": "row"} if conv else {"net.2.fc1": "column",
                                                                               "net.2.fc2": "row"}

        def __init__(self, **kw):
            super().__init__(**kw)
            self.net = (nn.Sequential(_ReducingConv(op), nn.Flatten(), nn.Linear(784, 10)) if conv
                        else _one_attention(_ReducingMLP(op), {}).net)
    return Reducing


_OVER_SPLIT_FEATURES = {  # op, what the refusal names
    "normalize": (lambda h: nn.functional.normalize(h, dim=-1), "torch.nn.functional.normalize over dim 2"),
    "layer_norm": (lambda h: nn.functional.layer_norm(h, h.shape[-1:]), "torch.nn.functional.layer_norm over dim 2"),
    "softmax": (lambda h: h.softmax(-1), "Tensor.softmax over dim 2"),
    "rms": (lambda h: h * h.pow(2).mean(-1, keepdim=True).rsqrt(), "Tensor.mean over dim 2"),
    "all": (lambda h: h / h.abs().sum(), "Tensor.sum over dim 2"),
    "gram": (lambda h: (h @ h.mT).softmax(-1) @ h, "Tensor.matmul over dim 2"),  # one head over all features
    "einsum": (lambda h: torch.einsum("btf,bsf->bts", h, h).softmax(-1) @ h, "torch.einsum over dim 2"),
}


@pytest.mark.parametrize("op", list(_OVER_SPLIT_FEATURES))
def test_a_reduction_over_split_features_in_a_blocks_forward_is_stopped_naming_it(op):
    """Between fc1 (column) and fc2 (row) a rank holds 16 of the 32 features: a reduction over them -- a norm
    written as a call, a softmax, an RMS scale -- would take each rank's own 16 only. Until 2026-12-08 the model
    trained otherwise than one process without an error (F.normalize or F.layer_norm there: 4.0e-2 off after 2
    float64 Adam steps at tp2, ``/tmp/pm/splitreduce.py``, a local probe)."""
    fn, said = _OVER_SPLIT_FEATURES[op]
    with pytest.raises(ValueError, match=re.escape(
            f"'net.2''s forward runs {said} of the output of column layer 'net.2.fc1', which tensor parallelism "
            "splits [16, 16] along that dim: each rank would reduce over its own features only")):
        train_mnist(tp(2), 2, "sgd", batch=GLOBAL_BATCH, model_cls=_reducing(fn))


def test_a_reduction_over_split_channels_is_stopped_and_pipelined_blocks_are_watched_too():
    """A convolution's features are its channels (dim 1); under tp2 x pp2 the block runs in a stage's chunk."""
    with pytest.raises(ValueError, match=re.escape(
            "'net.0''s forward runs torch.nn.functional.normalize over dim 1 of the output of column layer "
            "'net.0.conv1', which tensor parallelism splits [4, 4] along that dim")):
        train_mnist(tp(2), 2, "sgd", batch=GLOBAL_BATCH,
                    model_cls=_reducing(lambda h: nn.functional.normalize(h, dim=1), conv=True))
    with pytest.raises(ValueError, match=re.escape("'net.2''s forward runs Tensor.softmax over dim 2")):
        train_mnist(SHMModelParallel(start_method="fork", tensor_parallel_size=2, pipeline_parallel_size=2,
                                     microbatches=2, split_points=[2]), 4, "sgd", batch=GLOBAL_BATCH,
                    model_cls=_reducing(_OVER_SPLIT_FEATURES["softmax"][0]))


@pytest.mark.parametrize("op", [
    lambda h: h - h.mean(1, keepdim=True),  # over the tokens
    lambda h: h * torch.sigmoid(h),  # elementwise
    lambda h: h.view(*h.shape[:-1], -1, 4).softmax(-1).flatten(-2),  # within heads of 4, viewed apart
], ids=["tokens", "gate", "heads"])
def test_reductions_over_other_dims_or_within_viewed_heads_equal_one_process(op):
    ref = train_mnist("auto", 1, "sgd", batch=GLOBAL_BATCH, ref=True, model_cls=_reducing(op))
    got = train_mnist(tp(2), 2, "sgd", batch=GLOBAL_BATCH, model_cls=_reducing(op))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
