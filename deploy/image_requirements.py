#!/usr/bin/env python3
"""The serving requirements to install into an NVIDIA image, against what it already has.

    python3 deploy/image_requirements.py deploy/requirements-serve.txt image-freeze.txt

Prints deploy/requirements-serve.txt with every package the image already has pinned to the
image's version instead of ours. The TensorRT-LLM image's transformers checks the tokenizers
version on import (4.53: tokenizers>=0.21,<0.22), so our pin (0.23.x) would install fine and
then break `import tensorrt_llm`; disagg's code runs on the image's versions. Install with
the image's freeze as constraints too (pip -c), so nothing it has is upgraded behind its back.

A package the image lacks keeps our pin, unless its line says `# image: <range>`: then the
range, for pip to pick a version that resolves against the image's freeze. tritonclient 2.73
requires grpcio>=1.81.1 and protobuf>=6.30,<7, which an image with protobuf 4 or 5 (the
TensorRT-LLM image has grpcio and protobuf, through etcd3) cannot take: ResolutionImpossible
under -c. tritonclient>=2.51 resolves to 2.51 beside protobuf 4.25, to 2.66 beside 5.29.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def split(line: str) -> tuple[str, str, str]:
    """'tritonclient[grpc,http]==2.73.0' -> ('tritonclient', '[grpc,http]', '==2.73.0')."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)", line)
    if not m:
        raise ValueError(f"not a requirement: {line!r}")
    return m.group(1), m.group(2) or "", m.group(3).strip()


def image_versions(freeze: str) -> dict[str, str]:
    """name -> '==version' (or '' for a package installed from a URL) from `pip freeze`."""
    out = {}
    for line in freeze.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-")):
            continue
        name, _, rest = split(line.split(" @ ")[0] if " @ " in line else line)
        out[canonical(name)] = rest if rest.startswith("==") else ""
    return out


def adapt(requirements: str, freeze: str) -> str:
    have = image_versions(freeze)
    lines = []
    for raw in requirements.splitlines():
        text, _, comment = (part.strip() for part in raw.partition("#"))
        if not text:
            continue
        name, extras, pin = split(text)
        in_image = re.match(r"image:\s*(\S+)", comment)
        if canonical(name) in have:
            lines.append(f"{name}{extras}{have[canonical(name)]}  # the image's")
        elif in_image:
            lines.append(f"{name}{extras}{in_image.group(1)}  # what resolves beside the image's")
        else:
            lines.append(f"{name}{extras}{pin}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    sys.stdout.write(adapt(Path(argv[0]).read_text(), Path(argv[1]).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
