"""Parameters FSDP keeps whole on every rank: the LightningModule's own (read in its step, where no unit's
forward hook sees the read), those of parameter containers it holds and 0-d ones (no rows to cut) -- once
refused, now replicated with their gradients averaged (``parallel/fsdp/policy.py``, ``kept_whole``) -- and
a container's parameters inside a module outside the Sequential, gathered around that module's forward; and
in a unit holding several dtypes, those of its smaller ones (a quantized layer's float scales and adapter); and
those of TorchScript modules, whose forward runs no hooks."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, SEED, flat_params, layouts, loader, mnist_like, train_mnist, trainer


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.tensor(0.5))  # 0-d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.g


class Scaled(MNISTClassifier):
    """A 0-d gate inside the Sequential, a 0-d logit scale (CLIP's) and a (1,) temperature on the module,
    both read in the step only, and a buffer on the module."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = nn.Sequential(*list(self.net)[:4], _Gate(), *list(self.net)[4:])
        self.logit_scale = nn.Parameter(torch.tensor(1.5))
        self.log_t = nn.Parameter(torch.zeros(1))
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = (self(x) + self.shift) * self.logit_scale * self.log_t.exp()
        return nn.functional.cross_entropy(logits, y)


class _Affine(nn.Module):
    """A per-class gain and bias kept in containers: its forward reads them, the containers have none."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.gain = nn.ParameterList([nn.Parameter(torch.linspace(0.5, 1.5, n))])
        self.bias = nn.ParameterDict({"b": nn.Parameter(torch.zeros(n))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain[0] + self.bias["b"]


class Prompted(MNISTClassifier):
    """Per-task input prompts in an ``nn.ParameterDict`` and layer-mixing weights in an ``nn.ParameterList``
    held by the module, read in its step; a head outside the Sequential whose parameters live in containers.
    Until 2026-12-04 each container was a unit no forward gathered: the step read the rank's rows
    ("The size of tensor a (784) must match the size of tensor b (392)")."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.prompts = nn.ParameterDict({"digits": nn.Parameter(torch.zeros(784)),
                                         "unused": nn.Parameter(torch.zeros(784))})
        self.mix = nn.ModuleDict({"w": nn.ParameterList([nn.Parameter(torch.full((1,), 0.7)),
                                                         nn.Parameter(torch.full((2,), 0.2))])})
        self.head = _Affine(10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        w0, w1 = self.mix["w"]
        logits = self.head(self(x.flatten(1) + self.prompts["digits"]) * w0 + w1.sum())
        return nn.functional.cross_entropy(logits, y)


class _QuantizedLoRA(nn.Module):
    """QLoRA's layer: a frozen int8 weight with float row scales, a trainable bias and low-rank adapter."""

    def __init__(self, n_in: int, n_out: int, rank: int = 4) -> None:
        super().__init__()
        w = torch.randn(n_out, n_in) * 0.05
        scale = w.abs().amax(1) / 127
        self.weight_q = nn.Parameter(torch.round(w / scale[:, None]).to(torch.int8), requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(n_out))
        self.lora_a = nn.Parameter(torch.randn(rank, n_in) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(n_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight_q.to(x.dtype) * self.scale.to(x.dtype)[:, None]
        return x @ w.t() + self.bias + (x @ self.lora_a.t()) @ self.lora_b.t()


class QuantizedLoRA(MNISTClassifier):
    """Each unit holds an int8 weight beside float parameters: refused until 2026-12-06 ("FSDP unit 'net.1' mixes
    dtypes ['torch.float64', 'torch.int8']"); now the int8 weight is sharded, the unit's float parameters kept
    whole (``split_off_other_dtypes``)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = nn.Sequential(nn.Flatten(), _QuantizedLoRA(784, 64), nn.ReLU(), _QuantizedLoRA(64, 32), nn.ReLU(),
                                 nn.Linear(32, 10))


class Scripted(MNISTClassifier):
    """A block scripted with torch.jit inside the Sequential: its forward runs no hooks, so its parameters stay
    whole. Until 2026-12-06 shm_fsdp failed in setup: "register_forward_pre_hook is not supported on
    ScriptModules"."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net[1] = torch.jit.script(nn.Sequential(self.net[1], nn.ReLU()))


@pytest.mark.parametrize("model_cls", [Scaled, Prompted, QuantizedLoRA, Scripted])
@pytest.mark.parametrize("layout", ["fsdp", "fsdp-copy", "dp2xpp2-shard"])
def test_module_and_scalar_parameters_train_as_in_one_process(layout, model_cls):
    """Clipped by the global norm: a replicated gradient must count once, not once per rank."""
    strategy, devices, dp = layouts(layout)[layout]
    kw = dict(model_cls=model_cls, buffers=True, gradient_clip_val=0.5)
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, **kw)
    got = train_mnist(strategy(), devices, "adam", batch=GLOBAL_BATCH // dp, **kw)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)


@pytest.mark.parametrize("model_cls", [Scaled, Prompted, QuantizedLoRA, Scripted])
def test_checkpoint_is_plain_and_resumes_as_uninterrupted(tmp_path, model_cls):
    ds = mnist_like(GLOBAL_BATCH * 2, seed=1)

    def fit(epochs, ckpt_path=None, callbacks=()):
        pl.seed_everything(SEED)
        model = model_cls(optimizer="adam", lr=0.01)
        t = trainer(strategy="shm_fsdp_fork", devices=2, max_epochs=epochs, precision="64-true",
                    enable_checkpointing=bool(callbacks), callbacks=list(callbacks))
        t.fit(model, loader(ds, GLOBAL_BATCH // 2), ckpt_path=ckpt_path)
        return flat_params(model)

    straight = fit(2)
    ckpt = ModelCheckpoint(dirpath=tmp_path)
    fit(1, callbacks=[ckpt])
    saved = torch.load(ckpt.best_model_path, weights_only=False)
    plain = model_cls()
    assert {k: v.shape for k, v in saved["state_dict"].items()} == {k: v.shape for k, v in plain.state_dict().items()}
    plain.load_state_dict(saved["state_dict"])
    torch.optim.Adam(plain.parameters()).load_state_dict(saved["optimizer_states"][0])
    resumed = fit(2, ckpt_path=ckpt.best_model_path)
    torch.testing.assert_close(resumed, straight, rtol=0, atol=0)



def test_scripted_modules_kept_whole_are_named_in_the_log(tmp_path, monkeypatch):
    """Rank 0 says which TorchScript modules stay whole, and how many parameters they hold: a user expecting
    1/W of them per rank learns why not. (The forked workers write what the strategy logs to a file here.)"""
    from lightning_shm.strategies import model_parallel

    said = tmp_path / "said.txt"

    def info(message: str) -> None:
        with open(said, "a") as f:
            f.write(message + "\n")

    monkeypatch.setattr(model_parallel, "rank_zero_info", info)
    strategy, devices, dp = layouts("fsdp")["fsdp"]
    train_mnist(strategy(), devices, "sgd", batch=GLOBAL_BATCH // dp, model_cls=Scripted)
    held = sum(p.numel() for p in Scripted().net[1].parameters())
    total = sum(p.numel() for p in Scripted().parameters())
    lines = said.read_text().splitlines()
    line = (f"shm_fsdp: ['net.1'] are TorchScript modules, whose forward runs no hooks: their {held:,} parameters "
            f"(of {total:,}) stay whole on every rank")
    assert lines.count(line) == 2  # the strategy's info goes through rank_zero_info; each rank calls it
