"""docs/scale-out.md against the files and code it names: what a Celery worker reserves, which DAG settings an
operator's variable changes, and which queues the documented workers consume (static, function-level checks)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
DOC = (REPO / "docs" / "scale-out.md").read_text()
COMPOSE = yaml.safe_load((REPO / "docker" / "docker-compose.yml").read_text())


def _airflow_worker_concurrency_default() -> int:
    """Airflow's own default for [celery] worker_concurrency (the provider's config description)."""
    from airflow.providers.celery.get_provider_info import get_provider_info

    return int(get_provider_info()["config"]["celery"]["options"]["worker_concurrency"]["default"])


def _reserved(env: dict) -> int:
    """How many tasks a real Celery worker started as `airflow celery worker` with this environment reserves from
    the broker at once (Airflow passes --concurrency [celery] worker_concurrency, and the pool and
    worker_prefetch_multiplier (1) to Celery)."""
    from celery import Celery

    concurrency = int(env.get("AIRFLOW__CELERY__WORKER_CONCURRENCY", _airflow_worker_concurrency_default()))
    app = Celery(broker="memory://")
    worker = app.WorkController(
        pool_cls=env.get("AIRFLOW__CELERY__POOL", "prefork"), concurrency=concurrency, prefetch_multiplier=1
    )
    return worker.consumer.initial_prefetch_count


def _bare_metal_exports() -> dict:
    recipe = DOC.split("## Bare metal", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    out = {}
    for line in recipe.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("export "):
            out.update(re.findall(r"([A-Z_][A-Z0-9_]*)=(\S+)", line))
    return out


def test_a_solo_worker_reserves_only_the_task_it_runs():
    """A solo worker runs one task at a time; at Airflow's default concurrency (16) Celery would still reserve 16,
    which it runs one after another while the other workers idle: compose and the bare-metal recipe set 1."""
    workers = [COMPOSE["services"]["celery-worker"]["environment"], _bare_metal_exports()]
    for env in workers:
        assert env["AIRFLOW__CELERY__POOL"] == "solo"
        assert _reserved(env) == 1, env.get("AIRFLOW__CELERY__WORKER_CONCURRENCY")


def test_the_doc_names_no_variable_that_the_dags_override():
    """Every DAG file sets max_active_runs itself, so [core] max_active_runs_per_dag never applies to them: the doc
    must not promise that AIRFLOW__CORE__MAX_ACTIVE_RUNS_PER_DAG changes it."""
    explicit = []
    for path in sorted((REPO / "dags").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "max_active_runs":
                explicit.append(path.name)
    assert explicit
    sentence = re.search(r"[^.]*AIRFLOW__CORE__MAX_ACTIVE_RUNS_PER_DAG[^.]*", DOC)
    if sentence:
        assert "changes it" not in sentence.group(0) and "does not" in sentence.group(0), sentence.group(0)


def test_every_queue_a_stage_goes_to_has_a_documented_worker(tmp_path):
    """The doc's site preset sends the device stages to its device_queue and the rest to Airflow's default queue:
    each has a worker in the doc (`airflow celery worker --queues ...`) or compose (CELERY_WORKER_QUEUES)."""
    from tasks.config import load_config
    from tasks.device import DEVICE_STAGES
    from tasks.launch.placement import celery_queue
    from tasks.stages import STAGES

    line = re.search(r"^hardware: \{.*device_queue.*\}$", DOC, re.M).group(0)
    site = tmp_path / "site.yaml"
    site.write_text(line + "\n")
    cfg = load_config(str(site))
    queues = {stage: celery_queue(stage, cfg) or "default" for stage in STAGES}
    assert {queues[s] for s in DEVICE_STAGES} == {cfg.hardware.device_queue}
    assert {q for s, q in queues.items() if s not in DEVICE_STAGES} == {"default"}
    consumed = set()
    for found in re.findall(r"airflow celery worker --queues (\S+)", DOC):
        consumed.update(found.split(","))
    assert set(queues.values()) <= consumed, set(queues.values()) - consumed
    compose_default = re.search(
        r"CELERY_WORKER_QUEUES:-([^}]+)\}", COMPOSE["services"]["celery-worker"]["command"][-1]
    ).group(1)
    assert "default" in compose_default.split(",")
    # a kubernetes launcher keeps every task on the default queue (its pods are placed by the cluster)
    k8s = cfg.model_copy(update={"hardware": cfg.hardware.model_copy(update={"launcher": "kubernetes"})})
    assert all(celery_queue(stage, k8s) is None for stage in STAGES)


def test_bare_metal_flower_asks_for_a_password():
    """Flower listens on every address by default ([celery] flower_host 0.0.0.0) and can stop workers: the recipe
    starts it behind basic auth, as compose does (FLOWER_PASSWORD)."""
    recipe = DOC.split("## Bare metal", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    (line,) = [ln for ln in recipe.splitlines() if "airflow celery flower" in ln]
    assert re.search(r"AIRFLOW__CELERY__FLOWER_BASIC_AUTH=\S+:\S+ airflow celery flower|--basic-auth", line), line
    assert "AIRFLOW__CELERY__FLOWER_BASIC_AUTH" in str(COMPOSE["services"]["flower"]["environment"])


def test_the_npu_worker_is_given_the_paths_of_the_deployment_it_joins():
    """The NPU node's worker was told to use the bare-metal block (every host's) also against the compose stack:
    LLM_PIPELINE_VAR_DIR=/shared/llm, BASE_LOG_FOLDER=/shared/llm/logs, HF_HOME=/shared/llm/hf, where the compose
    services use /var/lib/llm, so the shard and run paths in XCom and the task logs did not resolve. The doc's table
    gives each deployment's own value: the bare-metal recipe's, and compose's (its environment, else the image's)."""
    section = DOC.split("## Queues for NPU nodes", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            for name in re.findall(r"`([A-Z_]+)`", cells[0]):
                rows[name] = cells[1:]
    bare = _bare_metal_exports()
    worker = COMPOSE["services"]["celery-worker"]["environment"]
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.ascend"):  # compose runs the one, NPU nodes the other
        image = dict(re.findall(r"\b([A-Z_]+)=(/\S+)", (REPO / "docker" / dockerfile).read_text()))
        for name in ("LLM_PIPELINE_VAR_DIR", "AIRFLOW__LOGGING__BASE_LOG_FOLDER"):
            assert image[name] == worker.get(name, image[name]), (dockerfile, name)
    compose = {**image, **worker}
    for name in ("LLM_PIPELINE_VAR_DIR", "AIRFLOW__LOGGING__BASE_LOG_FOLDER", "HF_HOME"):
        assert name in rows, f"docs/scale-out.md: the NPU worker's {name} is not in the table"
        on_bare_metal, on_compose = rows[name]
        assert f"`{bare[name]}`" in on_bare_metal, (name, on_bare_metal)
        assert f"`{compose[name]}`" in on_compose and bare[name] not in on_compose, (name, on_compose)
    assert compose["HF_HOME"].startswith(compose["LLM_PIPELINE_VAR_DIR"] + "/")


def test_the_bare_metal_recipe_creates_the_role_and_the_databases_its_urls_name():
    """The recipe said `createdb airflow; createdb mlflow`: no `airflow` role (its URLs log in as airflow with
    $PGPASS), and databases owned by postgres, in whose schema public PostgreSQL 15+ lets no one else create tables
    (`airflow db migrate`: permission denied for schema public). Each URL's user is created with a password and owns
    its database, as compose's airflow owns mlflow (docker/postgres-init.sql)."""
    from sqlalchemy.engine import make_url

    recipe = DOC.split("## Bare metal", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    urls = [make_url(u) for u in re.findall(r"postgresql\+psycopg2://[^\s\"']+", recipe)]
    named = {(u.username, u.database) for u in urls}
    assert {db for _, db in named} == {"airflow", "mlflow"}, named
    roles = re.findall(r"^sudo -u postgres createuser --pwprompt (\w+)$", recipe, re.M)
    owners = {db: owner for owner, db in re.findall(r"^sudo -u postgres createdb --owner=(\w+) (\w+)$", recipe, re.M)}
    for user, db in named:
        assert user in roles, f"the recipe's URLs log in as {user!r}, which it never creates"
        assert owners.get(db) == user, f"database {db!r}: owner {owners.get(db)!r}, its URLs' user {user!r}"
    assert "CREATE DATABASE mlflow OWNER airflow;" in (REPO / "docker" / "postgres-init.sql").read_text()
