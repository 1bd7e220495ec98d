"""kvq.torch_ops: the torch ops over libkvq_gpu.so's C ABI.

Without torch, torch >= 2.4 or a CUDA device (the build machine) only the C ABI's queries run:
every golden cache case's pool planes have the shapes and dtypes of its expect.pool tensors,
and refusals name the offending value. On the GPU machine the ops replay the golden cache
cases' scripts (conformance/vectors/cache: the CPU oracle's pools and windows, read here with a
small safetensors reader, so the extension module is not needed) and must leave the same bytes;
decode over the replayed attention cases must hold each case's GPU tolerance against its fp64
reference (kvq.attend's oracle); a write + decode step captured in a CUDA graph replays to the
eager bits; decode_step gives the bits of write_append then decode, eagerly and in a graph; a
torch.compile'd step (fullgraph) runs and gives the eager bits; opcheck passes.
"""
import json
import os
import pathlib
import struct

import pytest

from kvq import torch_ops

VECTORS = pathlib.Path(__file__).resolve().parents[3] / "conformance" / "vectors"

try:
    torch_ops.library()
    LIBRARY_ERROR = None
except torch_ops.TorchOpError as e:  # a CPU-only build has no libkvq_gpu.so
    LIBRARY_ERROR = str(e)
needs_library = pytest.mark.skipif(LIBRARY_ERROR is not None, reason=str(LIBRARY_ERROR))

# Cache cases the CUDA decode does not serve (kvq/gpu/attention.h's list), refused at
# kvq_cache_create with the reason: a case -> a piece of its message.
REFUSED = {"w0_s3_f32_tiled_values_d64": "value format affine_tile",
           "fp8k_int4v_d256_s2_w4": "fp8",
           "d128_kb2_vb4_block32_s8_w16_p16": "value group 32 is below d*b/8 = 64",
           "saw_int4_d256_g256_w0": "key group 256"}


def read_safetensors(path):
    """(metadata, {name: (dtype, shape, bytes)}) of a safetensors file."""
    blob = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    metadata = header.pop("__metadata__", {})
    body = blob[8 + n:]
    tensors = {name: (h["dtype"], h["shape"], body[h["data_offsets"][0]:h["data_offsets"][1]])
               for name, h in header.items()}
    return metadata, tensors


CACHE_KEYS = {"num_kv_heads", "num_q_heads", "sink", "recent", "flush", "page_size", "quantized",
              "softmax_scale"}


def params_of(metadata):
    """The cache's metadata text: a case's cache keys (the same codec as kvq_cache_create's)."""
    return "".join("%s=%s;" % (k, v) for k, v in sorted(metadata.items())
                   if k in CACHE_KEYS or k.startswith(("key.", "value.")))


def cases(kind):
    return sorted(p.stem for p in (VECTORS / kind).glob("*.safetensors")
                  if not (kind == "attention" and p.stem.startswith("scheme_")))


# ---- The C ABI's queries (no device, no torch) -------------------------------------------------


@needs_library
@pytest.mark.parametrize("name", cases("cache"))
def test_pool_planes_have_the_golden_pools_shapes(name):
    metadata, tensors = read_safetensors(VECTORS / "cache" / (name + ".safetensors"))
    params = params_of(metadata)
    if name in REFUSED:
        with pytest.raises(torch_ops.TorchOpError) as refused:
            torch_ops.pool_planes(params, "key")
        assert refused.value.code == "unsupported"
        assert REFUSED[name] in str(refused.value)
        return
    names = {"U8": "uint8", "BF16": "bfloat16"}
    for side in ("key", "value"):
        planes = torch_ops.pool_planes(params, side)
        expected = {k.split(".")[-1]: v for k, v in tensors.items()
                    if k.startswith("expect.pool.%s." % side)}
        if metadata["quantized"] == "0":
            assert not expected and [p[0] for p in planes] == ["rows"]
            continue
        assert [p[0] for p in planes] == list(expected) or \
            sorted(p[0] for p in planes) == sorted(expected)
        for plane, dtype, shape in planes:
            want_dtype, want_shape, _ = expected[plane]
            assert (dtype, list(shape)) == (names[want_dtype], want_shape[1:]), (side, plane)


@needs_library
def test_refusals_name_the_value():
    good = torch_ops.cache_params(num_kv_heads=2, num_q_heads=8, head_dim=128, sink=4, recent=8,
                                  page_size=16, key=dict(rotation="dense"),
                                  value=dict(rotation="dense"))
    assert torch_ops.pool_planes(good, "value")[0][0] == "codes"
    for bad, needle, code in [
            (good.replace("key.bits=2", "key.bits=3"), "bits 3", "invalid argument"),
            (good.replace("key.head_dim=128", "key.head_dim=96"), "96", "invalid argument"),
            (good + "key.row_format=oscar_int3;", "oscar_int3", "invalid argument"),
            (good + "key.bitz=2;", "'key.bitz'", "invalid argument"),
            (good.replace("key.group=64", "key.group=32").replace("key.bits=2", "key.bits=4")
             .replace("value.group=64", "value.group=32").replace("value.bits=2", "value.bits=4"),
             "32", "unsupported")]:
        with pytest.raises(torch_ops.TorchOpError) as refused:
            torch_ops.pool_planes(bad, "key")
        assert needle in str(refused.value)
        assert refused.value.code == code
    with pytest.raises(torch_ops.TorchOpError, match="side 'both'"):
        torch_ops.pool_planes(good, "both")


# ---- The ops on the device ------------------------------------------------------------------

torch = torch_ops.torch
DEVICE_REASON = (LIBRARY_ERROR or ("no torch" if torch is None else
                 "torch %s has no torch.library.custom_op (>= 2.4)" % torch.__version__
                 if not torch_ops.registered() else
                 None if torch.cuda.is_available() else "no CUDA device"))
needs_device = pytest.mark.skipif(DEVICE_REASON is not None, reason=str(DEVICE_REASON))

_DTYPES = {"BF16": "bfloat16", "F32": "float32", "I32": "int32", "U8": "uint8"}


def as_tensor(entry, device="cpu"):
    dtype, shape, data = entry
    t = torch.frombuffer(bytearray(data), dtype=getattr(torch, _DTYPES[dtype])) if data else \
        torch.empty(0, dtype=getattr(torch, _DTYPES[dtype]))
    return t.reshape(shape).to(device)


class Replay:
    """A cache case's script run through the ops: kvq's page allocation (a page when the history
    reaches it, the most recently freed first), freed pages zeroed as the CPU cache zeroes them."""

    def __init__(self, kind, name):
        self.metadata, self.tensors = read_safetensors(VECTORS / kind / (name + ".safetensors"))
        self.params = params_of(self.metadata)
        c = torch_ops._cache(self.params)
        self.dims = c.dims
        self.quantized = self.dims["quantized"] == 1
        hkv, d, page = self.dims["num_kv_heads"], self.dims["head_dim"], self.dims["page_size"]
        self.heads = [self._heads(side, c.heads[i]) for i, side in enumerate("kv")]
        ops = as_tensor(self.tensors["in.ops"]).tolist()
        self.k = as_tensor(self.tensors["in.k"], "cuda").reshape(-1, hkv, d)
        self.v = as_tensor(self.tensors["in.v"], "cuda").reshape(-1, hkv, d)
        # Bookkeeping first (the pool's size), then the writes.
        self.lengths, self.tables, free, pages, steps, row = {}, {}, [], 0, [], 0
        for code, slot, tokens in ops:
            if code == 0:
                self.lengths[slot], self.tables[slot] = 0, []
            elif code == 3:
                steps.append(("remove", slot, list(self.tables[slot]), 0, 0))
                free.extend(self.tables[slot])
                self.tables[slot] = None
            else:
                t0 = self.lengths[slot]
                self.lengths[slot] = t0 + tokens
                need = -(-self.history(t0 + tokens) // page)
                while len(self.tables[slot]) < need:
                    if free:
                        self.tables[slot].append(free.pop())
                    else:
                        self.tables[slot].append(pages)
                        pages += 1
                steps.append(("write", slot, list(self.tables[slot]), t0, tokens, row))
                row += tokens
        self.pages = max(pages, 1)
        self.slots = len(self.lengths)
        self.pools = torch_ops.allocate_pools(self.params, self.pages)
        self.windows = torch_ops.allocate_windows(self.params, self.slots)
        self.flags = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.dense = {}  # bf16 cache: each slot's rows
        for step in steps:
            if step[0] == "remove":
                for pool in self.pools:
                    for plane in pool:
                        plane[step[2]] = 0
            else:
                self._write(*step[1:])
        torch.cuda.synchronize()
        assert self.flags.item() == 0, name

    def history(self, t):
        if not self.quantized:
            return 0
        s0, w, f = self.dims["sink"], self.dims["recent"], self.dims["flush"]
        return f * (max(0, t - s0 - w) // f)

    def _heads(self, side, spec):
        hkv, d = self.dims["num_kv_heads"], self.dims["head_dim"]
        rows = {}
        fixture = self.metadata.get("rotation_fixture")
        if fixture and "in.rotation_%s_index" % side in self.tensors:
            _, fx = read_safetensors(VECTORS / fixture)
            matrices = as_tensor(fx["rotations"])
            index = as_tensor(self.tensors["in.rotation_%s_index" % side]).long()
            rows["rotation"] = matrices[index].reshape(hkv, d, d).contiguous().cuda()
        for row in (r[0] for r in spec if r[0] != "rotation"):  # clip, scale, codebook widths
            if "in.%s_%s" % (row, side) in self.tensors:
                rows[row] = as_tensor(self.tensors["in.%s_%s" % (row, side)], "cuda")
        required = {r[0] for r in spec if r[3] == 2}
        if "scale" in required and "scale" not in rows:  # every head at the side's head_scale
            prefix = "key." if side == "k" else "value."
            rows["scale"] = torch.full((hkv,), float(self.metadata.get(prefix + "head_scale", 1)),
                                       dtype=torch.float32, device="cuda")
        return rows

    def _write(self, slot, table, t0, tokens, row):
        k, v = self.k[row:row + tokens], self.v[row:row + tokens]
        if not self.quantized:
            self.dense.setdefault(slot, []).append((k, v))
            return
        tables = torch.tensor(table or [0], dtype=torch.int32, device="cuda")
        if t0 == 0:
            torch_ops.write_prefill(self.params, k.contiguous(), v.contiguous(),
                                    tables[:len(table)], *self.heads, *self.pools,
                                    *self.windows, slot=slot, error_flags=self.flags)
            return
        windows = [w[slot:slot + 1] for w in self.windows]
        for i in range(tokens):  # a chunk of a longer sequence: one append per token
            torch_ops.write_append(self.params, k[i:i + 1].contiguous(), v[i:i + 1].contiguous(),
                                   torch.tensor([t0 + i], dtype=torch.int32, device="cuda"),
                                   tables.reshape(1, -1), *self.heads, *self.pools, *windows,
                                   error_flags=self.flags)


def same_bytes(a, b):
    return torch.equal(a.contiguous().view(torch.uint8).flatten().cpu(),
                       b.contiguous().view(torch.uint8).flatten().cpu())


@needs_device
@pytest.mark.parametrize("name", [n for n in cases("cache") if n not in REFUSED])
def test_ops_write_the_golden_pools(name):
    metadata, _ = read_safetensors(VECTORS / "cache" / (name + ".safetensors"))
    if metadata["quantized"] == "0":
        p = params_of(metadata)
        pools = torch_ops.allocate_pools(p, 1)
        windows = torch_ops.allocate_windows(p, 1)
        rows = torch.zeros(4, 2, 64, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(torch_ops.TorchOpError, match="bf16 baseline cache has no kvq write"):
            torch_ops.write_prefill(p, rows, rows, torch.zeros(1, dtype=torch.int32,
                                                               device="cuda"),
                                    None, None, *pools, *windows)
        return
    r = Replay("cache", name)
    expected_pages = as_tensor(r.tensors["expect.pool_pages"]).tolist()[0]
    assert r.pages == max(expected_pages, 1)
    for side, pool in zip(("key", "value"), r.pools):
        for (plane, _, _), t in zip(torch_ops.pool_planes(r.params, side), pool):
            want = as_tensor(r.tensors["expect.pool.%s.%s" % (side, plane)])
            assert same_bytes(t[:want.shape[0]], want), (name, side, plane)
    ring_slots = r.dims["ring_slots"]
    for key in [k for k in r.tensors if k.endswith(".shape") and k.startswith("expect.seq")]:
        slot = int(key[len("expect.seq"):-len(".shape")])
        length, sink_rows, _, first_recent = as_tensor(r.tensors[key]).tolist()
        for i, side in enumerate(("key", "value")):
            sink = r.windows[i][slot, :sink_rows]
            recent = torch.stack([r.windows[2 + i][slot, p % ring_slots]
                                  for p in range(first_recent, length)]) \
                if length > first_recent else r.windows[2 + i][slot, :0]
            assert same_bytes(sink, as_tensor(r.tensors["expect.seq%d.sink.%s" % (slot, side)]))
            assert same_bytes(recent,
                              as_tensor(r.tensors["expect.seq%d.recent.%s" % (slot, side)]))


def relative_errors(out, reference):
    """Per query head: max_j |out - ref| / max_j |ref| (spec/cache.md §5)."""
    diff = (out.double() - reference).abs().amax(dim=-1)
    return diff / reference.abs().amax(dim=-1)


@needs_device
@pytest.mark.parametrize("name", [n for n in cases("attention") if n not in REFUSED])
def test_decode_holds_the_gpu_tolerance(name):
    r = Replay("attention", name)
    q = as_tensor(r.tensors["in.q"], "cuda")
    slots = as_tensor(r.tensors["in.query_slots"]).tolist()
    dtype, shape, data = r.tensors["expect.reference_f64"]
    reference = torch.frombuffer(bytearray(data), dtype=torch.float64).reshape(shape[:-1]).cuda()
    tolerance = float(r.metadata["tolerance_gpu"])
    hkv, d, page = r.dims["num_kv_heads"], r.dims["head_dim"], r.dims["page_size"]
    for j, slot in enumerate(slots):
        length = r.lengths[slot]
        if r.quantized:
            pools, windows = r.pools, [w[slot:slot + 1] for w in r.windows]
            table = r.tables[slot] or [0]
        else:  # the bf16 cache: its rows paged here, pages 0 .. n - 1
            k = torch.cat([kv[0] for kv in r.dense[slot]])
            v = torch.cat([kv[1] for kv in r.dense[slot]])
            n = -(-length // page)
            pools = torch_ops.allocate_pools(r.params, n)
            for plane, rows in ((pools[0][0], k), (pools[1][0], v)):
                padded = torch.zeros(n * page, hkv, d, dtype=torch.bfloat16, device="cuda")
                padded[:length] = rows
                plane.copy_(padded.reshape(n, page, hkv, d).transpose(1, 2))
            windows = torch_ops.allocate_windows(r.params, 1)
            table = list(range(n))
        workspace = torch_ops.allocate_workspace(r.params, 1, length)
        out = torch_ops.decode(r.params, q[j:j + 1].contiguous(),
                               torch.tensor([length], dtype=torch.int32, device="cuda"),
                               torch.tensor([table], dtype=torch.int32, device="cuda"), length,
                               *r.heads, *pools, *windows, workspace)
        errors = relative_errors(out[0], reference[j])
        assert errors.max().item() <= tolerance, (name, j, errors.max().item())


def step_fixture(batch=3, steps=20):
    """An OSCAR-like INT2 cache (dense rotations, sink 4, window 8, pages of 16) with `batch`
    sequences prefilled to different lengths, and the rows of `steps` decode steps."""
    gen = torch.Generator(device="cpu").manual_seed(7)
    params = torch_ops.cache_params(num_kv_heads=2, num_q_heads=8, head_dim=128, sink=4,
                                    recent=8, page_size=16,
                                    key=dict(rotation="dense", clip=0.96),
                                    value=dict(rotation="dense", clip=0.92))
    heads = []
    for _ in range(2):
        q, _ = torch.linalg.qr(torch.randn(2, 128, 128, generator=gen, dtype=torch.float64))
        heads.append({"rotation": q.float().contiguous().cuda()})
    max_pages = 8
    pools = torch_ops.allocate_pools(params, batch * max_pages)
    windows = torch_ops.allocate_windows(params, batch)
    tables = torch.arange(batch * max_pages, dtype=torch.int32).flip(0).reshape(batch, -1).cuda()
    lengths = [5, 30, 61][:batch]
    for b, t in enumerate(lengths):
        k = torch.randn(t, 2, 128, generator=gen).bfloat16().cuda()
        v = torch.randn(t, 2, 128, generator=gen).bfloat16().cuda()
        torch_ops.write_prefill(params, k, v, tables[b].contiguous(), *heads, *pools, *windows,
                                slot=b)
    rows = [(torch.randn(batch, 2, 128, generator=gen).bfloat16().cuda(),
             torch.randn(batch, 2, 128, generator=gen).bfloat16().cuda(),
             torch.randn(batch, 8, 128, generator=gen).cuda()) for _ in range(steps)]
    state = dict(pools=pools, windows=list(windows),
                 lengths=torch.tensor(lengths, dtype=torch.int32, device="cuda"))
    return params, heads, tables, state, rows, max(lengths) + steps + 1


def clone_state(state):
    return dict(pools=tuple([p.clone() for p in pool] for pool in state["pools"]),
                windows=[w.clone() for w in state["windows"]], lengths=state["lengths"].clone())


def run_step(params, heads, tables, state, key, value, q, workspace, max_len):
    """One decode step through the torch ops: append, advance, decode."""
    torch.ops.kvq.write_append(params, key, value, state["lengths"], tables,
                               torch_ops._head_list(heads[0]), torch_ops._head_list(heads[1]),
                               state["pools"][0], state["pools"][1], *state["windows"], None)
    state["lengths"].add_(1)
    return torch.ops.kvq.decode(params, q, state["lengths"], tables, max_len,
                                torch_ops._head_list(heads[0]), torch_ops._head_list(heads[1]),
                                state["pools"][0], state["pools"][1], *state["windows"],
                                workspace)


def assert_same_state(a, b):
    for pa, pb in zip(a["pools"], b["pools"]):
        for x, y in zip(pa, pb):
            assert same_bytes(x, y)
    for x, y in zip(a["windows"], b["windows"]):
        assert same_bytes(x, y)
    assert torch.equal(a["lengths"], b["lengths"])


@needs_device
def test_cuda_graph_replays_the_eager_bits():
    params, heads, tables, state, rows, max_len = step_fixture()
    workspace = torch_ops.allocate_workspace(params, 3, max_len)
    eager, graphed = clone_state(state), clone_state(state)
    static_k, static_v, static_q = [x.clone() for x in rows[0]]
    warm = clone_state(state)  # a first run off the captured tensors (lazy initialisation)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_step(params, heads, tables, warm, static_k, static_v, static_q, workspace, max_len)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run_step(params, heads, tables, graphed, static_k, static_v, static_q,
                              workspace, max_len)
    for key, value, q in rows:  # crosses a demotion into the pages for every sequence
        want = run_step(params, heads, tables, eager, key, value, q, workspace, max_len)
        static_k.copy_(key)
        static_v.copy_(value)
        static_q.copy_(q)
        graph.replay()
        torch.cuda.synchronize()
        assert same_bytes(static_out, want)
        assert torch.isfinite(want).all()
    assert_same_state(eager, graphed)


def run_decode_step(params, heads, tables, state, key, value, q, workspace, max_len):
    """The same step through torch.ops.kvq.decode_step (lengths before, seq_lens after)."""
    after = state["lengths"] + 1
    out = torch.ops.kvq.decode_step(params, key, value, state["lengths"], q, after, tables,
                                    max_len, torch_ops._head_list(heads[0]),
                                    torch_ops._head_list(heads[1]), state["pools"][0],
                                    state["pools"][1], *state["windows"], workspace, None)
    state["lengths"].add_(1)
    return out


@needs_device
def test_decode_step_gives_the_bits_of_append_then_decode():
    """decode_step (each kernel launched while the one before it runs) leaves the
    cache and the output of write_append then decode, bit for bit, over steps that demote into
    the pages of every sequence; eagerly and replayed from a captured CUDA graph."""
    params, heads, tables, state, rows, max_len = step_fixture()
    workspace = torch_ops.allocate_workspace(params, 3, max_len)
    apart, fused, graphed = clone_state(state), clone_state(state), clone_state(state)
    static_k, static_v, static_q = [x.clone() for x in rows[0]]
    warm = clone_state(state)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_decode_step(params, heads, tables, warm, static_k, static_v, static_q, workspace,
                        max_len)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run_decode_step(params, heads, tables, graphed, static_k, static_v,
                                     static_q, workspace, max_len)
    for key, value, q in rows:
        want = run_step(params, heads, tables, apart, key, value, q, workspace, max_len)
        got = run_decode_step(params, heads, tables, fused, key, value, q, workspace, max_len)
        assert same_bytes(got, want)
        static_k.copy_(key)
        static_v.copy_(value)
        static_q.copy_(q)
        graph.replay()
        torch.cuda.synchronize()
        assert same_bytes(static_out, want)
    assert_same_state(apart, fused)
    assert_same_state(apart, graphed)


@needs_device
def test_decode_step_refuses_what_its_halves_refuse():
    params, heads, tables, state, rows, max_len = step_fixture(steps=1)
    workspace = torch_ops.allocate_workspace(params, 3, max_len)
    key, value, q = rows[0]

    def step(key, seq_lens):
        torch_ops.decode_step(params, key, value, state["lengths"], q, seq_lens, tables, max_len,
                              *heads, *state["pools"], *state["windows"], workspace)

    with pytest.raises(torch_ops.TorchOpError, match="seq_lens"):
        step(key, state["lengths"][:2])
    with pytest.raises(torch_ops.TorchOpError, match="key"):
        step(key.float(), state["lengths"] + 1)


@needs_device
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_gives_the_eager_bits(backend):
    params, heads, tables, state, rows, max_len = step_fixture(steps=3)
    workspace = torch_ops.allocate_workspace(params, 3, max_len)
    eager, compiled = clone_state(state), clone_state(state)
    step = torch.compile(run_step, fullgraph=True, backend=backend)
    for key, value, q in rows:
        want = run_step(params, heads, tables, eager, key, value, q, workspace, max_len)
        got = step(params, heads, tables, compiled, key, value, q, workspace, max_len)
        assert same_bytes(got, want)
    assert_same_state(eager, compiled)


@needs_device
def test_opcheck():
    params, heads, tables, state, rows, max_len = step_fixture(steps=1)
    workspace = torch_ops.allocate_workspace(params, 3, max_len)
    key, value, q = rows[0]
    h = [torch_ops._head_list(x) for x in heads]
    torch.library.opcheck(torch.ops.kvq.write_append.default,
                          (params, key, value, state["lengths"], tables, h[0], h[1],
                           state["pools"][0], state["pools"][1], *state["windows"], None))
    torch.library.opcheck(torch.ops.kvq.decode.default,
                          (params, q, state["lengths"] + 1, tables, max_len, h[0], h[1],
                           state["pools"][0], state["pools"][1], *state["windows"], workspace))
    torch.library.opcheck(torch.ops.kvq.decode_step.default,
                          (params, key, value, state["lengths"], q, state["lengths"] + 1, tables,
                           max_len, h[0], h[1], state["pools"][0], state["pools"][1],
                           *state["windows"], workspace, None))


@needs_device
def test_ops_refuse_bad_tensors():
    params, heads, tables, state, rows, max_len = step_fixture(steps=1)
    key, value, q = rows[0]
    with pytest.raises(torch_ops.TorchOpError, match="key has dtype torch.float32"):
        torch_ops.write_append(params, key.float(), value, state["lengths"], tables, *heads,
                               *state["pools"], *state["windows"])
    with pytest.raises(torch_ops.TorchOpError, match=r"lengths has shape \[2\]"):
        torch_ops.write_append(params, key, value, state["lengths"][:2], tables, *heads,
                               *state["pools"], *state["windows"])
    with pytest.raises(torch_ops.TorchOpError, match="key_heads: row 'rotation' is required"):
        torch_ops.write_append(params, key, value, state["lengths"], tables, None, heads[1],
                               *state["pools"], *state["windows"])
    with pytest.raises(torch_ops.TorchOpError, match="workspace of 256 bytes"):
        torch_ops.decode(params, q, state["lengths"], tables, max_len, *heads, *state["pools"],
                         *state["windows"], torch.empty(256, dtype=torch.uint8, device="cuda"))
