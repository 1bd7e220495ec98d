"""Attention cases replayed from Python: a decode step written in numpy against kvq.Cache's
views passes within each case's tolerance; one that forgets the softmax scale fails with kvq
conform's first-mismatch line; kvq's own attend passes every case."""
import io

import numpy as np

import kvq
from kvq.verdicts import bf16_value


class NumpyAttention:
    """Decode attention over the cache's own planes, for identity rotations without a norm:
    sink, dequantized history and recent rows in position order; softmax in float64."""
    name = "numpy_attention"

    def __init__(self, scale_logits=True):
        self.scale_logits = scale_logits

    def attend(self, cache, seq, q):
        p = cache.params
        for side in (p["key"], p["value"]):
            if side.rotation != "identity" or side.norm:
                raise NotImplementedError("rotation %s, norm %s" % (side.rotation, side.norm))
        group = p["num_q_heads"] // p["num_kv_heads"]
        out = np.empty((p["num_q_heads"], p["head_dim"]), np.float32)
        for h in range(p["num_q_heads"]):
            keys, values = (self.rows(cache, seq, h // group, kv) for kv in ("key", "value"))
            logits = keys @ q[h].astype(np.float64)
            if self.scale_logits:
                logits *= p["softmax_scale"]
            weights = np.exp(logits - logits.max())
            out[h] = (weights / weights.sum()) @ values
        return out

    @staticmethod
    def rows(cache, seq, head, kv):
        """float64 [t, d]: KV head `head`'s rows of sequence seq, positions 0..t-1."""
        parts = [bf16_value(cache.sink(seq, kv)[:, head])]
        if cache.params["quantized"]:
            parts.append(cache.dequantized_history(seq, head, kv))
        parts.append(bf16_value(cache.recent(seq, kv)[:, head]))
        return np.concatenate(parts).astype(np.float64)


def test_kvqs_attend_passes_every_attention_case(vectors):
    report = kvq.conformance.check(kvq.conformance.ORACLE, kinds=["attention"], vectors=vectors,
                                   out=None)
    assert report.results and report.passed == len(report.results), report.failures()[:3]


def test_a_numpy_decode_step_over_the_caches_views_passes(vectors):
    report = kvq.conformance.check(NumpyAttention(), kinds=["attention"], vectors=vectors,
                                   out=None)
    assert report.failed == 0, report.failures()[:3]
    identity = [r for r in report.results if r.status == "PASS"]
    assert len(identity) >= 8 and any(r.name == "attention/bf16_d64" for r in identity)
    assert any(r.message.startswith("unsupported: rotation hadamard") for r in report.results)


def test_an_unscaled_softmax_fails_with_the_first_mismatch(vectors):
    out = io.StringIO()
    report = kvq.conformance.check(NumpyAttention(scale_logits=False), kinds=["attention"],
                                   formats=["affine_token"], vectors=vectors, out=out)
    failed = [r for r in report.results if r.status == "FAIL"]
    assert failed and not any(r.status == "PASS" for r in report.results)
    assert failed[0].mismatch["output"] == "out"
    assert failed[0].message.startswith("attention output out of tolerance at row ")
    assert "> tolerance 1e-05)" in failed[0].message
    assert "[numpy_attention] FAIL %s: attention output" % failed[0].name in out.getvalue()


def test_a_cuda_target_is_held_to_the_gpu_tolerance(vectors):
    case = vectors.case("attention/bf16_d64")
    cache = case.cache()
    seq = case.query_sequence(cache, 0)
    out = kvq.attend(cache, seq, case.inputs["q"][0]) * np.float32(1 + 1e-4)
    assert case.compare_attention(0, out, case.tolerance) is not None
    assert case.compare_attention(0, out, case.tolerance_gpu) is None

    class Cuda:
        device = "cuda"

        def attend(self, cache, seq, q):
            return kvq.attend(cache, seq, q) * np.float32(1 + 1e-4)
    report = kvq.conformance.check(Cuda(), kinds=["attention"], vectors=vectors, out=None)
    assert report.failed == 0, report.failures()[:3]


def test_the_cache_exposes_its_planes_and_windows(vectors):
    case = vectors.case("attention/d64_b2_g32_dense_s4_w8_p16")
    cache = case.cache()
    p = cache.params
    seq = case.query_sequence(cache, 0)
    t = cache.length(seq)
    assert cache.sink(seq, "key").shape == (cache.sink_length(seq), p["num_kv_heads"], 64)
    assert cache.recent(seq, "value").shape == (t - cache.recent_begin(seq),
                                                p["num_kv_heads"], 64)
    assert cache.recent_begin(seq) == cache.sink_length(seq) + cache.history_length(seq)
    pool = cache.pool("key")
    assert list(pool) == [q["name"] for q in p["key"].planes]
    assert pool["codes"].shape[1:] == (p["num_kv_heads"], p["page_size"], 64 * 2 // 8)
    assert not pool["codes"].flags.writeable
    assert len(cache.page_table(seq)) * p["page_size"] >= cache.history_length(seq)
    assert cache.rotation("key", 0).shape == (64, 64)
    assert cache.dequantized_history(seq, 0, "key").shape == (cache.history_length(seq), 64)
