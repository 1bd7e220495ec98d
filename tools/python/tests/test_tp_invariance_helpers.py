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
    calls = ([numbered((2, 3, 4), torch.bfloat16, 0), numbered((2, 1, 4), torch.bfloat16, 50)],
             [numbered((2, 3, 4), torch.bfloat16, 100), numbered((2, 1, 4), torch.bfloat16, 150)])
    got = tp.input_rows({0: calls}, [2, 3])
    assert sorted(got) == sorted(tp.head_key(0, h, s, "inputs") for h in (2, 3) for s in "kv")
    for i, h in enumerate((2, 3)):
        for s, side in enumerate("kv"):
            rows = got[tp.head_key(0, h, side, "inputs")]
            assert rows.shape == (4, 4)
            assert torch.equal(rows, torch.cat([calls[s][0][i], calls[s][1][i]]))
