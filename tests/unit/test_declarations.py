"""Topic declarations: the invariants the pipeline relies on."""

from __future__ import annotations

from reef_stream.topics.declarations import declare_topics, feedback, generations


def test_generations_and_feedback_are_co_partitioned():
    topics = {t.name: t for t in declare_topics("reef")}
    assert topics[generations("reef")].partitions == topics[feedback("reef")].partitions


def test_every_topic_is_under_the_namespace_and_bounded():
    topics = declare_topics("ns1", recipes=("sao", "grpo"))
    names = [t.name for t in topics]
    assert len(names) == len(set(names)) == 10
    assert all(name.startswith("ns1.") for name in names)
    assert "ns1.decision-requests" in names and "ns1.decision-outcomes" in names
    assert "ns1.units.sao" in names and "ns1.units.grpo" in names
    assert all(t.max_message_bytes >= 1024 * 1024 for t in topics)


def test_decision_requests_have_one_partition_so_they_are_applied_in_the_order_asked():
    topics = {t.name: t for t in declare_topics("reef")}
    assert topics["reef.decision-requests"].partitions == 1
    assert topics["reef.decision-requests"].config["cleanup.policy"] == "delete"


def test_publications_are_compacted_by_model():
    publications = next(t for t in declare_topics("reef") if t.name == "reef.publications")
    assert publications.config["cleanup.policy"] == "compact"
