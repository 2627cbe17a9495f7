"""A Kubernetes API endpoint on 127.0.0.1 that answers with recorded responses (tests/test_k8s_launcher.py).

No kube-apiserver can run here (no package registry ships one, no Docker), so the `kubernetes` client and the cncf
provider's KubernetesHook talk HTTP to this server: their whole request layer runs (kubeconfig loading, URL building,
serialisation, urllib3, response decoding into V1Job / V1PodList / dicts, ApiException from a non-2xx reply).

What it answers with is recorded, not written here: the Job, PyTorchJob and TrainJob bodies a poll returns, the pod
list, and the 409/403 `Status` replies are tests/data/k8s/*.json, each naming its upstream source (repository, path,
commit or URL), whether it is verbatim or assembled, and what was adjusted (the object's name and namespace). Only
the echo of a create (201: the posted object plus server-set uid/resourceVersion/creationTimestamp/generation) and
a DELETE's `Status` Success are the server's own. Every created body is validated strictly against its kind's
schema (`validate`), as `kubectl --validate=strict` would; a body it refuses is a 422 `Status`.

`replies[name]` (name: the object's hardware.k8s_kind, `k8s_schema.kind_name`) is what successive GETs of the created
object return, the last one repeated: a recording's name, or None for the object as created (no status yet: the
controller has not acted). `on_done(obj)` runs when the last reply is first served (the pods writing <stage>.json onto
the shared volume before the job is marked finished).
"""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.helpers.k8s_schema import kind_name

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"
NOW = "2026-12-01T12:00:00Z"
PATH = re.compile(r"^/(?:api/v1|apis/(?P<group>[^/]+)/(?P<version>[^/]+))/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/?]+)")
# where each kind's pods' names come from: the Job controller's Indexed pods, training-operator's replicas, JobSet's
POD_NAMES = {"job": ("0", "1"), "pytorchjob": ("master-0", "worker-0"), "trainjob": ("node-0-0", "node-0-1")}


def connected(api: "RecordedApi", tmp_path: Path, monkeypatch) -> "RecordedApi":
    """`api` as the Airflow connection `k8s_loopback` (a kubeconfig in tmp_path, namespace llm) that the launcher
    submits to, with the pipeline's var dir in tmp_path."""
    kubeconfig = tmp_path / "kubeconfig.json"
    kubeconfig.write_text(json.dumps(api.kubeconfig()))
    conn = {"conn_type": "kubernetes", "extra": {"kube_config_path": str(kubeconfig), "namespace": "llm"}}
    monkeypatch.setenv("AIRFLOW_CONN_K8S_LOOPBACK", json.dumps(conn))
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    return api


def on_kubernetes(cfg):
    """`cfg` (the tests' config fixture) set for the Kubernetes launcher: an image, 2 nodes of 8 devices."""
    cfg.hardware.launcher = "kubernetes"
    cfg.hardware.k8s_image = "registry.example/llm-pipeline:ascend"
    cfg.hardware.nnodes, cfg.hardware.nproc_per_node = 2, 8
    return cfg


def recorded(name: str) -> dict:
    """One recording: {"source", "recorded", "adjusted", "code", "body"}."""
    return json.loads((DATA / f"{name}.json").read_text())


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}  # fmt: skip


def refusal(name: str, job: str, namespace: str, group: str, plural: str) -> tuple[int, dict]:
    """A recorded Status reply made about this job: the recording's (redacted) job name and namespace become the
    test's, and for a Kubeflow kind the resource jobs.batch becomes its plural.group (tests/data/k8s, "adjusted")."""
    rec = recorded(name)
    body = copy.deepcopy(rec["body"])
    msg = body["message"].replace("<<job_name>>", job).replace('namespace "prefect"', f'namespace "{namespace}"')
    if (group, plural) != ("batch", "jobs"):  # another API's resource, whatever its plural (Volcano's is jobs too)
        msg = msg.replace("jobs.batch", f"{plural}.{group}").replace('resource "jobs"', f'resource "{plural}"')
        msg = msg.replace('API group "batch"', f'API group "{group}"')
        body["details"].update(group=group, kind=plural)
    if "name" in body["details"]:
        body["details"]["name"] = job
    body["message"] = msg
    return rec["code"], body


class RecordedApi:
    def __init__(self, validate, replies: dict[str, list[str | None]]):
        self.validate, self.replies = validate, replies
        self.objects: dict[tuple[str, str], dict] = {}  # (plural, name) → the object as created
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.polls: dict[tuple[str, str], int] = {}
        self.finished: set[tuple[str, str]] = set()
        self.on_done = lambda obj: None
        self.refuse: dict[str, str] = {}  # "POST"/"GET" → a recorded Status the job's own resource is answered with
        self.pods: str | None = None  # the recorded pod list; None: no pods
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method: str):
                api.requests.append((method, self.path))
                m = PATH.match(self.path)
                if not m:
                    return self._reply(404, _status(404, "NotFound", f"the server could not find {self.path}"))
                rest = self.path[m.end() :].split("?")[0].strip("/").split("/")
                plural, name = m["plural"], (rest[0] if rest and rest[0] else None)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"]))) if method == "POST" else {}
                if method in api.refuse and plural not in ("services", "pods", "podgroups"):
                    job = name or body["metadata"]["name"]
                    return self._reply(*refusal(api.refuse[method], job, m["ns"], m["group"] or "", plural))
                if method == "POST":
                    try:
                        api.validate(body)
                    except Exception as e:
                        msg = f"{body.get('kind')} in version {body.get('apiVersion')} cannot be handled: {e}"
                        return self._reply(422, _status(422, "Invalid", msg.splitlines()[0]))
                    key = (plural, body["metadata"]["name"])
                    body["metadata"].update(
                        uid=str(uuid.uuid4()), resourceVersion="1", creationTimestamp=NOW, generation=1
                    )
                    api.objects[key] = body
                    return self._reply(201, body)
                if plural == "pods" and method == "GET":
                    return self._reply(200, api.pod_list(m["ns"]))
                obj = api.objects.get((plural, name))
                if obj is None:
                    return self._reply(404, _status(404, "NotFound", f'{plural} "{name}" not found'))
                if method == "DELETE":
                    api.objects.pop((plural, name))
                    return self._reply(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})
                return self._reply(200, api.poll(plural, name))

            def do_GET(self):
                self._route("GET")

            def do_POST(self):
                self._route("POST")

            def do_DELETE(self):
                self._route("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def poll(self, plural: str, name: str) -> dict:
        """The n-th reply to a GET of the created object: replies[its k8s_kind][n] (the last one repeated)."""
        obj = self.objects[(plural, name)]
        n = self.polls[(plural, name)] = self.polls.get((plural, name), 0) + 1
        script = self.replies[kind_name(obj)]
        reply = script[min(n, len(script)) - 1]
        if n >= len(script) and (plural, name) not in self.finished:
            self.finished.add((plural, name))
            self.on_done(obj)
        if reply is None:
            return obj
        body = recorded(reply)["body"]
        body["metadata"].update(name=name, namespace=obj["metadata"]["namespace"])
        return body

    def pod_list(self, namespace: str) -> dict:
        if self.pods is None:
            return {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": []}
        body = recorded(self.pods)["body"]
        job = next(o for (plural, _), o in self.objects.items() if plural not in ("services", "podgroups"))
        for pod, suffix in zip(body["items"], POD_NAMES[kind_name(job)]):
            pod["metadata"].update(name=f"{job['metadata']['name']}-{suffix}", namespace=namespace)
        return body

    def kubeconfig(self) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "local", "cluster": {"server": self.url}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "u", "namespace": "llm"}}],
            "current-context": "local",
        }

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
