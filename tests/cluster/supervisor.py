"""An orchestrator for the cluster scenario: a stage whose host was lost starts again on a spare.

    supervisor = Supervisor(hosts, demo, say=print)
    supervisor.kill("processor")    # SIGKILL its host; the processor starts on processor-b
    supervisor.pause("trainer")     # SIGSTOP its host; the trainer starts on trainer-b, ...
    supervisor.resume("trainer")    # ... and the old one wakes up: a zombie, to be fenced
    supervisor.finish(fenced)       # after the run: what became of each old stage

The stages it may replace are ``SUPERVISED`` and the other members of their groups
(``processor-2``, ``evaluator-2``: ``faults.supervised``): each runs alone on the host of its
name, and its spare is ``<host>-b`` (``spare_host``), made with the other hosts before the run
(``spare_hosts``). A replacement starts ``REPLACE_DELAY_S`` after the host was lost (an
orchestrator notices late) and runs the stage's command unchanged on the spare: the same
broker, Redis and checkpoint store (the hosts share one filesystem). The demo retires the old
stage at once (``Demo.retire``; ``Demo.supersede`` adds the replacement): its death is no
failure of the run, and a paused one left running is the zombie the stage's own fence must
stop at its first write (the trainer's and the evaluator's Kafka transactions, the
processor's transactional id), or, an evaluator, that its consumer group tells to stand by.
A stage is replaced at most once a run (one spare each).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from reef_stream.demo.run import Demo, Stage, member_of
from tests.cluster.faults import SUPERVISED, supervised
from tests.cluster.hosts import Hosts

#: Seconds between the loss of a stage's host and the start of its replacement.
REPLACE_DELAY_S = 5.0
#: Seconds ``pause`` waits, at most, for the replacement to hold the fence (``pause``).
REPLACEMENT_STEP_WAIT_S = 240.0
#: What a replacement's log says once it holds its stage's fence (``pause`` waits for it;
#: the trainer's is its first step, read from the demo's metrics instead).
FENCE_TAKEN = {"evaluator": "any older evaluator of the recipe is fenced"}
#: What an evaluator's log says when the group took the checkpoints from it: it writes nothing
#: more until assigned them again (a resumed evaluator rejoins its group, and one that learns
#: of the revocation before it writes is never fenced).
GAVE_UP_FENCE = "so it gave up the fence"
#: Fault kinds that make the supervisor replace a stage (``tests.cluster.faults.KINDS``).
REPLACING_KINDS = ("kill", "pause-replace")


def _text(log: Path) -> str:
    try:
        return log.read_text(errors="replace")
    except OSError:
        return ""


def _holds_fence(kind: str, log: str) -> bool:
    """Whether a stage's log (an evaluator's) says it holds its fence now: it took it
    (``FENCE_TAKEN``) after it last gave it up (``GAVE_UP_FENCE``)."""
    return log.rfind(FENCE_TAKEN[kind]) > log.rfind(GAVE_UP_FENCE)


def spare_host(host: str) -> str:
    """The host a supervised stage of ``host`` is replaced on."""
    return f"{host}-b"


def spare_hosts(faults: Iterable) -> list[str]:
    """The spares a run of ``faults`` (``tests.cluster.faults.Fault``) needs: one per
    supervised stage whose host a fault kills or pauses for a replacement. Raises ValueError
    for a stage replaced twice (one spare each)."""
    hosts = [f.host for f in faults if f.kind in REPLACING_KINDS and supervised(f.host)]
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"a supervised stage is replaced at most once a run: {hosts}")
    return [spare_host(h) for h in hosts]


@dataclass
class Replacement:
    """One stage replaced: how its host was lost (``kill`` or ``pause``), when (monotonic
    seconds), and, after ``Supervisor.finish``, what became of the old process."""

    stage: str
    how: str
    spare: str
    lost_at: float
    #: The replacement stage (None until it was asked for).
    new: Stage | None = None
    #: The old host's processes that were paused (``pause``), resumed by ``resume``.
    paused: list[int] = field(default_factory=list)
    resumed_at: float | None = None
    #: The old stage's exit status at the end of the run (None: still running then).
    old_status: int | None = None
    #: Lines of the old stage's log that say a write of it was fenced.
    old_fenced: int = 0
    #: Processes left on the old host at the end of the run, before the hosts were removed.
    left_on_host: list[int] = field(default_factory=list)
    #: Whether the replacement was started.
    new_started: bool = False
    #: The old stage's log size when it was resumed, and whether it said after that that it
    #: gave up its fence (``GAVE_UP_FENCE``: an evaluator that learnt of the revocation).
    log_at_resume: int = 0
    gave_up_fence: bool = False
    #: An evaluator: whether it held the recipe's fence when its host was lost (False: it
    #: stood by, another member decided).
    held_fence: bool = True

    def settled(self) -> bool:
        """What must have become of the old stage: gone, with nothing left on its host; a
        resumed one fenced at its first write (exited non-zero, its log says so), or, an
        evaluator, standing by: it gave up the fence when its group revoked its checkpoints."""
        if not self.new_started or self.left_on_host:
            return False
        if self.how == "kill":
            return self.old_status is not None
        fenced = self.old_status not in (None, 0) and self.old_fenced > 0
        standing_by = self.gave_up_fence or not self.held_fence
        return fenced or (member_of(self.stage) == "evaluator" and standing_by)

    def line(self) -> str:
        return (f"{self.stage}: {self.how}, replaced on {self.spare} (started "
                f"{self.new_started}), old exit {self.old_status}, fenced {self.old_fenced}"
                + (", gave up its fence" if self.gave_up_fence else "")
                + ("" if self.held_fence else ", stood by (held no fence)")
                + f", left on host {self.left_on_host}")


class Supervisor:
    """Replaces a supervised stage whose host a fault took (see the module docstring).
    ``kill``, ``pause`` and ``resume`` block; call them from one thread (the injector's)."""

    def __init__(self, hosts: Hosts, demo: Demo, say: Callable[[str], None] = print,
                 delay_s: float = REPLACE_DELAY_S) -> None:
        self.hosts, self.demo, self.say, self.delay_s = hosts, demo, say, delay_s
        self.replaced: dict[str, Replacement] = {}

    def kill(self, host: str) -> Replacement:
        """SIGKILL every process on ``host`` (a supervised stage's), then start the stage on
        its spare after ``delay_s``. Returns once the replacement is started."""
        one = self._retire(host, "kill")
        killed = self.hosts.kill_host(host)
        self.say(f"supervisor: {killed} processes killed on {host}")
        self._replace(one)
        return one

    def pause(self, host: str) -> Replacement:
        """SIGSTOP every process on ``host``, start the stage on its spare after ``delay_s``,
        and wait (up to ``REPLACEMENT_STEP_WAIT_S``) until the stage's fence is held again:
        the trainer's replacement trained a step; for an evaluator that held the recipe's fence,
        the log of another member of its group (the replacement's, or a standby's that the
        group handed the checkpoints) says ``FENCE_TAKEN`` (a standby paused: no wait);
        ``resume`` wakes the paused processes. Returns once the replacement is started (and
        the fence is held, or the wait ran out)."""
        one = self._retire(host, "pause")
        kind = member_of(host)
        others = []   # the group's other members and their logs' sizes now (an evaluator's)
        if kind in FENCE_TAKEN:
            one.held_fence = _holds_fence(kind, _text(self.demo.stages[host].log))
            others = [(stage, len(_text(stage.log))) for name, stage in self.demo.stages.items()
                      if member_of(name) == kind and name != host]
        one.paused = self.hosts.pids(host)
        for pid in one.paused:
            self.hosts.pause(pid)
        self.say(f"supervisor: {len(one.paused)} processes paused on {host}")
        steps = self.demo.steps
        self._replace(one)
        deadline = time.monotonic() + REPLACEMENT_STEP_WAIT_S
        if kind == "trainer":
            while self.demo.steps <= steps and one.new.alive and time.monotonic() < deadline:
                time.sleep(0.2)
            self.say(f"supervisor: the replacement trainer is at step {self.demo.steps}")
        elif kind in FENCE_TAKEN and one.held_fence:
            others.append((one.new, 0))

            def taken() -> str | None:
                return next((stage.name for stage, seen in others
                             if FENCE_TAKEN[kind] in _text(stage.log)[seen:]), None)
            while taken() is None and one.new.alive and time.monotonic() < deadline:
                time.sleep(0.5)
            self.say(f"supervisor: the {kind} fence is held again, by {taken()}")
        elif kind in FENCE_TAKEN:
            self.say(f"supervisor: {host} stood by (another member held the fence)")
        return one

    def resume(self, host: str) -> None:
        """SIGCONT the processes ``pause`` stopped on ``host``: the old stage runs on."""
        one = self.replaced[host]
        log = self.demo.stages[one.stage].log
        one.log_at_resume = log.stat().st_size if log.exists() else 0
        for pid in one.paused:
            try:
                self.hosts.resume(pid)
            except ProcessLookupError:
                pass
        one.resumed_at = time.monotonic()
        self.say(f"supervisor: {len(one.paused)} processes resumed on {host}")

    def finish(self, fenced: Callable[[Path], int]) -> dict[str, Replacement]:
        """After the demo's run (its stages stopped), before the hosts are removed: note each
        old stage's exit status, its fenced writes (``fenced(log)``: how many lines of the log
        say so) and the processes left on its host. Returns ``replaced``, by host."""
        for host, one in self.replaced.items():
            old = self.demo.stages[one.stage]
            process = old.process
            one.old_status = None if process is None else process.poll()
            one.old_fenced = fenced(old.log) if old.log.exists() else 0
            one.left_on_host = self.hosts.pids(host)
            one.new_started = one.new is not None and one.new.starts > 0
            one.gave_up_fence = one.resumed_at is not None and GAVE_UP_FENCE in \
                _text(old.log)[one.log_at_resume:]
        return self.replaced

    def _retire(self, host: str, how: str) -> Replacement:
        if not supervised(host):
            raise ValueError(f"the supervisor replaces the stages {', '.join(SUPERVISED)} and "
                             f"the other members of their groups, not {host!r}")
        if host in self.replaced:
            raise ValueError(f"the {host} stage was replaced already this run")
        self.demo.retire(host)
        one = Replacement(host, how, spare_host(host), time.monotonic())
        self.replaced[host] = one
        return one

    def _replace(self, one: Replacement) -> None:
        """After ``delay_s``, ask the demo for the replacement and wait until its loop
        started it (at its next check of the stages, about a second later)."""
        time.sleep(self.delay_s)
        one.new = self.demo.supersede(one.stage, one.spare, self.hosts.wrap(one.spare))
        deadline = time.monotonic() + 60
        while one.new.starts == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        if one.new.starts == 0:
            raise RuntimeError(f"the demo did not start the replacement {one.spare}")
        self.say(f"supervisor: {one.stage} started on {one.spare}")
