"""Expert biases (Megatron's ``add_bias_linear``, as gpt-oss sets it) in the LRMoE layer.

Megatron's expert MLP adds fc1's bias before the activation and fc2's to the output it
scales by the routing probability (``MLP.forward``: ``output += bias * per_token_scale``),
so a pair's unweighted output o(t, e) carries b2 and y = sum p o as without biases
(docs/design.md, "Region"). The oracles: Megatron's own MoELayer at gamma = inf (forward,
dx, router and every expert gradient, biases included; per-expert loop and grouped GEMMs;
with replicas), and the dense reference minus the dropped pairs at a finite gamma, whose
bias gradients sum the kept pairs' output gradients reweighted as the weights' are. Each
layer has gpt-oss's expert activation: a GLU of quick-GELU, clamped at 7, with the
linear half offset by 1. The biases are drawn nonzero (``_build``).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.layer.test_lrmoe_layer import _compare_with_dense_reference, _compare_with_megatron
from tests.layer.test_replicas import _replicas_equal_static


def quick_gelu(y: torch.Tensor) -> torch.Tensor:
    """Megatron's ``quick_gelu`` without its ``torch.compile`` (which a CPU test would
    pay for in compile time): y sigmoid(1.702 y)."""
    return y * torch.sigmoid(1.702 * y)


#: gpt-oss's expert MLP (Megatron-Bridge's GPTOSSBridge): biases, GLU of quick-GELU, clamp
#: 7, linear offset 1.
GPT_OSS = dict(add_bias_linear=True, gated_linear_unit=True, activation_func=quick_gelu,
               activation_func_clamp_value=7.0, glu_linear_offset=1.0)
BIASES = {f"experts.local_experts.{i}.{linear}.bias" for i in range(4)
          for linear in ("linear_fc1", "linear_fc2")}


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped_mm"])
def test_biases_without_drops_equal_megatron(gloo2, grouped):
    for rank, r in enumerate(gloo2.run(_compare_with_megatron, 2, math.inf, 12, True, None,
                                       None, GPT_OSS, grouped)):
        assert r["forward"] and r["dx"] and r["same-params"], (rank, r)
        assert BIASES | {"router.bias"} <= set(r["grads"]), (rank, sorted(r["grads"]))
        assert all(r["grads"].values()), (rank, r["grads"])


@pytest.mark.parametrize("selection,grouped,metric", [
    ("uniform", False, "grad_act"),      # drawn in forward (uniform reads no metric)
    ("sample", True, "grad_act"),        # drawn in backward, from the gradient metric
    ("topk", False, "grad"),
])
def test_biases_with_drops_equal_dense_reference(gloo2, selection, grouped, metric):
    for rank, result in enumerate(gloo2.run(_compare_with_dense_reference, 2, 0.6, selection,
                                            0.1, grouped, metric, None, GPT_OSS)):
        assert result.pop("dropped"), "the setting must actually drop pairs"
        assert set(result) >= BIASES, (rank, sorted(result))
        assert all(result.values()), (rank, result)


def test_replicas_carry_biases_and_return_their_gradients(gloo2):
    """Replicas compute with their home's biases (nonzero: the forward would differ
    otherwise) and send the bias gradients home in the step's last backward."""
    results = gloo2.run(_replicas_equal_static, 2, 2, GPT_OSS)
    assert any(r["hosted"] and r["routed"] for r in results)
    for rank, r in enumerate(results):
        assert r["forward"] and r["forward-vs-static"] and r["dx"], (rank, r)
        assert r["same-params"] and set(r["grads"]) >= BIASES, (rank, sorted(r["grads"]))
        assert all(r["grads"].values()), (rank, r["grads"])
        if r["hosted"]:
            assert r["pending"] == [True, False], (rank, r["pending"])
