"""Two nodes x two devices on one machine (scripts/launch_nodes.py): shared memory inside each node,
gloo rails between them. Every strategy must train like one process on the global batch, combine
logs over all four ranks, write one checkpoint, and stop both nodes when a rank of one fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from lightning_shm.models import MNISTClassifier
from lightning_shm.runtime.errors import NodeStoppedError
from lightning_shm.runtime.rail import NodeLayout, connect_rail
from tests.helpers import GLOBAL_BATCH, SEED, STEPS, mnist_like, reference_loader, train_mnist, trainer
from tests.nodes_job import Counted

ROOT = Path(__file__).resolve().parents[1]


def run_nodes(name: str, out: Path, mode: str = "train") -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "scripts/launch_nodes.py", "--nodes", "2", "--grace", "60", "--",
                           sys.executable, "tests/nodes_job.py", name, str(out), mode],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def reference():
    """One process's weights, and the gradient norm of its last step (the job's module logs it too)."""
    weights = train_mnist("auto", 1, "sgd", batch=GLOBAL_BATCH, ref=True, model_cls=MNISTClassifier,
                          samples=GLOBAL_BATCH * STEPS)
    pl.seed_everything(SEED)
    t = trainer(devices=1, max_epochs=1)
    data = reference_loader(mnist_like(GLOBAL_BATCH * STEPS, seed=1), GLOBAL_BATCH, SEED)
    t.fit(Counted(optimizer="sgd", lr=0.1), data)
    return weights, float(t.callback_metrics["grad_norm"])


NAMES = ["ddp", "fsdp", "tp", "pipeline"]


@pytest.fixture(scope="module")
def two_node_runs(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """Each strategy's fit, one after the other in the same two node processes (as a job that fits and then
    tests runs two launches): a node process's interpreter costs more than its fits."""
    out = tmp_path_factory.mktemp("nodes")
    return run_nodes(",".join(NAMES), out), out


@pytest.mark.parametrize("name", NAMES)
def test_two_nodes_equal_one_process(two_node_runs, reference, name):
    done, runs = two_node_runs
    assert done.returncode == 0, done.stderr[-4000:]
    out = runs / name
    got = [torch.load(out / f"node{n}.pt").double() for n in (0, 1)]
    weights, grad_norm = reference
    torch.testing.assert_close(got[0], weights, rtol=0, atol=1e-5)
    assert torch.equal(got[0], got[1])  # every node's main process holds the trained model
    meta = [json.loads((out / f"node{n}.json").read_text()) for n in (0, 1)]
    assert meta[0]["global_step"] == meta[1]["global_step"] == STEPS
    # logs combine over the data-parallel ranks of both nodes: all four for ddp / fsdp (a SumMetric of
    # rank + 1 per step: 5 * (1 + 2 + 3 + 4)); for tp the replicas are global ranks 0 and 2 (tp ranks see the
    # same data); a pipeline logs from its last stage (ranks 1 and 3), whose step runs once per microbatch
    metrics = meta[0]["metrics"]
    expected = {"ddp": (STEPS * 10, 1.5), "fsdp": (STEPS * 10, 1.5), "tp": (STEPS * 4, 1.0),
                "pipeline": (STEPS * 2 * 6, 2.0)}[name]
    assert (metrics["rank_sum"], metrics["rank_mean"]) == pytest.approx(expected)
    assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)  # every node's pieces (lightning_shm.grad_norm)
    # one checkpoint, written once (global rank 0), plain: it loads in one process
    files = sorted((out / "ckpt").iterdir())
    assert len(files) == 1 and meta[0]["best"] == meta[1]["best"] == str(files[0])
    plain = MNISTClassifier.load_from_checkpoint(files[0])
    torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in plain.parameters()]).double(), got[0])


def test_a_rank_failing_on_node_1_stops_both_nodes(tmp_path):
    done = run_nodes("ddp", tmp_path, mode="fail")
    assert done.returncode != 0
    assert "ValueError: rank 3 on node 1 failed on purpose" in done.stderr, done.stderr[-4000:]
    assert "NodeStoppedError: node 1 stopped" in done.stderr, done.stderr[-4000:]  # what node 0 reports
    assert not (tmp_path / "node0.pt").exists() and not (tmp_path / "node1.pt").exists()


def _rail_barrier(node: int, port: int, untimed: bool, results) -> None:
    rail = connect_rail(NodeLayout(nodes=2, node=node, local_size=1, local_rank=0), "127.0.0.1", port, 1.0)
    if node == 0:
        time.sleep(3)  # prepare_data on node 0 alone
    try:
        rail.barrier(untimed)
        results.put((node, "arrived"))
    except NodeStoppedError as e:
        results.put((node, str(e)))


@pytest.mark.parametrize("untimed", [True, False])
def test_an_untimed_rail_barrier_outlasts_the_rails_timeout(untimed):
    """The barrier after prepare_data waits as long as node 0 prepares (Lightning's infinite barrier); a gloo
    wait cannot outlast its group's timeout, so the rail keeps a second group for it."""
    ctx = torch.multiprocessing.get_context("fork")
    results = ctx.Queue()
    port = find_free_network_port()
    nodes = [ctx.Process(target=_rail_barrier, args=(n, port, untimed, results)) for n in (0, 1)]
    for p in nodes:
        p.start()
    got = dict(results.get(timeout=60) for _ in nodes)
    for p in nodes:
        p.join(10)
    if untimed:
        assert got == {0: "arrived", 1: "arrived"}
    else:  # the rail's own timeout (1 s) ends node 1's wait
        assert "Timed out" in got[1], got


def test_a_node_waiting_for_the_others_says_where_and_its_timeout_says_why():
    """``num_nodes=2`` given to a run started on one machine only: node 0 waited the strategies' 30 minutes in
    silence, then failed with torch's "Timed out after 1801 seconds waiting for clients". It now says where it
    waits, again while it waits, and the timeout's error says the same."""
    said: list[str] = []
    port = find_free_network_port()
    with pytest.raises(Exception, match="waiting for clients") as info:
        connect_rail(NodeLayout(nodes=2, node=0, local_size=1, local_rank=0), "127.0.0.1", port, 2.0, said.append,
                     every_s=0.5)
    where = f"127.0.0.1:{port}, the TCP store global rank 0 hosts (MASTER_ADDR / MASTER_PORT); every node runs " \
            "this script with its NODE_RANK, 0 to 1"
    assert said[0] == f"node 0 of 2: meeting the other nodes' ranks at {where}"
    assert any(s.startswith("node 0 of 2: still waiting for the other nodes (") and s.endswith(where) for s in said)
    assert f"node 0 of 2 did not meet the other nodes within 2 s at {where}." in info.value.__notes__
