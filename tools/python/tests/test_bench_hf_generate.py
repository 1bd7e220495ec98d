"""bench/bench_hf_generate.py without a device: its options and their refusals, the decode rate
summary (median, min, max of the timed runs), and that kvq.hf serves every kvq cache the
benchmark runs from the stand-in calibration files it writes (tq_mse's included). The timed
rows themselves need the GPU machine (torch >= 2.4, transformers 5.x, libkvq_gpu.so)."""
import importlib.util
import pathlib
import subprocess
import sys
import types

import pytest

import kvq.hf as hf
from kvq import torch_ops

BENCH = pathlib.Path(__file__).resolve().parents[3] / "bench" / "bench_hf_generate.py"


def bench():
    spec = importlib.util.spec_from_file_location("bench_hf_generate", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_bench(*args):
    return subprocess.run([sys.executable, str(BENCH)] + list(args), capture_output=True,
                          text=True, timeout=60)


def test_help_names_the_options():
    r = run_bench("--help")
    assert r.returncode == 0, r.stderr
    for option in ("--contexts", "--batch", "--new", "--repeats", "--caches", "--layers"):
        assert option in r.stdout
    assert "tq_mse" in r.stdout  # among the caches it can run


@pytest.mark.parametrize("args,message", [(["--caches", "kvq_bf16,oscarr"], "'oscarr'"),
                                          (["--repeats", "0"], "--repeats 0 below 1"),
                                          (["--batch", "1,0"], "--batch 0 below 1"),
                                          (["--new", "0"], "--new 0 below 1")])
def test_bad_options_are_refused_before_any_work(args, message):
    r = run_bench(*args)
    assert r.returncode == 2 and message in r.stderr, (r.stdout, r.stderr)


def test_decode_rates_are_the_runs_median_min_max():
    rates = bench().decode_rates
    assert rates(8, 32, [2.0, 1.0, 4.0]) == (128.0, 64.0, 256.0)  # B * new / s per run
    assert rates(1, 10, [1.0, 2.0]) == (7.5, 5.0, 10.0)
    assert rates(1, 4, [2.0]) == (2.0, 2.0, 2.0)


@pytest.mark.skipif(torch_ops.torch is None, reason="no torch (the files are written with it)")
def test_every_kvq_cache_reads_its_stand_in_calibration(tmp_path):
    """At the benchmark's KV shape (8 KV heads, d = 128; 2 layers here), each kvq cache's
    scheme is served and takes the file the benchmark writes for it (none where it reads
    none); and kvq_cache_create accepts its parameters where libkvq_gpu.so loads."""
    b = bench()
    config = types.SimpleNamespace(num_hidden_layers=2, num_key_value_heads=8, head_dim=128)
    files = b.calibration_files(tmp_path, config)
    schemes = ["bf16" if c == "kvq_bf16" else c for c in b.CACHES if not c.startswith("hf_")]
    assert "tq_mse" in schemes and set(files) <= set(schemes)
    try:
        torch_ops.library()
        library = True
    except torch_ops.TorchOpError:
        library = False
    for scheme in schemes:
        cal = hf.calibration_for(scheme, files.get(scheme), 2, 8, 128)
        assert (cal is None) == (scheme not in files), scheme
        if cal is not None:
            assert cal.scheme == scheme
        if library:
            limits = hf.codebook_limits(cal, 2) if hf.SCHEMES[scheme]["widths"] else None
            hf.cache_params_for(scheme, 8, 32, 128, codebook_rows=limits)
