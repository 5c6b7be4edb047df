"""`reef kafka up --nodes 3`: three brokers elect a controller, keep three copies,
and go on acknowledging writes when the controller's node is killed."""

from __future__ import annotations

import json

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from reef_stream.servers.kafka_local import LocalCluster
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import generations
from tests.helpers import reef, wait_until


def test_three_node_cluster_survives_losing_its_controller(cli_env, settings, tmp_path, namespace):
    env = {k: v for k, v in cli_env.items() if k != "REEF_BOOTSTRAP_SERVERS"}
    data = tmp_path / "kafka3"
    reef("kafka", "up", "--nodes", "3", "--port", "0", "--data", str(data), env=env)
    cluster = LocalCluster(data, settings.cache_dir)
    try:
        status = reef("kafka", "status", "--data", str(data), env=env).stdout
        assert status.count("alive") == 3, status
        assert status.count("active controller") == 1, status
        bootstrap = json.loads((data / "cluster.json").read_text())["bootstrap"]
        assert len(bootstrap.split(",")) == 3

        env["REEF_BOOTSTRAP_SERVERS"] = bootstrap
        reef("topics", "create", env=env)
        admin = AdminClient(client_config(bootstrap))
        topic = generations(namespace)
        # The broker this client asks may learn of the new topic a moment after
        # the one that created it: metadata is eventually consistent.
        partitions = wait_until(
            lambda: admin.list_topics(topic, timeout=10).topics[topic].partitions, 30,
            f"the broker asked to know {topic}", poll_s=0.5)
        assert {len(p.replicas) for p in partitions.values()} == {3}
        configs = next(iter(admin.describe_configs(
            [ConfigResource(ResourceType.TOPIC, topic)]).values())).result()
        assert configs["min.insync.replicas"].value == "2"

        controller = cluster.controller()
        assert controller in (1, 2, 3)
        cluster.kill(controller)

        wait_until(lambda: cluster.controller() not in (controller, None), 60,
                   "a new controller to be elected", poll_s=0.5)

        producer = Producer(client_config(bootstrap, {"acks": "all", "enable.idempotence": True}))
        for i in range(1000):
            producer.produce(topic, key=f"k{i}".encode(), value=b"v")
        assert producer.flush(60) == 0

        consumer = Consumer(client_config(bootstrap, {
            "group.id": "verifier", "auto.offset.reset": "earliest"}))
        consumer.subscribe([topic])
        keys: set[bytes] = set()

        def read_all() -> bool:
            keys.update(m.key() for m in consumer.consume(1000, timeout=1.0) if m.error() is None)
            return len(keys) >= 1000

        wait_until(read_all, 60, lambda: f"the 1000 keys; read {len(keys)}", poll_s=0)
        consumer.close()
        assert keys == {f"k{i}".encode() for i in range(1000)}
    finally:
        cluster.down()
