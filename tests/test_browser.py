"""The operator's path through real UIs in headless Chromium: `make ui` (airflow standalone + mlflow server with
auth), log in, open the main DAG's trigger form, see its sections and fields, trigger a run with a changed Param,
wait for success, follow the task's "MLflow run" link and see that run in the MLflow UI.

Chromium is Debian's (scripts/install-browser.sh), driven by Playwright. The servers run from scripts/ui.sh on free
ports with every piece of state in a temp dir; the DAG's Params default to the ci-tiny preset (LLM_PIPELINE_PRESET)
so the run takes minutes, and cron scheduling is off so the manual run is the only one.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser]

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
# Root in a container with no outside network: no sandbox, no GPU, and none of Chromium's background connections.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
SECTIONS = ["Hardware", "Data", "Model", "Parallelism", "Training", "Quantization"]
RUN_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    var = tmp_path_factory.mktemp("ui") / "var"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW", "LLM_PIPELINE"))}
    env.update(
        LLM_PIPELINE_VAR_DIR=str(var),
        AIRFLOW_PORT=str(free_port()),
        MLFLOW_PORT=str(free_port()),
        LLM_PIPELINE_PRESET="ci-tiny",
        AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE="False",
        UI_WAIT_S="240",
    )
    started = subprocess.run(["bash", "scripts/ui.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield {
            "var": var,
            "airflow": f"http://127.0.0.1:{env['AIRFLOW_PORT']}",
            "mlflow": f"http://127.0.0.1:{env['MLFLOW_PORT']}",
            "airflow_password": json.loads((var / "simple_auth_manager_passwords.json.generated").read_text())["admin"],
            "mlflow_password": (var / "mlflow_admin_password").read_text().strip(),
        }
    finally:
        subprocess.run(["bash", "scripts/stop.sh"], cwd=REPO, env=env, capture_output=True, timeout=120)


def api(ui, path: str, token: str):
    req = urllib.request.Request(ui["airflow"] + path, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def api_token(ui) -> str:
    body = json.dumps({"username": "admin", "password": ui["airflow_password"]}).encode()
    req = urllib.request.Request(ui["airflow"] + "/auth/token", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)["access_token"]


def wait_for_run(ui, run_id: str) -> dict:
    token = api_token(ui)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        run = api(ui, f"/api/v2/dags/llm_pipeline/dagRuns/{urllib.parse.quote(run_id, safe='')}", token)
        if run["state"] in ("success", "failed"):
            tis = api(
                ui, f"/api/v2/dags/llm_pipeline/dagRuns/{urllib.parse.quote(run_id, safe='')}/taskInstances", token
            )["task_instances"]
            run["tasks"] = {t["task_id"]: t["state"] for t in tis}
            return run
        time.sleep(1)
    pytest.fail(f"run {run_id} did not finish in {RUN_TIMEOUT_S} s")


def test_trigger_form_run_and_mlflow_link(ui, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/install-browser.sh (make test does)")
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=60_000)  # a 2-core machine under load renders slowly
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            # MLflow's basic auth: sent only when a server asks (401), so Airflow never sees it.
            context = browser.new_context(
                viewport={"width": 1400, "height": 1000},
                http_credentials={"username": "admin", "password": ui["mlflow_password"]},
            )
            context.set_default_timeout(60_000)
            page = context.new_page()
            # Log in (SimpleAuthManager; the password is the one `make ui` points to).
            page.goto(ui["airflow"] + "/dags/llm_pipeline")
            page.get_by_label("Username").fill("admin")
            page.get_by_label("Password").fill(ui["airflow_password"])
            page.get_by_role("button", name="Sign in").click()
            page.wait_for_url("**/dags/llm_pipeline**")

            # The trigger form: one accordion section per config area, a field per Param (element_<param>).
            page.get_by_role("button", name="Trigger").first.click()
            dialog = page.get_by_role("dialog")
            for section in SECTIONS:
                expect(dialog.get_by_text(section, exact=True)).to_be_visible()
            dialog.get_by_text("Training", exact=True).click()
            steps = dialog.locator("[name=element_steps]")
            expect(steps).to_have_value("")  # empty = from the preset (ci-tiny: 6)
            expect(dialog.get_by_text("Optimizer steps")).to_be_visible()
            expect(dialog.locator("[name=element_micro_batch]")).to_be_visible()
            steps.fill("4")
            steps.blur()
            dialog.get_by_role("button", name="Trigger").click()
            page.wait_for_url(re.compile(r".*/dags/llm_pipeline/runs/.+"))
            run_id = urllib.parse.unquote(page.url.split("/runs/", 1)[1].split("/")[0].split("?")[0])

            run = wait_for_run(ui, run_id)
            assert run["conf"]["steps"] == 4, run["conf"]
            # Every task, not only the run: the summary task runs on all_done and is the run's only leaf.
            assert run["state"] == "success" and set(run["tasks"].values()) == {"success"}, run["tasks"]
            train = json.loads(
                (
                    ui["var"]
                    / "runs"
                    / "llm_pipeline"
                    / re.sub(r"[^A-Za-z0-9_.-]+", "_", run_id).strip("_")
                    / "train.json"
                ).read_text()
            )

            # The train task's Details tab lists the plugin's "MLflow run" link to its stage run.
            page.goto(
                f"{ui['airflow']}/dags/llm_pipeline/runs/{urllib.parse.quote(run_id, safe='')}/tasks/train/details"
            )
            link = page.get_by_role("link", name="MLflow run")
            assert link.get_attribute("href") == f"{ui['mlflow']}/#/runs/{train['mlflow_run_id']}"
            page.screenshot(path=str(tmp_path / "airflow-task.png"))

            # Follow it (MLflow is another origin: a new tab) and log in to MLflow; it lands on the stage's run.
            with context.expect_page() as opened:
                link.click()
            mlflow_page = opened.value
            mlflow_page.wait_for_url(re.compile(rf".*/experiments/\d+/runs/{train['mlflow_run_id']}.*"))
            expect(mlflow_page.get_by_text("train", exact=True).first).to_be_visible()
            expect(mlflow_page.get_by_text(train["mlflow_run_id"]).first).to_be_visible()
            mlflow_page.screenshot(path=str(tmp_path / "mlflow-run.png"))
        finally:
            browser.close()


def test_secrets_are_private_and_never_logged(ui):
    """Password/secret files and the server logs are 0600; neither password appears in any log of `make ui`."""
    var = ui["var"]
    private = [
        "simple_auth_manager_passwords.json.generated",
        "mlflow_admin_password",
        "airflow_jwt_secret",
        "airflow_fernet_key",
        "mlflow_flask_secret",
        "mlflow_basic_auth.ini",
        "logs/airflow-standalone.log",
        "logs/mlflow-server.log",
    ]
    for name in private:
        mode = (var / name).stat().st_mode & 0o777
        assert mode & 0o077 == 0, f"{name} is {oct(mode)}, readable by others"
    for log in (var / "logs").rglob("*"):
        if log.is_file():
            text = log.read_text(errors="replace")
            assert ui["airflow_password"] not in text and ui["mlflow_password"] not in text, f"password in {log}"
