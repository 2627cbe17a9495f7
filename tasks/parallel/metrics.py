"""Per-step metrics: `<run-dir>/metrics.jsonl` (one JSON object per optimizer step), written by rank 0 only and sent
to the stage's MLflow run by the launching stage process (MetricsFollower: no rank imports MLflow); per-rank
heartbeats that let the launcher name ranks that fell behind."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tasks.fsutil import atomic_write_text, read_jsonl

# Keys metrics.jsonl had before issue 27's names (`val.loss`, as MLflow's `train/val.loss`): a run resumed across the
# rename reads its earlier records under the new names.
RENAMED = {"val_loss": "val.loss", "val_time_s": "val.time_s"}


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """metrics.jsonl's records (one per optimizer step), under today's keys; [] when the file does not exist."""
    return [{RENAMED.get(k, k): v for k, v in r.items()} for r in read_jsonl(path)]


def peak_flops(device, configured_tflops: float) -> float | None:
    """Dense 16-bit peak FLOP/s of one device for MFU: hardware.peak_tflops when set, else the planner's device
    table (tasks.planner.cluster.DEVICES, the same rows as the cluster presets); None on CPU or an unknown device."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type == "cpu":
        return None
    from tasks.device import device_module
    from tasks.planner.cluster import device_peak_tflops

    tflops = device_peak_tflops(device_module(device.type).get_device_name(device))
    return tflops * 1e12 if tflops else None


def truncate_after(path: Path, step: int) -> None:
    """On resume: drop lines of steps the previous attempt ran past its last checkpoint (they are redone)."""
    if not path.is_file():
        return
    kept = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    atomic_write_text(path, "".join(ln + "\n" for ln in kept))


class MetricsLog:
    """Rank 0's sink: metrics.jsonl, each record written and flushed as its step ends (the record of truth). The
    stage process that launched the ranks sends the records to MLflow as they appear (MetricsFollower), so training
    never waits on tracking and no rank imports MLflow; a step MLflow did not take is backfilled from metrics.jsonl
    by the launcher at stage end (tasks.tracking.settle_metrics) or by the next stage."""

    def __init__(self, path: Path, start_step: int):
        self.path = Path(path)
        truncate_after(self.path, start_step)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict) -> None:
        record = {**record, "time": time.time()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class MlflowSender:
    """A daemon thread sending metric records to one MLflow run; submit() never blocks. Each record is tried
    `attempts` times; when that fails the sender skips records for `pause_s` before trying again (the outage's
    steps are left to the backfill), so a dead server costs a bounded amount of effort and nothing else."""

    def __init__(self, uri: str, run_id: str, attempts: int = 2, queue_size: int = 10000, pause_s: float = 5.0):
        import queue
        import threading

        from tasks.tracking import bound_http

        bound_http()
        self.uri, self.run_id, self.attempts, self.pause_s = uri, run_id, attempts, pause_s
        self.q: "queue.Queue" = queue.Queue(maxsize=queue_size)
        self.thread = threading.Thread(target=self._run, name="mlflow-sender", daemon=True)
        self.thread.start()

    def submit(self, record: dict) -> None:
        import queue

        try:
            self.q.put_nowait(record)
        except queue.Full:  # MLflow far behind: dropped here, backfilled later from metrics.jsonl
            pass

    def _run(self) -> None:
        import mlflow
        from mlflow.entities import Metric

        from tasks.tracking import metric_key

        client = mlflow.MlflowClient(self.uri)
        down_until = 0.0
        while True:
            record = self.q.get()
            if record is None:
                return
            if time.time() < down_until:
                continue
            metrics = [
                Metric(metric_key(k), float(v), int(record["time"] * 1000), int(record["step"]))
                for k, v in record.items()
                if k not in ("step", "time")
                and isinstance(v, (int, float))
                and not isinstance(v, bool)
                and v is not None
            ]
            for attempt in range(self.attempts):
                try:
                    client.log_batch(self.run_id, metrics=metrics, synchronous=True)
                    break
                except Exception:
                    time.sleep(0.5 * (attempt + 1))
            else:
                down_until = time.time() + self.pause_s

    def close(self, flush_s: float) -> None:
        """Give the queue up to flush_s to drain; what is left is the backfill's."""
        try:
            self.q.put(None, timeout=flush_s)
        except Exception:
            return
        self.thread.join(flush_s)


class MetricsFollower:
    """The launcher's half of the per-step metrics: while the ranks run, a daemon thread reads what rank 0 appends
    to metrics.jsonl (every `poll_s`, whole lines only) and hands each record of this launch to an MlflowSender.

    A record belongs to this launch when its time (rank 0's clock, written as its step ends; rank 0 runs on node 0,
    this host) is not before the follower started: a resumed run's earlier records were sent by their own launch.
    Rank 0 rewrites the file when it resumes (truncate_after: the steps past the checkpoint are redone), a new file
    under the same name: the follower then reads it again from its start."""

    def __init__(self, path: Path, uri: str, run_id: str, poll_s: float = 0.5):
        import threading

        self.path, self.poll_s = Path(path), poll_s
        self.since = time.time()
        self._file_id: tuple[int, int] | None = None  # (device, inode) of the file read so far
        self._pos = 0  # bytes of it read: whole lines only
        self.sender = MlflowSender(uri, run_id)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._follow, name="metrics-follower", daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.read()

    def read(self) -> None:
        """Send the whole lines appended since the last read (all of a new file's: rank 0 rewrote it)."""
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if (st.st_dev, st.st_ino) != self._file_id or st.st_size < self._pos:
                    self._file_id, self._pos = (st.st_dev, st.st_ino), 0
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:  # rank 0 has not written yet
            return
        whole = data[: data.rfind(b"\n") + 1]  # a line rank 0 is still writing waits for the next read
        self._pos += len(whole)
        for line in whole.splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a damaged line: the backfill reads the file again at stage end
                continue
            if isinstance(record, dict) and record.get("time", 0) >= self.since and "step" in record:
                self.sender.submit(record)

    def close(self, flush_s: float = 10.0) -> None:
        """Stop following (after the ranks ended), send the last lines, and give the sender up to flush_s."""
        self._stop.set()
        self.thread.join()
        self.read()
        self.sender.close(flush_s)


class Heartbeat:
    """`<dir>/rank-K.json`: pid, step and phase of one rank, rewritten as it advances (plain writes: a torn read
    is tolerated by the reader)."""

    def __init__(self, directory: Path, rank: int):
        self.path = Path(directory) / f"rank-{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank

    def beat(self, step: int, phase: str) -> None:
        self.path.write_text(
            json.dumps({"rank": self.rank, "pid": os.getpid(), "step": step, "phase": phase, "time": time.time()})
        )


def read_heartbeats(directory: Path) -> dict[int, dict]:
    beats = {}
    for p in Path(directory).glob("rank-*.json"):
        try:
            b = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        beats[int(b["rank"])] = b
    return beats


PRELOADED_RSS = "LLM_PIPELINE_PRELOADED_RSS"  # what the forking agent's RSS grew by importing them (tasks/launch/agent)


class PhasePeaks:
    """This rank's memory peak per phase (init, train, checkpoint, export): the peak counter is reset when a phase
    starts and read when it ends (on CPU the RSS high-water mark, VmHWM, reset through /proc/self/clear_refs), so
    each figure is that phase's own; a phase entered again keeps its maximum. `base_bytes` is what the process
    held before the model existed (imports, process group): on CPU the estimate is compared with peak − base."""

    def __init__(self, device):
        from tasks.device import memory_stats

        self.device, self.peaks, self.current = device, {}, None
        self.base_bytes = memory_stats(device)["allocated_bytes"]
        if getattr(device, "type", device) == "cpu":
            # A rank forked by tasks/launch/agent.py already holds the modules an exec'd rank imports while building
            # its parallel model (FSDP2, DTensor, DCP, dynamo); they stay the first trainer's, as exec'd (the CPU
            # runtime reserve, tasks/planner/cluster.py, counts them). Taken once: a later spec's trainer and the
            # export start with them in their baseline, exec'd too.
            self.base_bytes -= int(os.environ.pop(PRELOADED_RSS, "0"))

    def enter(self, phase: str) -> None:
        from tasks.device import reset_peak

        self.close()
        reset_peak(self.device)
        self.current = phase

    def close(self) -> None:
        from tasks.device import memory_stats

        if self.current:
            peak = memory_stats(self.device)["peak_bytes"]
            self.peaks[self.current] = max(self.peaks.get(self.current, 0), peak)
            self.current = None

    def result(self) -> dict:
        self.close()
        return {**self.peaks, "base": self.base_bytes}
