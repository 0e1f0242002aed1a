"""turboquant.pipeline: convert Hugging Face checkpoints into TurboQuant repos.

Thin orchestration around `turboquant.stages` (the codec) and `turboquant.manifests`
(recipes, manifest schema):

    sources.py         local folder / Hub repo: metadata first, shards on demand
    safetensors_io.py  headers checked against the file; positioned reads; bf16/fp16/fp32
    plan.py            the metadata-only validation pass: jobs, units, output layout
    job.py             one job as a plain function: read -> encode -> write (resumable)
    ledger.py          what is durable: ledgers, partial shards, markers, locks
    repo.py, card.py   manifest.parquet, index, config.json, tokenizer, README.md
    convert.py         the conversion without Prefect (validate, run jobs, finish)
    flow.py            the same as a Prefect 3 flow, one task per job
    head_start.py      the flow's first steps, begun before Prefect is imported (CLI)
    flow_api.py        Prefect's API served from this process for the run
    flow_record.py     a local run's Prefect record, written by a side process
    verify.py          re-read a repo: checksums, decoded errors
    progress.py        tqdm bars driven by the ledgers
    distributed.py     the jobs on Dask (local cluster or a scheduler address)

Arrows point down: job.py and ledger.py at the bottom, distributed.py (Dask) on the jobs,
convert.py (the plain conversion) on both, head_start.py on convert.py, and flow.py (the
Prefect flow, its Dask tasks) on top of them all.
    publish.py         upload converted repos to the Hub, only what changed
    publish_flow.py    the same as a Prefect flow, one task per repo
    deploy.py          Prefect deployments per model family, resume of crashed runs
    fit*.py            memory projection for `turboquant plan`

Nothing imports this package except the CLI (turboquant.convert, verify, plan, publish,
deploy).
"""
