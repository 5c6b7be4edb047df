"""Java programs the local servers run from Maven Central jars: a pom's runtime classpath,
resolved by Maven once and cached under ``REEF_CACHE_DIR``.

``maven_classpath(pom, cache_dir, what)`` blocks while Maven downloads (seconds to a minute,
once; the jars stay in ``~/.m2``) and raises ``ConfigurationError`` naming the fix when Maven
is missing or Maven Central cannot be reached.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from reef_stream.core.errors import ConfigurationError

Progress = Callable[[str], None]

#: The plugin that prints a pom's classpath; pinned so the same pom resolves the same way.
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
_UNREACHABLE = re.compile(r"Could not (resolve|transfer)|UnknownHost|Connection (refused|timed "
                          r"out)|Network is unreachable|No plugin found|offline")


def _quiet(_: str) -> None:
    pass


def maven_classpath(pom: Path, cache_dir: Path, what: str, *, instead: str,
                    progress: Progress = _quiet) -> str:
    """The runtime classpath of ``pom``'s dependencies (``os.pathsep``-joined jar paths).

    The cache key is the pom's content, so editing the pom resolves again; a cached classpath
    whose jars have gone (``~/.m2`` cleaned) is resolved again. ``what`` names the program in
    messages ("the Kafka broker's jars"), ``instead`` the way to do without it.
    """
    key = hashlib.sha256(pom.read_bytes()).hexdigest()[:16]
    cached = cache_dir / f"{pom.parent.name}-classpath-{key}.txt"
    if cached.exists():
        classpath = cached.read_text().strip()
        if classpath and all(Path(jar).exists() for jar in classpath.split(os.pathsep)):
            return classpath

    mvn = shutil.which("mvn")
    if mvn is None:
        raise ConfigurationError(
            f"Maven (mvn) was not found: it fetches {what} from Maven Central once. Install it "
            f"(Debian: apt-get install maven), or {instead}.")
    cache_dir.mkdir(parents=True, exist_ok=True)
    progress(f"Fetching {what} from Maven Central (once; cached in ~/.m2)")
    partial = cached.with_suffix(".partial")
    result = subprocess.run(
        [mvn, "-B", "-q", "-Dstyle.color=never", "-f", str(pom),
         f"{DEPENDENCY_PLUGIN}:build-classpath",
         f"-Dmdep.outputFile={partial}", "-Dmdep.includeScope=runtime"],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip()
        tail = "\n".join(output.splitlines()[-15:])
        if _UNREACHABLE.search(output):
            raise ConfigurationError(
                f"Maven could not fetch {what}: Maven Central looks unreachable from this "
                "machine (check the network or proxy settings in ~/.m2/settings.xml), "
                f"or {instead}.\n{tail}")
        raise ConfigurationError(f"Maven failed to resolve {pom}:\n{tail}")
    partial.replace(cached)
    return cached.read_text().strip()
