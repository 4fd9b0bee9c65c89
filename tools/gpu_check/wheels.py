"""Check a folder of wheels meant for the GPU machine: one version of each, every need met.

The GPU machine has no network, so what its Python lacks travels as wheels (``make gpu-wheels``)
installed with ``pip install --no-deps --target``: nothing resolves dependencies there, so this
check does it here. Each wheel's ``Requires-Dist`` lines (markers evaluated for the target: CPython
3.12 on x86-64 Linux, no extras) must be met by a wheel in the folder whose version fits, or be
named as already provided by the machine. Two versions of one distribution stop the install, so
they are an error too. Needs ``packaging`` (pip's and pytest's dependency), imported lazily.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Iterable
from pathlib import Path

__all__ = ["TARGET_ENV", "check_wheels", "normalize", "wheel_requirements"]

TARGET_ENV: dict[str, str] = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux", "os_name": "posix",
    "platform_system": "Linux", "platform_machine": "x86_64", "extra": "",
}
"""The marker environment of the GPU machine's python3 (3.12.3, x86-64 Linux)."""


def normalize(name: str) -> str:
    """A distribution name in PEP 503 normal form (``typing_extensions`` -> ``typing-extensions``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _name_version(wheel: Path) -> tuple[str, str]:
    parts = wheel.name[: -len(".whl")].split("-")
    if len(parts) < 5:
        raise ValueError(f"{wheel.name}: not a wheel file name (name-version-python-abi-platform)")
    return normalize(parts[0]), parts[1]


def wheel_requirements(wheel: str | Path) -> list[str]:
    """The ``Requires-Dist`` lines of ``wheel``'s METADATA, as written."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist()
                 if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        if not names:
            raise ValueError(f"{Path(wheel).name}: no *.dist-info/METADATA inside")
        text = archive.read(names[0]).decode("utf-8", "replace")
    header = text.split("\n\n", 1)[0]  # the body after the first blank line is the description
    return [line.split(":", 1)[1].strip() for line in header.splitlines()
            if line.startswith("Requires-Dist:")]


def check_wheels(directory: str | Path, provided: Iterable[str] = ()) -> list[str]:
    """Problems with the wheels in ``directory`` (an empty list: ready to travel).

    Args:
        directory: the folder of ``.whl`` files.
        provided: distributions the target machine already has (their versions are not checked).

    Returns:
        One line per problem: a missing folder, two versions of one distribution, or a requirement
        that neither a wheel here nor ``provided`` meets.

    Example::

        check_wheels(".gpu-wheels", provided=["numpy", "torch"])   # [] when complete
    """
    from packaging.requirements import Requirement
    from packaging.version import Version

    folder = Path(directory)
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not wheels:
        return [f"{folder}: no wheels (run `make gpu-wheels` where the package index is reachable)"]
    problems: list[str] = []
    versions: dict[str, list[str]] = {}
    for wheel in wheels:
        name, version = _name_version(wheel)
        versions.setdefault(name, []).append(version)
    for name, found in sorted(versions.items()):
        if len(found) > 1:
            problems.append(f"{name}: {len(found)} versions ({', '.join(found)}); keep one, two "
                            "stop the install")
    have = {normalize(p) for p in provided if p.strip()}
    for wheel in wheels:
        for line in wheel_requirements(wheel):
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate(TARGET_ENV):
                continue  # an extra, or another platform/Python
            name = normalize(requirement.name)
            if name in versions:
                bad = [v for v in versions[name] if Version(v) not in requirement.specifier]
                if bad:
                    problems.append(f"{wheel.name} needs {line!r}; the folder has {name} "
                                    f"{', '.join(bad)}")
            elif name not in have:
                problems.append(f"{wheel.name} needs {line!r}: no wheel here and not provided "
                                "by the GPU machine; add it to scripts/gpu-wheels.txt")
    return problems
