"""The LRMoE layer in deterministic mode: its backward does not depend on the order in which
the kept rows reach the token gradient.

The permutation is applied where the order could vary: the rows handed to the token
gradient's scatter-add (on a GPU their arrival and the atomics' order), here shuffled on
the way in. Oracle: the same layer's unshuffled backward (bitwise), and the layer with
the mode off (bitwise on the CPU, where both sum in pair order; its drop gradients are
checked against a dense reference in test_lrmoe_layer.py). Megatron's flag
(``config.deterministic_mode``) and torch's (``use_deterministic_algorithms``) each turn
the mode on.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from tests.layer.test_lrmoe_layer import _build, _inputs, _run

TOPK = {"moe_router_topk": 4}    # several kept rows per token: fp32 sums that round


def _shuffled(real, seed: int):
    """scatter_add_rows with its rows (index, src, scale, key) permuted on the way in."""
    g = torch.Generator().manual_seed(seed)

    def call(out, index, src, scale=None, backend="auto", *, key=None, deterministic=None):
        perm = torch.randperm(index.shape[0], generator=g)
        return real(out, index[perm], src[perm], None if scale is None else scale[perm],
                    backend, key=None if key is None else key[perm],
                    deterministic=deterministic)

    return call


def _backward_under_shuffle(ep: int, deterministic: bool, flag: str):
    """(plain, shuffled) results of one layer: (out, dx, parameter grads), and what the
    region was told."""
    from megatron_lrmoe.layer import region

    _, lrmoe = _build(ep, 0.5, selection="topk", aux=0.0, router=TOPK)
    if flag == "megatron":
        lrmoe.config.deterministic_mode = deterministic
    x, dy = _inputs(32)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic and flag == "torch")
    told = []
    real = region.scatter_add_rows

    def spy(*args, **kwargs):
        told.append(kwargs["deterministic"])
        return real(*args, **kwargs)

    try:
        with mock.patch.object(region, "scatter_add_rows", spy):
            plain = _run(lrmoe, x, dy)
        lrmoe.zero_grad()
        with mock.patch.object(region, "scatter_add_rows", _shuffled(spy, seed=7)):
            shuffled = _run(lrmoe, x, dy)
    finally:
        torch.use_deterministic_algorithms(before)
    return plain, shuffled, told, lrmoe.lrmoe_stats.calls[-1].retained_pairs


def _equal(a, b) -> bool:
    out_a, dx_a, grads_a = a
    out_b, dx_b, grads_b = b
    return (torch.equal(out_a, out_b) and torch.equal(dx_a, dx_b)
            and grads_a.keys() == grads_b.keys()
            and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a))


@pytest.mark.parametrize("flag", ["megatron", "torch"])
def test_deterministic_backward_is_bitwise_under_a_shuffle(gloo2, flag):
    for plain, shuffled, told, retained in gloo2.run(_backward_under_shuffle, 2, True, flag):
        assert told == [True, True]
        assert retained > 0
        assert _equal(plain, shuffled)


def test_the_shuffle_changes_bits_with_the_mode_off(gloo2):
    """The test above has teeth: off, the CPU sums in the order the rows come."""
    results = gloo2.run(_backward_under_shuffle, 2, False, "megatron")
    for _, _, told, _ in results:
        assert told == [False, False]
    assert not all(torch.equal(plain[1], shuffled[1]) for plain, shuffled, _, _ in results)


def test_the_mode_changes_no_bit_on_the_cpu(gloo2):
    """The kept pairs arrive in pair order, which the mode's keys keep: on the CPU the
    mode's gradients are bitwise those of the fast path."""
    on = gloo2.run(_backward_under_shuffle, 2, True, "megatron")
    off = gloo2.run(_backward_under_shuffle, 2, False, "megatron")
    for (plain_on, *_), (plain_off, *_) in zip(on, off, strict=True):
        assert _equal(plain_on, plain_off)
