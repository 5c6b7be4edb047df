"""Fault tests get a broker of their own, since they kill it."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AdminClient

from reef_stream.servers.kafka_local import LocalCluster
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import declare_topics


@pytest.fixture
def cluster(settings, tmp_path, namespace):
    """A single-node cluster of this test's own, with the namespace's topics created."""
    cluster = LocalCluster(tmp_path / "kafka", settings.cache_dir)
    cluster.up(port=0)
    ensure_topics(AdminClient(client_config(cluster.bootstrap)), declare_topics(namespace))
    yield cluster
    cluster.down()
