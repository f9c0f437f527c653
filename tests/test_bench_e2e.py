"""BM5's logic on the CPU: every policy (engine on the host backend, the
by-hand LRU, predictors) must compute exactly what all-resident computes."""
from bench import e2e


def test_every_policy_computes_the_same_decode(capsys):
    assert e2e.main(["--smoke-cpu"]) == 0
    assert "smoke ok" in capsys.readouterr().out


def test_table_keeps_unmeasured_runs_null():
    row = {"model": "m", "batch": 1, "cache_share": 0.1, "policy": "oracle", "p50_ms": None, "p90_ms": None,
           "floor_ms": 3.0}
    assert "null" in e2e.format_table([row])
