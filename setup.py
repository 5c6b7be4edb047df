"""The packages of the wheel; every other setting is in pyproject.toml.

The example methods in the repository's ``methods/`` ship as ``reef_stream.methods``
(the wheel installs no top-level package ``methods``). pyproject.toml's package
finder cannot rename a folder, hence this file. ``schemas/`` and ``infra/kafka/``
reach the wheel as package data through the links in ``reef_stream/_data/``.
"""

from setuptools import find_namespace_packages, setup

# Namespace packages too: the data folders (dashboard static files, _data/*) are then
# packages setuptools knows of, and package-data in pyproject.toml says what they hold.
_SKIP = ["*__pycache__*"]

setup(
    packages=[
        *find_namespace_packages(include=["reef_stream", "reef_stream.*"], exclude=_SKIP),
        *(f"reef_stream.{name}"
          for name in find_namespace_packages(include=["methods", "methods.*"], exclude=_SKIP)),
    ],
    package_dir={"reef_stream.methods": "methods"},
)
