"""Hooks a model registers on its own parameters and layers in ``__init__``, and attributes it sets on its
parameters, trained under every layout that replaces them (FSDP's row blocks, tensor-parallel slices and
layers, a pipeline's row cut of a Linear) against one process.

Until 2026-12-03 those hooks stayed on the replaced objects and training went on without them, silently:
a gradient hook scaling the first Linear's weight gradient by 0 left one process's weights 0.061 away under
shm_fsdp, shm_tp and dp x pp (shm_ddp and the pipelines keep the model's own tensors and were right).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.optim.swa_utils import get_ema_multi_avg_fn

from lightning_shm import SHMModelParallel, SHMPipeline, SHMTensorParallel
from lightning_shm.models import MNISTClassifier
from lightning_shm.models.mlp import build_mlp
from lightning_shm.parallel.pipeline.row_cut import LinearRows, plan_row_cuts
from tests.helpers import GLOBAL_BATCH, LAYOUTS, fit_seeded, flat_params, layouts

PLAN = {"net.1": "column", "net.4": "row"}
HOOK_LAYOUTS = {
    **{n: LAYOUTS[n] for n in ("ddp", "fsdp", "fsdp-copy", "pp2-zero-bubble", "dp2xpp2-shard")},
    "tp2": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2, plan=PLAN), 2, 1),
    "dp2xtp2": (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2, tensor_parallel_size=2,
                                         plan=PLAN), 4, 2),
    "pp2-split-linear": (lambda: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4,
                                             split_linear=True, balance="params"), 2, 1),
}


def _triple(p: torch.Tensor) -> None:
    p.grad.mul_(3.0)


def _never(grad: torch.Tensor) -> None:
    raise AssertionError("a hook removed by its handle ran")


class Hooked(MNISTClassifier):
    """Six hooks, each elementwise (so each piece of a split tensor gets what one process gives its
    elements) and each changing what SGD trains; a sixth is removed through its handle before training."""

    def __init__(self, hooks: bool = True, **kw):
        super().__init__(**kw)
        first, second = self.net[1], self.net[4]  # under tp: the column and the row layer
        if hooks:
            first.weight.register_hook(lambda g: g * 0.25)
            second.bias.register_post_accumulate_grad_hook(_triple)
            second.weight.register_post_accumulate_grad_hook(_triple)  # a Linear weight zero-bubble defers
            first.register_forward_pre_hook(lambda m, args: (args[0] * 2.0,))
            second.register_forward_hook(lambda m, args, out: out * 0.5)
            second.register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * 0.5,))
            self._removed = first.bias.register_hook(_never)

    def on_fit_start(self) -> None:  # after the strategy replaced the parameters
        if hasattr(self, "_removed"):
            self._removed.remove()


def _fit(strategy, devices, batch, ref=False, hooks=True):
    _, model = fit_seeded(lambda: Hooked(hooks=hooks, optimizer="sgd", lr=0.1), strategy, devices, batch, ref=ref,
                          samples=GLOBAL_BATCH * 3)
    return flat_params(model)


@pytest.fixture(scope="module")
def reference():
    ref = _fit("auto", 1, GLOBAL_BATCH, ref=True)
    assert (ref - _fit("auto", 1, GLOBAL_BATCH, ref=True, hooks=False)).abs().max() > 1e-2  # the hooks matter
    return ref


@pytest.mark.parametrize("name", list(HOOK_LAYOUTS))
def test_hooks_registered_in_init_run_under_every_layout_as_in_one_process(reference, name):
    strategy, devices, dp = HOOK_LAYOUTS[name]
    torch.testing.assert_close(_fit(strategy(), devices, GLOBAL_BATCH // dp), reference, rtol=0, atol=1e-10)


class GradientHooked(MNISTClassifier):
    """Gradient hooks only, on the Linear that ``split_linear`` cuts into two stages' row pieces (module hooks
    keep a Linear whole: they expect its whole input and output)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net[1].weight.register_hook(lambda g: g * 0.25)
        self.net[1].bias.register_post_accumulate_grad_hook(_triple)

    def on_train_start(self) -> None:
        self.log("cut", float(any(isinstance(m, LinearRows) for m in self.modules())))


def test_gradient_hooks_run_on_both_row_pieces_of_a_cut_linear():
    def fit(strategy, devices, ref=False):
        t, model = fit_seeded(lambda: GradientHooked(optimizer="sgd", lr=0.1), strategy, devices, GLOBAL_BATCH,
                              ref=ref, samples=GLOBAL_BATCH * 3)
        return flat_params(model), t

    ref, _ = fit("auto", 1, ref=True)
    got, t = fit(HOOK_LAYOUTS["pp2-split-linear"][0](), 2)
    assert float(t.callback_metrics["cut"]) == 1.0
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)


def test_a_linear_with_module_hooks_is_not_cut_by_rows():
    layers = list(build_mlp([256, 64]))
    costs = [1.0, 100.0, 1.0, 1.0, 30.0, 1.0, 1.0, 3.0]
    assert any(r for _, r in plan_row_cuts(layers, costs, 2))  # the first Linear holds most of the cost
    layers[1].register_forward_hook(lambda m, args, out: None)
    assert not any(r for _, r in plan_row_cuts(layers, costs, 2) or [])


class GroupsByAttribute(MNISTClassifier):
    """Parameter groups built from attributes set in ``__init__`` (no weight decay, a learning-rate scale)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        for m in self.net:
            if isinstance(m, torch.nn.Linear):
                m.weight.lr_scale = 0.1
                m.bias.no_decay = True
            elif isinstance(m, torch.nn.LayerNorm):
                m.weight.no_decay = m.bias.no_decay = True

    def configure_optimizers(self):
        groups: dict = {}
        for p in self.parameters():
            groups.setdefault((getattr(p, "no_decay", False), getattr(p, "lr_scale", 1.0)), []).append(p)
        return torch.optim.AdamW([{"params": ps, "weight_decay": 0.0 if no_decay else 0.5, "lr": self.hparams.lr * s}
                                  for (no_decay, s), ps in groups.items()])


@pytest.mark.parametrize("name", ["fsdp", "tp2", "pp2-split-linear", "dp2xpp2-shard"])
def test_attributes_set_on_parameters_reach_the_pieces_configure_optimizers_sees(name):
    def fit(strategy, devices, batch, ref=False, cls=GroupsByAttribute):
        return flat_params(fit_seeded(lambda: cls(optimizer="adam", lr=0.01), strategy, devices, batch, ref=ref)[1])

    ref = fit("auto", 1, GLOBAL_BATCH, ref=True)
    assert (ref - fit("auto", 1, GLOBAL_BATCH, ref=True, cls=MNISTClassifier)).abs().max() > 1e-2
    strategy, devices, dp = HOOK_LAYOUTS[name]
    torch.testing.assert_close(fit(strategy(), devices, GLOBAL_BATCH // dp), ref, rtol=0, atol=1e-10)


class DecayByLayerType(MNISTClassifier):
    """minGPT's configure_optimizers: weight decay for Linear / Conv2d weights, none for biases and norm weights,
    classified by module type, every parameter accounted for."""

    def configure_optimizers(self):
        decay, no_decay = [], []
        for m in self.modules():
            for name, p in m.named_parameters(recurse=False):
                if name == "bias" or isinstance(m, (torch.nn.LayerNorm, torch.nn.BatchNorm2d)):
                    no_decay.append(p)
                elif isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
                    decay.append(p)
                else:
                    raise AssertionError(f"{type(m).__name__}.{name} is neither decayed nor not")
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.5}, {"params": no_decay, "weight_decay": 0.0}],
                                 lr=self.hparams.lr)


@pytest.mark.parametrize("name,arch", [("tp2", "mlp"), ("pp2-split-linear", "mlp"), ("tp2-cnn", "cnn")])
def test_layers_a_strategy_replaces_keep_the_type_configure_optimizers_classifies_by(name, arch):
    """Tensor-parallel layers and a cut Linear's row pieces are instances of the layer type they replace (they
    were not: the Linear weights got no weight decay under tp2 and split_linear, 0.040 off one process)."""
    def fit(strategy, devices, cls=DecayByLayerType):
        return flat_params(fit_seeded(lambda: cls(optimizer="adam", lr=0.01, arch=arch, channels=(4, 8), cnn_hidden=16),
                                      strategy, devices, GLOBAL_BATCH, ref=devices == 1)[1])

    ref = fit("auto", 1)
    assert (ref - fit("auto", 1, cls=MNISTClassifier)).abs().max() > 1e-3  # the decay matters
    strategy = (SHMTensorParallel(start_method="fork", tensor_parallel_size=2) if name == "tp2-cnn"
                else HOOK_LAYOUTS[name][0]())
    torch.testing.assert_close(fit(strategy, 2), ref, rtol=0, atol=1e-8)  # the CNN's split sums: 2e-9


class LrMultPerLayer(MNISTClassifier):
    """A learning-rate multiplier set on a layer in ``__init__``, read by ``configure_optimizers``."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net[1].lr_mult = 0.1

    def configure_optimizers(self):
        return torch.optim.Adam([{"params": list(m.parameters(recurse=False)), "lr": self.hparams.lr * m.lr_mult}
                                 if hasattr(m, "lr_mult") else {"params": list(m.parameters(recurse=False))}
                                 for m in self.modules() if list(m.parameters(recurse=False))], lr=self.hparams.lr)


def test_attributes_set_on_a_layer_reach_its_tensor_parallel_version():
    def fit(strategy, devices):
        return flat_params(fit_seeded(lambda: LrMultPerLayer(optimizer="adam", lr=0.01), strategy, devices,
                                      GLOBAL_BATCH, ref=devices == 1)[1])

    torch.testing.assert_close(fit(HOOK_LAYOUTS["tp2"][0](), 2), fit("auto", 1), rtol=0, atol=1e-10)


class GroupsFromInit(MNISTClassifier):
    """Parameter groups from lists made in ``__init__``, before the strategy replaces the parameters; with
    ``fresh_rest`` the second group comes from ``self.parameters()`` in ``configure_optimizers`` instead."""

    def __init__(self, fresh_rest: bool = False, **kw):
        super().__init__(**kw)
        self.fresh_rest = fresh_rest
        self.first = list(self.net[1].parameters())
        self.others = [p for n, p in self.named_parameters() if not n.startswith("net.1.")]

    def configure_optimizers(self):
        first = {id(p) for p in self.first}
        rest = [p for p in self.parameters() if id(p) not in first] if self.fresh_rest else self.others
        return torch.optim.Adam([{"params": self.first, "lr": self.hparams.lr * 0.1}, {"params": rest}],
                                lr=self.hparams.lr)


@pytest.mark.parametrize("name", ["fsdp", "tp2", "pp2-zero-bubble", "dp2xpp2-shard"])
def test_parameter_lists_made_before_setup_optimize_what_the_rank_holds(name):
    """They held the replaced tensors: the run trained with them and failed at its end (KeyError in the
    checkpoint of the optimizer state)."""
    def fit(strategy, devices, batch, **kw):
        return fit_seeded(lambda: GroupsFromInit(optimizer="adam", lr=0.01, **kw), strategy, devices, batch,
                          ref=devices == 1)[1]

    ref = flat_params(fit("auto", 1, GLOBAL_BATCH))
    strategy, devices, dp = HOOK_LAYOUTS[name]
    torch.testing.assert_close(flat_params(fit(strategy(), devices, GLOBAL_BATCH // dp)), ref, rtol=0, atol=1e-10)
    if name == "pp2-zero-bubble":  # a stage keeps the model's own parameters (it drops other stages' ones)
        return
    with pytest.raises(ValueError, match=r"Adam holds \['net.1.bias', 'net.1.weight'\] twice: once as kept from "
                                         r"before the strategy replaced them"):
        fit(strategy(), devices, GLOBAL_BATCH // dp, fresh_rest=True)


class SequentialHooked(MNISTClassifier):
    """Hooks on the Sequential a pipeline cuts into stages: one scales its input, one its output."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net.register_forward_pre_hook(lambda m, args: (args[0] * 2.0,))
        self.net.register_forward_hook(lambda m, args, out: out * 0.5)


@pytest.mark.parametrize("name", ["pp2-zero-bubble", "dp2xpp2-shard"])
def test_hooks_on_the_pipelined_sequential_run_where_its_input_and_output_are(name):
    """The stage replaces the Sequential: its hooks stayed behind (0.085 / 0.090 off one process under pp2)."""
    def fit(strategy, devices, batch):
        t, model = fit_seeded(lambda: SequentialHooked(optimizer="adam", lr=0.01), strategy, devices, batch,
                              ref=devices == 1, validate=True)
        return flat_params(model), float(t.callback_metrics["val_loss"])

    ref, ref_val = fit("auto", 1, GLOBAL_BATCH)
    _, plain = fit_seeded(lambda: MNISTClassifier(optimizer="adam", lr=0.01), "auto", 1, GLOBAL_BATCH, ref=True)
    assert (ref - flat_params(plain)).abs().max() > 1e-2
    strategy, devices, dp = HOOK_LAYOUTS[name]
    got, val = fit(strategy(), devices, GLOBAL_BATCH // dp)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
    assert val == pytest.approx(ref_val, abs=1e-10)


class KeepsAnAverage(MNISTClassifier):
    """An EMA as torch documents it: ``AveragedModel(self.net)`` built in ``__init__``, updated after each batch."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.ema = torch.optim.swa_utils.AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.5))
        self.ema.requires_grad_(False)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.ema.update_parameters(self.net)


def test_an_averaged_model_of_a_part_sliced_or_staged_is_refused_and_fsdp_averages_block_for_block():
    """Under tp / a pipeline the fit failed after its first step ("The size of tensor a (256) must match the
    size of tensor b (128)"); now before any worker starts, pointing to the callbacks that average in the layout."""
    for strategy in (SHMTensorParallel(start_method="fork", tensor_parallel_size=2),
                     SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4)):
        with pytest.raises(ValueError, match=r"'ema' is a torch AveragedModel of 'net', and (tensor parallelism "
                                             r"splits \['net.1'|the pipeline gives each stage some layers of 'net').*"
                                             r"EMAWeightAveraging"):
            fit_seeded(lambda: KeepsAnAverage(optimizer="adam", lr=0.01), strategy, 2, GLOBAL_BATCH)
    _, one = fit_seeded(lambda: KeepsAnAverage(optimizer="adam", lr=0.01), "auto", 1, GLOBAL_BATCH, ref=True)
    make, devices, dp = LAYOUTS["fsdp"]
    _, ours = fit_seeded(lambda: KeepsAnAverage(optimizer="adam", lr=0.01), make(), devices, GLOBAL_BATCH // dp)
    assert torch.allclose(flat_params(ours.ema), flat_params(one.ema), rtol=0, atol=1e-10)
    assert not torch.equal(flat_params(ours.ema), flat_params(ours.net))  # an average, not the last weights


def _ramp(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A full-shape scale along ``dim``: different for every feature, so a piece cannot pass for the whole."""
    shape = [1] * t.dim()
    shape[dim] = t.shape[dim]
    return torch.linspace(0.5, 1.5, t.shape[dim], dtype=t.dtype).view(shape)


class WholeTensorHooks(MNISTClassifier):
    """Forward hooks that need the whole tensor, on layers tensor parallelism splits: a penalty on a column layer's
    output kept for the loss, full-shape scales returned in place of a column layer's output, of a row layer's input
    and of a BatchNorm's output between column and row convolutions (and of the row convolution's input)."""

    def __init__(self, **kw):
        if kw.get("arch") == "cnn":
            super().__init__(**{"channels": (8, 16), "cnn_hidden": 32, **kw})
            self.net[1].register_forward_hook(lambda m, args, out: out * _ramp(out, 1))  # BatchNorm2d: channels
            self.net[4].register_forward_pre_hook(lambda m, args: (args[0] * _ramp(args[0], 1),))  # the row conv
        else:
            super().__init__(**{"arch": "transformer", "dim": 16, "depth": 2, "heads": 2, **kw})
            block = self.net[1]
            block.mlp.fc1.register_forward_hook(self._keep)
            block.attn.q.register_forward_hook(lambda m, args, out: out * _ramp(out, -1))
            block.attn.o.register_forward_pre_hook(lambda m, args, kwargs: ((args[0] * _ramp(args[0], -1),), kwargs),
                                                   with_kwargs=True)

    def _keep(self, module, args, out):
        self.feat = out

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if not hasattr(self, "feat"):
            return loss
        return loss + (self.feat.pow(2) * _ramp(self.feat, -1)).mean()


WHOLE_TENSOR_RUNS = {
    "transformer-tp2": ({}, lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, 1),
    "transformer-dp2xtp2": ({}, lambda: SHMModelParallel(start_method="fork", data_parallel_size=2,
                                                         tensor_parallel_size=2), 4, 2),
    "cnn-tp2": ({"arch": "cnn"}, lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, 1),
}


@pytest.mark.parametrize("name", list(WHOLE_TENSOR_RUNS))
def test_forward_hooks_on_split_layers_see_the_whole_tensors(name):
    """They saw this rank's slice: a mean over half the features, another loss on each rank (0.059 off one process
    after 5 steps, a penalty on fc1's output under tp2); a full-shape scale did not even fit the slice."""
    kw, strategy, devices, dp = WHOLE_TENSOR_RUNS[name]

    def fit(strategy, devices, batch, ref=False):
        _, model = fit_seeded(lambda: WholeTensorHooks(optimizer="adam", lr=0.01, **kw), strategy, devices, batch,
                              ref=ref, samples=GLOBAL_BATCH * 3)
        return flat_params(model)

    torch.testing.assert_close(fit(strategy(), devices, GLOBAL_BATCH // dp), fit("auto", 1, GLOBAL_BATCH, ref=True),
                               rtol=0, atol=1e-7)


class _Positive(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return nn.functional.softplus(w)


class HookedBatchNorm(MNISTClassifier):
    """The CNN with hooks on its first BatchNorm: a forward hook scaling its output, state-dict hooks saving its
    running mean as ``mean``; and its second BatchNorm's weight kept positive by a parametrization."""

    def __init__(self, **kw):
        super().__init__(arch="cnn", channels=(4, 8), cnn_hidden=16, **kw)
        parametrize.register_parametrization(self.net[5], "weight", _Positive())
        bn = self.net[1]
        bn.register_forward_hook(lambda module, args, out: out * 0.5)

        def save(module, state_dict, prefix, local_metadata):
            state_dict[prefix + "mean"] = state_dict.pop(prefix + "running_mean")

        def load(state_dict, prefix, *args):
            if prefix + "mean" in state_dict:
                state_dict[prefix + "running_mean"] = state_dict.pop(prefix + "mean")

        bn._register_state_dict_hook(save)
        bn._register_load_state_dict_pre_hook(load)


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_a_batchnorm_synced_over_the_ranks_keeps_the_models_hooks_and_parametrizations(tmp_path, name):
    """``sync_batchnorm=True`` replaces each BatchNorm by the shared-memory SyncBatchNorm, which did not take the
    layer's hooks: the forward hook silently stopped running (3.4e-05 off one process after 2 SGD steps), a
    checkpoint lacked the renamed key one process writes, and a parametrized weight became a plain one -- trained
    without its constraint, and the run failed at its end ("KeyError: 'net.5.weight'")."""

    def fit(strategy, devices, batch, ref=False, save=None):
        t, model = fit_seeded(lambda: HookedBatchNorm(optimizer="sgd", lr=0.1), strategy, devices, batch, ref=ref,
                              sync_batchnorm=devices > 1)
        t.save_checkpoint(save)
        return flat_params(model), torch.load(save, weights_only=False)["state_dict"]

    one, one_saved = fit("auto", 1, GLOBAL_BATCH, ref=True, save=tmp_path / "one.ckpt")
    strategy, devices, dp = layouts(name)[name]
    got, saved = fit(strategy(), devices, GLOBAL_BATCH // dp, save=tmp_path / "layout.ckpt")
    torch.testing.assert_close(got, one, rtol=0, atol=1e-12)
    assert "net.1.mean" in saved and "net.5.parametrizations.weight.original" in saved
    assert list(saved) == list(one_saved)
