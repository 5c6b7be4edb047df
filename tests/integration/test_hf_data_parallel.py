"""The Hugging Face backend under data parallelism: two trainer ranks (torchrun, gloo on the
CPU) train a tiny Llama-style model built from a config and saved with ``save_pretrained``,
each on its own partitions; after every step both ranks hold the very weights rank 0
checkpoints (each rank logs the sha256 of its weights' safetensors bytes: it is the
checkpoint's ``model.safetensors``'s), and two runs end bitwise equal -- what
test_trainer_data_parallel checks of the toy model, on a real model, in full and with LoRA
(one run: the ranks' agreement with the checkpoint is checked, not run against run)."""

from __future__ import annotations

import json
import re
from collections import Counter

import fsspec
import pytest
import torch
import transformers  # noqa: E402 - a dependency: missing, the test fails rather than skips
from confluent_kafka import Consumer, TopicPartition

from reef_stream.engine.checkpoints import MANIFEST, CheckpointStore, load
from reef_stream.topics.connect import client_config
from tests.integration.test_trainer_data_parallel import STEPS, _torchrun, spread_units

DIGEST = re.compile(r"rank (\d) of 2 holds the weights of every rank \(sha256 ([0-9a-f]{64})\)")


def _weights_sha256(stored) -> str:
    fs, path = fsspec.core.url_to_fs(stored.uri)
    return json.loads(fs.cat_file(f"{path}/{MANIFEST}"))["files"]["model.safetensors"]["sha256"]


@pytest.mark.parametrize("lora", [None, 4], ids=["full", "lora"])
def test_two_ranks_train_a_hugging_face_model_to_the_same_weights(
        llama_dir, lora, kafka_bootstrap, cli_env, namespace, tmp_path):
    log, topic, partition_of = spread_units(kafka_bootstrap, namespace)
    env = {**cli_env, "REEF_TEST_HF_MODEL": str(llama_dir)}
    if lora:
        env["REEF_TEST_HF_LORA"] = str(lora)

    # Two runs in full (they end bitwise equal); one with LoRA (CI time).
    runs = {group: _torchrun(env, group, tmp_path / group, "tests.recipes.trainable_hf_dp")
            for group in (("hf1",) if lora else ("hf1", "hf2"))}
    finals = {}
    for group, result in runs.items():
        assert result.returncode == 0, result.stderr[-4000:]
        assert "rank 0 of 2 owns partitions [0, 2, 4]" in result.stderr, result.stderr[-3000:]
        assert "rank 1 of 2 owns partitions [1, 3, 5]" in result.stderr, result.stderr[-3000:]
        assert result.stdout.count(f"now at step {STEPS}") == 2, result.stdout
        stored = CheckpointStore(tmp_path / group).steps()
        assert [c.step for c in stored] == list(range(1, STEPS + 1))
        steps = [load(c.uri, c.sha256) for c in stored]
        trained = Counter(u for c in steps for u in c.step_units)
        assert len(trained) == STEPS * 4 and set(trained.values()) == {1}
        for contents in steps:   # rank 0's half of a step from its partitions, rank 1's from its
            assert {partition_of[u] % 2 for u in contents.step_units[:2]} == {0}
            assert {partition_of[u] % 2 for u in contents.step_units[2:]} == {1}
        assert {k.split(".")[0] for k in steps[-1].rng} == {"rank0", "rank1"}

        # After every step, each rank's weights hash to the checkpoint's model.safetensors.
        logged = {rank: [] for rank in (0, 1)}
        for rank, digest in DIGEST.findall(result.stderr):
            logged[int(rank)].append(digest)
        written = [_weights_sha256(c) for c in stored]
        assert logged[0] == written and logged[1] == written, (logged, written)
        assert len(set(written)) == STEPS, "every step changed the weights"

        consumer = Consumer(client_config(kafka_bootstrap, {"group.id": group}))
        committed = consumer.committed([TopicPartition(topic, p) for p in range(6)], timeout=30)
        consumer.close()
        assert {(tp.partition, tp.offset) for tp in committed} == \
            {(o.partition, o.offset) for o in steps[-1].offsets}
        finals[group] = steps[-1].weights

    # The model's own parameter names; in full every parameter trains, with LoRA the adapters
    # alone are checkpointed.
    names = set(finals["hf1"])
    if lora:
        assert names and all("lora_" in n for n in names), sorted(names)[:5]
    else:
        base = transformers.LlamaForCausalLM.from_pretrained(llama_dir).state_dict()
        assert {n.removeprefix("hf.") for n in names} >= set(base) - {"lm_head.weight"}
        changed = [n for n in names if not torch.equal(finals["hf1"][n],
                                                       base[n.removeprefix("hf.")])]
        assert len(changed) == len(names), sorted(names - set(changed))[:5]
    for name, tensor in finals.get("hf2", {}).items():
        assert torch.equal(tensor, finals["hf1"][name]), name
