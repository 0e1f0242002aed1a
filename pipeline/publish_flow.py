"""The Prefect 3 flow `publish`: one task per repo, a bounded number at a time.

Each task wraps the plain `turboquant.pipeline.publish.publish_repo`. A task that fails
(the Hub answered an error, the network dropped) is retried: publishing is idempotent,
what the Hub already holds is not sent again. A repo that still fails is reported in the
summary table, and the other repos go on.

Importing this module first sets Prefect's quiet defaults (see flow_env.py).
"""

from __future__ import annotations

from .flow_env import configure_prefect_env

configure_prefect_env()

from prefect import flow, task  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402
from prefect.task_runners import ThreadPoolTaskRunner  # noqa: E402

from .publish import PublishError, PublishResult, failed, publish_repo  # noqa: E402


def _worth_retrying(task, task_run, state) -> bool:
    """Network and Hub errors are retried; a folder that cannot be published is not."""
    return not isinstance(state.result(raise_on_failure=False), PublishError)


@task(name="publish-repo", cache_policy=NO_CACHE, persist_result=False, retries=2,
      retry_delay_seconds=5, retry_condition_fn=_worth_retrying)
def publish_task(folder: str, repo_id: str, private: bool, dry_run: bool,
                 base_model: str | None, prune: bool, revision: str | None) -> PublishResult:
    return publish_repo(folder, repo_id, private=private, dry_run=dry_run,
                        base_model=base_model, prune=prune, revision=revision)


@flow(name="turboquant-publish", persist_result=False, log_prints=False,
      task_runner=ThreadPoolTaskRunner(max_workers=4))
def publish_flow(outputs: list[str], repo_ids: list[str], private: bool = False,
                 dry_run: bool = False, base_model: str | None = None, prune: bool = False,
                 revision: str | None = None, retries: int = 2) -> list[PublishResult]:
    """Publish each output folder to its Hub repo (`repo_ids[i]` for `outputs[i]`);
    a failed upload is retried `retries` times (it resumes)."""
    if len(outputs) != len(repo_ids):
        raise ValueError(f"{len(outputs)} outputs but {len(repo_ids)} repo ids")
    futures = [
        publish_task.with_options(name=f"publish-{rid.replace('/', '-')}", retries=retries)
        .submit(out, rid, private, dry_run, base_model, prune, revision)
        for out, rid in zip(outputs, repo_ids)
    ]
    results = []
    for out, rid, fut in zip(outputs, repo_ids, futures):
        fut.wait()
        state = fut.state
        if state.is_completed():
            results.append(state.result())
        else:
            try:
                state.result()  # raises the task's error
                results.append(failed(rid, out, state.message or state.name))
            except Exception as e:  # noqa: BLE001 - reported per repo
                results.append(failed(rid, out, e))
    return results


def run_publish_flow(outputs: list[str], repo_ids: list[str], concurrency: int = 4,
                     **options) -> list[PublishResult]:
    """Run `publish_flow` with `concurrency` repos at a time."""
    runner = ThreadPoolTaskRunner(max_workers=max(1, concurrency))
    return publish_flow.with_options(task_runner=runner)(outputs, repo_ids, **options)
