"""The step's random draws, the same on every stage of a pipeline.

A pipeline runs the module's step on two stages: the first runs it up to the Sequential (to capture the
Sequential's input), the last runs all of it on the activation it receives (to get the loss). A draw the
step makes before the Sequential -- a mask applied to the input and used again to pick the loss's positions
(masked language modelling), a noise level -- must give both the same numbers. Left to the global streams
it did only for the first microbatch: the last stage also draws after the Sequential and in its layers'
dropout, the first stage in its own layers, so from the second microbatch on the input was masked with one
mask and the loss computed with another, silently (the stages agreed on 1 of 20 masks)::

    pipeline step n, microbatch m     every stage: streams seeded from hash(base, n, m), then the step
    evaluation step n (whole batch)   every stage: streams seeded from hash(base, n, -1)

``base`` is the replica's first rank's ``torch.initial_seed()``, which its stages and tp members agree on at
setup; every stage counts the same pipeline steps. Seeded: torch's default generator, Python's ``random``
and numpy's global stream -- what ``seed_everything`` seeds. A ``torch.Generator`` the module keeps itself
is not.
"""

from __future__ import annotations

from lightning_shm.parallel.streams import call_seed, seed_streams

__all__ = ["call_seed", "seed_streams"]
