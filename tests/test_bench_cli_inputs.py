"""bench/bandwidth.py and bench/overlap.py refuse values no measurement can
take (a size of zero bytes, no reps: a division by zero or the median of
nothing on a GPU) with a usage error, exit 2, before touching CUDA; valid
arguments on a machine without CUDA still print null and exit 1."""
import json

import pytest

from bench import bandwidth, overlap


@pytest.mark.parametrize("args, message", [
    (["--sizes-mib", "0", "-1", "--reps", "-3"], "--sizes-mib must be positive"),
    (["--sizes-mib", "1", "-1"], "--sizes-mib must be positive"),
    (["--sizes-mib", "1e-9"], "at least a byte"),
    (["--sizes-mib", "nan"], "--sizes-mib must be positive and finite"),
    (["--sizes-mib", "inf"], "--sizes-mib must be positive and finite"),
    (["--reps", "0"], "--reps must be at least 1"),
    (["--chunk-mib", "0"], "--chunk-mib must be positive"),
    (["--total-mib", "0"], "--total-mib must be positive"),
    (["--lanes", "0"], "--lanes must be at least 1"),
    (["--devices", "0"], "--devices must be at least 1"),
    (["--devices", "2", "--reps", "0"], "--reps must be at least 1"),
])
def test_bandwidth_refuses_nonsense(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        bandwidth.main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--entry-mib", "0"], "--entry-mib must be positive"),
    (["--entry-mib", "-9.4"], "--entry-mib must be positive"),
    (["--entry-mib", "nan"], "--entry-mib must be positive"),
    (["--reps", "0"], "must be at least 1"),
    (["--steps", "0"], "must be at least 1"),
    (["--matmul", "-1"], "must be at least 1"),
    (["--copy-fraction", "0"], "--copy-fraction must be positive"),
])
def test_overlap_refuses_nonsense(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        overlap.main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="checks the no-CUDA output; with CUDA these would measure")
def test_without_cuda_valid_arguments_still_report_null_and_exit_1(tmp_path, capsys):
    out = tmp_path / "bw.json"
    assert bandwidth.main(["--sizes-mib", "1", "--reps", "1", "--json", str(out)]) == 1
    assert json.loads(out.read_text())["rows"][0]["raw_gbps"] is None
    out = tmp_path / "ov.json"
    assert overlap.main(["--reps", "1", "--json", str(out)]) == 1
    assert json.loads(out.read_text())["hidden_fraction"] is None
    assert "null" in capsys.readouterr().out
