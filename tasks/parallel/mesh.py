"""The one DeviceMesh: pp outermost, tp innermost, so a TP group is consecutive ranks (one node, fast links)."""

from __future__ import annotations

DIMS = ("pp", "dp", "tp")


def build_mesh(device_type: str, pp: int, dp: int, tp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=DIMS)


def coords(mesh) -> dict[str, int]:
    """This rank's (pp, dp, tp) coordinates."""
    return {name: mesh[name].get_local_rank() for name in DIMS}


def layout_name(dp: int, tp: int, pp: int) -> str:
    """ "dp2·tp2·pp2" (degree-1 axes left out; "single" when all are 1)."""
    parts = [f"{k}{v}" for k, v in (("dp", dp), ("tp", tp), ("pp", pp)) if v > 1]
    return "·".join(parts) or "single"
