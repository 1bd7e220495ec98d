"""Test-only write targets in PyTorch (CPU) for kvq.conformance.check (test_torch_targets.py).

    spec_torch           kvq's spec (spec/numerics.md) written again in torch: every bit
    oscar_authors_torch  the OSCAR authors' Triton write kernels' choices, as measured in
                         shared/research/outside_kernel.md: half-up codes, a 1e-8 range floor,
                         fp32 scale and zero point, a bisection clip when decode flushes
    kivi_torch           KIVI's quantizer (shared/research/outside_kivi.md): fp16 arithmetic,
                         fp16 scale and min, codes packed into int32 words in KIVI's order
    wrong_torch          spec_torch with deliberate defects: packing off by one, wrong width

None of them calls kvq: they share nothing with the oracle but the vectors they replay.
"""
