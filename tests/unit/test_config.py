"""REEF_* settings: defaults, and one error listing every bad variable."""

from __future__ import annotations

import pytest

from reef_stream.core.errors import ConfigurationError
from reef_stream.core.settings import load_settings


def test_defaults(tmp_path):
    settings = load_settings({"HOME": str(tmp_path)})
    assert settings.namespace == "reef"
    assert settings.bootstrap_servers is None and settings.redis_url is None
    assert settings.kafka_dir == settings.home / "kafka"


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigurationError) as caught:
        load_settings({
            "REEF_NAMESPACE": "bad namespace!",
            "REEF_BOOTSTRAP_SERVERS": "localhost",
            "REEF_REDIS_URL": "localhost:6379",
        })
    problems = caught.value.problems
    assert len(problems) == 3
    assert "REEF_NAMESPACE" in problems[0]
    assert "'localhost', which is not host:port" in problems[1]
    assert "REEF_REDIS_URL" in problems[2]
    assert str(caught.value).startswith("3 problems:")


def test_existing_servers_are_taken_as_given():
    settings = load_settings({"REEF_BOOTSTRAP_SERVERS": "a:9092,b:9092",
                              "REEF_REDIS_URL": "redis://r:6379/0", "REEF_NAMESPACE": "prod.rl"})
    assert settings.bootstrap_servers == "a:9092,b:9092"
    assert settings.redis_url == "redis://r:6379/0"
    assert settings.namespace == "prod.rl"


SECURE = {
    "REEF_BOOTSTRAP_SERVERS": "kafka-1.example:9093",
    "REEF_KAFKA_SECURITY_PROTOCOL": "sasl_ssl",
    "REEF_KAFKA_SASL_MECHANISM": "scram-sha-512",
    "REEF_KAFKA_SASL_USERNAME": "reef-trainer",
    "REEF_KAFKA_SASL_PASSWORD": " pass word ",
}


def test_kafka_security_settings_become_librdkafka_properties(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    settings = load_settings({**SECURE, "REEF_KAFKA_SSL_CA_LOCATION": str(ca),
                              "REEF_KAFKA_SSL_ENDPOINT_IDENTIFICATION_ALGORITHM": "https"})
    assert dict(settings.kafka_client) == {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "reef-trainer", "sasl.password": " pass word ",  # a secret as given
        "ssl.ca.location": str(ca), "ssl.endpoint.identification.algorithm": "https",
    }
    assert settings.kafka_security_protocol == "SASL_SSL"
    assert settings.kafka_client_redacted()["sasl.password"] == "***"


def test_every_client_gets_them_and_its_own_properties_win(tmp_path):
    from reef_stream.topics.connect import client_config

    settings = load_settings(SECURE)
    config = client_config("b:9093", {"acks": "all", "sasl.username": "override"},
                           settings=settings)
    assert config["security.protocol"] == "SASL_SSL" and config["acks"] == "all"
    assert config["sasl.username"] == "override"
    assert callable(config["error_cb"])  # reports a refused login clearly
    plain = client_config("b:9092", {"acks": "all"}, settings=load_settings({}))
    assert "security.protocol" not in plain and "error_cb" not in plain
    assert "security.protocol" not in client_config("b:9092", security=False)


def test_a_refusal_names_what_to_check_and_never_the_password():
    from reef_stream.topics.connect import refusal_message

    settings = load_settings(SECURE)
    message = refusal_message("b:9093", settings, -169, "SASL authentication error")
    assert "refused to authenticate (SASL_SSL, SCRAM-SHA-512 as 'reef-trainer')" in message
    assert "REEF_KAFKA_SASL_PASSWORD" in message and "pass word" not in message
    assert "pass word" not in repr(settings) and "pass word" not in str(settings.kafka_client_redacted())


def test_the_intake_token_is_not_in_the_settings_repr():
    settings = load_settings({"REEF_INTAKE_TOKEN": "tok-123"})
    assert settings.intake_token == "tok-123" and "tok-123" not in repr(settings)


def test_the_stuck_commit_threshold_is_read_as_seconds_above_zero():
    assert load_settings({}).stuck_commit_s == 120.0
    assert load_settings({"REEF_STUCK_COMMIT_S": " 45 "}).stuck_commit_s == 45.0
    for bad in ("0", "-3", "soon", "inf", "nan"):
        with pytest.raises(ConfigurationError) as caught:
            load_settings({"REEF_STUCK_COMMIT_S": bad})
        assert caught.value.problems == [
            f"REEF_STUCK_COMMIT_S={bad!r} is not a number of seconds above 0"]


def test_bad_kafka_security_settings_are_reported_together_without_secrets(tmp_path):
    with pytest.raises(ConfigurationError) as caught:
        load_settings({
            "REEF_BOOTSTRAP_SERVERS": "k:9093",
            "REEF_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "REEF_KAFKA_SASL_MECHANISM": "GSSAPI",
            "REEF_KAFKA_SASL_PASSWORD": "hunter2",
            "REEF_KAFKA_SSL_CA_LOCATION": str(tmp_path / "missing.pem"),
            "REEF_KAFKA_ACKS": "0",
        })
    problems = caught.value.problems
    text = str(caught.value)
    assert any(p.startswith("REEF_KAFKA_ACKS is not a reef-stream setting") for p in problems)
    assert any("REEF_KAFKA_SASL_MECHANISM='GSSAPI' is not one of" in p for p in problems)
    assert any(p.startswith("REEF_KAFKA_SASL_USERNAME is required") for p in problems)
    assert any(p.startswith("REEF_KAFKA_SSL_CA_LOCATION=") and "no such file" in p
               for p in problems)
    assert len(problems) == 4
    assert "hunter2" not in text


@pytest.mark.parametrize("env, expected", [
    ({"REEF_KAFKA_SECURITY_PROTOCOL": "TLS"}, "REEF_KAFKA_SECURITY_PROTOCOL='TLS' is not one of"),
    ({"REEF_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "REEF_KAFKA_SASL_USERNAME": "u",
      "REEF_KAFKA_SASL_PASSWORD": "p"}, "REEF_KAFKA_SASL_MECHANISM is required"),
    ({"REEF_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "REEF_KAFKA_SASL_MECHANISM": "PLAIN",
      "REEF_KAFKA_SASL_USERNAME": "u", "REEF_KAFKA_SASL_PASSWORD": "p"}, "PLAIN sends the password"),
    ({"REEF_KAFKA_SASL_USERNAME": "u", "REEF_KAFKA_SASL_PASSWORD": "p"},
     "REEF_KAFKA_SASL_PASSWORD, REEF_KAFKA_SASL_USERNAME set, but REEF_KAFKA_SECURITY_PROTOCOL="
     "PLAINTEXT does not authenticate"),
    ({"REEF_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "REEF_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
      "REEF_KAFKA_SASL_USERNAME": "u", "REEF_KAFKA_SASL_PASSWORD": "p",
      "REEF_KAFKA_SSL_CA_LOCATION": "probe"}, "does not use TLS"),
    ({"REEF_KAFKA_SECURITY_PROTOCOL": "SSL", "REEF_KAFKA_SSL_ENDPOINT_IDENTIFICATION_ALGORITHM": "x"},
     "REEF_KAFKA_SSL_ENDPOINT_IDENTIFICATION_ALGORITHM must be https"),
])
def test_each_bad_kafka_security_setting_is_named(env, expected):
    with pytest.raises(ConfigurationError) as caught:
        load_settings({"REEF_BOOTSTRAP_SERVERS": "k:9093", **env})
    assert expected in str(caught.value)
    assert "'p'" not in str(caught.value)


def test_a_secured_protocol_needs_an_existing_cluster():
    with pytest.raises(ConfigurationError) as caught:
        load_settings({k: v for k, v in SECURE.items() if k != "REEF_BOOTSTRAP_SERVERS"})
    assert "REEF_KAFKA_SECURITY_PROTOCOL=SASL_SSL needs REEF_BOOTSTRAP_SERVERS" in str(caught.value)


def test_plaintext_needs_nothing():
    settings = load_settings({"REEF_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT"})
    assert dict(settings.kafka_client) == {"security.protocol": "PLAINTEXT"}
