"""`make demo`: the main job on the bundled default, offline.

1. converts the bundled reference model (`reference/models/pystd-dense`, a small Llama
   trained on the CPython standard library) to 3-bit TurboQuant through the Prefect
   pipeline (an embedded, temporary Prefect API: no server to start);
2. verifies the output (checksums, decoded errors);
3. loads it with the runtime and completes a Python prompt.

Running it again resumes: a finished conversion is found in the ledger and skipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKOUT_MODEL = ROOT / "reference" / "models" / "pystd-dense"
INSTALLED_MODEL = Path(__file__).resolve().parent / "bundled" / "pystd-dense"  # package data
PROMPT = "def read_config(path):\n"


def default_paths() -> tuple[Path, Path]:
    """(source, output) of the demo: in a source checkout the bundled model under
    reference/ and out/demo/ beside it; in an installed package its copy of the model and
    ./turboquant-demo/ in the current folder (never site-packages)."""
    if CHECKOUT_MODEL.is_dir() and (ROOT / "pyproject.toml").is_file():
        return CHECKOUT_MODEL, ROOT / "out" / "demo" / "pystd-dense-tq3"
    return INSTALLED_MODEL, Path.cwd() / "turboquant-demo" / "pystd-dense-tq3"


def _banner(text: str) -> None:
    print(f"\n== {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="turboquant demo", description=__doc__.splitlines()[0])
    source, output = default_paths()
    p.add_argument("--source", default=str(source), help="checkpoint to convert")
    p.add_argument("--output", default=str(output), help="output folder")
    p.add_argument("--bits", default="3", help="weight bits (2, 3, 4)")
    p.add_argument("--prompt", default=PROMPT, help="prompt to complete")
    p.add_argument("--max-tokens", type=int, default=80)
    args = p.parse_args(argv)
    if not Path(args.source).is_dir():
        print(f"turboquant demo: error: the bundled model {args.source} is not installed; give "
              "--source FOLDER (a Hugging Face checkpoint)", file=sys.stderr)
        return 2

    from turboquant import convert, generate, verify

    _banner(f"convert {args.source} -> {args.output} ({args.bits}-bit, Prefect pipeline)")
    rc = convert.main([args.source, args.output, "--bits", args.bits])
    if rc:
        return rc
    _banner(f"verify {args.output}")
    rc = verify.main([args.output])
    if rc:
        return rc
    _banner(f"generate from {args.output}")
    print(args.prompt, end="", flush=True)
    return generate.main(["--model", args.output, "--prompt", args.prompt,
                          "--max-tokens", str(args.max_tokens)])


if __name__ == "__main__":
    sys.exit(main())
