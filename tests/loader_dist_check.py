"""Run by tests/test_loader.py under torchrun (2 ranks, 2 DataLoader workers each); rank 0 writes what all saw.

Usage: torchrun --nproc-per-node 2 tests/loader_dist_check.py SHARD_DIR BATCH_SIZE OUT_JSON
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from data_prep.loader import ShardLoader  # noqa: E402


def keys(batches) -> list[str]:
    return [k for _, _, ks in batches for k in ks]


def main(shard_dir: str, batch_size: int, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    kw = dict(batch_size=batch_size, dp_rank=rank, dp_world=world, num_workers=2, seed=7, with_keys=True)
    loader = ShardLoader(shard_dir, **kw)
    epochs, shifted = [], True
    for _ in range(2):
        batches = list(loader)
        shifted &= all(bool((x[:, 1:] == y[:, :-1]).all()) for x, y, _ in batches)
        epochs.append(keys(batches))
    first = ShardLoader(shard_dir, **kw)
    stream = iter(first)
    head = [next(stream) for _ in range(5)]
    state = first.state_dict()
    stream.close()
    resumed = ShardLoader(shard_dir, **kw)
    resumed.load_state_dict(state)
    mine = {
        "epochs": epochs,
        "resumed": keys(head) + keys(resumed),
        "len": len(loader),
        "shifted": shifted,
        "state": state,
        "epoch_after": loader.epoch,
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
