"""The seeded nemesis (``tests/cluster/nemesis.py``) without a broker: the same seed draws the
same faults, a different one others, and every fault is one the cluster scenario can inject
and undo. The run itself is ``bench/cluster.py --nemesis SEED``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.nemesis import GAP_S, HOLD_S, KILL_S, NEMESIS_KINDS, describe, schedule
from tests.cluster.faults import KINDS, Fault, broker_hosts, stage_hosts

BROKERS = broker_hosts(3)
STAGES = stage_hosts(2)


def test_the_same_seed_draws_the_same_faults_and_another_seed_others():
    first = schedule(7, 6, brokers=BROKERS, stages=STAGES)
    assert schedule(7, 6, brokers=BROKERS, stages=STAGES) == first
    assert describe(schedule(7, 6, brokers=BROKERS, stages=STAGES)) == describe(first)
    # A longer schedule of the same seed begins with the shorter one.
    assert schedule(7, 9, brokers=BROKERS, stages=STAGES)[:6] == first
    assert len({schedule(seed, 6, brokers=BROKERS, stages=STAGES)
                for seed in range(20)}) == 20


def test_the_schedule_is_the_same_in_another_process():
    # Nothing in it depends on the process: not hash randomisation, not the time.
    code = ("from tests.cluster.nemesis import describe, schedule; "
            "from tests.cluster.faults import broker_hosts, stage_hosts; "
            "print(describe(schedule(11, 8, brokers=broker_hosts(3), "
            "stages=stage_hosts(2))))")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": str(root),
                                                     "PYTHONHASHSEED": "random"}).stdout
    assert out == describe(schedule(11, 8, brokers=BROKERS, stages=STAGES)) + "\n"


def test_every_fault_is_one_the_scenario_injects_and_undoes():
    faults = [f for seed in range(50)
              for f in schedule(seed, 8, brokers=BROKERS, stages=STAGES)]
    assert {f.kind for f in faults} == set(NEMESIS_KINDS) <= set(KINDS)
    for fault in faults:
        if fault.kind == "kill":   # only a broker's host: its node comes back
            assert fault.host in BROKERS and KILL_S[0] <= fault.seconds <= KILL_S[1]
        else:
            assert fault.host in (*BROKERS, *STAGES)
            assert HOLD_S[0] <= fault.seconds <= HOLD_S[1]
        assert GAP_S[0] <= fault.at_s <= GAP_S[1]
    assert "redis" not in {f.host for f in faults}


def test_a_schedule_has_at_least_one_fault_and_brokers():
    with pytest.raises(ValueError, match="at least one fault"):
        schedule(1, 0, brokers=BROKERS, stages=STAGES)
    with pytest.raises(ValueError, match="brokers"):
        schedule(1, 3, brokers=[], stages=STAGES)


def test_with_a_store_the_nemesis_also_isolates_stages_and_kills_the_store():
    faults = [f for seed in range(50)
              for f in schedule(seed, 8, brokers=BROKERS, stages=STAGES, store="store")]
    assert {f.kind for f in faults} == set(KINDS) - {"pause-replace"}   # unsupervised
    assert {f.host for f in faults if f.kind == "isolate"} <= set(STAGES)
    assert {f.host for f in faults if f.kind == "kill"} == {*BROKERS, "store"}
    # Without a store a seed draws what it drew before the store existed.
    assert all(f.kind in NEMESIS_KINDS and f.host != "store"
               for f in schedule(29, 8, brokers=BROKERS, stages=STAGES))


def test_isolate_and_a_kill_of_the_store_parse_and_say_how_long():
    assert Fault.parse("isolate:trainer:50") == Fault("isolate", "trainer", 50.0)
    assert Fault.parse("isolate:trainer:50").name() == "isolate trainer 50s"
    # The store's S3Proxy is restarted after SECONDS, as a broker's node is.
    assert Fault.parse("kill:store:10").name() == "kill store 10s"
    assert Fault.parse("kill:replica-0").name() == "kill replica-0"


def test_a_supervised_nemesis_also_replaces_each_supervised_stage_at_most_once():
    # The scenario's supervisor has one spare host per supervised stage.
    from tests.cluster.faults import SUPERVISED
    from tests.cluster.supervisor import spare_hosts

    runs = [schedule(seed, 8, brokers=BROKERS, stages=STAGES, supervised=True)
            for seed in range(50)]
    faults = [f for run in runs for f in run]
    assert {f.kind for f in faults} == {*NEMESIS_KINDS, "pause-replace"}
    assert {f.host for f in faults if f.kind == "kill"} == {*BROKERS, *SUPERVISED}
    assert {f.host for f in faults if f.kind == "pause-replace"} == set(SUPERVISED)
    for run in runs:
        replaced = [f.host for f in run if f.kind == "pause-replace"
                    or (f.kind == "kill" and f.host in SUPERVISED)]
        assert len(replaced) == len(set(replaced))
        assert spare_hosts(run) == [f"{host}-b" for host in replaced]
    # Unsupervised, the draws are those of before the option: seed 1 of docs/deployment.md.
    assert describe(schedule(1, 4, brokers=BROKERS, stages=stage_hosts(1))) == (
        " 1. after 13 s: partition-out kafka-2 36s\n 2. after 30 s: kill kafka-2 20s\n"
        " 3. after 25 s: kill kafka-1 8s\n 4. after 29 s: partition evaluator 47s")


def test_the_other_members_of_a_supervised_group_are_replaced_too():
    from tests.cluster.supervisor import spare_hosts

    stages = stage_hosts(1, processors=2, evaluators=2)
    runs = [schedule(seed, 8, brokers=BROKERS, stages=stages, supervised=True)
            for seed in range(50)]
    replaced = {f.host for run in runs for f in run if f.kind == "pause-replace"}
    assert replaced == {"processor", "processor-2", "trainer", "evaluator", "evaluator-2"}
    assert spare_hosts([Fault("pause-replace", "evaluator-2", 20)]) == ["evaluator-2-b"]
    # With one member each the draws are those of before: seed 26 of docs/deployment.md.
    assert describe(schedule(26, 3, brokers=["kafka"], stages=stage_hosts(1), store="store",
                             supervised=True)) == (
        " 1. after 23 s: isolate processor 33s\n 2. after 14 s: pause evaluator 23s\n"
        " 3. after 29 s: pause-replace trainer 22s")
