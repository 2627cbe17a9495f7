"""The operator's path through real UIs in headless Chromium: `make ui` (airflow standalone + mlflow server with
auth), log in, open the main DAG's trigger form, see its sections and fields, trigger a run with a changed Param and
an approval, watch the train task's log while it runs (progress lines), approve the new version on Airflow's
Required-actions page, wait for success, read the task logs (no ERROR line in a successful task; progress lines of
train, quantize and evaluate, no tqdm bar), follow the task's "MLflow run" link into MLflow's model-training view
(params, headline charts first, system metrics), open the registered INT8 and BF16 versions (model cards as their
descriptions), then a run that fails: its log's failure is the one-line cause, in full.

Chromium is Debian's (scripts/install-browser.sh), driven by Playwright. The servers run from scripts/ui.sh on free
ports with every piece of state in a temp dir; the DAG's Params default to ci-tiny, shortened (LLM_PIPELINE_PRESET,
tests/helpers/presets.py), so the run takes minutes, and cron scheduling is off so the manual runs are the only ones.
Screenshots of every page land in the test's tmp_path (screens/, the path is printed).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import pytest
from tests.helpers.ports import free_port
from tests.helpers.presets import short_ci_tiny

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
RUN_TIMEOUT_S = 1500  # a bound on a hung run, not a timing: a busy 2-core host needs ~15 min for the two runs


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    var = tmp_path_factory.mktemp("ui") / "var"
    # The operator's path, not what the stages compute: ci-tiny shortened (one rank, one shard per split, fewer smoke
    # steps and tokens; tests/helpers/presets.py), a site's preset file as $LLM_PIPELINE_PRESET
    preset = short_ci_tiny(var.parent / "ci-tiny-short.yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW", "LLM_PIPELINE"))}
    env.update(
        LLM_PIPELINE_VAR_DIR=str(var),
        AIRFLOW_PORT=str(free_port()),
        MLFLOW_PORT=str(free_port()),
        LLM_PIPELINE_PRESET=str(preset),
        AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE="False",
        # The DAG files do not change during the test: parsed once at start, not again every 30 s (each parse is
        # seconds of CPU that the run's tasks need). Callbacks are parsed for whenever they come (dag_processing
        # manager: _add_callback_to_queue puts the file at the front of the queue).
        AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL="3600",
        AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="3600",
        # The scheduler's idle loop (no task queued, no executor event) every 2 s, not every 1 s: its queries are CPU
        # the run's tasks need, and a second more between a task's end and the next one's start changes no check.
        AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME="2",
        UI_WAIT_S="240",
    )
    started = subprocess.run(["bash", "scripts/ui.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield {
            "var": var,
            "preset": str(preset),
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
        try:
            run = api(ui, f"/api/v2/dags/llm_pipeline/dagRuns/{urllib.parse.quote(run_id, safe='')}", token)
        except (TimeoutError, urllib.error.URLError):  # a busy 2-core host: ask again
            continue
        if run["state"] in ("success", "failed"):
            run["tasks"] = task_states(ui, run_id, token)
            if run["tasks"]:
                return run
        time.sleep(3)  # a run ends minutes after it starts: a few seconds late changes no check, each poll is CPU
    pytest.fail(f"run {run_id} did not finish in {RUN_TIMEOUT_S} s")


def unpause(ui) -> None:
    """The DAG's pause switch turned off before the trigger form opens, as docs/operations.md tells a `make ui` user on
    SQLite: the form's own "Unpause llm_pipeline on trigger" sends its PATCH beside the trigger's POST, and the two can
    hold each other in the API server for the whole busy timeout (seen once: both 60 s, the unpause a 500, the run
    left on a paused DAG; plugins/db_connect_args.py). A queued run on a paused DAG never starts: checked here."""
    body = json.dumps({"is_paused": False}).encode()
    headers = {"Authorization": f"Bearer {api_token(ui)}", "Content-Type": "application/json"}
    req = urllib.request.Request(ui["airflow"] + "/api/v2/dags/llm_pipeline", body, headers, method="PATCH")
    with urllib.request.urlopen(req, timeout=90) as r:
        assert json.load(r)["is_paused"] is False


def run_dir_of(ui, run_id: str) -> Path:
    return ui["var"] / "runs" / "llm_pipeline" / re.sub(r"[^A-Za-z0-9_.-]+", "_", run_id).strip("_")


def task_states(ui, run_id: str, token: str) -> dict:
    """{task: state}, or {} when the API server did not answer this poll in time (a busy 2-core host)."""
    try:
        tis = api(ui, f"/api/v2/dags/llm_pipeline/dagRuns/{urllib.parse.quote(run_id, safe='')}/taskInstances", token)
    except (TimeoutError, urllib.error.URLError):
        return {}
    return {t["task_id"]: t["state"] for t in tis["task_instances"]}


def wait_for_task(ui, run_id: str, task_id: str, state: str) -> None:
    token = api_token(ui)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        states = task_states(ui, run_id, token)
        if states.get(task_id) == state:
            return
        assert "failed" not in states.values() and "upstream_failed" not in states.values(), states
        time.sleep(2)
    pytest.fail(f"{task_id} of {run_id} did not reach {state} in {RUN_TIMEOUT_S} s")


def wait_for_parked_exit(ui, run_id: str, task_id: str) -> None:
    """Until the scheduler has processed the exit of the runner that parked `task_id` in AWAITING_INPUT.

    Airflow 3.3.2 race (scheduler_job_runner.process_executor_events): the resumed task keeps its try_number, so an
    answer given before the scheduler reads the parked runner's exit event lets that stale "success" event meet the
    resumed, running task instance; the scheduler then marks it failed ("task-state-changed-externally") and the
    resumed runner is told to stop ("Server indicated the task shouldn't be running anymore"). A person answers
    after minutes; this test answers within a second or two, on a host where a busy scheduler read that event 5 s
    late (seen twice). The scheduler logs the event as "TaskInstance Finished: … state=awaiting_input"."""
    log = ui["var"] / "logs" / "airflow-standalone.log"
    done = re.compile(
        rf"TaskInstance Finished: dag_id=llm_pipeline, task_id={task_id}, run_id={re.escape(run_id)}, "
        r".*state=awaiting_input, .*executor_state=success"
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if done.search(log.read_text(errors="replace")):
            return
        time.sleep(1)
    pytest.fail(f"the scheduler did not process the parked {task_id} runner's exit within 300 s (see {log})")


def task_log(ui, run_id: str, task_id: str) -> list[dict]:
    """The task's last attempt as Airflow stored it (of every map index, for a mapped task: map_index=N/): one JSON
    object per line (level, event, logger, …)."""
    folder = ui["var"] / "logs" / "dag_id=llm_pipeline" / f"run_id={run_id}" / f"task_id={task_id}"
    last: dict[Path, Path] = {}
    for log in sorted(folder.rglob("attempt=*.log"), key=lambda p: int(p.stem.split("=")[1])):
        last[log.parent] = log
    assert last, f"no log for {task_id} in {folder}"
    return [json.loads(ln) for log in last.values() for ln in log.read_text().splitlines() if ln.startswith("{")]


def log_records(ui, run_id: str, task_id: str) -> list[dict]:
    """The task's log as far as Airflow has written it (a running task's: its last line may be half written)."""
    folder = ui["var"] / "logs" / "dag_id=llm_pipeline" / f"run_id={run_id}" / f"task_id={task_id}"
    out = []
    for log in sorted(folder.rglob("attempt=*.log")):
        for ln in log.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(ln))
            except ValueError:
                continue
    return out


def progress_while_running(ui, run_id: str, task_id: str, what: str) -> list[str]:
    """The log's lines starting with `what` as read from the log file before the task ended: Airflow writes a task's
    log as the task goes. The file is read every 0.05 s once the API says the task runs, and the first read that
    finds such lines is held against the task instance's end_date, which the API gives once it ended (the same host
    clock); [] when the lines came only after the end. Not a race with the task: a quick task's lines may be in the
    file for a fraction of a second before it ends (seen: 0.45 s after 4 steps on a quiet host)."""
    token = api_token(ui)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while (state := task_states(ui, run_id, token).get(task_id)) in (None, "scheduled", "queued"):  # {}: missed poll
        if time.monotonic() > deadline:
            pytest.fail(f"{task_id} of {run_id} did not start in {RUN_TIMEOUT_S} s")
        time.sleep(1)
    if state in ("upstream_failed", "skipped", "removed"):  # never ran: no log to read
        return []
    lines, read_at, polls = [], None, 0
    while time.monotonic() < deadline:
        found = [r.get("event", "") for r in log_records(ui, run_id, task_id)]
        found = [x for x in found if x.startswith(what)]
        if found:  # in the file at the latest now
            lines, read_at = found, datetime.now(timezone.utc)
            break
        polls += 1  # the API every second (each poll is the API server's CPU), the file every 0.05 s
        if polls % 20 == 0 and task_states(ui, run_id, token).get(task_id) in ("success", "failed", "upstream_failed"):
            break
        time.sleep(0.05)
    quoted, ended = urllib.parse.quote(run_id, safe=""), None
    while not ended and time.monotonic() < deadline:
        try:
            ended = api(ui, f"/api/v2/dags/llm_pipeline/dagRuns/{quoted}/taskInstances/{task_id}", token)["end_date"]
        except (TimeoutError, urllib.error.URLError):  # a busy 2-core host: ask again
            pass
        time.sleep(0 if ended else 1)
    assert ended, f"{task_id} of {run_id} did not end in {RUN_TIMEOUT_S} s"
    return lines if lines and read_at < datetime.fromisoformat(ended) else []


def trigger(ui, conf: dict) -> str:
    body = json.dumps({"logical_date": None, "conf": conf}).encode()
    req = urllib.request.Request(
        ui["airflow"] + "/api/v2/dags/llm_pipeline/dagRuns",
        data=body,
        headers={"Authorization": f"Bearer {api_token(ui)}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)["dag_run_id"]


@pytest.mark.timeout(3600)  # two pipeline runs: ~10 min on an idle 2-core host, more when it is busy
def test_trigger_approve_logs_and_mlflow(ui, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/install-browser.sh (make test does)")
    import mlflow
    from playwright.sync_api import expect, sync_playwright

    from tasks import tracking

    shots = Path(os.environ.get("BROWSER_SCREENSHOTS") or tmp_path / "screens")  # to keep them past pytest's cleanup
    shots.mkdir(parents=True, exist_ok=True)
    print(f"screenshots: {shots}")
    store = mlflow.MlflowClient(f"sqlite:///{ui['var'] / 'mlflow.db'}")  # the server's store, read directly
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
            unpause(ui)
            page.reload()  # the page as it is now: the DAG unpaused, so the form sends no unpause of its own
            page.get_by_role("button", name="Trigger").first.click()
            dialog = page.get_by_role("dialog")
            for section in SECTIONS:
                expect(dialog.get_by_text(section, exact=True)).to_be_visible()
            dialog.get_by_text("Training", exact=True).click()
            steps = dialog.locator("[name=element_steps]")
            expect(steps).to_have_value("")  # empty = from the preset (ci-tiny's 6, shortened to 4)
            expect(dialog.get_by_text("Optimizer steps")).to_be_visible()
            expect(dialog.locator("[name=element_micro_batch]")).to_be_visible()
            steps.fill("4")
            steps.blur()
            # The gate's label names what it gates on; hints name every preset's value, not the default's only.
            dialog.get_by_text("Quantization", exact=True).click()
            expect(dialog.get_by_text("Max INT8 drop on the gate metric (%)")).to_be_visible()
            expect(dialog.get_by_text("perplexity drop", exact=False)).to_have_count(0)
            hint = f"({ui['preset']}: 2.0; ci-tiny: 2.0; demo-cpu: 2.0;"  # the chosen preset's first
            expect(dialog.get_by_text(hint, exact=False)).to_be_visible()
            switch = dialog.locator("label:has([name=element_require_approval])")  # the input itself is hidden
            switch.click()
            expect(dialog.locator("[name=element_require_approval]")).to_be_checked()
            dialog.get_by_text("Approve the champion in Airflow").scroll_into_view_if_needed()
            page.screenshot(path=str(shots / "1-trigger-form.png"))
            dialog.get_by_role("button", name="Trigger").click()
            page.wait_for_url(re.compile(r".*/dags/llm_pipeline/runs/.+"))
            run_id = urllib.parse.unquote(page.url.split("/runs/", 1)[1].split("/")[0].split("?")[0])
            run_path = f"{ui['airflow']}/dags/llm_pipeline/runs/{urllib.parse.quote(run_id, safe='')}"
            # While the run works, no open page: the run's page polls the API server every few seconds (CPU the
            # tasks need on a 2-core host); each check below opens its page when the run is where it looks.
            page.goto("about:blank")

            # Training says how far it is while it runs: rank 0's progress lines, relayed into the task's log.
            live = progress_while_running(ui, run_id, "train", "progress: train step ")
            assert live, "no progress line in the train task's log while it ran"
            assert re.match(r"progress: train step \d+/4 \(\d+%\), loss \d+\.\d{3}, ", live[0]), live
            page.goto(f"{run_path}/tasks/train")
            expect(page.get_by_text("progress: train step").first).to_be_visible()
            page.screenshot(path=str(shots / "2-train-log-progress.png"))
            page.goto("about:blank")  # the running task's log page polls too

            # The evaluation registers a version and leaves the champion alone; the approve task waits for a person.
            wait_for_task(ui, run_id, "approve", "awaiting_input")
            wait_for_parked_exit(ui, run_id, "approve")
            evaluate = json.loads((run_dir_of(ui, run_id) / "evaluate.json").read_text())
            name, version = evaluate["registered_model"], evaluate["version"]
            assert evaluate["approval"] == {
                "needed": True,
                "reason": evaluate["approval"]["reason"],
                "version": version,
            }
            assert "champion" not in store.get_registered_model(name).aliases
            page.goto(f"{run_path}/tasks/approve/required_actions")
            expect(page.get_by_text(f"Promote {name} v{version} to champion?").first).to_be_visible()
            expect(page.get_by_text("evaluate.require_approval is set").first).to_be_visible()
            page.screenshot(path=str(shots / "3-approval.png"))
            page.get_by_role("button", name="Approve").click()
            # Once Airflow has the answer (approve left awaiting_input), no open page while the run finishes: the
            # required-actions page polls the API server every few seconds.
            token, deadline = api_token(ui), time.monotonic() + 300
            while task_states(ui, run_id, token).get("approve") in ("awaiting_input", None):
                if time.monotonic() > deadline:
                    break  # wait_for_run below says what the run did
                time.sleep(1)
            page.goto("about:blank")

            run = wait_for_run(ui, run_id)
            assert run["conf"]["steps"] == 4, run["conf"]
            # Every task, not only the run: the summary task runs on all_done and is the run's only leaf.
            assert run["state"] == "success" and set(run["tasks"].values()) == {"success"}, run["tasks"]
            assert str(store.get_model_version_by_alias(name, "champion").version) == version  # promoted on Approve
            assert store.get_model_version(name, version).tags["champion.approved_by"] == "admin"

            # A successful task's log has no ERROR line (Airflow logs stderr at ERROR: tasks.logs routes it).
            for task_id in run["tasks"]:
                errors = [r["event"] for r in task_log(ui, run_id, task_id) if r["level"] in ("error", "critical")]
                assert errors == [], (task_id, errors)
            # Progress lines at INFO: training (every step of 4, log_every permitting, and the last), the
            # gate's and evaluation's scoring per model and task; lm-eval's tqdm bars are not in the logs.
            train_log = [r["event"] for r in task_log(ui, run_id, "train") if r["level"] == "info"]
            assert any(re.match(r"progress: train step 4/4 \(100%\), loss .*, done$", x) for x in train_log)
            scoring = {
                task_id: [r["event"] for r in task_log(ui, run_id, task_id) if r["level"] == "info"]
                for task_id in ("quantize", "evaluate")
            }
            lines = scoring["quantize"] + scoring["evaluate"]  # the gate on tasks scores BF16 and INT8 in quantize
            for model in ("FP32", "BF16", "INT8"):
                mine = [x for x in lines if re.match(rf"progress: (quantize|evaluate) {model} demo-continuation ", x)]
                assert mine and mine[-1].endswith(", done") and "requests/s" in mine[-1], (model, lines)
            for task_id, events in scoring.items():
                assert not [x for x in events if "it/s]" in x or re.search(r"\| *\d+/\d+ \[", x)], task_id
            env_log = task_log(ui, run_id, "env")
            assert any(r["event"].strip().startswith("[  ok]") and r["level"] == "info" for r in env_log)
            summary_text = "\n".join(r["event"] for r in task_log(ui, run_id, "summary"))
            assert f"Approval: {evaluate['approval']['reason']} → approved by admin" in summary_text  # in full
            page.goto(f"{ui['airflow']}/dags/llm_pipeline/runs/{urllib.parse.quote(run_id, safe='')}/tasks/env")
            expect(page.get_by_text("python-torch").first).to_be_visible()
            page.screenshot(path=str(shots / "4-env-log.png"))

            # The train task's Details tab lists the plugin's "MLflow run" link to its stage run.
            train = json.loads((run_dir_of(ui, run_id) / "train.json").read_text())
            page.goto(
                f"{ui['airflow']}/dags/llm_pipeline/runs/{urllib.parse.quote(run_id, safe='')}/tasks/train/details"
            )
            link = page.get_by_role("link", name="MLflow run")
            exp_id = train["mlflow_experiment_id"]
            want = f"{ui['mlflow']}/#/experiments/{exp_id}/runs/{train['mlflow_run_id']}?workflowType=machine_learning"
            assert link.get_attribute("href") == want
            page.screenshot(path=str(shots / "5-airflow-task.png"))

            # Follow it (MLflow is another origin: a new tab) and log in to MLflow; it lands on the stage's run, in
            # the model-training view, the headline charts (train/loss, train/tokens_per_s) in the first section.
            with context.expect_page() as opened:
                link.click()
            mlflow_page = opened.value
            mlflow_page.wait_for_url(re.compile(rf".*/experiments/\d+/runs/{train['mlflow_run_id']}.*"))
            expect(mlflow_page.get_by_text(train["mlflow_run_id"]).first).to_be_visible()
            expect(mlflow_page.get_by_text("Model registry").first).to_be_visible()  # the model-training sidebar
            expect(mlflow_page.get_by_text("Evaluation runs")).to_have_count(0)  # the GenAI sidebar's
            mlflow_page.screenshot(path=str(shots / "6-mlflow-run.png"))
            mlflow_page.get_by_text("Model metrics", exact=True).first.click()
            expect(mlflow_page.get_by_text("memory.peak_gb").first).to_be_visible()
            text = mlflow_page.locator("body").inner_text()
            first, rest = re.search(r"train\s*\(\d+\)", text), re.search(r"Model metrics\s*\(\d+\)", text)
            assert first and rest and first.start() < rest.start() < text.index("memory.peak_gb"), text[:2000]
            assert first.start() < text.index("tokens_per_s") < rest.start()  # the headline charts come first
            mlflow_page.screenshot(path=str(shots / "7-mlflow-metrics.png"))
            mlflow_page.get_by_text("System metrics", exact=True).first.click()
            expect(mlflow_page.get_by_text("cpu_utilization_percentage").first).to_be_visible()
            mlflow_page.screenshot(path=str(shots / "8-mlflow-system-metrics.png"))
            run_data = store.get_run(train["mlflow_run_id"]).data
            assert {"train/loss", "train/tokens_per_s", "system/cpu_utilization_percentage"} <= set(run_data.metrics)
            assert "train/val.loss" in run_data.metrics  # issue 27's val.loss, in the headline section

            # The experiment opens in the model-training view (kind tag, link parameter); the parent run holds the
            # flattened config as params.
            exp = store.get_experiment(exp_id)
            assert exp.tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"
            parent = store.get_run(run_data.tags["mlflow.parentRunId"])
            assert parent.data.params["train.lr"] and parent.data.params["train.steps"] == "4"
            mlflow_page.goto(f"{ui['mlflow']}/#/experiments/{exp_id}?workflowType=machine_learning")
            expect(mlflow_page.get_by_text(f"llm_pipeline/{run_id}").first).to_be_visible()
            mlflow_page.screenshot(path=str(shots / "9-mlflow-experiment.png"))

            # The registered INT8 version and its linked BF16 version: each has a model card as its description.
            bf16 = evaluate["bf16_model"]
            versions = [("int8", name, version, "INT8 "), ("bf16", bf16["registered_model"], bf16["version"], "BF16: ")]
            for n, (kind, model, v, first) in enumerate(versions):
                assert store.get_model_version(model, v).description.startswith(first), (model, v)
                mlflow_page.goto(f"{ui['mlflow']}/#/models/{urllib.parse.quote(model)}/versions/{v}")
                expect(mlflow_page.get_by_text(f"Version {v}").first).to_be_visible()
                expect(mlflow_page.get_by_role("heading", name="Model card").first).to_be_visible()
                expect(mlflow_page.get_by_text(f"llm_pipeline / {run_id}").first).to_be_visible()  # its lineage
                mlflow_page.screenshot(path=str(shots / f"{10 + n}-mlflow-{kind}-version.png"))

            # A run that fails (the first stage: no NPU here): its log's failure is the stage's one-line cause, in
            # full, the first ERROR line (the failed checks above it are WARNING), with no traceback under it.
            # While the failing run works, no open page (both poll their servers: CPU the run needs).
            mlflow_page.close()
            page.goto("about:blank")
            failing = trigger(ui, {"device": "npu"})
            done = wait_for_run(ui, failing)
            assert done["state"] == "failed" and done["tasks"]["env"] == "failed", done["tasks"]
            cause = json.loads((run_dir_of(ui, failing) / "env.json").read_text())["error"]
            records = task_log(ui, failing, "env")
            errors = [r for r in records if r["level"] in ("error", "critical")]
            assert errors[0]["event"] == cause and "torch_npu" in cause and "\n" not in cause, errors
            assert not any("error_detail" in r for r in records)  # no framework frames
            page.goto(f"{ui['airflow']}/dags/llm_pipeline/runs/{urllib.parse.quote(failing, safe='')}/tasks/env")
            expect(page.get_by_text(cause).first).to_be_visible()
            page.screenshot(path=str(shots / "12-failed-task.png"))
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
