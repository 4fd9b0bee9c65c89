"""Record ``dir()`` of torch's NCCL classes for the installed torch (tests/data/nccl_class_attrs.json).

Repository tooling, not part of the package. The classes are those of
:data:`commgroups.torch_internals.nccl_classes.RECORDED_CLASSES` (ProcessGroupNCCL,
ProcessGroupNCCL2, ProcessGroupNCCLLazy, their Options, the NCCL config type, ProcessGroup and
c10d's Backend), read by :func:`~commgroups.torch_internals.nccl_classes.nccl_class_attributes`.
CUDA wheels import on a CPU machine, so no GPU is needed; a CPU build records every NCCL class as
absent. The mocked-NCCL tests build their fakes from this file (``tests/nccl_fakes.py``).

    python -m tools.capture_nccl_attrs            # print this torch's record
    python -m tools.capture_nccl_attrs --write    # put it into the file (other versions kept)
    python -m tools.capture_nccl_attrs --check    # exit 1 when the file's record differs
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import torch

from commgroups.torch_internals import nccl_classes
from commgroups.torch_internals.version import torch_version

__all__ = ["DATA_FILE", "capture", "differences", "main", "release"]

DATA_FILE = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "nccl_class_attrs.json"
ABOUT = ("dir() (dunders left out) of torch._C._distributed_c10d's NCCL classes per torch release, "
         "from the PyPI wheels imported on a CPU machine; null: the class is absent. Written by "
         "tools/capture_nccl_attrs.py; read by tests/nccl_fakes.py and tests/test_nccl_classes.py.")


def release() -> str:
    """The running torch's release without its local part: ``2.15.0`` for ``2.15.0+cu132``."""
    return ".".join(str(part) for part in torch_version())


def _nccl_version() -> str | None:
    try:
        nccl: Any = torch.cuda.nccl  # untyped; reads the bundled NCCL library, no GPU needed
        version = nccl.version()
    except Exception:  # a CPU build: no NCCL library
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def capture() -> dict[str, Any]:
    """This torch's record: build, CUDA and NCCL versions, each class's attributes."""
    classes = nccl_classes.nccl_class_attributes()
    record: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": _nccl_version(),
        "options_same_as_ProcessGroupNCCL": nccl_classes.nccl_options_classes_alike(),
        "classes": classes,
    }
    if classes.get("ProcessGroupNCCL") is None:
        record["note"] = "a build without NCCL (CPU): no NCCL class"
    return record


def differences(recorded: dict[str, Any] | None, live: dict[str, Any]) -> list[str]:
    """What differs between a recorded and a live record, one line each (empty: equal)."""
    if recorded is None:
        return ["not recorded"]
    lines = [f"{key}: recorded {recorded.get(key)!r}, live {live.get(key)!r}"
             for key in ("torch", "cuda", "nccl", "options_same_as_ProcessGroupNCCL")
             if recorded.get(key) != live.get(key)]
    for name in sorted(set(recorded.get("classes", {})) | set(live["classes"])):
        old, new = recorded.get("classes", {}).get(name), live["classes"].get(name)
        if old == new:
            continue
        if old is None or new is None:
            lines.append(f"{name}: recorded {'absent' if old is None else 'present'}, live "
                         f"{'absent' if new is None else 'present'}")
            continue
        gone, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
        lines.append(f"{name}: live lacks {gone}, live adds {added}")
    return lines


def load(path: pathlib.Path = DATA_FILE) -> dict[str, Any]:
    """The data file, or an empty one."""
    if not path.exists():
        return {"about": ABOUT, "classes_read": list(nccl_classes.RECORDED_CLASSES), "versions": {}}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def main(argv: list[str] | None = None) -> int:
    """Print, write or check this torch's record; 1 when ``--check`` finds a difference."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="store this torch's record in the file")
    mode.add_argument("--check", action="store_true", help="exit 1 when the file differs")
    parser.add_argument("--file", type=pathlib.Path, default=DATA_FILE)
    args = parser.parse_args(argv)
    live = capture()
    if not (args.write or args.check):
        print(json.dumps({release(): live}, indent=1))
        return 0
    data = load(args.file)
    if args.check:
        lines = differences(data["versions"].get(release()), live)
        for line in lines:
            print(f"torch {release()}: {line}")
        return 1 if lines else 0
    data["about"], data["classes_read"] = ABOUT, list(nccl_classes.RECORDED_CLASSES)
    data["versions"][release()] = live
    data["versions"] = dict(sorted(data["versions"].items(),
                                   key=lambda item: tuple(int(p) for p in item[0].split("."))))
    args.file.parent.mkdir(parents=True, exist_ok=True)
    args.file.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    print(f"wrote torch {release()} ({live['torch']}) into {args.file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
