"""`turboquant deploy`: one Prefect deployment of the convert flow per model family.

Needs a Prefect server (PREFECT_API_URL). Creates the process work pool if missing, the
deployments `turboquant-convert/<family>` with the family's recipe as default parameters,
and the automations that resume a conversion whose worker died. See docs/publish.md.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="turboquant deploy",
        description="Create one Prefect deployment of the convert flow per model family "
        "(manifests/recipes/*.toml) on the Prefect server in PREFECT_API_URL, run by a "
        "process work pool's worker: `prefect worker start --pool NAME`.",
    )
    p.add_argument("--pool", default=None, help="process work pool (created if missing; "
                   "default: turboquant)")
    p.add_argument("--family", action="append", metavar="F", help="only this family (repeat "
                   "for several; default: every recipe)")
    p.add_argument("--work-queue", help="work queue of the pool (default: the pool's default)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment "
                   "variable of the flow runs (a job variable; repeat for several)")
    p.add_argument("--no-create-pool", action="store_true", help="fail if the pool is missing")
    p.add_argument("--no-auto-resume", action="store_true", help="do not create the automations "
                   "that resume a conversion whose worker died")
    p.add_argument("--max-resumes", type=int, default=3, help="automatic resumes of one run "
                   "(default 3)")
    p.add_argument("--stalled-after", type=float, metavar="SECONDS", help="a run without a "
                   "heartbeat for this long is marked Crashed (default: 3 x "
                   "PREFECT_FLOWS_HEARTBEAT_FREQUENCY, which is 180 s unless set)")
    p.add_argument("--list", action="store_true", help="print the deployments and their "
                   "default parameters; change nothing")
    p.add_argument("--print-yaml", action="store_true", help="print the prefect.yaml that "
                   "declares the same deployments")
    p.add_argument("--resume", metavar="FLOW_RUN_ID", help="put a crashed or stuck run back in "
                   "its queue (what the resume automation does)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from turboquant.pipeline.flow_env import configure_prefect_env

    configure_prefect_env()
    from turboquant.pipeline import deploy as d

    pool = args.pool or d.DEFAULT_POOL
    try:
        fams = d.families(args.family)
    except ValueError as e:
        print(f"turboquant deploy: error: {e}", file=sys.stderr)
        return 2
    if args.print_yaml:
        print(d.prefect_yaml(pool, fams), end="")
        return 0
    if args.list:
        for f in fams:
            s = d.deployment_spec(f, pool, args.work_queue)
            params = ", ".join(f"{k}={v}" for k, v in s["parameters"].items())
            print(f"{d.FLOW_NAME}/{f}  pool={pool}  {params}")
        return 0
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"turboquant deploy: error: --env {item!r}: expected KEY=VALUE",
                  file=sys.stderr)
            return 2
        env[key] = value

    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if not url:
        print("turboquant deploy: error: no Prefect server: start one (`prefect server start`) "
              "and set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api)", file=sys.stderr)
        return 2
    try:
        if args.resume:
            print(f"flow run {args.resume}: {d.resume_run(args.resume)}")
            return 0
        done = d.deploy(pool, fams, args.work_queue, {"env": env} if env else None,
                        create_pool=not args.no_create_pool,
                        auto_resume=not args.no_auto_resume, max_resumes=args.max_resumes,
                        stalled_after=args.stalled_after)
    except Exception as e:  # noqa: BLE001 - the API's answer, in one line
        print(f"turboquant deploy: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    for name, ident in done:
        print(f"deployed {name} ({ident}) to pool {pool!r}")
    if not args.no_auto_resume:
        print(f"automations: {d.STALLED!r}, {d.RESUME!r} (up to {args.max_resumes} resumes)")
    print(f"start a worker: prefect worker start --pool {pool}")
    print(f"run one:        prefect deployment run '{d.FLOW_NAME}/{fams[0]}' "
          "--param source=ORG/MODEL --param output=/data/out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
