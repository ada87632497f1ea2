"""SinkLinear's input gradient through re-strided weight copies (parallel/linear_grads.py, PaddedWeights)."""

from __future__ import annotations

import torch

from lightning_shm.parallel.linear_grads import PaddedWeights


def test_a_copy_serves_until_its_weight_changes_in_place():
    """``g @ W`` through the copy equals the plain product; a weight changed in place after the copy was
    made (an optimizer step, with nobody calling clear()) gets a new copy: the old one is never read again.
    Weights the rule leaves alone take the plain product and make no copy."""
    padded = PaddedWeights()
    padded.min_numel = 0
    w, g = torch.randn(8, 2048), torch.randn(3, 5, 8)  # rows 8 KiB apart; [3, 5] rows of g
    assert padded.wanted(g, w)
    torch.testing.assert_close(padded.input_grad(g, w), g @ w, rtol=1e-5, atol=1e-5)
    assert len(padded) == 1
    copy = next(iter(padded._copies.values()))[1]
    assert copy.stride() == (2048 + 16, 1)  # 64 bytes longer rows
    with torch.no_grad():
        w.mul_(-2.0).add_(1.0)
    torch.testing.assert_close(padded.input_grad(g, w), g @ w, rtol=1e-5, atol=1e-5)
    assert len(padded) == 1
    padded.clear()
    for other_w, other_g in ((torch.randn(8, 2000), g),  # rows 8,000 bytes apart
                             (w, torch.randn(padded.max_rows + 1, 8)),  # more rows than the slow range
                             (w.double(), g.double()[:1].float())):  # dtypes differ (autocast's business)
        assert not padded.wanted(other_g, other_w)
    many = torch.randn(200, 8)
    torch.testing.assert_close(padded.input_grad(many, w), many @ w, rtol=1e-5, atol=1e-5)
    assert len(padded) == 0  # the plain product: no copy made
    assert not PaddedWeights().wanted(g, w)  # by default only weights of 2^20 elements and more
