"""Fixtures: a real Kafka broker and a real Redis server, once per test session.

By default the session starts its own single-node KRaft broker (jars from
Maven Central, see reef_stream.servers.kafka_local) and its own redis-server, each in
a temporary directory on free ports, and stops them at the end. Where
``REEF_BOOTSTRAP_SERVERS`` / ``REEF_REDIS_URL`` name existing servers, those
are used instead. With ``REEF_TEST_DOCKER=1``, pytest-docker starts
``infra/kafka/docker-compose.yml`` instead (for machines with Docker).

Tests isolate themselves by namespace (a fresh topic prefix each), never by
replacing the broker.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

# No test reaches a model hub: Hugging Face models are built from a config and loaded from a
# directory. Set before anything imports huggingface_hub, which reads it once.
os.environ["HF_HUB_OFFLINE"] = "1"

from reef_stream.core.settings import KAFKA_INFRA_DIR, load_settings
from reef_stream.servers.kafka_local import LocalCluster
from reef_stream.servers.redis_local import LocalRedis

USE_DOCKER = os.environ.get("REEF_TEST_DOCKER") == "1"


@pytest.fixture(scope="session")
def settings():
    return load_settings()


@pytest.fixture(scope="session")
def docker_compose_file():
    return str(KAFKA_INFRA_DIR / "docker-compose.yml")


@pytest.fixture(scope="session")
def kafka_bootstrap(settings, tmp_path_factory, request) -> str:
    """Bootstrap address of a real Kafka cluster for the whole session."""
    if settings.bootstrap_servers:
        yield settings.bootstrap_servers
        return
    if USE_DOCKER:
        services = request.getfixturevalue("docker_services")
        bootstrap = "127.0.0.1:19092"
        services.wait_until_responsive(timeout=90, pause=1,
                                       check=lambda: _kafka_answers(bootstrap))
        yield bootstrap
        return
    cluster = LocalCluster(tmp_path_factory.mktemp("kafka"), settings.cache_dir)
    bootstrap = cluster.up(port=0)
    yield bootstrap
    cluster.down()


@pytest.fixture(scope="session")
def redis_url(settings, tmp_path_factory, request) -> str:
    """URL of a real Redis server for the whole session."""
    if settings.redis_url:
        yield settings.redis_url
        return
    if USE_DOCKER:
        request.getfixturevalue("docker_services")
        yield "redis://127.0.0.1:16379/0"
        return
    from reef_stream.core.processes import free_ports

    server = LocalRedis(tmp_path_factory.mktemp("redis"))
    url = server.up(port=free_ports(1)[0])
    yield url
    server.down()


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama-style Hugging Face model (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 96,
    random weights under seed 0), saved with ``save_pretrained``: no model hub. Read-only."""
    import torch
    import transformers

    directory = tmp_path_factory.mktemp("llama")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=96,
                                          max_position_embeddings=64)
        transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture
def namespace() -> str:
    """A topic namespace of this test's own."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def cli_env(kafka_bootstrap, redis_url, namespace, tmp_path) -> dict[str, str]:
    """Environment for running `reef` as a subprocess against the session's servers."""
    env = dict(os.environ)
    env.update(REEF_BOOTSTRAP_SERVERS=kafka_bootstrap, REEF_REDIS_URL=redis_url,
               REEF_NAMESPACE=namespace, REEF_HOME=str(tmp_path / "home"))
    return env


def _kafka_answers(bootstrap: str) -> bool:
    from confluent_kafka.admin import AdminClient

    try:
        AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=2)
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


#: The fixtures that reach a real broker or Redis: a test using one is an integration test.
SERVICE_FIXTURES = frozenset({"kafka_bootstrap", "redis_url", "cli_env"})
#: Tests that keep both cores busy for a minute or more (a whole demo loop, a vLLM server, a
#: fault run): marked ``heavy``. scripts/test.sh runs the others on two pytest-xdist workers,
#: then these alone, one after another, so that none shares the cores with another test (a
#: demo's time to target, a fault run's timeline, must not measure a neighbour).
HEAVY_FILES = frozenset({
    "test_demo.py", "test_demo_tool.py", "test_demo_vllm.py", "test_demo_replica.py",
    "test_vllm_engine.py", "test_trainer_kills.py", "test_broker_faults.py",
    "test_processor_kill.py", "test_trainer_fencing.py", "test_quickstart.py",
    "test_cluster.py", "test_trainer_hosts.py", "test_cluster_supervisor.py"})
HEAVY_TESTS = frozenset({"test_the_main_job_command_runs_the_demo_on_the_embedded_default"})


def pytest_collection_modifyitems(items):
    """Mark tests by directory, and any test that uses the broker or Redis (the property tests
    of tests/property/ that do, for one) as integration, so `-m "not integration"` runs only
    tests that need no server, and `-m "not faults"` and friends work."""
    for item in items:
        path = Path(str(item.fspath))
        if "integration" in path.parts or SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
        if "faults" in path.parts:
            item.add_marker(pytest.mark.faults)
        if path.name in HEAVY_FILES or item.name in HEAVY_TESTS:
            item.add_marker(pytest.mark.heavy)
