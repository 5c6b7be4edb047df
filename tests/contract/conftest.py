"""The contract's broker: each test runs on the in-memory broker and on the real Kafka broker
(the second marked ``integration``)."""

from __future__ import annotations

import pytest

from tests.contract.backends import Backend, Kafka, Memory


@pytest.fixture(params=["memory", pytest.param("kafka", marks=pytest.mark.integration)])
def backend(request, namespace) -> Backend:
    if request.param == "memory":
        yield Memory(namespace)
        return
    kafka = Kafka(request.getfixturevalue("kafka_bootstrap"), namespace)
    yield kafka
    kafka.close()
