"""Static checks of the deployment files: Dockerfiles, compose file and Kubernetes manifests parse, name files that
exist, pin torch/torch_npu as a published pair, take secrets only from the environment and bind to 127.0.0.1."""

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.launch import k8s_job
from tasks.errors import ConfigError, StageError

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
K8S = REPO / "deploy" / "k8s"
SECRET_WORDS = re.compile(r"PASSWORD|SECRET|FERNET|TOKEN", re.I)
ENV_REF = re.compile(r"\$\{[A-Z_]+(:\?[^}]*)?\}")


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", ["Dockerfile.ascend", "Dockerfile.cpu"])
def test_dockerfiles_parse_and_copy_files_that_exist(name):
    steps = instructions(DOCKER / name)
    known = {"ARG", "FROM", "ENV", "WORKDIR", "COPY", "RUN", "ENTRYPOINT", "CMD"}
    assert {w for w, _ in steps} <= known, {w for w, _ in steps} - known
    assert [w for w, _ in steps if w not in ("ARG",)][0] == "FROM"
    for word, args in steps:
        if word == "COPY":
            *sources, _dest = shlex.split(args)
            for src in sources:
                assert (REPO / src).exists(), f"{name}: COPY {src} does not exist in the build context"
        if word == "RUN":
            for req in re.findall(r"-r\s+(\S+\.txt)", args):
                assert req.startswith("/tmp/") or (REPO / req).is_file(), f"{name}: {req} missing"


def test_ascend_image_is_cann_based_sources_set_env_and_pins_a_published_pair():
    steps = instructions(DOCKER / "Dockerfile.ascend")
    base = dict(a.split("=", 1) for w, a in steps if w == "ARG" and "=" in a)["CANN_IMAGE"]
    assert base.startswith("quay.io/ascend/cann:"), base
    cann = base.split(":")[1].split("-")[0]
    entry = (DOCKER / "entrypoint-ascend.sh").read_text()
    assert "set_env.sh" in entry and "source" in entry
    assert ("ENTRYPOINT", '["/usr/local/bin/entrypoint-ascend.sh"]') in steps
    pins = dict(
        line.split("==")
        for line in (REPO / "requirements-npu.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert pins["torch"] == pins["torch-npu"].split(".post")[0]
    matrix = yaml.safe_load((REPO / "tasks" / "envcheck" / "compat_matrix.yaml").read_text())["pairs"]
    row = next(r for r in matrix if str(r["torch_npu"]) == pins["torch-npu"])  # the env stage's own matrix
    assert str(row["torch"]) == pins["torch"] and str(row["cann"]) == cann


def compose() -> dict:
    return yaml.safe_load((DOCKER / "docker-compose.yml").read_text())


def test_compose_services_files_and_ports():
    services = compose()["services"]
    assert {
        "postgres",
        "mlflow",
        "airflow-apiserver",
        "airflow-scheduler",
        "airflow-dag-processor",
        "airflow-triggerer",
    } <= set(services)
    for name, svc in services.items():
        build = svc.get("build")
        if build:
            assert (DOCKER / build["context"] / build["dockerfile"]).is_file(), name
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DOCKER / src).is_file(), f"{name}: {src} missing"
        for port in svc.get("ports", []):
            assert port.startswith(("${BIND_ADDRESS:-127.0.0.1}:", "127.0.0.1:")), f"{name}: {port} not on loopback"
    # PostgreSQL and Redis are published (NPU nodes run their own workers against them), only with their passwords
    assert services["postgres"]["ports"] == ["${BIND_ADDRESS:-127.0.0.1}:${POSTGRES_PORT:-5432}:5432"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    assert "--app-name basic-auth" in services["mlflow"]["command"]
    volumes = compose()["volumes"]
    assert "mlartifacts" in volumes
    assert any(v.startswith("mlartifacts:") for v in services["mlflow"]["volumes"])
    # the server stores and serves the artifacts (--serve-artifacts): no Airflow service mounts them (the compose
    # file mounted them in every one, "shared by the server and the workers", while docs/scale-out.md said none
    # needs them), and the pipeline leaves an http(s) server's experiment at its default, mlflow-artifacts:/
    for name, svc in services.items():
        if name != "mlflow":
            assert not any(v.startswith("mlartifacts:") for v in svc.get("volumes", [])), name
    from mlflow.store.tracking import DEFAULT_ARTIFACTS_URI
    from mlflow.utils.server_cli_utils import resolve_default_artifact_root

    assert "--default-artifact-root" not in services["mlflow"]["command"]
    assert resolve_default_artifact_root(True, "", "postgresql+psycopg2://db/mlflow") == DEFAULT_ARTIFACTS_URI
    assert "no worker needs the artifact disk" in (REPO / "docs" / "scale-out.md").read_text()


def test_compose_takes_every_secret_from_the_environment():
    text = (DOCKER / "docker-compose.yml").read_text()
    for name, svc in compose()["services"].items():
        env = svc.get("environment", {})
        for key, value in env.items():
            if SECRET_WORDS.search(key) and not key.endswith(("_FILE", "_PATH")):
                assert ENV_REF.fullmatch(str(value)), f"{name}.{key} = {value!r}: take it from ${{VAR:?}}"
    for url in re.findall(r"\w+://[^\s\"']+", text):
        userinfo = url.split("://", 1)[1].split("@")[0] if "@" in url else ""
        if ":" in userinfo:
            assert ENV_REF.search(userinfo), f"credential in URL {url}"
    required = set(re.findall(r"\$\{([A-Z_]+):\?", text))
    assert {
        "POSTGRES_PASSWORD",
        "AIRFLOW_ADMIN_PASSWORD",
        "AIRFLOW_JWT_SECRET",
        "MLFLOW_ADMIN_PASSWORD",
        "MLFLOW_FLASK_SECRET",
        "AIRFLOW_FERNET_KEY",
    } <= required


def test_no_secrets_committed_in_deploy_files():
    pattern = re.compile(r"(?i)(password|secret|passwd|api[_-]?key)\s*[:=]\s*['\"]?([^\s'\"$#{]{6,})")
    files = [*DOCKER.iterdir(), *K8S.iterdir(), *(REPO / "scripts").iterdir(), REPO / "airflow.cfg"]
    for f in (f for f in files if f.is_file()):  # not __pycache__ (a test that imports scripts/npu_api.py makes one)
        text = f.read_text()
        assert "BEGIN PRIVATE KEY" not in text and "BEGIN RSA" not in text, f
        for m in pattern.finditer(text):
            assert m.group(2).startswith(("sqlite", "mlflow.server")), f"{f.name}: {m.group(0)}"
    ignored = (REPO / ".gitignore").read_text().split()
    assert "var/" in ignored  # make ui writes its generated passwords there


def test_local_ui_binds_loopback_and_scripts_parse():
    ui = (REPO / "scripts" / "ui.sh").read_text()
    assert "host=127.0.0.1" in ui and '--host "$host"' in ui and "--app-name basic-auth" in ui
    assert re.search(r"^\[api\][^\[]*^host = 127\.0\.0\.1", (REPO / "airflow.cfg").read_text(), re.M | re.S)
    for script in ("ui.sh", "stop.sh", "install-browser.sh", "install-services.sh", "airflow-env.sh"):
        out = subprocess.run(["bash", "-n", str(REPO / "scripts" / script)], capture_output=True, text=True)
        assert out.returncode == 0, f"{script}: {out.stderr}"
    assert "SIGINT" in (REPO / "scripts" / "stop.sh").read_text()


def test_k8s_manifests_one_pod_per_node_with_rendezvous_service():
    service, job = yaml.safe_load_all((K8S / "train-job.yaml").read_text())
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    pod = spec["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    container = pod["containers"][0]
    assert container["resources"]["limits"]["huawei.com/Ascend910"] >= 1
    assert "hardware.rdzv_endpoint=llm-train-0.llm-train:29400" in container["args"][0]
    assert "hardware.node_rank=$JOB_COMPLETION_INDEX" in container["args"][0]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    pvc_docs = list(yaml.safe_load_all((K8S / "pvc.yaml").read_text()))
    assert claims == {d["metadata"]["name"] for d in pvc_docs if d["kind"] == "PersistentVolumeClaim"}


def test_render_for_a_dag_run(cfg, tmp_path):
    cfg.hardware.nnodes = 4
    cfg.hardware.nproc_per_node = 8
    cfg.hardware.k8s_image = "registry.example/llm-pipeline:ascend"
    cfg.hardware.device = "npu"  # the Ascend image: NPU pods (a cpu one requests no device: test_k8s_audit.py)
    name = k8s_job.job_name("llm_pipeline", "manual__2026-11-29T14:00:00+00:00", 2)
    assert re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", name) and len(name) <= 50
    service, job = k8s_job.render(cfg, tmp_path / "run", name)
    assert service["metadata"]["name"] == job["metadata"]["name"] == name
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == cfg.hardware.k8s_image
    assert container["resources"]["requests"]["huawei.com/Ascend910"] == 8
    args = container["args"][0]
    assert f"hardware.rdzv_endpoint={name}-0.{name}:29400" in args and "$JOB_COMPLETION_INDEX" in args
    assert "data.seq_len" not in args  # from the preset: the pods take the shard set's
    from tasks.config import apply_overrides

    apply_overrides(cfg, {"data.seq_len": 64})  # set explicitly: the pods must still see it as explicit
    assert (
        "--set data.seq_len=64"
        in k8s_job.render(cfg, tmp_path / "run", name)[1]["spec"]["template"]["spec"]["containers"][0]["args"][0]
    )
    written = yaml.safe_load((tmp_path / "run" / "k8s" / f"{name}.yaml").read_text())
    assert written["hardware"]["nnodes"] == 4 and written["tracking"]["uri"] == ""
    cfg.hardware.k8s_image = ""
    with pytest.raises(ConfigError, match="hardware.k8s_image"):
        k8s_job.render(cfg, tmp_path / "run", name)


def test_kubernetes_launcher_without_the_provider_says_what_to_install(cfg, monkeypatch):
    """A worker without the cncf provider (an image built from another requirements file): one line, what to do."""
    monkeypatch.setitem(sys.modules, "airflow.providers.cncf.kubernetes.hooks.kubernetes", None)  # import fails
    module = importlib.reload(importlib.import_module("tasks.launch.k8s_submit"))  # importing it needs no provider
    with pytest.raises(StageError, match="needs the cncf provider .*pip install -r requirements.txt"):
        module.run_stage_job("train", cfg, "llm_pipeline", "manual__1")


def test_compose_is_the_celery_profile_with_scalable_workers_and_flower():
    services = compose()["services"]
    env = services["airflow-scheduler"]["environment"]
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert env["AIRFLOW__CELERY__POOL"] == "solo"  # prefork children are daemonic: no process pools in a stage
    assert (
        env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://:${REDIS_PASSWORD:?")
        and "@redis:6379/" in (env["AIRFLOW__CELERY__BROKER_URL"])
    )
    assert env["AIRFLOW__CELERY__RESULT_BACKEND"].startswith("db+postgresql+psycopg2://airflow:")
    assert "@postgres:5432/airflow" in env["AIRFLOW__CELERY__RESULT_BACKEND"]
    worker = services["celery-worker"]
    assert "container_name" not in worker and "ports" not in worker  # `--scale celery-worker=N` needs both absent
    assert worker["environment"]["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert "exec airflow celery worker --queues" in worker["command"][-1]
    assert {"redis", "airflow-init"} <= set(worker["depends_on"])
    assert services["flower"]["command"] == ["airflow", "celery", "flower"]
    assert services["redis"]["healthcheck"]
    assert services["redis"]["ports"] == ["${BIND_ADDRESS:-127.0.0.1}:${REDIS_PORT:-6379}:6379"]
    assert "--requirepass" in services["redis"]["command"][-1]
    required = set(re.findall(r"\$\{([A-Z_]+):\?", (DOCKER / "docker-compose.yml").read_text()))
    assert {"REDIS_PASSWORD", "FLOWER_PASSWORD"} <= required


def test_compose_components_check_their_services_first():
    services = compose()["services"]
    for name in ("airflow-scheduler", "celery-worker"):
        command = " ".join(services[name]["command"])
        assert "python scripts/check_services.py && exec airflow" in command, name
    assert (REPO / "scripts" / "check_services.py").is_file()
    assert ("COPY", "scripts ./scripts") in instructions(DOCKER / "Dockerfile.cpu")


def test_every_postgres_url_names_the_installed_driver():
    """SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, which is not installed: the URLs say psycopg2."""
    text = (DOCKER / "docker-compose.yml").read_text()
    urls = re.findall(r"postgresql[+\w]*://", text)
    assert urls and set(urls) == {"postgresql+psycopg2://"}, urls
    pins = (REPO / "requirements.txt").read_text()
    assert "psycopg2-binary==" in pins and "asyncpg==" in pins  # asyncpg: Airflow 3's async engine on PostgreSQL


def test_mlflow_server_keeps_runs_in_postgres_and_serves_the_artifacts():
    services = compose()["services"]
    command = services["mlflow"]["command"]
    assert "--backend-store-uri postgresql+psycopg2://" in command and "@postgres:5432/mlflow" in command
    assert "--serve-artifacts" in command and "--artifacts-destination /mlartifacts" in command
    assert "mlartifacts:/mlartifacts" in services["mlflow"]["volumes"]
    assert services["celery-worker"]["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert "CREATE DATABASE mlflow" in (DOCKER / "postgres-init.sql").read_text()
    # the name the workers use is one MLflow lets in (its default allow-list, localhost and private IPs, answered
    # `mlflow:5000` 403 on every call), judged by MLflow's own check, with compose's default for the variable
    from mlflow.server.security_utils import is_allowed_host_header

    allowed = re.fullmatch(
        r"\$\{MLFLOW_ALLOWED_HOSTS:-(.+)\}", services["mlflow"]["environment"]["MLFLOW_SERVER_ALLOWED_HOSTS"]
    )
    hosts = allowed.group(1).split(",")
    uris = {s: v["environment"].get("MLFLOW_TRACKING_URI") for s, v in services.items() if v.get("environment")}
    for service, uri in uris.items():
        assert not uri or is_allowed_host_header(hosts, uri.removeprefix("http://")), (service, uri, hosts)
    assert uris["celery-worker"] and uris["airflow-scheduler"]
    assert is_allowed_host_header(hosts, "127.0.0.1:5000") and not is_allowed_host_header(hosts, "evil.example:5000")


def copied(name: str) -> set[str]:
    """The repository paths a Dockerfile COPYs into the image (sources of every COPY, without a trailing slash)."""
    return {src.rstrip("/") for w, a in instructions(DOCKER / name) if w == "COPY" for src in shlex.split(a)[:-1]}


def test_every_path_the_code_reads_under_the_repository_is_in_both_images():
    """What the code opens at run time relative to REPO_ROOT (configs/ presets, deploy/k8s/ Job template, ...) is in
    both images: without deploy/, `launcher: kubernetes` in an image died of a FileNotFoundError."""
    read = set()
    for top in ("tasks", "data_prep", "dags", "plugins", "scripts"):
        for f in (REPO / top).rglob("*.py"):
            read |= set(re.findall(r'REPO_ROOT\s*/\s*"([^"/]+)', f.read_text(encoding="utf-8")))
    read -= {"var"}  # state, not code: LLM_PIPELINE_VAR_DIR (/var/lib/llm in the images)
    assert {"configs", "deploy"} <= read, read
    assert (k8s_job.TEMPLATE.parent.parent.name, k8s_job.TEMPLATE.parent.name) == ("deploy", "k8s")
    for name in ("Dockerfile.cpu", "Dockerfile.ascend"):
        assert read <= copied(name), f"{name} does not COPY {sorted(read - copied(name))}"
    ignored = (REPO / ".dockerignore").read_text().split()
    assert not read & {p.strip("/") for p in ignored}


def test_both_images_configure_airflow_alike_and_tag_the_commit():
    """The Ascend image runs Airflow workers too (NPU nodes' device queue): the same Airflow ENV as the CPU image.
    Both take GIT_SHA as a build argument into LLM_PIPELINE_GIT_SHA (the build context has no .git)."""

    def env(name: str) -> dict:
        out = {}
        for w, a in instructions(DOCKER / name):
            if w == "ENV":
                out.update(dict(pair.split("=", 1) for pair in shlex.split(a)))
        return out

    cpu, ascend = env("Dockerfile.cpu"), env("Dockerfile.ascend")
    airflow = {k: v for k, v in cpu.items() if k.startswith("AIRFLOW") or k == "PYTHONPATH"}
    assert {"AIRFLOW_HOME", "AIRFLOW_CONFIG", "AIRFLOW__CORE__DAGS_FOLDER", "AIRFLOW__LOGGING__BASE_LOG_FOLDER"} <= set(
        airflow
    )
    assert {k: ascend.get(k) for k in airflow} == airflow
    for name, values in (("Dockerfile.cpu", cpu), ("Dockerfile.ascend", ascend)):
        steps = instructions(DOCKER / name)
        assert any(w == "ARG" and a.startswith("GIT_SHA") for w, a in steps), name
        assert values["LLM_PIPELINE_GIT_SHA"] == "$GIT_SHA", name
        assert "--build-arg GIT_SHA=" in (DOCKER / name).read_text(), f"{name}: its header says how to pass it"
    assert ".git" in (REPO / ".dockerignore").read_text().split()


def test_ascend_image_installs_under_the_constraints_except_the_torch_it_replaces():
    (run,) = [a for w, a in instructions(DOCKER / "Dockerfile.ascend") if w == "RUN" and "pip install" in a]
    assert "constraints.txt" in copied("Dockerfile.ascend")
    m = re.search(r"grep -v '\^torch==' constraints\.txt > (\S+)", run)
    assert m, run
    installs = [c for c in run.split("&&") if "pip install" in c]
    assert installs and all(f"-c {m.group(1)}" in c for c in installs), installs
    pins = [line for line in (REPO / "constraints.txt").read_text().splitlines() if line.startswith("torch")]
    assert "torch==" in "".join(pins)  # the one line dropped; torch_npu's torch comes from requirements-npu.txt
    assert not any(line.startswith(("torch-npu", "torch_npu")) for line in pins)


def test_compose_lets_the_workers_run_in_parallel_and_links_to_a_browsable_host():
    """airflow.cfg's laptop limits (parallelism 4, 2 tasks per DAG run) would cap `--scale celery-worker=8` at 2: the
    shared Airflow env raises both; the UI links use PUBLIC_HOST, never BIND_ADDRESS (0.0.0.0 is not browsable)."""
    services = compose()["services"]
    for name, svc in services.items():
        env = svc.get("environment") or {}
        if env.get("AIRFLOW__CORE__EXECUTOR") != "CeleryExecutor":
            continue
        for key, var in (
            ("AIRFLOW__CORE__PARALLELISM", "AIRFLOW_PARALLELISM"),
            ("AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG", "AIRFLOW_MAX_ACTIVE_TASKS_PER_DAG"),
        ):
            m = re.fullmatch(r"\$\{" + var + r":-(\d+)\}", str(env.get(key)))
            assert m and int(m.group(1)) >= 8, f"{name}.{key} = {env.get(key)!r}"
        assert env["LLM_PIPELINE_PRESET"] == "${LLM_PIPELINE_PRESET:-}", name
        for key in ("AIRFLOW__API__BASE_URL", "MLFLOW_UI_URL"):
            assert "BIND_ADDRESS" not in env[key] and "${PUBLIC_HOST:-localhost}" in env[key], (name, key)
        assert "${LLM_SITE_DIR:-./site}:/etc/llm:ro" in svc["volumes"], name
    assert (DOCKER / "site").is_dir()
    doc = (REPO / "docs" / "scale-out.md").read_text()
    for var in (
        "AIRFLOW_PARALLELISM",
        "AIRFLOW_MAX_ACTIVE_TASKS_PER_DAG",
        "PUBLIC_HOST",
        "CELERY_WORKER_QUEUES",
        "LLM_PIPELINE_PRESET",
        "LLM_SITE_DIR",
        "LLM_VAR_VOLUME",
    ):
        assert var in doc, f"docs/scale-out.md does not describe {var}"


def test_bare_metal_recipe_reaches_the_api_server_and_runs_every_component():
    """The recipe's workers call http://api-host:8080/execution/, so the api-server must listen beyond loopback
    (airflow.cfg: 127.0.0.1); the DAG's approval gate is deferrable, so a triggerer runs; the same limits as compose."""
    doc = (REPO / "docs" / "scale-out.md").read_text()
    recipe = doc.split("## Bare metal", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert "export AIRFLOW__API__HOST=0.0.0.0" in recipe
    assert "airflow triggerer" in recipe
    assert "AIRFLOW__CORE__PARALLELISM=" in recipe and "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG=" in recipe
    assert "LLM_PIPELINE_GIT_SHA" in doc or "GIT_SHA" in doc


def test_operations_lists_every_secret_compose_requires():
    required = set(re.findall(r"\$\{([A-Z_]+):\?", (DOCKER / "docker-compose.yml").read_text()))
    ops = (REPO / "docs" / "operations.md").read_text()
    section = ops[ops.index("docker/docker-compose.yml") :][:1500]
    assert required and all(f"`{name}`" in section for name in required), required - set(
        re.findall(r"`([A-Z_]+)`", section)
    )


def test_a_cuda_user_is_told_which_image_to_build(cfg, tmp_path):
    """configs/llama3-8b-h100.yaml runs llm-pipeline:cuda: the missing-image line and the Dockerfile say how to build
    it (Dockerfile.cpu on PyTorch's CUDA wheel), not to build the Ascend image."""
    cfg.hardware.device, cfg.hardware.k8s_image = "cuda", ""
    with pytest.raises(ConfigError) as e:
        k8s_job.render(cfg, tmp_path / "run", "llm-x")
    assert "docker/Dockerfile.cpu" in str(e.value) and "TORCH_INDEX_URL" in str(e.value)
    header = (DOCKER / "Dockerfile.cpu").read_text()
    assert "llm-pipeline:cuda" in header and "--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu" in header
    assert yaml.safe_load((REPO / "configs" / "llama3-8b-h100.yaml").read_text())["hardware"]["k8s_image"] == (
        "llm-pipeline:cuda"
    )


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """scripts/<script> on a state dir under tmp_path and free ports; a ui.sh that got past its checks (a
    regression) starts the real servers, so its state dir is stopped afterwards whatever the outcome."""
    ours = ("AIRFLOW", "MLFLOW", "LLM_PIPELINE", "UI_", "STOP_")
    base = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    base.update(
        LLM_PIPELINE_VAR_DIR=str(tmp_path / "var"),
        AIRFLOW_PORT=str(free_port()),
        MLFLOW_PORT=str(free_port()),
        STOP_WAIT_S="1",
    )
    base.update(env)
    try:
        command = ["bash", str(REPO / "scripts" / script)]
        return subprocess.run(command, cwd=tmp_path, env=base, capture_output=True, text=True, timeout=600)
    finally:
        if script == "ui.sh" and (tmp_path / "var").exists():
            stop_env = {**base, "STOP_WAIT_S": "10"}
            subprocess.run(["bash", str(REPO / "scripts" / "stop.sh")], env=stop_env, capture_output=True, timeout=120)


INJECTION = "PPID[$(touch {marker})0]"  # bash runs the substitution when it evaluates the value in $(( ))


@pytest.mark.parametrize(
    "name, value",
    [
        ("AIRFLOW_PORT", "abc"),
        ("MLFLOW_PORT", "70000"),
        ("AIRFLOW_PORT", "0"),
        ("UI_WAIT_S", "1.5"),
        ("UI_WAIT_S", INJECTION),
        ("STOP_WAIT_S", INJECTION),
    ],
)
def test_ui_refuses_a_bad_number_in_one_line_before_starting_anything(tmp_path, name, value):
    marker = tmp_path / "injected"
    out = run_script("ui.sh", tmp_path, **{name: value.format(marker=marker)})
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ui: {name}=") and f"set e.g. {name}=" in lines[0], lines
    assert "Traceback" not in out.stderr and not out.stdout
    assert not marker.exists(), "the value was evaluated as shell code"
    assert not (tmp_path / "var").exists()  # nothing started, not even the state dir


def test_stop_refuses_a_bad_wait_in_one_line_and_runs_nothing_from_it(tmp_path):
    """STOP_WAIT_S reaches $(( )) only once a server is running: one is (a process group of our own), and the value
    that would run `touch` is refused before anything is signalled."""
    var = tmp_path / "var"
    var.mkdir()
    marker = tmp_path / "injected"
    server = subprocess.Popen(["sleep", "60"], start_new_session=True)  # its pid is its process group
    try:
        (var / "airflow.pid").write_text(f"{server.pid}\n")
        for value in (INJECTION.format(marker=marker), "-1", "20s"):
            out = run_script("stop.sh", tmp_path, STOP_WAIT_S=value)
            assert out.returncode == 2, out.stdout + out.stderr
            lines = out.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("stop: STOP_WAIT_S=") and "STOP_WAIT_S=20" in lines[0]
            assert not marker.exists(), "the value was evaluated as shell code"
            assert server.poll() is None and (var / "airflow.pid").is_file()  # nothing signalled, nothing removed
        out = run_script("stop.sh", tmp_path, STOP_WAIT_S="05")  # leading zero: five seconds, not an octal error
        assert out.returncode == 0 and "stop: airflow stopped" in out.stdout, out.stdout + out.stderr
        assert server.wait(timeout=30) is not None
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
