"""smoke.model named (a preset, or `same`) is trained as named, but one whose FP32 AdamW estimate is over the device
budget was built without a word and the process killed for memory (a 70B named beside a llama3-8b config passed every
check: its vocabulary is the same). It is said in one warning line first, with the estimate in the record."""

from __future__ import annotations

from tasks.config import load_config
from tasks.model import get_preset
from tasks.model.sibling import budget_of, choose

SEQ = 128


def _cfg(**sets):
    return load_config("demo-cpu", sets=[f"{k}={v}" for k, v in {"model.preset": "llama3-8b", **sets}.items()])


def test_a_named_smoke_model_over_the_budget_is_said_before_it_is_built(capsys):
    full = get_preset("llama3-8b")
    cfg = _cfg(**{"smoke.model": "llama3-70b"})
    tcfg, info = choose(cfg, full, 128256, SEQ)
    assert tcfg.n_layers == get_preset("llama3-70b").n_layers  # named: trained as named, not replaced
    assert info["estimate_bytes"] > budget_of(cfg).usable_bytes
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("warning: smoke.model=llama3-70b: "), err
    assert "may be killed for memory; smoke.model=auto derives a sibling that fits" in err[0]
    assert "GB usable" in err[0]  # the budget it is over, as auto's refusal names it

    tcfg, info = choose(_cfg(**{"smoke.model": "same"}), full, 128256, SEQ)  # the 8B itself: over it too
    assert tcfg is full and "may be killed for memory" in capsys.readouterr().err


def test_a_named_smoke_model_that_fits_says_nothing(capsys):
    cfg = _cfg(**{"smoke.model": "debug"})
    tcfg, info = choose(cfg, get_preset("llama3-8b"), 2048, SEQ)
    assert tcfg.n_layers == 2 and 0 < info["estimate_bytes"] <= budget_of(cfg).usable_bytes
    assert capsys.readouterr().err == ""
