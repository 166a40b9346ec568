"""The causal layerwise losses without (L, L) matrices: on the stabiliser's pieces, or as outputs.

:func:`dofla.attention.stable.kernel_slabs` cuts the causal (L, L) kernel into pieces: per block of
128 keys, its diagonal rows (row a sees the block's first a + 1 keys) and the rows after them (they
see the whole block). The losses here compute both the student's and the teacher's side on those
pieces and merge them per row, like flash attention's online softmax: no (L, L) tensor exists on
either side, the keys a row cannot see are never computed, and only the pieces themselves are held
for the backward. :mod:`dofla.train.losses` keeps the plain (L, L) forms beside them: the tests
compare the two. Hybrid layers (a window) and non-causal rows use the plain forms, except for the
``output`` loss, which compares attention outputs and so runs the student's own chunked kernels
(linear or hybrid, O(L) memory) against the teacher's fused attention.

Layouts as in :mod:`dofla.train.losses`: log_q, log_k (B, H, L, M); q, k (B, H, L, d).
"""
from __future__ import annotations

import torch

from dofla.attention.hybrid import exact_logits, hybrid_attention_chunked
from dofla.attention.linear import linear_attention_chunked
from dofla.attention.stable import kernel_slabs, merge_normaliser, widened

pad = torch.nn.functional.pad


def check_softcap(softcap: float | None) -> None:
    if softcap is not None and not softcap > 0:
        raise ValueError(f"loss option softcap={softcap!r} must be a positive number (or None for no capping)")


@torch.no_grad()
def teacher_logits_piece(q: torch.Tensor, k: torch.Tensor, softcap, diagonal: bool) -> torch.Tensor:
    """The teacher's logits of a piece of rows against a block of keys (q already scaled by
    1/sqrt(d)), soft-capped when asked, −inf on the keys a diagonal piece's row cannot see."""
    s = widened(q @ k.transpose(-1, -2))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if diagonal:
        s.masked_fill_(hidden(s), float("-inf"))
    return s


def hidden(x: torch.Tensor) -> torch.Tensor:
    """(R, n) bool: the keys row a of a diagonal piece cannot see (those after key a)."""
    return torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).triu_(1)


def per_row(pieces: list, length: int, index: int, value: float) -> torch.Tensor:
    """(B, H, L, P): entry ``index`` (B, H, R, 1) of every piece (row0, ...) placed at its rows,
    one column per piece, ``value`` where a piece has no row."""
    return torch.cat([pad(piece[index], (0, 0, piece[0], length - piece[0] - piece[index].shape[2]), value=value)
                      for piece in pieces], dim=-1)


def row_sum(parts: list, length: int) -> torch.Tensor:
    """(B, H, L, 1): Σ over pieces of (row0, x (B, H, R, 1)) per row."""
    return per_row(parts, length, 1, 0.0).sum(-1, keepdim=True)


def teacher_weighted(pieces: list, length: int) -> torch.Tensor:
    """(B, H, L, 1) Σ_j p_ij · x_ij from per-piece (row0, m, z, x) with z = Σ e and x = Σ e·x over
    the piece's keys: the teacher's softmax p_ij = e_ij e^{m − M_i} / Σ_pieces z e^{m − M_i}, M_i the
    row's largest logit, assembled per row without ever forming the (L, L) attention."""
    m, z, x = per_row(pieces, length, 1, float("-inf")), per_row(pieces, length, 2, 0.0), per_row(pieces, length, 3, 0.0)
    w = torch.exp(m - m.amax(-1, keepdim=True))
    return (w * x).sum(-1, keepdim=True) / (w * z).sum(-1, keepdim=True)


def _linear_pieces(log_q, log_k, q, k, softcap, window: int = 0, sinks: int = 0):
    """Yield (row0, scores, r, diagonal, teacher logits) for every piece of the keys K̂ approximates
    (the student's scores with their graph, the teacher's logits without): every key a row sees,
    or for a hybrid layer the keys sinks ≤ j ≤ i − window (the stabiliser runs on the keys after
    the sinks, so no piece holds a key it must hide)."""
    check_softcap(softcap)
    qs = q * q.shape[-1] ** -0.5  # the teacher's scale on q once, not on every logit
    for row0, start, scores, r, diagonal in kernel_slabs(log_q, log_k[:, :, sinks:], window + sinks):
        rows, n = scores.shape[2], scores.shape[3]
        keys = k[:, :, sinks + start:sinks + start + n]
        yield row0, scores, r, diagonal, teacher_logits_piece(qs[:, :, row0:row0 + rows], keys, softcap, diagonal)


@torch.no_grad()
def exact_band(q, k, window: int, sinks: int, softcap, block: int = 128) -> list:
    """[(row0, s (B, H, R, n))]: a hybrid layer's exact logits per block of rows, against the keys
    its rows see exactly (the last ``window`` and the first ``sinks``), −inf on the rest; R·(window
    + R + sinks) entries per block instead of a row's L. q, k (B, H, L, d), q not yet scaled."""
    if window <= 0:
        return []
    qs, length, out = q * q.shape[-1] ** -0.5, q.shape[2], []
    for row0 in range(0, length, block):
        end = min(length, row0 + block)
        low = max(0, row0 - window + 1)
        keys = torch.cat([torch.arange(min(sinks, low)), torch.arange(low, end)]).to(k.device)
        s = teacher_logits_piece(qs[:, :, row0:end], k[:, :, keys], softcap, diagonal=False)
        i, j = torch.arange(row0, end, device=k.device)[:, None], keys[None, :]
        out.append((row0, s.masked_fill_(~((j <= i) & ((j > i - window) | (j < sinks))), float("-inf"))))
    return out


def _band_stats(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, z, x) of a band piece: its row maxima, Σ e and Σ e·s with e = exp(s − m)."""
    m = s.amax(-1, keepdim=True)  # every row sees itself exactly: finite
    e = torch.exp(s - m)
    return m, e.sum(-1, keepdim=True), (e * s.clamp_min(torch.finfo(s.dtype).min)).sum(-1, keepdim=True)


def _row_max(slabs: list, band: list, length: int) -> torch.Tensor:
    """(B, H, L, 1): the teacher's largest visible logit per row, over every piece and band block."""
    maxima = [(row0, s.amax(-1, keepdim=True)) for row0, *_, s in slabs + band]
    return per_row(maxima, length, 1, float("-inf")).amax(-1, keepdim=True)


def _visible_sum(row0: int, sq: torch.Tensor, diagonal: bool) -> tuple[int, torch.Tensor]:
    """(row0, Σ over the keys each row sees) of a piece's squared errors."""
    return row0, (sq.masked_fill(hidden(sq), 0.0) if diagonal else sq).sum(-1, keepdim=True)


def log_student(scores: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """log K̂ of a piece, floored at the smallest normal number (as the plain form's)."""
    return r + torch.log(scores.clamp_min(torch.finfo(scores.dtype).tiny))


def l2_kernel(log_q, log_k, q, k, scale: str, softcap, limit: float, saturating_exp,
              window: int = 0, sinks: int = 0) -> torch.Tensor:
    """The ``l2`` loss's ``row_max`` / ``none`` forms on pieces: Σ (K_ij − K̂_ij)² per row over the
    keys K̂ approximates (both relative to the teacher's largest visible logit for ``row_max``, a
    hybrid's exact keys included), in float64, mean over rows."""
    length = log_q.shape[2]
    slabs = list(_linear_pieces(log_q, log_k, q, k, softcap, window, sinks))
    if not slabs:  # a hybrid whose window and sinks cover every row: no approximated key
        return _on_graph(log_q.new_zeros((), dtype=torch.float64), log_q)
    top = None
    if scale == "row_max":
        top = _row_max(slabs, exact_band(q, k, window, sinks, softcap), length).double()
    parts = []
    for row0, scores, r, diagonal, s in slabs:
        ref = 0.0 if top is None else top[:, :, row0:row0 + s.shape[2]]
        teacher = torch.exp((s.double() - ref).clamp_max(limit))  # 0 on hidden keys
        sq = (teacher - saturating_exp(log_student(scores, r).double() - ref, limit)).pow(2)
        parts.append(_visible_sum(row0, sq, diagonal))
    return _on_graph(row_sum(parts, length).mean(), log_q)


def l2_rows(log_q, log_k, q, k, softcap, window: int = 0, sinks: int = 0) -> torch.Tensor:
    """The ``l2`` loss's ``rows`` form on pieces: Σ_j (p_ij − p̂_ij)² between the normalised rows
    (a hybrid's p̂ includes its exact keys, whose logits are the teacher's)."""
    length = log_q.shape[2]
    slabs = list(_linear_pieces(log_q, log_k, q, k, softcap, window, sinks))
    band = exact_band(q, k, window, sinks, softcap)
    top = _row_max(slabs, band, length)
    norm = row_sum([(row0, torch.exp(s - top[:, :, row0:row0 + s.shape[2]]).sum(-1, keepdim=True))
                    for row0, *_, s in slabs + band], length)
    tiny = torch.finfo(log_q.dtype).tiny
    log_norm = merge_normaliser([(row0, r + torch.log(scores.sum(-1, keepdim=True).clamp_min(tiny)))
                                 for row0, scores, r, *_ in slabs]
                                + [(row0, torch.logsumexp(s, -1, keepdim=True)) for row0, s in band], length, log_q)
    parts = []
    for row0, scores, r, diagonal, s in slabs:
        rows = slice(row0, row0 + s.shape[2])
        p = torch.exp(s - top[:, :, rows]) / norm[:, :, rows]
        p_hat = torch.exp(log_student(scores, r) - log_norm[:, :, rows])
        parts.append(_visible_sum(row0, (p - p_hat).pow(2), diagonal))
    for row0, s in band:  # exact keys: the same logits, different normalisers (0 − 0 on the rest)
        rows = slice(row0, row0 + s.shape[2])
        p = torch.exp(s - top[:, :, rows]) / norm[:, :, rows]
        parts.append((row0, (p - torch.exp(s - log_norm[:, :, rows])).pow(2).sum(-1, keepdim=True)))
    return _on_graph(row_sum(parts, length).mean(), log_q)


def cross_entropy(log_q, log_k, q, k, softcap, log_floor, window: int = 0, sinks: int = 0) -> torch.Tensor:
    """The ``softmax`` loss on pieces: CE_i = log Σ_{j≤i} K̂_ij − Σ_j p_ij log K̂_ij, mean over rows;
    per piece only the teacher's row maxima, Σ e and Σ e·log K̂ are kept (:func:`teacher_weighted`).
    A hybrid layer's exact keys enter both sums with the teacher's logits, block by block of rows
    (:func:`exact_band`)."""
    pieces, parts = [], []
    for row0, scores, r, diagonal, s in _linear_pieces(log_q, log_k, q, k, softcap, window, sinks):
        m = s.amax(-1, keepdim=True)
        e = s.sub_(m).exp_()  # the teacher's logits carry no graph: in place
        z = e.sum(-1, keepdim=True)
        pieces.append((row0, m, z, (e * log_floor(scores)).sum(-1, keepdim=True) + r * z))
        parts.append((row0, r + log_floor(scores.sum(-1, keepdim=True))))
    for row0, s in exact_band(q, k, window, sinks, softcap):
        m, z, x = _band_stats(s)
        pieces.append((row0, m, z, x))
        parts.append((row0, m + torch.log(z)))
    length = log_q.shape[2]
    return _on_graph((merge_normaliser(parts, length, log_q) - teacher_weighted(pieces, length)).mean(), log_q)


def _on_graph(loss: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``loss``, tied to the features' graph with a zero gradient when no key was approximated (a
    hybrid whose window and sinks cover every row), as the plain forms are."""
    return loss + 0.0 * log_q.sum() if log_q.requires_grad and not loss.requires_grad else loss


@torch.no_grad()
def teacher_output(q, k, v, softcap=None) -> torch.Tensor:
    """The teacher's causal attention output (B, H, L, dv) at ≥ fp32: fused, or with ``softcap`` the
    capped softmax."""
    if softcap is None:
        return widened(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    s = exact_logits(q, k, softcap)
    return widened(torch.softmax(s.masked_fill(hidden(s), float("-inf")), -1) @ v)


def output_error(log_q, log_k, q, k, v, window: int, sinks: int, softcap, student=None) -> torch.Tensor:
    """The ``output`` loss of a causal layer, Σ‖y − ŷ‖² / Σ‖y‖²: ŷ from the student's chunked
    kernel (linear, or hybrid with its window and sinks; ``student``: a gated-delta layer's own
    attention), y from the teacher's fused causal attention (``scaled_dot_product_attention``; with
    ``softcap`` its capped softmax, no graph)."""
    check_softcap(softcap)
    y = teacher_output(q, k, v, softcap)
    if student is not None:
        y_hat, _ = student.attend(q, k, v, log_q=log_q, log_k=log_k, window=window, sinks=sinks, softcap=softcap)
    elif window > 0:
        y_hat, _ = hybrid_attention_chunked(q, k, v, log_q, log_k, window, sinks=sinks, softcap=softcap)
    else:
        y_hat, _ = linear_attention_chunked(log_q, log_k, v)
    return (widened(y_hat) - y).pow(2).sum() / y.pow(2).sum().clamp_min(torch.finfo(y.dtype).tiny)
