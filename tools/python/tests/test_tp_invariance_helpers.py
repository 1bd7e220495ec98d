"""tools/python/tp_invariance.py's pure helpers, on the CPU (no GPU, no transformers): the head
range of a rank, the from_pretrained arguments per transformers version, the per-head byte
layout of a layer's pools and windows, and the merge of the ranks' dumps."""
import importlib.util
import pathlib

import pytest

torch = pytest.importorskip("torch")

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "tp_invariance.py"


def load_script():
    spec = importlib.util.spec_from_file_location("tp_invariance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tp = load_script()


def test_ranks_hold_contiguous_equal_blocks_of_heads():
    assert [list(tp.rank_kv_heads(4, r, 2)) for r in range(2)] == [[0, 1], [2, 3]]
    assert [list(tp.rank_kv_heads(8, r, 4)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert list(tp.rank_kv_heads(4, 0, 1)) == [0, 1, 2, 3]
    every = [h for r in range(4) for h in tp.rank_kv_heads(8, r, 4)]
    assert every == list(range(8))


@pytest.mark.parametrize("heads,rank,world", [(6, 0, 4), (4, 2, 2), (4, -1, 2), (4, 0, 0)])
def test_a_head_split_that_does_not_fit_is_refused(heads, rank, world):
    with pytest.raises(ValueError):
        tp.rank_kv_heads(heads, rank, world)


def test_tp_arguments_follow_the_transformers_version():
    class FakeDistributedConfig:
        def __init__(self, tp_plan):
            self.tp_plan = tp_plan

    assert tp.tp_load_kwargs(1, "5.18.0", FakeDistributedConfig) == {}
    assert tp.tp_load_kwargs(2, "5.17.0", FakeDistributedConfig) == {"tp_plan": "auto"}
    assert tp.tp_load_kwargs(2, "4.57.1", None) == {"tp_plan": "auto"}
    for version in ("5.18.0", "5.18.0.dev0", "6.0.0"):
        got = tp.tp_load_kwargs(2, version, FakeDistributedConfig)
        assert list(got) == ["distributed_config"] and got["distributed_config"].tp_plan == "auto"
    with pytest.raises(RuntimeError, match="5.18.0"):
        tp.tp_load_kwargs(2, "5.18.0", None)


def test_head_keys_round_trip():
    key = tp.head_key(3, 11, "v", "pool.codes")
    assert key == "layers.3.heads.11.v.pool.codes"
    assert tp.parse_head_key(key) == (3, 11, "v", "pool.codes")
    assert tp.parse_head_key("argmax") is None


def numbered(shape, dtype, offset):
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n) + offset).reshape(shape).to(dtype)


def test_head_bytes_take_each_heads_pages_in_sequence_order():
    """Two local heads (global 5 and 7), a u8 and a bf16 plane per side, 4 pages of which the
    sequence uses pages 2 then 0; the windows hold 3 sink and 2 recent rows of d = 4."""
    kv_heads = [5, 7]
    pools = ([numbered((4, 2, 3, 8), torch.uint8, 0), numbered((4, 2, 3, 2), torch.bfloat16, 1)],
             [numbered((4, 2, 3, 8), torch.uint8, 100), numbered((4, 2, 3, 2), torch.bfloat16,
                                                                 200)])
    names = (["codes", "scale"], ["codes", "scale"])
    windows = [numbered((2, s, 2, 4), torch.bfloat16, 10 * j) for j, s in enumerate((3, 3, 2, 2))]
    pages = torch.tensor([2, 0])
    got = tp.head_bytes(1, kv_heads, names, pools, windows, pages)
    expected_keys = {tp.head_key(1, h, side, what) for h in kv_heads for side in "kv"
                     for what in ("pool.codes", "pool.scale", "window.sink", "window.recent")}
    assert set(got) == expected_keys
    for i, h in enumerate(kv_heads):
        for s, side in enumerate("kv"):
            for plane, name in zip(pools[s], names[s]):
                want = torch.cat([plane[2, i].reshape(-1), plane[0, i].reshape(-1)])
                assert torch.equal(got[tp.head_key(1, h, side, "pool." + name)],
                                   want.contiguous().view(torch.uint8).reshape(-1))
            for j, name in ((s, "sink"), (2 + s, "recent")):
                want = windows[j][0, :, i].contiguous().view(torch.uint8).reshape(-1)
                assert torch.equal(got[tp.head_key(1, h, side, "window." + name)], want)
    assert all(t.dtype == torch.uint8 and t.dim() == 1 for t in got.values())
    # Every entry owns its memory (safetensors refuses shared storage).
    storage = lambda t: t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    pointers = [storage(t).data_ptr() for t in got.values()]
    assert len(set(pointers)) == len(pointers)


def test_head_bytes_leave_out_empty_windows_and_refuse_a_wrong_head_count():
    pools = ([torch.zeros(2, 3, 4, 8, dtype=torch.bfloat16)],
             [torch.zeros(2, 3, 4, 8, dtype=torch.bfloat16)])
    empty = [torch.zeros(1, 0, 3, 8, dtype=torch.bfloat16)] * 4  # a bf16 cache has no windows
    got = tp.head_bytes(0, [0, 1, 2], (["rows"], ["rows"]), pools, empty, torch.tensor([0]))
    assert sorted(got) == sorted(tp.head_key(0, h, s, "pool.rows") for h in range(3) for s in "kv")
    assert all(t.numel() == 4 * 8 * 2 for t in got.values())
    with pytest.raises(ValueError, match="3 heads"):
        tp.head_bytes(0, [0, 1], (["rows"], ["rows"]), pools, empty, torch.tensor([0]))


def test_merge_refuses_a_head_held_twice_and_keeps_the_first_argmax():
    a = {tp.head_key(0, 0, "k", "inputs"): torch.zeros(1), "argmax": torch.tensor([1])}
    b = {tp.head_key(0, 1, "k", "inputs"): torch.ones(1), "argmax": torch.tensor([2])}
    merged = tp.merge_ranks([a, b])
    assert sorted(merged) == sorted(set(a) | set(b)) and merged["argmax"].tolist() == [1]
    with pytest.raises(ValueError, match="two ranks"):
        tp.merge_ranks([a, dict(a)])


def test_input_rows_concatenate_the_calls_per_global_head():
    # The prompt's rows arrive as a non-contiguous view (../shared/research/hf_probe.md,
    # trap 2).
    prompt_k = numbered((3, 2, 4), torch.bfloat16, 0).transpose(0, 1)
    calls = ([prompt_k, numbered((2, 1, 4), torch.bfloat16, 50)],
             [numbered((2, 3, 4), torch.bfloat16, 100), numbered((2, 1, 4), torch.bfloat16, 150)])
    got = tp.input_rows({0: calls}, [2, 3])
    assert sorted(got) == sorted(tp.head_key(0, h, s, "inputs") for h in (2, 3) for s in "kv")
    for i, h in enumerate((2, 3)):
        for s, side in enumerate("kv"):
            rows = got[tp.head_key(0, h, side, "inputs")]
            assert rows.shape == (4, 4)
            assert rows.is_contiguous()
            assert torch.equal(rows, torch.cat([calls[s][0][i], calls[s][1][i]]))


class FakeLayer:
    """What cache_head_bytes and record_inputs read of a kvq.hf.Layer: bf16 pools of one
    "rows" plane [pages, Hkv, P, d], empty windows, page tables, the length."""

    def __init__(self, hkv, d=4, page=2, pages=3):
        self.params, self.dims = "fake", {"page_size": page}
        self.pools = ([torch.zeros(pages, hkv, page, d, dtype=torch.bfloat16)],
                      [torch.zeros(pages, hkv, page, d, dtype=torch.bfloat16)])
        self.windows = [torch.zeros(1, 0, hkv, d, dtype=torch.bfloat16)] * 4
        self.tables = torch.tensor([[2, 0, 1]], dtype=torch.int32)
        self.length, self.is_initialized, self.calls = 0, True, []

    def history_tokens(self, t):
        return t

    def update(self, key_states, value_states, *args, **kwargs):
        """Writes row t of head i to pool page tables[0][t // P], slot t % P (the bf16 cache)."""
        self.calls.append((key_states.shape[2], args, kwargs))
        for t in range(key_states.shape[2]):
            pos = self.length + t
            page, slot = int(self.tables[0, pos // 2]), pos % 2
            self.pools[0][0][page, :, slot] = key_states[0, :, t]
            self.pools[1][0][page, :, slot] = value_states[0, :, t]
        self.length += key_states.shape[2]
        return key_states, value_states


class FakeCache:
    def __init__(self, kv_heads, layers=2):
        self.kv_heads = list(kv_heads)
        self.layers = [FakeLayer(len(self.kv_heads)) for _ in range(layers)]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)


def test_a_recorded_and_replayed_cache_holds_the_same_bytes_per_head(monkeypatch):
    """The GPU path's wiring, with fakes for the kvq.hf.Cache: record_inputs keeps what two
    "ranks" (heads [0, 2) and [2, 4)) are handed, replay() feeds the gathered rows to one
    cache over all 4 heads in a prompt update and one-row updates, and cache_head_bytes reads
    the used pages in sequence order; every head's bytes then agree."""
    from kvq import torch_ops
    monkeypatch.setattr(torch_ops, "pool_planes", lambda params, side: [("rows", "bfloat16",
                                                                         None)])
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 4, 5, 4, generator=g).bfloat16()
    v = torch.randn(1, 4, 5, 4, generator=g).bfloat16()
    dumps = []
    for heads in (range(0, 2), range(2, 4)):
        cache = FakeCache(heads)
        records = tp.record_inputs(cache)
        for l in range(2):
            for a, b in ((0, 3), (3, 4), (4, 5)):
                cache.update(k[:, heads.start:heads.stop, a:b],
                             v[:, heads.start:heads.stop, a:b], l, "extra", flag=1)
        assert cache.layers[0].calls[0] == (3, ("extra",), {"flag": 1})
        dump = {key: t for key, t in tp.cache_head_bytes(cache).items()}
        dump.update(tp.input_rows(records, heads))
        dumps.append(dump)
    merged = tp.merge_ranks(dumps)

    class Config:
        num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim = 2, 8, 4, 4
    built = []
    monkeypatch.setattr(tp, "build_cache", lambda *a: built.append(a) or FakeCache(range(4)))
    full = tp.replay("bf16", None, Config(), merged, 3, 8, "cpu")
    assert len(built) == 1 and built[0][:2] == ("bf16", None) and built[0][3:] == (None, 8)
    assert [c[0] for c in full.layers[1].calls] == [3, 1, 1]
    replayed = tp.cache_head_bytes(full)
    assert set(replayed) == {key for key in merged if not key.endswith(".inputs")}
    for key, value in replayed.items():
        assert torch.equal(value, merged[key]), key
    # Pages 2 and 0 hold the 4 rows of positions 0..3 and page 1 the fifth: 3 pages are used.
    assert replayed[tp.head_key(0, 3, "k", "pool.rows")].numel() == 3 * 2 * 4 * 2


def test_calibration_spec_gives_each_scheme_its_file():
    tp = load_script()
    assert tp.calibration_for(None, "oscar") is None
    assert tp.calibration_for("/c/all.safetensors", "blockgtq") == "/c/all.safetensors"
    spec = "oscar=/c/oscar.safetensors,blockgtq=/c/b=1.safetensors"
    assert tp.calibration_for(spec, "oscar") == "/c/oscar.safetensors"
    assert tp.calibration_for(spec, "blockgtq") == "/c/b=1.safetensors"
    assert tp.calibration_for(spec, "kivi") is None
