"""A failing, killed, stuck or late worker must never hang the others or leak /dev/shm.

The contract: the main process raises within 3 s of the first failure (or timeout). Each test
measures from the failure itself -- the moment a worker raised, was killed or timed out, taken
with the wall clock in that process -- not from the start of the run, so the time spent starting
processes on a loaded 2-core machine does not count against the limit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lightning_shm.runtime import (
    BarrierTimeoutError,
    CollectiveMismatchError,
    DeadlockError,
    PeerAbortedError,
    PeerFailedError,
    RuntimeConfig,
    SharedMemoryFullError,
    WorkerDiedError,
    launch,
    stacks,
)
from lightning_shm.runtime.deadlock import FAILED
from lightning_shm.runtime.launcher import LaunchConfig, Launcher
from lightning_shm.runtime.ops import Coll, barrier_reason, site_of
from lightning_shm.runtime.segment import PREFIX, SHM_DIR, Segment, check_free_space, list_owned, sweep_stale

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 3.0  # main process raises within this long after the failure


def _at(exc: BaseException) -> float:
    """The wall-clock time a worker noted on the exception it raised."""
    notes = " ".join(getattr(exc, "__notes__", [])) + str(exc)
    return float(re.search(r"at=([\d.]+)", notes).group(1))


def _raise_on_rank_1(world):
    g = world.group()
    g.barrier()
    if world.rank == 1:
        time.sleep(0.2)  # rank 0 is waiting in the all-reduce by now
        raise ValueError(f"boom from rank 1: bad value 42 at={time.time()}")
    g.all_reduce(torch.ones(10))  # rank 0 waits here for a peer that will never come


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_worker_exception_is_reraised_with_type_message_and_traceback(start_method):
    with pytest.raises(ValueError, match="boom from rank 1: bad value 42") as info:
        launch(_raise_on_rank_1, 3, start_method=start_method)
    assert time.time() - _at(info.value) < LIMIT_S
    cause = info.value.__cause__
    assert cause is not None and "_raise_on_rank_1" in str(cause) and "Traceback" in str(cause)
    assert "rank 1" in str(cause)
    assert "(ranks [0, 2] stopped because rank 1 failed)" in info.value.__notes__


def _die_mid_collective(world, stamp):
    g = world.group()
    pids = g.all_gather_object(os.getpid())
    x = torch.randn(1 << 20)
    for i in range(10_000):
        if world.rank == 0 and i == 20:
            Path(stamp).write_text(str(time.time()))
            os.kill(pids[1], signal.SIGKILL)
        g.all_reduce(x, "mean")


def test_sigkilled_worker_stops_everyone_within_seconds(tmp_path):
    stamp = tmp_path / "killed_at"
    with pytest.raises(WorkerDiedError, match=r"rank 1 .* killed by signal SIGKILL"):
        launch(_die_mid_collective, 3, str(stamp), start_method="fork")
    assert time.time() - float(stamp.read_text()) < LIMIT_S


def _stuck_in_user_code(world):
    if world.rank == 1:
        time.sleep(60)  # a rank stuck outside the runtime: it never sees the abort flag
    try:
        world.group().barrier()
    except BarrierTimeoutError as e:
        e.add_note(f"at={time.time()}")
        raise


def test_timeout_names_the_missing_rank_and_where_it_was():
    with pytest.raises(BarrierTimeoutError, match=r"rank\(s\) \[1\] did not arrive") as info:
        launch(_stuck_in_user_code, 2, start_method="fork", runtime=RuntimeConfig(timeout_s=1.0))
    assert time.time() - _at(info.value) < LIMIT_S  # includes SIGKILL of the rank stuck in time.sleep
    assert info.value.missing == [1]
    where = [n for n in info.value.__notes__ if n.startswith("rank 1 was here")]
    assert where, info.value.__notes__
    first_frame = where[0].splitlines()[1]
    assert "test_faults.py" in first_frame and "in _stuck_in_user_code" in first_frame, where[0]


def _raise_in_a_step():
    raise RuntimeError("a worker's own failure")


def test_a_missing_rank_that_failed_too_is_placed_where_it_raised():
    """The timeout names where each missing rank was, from a stack dump asked for as the run stops. A rank that had
    failed too may have exited before it could be asked -- in a CI run, the third rank of a deadlock, found by
    each rank of the cycle: the note was missing. Its report says where it raised: that frame stands in."""
    from multiprocessing import Pipe

    from lightning_shm.runtime.launcher import Launcher, _Failure, _report

    ours, theirs = Pipe()
    try:
        _raise_in_a_step()
    except RuntimeError as e:
        _report(theirs, e)
    sent = pickle.loads(ours.recv_bytes())
    assert sent[0] == "error" and sent[5][0][2] == "_raise_in_a_step"  # innermost frame first
    timeout = BarrierTimeoutError("rank 1 timed out waiting", [0, 2])
    failures = [_Failure(1, 1.0, timeout, False), _Failure(2, 1.1, RuntimeError("x"), False, tuple(sent[5]))]
    exc = Launcher._primary_error(failures, {0: [("/user/train.py", 7, "loop")]})  # rank 0 still ran: dumped
    notes = {n.split(" was here")[0]: n for n in exc.__notes__ if " was here" in n}
    assert set(notes) == {"rank 0", "rank 2"}, exc.__notes__
    assert "in loop" in notes["rank 0"] and "in _raise_in_a_step" in notes["rank 2"].splitlines()[1], notes


def test_a_rank_asked_while_unwinding_its_own_error_is_placed_where_it_raised():
    """Each rank of a deadlock's cycle finds it within a check of the others: one may be asked for its stack while
    it already reports its own DeadlockError, outside the program (a CI run: the note showed multiprocessing's
    frames only). Where it raised stands in; a rank that stopped because of the abort keeps the frames asked for
    (taken before the abort moved it). The ones that found the deadlock too did not stop because of the first."""
    from lightning_shm.runtime.launcher import Launcher, _Failure

    runtime = os.path.dirname(stacks.__file__)
    unwinding = [(f"{runtime}/launcher.py", 570, "_report"), (mp.process.__file__, 108, "run")]
    raised_at = ((f"{runtime}/wait.py", 145, "wait_ge"), ("/user/train.py", 9, "ring_step"))
    first = DeadlockError("deadlock: ranks [0, 1, 2] wait for each other", [1, 2])
    failures = [_Failure(0, 1.0, first, False), _Failure(1, 1.1, DeadlockError("deadlock", [0, 2]), False, raised_at),
                _Failure(2, 1.2, PeerAbortedError("rank 0 failed"), True, (("/user/train.py", 30, "after"),))]
    exc = Launcher._primary_error(failures, {1: unwinding, 2: [("/user/train.py", 20, "recv_step")]})
    notes = {n.split(" was here")[0]: n for n in exc.__notes__ if " was here" in n}
    assert "in ring_step" in notes["rank 1"].splitlines()[1], notes
    assert "in recv_step" in notes["rank 2"].splitlines()[1], notes
    assert "(ranks [1] met the same deadlock on their side)" in exc.__notes__, exc.__notes__
    assert "(ranks [2] stopped because rank 0 failed)" in exc.__notes__, exc.__notes__


def _sleep_with_stack_handler(path: str, w: int, then_default: bool = False) -> None:
    stacks.register(path)
    if then_default:  # what restoring "every handler Python knows of" does: it never saw faulthandler's
        signal.signal(stacks.DUMP_SIGNAL, signal.SIG_DFL)
    os.write(w, b"x")
    time.sleep(30)


def test_a_worker_that_put_the_default_back_is_not_asked_for_its_stack(tmp_path):
    """Its header says it is ready, but the request would kill it (seen: Lightning's teardown at the end of a
    Trainer call, then another rank's failure: "worker rank 0 was killed by signal SIGUSR2")."""
    path = tmp_path / "stack"
    path.write_bytes(b"\0" * 65536)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _sleep_with_stack_handler(str(path), w, then_default=True)
        finally:
            os._exit(0)
    try:
        os.read(r, 1)
        assert stacks.ready(str(path)) and not stacks.catches(pid, stacks.DUMP_SIGNAL)
        assert stacks.request({1: pid}, {1: str(path)}) == {}
        time.sleep(0.1)
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the dump request killed the worker"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_worker_is_asked_for_its_stack_only_once_it_can_answer(tmp_path):
    """SIGUSR2's default action kills: the main process signals a worker only after reading the header
    the worker writes once its handler is installed (a fork server's ranks start one after another;
    a stop request used to kill the one still starting)."""
    path = tmp_path / "stack"
    path.write_bytes(b"\0" * 65536)
    assert not stacks.ready(str(path))
    starting = subprocess.Popen(["sleep", "30"])  # no handler yet: SIGUSR2 would kill it
    try:
        assert stacks.request({1: starting.pid}, {1: str(path)}) == {}
        time.sleep(0.1)
        assert starting.poll() is None, "a worker without its handler was signalled"
    finally:
        starting.kill()
        starting.wait()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _sleep_with_stack_handler(str(path), w)
        finally:
            os._exit(0)
    try:
        os.read(r, 1)
        assert stacks.ready(str(path))
        asked = stacks.request({1: pid}, {1: str(path)})
        assert asked == {1: str(path)}
        frames = stacks.collect(asked)[1]
        assert frames and frames[0][2] == "_sleep_with_stack_handler", frames
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the dump request killed the worker"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _mismatch(world):
    g = world.group()
    if world.rank == 0:
        g.all_reduce(torch.ones(4))
    else:
        g.broadcast(torch.ones(4), src_member=0)


def test_mismatched_collectives_raise_instead_of_corrupting():
    with pytest.raises(CollectiveMismatchError, match="all_reduce.*broadcast|broadcast.*all_reduce"):
        launch(_mismatch, 2, start_method="fork")


def _reduce_here(g):
    g.all_reduce(torch.ones(4))


def _broadcast_here(g):
    g.broadcast(torch.ones(4), src_member=0)


def _mismatch_noted(world):
    try:
        (_reduce_here if world.rank == 0 else _broadcast_here)(world.group())
    except CollectiveMismatchError as e:
        e.add_note(f"member {world.rank}'s program stood at its step {3 + world.rank}")  # as the layer above notes
        raise


def test_a_mismatch_is_reported_with_where_the_other_rank_was_and_what_it_noted():
    """Both members meet the mismatch and raise; the report is the first one's, and the other one's call and notes
    (a Trainer's loop position, from the layer above) stand beside it, so the two paths read side by side."""
    with pytest.raises(CollectiveMismatchError) as info:
        launch(_mismatch_noted, 2, start_method="fork")
    me = int(re.search(r"raised in lightning_shm worker rank (\d)", "\n".join(info.value.__notes__)).group(1))
    other = 1 - me
    assert info.value.peer == other
    notes = info.value.__notes__
    assert f"member {me}'s program stood at its step {3 + me}" in notes
    assert f"member {other}'s program stood at its step {3 + other}" in notes, notes
    where = [n for n in notes if n.startswith(f"rank {other} was here")]
    assert where and f"in {('_reduce_here', '_broadcast_here')[other]}" in where[0].splitlines()[1], notes
    assert f"raised in lightning_shm worker rank {other}" not in notes  # the launcher's own line, not the peer's note
    assert f"(ranks [{other}] met the same mismatch on their side)" in notes  # not "stopped because rank {me} failed"
    assert not any("stopped because" in n for n in notes), notes


def _size_mismatch(world, n):
    world.group().all_reduce(torch.ones(n + world.rank))


@pytest.mark.parametrize("n", [4, 300_000])
def test_mismatched_sizes_raise(n):
    """Also where the sizes differ only after the first slot of 1 MiB (a pair reduces any size one-shot, a chunk
    per barrier: the first barrier announces the whole size)."""
    with pytest.raises(CollectiveMismatchError, match=f"numel={n}.*numel={n + 1}|numel={n + 1}.*numel={n}"):
        launch(_size_mismatch, 2, n, start_method="fork")


def _site_mismatch(world, shared):
    g = world.group()
    x = g.alloc_shared(8).local if shared else torch.ones(8)  # shared: the zero-copy path
    g.reduce_scatter_coalesced([x], "mean", site=1 + world.rank)  # equal kinds, dtypes and sizes


@pytest.mark.parametrize("shared", [False, True])
def test_reduce_scatters_from_different_sites_raise(shared):
    """Two FSDP units of equal sizes reduced in different orders would exchange gradients: the site tells them apart."""
    with pytest.raises(CollectiveMismatchError, match="reduce=mean.*site=1.*site=2|site=2.*site=1") as info:
        launch(_site_mismatch, 2, shared, start_method="fork")
    # the descriptors travel with the error to the main process, for a caller that names its sites
    assert {site_of(info.value.mine["arg"]), site_of(info.value.theirs["arg"])} == {1, 2}


_WHY = barrier_reason("a test: member 0 waits here")


def _barrier_and_reduce(world):
    g = world.group()
    g.barrier(why=_WHY)  # any two barriers match, whatever their reasons
    g.barrier(why=0 if world.rank else _WHY)
    if world.rank == 0:
        g.barrier(why=_WHY)
    else:
        g.all_reduce(torch.ones(4))


def test_a_member_meeting_a_barrier_in_another_collective_says_why_the_barrier_waits():
    """Whichever member raises first, its error says why the other waits (the reason travels in the descriptor)."""
    with pytest.raises(CollectiveMismatchError, match=r"barrier\(collective #\d+, .*why: a test: member 0 waits here"
                       ) as info:
        launch(_barrier_and_reduce, 2, start_method="fork")
    assert {info.value.mine["coll"], info.value.theirs["coll"]} == {Coll.BARRIER, Coll.ALL_REDUCE}


_ONE_VOTE, _ANOTHER_VOTE = barrier_reason("a test: a vote on one thing"), barrier_reason("a test: a vote on another")


def _votes_on_different_things(world):
    g = world.group()
    assert g.vote_max(world.rank, _ONE_VOTE) == 1  # the same reason: each member's value, the largest returned
    g.vote_max(7, _ONE_VOTE if world.rank == 0 else _ANOTHER_VOTE)


def test_votes_of_different_reasons_do_not_match():
    """A member voting on one thing (a stop request) must not take another's vote on something else (a stop the
    program decided) as its answer: the reasons travel in the descriptors and are named."""
    said = r"vote\(collective #2, why: a test: a vote on (one thing|another), value=7\) but rank \d entered vote\("
    with pytest.raises(CollectiveMismatchError, match=said):
        launch(_votes_on_different_things, 2, start_method="fork")


_ONE_THING, _ANOTHER_THING = barrier_reason("a test: objects of one kind"), barrier_reason("a test: objects of another")


def _object_collectives_of_different_things(world, kind):
    g = world.group()
    theirs = _ONE_THING if world.rank == 0 else _ANOTHER_THING
    if kind == "gather":
        assert g.all_gather_object(world.rank, _ONE_THING) == [0, 1]  # the same reason: every member's object
        g.all_gather_object({"state": 1} if world.rank == 0 else [1, 2], theirs)
    else:
        assert g.broadcast_object("x" if world.rank == 1 else None, 1, _ONE_THING) == "x"
        g.broadcast_object("y" if world.rank == 0 else None, 0, theirs)


@pytest.mark.parametrize("kind, said", [
    ("gather", r"all_gather_v\(collective #2, dtype=uint8, numel=\d+, why: a test: objects of (one kind|another)\) "
               r"but rank \d entered all_gather_v\(collective #2, dtype=uint8, numel=\d+, why: a test: objects of"),
    ("broadcast", r"broadcast_object\(collective #2, dtype=uint8, numel=-?\d+, src_member=0, why: a test: objects "
                  r"of (one kind|another)\) but rank \d entered broadcast_object\(.*src_member=0, why: a test:")])
def test_object_collectives_of_different_reasons_do_not_match(kind, said):
    """Gathers of pickled objects always matched (their lengths differ anyway), so a rank on another path got the
    other's object to unpickle: "AttributeError: 'list' object has no attribute 'items'" where the stages' state
    entries met another gather (pp2, a stop at the fit's start on stage 0 alone, before that stop was voted on).
    Their reasons travel in the descriptors, as a reduce op does, and are named."""
    with pytest.raises(CollectiveMismatchError, match=said):
        launch(_object_collectives_of_different_things, 2, kind, start_method="fork")


def _all_fail(world):
    g = world.group()
    agreed = g.agree_failed(step=5, timeout_s=10.0)
    return agreed, float(g.all_reduce(torch.ones(3) * (world.rank + 1)).sum())  # collectives still run together


def _fail_at_step(world):
    return world.group().agree_failed(step=world.rank, timeout_s=10.0)


def test_ranks_that_all_failed_at_the_same_step_agree_and_still_run_collectives():
    assert launch(_all_fail, 3, start_method="fork") == [(True, 18.0)] * 3
    assert launch(_fail_at_step, 2, start_method="fork") == [False, False]  # not the same step: nothing to share


def _stale_mark(world):
    g = world.group()
    assert g.agree_failed(step=1, timeout_s=10.0)
    if world.rank == 1:  # as if not yet awake in agree_failed's wait: its mark there outlives the barrier
        world.waiter.board.publish(FAILED, [0])
        time.sleep(0.6)  # longer than check_s: rank 0 reads the board while it waits below
        world.waiter.board.clear()
    return float(g.all_reduce(torch.ones(2)).sum())  # a collective of their failure handling (a checkpoint's)


def test_after_agreeing_a_rank_still_marked_as_failed_is_waited_for():
    """Seen 1 run in 8 at dp2 x pp2 on 2 cores: the checkpoint's first collective raised PeerFailedError, the
    mark of a rank that had not yet woken up from the agreement read as a new failure."""
    assert launch(_stale_mark, 2, start_method="fork") == [4.0, 4.0]


def _one_fails(world, where, seen):
    g = world.group()
    g.barrier()
    if world.rank == 1:
        agreed = g.agree_failed(step=0, timeout_s=30.0)
        raise ValueError(f"rank 1's own error, agreed={agreed} at={time.time()}")
    try:
        if where == "collective":  # rank 0 meets rank 1's failure barrier in the same group
            g.all_reduce(torch.ones(4))
        elif where == "barrier":  # ... which matches no other barrier, whatever its reason
            g.barrier()
        elif where == "other group":  # ... or waits for rank 1 in another group
            world.group(name="other").all_reduce(torch.ones(4))
        else:  # ... or in a channel from rank 1
            world.channel(1, 0, "x").recv()
    except Exception as e:
        Path(seen).write_text(f"{type(e).__name__}: {e}")
        raise


@pytest.mark.parametrize("where, consequence", [
    ("collective", "PeerAbortedError: group [0, 1]: rank 1 failed"),
    ("barrier", "PeerAbortedError: group [0, 1]: rank 1 failed"),
    ("other group", "PeerFailedError: rank 1 failed: it stopped at its error while this rank waited for it in a "
                    "collective (all_reduce)"),
    ("channel", "PeerFailedError: rank 1 failed: it stopped at its error while this rank waited for it in a receive")])
def test_a_rank_failing_alone_is_reported_at_once_and_the_waiting_rank_as_its_consequence(tmp_path, where,
                                                                                          consequence):
    """The others never fail: rank 1 does not wait for them (30 s here), rank 0's wait ends as a consequence
    (PeerAbortedError, or PeerFailedError within check_s where it waits elsewhere), and the report is rank 1's."""
    seen = tmp_path / "rank0.txt"
    with pytest.raises(ValueError, match="rank 1's own error, agreed=False") as info:
        launch(_one_fails, 2, where, str(seen), start_method="fork")
    assert time.time() - _at(info.value) < LIMIT_S
    assert "(ranks [0] stopped because rank 1 failed)" in info.value.__notes__
    assert seen.read_text().startswith(consequence), seen.read_text()


def _join_from_a_channel(world):
    g = world.group()
    if world.rank == 0:
        return g.agree_failed(step=2, timeout_s=30.0), None
    try:
        world.channel(0, 1, "act").recv()  # a pipeline's last stage, waiting for an activation never sent
    except PeerFailedError as e:
        return g.agree_failed(step=2, timeout_s=30.0), (e.rank, e.joinable)
    return None, None


def test_a_rank_waiting_in_a_channel_for_a_failed_rank_joins_it():
    t0 = time.monotonic()
    assert launch(_join_from_a_channel, 2, start_method="fork") == [(True, None), (True, (0, True))]
    assert time.monotonic() - t0 < 10


def _exit_silently(world):
    world.group().barrier()
    if world.rank == 1:
        os.write(2, b"rank 1 says goodbye on stderr\n")  # fd 2: pytest swaps sys.stderr for its own file
        os._exit(3)
    world.group().barrier()


def test_worker_exiting_without_result_is_reported_with_its_last_words():
    with pytest.raises(WorkerDiedError, match="rank 1 .* exited with code 3") as info:
        launch(_exit_silently, 2, start_method="fork")
    assert any("rank 1 says goodbye on stderr" in n for n in info.value.__notes__)


def test_free_space_check_says_how_much_and_how_to_fix():
    with pytest.raises(SharedMemoryFullError, match=r"needs .* MiB .* --shm-size"):
        check_free_space(1 << 50)


def test_segments_are_private_and_removed():
    seg = Segment.create(10_000, "unit-test")
    try:
        mode = os.stat(f"/dev/shm/{seg.name}").st_mode & 0o777
        assert mode == 0o600
        assert seg.name.startswith(f"{PREFIX}_{os.getpid()}.")
        assert seg.name in list_owned()
        view = seg.tensor(torch.float32, 64, 10)
        view.fill_(3.0)
        seg.close()  # a live view must not crash close() nor dangle
        assert float(view.sum()) == 30.0
    finally:
        seg.unlink()
    assert seg.name not in list_owned()


# ---------------------------------------------------------------------- the main process and its signals
_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    from lightning_shm.runtime import launch

    def loop(world):
        g = world.group()
        x = torch.ones(1000)
        while True:
            g.all_reduce(x)
            time.sleep(0.001)

    if __name__ == "__main__":
        print("started", flush=True)
        try:
            launch(loop, 2, start_method=sys.argv[1])
        finally:  # when launch gave up; the interpreter's exit with torch loaded comes after
            print("raised", time.monotonic(), flush=True)
    """
)


def _run_script(tmp_path: Path, start_method: str) -> subprocess.Popen:
    script = tmp_path / "loop.py"
    script.write_text(_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), start_method], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_descendants(proc.pid)) < 2:
        time.sleep(0.05)
    while time.monotonic() < deadline and not any(n.endswith("_group-0-1") for n in list_owned(proc.pid)):
        time.sleep(0.05)  # the workers run their loop once the group segment exists
    assert len(_descendants(proc.pid)) >= 2, "workers did not start"
    return proc


def _descendants(pid: int) -> list[int]:
    """Children and their children (a fork server's workers are its children, not the main process's)."""
    out = [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
    return out + [d for c in out for d in _descendants(c)]


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting to be reaped counts as gone; the file may vanish while we read it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


# SIGINT ends in KeyboardInterrupt, which an interpreter left by it reports as death by SIGINT. Each signal and
# each start method once (a fresh interpreter costs the suite 12-25 s); tests/test_interrupts.py sends both
# signals to a main process whose workers a fork server started.
@pytest.mark.parametrize("start_method, sig, rc", [("fork", signal.SIGTERM, 128 + signal.SIGTERM),
                                                   ("forkserver", signal.SIGINT, -signal.SIGINT)])
def test_signal_to_main_process_stops_workers_and_cleans_up(tmp_path, start_method, sig, rc):
    proc = _run_script(tmp_path, start_method)
    workers = _descendants(proc.pid)
    t0 = time.monotonic()
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == rc
    # launch stopped the workers and raised within LIMIT_S (CLOCK_MONOTONIC is system-wide); the
    # interpreter's own exit with torch loaded is the user's process, not timed (seconds on a busy VM)
    raised = [float(line.split()[1]) for line in proc.stdout.read().splitlines() if line.startswith("raised ")]
    assert raised and raised[0] - t0 < LIMIT_S, (raised, t0)
    assert list_owned(proc.pid) == []
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}_{proc.pid}.")], "lock file left"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all(_gone(w) for w in workers):
        time.sleep(0.05)
    assert all(_gone(w) for w in workers)


def _rank_1_still_starting(world) -> None:
    if world.rank == 0:
        world.stop_requested()  # rank 0 polls: it reached a point where it could stop with the others
        os.kill(os.getppid(), signal.SIGTERM)  # the main process (this test's): as kill, or a scheduler
    time.sleep(60)  # rank 1: a long setup or a rendezvous, no point to stop at; rank 0: waiting for it


def test_a_signal_while_a_rank_is_still_starting_stops_the_workers_at_once(caplog):
    """With graceful stops the first SIGINT / SIGTERM asks the workers to stop together at their next safe point,
    which a rank that has not polled yet (setup, a multi-node rendezvous, a hook before the first step) may not
    reach for minutes: the main process waited ``stop_grace_s`` (60 s) before stopping them -- 61 s after a
    Ctrl-C during a long ``setup``, where one process stops at once."""
    launcher = Launcher(LaunchConfig(2, start_method="fork", graceful_stop=True))
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as info, caplog.at_level("WARNING", logger="lightning_shm.runtime.launcher"):
        launcher.run(_rank_1_still_starting)
    assert time.monotonic() - t0 < 15, "the workers were left to reach a safe point"
    assert info.value.code == 128 + signal.SIGTERM and launcher.stop_signal == signal.SIGTERM
    assert "received SIGTERM before rank 1 reached a first step" in caplog.text  # not rank 0: it polled
    assert list_owned(os.getpid()) == []


def _every_rank_polls(world) -> int:
    world.stop_requested()
    world.group().barrier()
    if world.rank == 0:
        os.kill(os.getppid(), signal.SIGTERM)
    deadline = time.monotonic() + 30
    while not world.stop_requested() and time.monotonic() < deadline:
        time.sleep(0.01)
    return world.stop_requested()


def test_once_every_rank_polls_a_signal_is_a_request_to_stop_together():
    launcher = Launcher(LaunchConfig(2, start_method="fork", graceful_stop=True))
    assert launcher.run(_every_rank_polls) == [signal.SIGTERM, signal.SIGTERM]
    assert launcher.stop_signal == signal.SIGTERM


def _owned_by(pid: int) -> list[str]:
    """Everything in /dev/shm of owner ``pid``: its segments and its lock file."""
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}_{pid}.")]


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])  # forkserver: not the workers' parent
@pytest.mark.parametrize("killed", ["main", "group"])
def test_sigkill_of_main_kills_workers_and_its_segments_go(tmp_path, start_method, killed):
    """SIGKILL runs no clean-up in the main process. Killed alone, multiprocessing's resource tracker, a process
    of its own, unlinks its segments (until 2026-12-07 they stayed in /dev/shm until another run's sweep, if one
    ever came); killed with its whole process group -- the tracker too, as a scheduler or ``docker kill`` does --
    the next run's sweep removes them."""
    proc = _run_script(tmp_path, start_method)
    workers = _descendants(proc.pid)
    assert workers and len(_owned_by(proc.pid)) >= 2
    if killed == "group":
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (all(_gone(w) for w in workers) and (
            killed == "group" or not _owned_by(proc.pid))):
        time.sleep(0.05)
    assert all(_gone(w) for w in workers), "workers survived their parent"
    leftovers = _owned_by(proc.pid)
    if killed == "main":
        assert leftovers == [], "the resource tracker left the killed main process's segments"
        return
    assert len(leftovers) >= 2, "the tracker died with the group: the segments are expected to be left for the sweep"
    removed = sweep_stale()
    assert set(leftovers) <= set(removed)  # segments and the dead owner's lock file
    assert _owned_by(proc.pid) == []


# ---------------------------------------------------------------------- the sweep across PID namespaces
_HOLD = textwrap.dedent(
    """
    import sys
    from lightning_shm.runtime.segment import Segment, sweep_stale
    seg = Segment.create(4096, "held")
    print(seg.name, flush=True)
    print(",".join(sweep_stale()), flush=True)   # what a run starting in this namespace would remove
    sys.stdin.readline()                         # live until told to go
    seg.close(); seg.unlink()
    """
)

needs_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a second PID namespace needs root and util-linux's unshare",
)


@needs_unshare
def test_sweep_spares_live_owners_in_another_pid_namespace():
    """Liveness by pid is meaningless across PID namespaces (docker --ipc=host): the owner lock is not."""
    mine = Segment.create(4096, "mine")
    proc = subprocess.Popen(["unshare", "-pf", "--mount-proc", sys.executable, "-c", _HOLD], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theirs = proc.stdout.readline().strip()
        removed_there = proc.stdout.readline().strip().split(",")
        assert theirs.startswith(f"{PREFIX}_1.") or theirs.startswith(f"{PREFIX}_2."), theirs  # pid 1/2 in there
        assert mine.name not in removed_there  # the other namespace did not delete our live segment
        assert os.path.exists(os.path.join(SHM_DIR, mine.name))
        assert theirs not in sweep_stale()  # nor do we delete theirs, though no process here has its pid
        assert os.path.exists(os.path.join(SHM_DIR, theirs))
    finally:
        proc.communicate("\n", timeout=30)
        mine.close()
        mine.unlink()
    assert not os.path.exists(os.path.join(SHM_DIR, theirs))


_NORMAL_EXIT = textwrap.dedent(
    """
    import os
    from lightning_shm.runtime import launch

    if __name__ == "__main__":
        print(os.getpid(), sum(launch(lambda world: world.rank, 2, start_method="fork")), flush=True)
    """
)


def test_a_run_that_ends_well_leaves_the_resource_tracker_nothing():
    """Every segment the main process registered with the tracker it unregistered as it unlinked it: the tracker,
    which exits after the main process, has nothing to unlink and says nothing ("There appear to be N leaked
    shared_memory objects")."""
    out = subprocess.run([sys.executable, "-c", _NORMAL_EXIT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    pid, ranks = map(int, out.stdout.split())
    assert ranks == 1 and "resource_tracker" not in out.stderr, out.stderr[-3000:]
    assert _owned_by(pid) == []


def test_sweep_removes_what_a_dead_owner_left():
    """The owner killed with its process group, its resource tracker with it (which alone would unlink them)."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    name = proc.stdout.readline().strip()
    proc.stdout.readline()
    assert name not in sweep_stale()  # alive: kept
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    removed = sweep_stale()
    lock = name.split("_")[0] + "_" + name.split("_")[1] + ".lock"
    assert name in removed and lock in removed


# ---------------------------------------------------------------------- workers that die during start-up
_NO_GUARD = textwrap.dedent(
    """
    import torch
    from lightning_shm.runtime import launch

    def work(world, blob):
        return len(blob)

    print("main process started", flush=True)
    launch(work, 2, b"x" * (8 << 20), start_method="spawn")   # no __main__ guard; an 8 MiB job
    """
)


def test_spawned_worker_dying_at_start_up_surfaces_its_own_error(tmp_path):
    """The spawned interpreter re-imports a script without the ``__main__`` guard and dies before any
    of our code runs. The main process must neither block (the 8 MiB job once went through a pipe
    the dead child never read) nor stay silent: it raises with the child's own last words."""
    script = tmp_path / "no_guard.py"
    script.write_text(_NO_GUARD)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - t0 < 60
    assert out.returncode != 0
    assert "WorkerDiedError" in out.stderr, out.stderr[-3000:]
    assert "last lines rank" in out.stderr and "bootstrapping phase" in out.stderr, out.stderr[-3000:]


def _train_in_a_sweep_trial(q) -> None:
    """A multiprocessing child that launches a world of its own (a hyperparameter sweep's trial)."""
    from lightning_shm.runtime.segment import owner_token

    q.put((owner_token(), launch(_rank_of, 2, start_method="fork")))


def _rank_of(world) -> int:
    return world.rank


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_a_multiprocessing_child_that_trained_leaves_no_lock_file(context):
    """multiprocessing's fork / forkserver children leave with os._exit, skipping atexit: the owner's lock
    file is dropped by a multiprocessing finalizer too, which those children run."""
    import multiprocessing as mp

    ctx = mp.get_context(context)
    q = ctx.Queue()
    p = ctx.Process(target=_train_in_a_sweep_trial, args=(q,))
    p.start()
    token, ranks = q.get(timeout=120)
    p.join(timeout=60)
    assert p.exitcode == 0 and ranks == [0, 1]
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}_{token}")], "lock file left"


_MARKER = textwrap.dedent(
    """
    import atexit, os

    # imported by the fork server (its preload): the server and each worker forked from it hold this handler
    atexit.register(lambda: open(os.path.join(os.environ["MARKS"], str(os.getpid())), "w").close())
    """
)
_SERVER_MAIN = textwrap.dedent(
    """
    import os
    from lightning_shm.runtime import LaunchConfig, Launcher

    def pid(world):
        return os.getpid()

    if __name__ == "__main__":
        print(*Launcher(LaunchConfig(2, start_method="forkserver", preload=("server_marker",))).run(pid))
    """
)


def test_the_fork_server_leaves_without_an_interpreter_shutdown(tmp_path):
    """The fork server outlives the main process by its interpreter shutdown (torch loaded: 1.2 s here) and
    holds the main process's stdout meanwhile: a reader of that output (a shell pipe, this test) waits for it.
    It leaves with os._exit at its first exit handler: a handler registered before it (by a module the server
    imported earlier, as torch does) never runs there; the workers forked from it still run theirs."""
    (tmp_path / "server_marker.py").write_text(_MARKER)
    (tmp_path / "main.py").write_text(_SERVER_MAIN)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = dict(os.environ, MARKS=str(marks), PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    out = subprocess.run([sys.executable, str(tmp_path / "main.py")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)  # returns once the server has closed stdout too
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(os.listdir(marks)) == sorted(out.stdout.split()), "the server ran its handlers, or a worker did not"


def test_where_a_rank_was_reaches_the_programs_own_line_past_library_frames():
    """A collective inside a library's layer (a tp layer's all-gather, under torch's module call) showed four
    frames of libraries and not the program's line that ran the model -- a callback running it on rank 0 alone."""
    from lightning_shm.runtime import stacks

    runtime = os.path.dirname(os.path.abspath(stacks.__file__))
    package = os.path.dirname(runtime)
    site = "/venv/lib/python3.11/site-packages"
    frames = [(f"{runtime}/wait.py", 88, "wait_ge"), (f"{package}/parallel/tp/mappings.py", 89, "_gather"),
              (f"{package}/parallel/tp/layers.py", 95, "forward"),
              (f"{site}/torch/nn/modules/module.py", 1794, "_call"),
              (f"{site}/torch/nn/modules/module.py", 1783, "_wrapped"), (f"{site}/lightning/a.py", 3, "hook"),
              ("/home/me/train.py", 41, "on_train_epoch_end"), ("/home/me/train.py", 90, "main")]
    said = stacks.describe(0, frames)
    assert said.splitlines()[1:] == [
        f'    File "{package}/parallel/tp/mappings.py", line 89, in _gather',
        f'    File "{package}/parallel/tp/layers.py", line 95, in forward',
        f'    File "{site}/torch/nn/modules/module.py", line 1794, in _call',
        f'    File "{site}/torch/nn/modules/module.py", line 1783, in _wrapped',
        "    ... 1 frames of libraries ...",
        '    File "/home/me/train.py", line 41, in on_train_epoch_end']
    # the program's own frame among the innermost four: those four alone, as before
    assert stacks.describe(0, frames[:2] + frames[6:]).splitlines()[1:] == [
        f'    File "{package}/parallel/tp/mappings.py", line 89, in _gather',
        '    File "/home/me/train.py", line 41, in on_train_epoch_end',
        '    File "/home/me/train.py", line 90, in main']
