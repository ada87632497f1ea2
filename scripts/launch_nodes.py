"""Run a multi-node job on one machine: N "nodes", each a process with the environment a real node gets.

    python scripts/launch_nodes.py --nodes 2 -- python -m lightning_shm fit --config scripts/configs/shm_ddp.yaml \\
        --trainer.num_nodes 2

Each node process gets ``NODE_RANK``, ``MASTER_ADDR`` (127.0.0.1) and ``MASTER_PORT`` (a free port)
-- what Lightning's ``LightningEnvironment`` reads; on real machines set them yourself, the same
port and the address of node 0 everywhere, or let SLURM / torchrun provide them. Every node then
starts its own ``devices`` workers (shared memory inside it) and connects them to the other nodes
(gloo on loopback here). SIGINT / SIGTERM are passed on to every node. When a node exits with an
error the others are given ``--grace`` seconds to stop (they should: their collectives with it
fail) and then terminated; the exit status is the first failing node's.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--port", type=int, default=None, help="MASTER_PORT (default: a free one)")
    p.add_argument("--grace", type=float, default=30.0, help="seconds the other nodes get after one failed")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command every node runs")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.nodes < 1:
        p.error("give --nodes >= 1 and a command after --")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.port or free_port())}
    procs = [subprocess.Popen(command, env={**env, "NODE_RANK": str(n)}) for n in range(args.nodes)]

    def forward(signum: int, frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    first_failure: Optional[int] = None
    deadline: Optional[float] = None
    while any(proc.poll() is None for proc in procs):
        for proc in procs:
            code = proc.poll()
            if code not in (None, 0) and first_failure is None:
                first_failure, deadline = code, time.monotonic() + args.grace
        if deadline is not None and time.monotonic() > deadline:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            break
        time.sleep(0.05)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    codes = [proc.returncode for proc in procs]
    if first_failure is None:
        first_failure = next((c for c in codes if c), 0)
    return first_failure


if __name__ == "__main__":
    sys.exit(main())
