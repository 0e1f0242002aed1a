"""`turboquant convert SOURCE OUTPUT`: a Hugging Face checkpoint -> a TurboQuant repo.

Running the same command again resumes where it stopped (the output folder's ledger says
what is done). See docs/convert.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import multiprocessing.util
import os
import re
import sys

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_size(text: str) -> int:
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GB, 500MB, 0)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_bits(text: str):
    """Bits of a kind of weight (--expert-bits, --embeddings-bits ...): 2, 3, 4, ternary or
    raw (kept in 16 bits)."""
    t = text.strip().lower()
    if t in ("ternary", "raw"):
        return t
    if t in ("2", "3", "4"):
        return int(t)
    raise argparse.ArgumentTypeError(f"must be 2, 3, 4, ternary or raw, got {text!r}")


def parse_main_bits(text: str):
    """--bits: 2, 3, 4 or ternary (raw is for kinds of weight, not the default)."""
    if text.strip().lower() == "raw":
        raise argparse.ArgumentTypeError("must be 2, 3, 4 or ternary; raw (16-bit) is for "
                                         "--expert-bits, --down-proj-bits, --embeddings-bits "
                                         "and --lm-head-bits")
    try:
        return parse_bits(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be 2, 3, 4 or ternary, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="turboquant convert",
        description="Convert a Hugging Face checkpoint (a local folder or a Hub repo id) into a "
        "TurboQuant repo, tensor by tensor, in bounded memory. Rerunning the same command "
        "resumes an interrupted conversion.",
    )
    p.add_argument("source", help="local Hugging Face folder, or Hub repo id (org/name)")
    p.add_argument("output", help="output folder (created; resumed if it holds this conversion)")
    r = p.add_argument_group("recipe (defaults come from the model family's recipe)")
    r.add_argument("--recipe", help="bundled recipe name or path to a .toml file (default: "
                   "chosen by config.json's model_type)")
    r.add_argument("--bits", type=parse_main_bits, help="bits of attention and dense MLP "
                   "weights (2, 3, 4 or ternary)")
    r.add_argument("--group-size", type=int, choices=(32, 64, 128), help="weights per scale")
    r.add_argument("--expert-bits", type=parse_bits, help="bits of MoE expert weights (2, 3, 4 "
                   "or ternary)")
    r.add_argument("--down-proj-bits", type=parse_bits, help="bits of down projections, or raw")
    r.add_argument("--embeddings-bits", type=parse_bits, help="bits of the embeddings, or raw")
    r.add_argument("--lm-head-bits", type=parse_bits, help="bits of lm_head, or raw")
    r.add_argument("--protect-layers", type=int, metavar="N", help="first and last N decoder "
                   "layers at the recipe's protect bits (0: none)")
    r.add_argument("--model-seed", type=int, help="seed of all rotations (default 0)")
    r.add_argument("--column-scales", choices=("auto", "off"), help="per-input-column scales "
                   "of linear layers with small columns (format 2; docs/recipes.md)")
    r.add_argument("--codec", choices=("scalar", "trellis"), help="the code of every coded "
                   "weight: scalar (Lloyd-Max levels) or trellis (about half the weight error "
                   "at the same bits, a Viterbi search per row at conversion; docs/recipes.md)")
    r.add_argument("--trellis-state-bits", type=int, metavar="L", help="state bits of the "
                   "trellis code, 8-20 (more: lower error, slower conversion; default the "
                   "recipe's, else 16)")
    r.add_argument("--trellis-values", type=int, choices=(1, 2), metavar="V", help="weights "
                   "a trellis step codes, 1 or 2 (default the recipe's, else 1)")
    r.add_argument("--trellis-version", type=int, choices=(1, 2), metavar="N", help="the "
                   "trellis's computed codebook: 1 (with a shift-xor) or 2 (without: fewer GPU "
                   "instructions a weight; default the recipe's, else 1; docs/FORMAT.md)")
    s = p.add_argument_group("source")
    s.add_argument("--revision", help="Hub branch, tag or commit")
    s.add_argument("--delete-source", action="store_true", help="Hub source: delete each "
                   "downloaded shard once every job reading it is done (disks smaller than the "
                   "model)")
    x = p.add_argument_group("execution")
    x.add_argument("--workers", type=int, help="jobs at once, each in its own process "
                   "(default: one per core, as many as the memory holds)")
    x.add_argument("--dask-workers", type=int, default=0, metavar="N", help="run the jobs on "
                   "a local Dask cluster of N worker processes")
    x.add_argument("--dask-address", metavar="ADDR", help="run the jobs on an existing Dask "
                   "scheduler (tcp://host:8786) whose workers see the same output folder")
    x.add_argument("--fresh", action="store_true", help="delete this output's previous "
                   "conversion and start over")
    x.add_argument("--job-size", default="1GB:5GB", metavar="MIN[:MAX]", help="source bytes "
                   "per job: small shards are grouped up to MIN, shards over MAX are split "
                   "(default 1GB:5GB; 0 = one job per shard)")
    x.add_argument("--no-prefect", action="store_true", help="run the same steps without "
                   "Prefect (no API server, no record)")
    x.add_argument("--live-flow", action="store_true", help="run the jobs as tasks of a Prefect "
                   "flow in this process (the default when a Prefect API is configured; "
                   "otherwise a side process records the run once it ends)")
    x.add_argument("--in-process", action="store_true", help="run jobs in this process, one "
                   "after the other (debugging)")
    x.add_argument("--dry-run", action="store_true", help="validate and print the plan; "
                   "write nothing")
    x.add_argument("--no-disk-check", action="store_true", help=argparse.SUPPRESS)
    o = p.add_argument_group("output")
    o.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    o.add_argument("-v", "--verbose", action="store_true", help="Prefect's INFO logs")
    o.add_argument("--input-stats", metavar="FILE", help="optional: input statistics from "
                   "`turboquant calibrate`; the manifest's out_error (each coded tensor's "
                   "output error, docs/quality.md) then weights by them instead of by the "
                   "layer's own norm weights; the codes are the same")
    o.add_argument("--list-recipes", action="store_true", help=argparse.SUPPRESS)
    return p


def _quiet_prefect(verbose: bool) -> None:
    """Before Prefect is imported: warnings only, analytics off; task and flow failures
    are reported once, by this command, not as Prefect tracebacks."""
    from turboquant.pipeline.flow_env import configure_prefect_env

    configure_prefect_env(verbose)


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """Run the command; returns its exit status.

    `own_process`: this process runs nothing else (the `turboquant` command itself, never a
    caller that goes on, such as a test). A Prefect-mode run may then take two
    process-wide shortcuts (issue 3, both measured on the 2-core machine): the objects
    that importing Prefect builds are frozen out of the cyclic GC (`gc.freeze`: every full
    collection would scan them again, ~0.6 s of a run), and once the summary or the error
    is printed the process leaves with `os._exit`, skipping the interpreter's teardown of
    Prefect's modules (~1.1 s). By then every output file, ledger line and manifest is
    durable (fsync'ed), Prefect's log and event workers are drained and its in-process API
    server is stopped (pipeline/flow_api.py).
    """
    args = build_parser().parse_args(argv)
    status = _run(args, own_process)
    if own_process and uses_prefect(args):
        leave(status)
    return status


def uses_prefect(args: argparse.Namespace) -> bool:
    return not args.no_prefect and not args.dry_run


def leave(status: int) -> None:
    """End this process now with `status`, without the interpreter's teardown: first what a
    normal exit would still do that matters (finalizers of objects in reference cycles;
    multiprocessing's exit finalizers, such as its semaphore cleanup; log handlers; stdout
    and stderr), then `os._exit`."""
    gc.collect()  # ~30 ms: only what was built after gc.freeze()
    # what multiprocessing's atexit hook runs (os._exit skips it): its finalizers, among
    # them the unlinking of the worker pool's queue semaphores, which the resource tracker
    # would otherwise report as leaked (it did in about 1 run in 8 on 2 loaded cores)
    multiprocessing.util._run_finalizers(0)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    os._exit(status)


def _run(args: argparse.Namespace, own_process: bool) -> int:
    try:
        lo, _, hi = args.job_size.partition(":")
        min_job = parse_size(lo)
        max_job = parse_size(hi) if hi else max(min_job, 5 * 10**9)
    except argparse.ArgumentTypeError as e:
        print(f"turboquant convert: error: --job-size: {e}", file=sys.stderr)
        return 2
    if max_job <= 0:
        print("turboquant convert: error: --job-size MAX must be positive", file=sys.stderr)
        return 2
    if args.workers is None:  # sized from the cores and the memory (pipeline/machine.py)
        from turboquant.pipeline.machine import default_workers

        args.workers = default_workers()
    if args.workers < 1:
        print("turboquant convert: error: --workers must be >= 1", file=sys.stderr)
        return 2
    if args.dask_workers < 0 or (args.dask_workers and args.dask_address):
        print("turboquant convert: error: give --dask-workers N (a local cluster) or "
              "--dask-address ADDR (an existing scheduler), not both", file=sys.stderr)
        return 2
    if _starts_workers(args) and not _maybe_finished(args.output):
        from turboquant.pipeline.machine import start_worker_server

        # first: the workers' modules (~0.5 s of one core) load while this process imports
        # the pipeline and validates; a finished output (a no-op rerun) starts none
        start_worker_server()
    from turboquant.pipeline.convert import ConvertOptions, convert, finished, validate
    from turboquant.pipeline.errors import ConversionError
    from turboquant.manifests.recipe import RecipeError

    opts = ConvertOptions(
        source=args.source, output=args.output, recipe=args.recipe, bits=args.bits,
        group_size=args.group_size, expert_bits=args.expert_bits,
        down_proj_bits=args.down_proj_bits, embeddings_bits=args.embeddings_bits,
        lm_head_bits=args.lm_head_bits, protect_layers=args.protect_layers,
        model_seed=args.model_seed, column_scales=args.column_scales,
        codec=args.codec, trellis_state_bits=args.trellis_state_bits,
        trellis_values=args.trellis_values, trellis_version=args.trellis_version,
        revision=args.revision, workers=args.workers,
        in_process=args.in_process, fresh=args.fresh, delete_source=args.delete_source,
        min_job_bytes=min_job, max_job_bytes=max_job,
        progress=not args.quiet and sys.stderr.isatty(), check_disk=not args.no_disk_check,
        dask_workers=args.dask_workers, dask_address=args.dask_address,
        input_stats=args.input_stats,
    )
    try:
        if args.dry_run:
            print(describe_plan(validate(opts)))
            return 0
        if opts.input_stats:  # a bad file fails now, not after the conversion
            from turboquant.pipeline.calibrate import read_stats

            try:
                read_stats(opts.input_stats)
            except ValueError as e:
                print(f"turboquant convert: error: --input-stats: {e}", file=sys.stderr)
                return 2
        # a finished conversion of the same source is found before Prefect is imported
        # (with --input-stats the run goes on: its jobs are done, the manifest is rewritten)
        done = None if opts.input_stats else finished(opts)
        if done is not None:
            print(done.text())
            return 0
        if _starts_workers(args):
            from turboquant.pipeline.machine import start_worker_server

            start_worker_server()  # running already unless the output looked finished
        if uses_prefect(args):
            _quiet_prefect(args.verbose)
        if args.no_prefect:
            summary = convert(opts)
        else:
            summary = _run_flow(opts, freeze=own_process, live=args.live_flow,
                                wait_record=not own_process)
    except (ConversionError, RecipeError) as e:
        print(f"turboquant convert: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("turboquant convert: interrupted; run the same command again to resume",
              file=sys.stderr)
        return 130
    print(summary.text())
    return 0


def _starts_workers(args: argparse.Namespace) -> bool:
    """Whether the run's jobs go to worker processes started here (machine.py)."""
    return not (args.dry_run or args.in_process or args.dask_workers or args.dask_address)


def _maybe_finished(output: str) -> bool:
    """Whether OUTPUT holds a finished conversion's marker (pipeline/ledger.py's layout:
    OUTPUT/.turboquant/complete), checked without importing the pipeline."""
    return os.path.exists(os.path.join(output, ".turboquant", "complete"))


def _run_flow(opts, freeze: bool, live: bool = False, wait_record: bool = True):
    """The run and its Prefect record. With no Prefect API configured (and no --live-flow),
    the plain steps run here and a side process records them as the flow once they end
    (pipeline/flow_record.py): no Prefect in this process. Otherwise the Prefect flow, with
    a head start where it applies: the validation, the output's lock and the worker
    processes' jobs begin before Prefect is imported, and convert while it loads (about 2 s
    of one core; pipeline/head_start.py). The flow then takes them over and records them as
    its task runs, or raises what failed where it belongs. `wait_record`: return only once
    a side process's record is written (a caller in Python); the command's own process
    does not wait."""
    from turboquant.pipeline import flow_record, head_start

    if flow_record.applies(opts, live):
        # imports Prefect at the lowest priority meanwhile
        recorder = flow_record.Recorder(opts, detached=not wait_record)
        return flow_record.run(head_start.begin(opts), recorder, wait=wait_record)
    head = head_start.begin(opts) if head_start.applies(opts) else None
    try:
        run_convert_flow = _import_flow(freeze)
    except BaseException:
        if head is not None:
            head.close()
        raise
    return run_convert_flow(opts, head)


# The cyclic GC's thresholds while Prefect's modules load (own process only): with the
# default (700, 10, 10) the ~300,000 objects they build set off ~670 young and 5 full
# collections, ~0.45 s of a 2.1 s import on the 2-core machine; with these, ~30 and none,
# and no more garbage is left after the import than with the default.
IMPORT_GC_THRESHOLD = (50_000, 20, 100)


@contextlib.contextmanager
def gc_threshold(threshold: tuple[int, int, int]):
    """Within: the cyclic GC's thresholds set to `threshold`; restored on leaving."""
    before = gc.get_threshold()
    gc.set_threshold(*threshold)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _import_flow(freeze: bool):
    """`run_convert_flow`, imported with Prefect's API app when that will be served here.
    With `freeze` (a process of its own), the imports run with the GC's thresholds raised
    (IMPORT_GC_THRESHOLD), and what they built (about 300,000 objects the GC tracks) is
    then left out of the cyclic GC's scans for the rest of the process (`gc.freeze`)."""
    with gc_threshold(IMPORT_GC_THRESHOLD) if freeze else contextlib.nullcontext():
        from turboquant.pipeline.flow import run_convert_flow
        from turboquant.pipeline.flow_api import import_server_app

        import_server_app()
    if freeze:
        gc.freeze()
    return run_convert_flow


def describe_plan(p) -> str:
    plan = p.plan
    coded = [it for it in plan.items if it.codec != "raw"]
    lines = [
        f"source: {plan.source}",
        f"recipe: {plan.recipe.name} ({plan.recipe.source}), hash {plan.recipe_hash[:16]}",
        f"tensors: {sum(1 for _ in plan.items)} ({len(coded)} coded, "
        f"{len(plan.kept_small)} too small to code, {len(plan.dropped)} dropped)",
        f"jobs: {len(plan.jobs)}; source {plan.read_bytes / 1e9:.3f} GB -> output "
        f"{plan.out_bytes / 1e9:.3f} GB",
    ]
    for job in plan.jobs[:20]:
        lines.append(f"  {job.name}: {len(job.units)} units from {', '.join(job.files)} -> "
                     f"{job.shard} ({job.size / 1e6:.1f} MB)")
    if len(plan.jobs) > 20:
        lines.append(f"  ... {len(plan.jobs) - 20} more")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(own_process=True))
