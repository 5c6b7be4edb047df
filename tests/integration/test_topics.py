"""Topic creation and verification against the real broker."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from reef_stream.core.errors import TopicMismatchError
from reef_stream.topics.admin import ensure_topics, verify_topics
from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import declare_topics, generations, units


@pytest.fixture
def admin(kafka_bootstrap):
    return AdminClient(client_config(kafka_bootstrap))


def test_create_makes_every_declared_topic_with_its_settings(admin, namespace):
    declared = declare_topics(namespace, recipes=("sao",))
    report = ensure_topics(admin, declared)

    assert sorted(report.created) == sorted(t.name for t in declared)
    metadata = admin.list_topics(timeout=10)
    for topic in declared:
        assert len(metadata.topics[topic.name].partitions) == topic.partitions
    assert units(namespace, "sao") in metadata.topics
    assert verify_topics(admin, declared) == []
    configs = admin.describe_configs(
        [ConfigResource(ResourceType.TOPIC, f"{namespace}.publications")])
    entries = next(iter(configs.values())).result()
    assert entries["cleanup.policy"].value == "compact"


def test_create_is_idempotent(admin, namespace):
    declared = declare_topics(namespace)
    ensure_topics(admin, declared)
    again = ensure_topics(admin, declared)
    assert again.created == []
    assert sorted(again.verified) == sorted(t.name for t in declared)


def test_existing_topic_with_other_settings_is_an_error_listing_every_difference(admin, namespace):
    # Someone created the generations topic by hand, with 2 partitions and 1 day retention.
    name = generations(namespace)
    admin.create_topics([NewTopic(name, num_partitions=2, replication_factor=1,
                                  config={"retention.ms": "86400000"})])[name].result()

    with pytest.raises(TopicMismatchError) as caught:
        ensure_topics(admin, declare_topics(namespace))

    problems = caught.value.problems
    assert any(f"{name} has 2 partitions, declared 6" in p for p in problems), problems
    assert any(f"{name} has retention.ms=86400000" in p for p in problems), problems
    assert any("max.message.bytes" in p and name in p for p in problems), problems
    # The other topics were still created, and the mismatched one left as it was.
    metadata = admin.list_topics(timeout=10)
    assert f"{namespace}.feedback" in metadata.topics
    assert len(metadata.topics[name].partitions) == 2


def test_verify_reports_missing_topics(admin, namespace):
    declared = declare_topics(namespace)
    problems = verify_topics(admin, declared)
    # One problem per declared topic (eight since a person's decisions are requests), each
    # naming its topic.
    assert len(problems) == len(declared) == 8
    assert all(f"topic {t.name} does not exist" in p for t, p in zip(declared, problems))


def test_a_namespace_keeps_the_partition_count_it_was_created_with(admin, namespace):
    from reef_stream.topics.admin import namespace_topics
    from reef_stream.topics.declarations import feedback

    ensure_topics(admin, declare_topics(namespace, ("sao",), partitions=2))

    # The stages declare what the namespace has, not the default: nothing to mend.
    declared = namespace_topics(admin, namespace, ("sao",))
    counts = {t.name: t.partitions for t in declared}
    for name in (generations(namespace), feedback(namespace), units(namespace, "sao")):
        assert counts[name] == 2
    assert ensure_topics(admin, declared).created == []
    assert verify_topics(admin, declared) == []
    # Against the default of a new namespace, the difference is named.
    problems = verify_topics(admin, declare_topics(namespace, ("sao",)))
    assert f"topic {units(namespace, 'sao')} has 2 partitions, declared 6" in problems


def test_a_new_namespace_is_declared_with_the_default_partition_count(admin, namespace):
    from reef_stream.topics.admin import namespace_topics
    from reef_stream.topics.declarations import DATA_PARTITIONS

    declared = namespace_topics(admin, namespace, ("sao",))
    assert {t.partitions for t in declared if t.name.split(".")[-1] in
            ("generations", "feedback", "sao")} == {DATA_PARTITIONS}


def test_a_namespace_cannot_have_no_partitions():
    with pytest.raises(ValueError, match="at least 1 partition"):
        declare_topics("ns", partitions=0)


def test_topics_create_partitions_through_the_cli(cli_env, admin, namespace):
    from tests.helpers import reef

    reef("topics", "create", "--partitions", "2", "--recipe", "sao", env=cli_env)
    metadata = admin.list_topics(timeout=10)
    assert len(metadata.topics[units(namespace, "sao")].partitions) == 2
    # verify, and create again without the option, take the namespace's own count.
    assert "every declared topic exists" in reef("topics", "verify", "--recipe", "sao",
                                                 env=cli_env).stdout
    assert reef("topics", "create", "--recipe", "sao", env=cli_env).returncode == 0
    # Asking for another count than the namespace has names the difference.
    other = reef("topics", "create", "--partitions", "3", env=cli_env, check=False)
    assert other.returncode != 0
    assert f"{generations(namespace)} has 2 partitions, declared 3" in other.stderr
