"""``listening_port``: a free port below the kernel's ephemeral range, where no outgoing
connection can take it before a slow server binds it."""

from __future__ import annotations

from pathlib import Path

from reef_stream.core.processes import listening_port, port_is_free


def test_a_listening_port_is_free_and_below_the_ephemeral_range():
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {listening_port() for _ in range(20)}
    assert all(20000 <= p < first_ephemeral for p in ports), ports
    assert all(port_is_free(p) for p in ports)
    assert len(ports) > 1   # chosen at random, so two servers rarely race for one

