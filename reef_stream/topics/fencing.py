"""Transactional identities: a writer's producer, the fences it survives, the watchdog.

Every writer whose records others act on writes through a Kafka transaction with a stable
transactional id, so a newer instance fences every older one (``FENCED_CODES``: the errors
that say so; a fatal error of another code is the producer's own state, not a fence). The
processor's is ``reef-process.<ns>.<recipe>.<group>.<instance>``, the trainer's
``reef-train.<ns>.<recipe>.<group>`` (``consumers.trainer``), the evaluator's
``reef-evaluate.<ns>.<recipe>`` (``consumers.evaluator``). A restarted
instance fences its predecessor and aborts its open transaction at ``init_transactions``
(``TransactionalIdentity.new_producer``), so nothing waits for ``transaction.timeout.ms``.
A fence this process can survive (its own consumer fenced as a static member after the
group coordinator moved; its producer fenced by the broker for a transaction open past its
timeout) is recovered from at most ``MAX_REJOINS`` times in ``REJOIN_WINDOW_S``
(``TransactionalIdentity.count``); whether the transactional id is still this instance's is
proved by committing one harmless tombstone (``TransactionalIdentity.prove``). The
recovery policy itself is ``ProcessorRuntime._rejoin`` and ``_renew_producer``.

``CommitWatchdog`` reports a transaction stuck inside librdkafka (see its docstring), and
``exit_for_restart`` ends the stage's process with ``EXIT_RESTART`` for its supervisor.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from reef_stream.core.errors import FatalError
from reef_stream.core.settings import DEFAULT_STUCK_COMMIT_S
from reef_stream.topics.connect import new_producer
from reef_stream.topics.declarations import MiB
from reef_stream.topics.kafka import KafkaError, KafkaException, Producer

log = logging.getLogger(__name__)

#: The exit status of a stage that asks its supervisor to start it again (EX_TEMPFAIL): a
#: transaction stuck inside librdkafka (``CommitWatchdog``).
EXIT_RESTART = 75
#: Fences recovered from (consumer rejoins and producer renewals together) at most this often
#: in ``REJOIN_WINDOW_S`` seconds.
MAX_REJOINS = 3
REJOIN_WINDOW_S = 600.0
#: The changelog key of ``TransactionalIdentity.prove``'s tombstone (no state has it).
PROBE_KEY = b"reef.probe"


#: Errors that mean a newer producer holds this transactional id.
FENCED_CODES = frozenset({KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                          KafkaError.INVALID_PRODUCER_EPOCH})


class TransactionalIdentity:
    """One processor instance's transactional id, and the fences it recovered from.

    ``probe_topic`` (the changelog) takes ``prove``'s tombstone on partition 0. Not
    thread-safe: the processor's loop uses it."""

    def __init__(self, bootstrap: str, transactional_id: str, *, timeout_ms: int,
                 probe_topic: str, instance: str) -> None:
        self.bootstrap, self.transactional_id = bootstrap, transactional_id
        self.timeout_ms, self.probe_topic, self.instance = timeout_ms, probe_topic, instance
        self._recoveries: list[float] = []  # when a fence was last recovered from (monotonic)

    def new_producer(self) -> Producer:
        """A producer with this transactional id, initialised: its ``init_transactions``
        fences any earlier producer of the id and aborts its open transaction. Blocks (up
        to 60 s)."""
        producer = new_producer(self.bootstrap, {
            "transactional.id": self.transactional_id,
            "transaction.timeout.ms": self.timeout_ms,
            "linger.ms": 5,
            "compression.type": "lz4",
            "message.max.bytes": 16 * MiB + 1024,
        })
        producer.init_transactions(60)
        return producer

    def count(self, fenced: FatalError) -> None:
        """Note one recovery from a fence; ``fenced`` is raised past ``MAX_REJOINS`` of them
        (consumer rejoins and producer renewals together) within ``REJOIN_WINDOW_S``."""
        now = time.monotonic()
        self._recoveries = [t for t in self._recoveries if now - t < REJOIN_WINDOW_S] + [now]
        if len(self._recoveries) > MAX_REJOINS:
            raise FatalError(f"{fenced}; fenced {len(self._recoveries)} times within "
                             f"{REJOIN_WINDOW_S:.0f} s: is another processor running with "
                             f"--instance {self.instance}?") from fenced

    def prove(self, producer: Producer, fenced: FatalError) -> None:
        """Commit a transaction of one harmless tombstone (``PROBE_KEY``) with ``producer``;
        ``FatalError`` if it fails (a newer instance holds the transactional id). Blocks."""
        try:
            producer.begin_transaction()
            producer.produce(self.probe_topic, partition=0, key=PROBE_KEY, value=None)
            producer.commit_transaction(60)
        except KafkaException as exc:
            raise FatalError(f"{fenced}, and the transactional id is fenced too: "
                             f"{exc.args[0]}") from exc


class CommitWatchdog:
    """Reports a writer's transaction still open ``stuck_after_s`` after it began (the
    stages pass ``Settings.stuck_commit_s``, ``REEF_STUCK_COMMIT_S``; a healthy transaction
    commits in well under a second).

    librdkafka's ``send_offsets_to_transaction`` can wait forever, past its timeout, for a
    group coordinator that was killed (confluentinc/librdkafka#5456, #5511, open). Nothing
    in the process can end that call, so the watchdog tells ``on_stuck(why)``: the CLI's
    stages pass ``exit_for_restart``, which ends the process with ``EXIT_RESTART`` for its
    supervisor to start it again. That is as safe as any crash: the next instance's
    ``init_transactions`` aborts the open transaction. None: logged only (a stage run inside
    another program, as in tests).

    The writer calls ``begin()`` before its transaction and ``end()`` after it, in a
    ``finally``; ``start(stopped)`` runs the watch on a thread of its own until ``stopped``.
    Every transactional writer has one: the processor, the trainer, the evaluator (the
    broker-fault test saw the evaluator stay stuck so after a controller was killed).
    """

    def __init__(self, name: str, on_stuck: Callable[[str], None] | None = None, *,
                 stuck_after_s: float = DEFAULT_STUCK_COMMIT_S) -> None:
        self.name, self.on_stuck, self.stuck_after_s = name, on_stuck, stuck_after_s
        #: When the open transaction began (monotonic); None when none is open.
        self.began: float | None = None

    def begin(self) -> float:
        """A transaction begins now; returns when (monotonic)."""
        self.began = time.monotonic()
        return self.began

    def end(self) -> None:
        self.began = None

    def start(self, stopped: threading.Event) -> None:
        """Watch on a daemon thread until ``stopped`` is set."""
        threading.Thread(target=self.watch, args=(stopped,), name="reef-commit-watchdog",
                         daemon=True).start()

    def watch(self, stopped: threading.Event, every_s: float = 1.0) -> None:
        """Until ``stopped``: report each transaction still open ``stuck_after_s`` after it
        began, once. Blocks."""
        reported = None
        while not stopped.wait(every_s):
            since = self.began
            if since is None or since == reported \
                    or time.monotonic() - since < self.stuck_after_s:
                continue
            reported = since
            why = (f"a transaction has not committed {self.stuck_after_s:g} s after it began "
                   "(librdkafka can wait forever on a group coordinator that died: "
                   "confluentinc/librdkafka#5456)")
            log.critical("%s: %s", self.name, why)
            if self.on_stuck is not None:
                self.on_stuck(why)


def exit_for_restart(stage: str) -> Callable[[str], None]:
    """A ``CommitWatchdog``'s ``on_stuck`` for a stage's own process: end it now with
    ``EXIT_RESTART`` (its main thread is blocked in librdkafka, so nothing else can)."""
    def on_stuck(why: str) -> None:
        print(f"error: {why}; exiting with status {EXIT_RESTART} for a supervisor to restart "
              f"this {stage} (nothing committed is lost)", file=sys.stderr, flush=True)
        os._exit(EXIT_RESTART)
    return on_stuck
