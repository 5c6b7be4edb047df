"""Where the broker's CPU goes: its requests, counted by client and by API, over one demo run.

    python bench/broker_requests.py [--seconds 75] [--device-model [SPEC]] [--replicas 2]
                                    [--rate 300] [--runs 1] [--code TREE,TREE,...]
                                    [--jvm=FLAG ...]

Starts one local broker whose request logger (``kafka.request.logger``) writes every completed
request at DEBUG to a file of its own, and one Redis; then runs ``reef demo`` ``--runs`` times
for ``--seconds`` each (a target no run reaches, so each gets the same traffic), each in a
fresh namespace. Meanwhile it maps each client connection's local port to the demo stage whose
process holds it (every second), so each request is put to a stage (``replica-0``,
``processor``, ``reward``, ``trainer``, ``evaluator``; ``demo`` is the demo's own process and
its watchers; ``broker`` the broker's connections to itself). Per run it prints the requests
per second by stage and API, the same per generation, the fetches' mean wait at the broker
(``remoteTimeMs``: how long a fetch was held for data), their totals by stage and by API,
the CPU of the broker's threads by name (the JIT's ``C2 CompilerThread``s, the request
threads ``data-plane-kafka-*``, ...) and the broker's CPU per generation:

    REQUESTS run=... stage=... api=... count=... per_s=... per_generation=...
    BY_STAGE run=... <stage>=<per s> ...        BY_API run=... <api>=<per s> ...
    BROKER_THREADS run=... <thread name>=<CPU s> ...
    BROKER run=... generated=... seconds=... requests_per_s=... broker_cpu_ms_per_generation=...

``--code``: one run per source tree given, in order, the stages importing ``reef_stream`` from
it (their PYTHONPATH), on the same broker: an A/B of two commits in one invocation, e.g.
``--code A,B,B,A`` with A and B two worktrees (a fresh broker compiles its hot paths over its
first minutes, so the same broker for both sides, in ABBA order). ``--jvm=FLAG``: a flag added
to the broker's JVM. Counts do not depend on the machine's load; CPU seconds do. Figures,
never assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from common import figure, run, run_and_say, say  # first: it sets sys.path

import psutil

from reef_stream.core.processes import free_ports
from reef_stream.core.settings import KAFKA_INFRA_DIR, load_settings
from reef_stream.demo.devices import DEFAULT_SPEC, DeviceModel
from reef_stream.demo.run import Demo, DemoOptions, process_cpu_seconds
from reef_stream.servers.kafka_local import LocalCluster
from reef_stream.servers.redis_local import LocalRedis

#: Kafka's API keys, by number, for those a demo's clients and the broker itself send.
API_NAMES = {
    0: "Produce", 1: "Fetch", 2: "ListOffsets", 3: "Metadata", 8: "OffsetCommit",
    9: "OffsetFetch", 10: "FindCoordinator", 11: "JoinGroup", 12: "Heartbeat",
    13: "LeaveGroup", 14: "SyncGroup", 15: "DescribeGroups", 16: "ListGroups",
    18: "ApiVersions", 19: "CreateTopics", 22: "InitProducerId", 24: "AddPartitionsToTxn",
    25: "AddOffsetsToTxn", 26: "EndTxn", 27: "WriteTxnMarkers", 28: "TxnOffsetCommit",
    32: "DescribeConfigs", 60: "DescribeCluster", 62: "BrokerRegistration",
    63: "BrokerHeartbeat", 71: "GetTelemetrySubscriptions", 72: "PushTelemetry",
}
COMPLETED = "Completed request:"
#: ``[2026-12-05 06:50:01,123] DEBUG Completed request:{...} (kafka.request.logger)``
LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\] \w+ " + re.escape(COMPLETED)
                  + r"(\{.*\}) \(kafka\.request\.logger\)$")

REQUEST_LOG4J = """
log4j.appender.requests=org.apache.log4j.FileAppender
log4j.appender.requests.File=${kafka.logs.dir}/requests.log
log4j.appender.requests.layout=org.apache.log4j.PatternLayout
log4j.appender.requests.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka.request.logger=DEBUG, requests
log4j.additivity.kafka.request.logger=false
"""


class LoggingCluster(LocalCluster):
    """A local cluster whose nodes log every completed request to ``requests.log``."""

    def __init__(self, *args, jvm_flags: tuple[str, ...] = (), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.jvm_flags = jvm_flags
        self.log4j = self.data_dir / "log4j-requests.properties"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        base = (KAFKA_INFRA_DIR / "log4j.properties").read_text()
        base = "\n".join(line for line in base.splitlines()
                         if not line.startswith("log4j.logger.kafka.request.logger"))
        self.log4j.write_text(base + REQUEST_LOG4J)

    def _jvm_flags(self, node):
        return [*(f"-Dlog4j.configuration=file:{self.log4j}" if flag.startswith("-Dlog4j.")
                  else flag for flag in super()._jvm_flags(node)), *self.jvm_flags]

    def request_logs(self) -> list[Path]:
        return [node.directory(self.data_dir) / "requests.log" for node in self.nodes]


class PortMap:
    """Which demo stage holds each local port connected to the broker, sampled every second
    on a thread while the demo runs. A port is used again by another process once closed
    (the end-of-run readers take the stopped stages' ports), so each port keeps its owners
    with when each was first seen; a connection opened and closed between two samples stays
    unnamed: ``other``."""

    def __init__(self, demo: Demo, broker_port: int, broker_pids: list[int]) -> None:
        self.demo, self.broker_port, self.broker_pids = demo, broker_port, set(broker_pids)
        #: port -> [(unix time first seen, owner)], in time order.
        self.ports: dict[int, list[tuple[float, str]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> PortMap:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.sample()

    def owner(self, port: int, at: float) -> str:
        """Who held ``port`` at unix time ``at``: the last owner first seen by one sampling
        period after it (a connection is seen up to a period after it opened)."""
        owners = self.ports.get(port)
        if not owners:
            return "other"
        held = [name for seen, name in owners if seen <= at + 1.0]
        return held[-1] if held else owners[0][1]

    def sample(self) -> None:
        owners = {os.getpid(): "demo", **{pid: "broker" for pid in self.broker_pids}}
        for name, stage in list(self.demo.stages.items()):
            if stage.process is not None:
                owners[stage.process.pid] = name
        for pid, name in owners.items():
            try:
                processes = [psutil.Process(pid)]
                processes += processes[0].children(recursive=True)
                for process in processes:
                    if process.pid in self.broker_pids and name != "broker":
                        continue   # the broker's own connections: txn markers, verification
                    for conn in process.net_connections(kind="tcp"):
                        if conn.raddr and conn.raddr.port == self.broker_port:
                            owners_of = self.ports.setdefault(conn.laddr.port, [])
                            if not owners_of or owners_of[-1][1] != name:
                                owners_of.append((time.time(), name))
            except psutil.Error:
                continue


def thread_cpu(pids: list[int]) -> Counter:
    """CPU seconds of the broker processes' live threads, by thread name (the kernel's 15
    characters; digits dropped, so a pool's threads add up)."""
    seconds: Counter = Counter()
    for pid in pids:
        try:
            threads = psutil.Process(pid).threads()
        except psutil.Error:
            continue
        for thread in threads:
            try:
                name = Path(f"/proc/{pid}/task/{thread.id}/comm").read_text().strip()
            except OSError:
                continue
            seconds[re.sub(r"[\d#]+", "", name).strip("- ") or "?"] += \
                thread.user_time + thread.system_time
    return seconds


def read_requests(logs: list[Path], since: float, until: float, ports: PortMap,
                  broker_port: int) -> tuple[Counter, Counter]:
    """(requests, fetch wait ms) by (stage, api) of the logged requests completed between
    ``since`` and ``until`` (unix times)."""
    counts: Counter = Counter()
    waits: Counter = Counter()
    for log in logs:
        with open(log, errors="replace") as lines:
            for line in lines:
                match = LINE.match(line.rstrip("\n"))
                if match is None:
                    continue
                at = time.mktime(time.strptime(match[1], "%Y-%m-%d %H:%M:%S")) \
                    + int(match[2]) / 1000
                if not since <= at <= until:
                    continue
                request = json.loads(match[3])
                key = request["requestHeader"]["requestApiKey"]
                api = API_NAMES.get(key, f"api{key}")
                # "connection": "127.0.0.1:9092-127.0.0.1:51234-7": listener, then the client.
                listener, client = request.get("connection", "-:0-:0").split("-")[:2]
                port = int(client.rsplit(":", 1)[1])
                stage = ports.owner(port, at)
                if stage == "other" and int(listener.rsplit(":", 1)[1]) != broker_port:
                    stage = "broker"   # the broker's own requests, to itself
                counts[stage, api] += 1
                if api == "Fetch":
                    waits[stage, api] += float(request.get("remoteTimeMs", 0.0))
    return counts, waits


def main() -> int:
    parser = argparse.ArgumentParser(prog="python bench/broker_requests.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=75.0, help="each run's length")
    parser.add_argument("--device-model", nargs="?", const=DEFAULT_SPEC, default=DEFAULT_SPEC,
                        metavar="SPEC", help=f"the demo's device model (default {DEFAULT_SPEC})")
    parser.add_argument("--replicas", type=int, default=DemoOptions.replicas)
    parser.add_argument("--rate", type=float, default=DemoOptions.rate)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--code", default=None, metavar="TREE,...",
                        help="one run per source tree, the stages' PYTHONPATH (replaces --runs)")
    parser.add_argument("--jvm", action="append", default=[], metavar="FLAG",
                        help="a JVM flag added to the broker's (repeatable), e.g. "
                             "-XX:TieredStopAtLevel=1")
    args = parser.parse_args()
    trees = [str(Path(t).resolve()) for t in args.code.split(",")] if args.code \
        else [None] * args.runs
    device = DeviceModel.parse(args.device_model)
    with tempfile.TemporaryDirectory(prefix="reef-requests-") as tmp:
        home = Path(tmp)
        settings = load_settings({**os.environ, "REEF_HOME": str(home)})
        cluster = LoggingCluster(home / "kafka", settings.cache_dir, jvm_flags=tuple(args.jvm))
        redis = LocalRedis(home / "redis")
        try:
            bootstrap = cluster.up(port=0, progress=say)
            broker_port = int(bootstrap.rsplit(":", 1)[1])
            broker_pids = [node.pid for node in cluster.nodes]
            redis_url = redis.up(port=free_ports(1)[0])
            for number, tree in enumerate(trees, 1):
                if tree is not None:
                    # The stages' code: ``python -m`` puts its working directory first on
                    # sys.path, then PYTHONPATH (the Demo copies os.environ, Popen the cwd).
                    os.environ["PYTHONPATH"] = tree
                    os.chdir(tree)
                    say(f"run {number}: the stages run the code in {tree}")
                options = DemoOptions(replicas=args.replicas, rate=args.rate, target=1.0,
                                      time_limit=args.seconds, run_dir=home / f"run-{number}",
                                      namespace=f"req{number}{time.strftime('%H%M%S')}",
                                      device_model=device.spec())
                demo = Demo(options, settings=settings, bootstrap=bootstrap,
                            redis_url=redis_url, broker_pids=broker_pids)
                broker_cpu = sum(process_cpu_seconds(pid) or 0.0 for pid in broker_pids)
                threads = thread_cpu(broker_pids)
                since = time.time()
                with PortMap(demo, broker_port, broker_pids) as ports:
                    label = f"run {number}/{len(trees)}"
                    say(f"{label}: reef demo --device-model {options.device_model} for "
                        f"{options.time_limit:g} s (namespace {demo.ns})")
                    result = run_and_say(demo, label)
                until = time.time()
                broker_cpu = sum(process_cpu_seconds(pid) or 0.0
                                 for pid in broker_pids) - broker_cpu
                threads = thread_cpu(broker_pids) - threads
                print("BROKER_THREADS run=" + str(number) + " " + " ".join(
                    f"{name.replace(' ', '_')}={seconds:.1f}s"
                    for name, seconds in threads.most_common(12)), flush=True)
                report(number, result, cluster.request_logs(), since, until, ports,
                       broker_port, broker_cpu)
        finally:
            redis.down()
            cluster.down()
    return 0


def report(number: int, result, logs: list[Path], since: float, until: float,
           ports: PortMap, broker_port: int, broker_cpu: float) -> None:
    counts, waits = read_requests(logs, since, until, ports, broker_port)
    seconds = until - since
    card = result.scorecard
    generated = card.generated if card is not None and card.generated else 0
    print()
    for (stage, api), count in sorted(counts.items(), key=lambda item: -item[1]):
        wait = f" fetch_wait_ms={waits[stage, api] / count:.1f}" if api == "Fetch" else ""
        per_generation = figure(count / generated) if generated else "na"
        print(f"REQUESTS run={number} stage={stage} api={api} count={count} "
              f"per_s={figure(count / seconds)} per_generation={per_generation}{wait}")
    for label, key in (("stage", 0), ("api", 1)):
        totals: Counter = Counter()
        for pair, count in counts.items():
            totals[pair[key]] += count
        print(f"BY_{label.upper()} run={number} " + " ".join(
            f"{name}={figure(count / seconds)}/s" for name, count in totals.most_common()))
    total = sum(counts.values())
    infra = card.cpu_seconds if card is not None else {}
    print(f"BROKER run={number} generated={generated} seconds={seconds:.0f} "
          f"requests={total} requests_per_s={figure(total / seconds)} "
          f"broker_cpu_s={broker_cpu:.1f} broker_cpu_ms_per_generation="
          f"{figure(1000 * broker_cpu / generated) if generated else 'na'} "
          f"infra_cpu_s=" + ",".join(f"{k}:{infra.get(k, 0.0):.1f}"
                                     for k in ("broker", "processor", "reward")), flush=True)


if __name__ == "__main__":
    run(main)
