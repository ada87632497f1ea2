"""Copies of the pipelined ``nn.Sequential`` kept outside it: an EMA teacher cannot follow a pipeline.

A BYOL / DINO / mean-teacher model keeps ``self.teacher = copy.deepcopy(self.net)`` and updates it after
each step from the student, ``zip(teacher.parameters(), net.parameters())``. Under a pipeline the copy
stays whole on every stage (it is outside the Sequential) while ``net.parameters()`` on a stage yields only
that stage's layers, so the zip pairs other layers::

    stage 1 of 2, net = [b0 b1 b2 b3]:  net.parameters() -> b2 b3      teacher.parameters() -> b0 b1 b2 b3
                                        zip: teacher b0 <- net b2, teacher b1 <- net b3 (b2, b3 never)

-- a shape error, or, where the layers' shapes agree (identical blocks), silently the wrong teacher, which
the last stage then runs in the step. A copy used frozen (a reference model) is fine, and so is one the
optimizer trains (a second tower of the same architecture: its gradients are summed over the stages like
any parameter outside the Sequential). So the parameters of the copies that no optimizer holds are watched:
a change to them between two training steps stops the run at the next step, saying why.
"""

from __future__ import annotations

from torch import nn

from lightning_shm.parallel.sequential import copies_of


class SequentialCopies:
    """The copies of ``module``'s Sequential ``seq_name`` among its children (found before the stages are cut)."""

    def __init__(self, module: nn.Module, seq_name: str) -> None:
        self.module = module
        self.seq_name = seq_name
        self.names = [n for n, _ in copies_of(module, seq_name)]
        self._versions: dict[str, list[int]] = {}
        self._optimized: set[int] = set()  # ids of parameters an optimizer updates: their changes are its steps

    @property
    def frozen(self) -> list[str]:
        """The copies without a parameter that requires a gradient (an EMA teacher, a reference model)."""
        return [n for n in self.names if not any(p.requires_grad for p in self.module.get_submodule(n).parameters())]

    def skip_optimized(self, params: set[int]) -> None:
        """The run's optimizers hold the parameters with these ids: changes to them are optimizer steps."""
        self._optimized = params
        self._versions = {}

    def note(self) -> str:
        """Said once at setup where there are copies: a frozen one works, an updated one cannot."""
        return (f"lightning_shm: {self.frozen} copy the architecture of the pipelined nn.Sequential "
                f"{self.seq_name!r}. Used frozen (a reference model) that works; updated from {self.seq_name!r}'s "
                f"parameters (an EMA teacher: zip({self.frozen[0]}.parameters(), {self.seq_name}.parameters())) it "
                f"cannot: each stage holds only its own layers of {self.seq_name!r}, so such an update pairs other "
                "layers -- a shape error, or, where shapes agree, a refusal at the next step. Train such a model with "
                "shm_ddp, shm_fsdp or shm_tp.")

    def _now(self) -> dict[str, list[int]]:  # read at every check: FSDP replaces the parameters by its row blocks
        return {n: [p._version for p in self.module.get_submodule(n).parameters() if id(p) not in self._optimized]
                for n in self.names}

    def check(self) -> None:
        """At a training step's start: refuse a copy changed since the previous step's start."""
        now = self._now()
        changed = [n for n in self.names if n in self._versions and now[n] != self._versions[n]]
        self._versions = now
        if changed:
            raise RuntimeError(
                f"the parameters of {changed} changed outside the optimizer since the last step: "
                f"{changed[0]!r} has the architecture of the pipelined nn.Sequential {self.seq_name!r} (an EMA "
                f"teacher updated from it: BYOL, DINO, mean teacher?). Under a pipeline each stage holds only its "
                f"own layers of {self.seq_name!r}, so {self.seq_name}.parameters() yields those, and an update "
                f"pairing it with {changed[0]!r} by position pairs other layers (a shape error, or silently the "
                "wrong ones where shapes agree). Not supported under a pipeline: train this model with shm_ddp, "
                "shm_fsdp or shm_tp (which splits such a copy as it splits the Sequential).")
