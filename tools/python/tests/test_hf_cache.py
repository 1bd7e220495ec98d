"""kvq.hf: transformers' Llama and Qwen3 generating through kvq's paged cache.

Everywhere (no device): SCHEMES restates schemes.inc (every id, no other); every row it serves
builds, key for key, the cache parameters calib::BuildLayerScheme built for that scheme's golden
attention case (conformance/vectors/attention/scheme_<id>: its metadata, read here; and, where
the extension module kvq._kvq loads, as kvq's C++ parses them), and is accepted by
kvq_cache_create (libkvq_gpu.so's C ABI; skipped without the library); the per-head rows kvq.hf
reads from a golden case's rows written as a calibration file are those kvq's scalar cache
writes the case with (where kvq._kvq loads); the rotations kvq.hf reads from a `kvq calibrate
--scheme tq_mse` file are the ones BuildLayerScheme built for the golden tq_mse case (with
KVQ_BINARY, as ctest sets it); a scheme that needs its own calibration file (tq_mse, blockgtq,
fp8) refuses another scheme's naming both.
On the GPU machine (CUDA, torch >= 2.4, transformers 5.x, libkvq_gpu.so), on tiny random-init
Llama and Qwen3 configs (4 KV heads, 8 query heads, head_dim 128, fp32 weights, seed 0):
 (a) scheme bf16: prompt logits equal DynamicCache + sdpa's bit for bit (the prompt's attention
     is sdpa's own), and the logits of every decode step equal them within 4 * 2^-9 of the
     largest logit (K/V rounded to bf16; see test_bf16_cache_logits_match_dynamic_cache);
 (b) greedy generation with oscar (a random orthonormal R per head, clip 0.95), kivi INT2,
     tq_mse_fwht (K3V2), tq_mse (random orthonormal R per head and side, K2V2) and blockgtq
     (random per-head key widths 1..5, V2) runs, gives valid tokens, changes the pools as tokens
     enter the history, and its agreement with bf16's tokens is printed, not asserted;
 (c) a scheme whose per-head data Python cannot build (saw_hessian: C++ Hessian rotations)
     raises naming the scheme;
 (d) caches over KV heads [0, H/2) and [H/2, H) fed those heads' K/V hold the bytes of the full
     cache's corresponding heads (sharding invariance at the cache level, one GPU);
 (e) with KVQ_PPL_JSON (`kvq ppl --backend gpu --gpu-decode steps --json`) and model A exported to
     an HF folder: teacher-forced PPL through the HF path equals kvq ppl's per scheme;
 (f) every served scheme's golden attention case, its per-head rows written to a calibration
     file, replayed through kvq.hf.Cache and answered by kvq.hf.attention, holds the case's GPU
     tolerance against kvq's fp64 reference (the rotations BuildLayerScheme made: tq_mse's
     seeded Haar ones included);
 (g) a dropped cache's pools are freed (the attention side channel holds no layer alive).
"""
import json
import math
import os
import pathlib
import re
import struct

import pytest

import kvq.hf as hf
from kvq import torch_ops

torch = torch_ops.torch
ROOT = pathlib.Path(__file__).resolve().parents[3]

try:
    torch_ops.library()
    LIBRARY_ERROR = None
except torch_ops.TorchOpError as e:
    LIBRARY_ERROR = str(e)
needs_library = pytest.mark.skipif(LIBRARY_ERROR is not None, reason=str(LIBRARY_ERROR))

DEVICE_REASON = (LIBRARY_ERROR
                 or ("no torch" if torch is None else None)
                 or (None if torch_ops.registered() else
                     "torch %s has no torch.library.custom_op (>= 2.4)" % torch.__version__)
                 or hf.TRANSFORMERS_ERROR
                 or (None if torch.cuda.is_available() else "no CUDA device"))
needs_device = pytest.mark.skipif(DEVICE_REASON is not None, reason=str(DEVICE_REASON))


# ---- Everywhere -------------------------------------------------------------------------------


def catalogue_ids():
    text = (ROOT / "calib" / "include" / "kvq" / "calib" / "schemes.inc").read_text()
    return re.findall(r"^KVQ_SCHEME\((\w+),", text, re.M)


def test_scheme_table_restates_the_catalogue():
    assert sorted(hf.SCHEMES) == sorted(catalogue_ids())


def test_refused_schemes_name_themselves():
    for name, row in hf.SCHEMES.items():
        if isinstance(row, str):
            with pytest.raises(torch_ops.TorchOpError) as refused:
                hf.scheme_recipe(name)
            assert "'%s'" % name in str(refused.value) and refused.value.code == "unsupported"
    with pytest.raises(torch_ops.TorchOpError, match="unknown scheme 'oscarr'"):
        hf.scheme_recipe("oscarr")


@needs_library
@pytest.mark.parametrize("name", [n for n, r in hf.SCHEMES.items() if not isinstance(r, str)])
def test_served_schemes_are_accepted_by_the_c_abi(name):
    params = hf.cache_params_for(name, num_kv_heads=2, num_q_heads=8, head_dim=128)
    recipe = hf.scheme_recipe(name)
    c = torch_ops._cache(params)
    for side in (0, 1):
        use = {row: u for row, _, _, u in c.heads[side]}
        dense = recipe["rotation"][side] is not None and \
            recipe["rotation"][side].startswith("calibration:")
        assert (use["rotation"] == 2) == dense, (name, side)
        assert (use["scale"] == 2) == (recipe["format"][side] == "fp8_e4m3"), (name, side)


@needs_library
def test_a_scheme_python_cannot_build_raises_naming_it():  # (c)
    with pytest.raises(torch_ops.TorchOpError) as refused:
        hf.cache_params_for("saw_hessian", num_kv_heads=2, num_q_heads=8, head_dim=128)
    assert "'saw_hessian'" in str(refused.value)
    assert "HessianBlockRotation" in str(refused.value)


# ---- The rows against what kvq's C++ builds (the golden scheme cases) -----------------------

VECTORS = ROOT / "conformance" / "vectors"
SERVED = [n for n, r in hf.SCHEMES.items() if not isinstance(r, str)]
CACHE_KEYS = {"num_kv_heads", "num_q_heads", "sink", "recent", "flush", "page_size", "quantized",
              "softmax_scale"}


def write_param_rows():
    """[(Type, name, metadata key, default text)] of write_params.inc's rows, the default as
    PutWriteParams writes it (enumerators by their snake_case names, bools as 0 / 1)."""
    text = (ROOT / "common" / "include" / "kvq" / "common" / "write_params.inc").read_text()
    rows = []
    for typ, name, init, key in re.findall(
            r'^KVQ_WRITE_PARAM\((\w+), (\w+), ([^,]+), "(\w+)"', text, re.M):
        init = init.strip()
        if "::k" in init:
            init = re.sub(r"(?<!^)([A-Z])", r"_\1", init.split("::k")[1]).lower()
        elif init in ("false", "true"):
            init = str(int(init == "true"))
        rows.append((typ, name, key, init.rstrip("f")))
    return rows


def as_value(text):
    try:
        return float(text)
    except ValueError:
        return text


def cache_entries(entries):
    """A cache's metadata ({key: text}, PutCacheParams' keys) with every key it may leave out at
    its default (flush 1; the write parameters it stores only where they matter), numbers as
    floats: two texts of the same parameters compare equal."""
    quantized = entries["quantized"] == "1"
    out = {"flush": "1"}
    for side in ("key.", "value."):
        for _, _, key, default in write_param_rows():
            out[side + key] = default
        if not quantized:  # GetCacheParams' fallback format
            out[side + "row_format"] = "bf16"
    out.update({k: v for k, v in entries.items()
                if k in CACHE_KEYS or k.startswith(("key.", "value."))})
    for side in ("key.", "value."):  # a bf16 side reads head_dim alone (WriteParams::Validate):
        if out[side + "row_format"] == "bf16":  # kvq.hf writes b = 16, BuildLayerScheme `bits`
            out = {k: v for k, v in out.items()
                   if not k.startswith(side) or k in (side + "row_format", side + "head_dim")}
    return {k: as_value(v) for k, v in out.items()}


def parse_params(text):
    return dict(item.split("=", 1) for item in text.split(";") if item)


def golden_scheme_case(name):
    """(metadata, tensors) of attention/scheme_<name> (calib::BuildLayerScheme's cache at the
    case's options: conformance/src/generate_schemes.cc)."""
    from test_torch_ops import read_safetensors
    return read_safetensors(VECTORS / "attention" / ("scheme_%s.safetensors" % name))


def golden_options(metadata):
    """The SchemeOptions of a golden scheme case ("G=32 b=2 S0=4 W=8 P=16 seed=0
    saw_block=32", and " F=32 (the scheme's own F is 128)" where the case flushes less than
    the scheme) as cache_params_for's keywords, and the scheme's own F where overridden."""
    text = metadata["scheme_options"]
    o = dict(re.findall(r"(\w+)=(\d+)", text.split(" F=")[0]))
    own_flush = re.search(r"the scheme's own F is (\d+)", text)
    return (dict(group=int(o["G"]), bits=int(o["b"]), sink=int(o["S0"]), recent=int(o["W"]),
                 page_size=int(o["P"]), saw_block=int(o["saw_block"])),
            int(own_flush.group(1)) if own_flush else None)


def golden_params(name):
    """(kvq.hf's cache text for scheme `name` at its golden case's shape and options, the case's
    metadata): the widths row limits of a widths scheme are the case's (data, as a file's)."""
    metadata, _ = golden_scheme_case(name)
    options, _ = golden_options(metadata)
    rows = None
    if hf.SCHEMES[name]["widths"]:
        rows = tuple(int(metadata["key." + k]) for k in ("segments", "code_bytes", "bits"))
    text = hf._scheme_params(name, int(metadata["num_kv_heads"]), int(metadata["num_q_heads"]),
                             int(metadata["key.head_dim"]), options["bits"], options["group"],
                             options["sink"], options["recent"], options["page_size"], 32,
                             options["saw_block"], None, rows)
    return text, metadata


@pytest.mark.parametrize("name", SERVED)
def test_served_rows_build_what_build_layer_scheme_builds(name):
    """Every key of the cache's metadata, as BuildLayerScheme set it for the scheme's golden
    attention case (tq_mse: codebook on both sides, G = d, dense R, b from the options, beta
    tables, no windows), equals the text kvq.hf hands kvq_cache_create at the case's options.
    The one difference kvq vectors generate makes on purpose, KIVI's flush of 128 cut to a
    tile (32) so that 40 tokens reach the history, is undone first."""
    text, metadata = golden_params(name)
    expected = cache_entries(metadata)
    _, own_flush = golden_options(metadata)
    if own_flush is not None:
        expected["flush"] = float(own_flush)
    got = cache_entries(parse_params(text))
    assert got == expected, {k: (got.get(k), expected.get(k))
                             for k in set(got) | set(expected) if got.get(k) != expected.get(k)}


def extension():
    try:
        import kvq
        kvq.WriteParams  # noqa: B018 (raises ImportError where kvq._kvq does not load)
        return kvq
    except ImportError:
        return None


@pytest.mark.skipif(extension() is None, reason="the extension module kvq._kvq does not load")
@pytest.mark.parametrize("name", SERVED)
def test_served_rows_parse_as_kvqs_own_golden_caches(name):
    """The same comparison through kvq's C++ (kvq._kvq): the case's cache as kvq's reader
    parses it (kvq.vectors: GetCacheParams), against kvq.WriteParams built from kvq.hf's text
    (kvq's builder and Validate), parameter by parameter of write_params.inc."""
    kvq = extension()
    text, metadata = golden_params(name)
    ours = parse_params(text)
    theirs = kvq.vectors.load().case("attention/scheme_" + name).cache().params
    _, own_flush = golden_options(metadata)
    for key in ("num_kv_heads", "num_q_heads", "sink", "recent", "page_size"):
        assert int(ours[key]) == theirs[key], key
    assert int(ours["flush"]) == (own_flush or theirs["flush"])
    assert bool(int(ours["quantized"])) == theirs["quantized"]
    types = {"int": int, "float": float, "bool": lambda v: bool(int(v))}
    for side in ("key", "value"):
        given = {n: types.get(t, str)(ours[side + "." + k])
                 for t, n, k, _ in write_param_rows() if side + "." + k in ours}
        built = kvq.WriteParams(**given)
        for _, n, _, _ in write_param_rows():
            if built.format == "bf16" and n not in ("format", "head_dim"):
                continue  # read by no bf16 side (cache_entries)
            assert getattr(built, n) == getattr(theirs[side], n), (side, n)


def test_served_rows_restate_the_catalogues_formats():
    kvq = extension()
    if kvq is None:
        pytest.skip("the extension module kvq._kvq does not load")
    formats = {s["name"]: (s["format_k"], s["format_v"]) for s in kvq.schemes()}
    for name in SERVED:
        assert hf.SCHEMES[name]["format"] == formats[name], name


# ---- Which calibration file a scheme takes ------------------------------------------------

needs_torch = pytest.mark.skipif(torch is None, reason="no torch (calibration files are read "
                                                      "into torch tensors)")
SHAPE = dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=64)


def shape_config():
    import types
    return types.SimpleNamespace(**SHAPE)


@needs_torch
def test_tq_mse_reads_its_own_calibration_file(tmp_path):
    config = shape_config()
    path = tq_mse_calibration(tmp_path / "t.safetensors", config)
    cal = hf.calibration_for("tq_mse", str(path), 2, 2, 64)
    assert cal.scheme == "tq_mse" and cal.version == 4
    rotations = hf.Cache._heads(cache_holding([1, 0]), hf.SCHEMES["tq_mse"], cal, 1, 2, 64)
    written = hf._read_safetensors(path)[1]
    assert torch.equal(rotations[0]["rotation"], written["layers.1.k_rotation"][[1, 0]])
    assert torch.equal(rotations[1]["rotation"], written["layers.1.v_rotation"][[1, 0]])
    assert set(rotations[0]) == {"rotation"} and set(rotations[1]) == {"rotation"}


@needs_torch
@pytest.mark.parametrize("name", [n for n in SERVED if any(
    r and r.startswith("calibration:") for r in hf.SCHEMES[n]["rotation"])])
def test_dense_rotations_come_from_the_tensors_the_rows_name(name, tmp_path):
    """Each side's R is read from layers.{l}.<the row's tensor> (raw_target: raw_k_rotation and
    raw_v_rotation), global KV heads in the cache's order."""
    tensors = {}
    for l in range(2):
        for stem in ("k_rotation", "v_rotation", "raw_k_rotation", "raw_v_rotation", "k_basis",
                     "v_basis"):
            tensors["layers.%d.%s" % (l, stem)] = torch.randn(2, 64, 64)
        for s in "kv":
            tensors["layers.%d.%s_clip" % (l, s)] = torch.rand(2)
        tensors["layers.%d.k_bits" % l] = torch.full((2, 32), 2, dtype=torch.uint8)
    codebook = "codebook" in hf.SCHEMES[name]["format"]
    write_safetensors(tmp_path / "c.safetensors", tensors, dict(
        format="kvq-calibration", format_version="4" if codebook else "3", scheme=name,
        num_layers="2", num_kv_heads="2", head_dim="64"))
    cal = hf.calibration_for(name, str(tmp_path / "c.safetensors"), 2, 2, 64)
    heads = hf.Cache._heads(cache_holding([1, 0]), hf.SCHEMES[name], cal, 1, 2, 64)
    for side in (0, 1):
        tensor = hf.SCHEMES[name]["rotation"][side].split(":", 1)[1]
        assert torch.equal(heads[side]["rotation"], tensors["layers.1." + tensor][[1, 0]])


@needs_torch
def test_a_calibration_read_before_is_checked_against_the_model(tmp_path):
    """A Calibration object handed to kvq.hf (read once, shared by caches) is held to the
    model's shape as a path is: one made for 2 layers does not serve a 3-layer model."""
    config = shape_config()
    path = tq_mse_calibration(tmp_path / "t.safetensors", config)
    cal = hf.Calibration(path, 2, 2, 64)
    assert hf.calibration_for("tq_mse", cal, 2, 2, 64) is cal
    with pytest.raises(hf.SchemeError, match="2 layers x 2 KV heads x d=64, the model 3 x 2"):
        hf.calibration_for("tq_mse", cal, 3, 2, 64)


@needs_torch
@pytest.mark.parametrize("density", [None, "beta", "gaussian", "laplace"])
def test_codebook_sides_take_the_tables_the_file_records(density, tmp_path):
    """A codebook file's "codebook" (kvq calibrate --codebook) decides the tables both codebook
    sides are coded by, as BuildLayerScheme's (calib/tests/schemes_test.cc); beta without it;
    any other value is refused naming it."""
    config = shape_config()
    path = tq_mse_calibration(tmp_path / "t.safetensors", config)
    if density is not None:
        metadata, tensors = hf._read_safetensors(path)
        write_safetensors(path, tensors, dict(metadata, codebook=density))
    cal = hf.calibration_for("tq_mse", str(path), 2, 2, 64)
    if density == "laplace":
        with pytest.raises(hf.SchemeError, match="laplace"):
            hf.codebook_density(cal)
        return
    want = density or "beta"
    assert hf.codebook_density(cal) == want
    entries = parse_params(hf._scheme_params("tq_mse", 2, 4, 64, 2, 64, 64, 256, 64, 32, 128,
                                             None, None, hf.codebook_density(cal)))
    assert entries["key.codebook"] == want and entries["value.codebook"] == want
    assert hf.codebook_density(None) == "beta"
    with pytest.raises(hf.SchemeError, match="laplace"):
        hf._scheme_params("tq_mse", 2, 4, 64, 2, 64, 64, 256, 64, 32, 128, None, None, "laplace")


def cache_holding(kv_heads):
    """What Cache._heads reads of its cache: the global KV heads it holds."""
    import types
    return types.SimpleNamespace(kv_heads=kv_heads)


@needs_torch
@pytest.mark.skipif(not os.environ.get("KVQ_BINARY"), reason="KVQ_BINARY (ctest sets it) not set")
def test_a_kvq_calibrate_tq_mse_file_holds_build_layer_schemes_rotations(tmp_path):
    """End to end at the golden tq_mse case's shape (1 KV head, d = 64, layer 0, seed 0): the
    rows kvq.hf reads from a `kvq calibrate --scheme tq_mse` file (of any capture of that
    shape: the rotations depend on the seed, layer, head and side alone) are the R_K and R_V
    calib::BuildLayerScheme built for the case (its rotation fixture), bit for bit."""
    import subprocess
    binary = os.environ["KVQ_BINARY"]
    for args in (["synth", "--out", "a.safetensors", "--layers", "1", "--tokens", "64",
                  "--q-heads", "2", "--kv-heads", "1", "--head-dim", "64"],
                 ["calibrate", "--activations", "a.safetensors", "--scheme", "tq_mse",
                  "--k-bits", "2", "--out", "t.safetensors"]):
        subprocess.run([binary] + args, cwd=tmp_path, check=True, capture_output=True)
    cal = hf.calibration_for("tq_mse", str(tmp_path / "t.safetensors"), 1, 1, 64)
    assert cal.metadata["seed"] == "0"
    heads = hf.Cache._heads(cache_holding([0]), hf.SCHEMES["tq_mse"], cal, 0, 1, 64)
    from test_torch_ops import as_tensor, read_safetensors
    metadata, tensors = golden_scheme_case("tq_mse")
    assert "seed=0" in metadata["scheme_options"]
    _, fixture = read_safetensors(VECTORS / metadata["rotation_fixture"])
    for side, s in enumerate("kv"):
        index = as_tensor(tensors["in.rotation_%s_index" % s]).long()
        built = as_tensor(fixture["rotations"])[index]
        assert torch.equal(heads[side]["rotation"], built), s


@needs_torch
@pytest.mark.parametrize("other", ["oscar", "blockgtq"])
def test_tq_mse_refuses_another_schemes_calibration(other, tmp_path):  # a file of `other`
    config = shape_config()
    path = scheme_calibration(other, tmp_path / "c.safetensors", config)
    with pytest.raises(hf.SchemeError) as refused:
        hf.calibration_for("tq_mse", str(path), 2, 2, 64)
    message = str(refused.value)
    assert "'tq_mse'" in message and "'%s'" % other in message
    assert "kvq calibrate --scheme tq_mse" in message
    with pytest.raises(hf.SchemeError, match="kvq calibrate --scheme tq_mse"):
        hf.calibration_for("tq_mse", None, 2, 2, 64)


@needs_torch
@pytest.mark.parametrize("scheme", ["oscar", "blockgtq", "fp8"])
def test_other_schemes_refuse_a_tq_mse_calibration(scheme, tmp_path):
    path = tq_mse_calibration(tmp_path / "t.safetensors", shape_config())
    with pytest.raises(hf.SchemeError) as refused:
        hf.calibration_for(scheme, str(path), 2, 2, 64)
    assert "'%s'" % scheme in str(refused.value) and "'tq_mse'" in str(refused.value)


@pytest.mark.skipif(torch is None or hf.TRANSFORMERS_ERROR is not None or
                    LIBRARY_ERROR is not None,
                    reason=str(hf.TRANSFORMERS_ERROR or LIBRARY_ERROR or "no torch"))
def test_tq_mse_widths_are_the_caches_and_v_its_files(tmp_path):
    """K at the cache's `bits` (the file's rotations do not depend on it); V at value_bits, else
    the file's v_bits (kvq ppl's rule), else `bits`."""
    config = shape_config()
    config.num_attention_heads = 4

    def widths(metadata, **kw):
        path = random_calibration(tmp_path / "t.safetensors", config, 0, dict(
            metadata, format_version="4", scheme="tq_mse"))
        cache = hf.Cache("tq_mse", calibration=path, config=config, **kw)
        return re.findall(r"(key|value)\.bits=(\d+);", cache.params)
    assert widths(dict(bits="3", v_bits="2"), bits=3) == [("key", "3"), ("value", "2")]
    assert widths(dict(bits="3", v_bits="2"), bits=4, value_bits=3) == [("key", "4"),
                                                                        ("value", "3")]
    assert widths(dict(bits="3"), bits=3) == [("key", "3"), ("value", "3")]


@needs_torch
def test_a_codebook_scheme_file_without_format_version_4_is_malformed(tmp_path):
    path = random_calibration(tmp_path / "t.safetensors", shape_config(), 0, dict(
        format_version="2", scheme="tq_mse"))
    with pytest.raises(hf.SchemeError, match="format_version 2") as refused:
        hf.calibration_for("tq_mse", str(path), 2, 2, 64)
    assert refused.value.code == "malformed file"


def test_codebook_layout_restates_the_library():
    # d = 16: blocks 3, 1, 3, 8, 1, 3, 2, 3 -> widths 1 (2 blocks), 2, 3 (4), 8: four segments
    # of ceil(4*1/8) + ceil(2*2/8) + ceil(8*3/8) + ceil(2*8/8) = 1 + 1 + 3 + 2 bytes.
    assert hf.codebook_layout([3, 1, 3, 8, 1, 3, 2, 3]) == (4, 7)
    assert hf.codebook_layout([3] * 64) == (1, 48)


@needs_library
def test_codebook_rows_reach_the_c_abi():
    params = hf.cache_params_for("tq_mse_fwht", num_kv_heads=2, num_q_heads=8, head_dim=128,
                                 bits=3, value_bits=2)
    assert "key.bits=3;" in params and "value.bits=2;" in params
    assert "key.row_format=codebook;" in params and "key.group=128;" in params
    c = torch_ops._cache(params)
    assert [p[0] for p in c.planes[0]] == ["codes", "norm"]
    assert c.planes[0][0][2][-1] == 48 and c.planes[1][0][2][-1] == 32  # d*b/8 code bytes
    params = hf.cache_params_for("blockgtq", num_kv_heads=2, num_q_heads=8, head_dim=128,
                                 bits=3, value_bits=2, codebook_rows=(4, 60, 3))
    c = torch_ops._cache(params)
    assert c.planes[0][0][2][-1] == 60 and c.planes[0][1][2][-1] == 4  # code bytes, norm slots
    use = {row: u for row, _, _, u in c.heads[0]}
    assert use["widths"] != 0 and use["rotation"] == 2


def test_hf_imports_without_transformers():
    if hf.TRANSFORMERS_ERROR is None:
        pytest.skip("transformers is installed")
    with pytest.raises(ImportError, match="transformers 5.x"):
        hf.Cache("bf16")


# ---- On the GPU machine -------------------------------------------------------------------

ARCHS = ["llama", "qwen3"]


def tiny_model(arch, seed=0):
    import transformers
    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
    config = (transformers.LlamaConfig if arch == "llama" else transformers.Qwen3Config)(**common)
    torch.manual_seed(seed)
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen3ForCausalLM
    model = cls(config).to("cuda").eval()
    return model


def set_attention(model, name):
    model.set_attn_implementation(name)
    assert model.config._attn_implementation == name


def prompt(batch=1, length=40, vocab=512, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).cuda()


def step_logits(model, ids, cache, steps):
    """Prompt logits, then `steps` greedy decode steps' logits, feeding the argmax."""
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        logits = [out.logits[:, -1].float()]
        prompt_logits = out.logits.float()
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            out = model(token, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1].float())
            token = out.logits[:, -1:].argmax(-1)
    return prompt_logits, logits


@needs_device
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_cache_logits_match_dynamic_cache(arch):  # (a)
    """Tolerance: the model is fp32. DynamicCache keeps fp32 K/V; kvq's bf16 cache stores them
    rounded to bf16 (RNE, relative error <= 2^-9 each) and its decode reads q as fp32 and
    accumulates in fp32 (1e-3 relative per head against fp64 at most, kGpuAttentionTolerance).
    A 2^-9 change of every key moves each logit q.k by <= 2^-9 of |q||k| and of every value the
    output by <= 2^-9 of its scale: about 2 * 2^-9 relative per attention, two layers with
    residuals: max |logit diff| <= 4 * 2^-9 (~7.8e-3) of the largest |logit| per step. That is a
    bound on rounding, not a fitted number; a wrong row, head or position moves logits by O(1)
    of their scale. The prompt's logits are bitwise equal: its attention is transformers' sdpa
    over the same fp32 rows (kvq.hf.attention hands the prompt to sdpa_attention_forward)."""
    import transformers
    model = tiny_model(arch)
    ids = prompt(batch=2)
    set_attention(model, "sdpa")
    ref_prompt, ref = step_logits(model, ids, transformers.DynamicCache(config=model.config), 24)
    set_attention(model, hf.ATTENTION)
    cache = hf.Cache(scheme="bf16", config=model.config, max_batch_size=2, max_cache_len=128)
    got_prompt, got = step_logits(model, ids, cache, 24)
    assert torch.equal(got_prompt, ref_prompt)
    worst = 0.0
    for step, (a, b) in enumerate(zip(got, ref)):
        scale = b.abs().max().item()
        diff = (a - b).abs().max().item()
        worst = max(worst, diff / scale)
        assert diff <= 4 * 2 ** -9 * scale, (arch, step, diff, scale)
    print("%s bf16: worst step logit diff %.2e of the largest logit" % (arch, worst))


def random_calibration(path, config, seed, metadata, extra=None):
    """A kvq calibration file (spec/formats.md §5, the tensors and keys kvq.hf reads) with a
    random orthonormal R per (layer, KV head, side), then extra(layer, generator, tensors) for
    the layer's other tensors, and `metadata` beside the shape keys."""
    layers, hkv, d = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for l in range(layers):
        for s in "kv":
            q, _ = torch.linalg.qr(torch.randn(hkv, d, d, generator=g, dtype=torch.float64))
            tensors["layers.%d.%s_rotation" % (l, s)] = q.float().contiguous()
        if extra is not None:
            extra(l, g, tensors)
    metadata = dict(metadata, format="kvq-calibration", head_dim=str(d), num_layers=str(layers),
                    num_kv_heads=str(hkv), source="test_hf_cache.py")
    write_safetensors(path, tensors, metadata)
    return path


def oscar_calibration(path, config, seed=0, clip=0.95):
    """OSCAR's: a random R per (layer, KV head, side) and clip ratio `clip`: what `kvq calibrate`
    writes, minus the bases and eigenvalues the GPU schemes do not read."""
    hkv = config.num_key_value_heads

    def clips(l, g, tensors):
        for s in "kv":
            tensors["layers.%d.%s_clip" % (l, s)] = torch.full((hkv,), clip)
    return random_calibration(path, config, seed, dict(
        format_version="2", group="64", bits="2", sink="64", recent="256", scheme="oscar",
        granularity="kv_head"), clips)


def blockgtq_calibration(path, config, seed=5):
    """A codebook calibration (format_version 4) for Block-GTQ: random R_K, R_V per (layer, KV
    head) and random key widths in 1..5 per RoPE block (different segment layouts per head), V at
    2 bits. Not an allocation kvq calibrate would make: the cache reads any."""
    hkv, d = config.num_key_value_heads, config.head_dim

    def widths(l, g, tensors):
        tensors["layers.%d.k_bits" % l] = torch.randint(1, 6, (hkv, d // 2), generator=g,
                                                        dtype=torch.uint8)
    return random_calibration(path, config, seed, dict(
        format_version="4", bits="3", v_bits="2", scheme="blockgtq"), widths)


def tq_mse_calibration(path, config, seed=7):
    """A codebook calibration (format_version 4) for tq_mse: a random orthonormal R per (layer,
    KV head, side), K and V at 2 bits. What kvq calibrate --scheme tq_mse writes, except that
    its rotations are the seed's Haar matrices (which only kvq's C++ derives); the cache reads
    any."""
    return random_calibration(path, config, seed, dict(
        format_version="4", bits="2", group=str(config.head_dim), sink="64", recent="256",
        scheme="tq_mse", codebook="beta", seed=str(seed), k_segments="1", k_code_bytes="0",
        v_segments="1", v_code_bytes="0", granularity="kv_head"))


def scheme_calibration(scheme, path, config):
    """The calibration file a scheme of these tests reads, or None."""
    if scheme == "oscar":
        return oscar_calibration(path, config)
    if scheme == "blockgtq":
        return blockgtq_calibration(path, config)
    if scheme == "tq_mse":
        return tq_mse_calibration(path, config)
    return None


def write_safetensors(path, tensors, metadata):
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name, t in tensors.items():
        data = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": "U8" if t.dtype == torch.uint8 else "F32",
                        "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def pool_snapshot(cache):
    return [[p.clone() for pool in layer.pools for p in pool] for layer in cache.layers]


@needs_device
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scheme", ["oscar", "kivi", "tq_mse_fwht", "tq_mse", "blockgtq"])
def test_int2_generation_runs_and_fills_the_pools(arch, scheme, tmp_path):  # (b)
    model = tiny_model(arch)
    vocab = model.config.vocab_size
    ids = prompt(batch=2, length=200)
    new = 200  # oscar: S0 + W = 320 < 400, so history rows enter the pages while generating
    set_attention(model, "sdpa")
    with torch.no_grad():  # transformers' own: sdpa over a DynamicCache
        ref = model.generate(ids, max_new_tokens=new, do_sample=False)
    set_attention(model, hf.ATTENTION)
    cal = scheme_calibration(scheme, tmp_path / "cal.safetensors", model.config)
    cache = hf.Cache(scheme, calibration=cal, config=model.config, max_batch_size=2,
                     max_cache_len=512, bits=3 if scheme == "tq_mse_fwht" else 2)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)  # the prompt alone: pools as written
    before = pool_snapshot(cache)
    cache.reset()
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=new, do_sample=False, past_key_values=cache)
    assert got.shape == ref.shape
    tokens = got[:, ids.shape[1]:]
    assert bool(((tokens >= 0) & (tokens < vocab)).all())
    after = pool_snapshot(cache)
    changed = sum(not torch.equal(a, b) for la, lb in zip(after, before) for a, b in zip(la, lb))
    assert changed > 0, "no pool plane changed while %d tokens were appended" % new
    assert cache.get_seq_length() == ids.shape[1] + new - 1  # the last token is never fed back
    agreement = (tokens == ref[:, ids.shape[1]:]).float().mean().item()
    print("%s %s: greedy agreement with sdpa + DynamicCache %.3f over %d tokens x 2"
          % (arch, scheme, agreement, new))


@needs_device
@pytest.mark.parametrize("scheme", ["oscar", "kivi", "bf16", "tq_mse_fwht", "tq_mse",
                                    "blockgtq"])
def test_kv_head_slices_hold_the_full_cache_bytes(scheme, tmp_path):  # (d)
    """Two caches over KV heads [0, H/2) and [H/2, H), each fed its heads' K/V, hold the bytes
    of the full cache's heads: pools (plane axis 1 is the KV head), windows (axis 2). What it does
    not show: transformers' tensor-parallel loading (the ranks' K/V come from sharded
    projections, whose bf16 reductions differ from one GPU's), nor two devices."""
    model = tiny_model("llama")
    config = model.config
    hkv, d, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    cal = scheme_calibration(scheme, tmp_path / "cal.safetensors", config)
    halves = [range(0, hkv // 2), range(hkv // 2, hkv)]
    caches = [hf.Cache(scheme, calibration=cal, config=config, max_batch_size=2,
                       max_cache_len=640, kv_heads=heads) for heads in [None] + halves]
    g = torch.Generator(device="cuda").manual_seed(3)
    rows = lambda t: torch.randn(2, hkv, t, d, generator=g, device="cuda").bfloat16()
    steps = [(rows(300), rows(300))] + [(rows(1), rows(1)) for _ in range(200)]
    for k, v in steps:
        for l in range(layers):
            caches[0].update(k, v, l)
            for heads, cache in zip(halves, caches[1:]):
                cache.update(k[:, heads.start:heads.stop], v[:, heads.start:heads.stop], l)
    for l in range(layers):
        full = caches[0].layers[l]
        for heads, cache in zip(halves, caches[1:]):
            part = cache.layers[l]
            for side in (0, 1):
                for a, b in zip(full.pools[side], part.pools[side]):
                    assert a.shape[1] == hkv and b.shape[1] == len(heads), (a.shape, b.shape)
                    assert same_bytes(a[:, heads.start:heads.stop], b), (scheme, l, side)
            for a, b in zip(full.windows, part.windows):
                assert same_bytes(a[:, :, heads.start:heads.stop], b), (scheme, l)


def same_bytes(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


# ---- (f) the golden scheme cases through kvq.hf ---------------------------------------------

# kvq vectors generate cuts KIVI's flush (F = 128) to a tile so that the case's 40 tokens reach
# the history; kvq.hf.Cache takes a scheme's own F, so these cases' caches are not its.
FLUSH_OVERRIDDEN = [n for n in SERVED if golden_options(golden_scheme_case(n)[0])[1]]


def golden_calibration(path, name, metadata, tensors):
    """The case's per-head rows as a calibration file (rotations from its fixture, in.clip_*,
    in.scale_*, in.widths_k), one layer, for scheme `name`."""
    from test_torch_ops import as_tensor, read_safetensors
    hkv, d = int(metadata["num_kv_heads"]), int(metadata["key.head_dim"])
    out = {}
    for i, side in enumerate("kv"):
        if "in.rotation_%s_index" % side in tensors:  # under the tensor the scheme reads
            _, fixture = read_safetensors(VECTORS / metadata["rotation_fixture"])
            index = as_tensor(tensors["in.rotation_%s_index" % side]).long()
            tensor = hf.SCHEMES[name]["rotation"][i].split(":", 1)[1]
            out["layers.0." + tensor] = as_tensor(fixture["rotations"])[index] \
                .reshape(hkv, d, d).contiguous()
        for row, stem in (("clip", "clip"), ("scale", "scale"), ("widths", "bits")):
            if "in.%s_%s" % (row, side) in tensors:
                out["layers.0.%s_%s" % (side, stem)] = as_tensor(tensors["in.%s_%s" % (row, side)])
    codebook = "codebook" in hf.SCHEMES[name]["format"]
    meta = dict(format="kvq-calibration", format_version="4" if codebook else "2",
                scheme=name, num_layers="1", num_kv_heads=str(hkv), head_dim=str(d),
                source="golden case attention/scheme_%s" % name)
    write_safetensors(path, out, meta)
    return path


def golden_rows(name, tmp_path):
    """kvq.hf's per-head rows for the golden case of `name` at its shape: ({row: tensor} of K,
    of V), read from the case's rows written as a calibration file (None: the scheme reads
    none), and the case's metadata and tensors."""
    metadata, tensors = golden_scheme_case(name)
    hkv, d = int(metadata["num_kv_heads"]), int(metadata["key.head_dim"])
    try:
        cal = hf.calibration_for(name, None, 1, hkv, d)  # None: the scheme reads no file
    except hf.SchemeError:  # it reads one: the case's rows, as a file
        cal = hf.calibration_for(name, str(golden_calibration(
            tmp_path / "cal.safetensors", name, metadata, tensors)), 1, hkv, d)
    heads = hf.Cache._heads(cache_holding(list(range(hkv))), hf.SCHEMES[name], cal, 0, hkv, d)
    return cal, heads, metadata, tensors


@needs_torch
@pytest.mark.skipif(extension() is None, reason="the extension module kvq._kvq does not load")
@pytest.mark.parametrize("name", SERVED)
def test_golden_rows_reach_the_hf_cache_as_kvqs_cache_reads_them(name, tmp_path):
    """What (f) hands the GPU, checked here against kvq's scalar cache of the same case: every
    per-head row kvq.hf reads from the case's rows as a file (dense R of each side, clip ratios,
    fp8 scales, key widths) is the one kvq's C++ writes that case with, bit for bit, and kvq.hf
    reads none that it does not."""
    kvq = extension()
    _, heads, metadata, _ = golden_rows(name, tmp_path)
    cache = kvq.vectors.load().case("attention/scheme_" + name).cache()
    hkv = int(metadata["num_kv_heads"])
    for side, kv in enumerate(("key", "value")):
        arrays = cache.head_arrays(kv)
        ours = {row: t.reshape(hkv, -1).numpy() for row, t in heads[side].items()
                if row in ("rotation", "widths")}
        assert sorted(ours) == sorted(arrays), (kv, sorted(ours), sorted(arrays))
        for row, a in arrays.items():
            assert ours[row].dtype == a.dtype and (ours[row] == a).all(), (kv, row)
        for row, field in (("clip", "clip"), ("scale", "head_scale")):
            want = [getattr(cache.head_params(kv, h), field) for h in range(hkv)]
            got = heads[side][row].tolist() if row in heads[side] else [1.0] * hkv
            assert got == want, (kv, row)


@needs_device
@pytest.mark.parametrize("name", [n for n in SERVED if n not in FLUSH_OVERRIDDEN])
def test_golden_scheme_cases_through_the_hf_cache(name, tmp_path):  # (f)
    """The case's script (a 36-token prompt, 4 appends) through kvq.hf.Cache.update at the
    case's options, the per-head rows from a calibration file holding the case's (the
    rotations calib::BuildLayerScheme made: for tq_mse the seeded Haar matrices, which a kvq
    calibrate --scheme tq_mse file holds bit for bit), then the case's query through
    kvq.hf.attention: within the case's GPU tolerance of kvq's fp64 reference, per query head."""
    import types
    from test_torch_ops import as_tensor, relative_errors
    cal, _, metadata, tensors = golden_rows(name, tmp_path)
    options, _ = golden_options(metadata)
    hkv, hq, d = (int(metadata[k]) for k in ("num_kv_heads", "num_q_heads", "key.head_dim"))
    ops = as_tensor(tensors["in.ops"]).tolist()
    assert [op[0] for op in ops] == [0, 1, 2, 2, 2, 2] and ops[1][2] == 36, ops  # the script
    config = types.SimpleNamespace(num_hidden_layers=1, num_attention_heads=hq,
                                   num_key_value_heads=hkv, head_dim=d)
    cache = hf.Cache(name, calibration=cal, config=config, max_cache_len=40, **options)
    k = as_tensor(tensors["in.k"], "cuda").transpose(0, 1)[None]  # [1, Hkv, 40, d]
    v = as_tensor(tensors["in.v"], "cuda").transpose(0, 1)[None]
    key, _ = cache.update(k[:, :, :36], v[:, :, :36], 0)
    for t in range(36, 40):
        key, _ = cache.update(k[:, :, t:t + 1], v[:, :, t:t + 1], 0)
    q = as_tensor(tensors["in.q"], "cuda")  # [queries, Hq, d]
    dtype, shape, data = tensors["expect.reference_f64"]
    reference = torch.frombuffer(bytearray(data), dtype=torch.float64).reshape(shape[:-1]).cuda()
    module = types.SimpleNamespace(layer_idx=0)
    for j in range(q.shape[0]):
        out, _ = hf.attention(module, q[j][None, :, None, :], key, None, None,
                              scaling=cache.scaling)
        errors = relative_errors(out[0, 0], reference[j])
        assert errors.max().item() <= float(metadata["tolerance_gpu"]), (name, j, errors)


# ---- (g) a dropped cache frees its pools ----------------------------------------------------


@needs_device
def test_a_dropped_cache_frees_its_pools(tmp_path):  # (g)
    """After a prefill and a decode step through attention(), `del cache` and a collection
    return the allocator to where it was: nothing of kvq.hf (the side channel from update to
    attention included) holds the layers, so a benchmark's next cache does not sit on top of
    the previous one's pools."""
    import gc
    import transformers
    model = tiny_model("llama")
    ids = prompt(batch=1, length=200)
    set_attention(model, "sdpa")  # the process's first forward (cuBLAS' workspace), no kvq
    with torch.no_grad():
        out = model(ids, past_key_values=transformers.DynamicCache(config=model.config))
        model(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values)
    del out
    set_attention(model, hf.ATTENTION)
    cal = oscar_calibration(tmp_path / "cal.safetensors", model.config)
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    cache = hf.Cache("oscar", calibration=cal, config=model.config, max_cache_len=65536)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in cache.layers
               for t in [p for pool in layer.pools for p in pool] + list(layer.windows))
    assert torch.cuda.memory_allocated() >= before + held
    del cache, out
    gc.collect()
    torch.cuda.synchronize()
    left = torch.cuda.memory_allocated() - before
    assert left < held // 2, "%d of the cache's %d bytes still allocated" % (left, held)


# ---- (e) teacher-forced PPL against kvq ppl ---------------------------------------------------

PPL_JSON = os.environ.get("KVQ_PPL_JSON")
HF_MODEL = os.environ.get("KVQ_HF_MODEL")  # tools/train_tiny_lm.py --export-hf of model A
CALIBRATION = os.environ.get("KVQ_CALIBRATION")  # kvq ppl --save-calibration
PPL_REASON = DEVICE_REASON or (None if PPL_JSON and HF_MODEL else
                               "set KVQ_PPL_JSON (kvq ppl --json) and KVQ_HF_MODEL (an HF "
                               "export of model A) to compare perplexities")


def ppl_run():
    """kvq ppl's run in PPL_JSON: a --backend cpu file is the run itself; a --backend gpu /
    both file ("format": "kvq-ppl-gpu") holds the GPU's run under "gpu"."""
    data = json.loads(pathlib.Path(PPL_JSON).read_text())
    return data["gpu"] if data.get("format") == "kvq-ppl-gpu" else data


def ppl_rows():
    if not PPL_JSON:
        return []
    data = ppl_run()
    out = []
    for s in data["sets"]:
        for r in s["rows"]:
            scheme, _, clip = r["label"].partition("@")
            row = hf.SCHEMES.get(scheme)
            if row is None or isinstance(row, str):
                continue
            # A row whose clip ratios kvq ppl chose itself (--clip own) has none in the file.
            if row["clip"] and scheme != "oscar" and clip != "oscar":
                continue
            out.append((s["name"], r["label"]))
    return out


@pytest.mark.skipif(PPL_REASON is not None, reason=str(PPL_REASON))
@pytest.mark.parametrize("set_name,label", ppl_rows())
def test_teacher_forced_ppl_equals_kvq_ppl(set_name, label):  # (e)
    """Model A in fp32 (its int8 weights dequantized, as kvq ppl's forward), one token per
    forward from position 0 (each position's logits come from kvq's decode over the cache of
    length p + 1, as `kvq ppl --gpu-decode steps`), over the windows of kvq ppl's set. The
    projections are torch's fp32 GEMMs (TF32 off) instead of kvq's cuBLAS calls, so the two
    runs' K and V rows differ in their last bits, and the bounds are those of kvq's own CPU
    against GPU PPL check (gpu/tests/ppl_test.cc, MatchesCpuWithinTolerance): 1e-3 relative,
    and 2e-2 for a scheme whose cache quantizes the sink token (S0 = 0: kivi, saw_int4, the
    codebook schemes), where such a last-bit difference can move the attention sink's codes
    (measured on the H200, 2026-11-28, 512-token windows: windowed rows <= 3.9e-4, quantized
    sinks up to 7.8e-3)."""
    import transformers
    data = ppl_run()
    sset = next(s for s in data["sets"] if s["name"] == set_name)
    row = next(r for r in sset["rows"] if r["label"] == label)
    o = data["options"]
    torch.backends.cuda.matmul.allow_tf32 = False
    model = transformers.AutoModelForCausalLM.from_pretrained(HF_MODEL, dtype=torch.float32)
    model = model.to("cuda").eval()
    set_attention(model, hf.ATTENTION)
    windows = load_windows(sset)
    nll, count = 0.0, 0
    for w in windows:
        ids = torch.tensor(w, dtype=torch.long, device="cuda")[None]
        try:
            cache = hf.Cache(label.partition("@")[0], calibration=CALIBRATION,
                             config=model.config, max_cache_len=ids.shape[1],
                             page_size=o["page"], group=o["group"],
                             sink=o["sink"], recent=o["recent"],
                             bits=o.get("k_bits", o["bits"]), value_bits=o.get("v_bits"))
        except hf.SchemeError as e:  # e.g. fp8 with an oscar calibration (no fp8 scales)
            pytest.skip(str(e))
        with torch.no_grad():
            for p in range(ids.shape[1] - 1):
                logits = model(ids[:, p:p + 1], past_key_values=cache,
                               use_cache=True).logits[0, -1].double()
                nll -= torch.log_softmax(logits, -1)[ids[0, p + 1]].item()
                count += 1
    ppl = math.exp(nll / count)
    print("%s %s: HF path PPL %.6f, kvq ppl %.6f" % (set_name, label, ppl, row["ppl"]))
    windows = hf.SCHEMES[label.partition("@")[0]]["windows"]
    quantized_sink = windows is not None and windows[0] == 0
    assert abs(ppl / row["ppl"] - 1) <= (2e-2 if quantized_sink else 1e-3)


def load_windows(sset):
    """The token windows of a kvq ppl set: rows `windows` of the tensor named after the set in
    the model's tokens.safetensors (KVQ_TOKENS, else beside KVQ_HF_MODEL, else model A's), cut
    to the set's length."""
    path = os.environ.get("KVQ_TOKENS") or next(
        p for p in [pathlib.Path(HF_MODEL) / "tokens.safetensors",
                    ROOT / "calib" / "models" / "tiny-llama-a" / "tokens.safetensors"]
        if p.exists())
    _, tensors = hf._read_safetensors(path)
    t = tensors[sset["name"]]
    return [t[i].tolist()[:sset["length"]] for i in sset["windows"]]
