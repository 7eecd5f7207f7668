"""Report the direct dependencies whose newest release on the package index is newer than the
version the test suite was last run against (``constraints.txt``).

    python dev/outdated.py [--constraints constraints.txt]

It reports and exits 0: a newer release is a reason to refresh the constraints (see the README's
"Versions" section), not a failure. An index that cannot be reached is reported the same way.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.+]", version))


def pinned(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[_name(name)] = version.strip()
    return pins


def direct_dependencies() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return sorted({_name(r) for r in reqs})


def newest(name: str) -> str | None:
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name],
                         capture_output=True, text=True, timeout=60)
    match = re.search(r"^\S+ \(([^)]+)\)", out.stdout, re.M)
    return match.group(1) if match else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--constraints", default=str(ROOT / "constraints.txt"))
    pins = pinned(Path(ap.parse_args().constraints))
    behind = []
    for name in direct_dependencies():
        tested = pins.get(name)
        latest = newest(name)
        if latest is None:
            print(f"outdated: {name}: the index gave no version (offline?)")
        elif tested is None:
            print(f"outdated: {name}: not in the constraints file (newest {latest})")
        elif _key(latest) > _key(tested.split("+")[0]):
            behind.append(f"{name} {tested} -> {latest}")
    print("outdated: " + ("; ".join(behind) + " (newer than tested: refresh constraints.txt)"
                          if behind else "every direct dependency's newest release is the tested one"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
