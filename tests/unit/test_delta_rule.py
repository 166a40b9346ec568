"""The gated delta rule's three forms (naive recurrence, chunked WY form, decoding step) against each
other in fp64 on odd sizes, outputs and gradients, at extreme gates, over long sequences, across a
carried state and with padding; the fla kernel against the chunked form on a GPU."""
from __future__ import annotations

import pytest
import torch

from dofla.attention.delta import (DeltaState, delta_rule_chunked, delta_rule_naive, delta_rule_recurrent,
                                   unit_features)
from dofla.attention.delta_backend import delta_rule, fla_kernel

FORMS = {
    "chunked1": lambda *a, **kw: delta_rule_chunked(*a, chunk_size=1, **kw),
    "chunked5": lambda *a, **kw: delta_rule_chunked(*a, chunk_size=5, **kw),
    "chunked16": lambda *a, **kw: delta_rule_chunked(*a, chunk_size=16, **kw),
    "chunked64": lambda *a, **kw: delta_rule_chunked(*a, chunk_size=64, **kw),
    "recurrent": delta_rule_recurrent,
}


def inputs(b=2, h=3, t=37, m=5, dv=7, seed=0, dtype=torch.float64, alpha=(0.0, 1.0), beta=(0.0, 1.0)):
    """q, unit k̂, v, log α uniform in −alpha range, β uniform in the beta range."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, m, generator=g, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(b, h, t, m, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(b, h, t, dv, generator=g, dtype=dtype)
    log_alpha = -(alpha[0] + (alpha[1] - alpha[0]) * torch.rand(b, h, t, generator=g, dtype=dtype))
    beta_ = beta[0] + (beta[1] - beta[0]) * torch.rand(b, h, t, generator=g, dtype=dtype)
    return q, k, v, log_alpha, beta_


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("t", [1, 13, 37])
def test_every_form_equals_the_naive_recurrence(form, t):
    x = inputs(t=t)
    ref, ref_state = delta_rule_naive(*x)
    out, state = FORMS[form](*x)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(state.S, ref_state.S, rtol=1e-10, atol=1e-11)
    assert state.length == ref_state.length == t


@pytest.mark.parametrize("form", ["chunked5", "chunked16", "recurrent"])
def test_gradients_equal_the_naive_recurrence(form):
    tensors = [x.requires_grad_() for x in inputs(t=19, m=3, dv=4)]
    ref_tensors = [x.detach().clone().requires_grad_() for x in tensors]
    weights = torch.randn(2, 3, 19, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out, state = FORMS[form](*tensors)
    ((out * weights).sum() + state.S.sum()).backward()
    ref, ref_state = delta_rule_naive(*ref_tensors)
    ((ref * weights).sum() + ref_state.S.sum()).backward()
    for mine, theirs, name in zip(tensors, ref_tensors, ("q", "k", "v", "log_alpha", "beta")):
        assert theirs.grad.abs().max() > 1e-3, name  # every input does get a gradient
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-9, atol=1e-10, msg=name)


def test_gradients_flow_into_a_carried_state():
    x = inputs(t=11)
    start = torch.randn(2, 3, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = []
    for form in (delta_rule_naive, FORMS["chunked5"], delta_rule_recurrent):
        s0 = start.clone().requires_grad_()
        out, _ = form(*x, state=DeltaState(s0, 4))
        out.pow(2).sum().backward()
        grads.append(s0.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(grads[2], grads[0], rtol=1e-10, atol=1e-11)


# (log α range, β range): forgetting everything, nothing, writing fully, not at all
EXTREMES = {"alpha_to_0": ((40.0, 80.0), (0.0, 1.0)), "alpha_to_1": ((0.0, 0.0), (0.0, 1.0)),
            "beta_to_1": ((0.0, 1.0), (1.0, 1.0)), "beta_to_0": ((0.0, 1.0), (0.0, 0.0)),
            "both_to_1": ((0.0, 0.0), (1.0, 1.0))}


@pytest.mark.parametrize("case", sorted(EXTREMES))
@pytest.mark.parametrize("form", ["chunked5", "chunked64", "recurrent"])
def test_extreme_gates_agree_across_forms(case, form):
    alpha, beta = EXTREMES[case]
    x = inputs(t=29, alpha=alpha, beta=beta)
    ref, ref_state = delta_rule_naive(*x)
    out, state = FORMS[form](*x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(state.S, ref_state.S, rtol=1e-9, atol=1e-10)


def test_extreme_gates_mean_what_they_say():
    q, k, v, _, _ = inputs(t=23)
    zero, _ = delta_rule_chunked(q, k, v, torch.zeros(2, 3, 23, dtype=q.dtype), torch.zeros(2, 3, 23, dtype=q.dtype))
    assert zero.abs().max() == 0  # β = 0 writes nothing
    forget = torch.full((2, 3, 23), -70.0, dtype=q.dtype)
    ones = torch.ones(2, 3, 23, dtype=q.dtype)
    last, _ = delta_rule_chunked(q, k, v, forget, ones, chunk_size=8)  # α → 0: only the newest write is left
    torch.testing.assert_close(last, (q * k).sum(-1, keepdim=True) * v, rtol=1e-10, atol=1e-12)
    eye = torch.eye(5, dtype=q.dtype).expand(2, 3, 5, 5)  # orthogonal keys, α = β = 1: exact recall
    _, state = delta_rule_chunked(eye, eye, v[:, :, :5], torch.zeros(2, 3, 5, dtype=q.dtype),
                                  torch.ones(2, 3, 5, dtype=q.dtype), chunk_size=2)
    torch.testing.assert_close(state.S, v[:, :, :5], rtol=1e-12, atol=1e-12)


def test_a_key_written_twice_is_overwritten_not_added():
    k = torch.nn.functional.normalize(torch.ones(1, 1, 2, 4, dtype=torch.float64), dim=-1)
    v = torch.tensor([[[[1.0, 2.0], [5.0, -1.0]]]], dtype=torch.float64)
    out, _ = delta_rule_chunked(k, k, v, torch.zeros(1, 1, 2, dtype=torch.float64),
                                torch.ones(1, 1, 2, dtype=torch.float64))
    torch.testing.assert_close(out[0, 0, 1], v[0, 0, 1])  # the delta rule replaces; linear attention would sum


@pytest.mark.parametrize("split", [1, 16, 40])
def test_prefill_then_decode_equals_a_single_pass(split):
    x = inputs(t=41)
    whole, final = delta_rule_chunked(*x, chunk_size=8)
    head = [t[:, :, :split] for t in x]
    first, state = delta_rule_chunked(*head, chunk_size=8)
    parts = [first]
    for t in range(split, 41):  # then token by token, as decoding does
        out, state = delta_rule(*[z[:, :, t:t + 1] for z in x], state=state)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts, dim=2), whole, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(state.S, final.S, rtol=1e-10, atol=1e-11)
    assert state.length == final.length == 41


def test_chunked_calls_chain_like_one():
    x = inputs(t=50)
    whole, _ = delta_rule_chunked(*x, chunk_size=16)
    a, state = delta_rule_chunked(*[t[:, :, :21] for t in x], chunk_size=16)
    b, _ = delta_rule_chunked(*[t[:, :, 21:] for t in x], chunk_size=16, state=state)
    torch.testing.assert_close(torch.cat([a, b], 2), whole, rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("form", ["naive", "chunked5", "recurrent"])
def test_padded_keys_write_nothing_and_do_not_decay(form):
    run = delta_rule_naive if form == "naive" else FORMS[form]
    x = inputs(b=1, t=17)
    pad = 4
    padded = [torch.cat([torch.randn_like(t[:, :, :pad]) * 9, t], dim=2) for t in x]
    valid = torch.ones(1, 17 + pad, dtype=torch.bool)
    valid[:, :pad] = False
    plain, plain_state = run(*x)
    out, state = run(*padded, key_valid=valid)
    torch.testing.assert_close(out[:, :, pad:], plain, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(state.S, plain_state.S, rtol=1e-10, atol=1e-11)


def test_long_sequences_stay_exact_in_float32_and_the_state_stays_bounded():
    x = inputs(b=1, h=1, t=4096, m=16, dv=8, alpha=(0.0, 0.02), beta=(0.1, 1.0), dtype=torch.float32)
    ref, _ = delta_rule_recurrent(*[t.double() for t in x])
    out, _ = delta_rule_chunked(*x, chunk_size=64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=1e-4)
    norms, state = [], None
    for start in range(0, 4096, 512):  # the state's size along the way
        _, state = delta_rule_chunked(*[t[:, :, start:start + 512] for t in x], chunk_size=64, state=state)
        norms.append(state.S.norm(dim=(-2, -1)).max().item())
    bound = (16 * x[2].pow(2).sum(-1).max()).sqrt().item()  # √M · max ‖v‖
    assert max(norms) <= bound
    assert max(norms[4:]) <= 2 * max(norms[:4])  # no growth with the length


def test_the_state_stays_bounded_without_decay_at_full_writes():
    x = inputs(b=1, h=1, t=4096, m=8, dv=4, alpha=(0.0, 0.0), beta=(1.0, 1.0), dtype=torch.float32)
    _, state = delta_rule_chunked(*x, chunk_size=64)
    assert torch.isfinite(state.S).all()
    assert state.S.norm(dim=(-2, -1)).max() < 100 * x[2].norm(dim=-1).max()


def test_unit_features_are_the_normalised_features_at_any_scale():
    log_x = torch.randn(2, 3, 9, 6, dtype=torch.float64)
    torch.testing.assert_close(unit_features(log_x), torch.nn.functional.normalize(log_x.exp(), dim=-1))
    huge = unit_features(log_x * 300.0)  # exp of these overflows even fp64
    assert torch.isfinite(huge).all()
    torch.testing.assert_close(huge.norm(dim=-1), torch.ones(2, 3, 9, dtype=torch.float64))


def test_the_dispatcher_runs_pytorch_on_the_cpu_and_refuses_a_missing_fla():
    x = inputs(t=9)
    out, _ = delta_rule(*x, chunk_size=4)
    torch.testing.assert_close(out, delta_rule_naive(*x)[0], rtol=1e-10, atol=1e-11)
    if fla_kernel() is None:
        with pytest.raises(RuntimeError, match="flash-linear-attention"):
            delta_rule(*x, backend="fla")


@pytest.mark.gpu
def test_fla_kernel_matches_the_pytorch_chunked_form():
    pytest.importorskip("fla")
    x = [t.float().cuda() for t in inputs(b=2, h=4, t=300, m=64, dv=64, alpha=(0.0, 0.1), beta=(0.0, 1.0))]
    half = [t.bfloat16() for t in x[:3]]
    start = DeltaState(torch.randn(2, 4, 64, 64, device="cuda") * 0.1, 0)
    out, state = delta_rule(*half, x[3], x[4], state=start, backend="fla")
    ref, ref_state = delta_rule_chunked(*[t.bfloat16().float() for t in x[:3]], x[3], x[4], state=start)
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(state.S.float(), ref_state.S, rtol=3e-2, atol=3e-2)


def _qwen3_next(name: str):
    """transformers' PyTorch reference of fla's gated delta rule API (the Qwen3-Next modelling file),
    unwrapped from the decorator that swaps in fla or a hub kernel where one is installed."""
    import importlib
    import inspect

    try:
        module = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    except ImportError:
        pytest.skip("this transformers has no Qwen3-Next modelling file")
    fn = getattr(module, name, None)
    if fn is None:
        pytest.skip(f"transformers no longer has the private {name}")
    return inspect.unwrap(fn)


@pytest.mark.parametrize("reference", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
@pytest.mark.parametrize("t", [1, 37, 130])
def test_the_forms_equal_transformers_qwen3_next_reference(reference, t):
    """Their conventions: (B, T, H, ·) layouts, q and k l2-normalised in the kernel, g the log decay,
    β the write strength, q scaled by 1/√d_k; ours take the unit q̂, k̂ as given and no scale."""
    b, h, m, dv = 2, 3, 16, 8
    gen = torch.Generator().manual_seed(t)
    q, k = (torch.randn(b, t, h, m, generator=gen) for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -0.5 * torch.rand(b, t, h, generator=gen)
    beta = torch.rand(b, t, h, generator=gen)
    start = 0.1 * torch.randn(b, h, m, dv, generator=gen)
    theirs, their_state = _qwen3_next(reference)(q, k, v, g, beta, initial_state=start.clone(),
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
    heads_first = lambda x: x.transpose(1, 2).double()  # noqa: E731  (B, T, H, ·) -> (B, H, T, ·)
    unit = lambda x: torch.nn.functional.normalize(heads_first(x), dim=-1)  # noqa: E731
    args = (unit(q) / m ** 0.5, unit(k), heads_first(v), heads_first(g), heads_first(beta))
    for form in (delta_rule_naive, delta_rule_chunked):
        out, state = form(*args, state=DeltaState(start.double(), 0))
        torch.testing.assert_close(out.transpose(1, 2).float(), theirs.float(), rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(state.S.float(), their_state.float(), rtol=1e-4, atol=2e-5)
