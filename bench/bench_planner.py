"""Planner accuracy figures: the activation estimate over the bytes autograd really saves on the project's model
(fused-attention estimate, and the paper's unfused formula as the baseline), plus the seed's verdicts.

bf16 runs the model in bf16 (as FSDP2's MixedPrecisionPolicy does in training); bf16_autocast keeps fp32 weights
under torch.autocast (as the smoke run does), which also saves bf16 copies of the weights and fp32 residuals."""

from __future__ import annotations

# The figures depend only on the code (fixed seeds, no timing): tests/test_bench_results.py recomputes them.
DETERMINISTIC = True


def run() -> dict:
    import torch

    from tasks.model import build_model, get_preset, materialize
    from tasks.model.loss import lm_loss
    from tasks.planner.calibrate import saved_activation_bytes
    from tasks.planner.cluster import get_cluster
    from tasks.layout import Layout
    from tasks.planner.memory import estimate
    from tasks.units import GB
    from tasks.planner.search import Problem, search

    figures = {}
    gen = torch.Generator().manual_seed(0)
    for preset, s, b in (("demo", 128, 4), ("demo", 512, 1), ("debug", 256, 8)):
        tcfg = get_preset(preset)
        model = materialize(build_model(tcfg), "cpu")
        bf16_model = materialize(build_model(tcfg), "cpu").to(torch.bfloat16)
        bf16_model.init_rope()  # the RoPE table stays fp32
        tokens = torch.randint(0, tcfg.vocab_size, (b, s), generator=gen)
        for label, precision, net, cast in (
            ("fp32", "fp32", model, None),
            ("bf16", "bf16", bf16_model, None),
            ("bf16_autocast", "bf16", model, torch.bfloat16),
        ):
            measured = saved_activation_bytes(net, tokens, lm_loss, cast)
            key = f"planner.act_estimate_over_saved.{preset}_s{s}_b{b}_{label}"
            for flash, suffix in ((True, ""), (False, "_unfused_formula")):
                est = estimate(tcfg, s, Layout(micro_batch=b, flash_attention=flash), precision)
                figures[key + suffix] = round(est["activations_bytes"] / measured, 3)

    seventy = get_preset("llama3-70b")
    result = search(Problem(get_cluster("910b", nodes=8), seventy, 4096, 512))
    best = result["plans"][0]
    figures["planner.llama3_70b_8x8x910b.best_layout"] = (
        f"dp{best['dp']} tp{best['tp']} pp{best['pp']} zero{best['zero']} {best['recompute']}"
    )
    figures["planner.llama3_70b_8x8x910b.best_total_gb"] = round(best["total_bytes"] / GB, 1)
    figures["planner.llama3_70b_8x8x910b.feasible_plans"] = len(result["plans"])
    one_card = search(Problem(get_cluster("910b", devices_per_node=1), None, 4096, 8, n_params=13e9))
    figures["planner.13b_one_910b.verdict"] = one_card["rejected"][0]["reason"]
    return figures


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    print(json.dumps(run(), indent=2))
