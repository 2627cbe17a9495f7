"""Per-rank training entry, started by torchrun: `python -m tasks.train.worker --spec launch.json [--spec …]`.

The spec (written by tasks/stages/train.py) holds the resolved config, model shape, layout and paths. Several specs run
one after another in the same process group (the tests use this to check many layouts per torchrun launch); after
each one that asks for it, all ranks export the final checkpoint to HF format together.
Exit codes: 0 done, 3 stopped by the divergence guard (nothing exported), 4 out of memory, 5 collective timeout,
6 stopped by the rehearsal, another a hook's StopTraining (train/stopped.json), 1 anything else.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

from tasks.train.progress import waiting
from tasks.train.trainer import log


def export(spec: dict, source: str | None = None) -> None:
    """The final checkpoint (or `source`: early stopping's best) → <run-dir>/hf (HF format), written by all ranks
    together after the model and optimizer are gone: each rank streams its share of the files one tensor at a time
    (tasks.model.hf_export)."""
    import torch
    import torch.distributed as dist
    from tasks import collectives

    from tasks.fsutil import atomic_write_json
    from tasks.model import TransformerConfig
    from tasks.model.hf_export import export_from_checkpoint
    from tasks.parallel.checkpoint import latest
    from tasks.parallel.metrics import PhasePeaks

    gc.collect()
    _release_freed_memory()
    phases = PhasePeaks(torch.device("cpu"))  # the export runs on the host whatever the training device
    phases.enter("export")
    stats = {}
    run_dir = Path(spec["run_dir"])
    found = (0, Path(source)) if source else latest(run_dir / "checkpoints")
    if found is None:
        raise RuntimeError(f"export: no complete checkpoint in {run_dir / 'checkpoints'}")
    log(f"exporting {found[1]} to {run_dir / 'hf'}")
    with waiting(f"the HF export of {found[1].name} to {run_dir / 'hf'}", dist.get_rank()):
        export_from_checkpoint(
            found[1],
            TransformerConfig(**spec["model"]),
            run_dir / "hf",
            tokenizer_dir=spec["export"].get("tokenizer_dir"),
            rank=dist.get_rank(),
            world=dist.get_world_size(),
            barrier=collectives.barrier,
            file_bytes=spec["export"].get("file_bytes"),
            stats=stats,
            hf_path=spec["export"].get("hf_path"),
        )
    by_rank = [None] * dist.get_world_size()
    collectives.all_gather_object(by_rank, {**phases.result(), **stats})
    if dist.get_rank() == 0:
        atomic_write_json(run_dir / "train" / "export_memory.json", {"per_rank": by_rank})
    log("export done")


def _release_freed_memory() -> None:
    """glibc keeps freed heap pages; hand them back (malloc_trim) so the next phase starts from what is in use."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def main(argv=None) -> int:
    """@record: a Python exception of this rank goes to the error file torchrun names (TORCHELASTIC_ERROR_FILE),
    where the launcher reads the real cause of the failure (tasks.parallel.rank_errors)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_main)(argv)


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", action="append", required=True, help="launch spec JSON (repeatable)")
    parser.add_argument("--profile-dir", default=None, help="profile the steps (tasks.profiling.collect schedule)")
    args = parser.parse_args(argv)
    import torch.distributed as dist

    from tasks.device import detect, torch_device
    from tasks.procs import die_with_parent, freeze_long_lived
    from tasks.train.trainer import Trainer

    die_with_parent(signal.SIGKILL)  # torchrun gone (kill -9) → this rank goes too, never an orphan that trains on
    specs = [json.loads(Path(p).read_text(encoding="utf-8")) for p in args.spec]
    hw = specs[0]["config"]["hardware"]
    backend = detect(hw["device"])
    device = torch_device(backend.kind, int(os.environ.get("LOCAL_RANK", "0")))
    world = os.environ.get("WORLD_SIZE", "?")  # rank 0 says so in torchrun's log (relayed by the launcher)
    with waiting(f"the process group ({world} ranks)", int(os.environ.get("RANK", "0"))):
        dist.init_process_group(
            backend.dist_backend, timeout=timedelta(seconds=specs[0]["config"]["train"]["timeout_s"])
        )
    freeze_long_lived()  # torch, the device layer and the process group: out of the GC passes of the training steps
    code, stopped = 0, False
    for spec in specs:
        trainer = Trainer(spec, device)
        try:
            code = trainer.fit(args.profile_dir)
        finally:  # its workers end through their own exit, also when fit raised: nothing of theirs left in $TMPDIR
            trainer.loader.close()
        source, stopped = trainer.export_from, trainer.stopped
        del trainer
        # the trainer and its hooks reference each other: free the model and loader workers now, and keep what stays
        # (FSDP2, DTensor, dynamo, imported by the first spec) out of the next specs' GC passes
        freeze_long_lived()
        if code:
            break
        if spec.get("export"):
            export(spec, source)
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 or stopped:  # every rank at the same point (the guard and the rehearsal stop through StopTraining too)
        dist.destroy_process_group()
    # os._exit: skips interpreter teardown, which rarely SIGABRTs after destroy_process_group (gloo threads)
    # and would turn a finished run into a failed one.
    os._exit(code)


if __name__ == "__main__":
    main()
