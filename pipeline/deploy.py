"""Prefect deployments of the convert flow: one per model family in manifests/recipes/.

Deployment `turboquant-convert/<family>` runs `turboquant.pipeline.flow.convert_flow` (by
module path: a worker imports it from the installed package, nothing is pulled) with the
family's recipe as default parameters; a run gives `source` and `output`. A process work
pool's worker runs it; `turboquant deploy` creates the pool if needed, the deployments,
and two automations that make the orchestrator resume an interrupted conversion:

- *stalled*: a conversion whose flow run stopped sending heartbeats (its worker or machine
  died) is marked Crashed after `stalled_after` seconds (default three heartbeats; a flow
  run sends one every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds, 180 by default);
- *resume*: a crashed conversion is put back in the queue (Scheduled, "AwaitingRetry") up
  to `max_resumes` times; the next worker reruns the same flow run, whose finished jobs are
  served by the cache and whose cut job resumes from its ledger, into the same bytes.

`prefect.yaml` at the repo root declares the same deployments for `prefect deploy --all`;
`prefect_yaml()` writes it (a test checks they agree).
"""

from __future__ import annotations

from datetime import timedelta

from turboquant.manifests.recipe import list_recipes, load_recipe

FLOW_NAME = "turboquant-convert"
ENTRYPOINT = "turboquant.pipeline.flow.convert_flow"
DEFAULT_POOL = "turboquant"
TAG = "turboquant"
STALLED = "turboquant: conversion stopped sending heartbeats"
RESUME = "turboquant: resume crashed conversions"

# recipe value -> convert_flow parameter; offered as a deployment default only when
# passing it explicitly resolves to the very same recipe (same hash)
_DEFAULTS = (("bits", lambda r: r.bits), ("group_size", lambda r: r.group_size),
             ("model_seed", lambda r: r.model_seed),
             ("expert_bits", lambda r: r.data["bits"].get("expert")),
             ("down_proj_bits", lambda r: r.data["bits"].get("down_proj")),
             ("embeddings_bits", lambda r: r.data["bits"].get("embeddings")),
             ("lm_head_bits", lambda r: r.data["bits"].get("lm_head")))


def families(selected: list[str] | None = None) -> list[str]:
    """Recipe families in manifests/recipes/ (all, or `selected`, checked)."""
    known = list_recipes()
    if not selected:
        return known
    unknown = [f for f in selected if f not in known]
    if unknown:
        raise ValueError(f"unknown family {', '.join(unknown)}: the recipes in "
                         f"manifests/recipes/ are {', '.join(known)}")
    return list(dict.fromkeys(selected))


def family_parameters(family: str) -> dict:
    """Default parameters of a family's deployment: its recipe, and each recipe value
    that, passed as a parameter, leaves the resolved recipe unchanged."""
    recipe = load_recipe(family)
    params: dict = {"recipe": family}
    for name, get in _DEFAULTS:
        value = get(recipe)
        if value is None:
            continue
        if recipe.with_overrides(**{name: value}).hash() == recipe.hash():
            params[name] = value
    return params


def deployment_spec(family: str, pool: str = DEFAULT_POOL,
                    work_queue: str | None = None) -> dict:
    """Name, description, tags and parameters of one family's deployment."""
    recipe = load_recipe(family)
    about = recipe.data["description"].rstrip(".")
    desc = (f"Convert a {', '.join(recipe.model_types)} checkpoint with the `{family}` recipe "
            f"({about}). Give `source` (local folder or Hub repo id) and `output`; rerunning "
            "the same parameters resumes.")
    spec = {"name": family, "description": desc, "tags": [TAG, f"family:{family}"],
            "parameters": family_parameters(family), "work_pool": pool}
    if work_queue:
        spec["work_queue"] = work_queue
    return spec


def family_deployments(pool: str = DEFAULT_POOL, selected: list[str] | None = None,
                       work_queue: str | None = None, job_variables: dict | None = None):
    """RunnerDeployment objects (not yet applied) for the selected families."""
    from prefect.deployments.runner import EntrypointType

    from .flow import convert_flow

    out = []
    for family in families(selected):
        s = deployment_spec(family, pool, work_queue)
        out.append(convert_flow.to_deployment(
            name=s["name"], description=s["description"], tags=s["tags"],
            parameters=s["parameters"], work_pool_name=pool, work_queue_name=work_queue,
            job_variables=job_variables or {}, entrypoint_type=EntrypointType.MODULE_PATH))
    return out


def ensure_pool(pool: str) -> bool:
    """Create a process work pool named `pool` unless it exists. True if created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
            return False
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(
                name=pool, type="process",
                base_job_template=ProcessWorker.get_default_base_job_template()))
            return True


def _automation(name: str, trigger, action):
    from prefect.automations import Automation

    return Automation(name=name, description="created by `turboquant deploy`", trigger=trigger,
                      actions=[action])


def resume_automations(max_resumes: int = 3, stalled_after: float | None = None) -> list:
    """The two automations (not yet created): stalled -> Crashed, Crashed -> rescheduled.
    A run is stalled after `stalled_after` seconds without a heartbeat (default: three
    times PREFECT_FLOWS_HEARTBEAT_FREQUENCY as set here; flow runs must send them at least
    that often)."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.settings import get_current_settings

    beat = get_current_settings().flows.heartbeat_frequency or 180
    wait = stalled_after or 3 * beat
    ours = {"prefect.resource.role": "tag", "prefect.resource.id": f"prefect.tag.{TAG}"}
    ends = {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed",
                                              "Cancelling", "AwaitingRetry")}
    stalled = EventTrigger(
        match={"prefect.resource.id": "prefect.flow-run.*"}, match_related=ours,
        after={"prefect.flow-run.heartbeat"},
        expect={"prefect.flow-run.heartbeat", *ends}, for_each={"prefect.resource.id"},
        posture=Posture.Proactive, threshold=1, within=timedelta(seconds=wait))
    crashed = EventTrigger(
        match={"prefect.resource.id": "prefect.flow-run.*",
               "prefect.run-count": [str(n) for n in range(max_resumes + 1)]},
        match_related=ours, expect={"prefect.flow-run.Crashed"}, for_each={"prefect.resource.id"},
        posture=Posture.Reactive, threshold=1, within=timedelta(0))
    return [
        _automation(STALLED, stalled, ChangeFlowRunState(
            state=StateType.CRASHED, force=True,
            message=f"no heartbeat for {wait:g} s: the worker running it is gone")),
        _automation(RESUME, crashed, ChangeFlowRunState(
            state=StateType.SCHEDULED, name="AwaitingRetry", force=True,
            message="resuming after a crash: finished jobs are kept, the cut one resumes "
                    "from its ledger")),
    ]


def apply_automations(automations: list) -> list[str]:
    """Create the automations, replacing any of the same name. Returns their names."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for a in automations:
            for old in client.read_automations_by_name(a.name):
                client.delete_automation(old.id)
            a.create()
    return [a.name for a in automations]


def deploy(pool: str = DEFAULT_POOL, selected: list[str] | None = None,
           work_queue: str | None = None, job_variables: dict | None = None,
           create_pool: bool = True, auto_resume: bool = True, max_resumes: int = 3,
           stalled_after: float | None = None) -> list[tuple[str, str]]:
    """Create (or update) the deployments on the Prefect API in PREFECT_API_URL.
    Returns [(deployment name, id)]."""
    if create_pool:
        ensure_pool(pool)
    done = []
    for d in family_deployments(pool, selected, work_queue, job_variables):
        done.append((f"{FLOW_NAME}/{d.name}", str(d.apply(work_pool_name=pool))))
    if auto_resume:
        apply_automations(resume_automations(max_resumes, stalled_after))
    return done


def resume_run(flow_run_id: str) -> str:
    """Put a crashed (or stuck) conversion run back in its queue, by hand: what the resume
    automation does. Returns the new state's name."""
    from prefect.client.orchestration import get_client
    from prefect.states import Scheduled

    with get_client(sync_client=True) as client:
        state = Scheduled(name="AwaitingRetry", message="resumed by `turboquant deploy --resume`")
        return client.set_flow_run_state(flow_run_id, state, force=True).state.name


def prefect_yaml(pool: str = DEFAULT_POOL, selected: list[str] | None = None) -> str:
    """The text of prefect.yaml declaring the same deployments (`prefect deploy --all`)."""
    import json

    lines = [
        "# Prefect deployments of the TurboQuant convert flow, one per model family.",
        "# Generated by `turboquant deploy --print-yaml`; tests/test_deploy_units.py checks",
        "# it matches manifests/recipes/. Deploy with a Prefect server in PREFECT_API_URL:",
        f"#   prefect work-pool create {pool} --type process",
        "#   prefect deploy --all",
        f"#   prefect worker start --pool {pool}",
        "# (`turboquant deploy` does the first two and adds the resume automations.)",
        "name: turboquant",
        "",
        "build: null",
        "push: null",
        "pull: null",
        "",
        "deployments:",
    ]
    for family in families(selected):
        s = deployment_spec(family, pool)
        lines += [
            f"- name: {s['name']}",
            f"  entrypoint: {ENTRYPOINT}",
            f"  description: {json.dumps(s['description'])}",
            f"  tags: {json.dumps(s['tags'])}",
            "  parameters:",
            *[f"    {k}: {json.dumps(v)}" for k, v in s["parameters"].items()],
            "  work_pool:",
            f"    name: {pool}",
            "    work_queue_name: null",
            "    job_variables: {}",
            "  schedules: []",
        ]
    return "\n".join(lines) + "\n"
