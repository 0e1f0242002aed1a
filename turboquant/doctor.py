"""`turboquant doctor M`: read-only checks of a TurboQuant repo folder and of this machine.

    turboquant doctor out/llama-tq4            # everything, checksums included
    turboquant doctor out/llama-tq4 --quick    # skip the checksums (D006)
    turboquant doctor org/llama-tq4            # a Hub repo: fetched into the HF cache first

One line per check: PASS, WARN, FAIL or SKIP, a stable id (D001..., M001...) and what was
found. Exit status: 0 all passed, 1 warnings only, 2 any failure (and 2 for bad options).
Nothing in the folder is written. The checks are listed in runtime/doctor.py and
docs/bigger-than-memory.md.
"""

from __future__ import annotations

import argparse
import json
import sys

PROG = "turboquant doctor"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Check a TurboQuant repo folder (files against the index and manifest, "
        "checksums, config, tokenizer) and this machine (MLX backend, memory), read-only.",
    )
    p.add_argument("model", help="TurboQuant repo folder or Hub repo id (downloaded into the "
                   "Hugging Face cache first)")
    p.add_argument("--quick", action="store_true", help="skip the sha256 checksums (D006)")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="context the memory check (M002) plans for (default 4096, or the "
                   "model's max_position_embeddings where smaller)")
    p.add_argument("--memory-gb", type=float, metavar="G",
                   help="memory M002 plans for, in GB (default: this machine's)")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    return p


def memory_check(folder: str, context: int, memory_gb: float | None, usable: bool):
    """M002 from `turboquant plan`'s projection of the folder."""
    from turboquant.runtime.doctor import Check

    def run() -> Check:
        if not usable:
            return Check("M002", "SKIP", "needs a readable config, index and shards "
                         "(D001, D003, D004)")
        from turboquant.pipeline.fit import project, this_machine
        from turboquant.pipeline.fit_weights import inventory
        from turboquant.pipeline.sources import LocalSource

        from turboquant.plan import default_context

        try:
            inv = inventory(LocalSource(folder))
            proj = project(inv, context or default_context(inv.config), this_machine(memory_gb))
        except Exception as e:  # noqa: BLE001 - report, do not crash the other checks
            return Check("M002", "FAIL", f"cannot project memory: {type(e).__name__}: {e}")
        text = proj.summary()
        status = {"RESIDENT": "PASS", "STREAM": "WARN", "WON'T FIT": "FAIL"}[proj.verdict]
        avail = proj.machine.available
        if status == "PASS" and memory_gb is None and avail is not None and proj.need > avail:
            status = "WARN"
            text += f"; only {avail / 1e9:.2f} GB is free now"
        return Check("M002", status, text)

    return run


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.context is not None and args.context < 1:
        print(f"{PROG}: --context must be at least 1", file=sys.stderr)
        return 2
    from turboquant.runtime.doctor import check_folder, check_machine, exit_code
    from turboquant.runtime.repo import RepoError, is_hub_id, resolve

    folder = args.model
    if is_hub_id(folder):  # fetched into the HF cache, as `generate` and `serve` do
        try:
            folder = str(resolve(folder))
        except RepoError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
    checks = check_folder(folder, quick=args.quick)
    by_id = {c.id: c.status for c in checks}
    usable = all(by_id.get(i) == "PASS" for i in ("D001", "D003", "D004"))
    checks += check_machine(memory_check(folder, args.context, args.memory_gb, usable))
    code = exit_code(checks)
    if args.json:
        print(json.dumps({"model": args.model, "exit_code": code,
                          "checks": [c.to_dict() for c in checks]}, indent=2))
        return code
    for c in checks:
        print(c.line())
    counts = {s: sum(c.status == s for c in checks) for s in ("PASS", "WARN", "FAIL", "SKIP")}
    print(f"{PROG}: {counts['PASS']} passed, {counts['WARN']} warnings, {counts['FAIL']} "
          f"failed, {counts['SKIP']} skipped")
    return code


if __name__ == "__main__":
    sys.exit(main())
