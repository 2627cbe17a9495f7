"""The operator's deployment files read as a new operator would: the commands their headers and docs give, run or
parsed against the files themselves (no Docker engine or Kubernetes API here)."""

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"


def compose() -> dict:
    return yaml.safe_load((DOCKER / "docker-compose.yml").read_text())


def test_api_server_seeds_the_admin_password_file_private(tmp_path):
    """The api-server writes AIRFLOW_ADMIN_PASSWORD in plaintext into the shared var volume (shared storage when NPU
    nodes run workers): 0600 under a container's default umask, also over a file an older start left 0644."""
    command = compose()["services"]["airflow-apiserver"]["command"]
    assert command[:2] == ["bash", "-c"]
    seed, sep, _ = command[2].partition("&& exec airflow api-server")
    assert sep, command[2]
    passwords = tmp_path / "airflow-passwords.json"
    env = {
        **os.environ,
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        "AIRFLOW_ADMIN_PASSWORD": "s3cret-for-test",
    }
    for existing in (False, True):
        if existing:
            passwords.write_text("{}")
            passwords.chmod(0o644)
        out = subprocess.run(["bash", "-c", f"umask 022; {seed}"], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert json.loads(passwords.read_text()) == {"admin": "s3cret-for-test"}
        mode = stat.S_IMODE(passwords.stat().st_mode)
        assert mode == 0o600, f"existing={existing}: {oct(mode)}"


def test_ascend_header_runs_the_image_with_the_devices_and_the_job_manifests_mounts():
    """docs/operations.md sends the operator to Dockerfile.ascend's header for running the image "with the davinci
    devices and the driver mounted": it gives that command, with the host paths deploy/k8s/train-job.yaml mounts."""
    text = (DOCKER / "Dockerfile.ascend").read_text()
    header = "\n".join(line[1:] for line in text.splitlines() if line.startswith("#"))
    run = re.search(r"docker run (.*?)llm-pipeline:ascend", header.replace("\\\n", " "), re.S)
    assert run, "Dockerfile.ascend's header has no `docker run ... llm-pipeline:ascend`"
    args = run.group(1).split()
    devices = {args[i + 1] for i, a in enumerate(args) if a == "--device"}
    assert {"/dev/davinci0", "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= devices, devices
    mounts = {args[i + 1].split(":")[0]: args[i + 1].split(":")[1] for i, a in enumerate(args) if a == "-v"}
    job = [d for d in yaml.safe_load_all((REPO / "deploy" / "k8s" / "train-job.yaml").read_text()) if d]
    pod = next(d for d in job if d["kind"] == "Job")["spec"]["template"]["spec"]
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    in_pod = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert host and {host[n]: in_pod[n] for n in host} == mounts, (host, mounts)
    ops = (REPO / "docs" / "operations.md").read_text()
    assert "davinci devices and the driver mounted (see the Dockerfile's header)" in " ".join(ops.split())


def test_the_hugging_face_cache_is_shared_by_every_worker():
    """The evaluate stage's standard tasks read their datasets from the HF cache only (nothing is downloaded at run
    time). In compose each container's ~/.cache is its own and lost on recreate: HF_HOME lies in the shared var
    volume, in every Airflow service (any worker may take evaluate), and the bare-metal hosts share it the same way."""
    services = compose()["services"]
    for name, svc in services.items():
        env = svc.get("environment") or {}
        if "LLM_PIPELINE_VAR_DIR" not in env:
            continue
        var = env["LLM_PIPELINE_VAR_DIR"]
        mounted = {re.sub(r":(ro|rw)$", "", v).rsplit(":", 1)[1] for v in svc["volumes"]}
        assert var in mounted, (name, mounted)
        assert str(env.get("HF_HOME", "")).startswith(var + "/"), f"{name}: HF_HOME {env.get('HF_HOME')!r}"
    assert "LLM_PIPELINE_VAR_DIR" in services["celery-worker"]["environment"]
    doc = (REPO / "docs" / "scale-out.md").read_text()
    recipe = doc.split("## Bare metal", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    var = re.search(r"export LLM_PIPELINE_VAR_DIR=(\S+)", recipe).group(1)
    assert re.search(rf"export HF_HOME={re.escape(var)}/", recipe), recipe
    assert f"HF_HOME={services['celery-worker']['environment']['HF_HOME']}" in doc


def test_bare_metal_mlflow_server_asks_for_the_password_its_clients_send():
    """The recipe's MLflow listens on every address: it runs the basic-auth app as compose does (an open server took
    any run, model or alias from anyone on the network), with the variables MLflow reads, an ini that exists, and
    every host sends the admin's credentials."""
    import shlex

    from mlflow import environment_variables as mlflow_env
    from mlflow.cli import server

    doc = (REPO / "docs" / "scale-out.md").read_text()
    recipe = doc.split("## Bare metal", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    every_host = recipe.split("# the server host", 1)[0]
    assert 'MLFLOW_TRACKING_USERNAME=admin MLFLOW_TRACKING_PASSWORD="$MLFLOWPASS"' in every_host
    m = re.search(r"^(MLFLOW_\w+=.*?mlflow server .*?)&$", recipe.replace("\\\n", " "), re.M | re.S)
    assert m, "the recipe's `mlflow server` is started without MLflow's basic-auth settings (MLFLOW_AUTH_*=...)"
    words = shlex.split(m.group(1))
    assigned = dict(w.split("=", 1) for w in words[: words.index("mlflow")])
    for name in assigned:
        assert getattr(mlflow_env, name).name == name  # a variable MLflow itself reads
    assert {"MLFLOW_AUTH_CONFIG_PATH", "MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"} <= set(assigned)
    assert assigned["MLFLOW_AUTH_ADMIN_PASSWORD"] == "$MLFLOWPASS"
    assert (REPO / assigned["MLFLOW_AUTH_CONFIG_PATH"]).is_file()
    args = words[words.index("server") + 1 :]
    ctx = server.make_context("server", list(args))  # MLflow's own option parser: every option exists
    assert ctx.params["app_name"] == "basic-auth" and ctx.params["serve_artifacts"]
    assert "$MLFLOWPASS" in doc.split("The secrets are docker/.env's", 1)[1]


def test_the_cpu_and_cuda_image_can_compile_what_train_compile_builds():
    """train.compile needs a compiler at run time (inductor's CPU kernels: C++; on the CUDA image built from the same
    Dockerfile, Triton's launchers: C) and python:*-slim has none: the CPU image refused `train.compile=true` with
    "install one (apt-get install g++)", which nobody can do in a running worker's container."""
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile.cpu").read_text())
    installs = [line for line in text.splitlines() if line.startswith("RUN ") and "apt-get install" in line]
    packages = {w for line in installs for w in line.split("apt-get install", 1)[1].split("&&")[0].split()}
    assert "g++" in packages, packages  # gcc and cc come with it; compile_problem accepts any of cc/gcc/g++
    from tasks.parallel.compile import compile_problem

    assert "g++" in (compile_problem("cpu") or "apt-get install g++")  # the package the refusal names
