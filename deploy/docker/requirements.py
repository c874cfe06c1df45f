"""Print the pip requirements of one image, read from pyproject.toml (the single source).

    python3 deploy/docker/requirements.py service [pyproject.toml]   # service image
    python3 deploy/docker/requirements.py trainer [pyproject.toml]   # trainer image

service: the project's dependencies plus the ``service`` and ``remote`` extras (the service never imports
torch). trainer: the project's dependencies plus the ``client`` extra (torch).
Used on the host to download wheels and inside the image build to install them, so both
always agree. Needs Python >= 3.11 (tomllib).
"""

from __future__ import annotations

import sys
import tomllib


def requirements(target: str, pyproject: str = "pyproject.toml") -> list:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    deps = list(project.get("dependencies", []))
    extras = {"service": ("service", "remote"), "trainer": ("client",)}.get(target)  # remote: s3:// datasets
    if extras is not None:
        return deps + [d for e in extras for d in project["optional-dependencies"][e]]
    raise SystemExit(f"unknown target {target!r}: use service or trainer")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    print("\n".join(requirements(*sys.argv[1:])))
