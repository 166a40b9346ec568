"""Feature maps: shapes, positivity, stability at realistic norms, trainability, and the PRF's
unbiasedness. Table-driven over FEATURE_MAPS, so a newly registered map is covered automatically."""
from __future__ import annotations

import math

import pytest
import torch

from dofla.feature_maps import FEATURE_MAPS, FeatureMap, build_feature_map
from dofla.feature_maps.dijiang import dct_matrix

NAMES = FEATURE_MAPS.names()
B, H, T, D = 2, 3, 5, 16


def _inputs(norm: float | None = None, seed: int = 0, d: int = D) -> torch.Tensor:
    """(B, H, T, d) Gaussian inputs, optionally rescaled to a fixed norm per token."""
    x = torch.randn(B, H, T, d, generator=torch.Generator().manual_seed(seed))
    return x if norm is None else x / x.norm(dim=-1, keepdim=True) * norm


def test_all_expected_maps_registered():
    assert {"performer", "learned_prf", "dijiang", "hedgehog", "hedgehog_joint", "elu1"} <= set(NAMES)


def test_unknown_name_lists_valid_names():
    with pytest.raises(KeyError, match="performer"):
        build_feature_map("performr", H, D, 8)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("m", [1, 5, 64, 100])
def test_shape_and_positivity(name, m):
    fm = build_feature_map(name, H, D, m, seed=1)
    assert isinstance(fm, FeatureMap) and fm.num_features == m
    log_phi = fm.log_features(_inputs())
    assert log_phi.shape == (B, H, T, m)
    phi = fm(_inputs())
    assert torch.isfinite(phi).all() and (phi > 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_finite_at_large_norms(name):
    """|x| = 12·d^{1/4}, i.e. |x|²/sqrt(d) = 144: the top of what real models produce."""
    fm = build_feature_map(name, H, D, 24)
    x = _inputs(norm=12 * D**0.25).requires_grad_(True)
    log_phi = fm.log_features(x)
    assert torch.isfinite(log_phi).all()
    log_phi.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("name", NAMES)
def test_gradients_reach_trainable_parameters(name):
    fm = build_feature_map(name, H, D, 12)
    params = [p for p in fm.parameters() if p.requires_grad]
    assert bool(params) == fm.trainable
    if not params:
        return
    w = torch.randn(B, H, T, 12, generator=torch.Generator().manual_seed(3))
    (fm.log_features(_inputs()) * w).sum().backward()
    for p in params:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


@pytest.mark.parametrize("name", NAMES)
def test_half_precision_input_computes_in_fp32(name):
    fm = build_feature_map(name, H, D, 8)
    x = _inputs()
    out = fm.log_features(x.bfloat16())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, fm.log_features(x.bfloat16().float()))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_performer_is_unbiased(seed):
    """Mean over M = 20000 draws of φ(x; z)φ(y; z) vs exp(x·y/sqrt(d)), d = 8, |x| = |y| = 2.

    Tolerance: 5 Monte-Carlo standard errors (std of the per-feature products / sqrt(M)); one SE
    is 1.3–3 % of the kernel value for these seeds, so the bound is a 7–15 % relative error; a wrong scale (e.g. d^{1/2} for d^{1/4}) or a missing
    |x|² term misses it by far more.
    """
    d, m = 8, 20000
    fm = build_feature_map("performer", 1, d, m, seed=seed)
    g = torch.Generator().manual_seed(100 + seed)
    x, y = torch.randn(2, 1, 1, 1, d, generator=g, dtype=torch.float64)
    x, y = 2 * x / x.norm(), 2 * y / y.norm()
    fm = fm.double()
    # Per-feature products φ(x;z_m)φ(y;z_m): the log features include ½log(1/M) each, so × M.
    samples = (fm.log_features(x) + fm.log_features(y)).exp().flatten() * m
    estimate, se = samples.mean(), samples.std() / math.sqrt(m)
    exact = torch.exp((x * y).sum() / math.sqrt(d))
    assert abs(estimate - exact) < 5 * se, (estimate.item(), exact.item(), se.item())
    assert se / exact < 0.05  # the test has power: 5 SE is a tight bound here


def test_performer_redraw():
    x = _inputs()
    fm = build_feature_map("performer", H, D, 16, seed=5)
    first = fm.log_features(x)
    fm.redraw(6)
    assert not torch.allclose(fm.log_features(x), first)
    torch.testing.assert_close(fm.log_features(x), build_feature_map("performer", H, D, 16, seed=6).log_features(x))
    fm.redraw(5)
    assert torch.equal(fm.log_features(x), first)
    assert [n for n, _ in fm.named_buffers()] == ["z"] and not list(fm.parameters())


def test_learned_prf_starts_at_performer():
    x = _inputs()
    for mode in ("log", "raw"):
        learned = build_feature_map("learned_prf", H, D, 16, seed=4, alpha_param=mode)
        performer = build_feature_map("performer", H, D, 16, seed=4)
        assert torch.equal(learned.z.detach(), performer.z)
        torch.testing.assert_close(learned.log_features(x), performer.log_features(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["log", "raw"])
def test_learned_prf_alpha_stays_positive(mode):
    fm = build_feature_map("learned_prf", H, D, 8, alpha_param=mode)
    torch.testing.assert_close(fm.alpha(), torch.ones(H, 8))
    groups = fm.param_groups()
    assert [g["name"] for g in groups] == ["z", "alpha"]
    assert groups[0]["params"][0] is fm.z and groups[1]["params"][0] is fm.alpha_param
    opt = torch.optim.SGD([{**g, "lr": 0.02 if g["name"] == "z" else 1.0} for g in groups])
    # d(sum log φ)/d(param) = +5 per entry, so this step drives raw α to −4 (and log α to −5):
    # α must stay positive and the log features finite either way.
    fm.log_features(_inputs()).sum().backward()
    opt.step()
    assert (fm.alpha_param < 0).all()
    assert (fm.alpha() > 0).all() and torch.isfinite(fm.log_alpha()).all()
    assert torch.isfinite(fm.log_features(_inputs())).all()
    with torch.no_grad():
        fm.alpha_param.fill_(-3.0)
    assert (fm.alpha() > 0).all() and torch.isfinite(fm.log_features(_inputs())).all()


def test_learned_prf_rejects_unknown_alpha_param():
    with pytest.raises(ValueError, match="alpha_param"):
        build_feature_map("learned_prf", H, D, 8, alpha_param="softplus")


def test_dijiang_matches_paper_formula():
    d, m = 4, 10  # M > d: rows cycle through the DCT
    c = dct_matrix(d)
    torch.testing.assert_close(c @ c.T, torch.eye(d, dtype=torch.float64))
    fm = build_feature_map("dijiang", 2, d, m, seed=3)
    x = torch.randn(1, 2, 3, d)
    cx = x @ c.float().T
    expected = torch.empty(1, 2, 3, m)
    for j in range(m):
        expected[..., j] = (1 / math.sqrt(m)) * torch.exp(fm.t[:, j, None] * cx[..., j % d] / d**0.25)
    torch.testing.assert_close(fm(x), expected)


def _hedgehog_reference(name: str, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, m: int):
    """φ(x) from the formulas, token by token in float64: published [softmax(y), softmax(−y)] with
    y = xW + b, or the joint softmax([y, −y]) without bias; the second half has ⌊M/2⌋ entries."""
    out = torch.empty(*x.shape[:-1], m, dtype=torch.float64)
    rest = m - weight.shape[-1]
    for b, h, t in torch.cartesian_prod(*(torch.arange(n) for n in x.shape[:-1])).tolist():
        y = x[b, h, t].double() @ weight[h].double()
        if name == "hedgehog":
            y = y + bias[h].double()
            pos, neg = y.exp() / y.exp().sum(), (-y[:rest]).exp() / (-y[:rest]).exp().sum()
            out[b, h, t] = torch.cat([pos, neg])
        else:
            both = torch.cat([y, -y[:rest]]).exp()
            out[b, h, t] = both / both.sum()
    return out


@pytest.mark.parametrize("name", ["hedgehog", "hedgehog_joint"])
@pytest.mark.parametrize("m", [1, 7, 32, 40])  # d' < d, d' = d (M = 2d), d' > d (noise columns)
def test_hedgehog_matches_formula(name, m):
    fm = build_feature_map(name, H, D, m, seed=2)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():  # move away from the identity init so W and b both matter
        fm.weight.add_(0.3 * torch.randn(fm.weight.shape, generator=g))
        if name == "hedgehog":
            fm.bias.copy_(torch.randn(fm.bias.shape, generator=g))
    x = _inputs(seed=6)
    expected = _hedgehog_reference(name, fm.weight.detach(), getattr(fm, "bias", None), x, m)
    torch.testing.assert_close(fm(x).double(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("m", [1, 5, 64])
def test_hedgehog_halves_are_distributions(m):
    x = _inputs(norm=3.0)
    half = math.ceil(m / 2)
    phi = build_feature_map("hedgehog", H, D, m)(x)
    torch.testing.assert_close(phi[..., :half].sum(-1), torch.ones(B, H, T))
    if m > 1:
        torch.testing.assert_close(phi[..., half:].sum(-1), torch.ones(B, H, T))
    joint = build_feature_map("hedgehog_joint", H, D, m)(x)
    torch.testing.assert_close(joint.sum(-1), torch.ones(B, H, T))


@pytest.mark.parametrize("name", ["hedgehog", "hedgehog_joint"])
def test_hedgehog_init_is_identity(name):
    fm = build_feature_map(name, H, D, 2 * D + 8, seed=3)  # d' = d + 4: four noise columns
    assert fm.weight.shape == (H, D, D + 4)
    torch.testing.assert_close(fm.weight[:, :, :D].detach(), torch.eye(D).expand(H, D, D))
    noise = fm.weight[:, :, D:].detach()
    assert 0 < noise.abs().max() < 0.2
    assert torch.equal(noise, build_feature_map(name, H, D, 2 * D + 8, seed=3).weight[:, :, D:].detach())
    if name == "hedgehog":
        assert torch.equal(fm.bias.detach(), torch.zeros(H, D + 4))
        x = _inputs()  # at M = 2d the map starts as [softmax(x), softmax(−x)]
        expected = torch.cat([torch.log_softmax(x, -1), torch.log_softmax(-x, -1)], -1)
        torch.testing.assert_close(build_feature_map(name, H, D, 2 * D).log_features(x), expected)


@pytest.mark.parametrize("name", ["hedgehog", "hedgehog_joint"])
def test_hedgehog_state_dict_round_trip(name):
    import io

    fm = build_feature_map(name, H, D, 10, seed=1)
    with torch.no_grad():
        for p in fm.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    buffer = io.BytesIO()
    torch.save(fm.state_dict(), buffer)
    buffer.seek(0)
    other = build_feature_map(name, H, D, 10, seed=7)
    x = _inputs()
    assert not torch.allclose(other.log_features(x), fm.log_features(x))
    other.load_state_dict(torch.load(buffer))
    assert set(other.state_dict()) == ({"weight", "bias"} if name == "hedgehog" else {"weight"})
    assert torch.equal(other.log_features(x), fm.log_features(x))


def test_elu1_starts_at_one_plus_elu():
    x = _inputs(norm=30.0)  # large norms: both branches, far from zero
    phi = build_feature_map("elu1", H, D, D)(x)
    torch.testing.assert_close(phi, 1 + torch.nn.functional.elu(x))


@pytest.mark.parametrize("x_grad", [False, True])
def test_prf_fast_form_matches_reference_values_and_gradients(x_grad):
    """The fused PRF (folded scale, in-place bias) equals the term-by-term formula, gradients too."""
    from dofla.feature_maps.performer import prf_log_features, prf_log_features_reference

    fm = build_feature_map("learned_prf", H, D, 7, seed=2)
    with torch.no_grad():
        fm.alpha_param.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(3))
    x = (_inputs(seed=4) * 2).double().requires_grad_(x_grad)
    fm = fm.double()
    w = torch.randn(B, H, T, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    results = []
    for form in (prf_log_features, prf_log_features_reference):
        out = form(x, fm.z, fm.log_alpha())
        leaves = [fm.z, fm.alpha_param] + ([x] if x_grad else [])
        results.append((out, torch.autograd.grad((out * w).sum(), leaves)))
    (fast, fast_grads), (ref, ref_grads) = results
    torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(fast_grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # the no-grad route (norm instead of squares) agrees as well
        torch.testing.assert_close(prf_log_features(x, fm.z, None), prf_log_features_reference(x, fm.z, None))
