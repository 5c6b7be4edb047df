"""The source of a generated function: what the compiled Avro reader and writer build.

    src = Source()
    src.emit(0, f"def read(b, {src.local()}):")   # lines, four spaces a depth
    name = src.constant(SomeClass)                 # k0, k1, ...: bound when the source runs

``reef_stream.core.avro_reader`` and ``avro_writer`` generate one function per event type
into a ``Source`` and execute ``"\\n".join(src.lines)`` with ``src.constants`` in scope.
"""

from __future__ import annotations

from typing import Any


class Source:
    """The lines of a function being generated, its locals and the constants they refer to."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.constants: dict[str, Any] = {}
        self._locals = 0

    def local(self) -> str:
        """A new local variable's name (x1, x2, ...)."""
        self._locals += 1
        return f"x{self._locals}"

    def constant(self, value: Any) -> str:
        """The name ``value`` is known by in the generated code."""
        name = f"k{len(self.constants)}"
        self.constants[name] = value
        return name

    def emit(self, depth: int, line: str) -> None:
        """One line, indented ``depth`` levels."""
        self.lines.append("    " * depth + line)
