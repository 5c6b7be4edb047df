"""The stage loop refuses, before it starts, a strategy whose declared capabilities and methods
disagree or do not fit its membership, and options that cannot work, listing every problem.
No broker: nothing here reaches one."""

from __future__ import annotations

import pytest

from reef_stream.consumers.stage import (
    CAPABILITIES, Committing, CommitsItself, DeadLetters, FetchEnd, Group, Reader, StageLoop,
    StageOptions, UsesConsumer,
)
from reef_stream.core.errors import ConfigurationError
from reef_stream.topics.memory import MemoryBroker


def _options(membership=None, **settings) -> StageOptions:
    return StageOptions(stage="test", topics=("t",), namespace="ns", reads="test record",
                        membership=membership or Group("g"), **settings)


class Plain:
    """Only the required protocol."""

    capabilities = frozenset()

    def submit(self, message): ...
    def poll(self): ...
    def join(self, timeout): ...
    def close(self): ...


class Commits(Plain):
    capabilities = frozenset({Committing})

    def committable(self):
        return {}

    def committed(self, positions): ...


def _loop(strategy, options=None, producer=None) -> StageLoop:
    return StageLoop(strategy, options or _options(), consumers=MemoryBroker().consumer,
                     producer=producer)


def test_a_declared_strategy_that_fits_is_taken():
    assert _loop(Commits()).capabilities == {Committing}
    assert _loop(Plain(), _options(Reader())).capabilities == frozenset()


def test_a_strategy_without_a_declaration_is_refused():
    class Silent(Commits):
        capabilities = None

    with pytest.raises(ConfigurationError, match="declares no capabilities"):
        _loop(Silent())


def test_a_capability_declared_without_its_methods_is_refused():
    class Claims(Commits):
        capabilities = frozenset({Committing, FetchEnd})

    with pytest.raises(ConfigurationError, match="declares FetchEnd but lacks its methods"):
        _loop(Claims())


def test_a_capability_method_without_its_declaration_is_refused():
    class Forgets(Commits):
        def fetched(self, drained_at_ms): ...

    with pytest.raises(ConfigurationError, match="methods of FetchEnd without declaring it"):
        _loop(Forgets())


def test_a_group_member_commits_one_way_and_a_reader_none():
    with pytest.raises(ConfigurationError, match="Committing or CommitsItself"):
        _loop(Plain())

    class Both(Commits):
        capabilities = frozenset({Committing, CommitsItself})

        def on_start(self, consumer): ...

    with pytest.raises(ConfigurationError, match="exactly one"):
        _loop(Both())
    with pytest.raises(ConfigurationError, match="a reader commits nothing"):
        _loop(Commits(), _options(Reader()))


def test_commits_itself_holds_the_consumer_and_dead_letters_need_a_producer():
    class Itself(Plain):
        capabilities = frozenset({CommitsItself})

        def on_start(self, consumer): ...

    assert UsesConsumer not in _loop(Itself()).capabilities  # implied, not declared twice

    class Letters(Commits):
        capabilities = frozenset({Committing, DeadLetters})

        def dead_lettered(self, message): ...

    with pytest.raises(ConfigurationError, match="needs a producer"):
        _loop(Letters())
    _loop(Letters(), producer=MemoryBroker().producer())


def test_every_problem_is_listed_at_once():
    class Wrong(Plain):
        capabilities = frozenset({FetchEnd, int})

    with pytest.raises(ConfigurationError) as raised:
        _loop(Wrong())
    assert len(raised.value.problems) == 3, raised.value.problems  # int, FetchEnd, commits
    assert int not in CAPABILITIES


def test_options_are_validated_and_frozen():
    with pytest.raises(ConfigurationError) as raised:
        StageOptions(stage="", topics=(), namespace="ns", reads="r", membership=Group(""),
                     batch=0, poll_timeout=0, join_timeout=-1, commit_every_s=-1)
    assert len(raised.value.problems) == 7, raised.value.problems
    options = StageOptions(stage="test", topics=["t", "u"], namespace="ns", reads="r",
                           membership=Reader(), consumer_config={"a": 1})
    assert options.topics == ("t", "u")
    with pytest.raises(TypeError):
        options.consumer_config["a"] = 2
    with pytest.raises(AttributeError):
        options.batch = 2
