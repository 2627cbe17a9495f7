"""A Kubernetes API endpoint on 127.0.0.1 for the launcher's submit/wait/collect path (tests/test_k8s_launcher.py).

No kube-apiserver can run here (no package registry ships one, no Docker), so the `kubernetes` client and the cncf
provider's KubernetesHook talk HTTP to this server instead: their whole request layer runs (kubeconfig loading,
URL building, serialisation, urllib3, response decoding into V1Job / dicts). It answers the REST paths the launcher
uses the way the API server does: POST create → 201 with the object plus server-set metadata (uid, resourceVersion,
creationTimestamp, generation), GET → the stored object (200) or a `Status` 404, DELETE → a `Status` 200, pod list
→ a `PodList`. The responses are built to the API's own schemas (k8s-api-schema.json and the CRDs' status
schemas), not recorded from a live server. Each created body is validated strictly against its kind's schema
(`validate`), as `kubectl --validate=strict` / fieldValidation=Strict would. `advance(kind, name)` plays the
controller: it sets the status a Job/PyTorchJob/TrainJob reaches (Running, then Succeeded/Complete or Failed) and
runs `on_done` (the pods writing <stage>.json onto the shared volume).
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NOW = "2026-12-01T12:00:00Z"
PATH = re.compile(r"^/(?:api/v1|apis/(?P<group>[^/]+)/(?P<version>[^/]+))/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/?]+)")


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}  # fmt: skip


class FakeApi:
    def __init__(self, validate, conditions: dict[str, list[dict]]):
        """validate(manifest) raises on an invalid body; conditions: kind → the status.conditions it ends with."""
        self.validate, self.final = validate, conditions
        self.objects: dict[tuple[str, str], dict] = {}  # (plural, name) → stored object
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.polls: dict[tuple[str, str], int] = {}
        self.finished: set[tuple[str, str]] = set()
        self.on_done = lambda obj: None
        self.polls_to_finish = 2
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
                if method == "POST":
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                    try:
                        api.validate(body)
                    except Exception as e:
                        msg = f"{body.get('kind')} in version {body.get('apiVersion')} cannot be handled: {e}"
                        return self._reply(422, _status(422, "Invalid", msg.splitlines()[0]))
                    key = (plural, body["metadata"]["name"])
                    if key in api.objects:
                        return self._reply(409, _status(409, "AlreadyExists", f'{plural} "{key[1]}" already exists'))
                    body["metadata"].update(
                        uid=str(uuid.uuid4()), resourceVersion="1", creationTimestamp=NOW, generation=1
                    )
                    api.objects[key] = body
                    return self._reply(201, body)
                if plural == "pods" and method == "GET":
                    return self._reply(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": []})
                obj = api.objects.get((plural, name))
                if obj is None:
                    return self._reply(404, _status(404, "NotFound", f'{plural} "{name}" not found'))
                if method == "DELETE":
                    api.objects.pop((plural, name))
                    return self._reply(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})
                api.advance(plural, name)
                return self._reply(200, obj)

            def do_GET(self):
                self._route("GET")

            def do_POST(self):
                self._route("POST")

            def do_DELETE(self):
                self._route("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def advance(self, plural: str, name: str) -> None:
        """The controller's part: Running on the first poll, the final conditions on the `polls_to_finish`-th."""
        obj = self.objects[(plural, name)]
        n = self.polls[(plural, name)] = self.polls.get((plural, name), 0) + 1
        kind = obj["kind"]
        if n < self.polls_to_finish:
            running = {"Job": [], "PyTorchJob": [_cond("Running", "PyTorchJobRunning")], "TrainJob": []}[kind]
            obj["status"] = {"conditions": running, **({"active": 1} if kind == "Job" else {})}
            return
        if (plural, name) not in self.finished:
            self.finished.add((plural, name))
            self.on_done(obj)
            obj["status"] = {"conditions": self.final[kind]}

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


def _cond(type_: str, reason: str, status: str = "True", message: str = "") -> dict:
    return {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": NOW}
