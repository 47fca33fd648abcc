"""MoEFeedForward against transformers' Mixtral and Qwen2-MoE blocks, a dense "every expert on every
token" oracle, pf.FeedForward, float64 gradcheck and hand-computed routings; the balancing losses
against transformers' `load_balancing_loss_func` and by hand; the aux-loss-free bias."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import MixtralConfig, Qwen2MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

import plainformer as pf
from plainformer.nn.moe import expert_counts, moe_layers
from tests.reference.torch_reference import assert_close, upstream_like


def _layer(*args, seed: int = 0, **kwargs) -> pf.MoEFeedForward:
    torch.manual_seed(seed)
    return pf.MoEFeedForward(*args, **kwargs)


def _assert_relative(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    """max |actual - expected| / max(max |expected|, 1) <= tol: relative for gradients of order 1 and
    more, absolute for those that vanish (the router's under top-1 with renormalised gates, g = 1)."""
    assert actual.shape == expected.shape, what
    error = ((actual - expected).abs().max() / expected.abs().max().clamp_min(1.0)).item()
    assert error <= tol, f"{what}: relative error {error:.3g}"


def _swiglu_expert(x: torch.Tensor, W_1: torch.Tensor, W_3: torch.Tensor, W_2: torch.Tensor) -> torch.Tensor:
    """(SiLU(x W_1ᵀ) ⊙ x W_3ᵀ) W_2ᵀ with SiLU(z) = z σ(z) written out."""
    gate = x @ W_1.T
    return (gate * torch.sigmoid(gate) * (x @ W_3.T)) @ W_2.T


def _dense_oracle(layer: pf.MoEFeedForward, x: torch.Tensor, *, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Every expert on every token, weighted by a (T, E) gate matrix that is zero off the top-K.

    keep (T, K) bool marks the slots that survive the capacity (all of them when None).
    """
    flat = x.reshape(-1, x.shape[-1])
    logits = flat @ layer.router.weight.T
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    scores = torch.softmax(wide, -1) if layer.score == "softmax" else torch.sigmoid(wide)
    chosen = torch.topk(scores + layer.expert_bias, layer.top_k, dim=-1).indices  # (T, K)
    picked = torch.gather(scores, 1, chosen)
    if layer.normalize_top_k:
        picked = picked / picked.sum(-1, keepdim=True)
    if keep is not None:
        picked = picked * keep
    gates = torch.zeros_like(scores).scatter(1, chosen, picked)  # (T, E)
    out = torch.zeros_like(flat)
    for e in range(layer.n_experts):
        out = out + gates[:, e:e + 1].to(flat.dtype) * _swiglu_expert(flat, layer.W_1[e], layer.W_3[e], layer.W_2[e])
    if layer.shared is not None:
        out = out + _swiglu_expert(flat, layer.shared.W_1.weight, layer.shared.W_3.weight, layer.shared.W_2.weight)
    return out.reshape(x.shape)


def _grads(layer: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of <out, G> by name: "x" and every parameter of the layer."""
    names, parameters = zip(*layer.named_parameters(), strict=True)
    grads = torch.autograd.grad(out, [x, *parameters], upstream_like(out), allow_unused=True)
    return dict(zip(["x", *names], grads, strict=True))


def _assert_same_grads(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in actual:
        assert_close(actual[name], expected[name], name)


def _mixtral(layer: pf.MoEFeedForward) -> MixtralSparseMoeBlock:
    d_ff, d_model = layer.W_1.shape[1:]
    theirs = MixtralSparseMoeBlock(MixtralConfig(hidden_size=d_model, intermediate_size=d_ff,
                                                 num_local_experts=layer.n_experts,
                                                 num_experts_per_tok=layer.top_k))
    with torch.no_grad():
        theirs.gate.weight.copy_(layer.router.weight)
        theirs.experts.gate_up_proj.copy_(torch.cat([layer.W_1, layer.W_3], dim=1))
        theirs.experts.down_proj.copy_(layer.W_2)
    return theirs


# ------------------------------------------------------------------ references


@pytest.mark.parametrize("n_experts, top_k", [(8, 2), (4, 1), (4, 4)])
def test_matches_mixtral_sparse_moe_block_with_copied_weights(n_experts, top_k):
    ours = _layer(16, 24, n_experts, top_k)
    theirs = _mixtral(ours)
    x = torch.randn(3, 7, 16, requires_grad=True)
    out, ref = ours(x), theirs(x)
    assert_close(out, ref, "output")
    grads, ref_grads = _grads(ours, x, out), _grads(theirs, x, ref)
    d_ff = ours.W_1.shape[1]
    gate_up = ref_grads["experts.gate_up_proj"]
    expected = {"x": ref_grads["x"], "router.weight": ref_grads["gate.weight"], "W_1": gate_up[:, :d_ff],
                "W_3": gate_up[:, d_ff:], "W_2": ref_grads["experts.down_proj"]}
    assert grads.keys() == expected.keys()
    for name in expected:
        _assert_relative(grads[name], expected[name], name)


def test_shared_expert_matches_qwen2_moe_block_with_a_zero_shared_gate():
    """Qwen2-MoE multiplies its shared expert by sigmoid(x w_g), an input-dependent gate that has no
    counterpart here (y += FFN_shared(x)). With w_g = 0 that gate is 1/2 for every token, so Qwen's
    block equals ours with the shared down-projection halved: outputs and input gradients compared."""
    ours = _layer(16, 24, 6, 2, n_shared_experts=2, normalize_top_k=False)
    config = Qwen2MoeConfig(hidden_size=16, moe_intermediate_size=24, shared_expert_intermediate_size=48,
                            num_experts=6, num_experts_per_tok=2, norm_topk_prob=False)
    theirs = Qwen2MoeSparseMoeBlock(config)
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight)
        theirs.experts.gate_up_proj.copy_(torch.cat([ours.W_1, ours.W_3], dim=1))
        theirs.experts.down_proj.copy_(ours.W_2)
        theirs.shared_expert.gate_proj.weight.copy_(ours.shared.W_1.weight)
        theirs.shared_expert.up_proj.weight.copy_(ours.shared.W_3.weight)
        theirs.shared_expert.down_proj.weight.copy_(2 * ours.shared.W_2.weight)
        theirs.shared_expert_gate.weight.zero_()
    x = torch.randn(2, 9, 16, requires_grad=True)
    out, ref = ours(x), theirs(x)
    assert_close(out, ref, "output")
    (grad,) = torch.autograd.grad(out, x, upstream_like(out))
    (ref_grad,) = torch.autograd.grad(ref, x, upstream_like(ref))
    _assert_relative(grad, ref_grad, "x")


def test_one_expert_top_1_is_the_swiglu_feed_forward():
    """Two of our layers, differing only in the order of their sums: compared in float64."""
    ours = _layer(16, 24, 1, 1).double()
    ffn = pf.FeedForward(16, 24, activation="swiglu", bias=False).double()
    with torch.no_grad():
        ffn.W_1.weight.copy_(ours.W_1[0])
        ffn.W_3.weight.copy_(ours.W_3[0])
        ffn.W_2.weight.copy_(ours.W_2[0])
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    out, ref = ours(x), ffn(x)
    assert_close(out, ref, "output")
    grads, ref_grads = _grads(ours, x, out), _grads(ffn, x, ref)
    assert_close(grads["x"], ref_grads["x"], "x")
    for name in ("W_1", "W_3", "W_2"):
        assert_close(grads[name][0], ref_grads[f"{name}.weight"], name)
    zero = torch.zeros(1, 16, dtype=torch.float64)
    assert_close(grads["router.weight"], zero, "router")  # one expert: g = 1 whatever the logits


# ------------------------------------------------------------------ every dispatch path = the dense oracle


def _router_preferring(layer: pf.MoEFeedForward, experts: list[int]) -> None:
    """Make the router send every token to `experts` (the others stay empty): x[..., 0] = 10 feeds them."""
    with torch.no_grad():
        layer.router.weight.mul_(0.01)
        for rank, e in enumerate(experts):
            layer.router.weight[e, 0] = 3.0 - rank


def _skewed_input(shape, seed: int = 1) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    x[..., 0] = 10.0
    return x


CASES = {
    "softmax top-2": dict(kwargs=dict(n_experts=6, top_k=2)),
    "sigmoid, no renormalisation": dict(kwargs=dict(n_experts=6, top_k=2, score="sigmoid", normalize_top_k=False)),
    "sigmoid, renormalised": dict(kwargs=dict(n_experts=6, top_k=3, score="sigmoid")),
    "K = E": dict(kwargs=dict(n_experts=4, top_k=4)),
    "shared experts": dict(kwargs=dict(n_experts=4, top_k=2, n_shared_experts=2)),
    "empty experts": dict(kwargs=dict(n_experts=6, top_k=2), prefer=[4, 1]),
    "ties": dict(kwargs=dict(n_experts=5, top_k=2), zero_router=True),
    "nonzero bias": dict(kwargs=dict(n_experts=6, top_k=2), bias=True),
    "capacity, nothing dropped": dict(kwargs=dict(n_experts=4, top_k=2, capacity_factor=4.0)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_dispatch_matches_the_dense_oracle(case, dtype):
    spec = CASES[case]
    layer = _layer(8, 12, **spec["kwargs"]).to(dtype)
    x = (_skewed_input((2, 6, 8)) if "prefer" in spec else torch.randn(2, 6, 8)).to(dtype).requires_grad_()
    if "prefer" in spec:
        _router_preferring(layer, spec["prefer"])
    if spec.get("zero_router"):
        with torch.no_grad():
            layer.router.weight.zero_()
    if spec.get("bias"):
        layer.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1, -0.3, 0.1]))
    out, ref = layer(x), _dense_oracle(layer, x)
    if "prefer" in spec:
        assert layer.step_load[[0, 2, 3, 5]].sum() == 0 and layer.step_load[[4, 1]].sum() == 24
    assert_close(out, ref, "output")
    _assert_same_grads(_grads(layer, x, out), _grads(layer, x, ref))


def test_gradcheck_in_float64():
    layer = _layer(6, 5, 4, 2, n_shared_experts=1).double()
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    params = [x, layer.router.weight, layer.W_1, layer.W_3, layer.W_2]

    def f(x, router, W_1, W_3, W_2):
        return torch.func.functional_call(layer, {"router.weight": router, "W_1": W_1, "W_3": W_3, "W_2": W_2}, (x,))

    assert torch.autograd.gradcheck(f, params, eps=1e-6, atol=1e-7)


# ------------------------------------------------------------------ capacity


def test_capacity_drops_the_overflow_in_token_order():
    """All 8 tokens choose experts {0, 1} (logits 20, 10, 0, 0); capacity ⌈1 · 8 · 2 / 4⌉ = 4 keeps
    tokens 0..3 on both experts, drops tokens 4..7 entirely: 8 dropped slots."""
    layer = _layer(8, 12, 4, 2, capacity_factor=1.0)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0], layer.router.weight[1, 0] = 2.0, 1.0
    x = torch.randn(1, 8, 8)
    x[..., 0] = 10.0
    assert layer.capacity(8) == 4
    out = layer(x)
    assert layer.step_dropped == 8
    assert layer.step_load.tolist() == [8, 8, 0, 0]
    gates = torch.softmax(x[0, :, :1] * torch.tensor([2.0, 1.0]), -1)  # (8, 2): the chosen logits renormalised
    flat = x[0]
    expected = (gates[:, :1] * _swiglu_expert(flat, layer.W_1[0], layer.W_3[0], layer.W_2[0])
                + gates[:, 1:] * _swiglu_expert(flat, layer.W_1[1], layer.W_3[1], layer.W_2[1]))
    expected[4:] = 0
    assert_close(out[0], expected, "capacity output")
    keep = torch.zeros(8, 2)
    keep[:4] = 1
    assert_close(out, _dense_oracle(layer, x, keep=keep), "oracle")


def test_capacity_gradients_match_the_dense_oracle():
    layer = _layer(8, 12, 4, 1, capacity_factor=1.0)
    _router_preferring(layer, [2])
    x = _skewed_input((1, 8, 8)).requires_grad_()
    out = layer(x)
    assert layer.step_dropped == 6  # capacity ⌈8 · 1 / 4⌉ = 2 of 8 slots on expert 2
    keep = torch.zeros(8, 1)
    keep[:2] = 1
    ref = _dense_oracle(layer, x, keep=keep)
    assert_close(out, ref, "output")
    _assert_same_grads(_grads(layer, x, out), _grads(layer, x, ref))


# ------------------------------------------------------------------ losses


def test_load_balancing_loss_matches_transformers():
    logits = torch.randn(40, 8, generator=torch.Generator().manual_seed(3))
    for top_k in (1, 2, 8):
        expected = load_balancing_loss_func((logits,), num_experts=8, top_k=top_k)
        assert_close(pf.load_balancing_loss(logits, top_k), expected, f"top_k={top_k}")


def test_load_balancing_loss_is_k_under_uniform_routing():
    # Token t prefers experts t, t+1 (mod E): every expert gets the same share, P uniform over tokens.
    E, K, T = 4, 2, 8
    logits = torch.zeros(T, E)
    for t in range(T):
        logits[t, t % E], logits[t, (t + 1) % E] = 2.0, 1.0
    assert_close(pf.load_balancing_loss(logits, K), torch.tensor(float(K)))
    assert_close(pf.load_balancing_loss(torch.zeros(T, E), K), torch.tensor(float(K)))


def test_load_balancing_loss_gradient_flows_through_probabilities_only():
    logits = torch.randn(10, 4, requires_grad=True)
    loss = pf.load_balancing_loss(logits, 2)
    (grad,) = torch.autograd.grad(loss, logits)
    probs = torch.softmax(logits.detach(), -1)
    f = torch.bincount(probs.topk(2, -1).indices.flatten(), minlength=4).float() / 10
    # dL/ds = E/T · J_softmaxᵀ f  for each token
    expected = 4 / 10 * probs * (f - (probs * f).sum(-1, keepdim=True))
    assert_close(grad, expected)


@pytest.mark.parametrize("shape", [(0,), (7,), (40, 2), (3, 5, 4)])
def test_expert_counts_equal_bincount(shape):
    ids = torch.randint(6, shape, generator=torch.Generator().manual_seed(len(shape)))
    assert torch.equal(expert_counts(ids, 6), torch.bincount(ids.flatten(), minlength=6))


def test_load_balancing_loss_reads_no_value_on_the_host():
    # Fake tensors have shapes and no values: an op that needs one on the host (a sync on CUDA,
    # e.g. bincount's max) raises here.
    with FakeTensorMode():
        loss = pf.load_balancing_loss(torch.randn(40, 8, requires_grad=True), 2)
    assert loss.shape == ()


def test_router_z_loss_by_hand_in_float64():
    logits = torch.randn(12, 5, dtype=torch.float64)
    by_hand = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / len(logits)
    by_hand = torch.tensor(by_hand, dtype=torch.float64)
    assert_close(pf.router_z_loss(logits), by_hand)


def test_a_layer_after_a_training_forward_can_be_deep_copied():
    layer = _layer(8, 12, 4, 2)
    x = torch.randn(2, 5, 8)
    layer(x)
    twin = copy.deepcopy(layer)
    assert twin.router_logits is None and layer.router_logits is not None
    assert_close(twin(x), layer(x))


def test_aux_losses_read_the_last_forward():
    layer = _layer(8, 12, 4, 2).double()  # the router's logits again, summed in another order: float64
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    layer(x)
    aux, z = layer.aux_losses()
    logits = x.reshape(-1, 8) @ layer.router.weight.T
    assert_close(aux, pf.load_balancing_loss(logits, 2))
    assert_close(z, pf.router_z_loss(logits))


# ------------------------------------------------------------------ aux-loss-free bias


def test_expert_bias_is_a_saved_buffer_without_gradient():
    layer = _layer(8, 12, 4, 2, bias_update_rate=0.1)
    assert "expert_bias" in layer.state_dict() and "step_load" not in layer.state_dict()
    assert all(parameter is not layer.expert_bias for parameter in layer.parameters())
    layer.train()
    layer(torch.randn(2, 5, 8)).sum().backward()
    assert layer.expert_bias.grad is None and not layer.expert_bias.requires_grad


def test_bias_update_counts_every_micro_batch_once_per_step_and_stays_zero_mean():
    layer = _layer(8, 12, 4, 1, bias_update_rate=0.1)
    _router_preferring(layer, [3])
    layer.train()
    layer(_skewed_input((1, 6, 8), seed=1))
    layer(_skewed_input((1, 4, 8), seed=2))
    assert layer.step_load.tolist() == [0, 0, 0, 10]
    layer.update_bias()  # what training does after each optimizer step (training/moe_stats.py)
    # sign(mean - load) = (+, +, +, -) → b = 0.1 · (1, 1, 1, -1) - mean = (0.05, 0.05, 0.05, -0.15)
    assert_close(layer.expert_bias, torch.tensor([0.05, 0.05, 0.05, -0.15]))
    assert layer.step_load.sum() == 0 and layer.step_dropped == 0
    layer.eval()
    layer(_skewed_input((1, 4, 8)))
    assert layer.step_load.sum() == 0  # evaluation does not count


def test_bias_moves_the_load_of_a_skewed_router_toward_balance():
    torch.manual_seed(0)
    layer = pf.MoEFeedForward(8, 12, 4, 1, bias_update_rate=0.01)
    with torch.no_grad():
        layer.router.weight.mul_(0.1)
        layer.router.weight[0, 0] = 0.4  # x[..., 0] ~ N(1, 1) pushes most tokens to expert 0

    def violation() -> float:
        load = layer.step_load.float()
        return ((load.max() - load.mean()) / load.mean()).item()

    layer.train()
    violations = []
    for step in range(60):
        x = torch.randn(8, 64, 8, generator=torch.Generator().manual_seed(step))
        x[..., 0] += 1.0
        with torch.no_grad():
            layer(x)
        violations.append(violation())
        layer.update_bias()
        assert abs(layer.expert_bias.mean().item()) < 1e-6
    assert violations[0] > 2.0  # expert 0 takes more than 3/4 of the tokens
    assert sum(violations[-10:]) / 10 < 0.25 * violations[0]
    assert layer.expert_bias[0] < 0 < layer.expert_bias[1:].min()


def test_bias_update_is_a_no_op_at_rate_zero():
    layer = _layer(8, 12, 4, 1)
    layer.train()
    layer(torch.randn(1, 5, 8))
    layer.update_bias()
    assert layer.expert_bias.abs().sum() == 0 and layer.step_load.sum() == 0


def test_moe_layers_finds_nested_layers():
    model = torch.nn.Sequential(_layer(8, 12, 4, 1), torch.nn.Linear(8, 8), _layer(8, 12, 4, 2))
    assert [m.top_k for m in moe_layers(model)] == [1, 2]


# ------------------------------------------------------------------ shapes, dtypes, dropout, errors


def test_bfloat16_input_keeps_fp32_gates_and_returns_bfloat16():
    layer = _layer(8, 12, 4, 2)
    x = torch.randn(2, 5, 8)
    ref = layer(x)
    out = layer.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert (out.float() - ref).abs().max() < 5e-2


def test_dropout_is_inactive_in_eval_and_scales_kept_units_in_training():
    layer = _layer(8, 12, 4, 2, dropout=0.5)
    x = torch.randn(2, 5, 8, requires_grad=True)
    layer.eval()
    assert_close(layer(x), _dense_oracle(layer, x))
    layer.train()
    torch.manual_seed(1)
    a, b = layer(x), layer(x)
    assert not torch.equal(a, b)
    a.sum().backward()  # the mask reaches the hand-written backward
    assert torch.isfinite(x.grad).all()


def test_dropout_backward_passes_gradcheck_with_a_fixed_mask():
    layer = _layer(6, 5, 4, 2, dropout=0.3).double()  # test_gradcheck_in_float64's shapes: 60 hidden units
    # (6 tokens x top-2 x d_ff 5), of which dropout 0.3 drops some whatever the seed
    layer.train()
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)

    def f(x, W_1, W_3, W_2):
        torch.manual_seed(7)
        return torch.func.functional_call(layer, {"W_1": W_1, "W_3": W_3, "W_2": W_2}, (x,))

    assert torch.autograd.gradcheck(f, [x, layer.W_1, layer.W_3, layer.W_2], eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=5), "top_k must be at most n_experts=4"),
    (dict(top_k=0), "top_k must be a positive integer"),
    (dict(score="relu"), "score"),
    (dict(n_shared_experts=-1), "n_shared_experts"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(bias_update_rate=-1.0), "bias_update_rate"),
    (dict(dropout=1.0), "dropout"),
])
def test_bad_arguments_are_rejected_at_construction(kwargs, message):
    arguments = dict(d_model=8, d_ff=12, n_experts=4, top_k=2) | kwargs
    with pytest.raises((ValueError, TypeError), match=message):
        pf.MoEFeedForward(**arguments)


def test_wrong_input_width_names_d_model():
    with pytest.raises(ValueError, match="d_model"):
        _layer(8, 12, 4, 2)(torch.randn(2, 3, 7))


def test_load_balancing_loss_rejects_top_k_above_the_experts():
    with pytest.raises(ValueError, match="top_k"):
        pf.load_balancing_loss(torch.randn(3, 4), 5)


def test_bfloat16_autocast_runs_the_experts_in_bfloat16_and_trains_the_fp32_weights():
    layer = _layer(8, 12, 4, 2)
    x = torch.randn(2, 5, 8, requires_grad=True)
    ref = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert layer.router_logits.dtype == torch.bfloat16 and out.dtype == torch.float32
    assert 0 < (out - ref).abs().max() < 2e-2  # bf16 matmuls, not an fp32 pass in disguise
    out.sum().backward()
    assert layer.W_1.grad.dtype == torch.float32 and layer.W_1.grad.abs().sum() > 0
