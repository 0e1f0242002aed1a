"""`turboquant publish OUTPUT... --repo-id ID | --org ORG`: TurboQuant repos -> the Hub.

Uploads only the files the Hub does not already hold (rerunning is safe and resumes an
interrupted upload), never the conversion state, and prints one line per repo. See
docs/publish.md.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="turboquant publish",
        description="Publish converted TurboQuant repos to the Hugging Face Hub (HF_ENDPOINT "
        "and HF_TOKEN are honoured): create each repo, write its model card if missing, "
        "and upload only the files that differ from the Hub's copy.",
    )
    p.add_argument("outputs", nargs="+", metavar="OUTPUT", help="output folder of "
                   "`turboquant convert`")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--repo-id", help="the Hub repo (ORG/NAME) of a single OUTPUT")
    who.add_argument("--org", help="publish each OUTPUT as ORG/<folder name>")
    p.add_argument("--private", action="store_true", help="create the repos private")
    p.add_argument("--dry-run", action="store_true", help="list what would be uploaded; "
                   "create and upload nothing")
    p.add_argument("--base-model", help="Hub id of the source model, written into the model "
                   "card's metadata (base_model)")
    p.add_argument("--prune", action="store_true", help="also delete files of the Hub repo "
                   "that the folder no longer has (e.g. shards of an older layout)")
    p.add_argument("--revision", help="branch to publish to (default: main)")
    p.add_argument("--concurrency", type=int, default=4, help="repos uploaded at once "
                   "(default 4)")
    p.add_argument("--no-prefect", action="store_true", help="the same steps without Prefect")
    p.add_argument("-q", "--quiet", action="store_true", help="only the summary table")
    p.add_argument("-v", "--verbose", action="store_true", help="Prefect's INFO logs, upload "
                   "progress bars, and each repo's file list")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.concurrency < 1:
        print("turboquant publish: error: --concurrency must be >= 1", file=sys.stderr)
        return 2
    from turboquant.pipeline.publish import (PublishError, publish_many, repo_ids_for,
                                             summary_table)

    try:
        ids = repo_ids_for(args.outputs, args.repo_id, args.org)
    except PublishError as e:
        print(f"turboquant publish: error: {e}", file=sys.stderr)
        return 2
    _logging(args, len(args.outputs))
    options = dict(private=args.private, dry_run=args.dry_run, base_model=args.base_model,
                   prune=args.prune, revision=args.revision)
    if args.no_prefect:
        results = publish_many(args.outputs, ids, args.concurrency, **options)
    else:
        from turboquant.pipeline.flow_env import configure_prefect_env

        configure_prefect_env(args.verbose)
        from turboquant.pipeline.publish_flow import run_publish_flow

        results = run_publish_flow(args.outputs, ids, args.concurrency, **options)
    if args.dry_run or args.verbose:
        for r in results:
            for path in r.uploaded:
                print(f"{r.repo_id}: {'would upload' if args.dry_run else 'uploaded'} {path}")
            for path in r.deleted:
                print(f"{r.repo_id}: {'would delete' if args.dry_run else 'deleted'} {path}")
    print(summary_table(results, dry_run=args.dry_run))
    return 0 if all(r.ok for r in results) else 1


def _logging(args, repos: int) -> None:
    """One line per repo on stderr as it goes; huggingface_hub's per-file progress bars only
    for a single repo on a terminal (or -v): bars of several uploads at once interleave."""
    import logging

    log = logging.getLogger("turboquant.publish")
    if not args.quiet and not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    from huggingface_hub.utils import disable_progress_bars

    if args.quiet or not (args.verbose or (repos == 1 and sys.stderr.isatty())):
        disable_progress_bars()


if __name__ == "__main__":
    sys.exit(main())
