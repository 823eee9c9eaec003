"""Planners: which (step, sample) pairs run with grad, and how every step's g folds onto them.

Every JAGG call executes a :class:`Plan`.  A plan is an anchor mask A (T, B) — the pairs
whose velocity is recomputed with grad — and the interpolation weights of every other
pair, set by the *fold* (:data:`FOLDS`, :func:`interpolation_weights`).  For sample b and
a step k strictly between its anchors p < k < q:

* ``fold="linear"`` (JAGG's):  alpha = (t_k - t_p) / (t_q - t_p),  w_cur = 1 - alpha
  (onto p), w_nxt = alpha (onto q);
* ``fold="causal"``:  w_cur = 1, w_nxt = 0 — each step folds onto the anchor at or
  before it only (on a prefix of the sampler's steps the trainer places its uniform
  anchors by :func:`~jagg_autograd.layout.causal_layout`).

(an anchor: w_cur = 1, w_nxt = 0; a step before the sample's first anchor: 0, 0, and after
its last anchor: linear 0, 0, causal 1, 0 — such steps must carry zero upstream gradient
for the linear fold.)  The planners differ only in the mask:

* :func:`uniform_mask` — today's layout: the same anchor steps for every sample; a
  router's routed-out (window, sample) pairs make every step of that window an anchor
  (the exact gradient there);
* :func:`exact_mask` — every pair (the exact gradient);
* :func:`adaptive_choice` — per-sample anchor sets chosen after the loss, knowing g: each
  sample's set minimises the proxy  sum_k ||g_k|| * ||v_k - v_hat_k||  (v_hat_k the
  fold's reconstruction of v_k from the step's anchors) for its anchor count, by dynamic
  programming over Gram matrices; every sample gets the same count (see below).
* :func:`stochastic_choice` — a base layout per sample and a random subset (the caller's
  generator, nothing else) promoted to a larger one, sample b with probability pi_b and
  its rows re-weighted by 1/pi_b, so the expectation over the draw is the larger layout's
  fold for every batch (:class:`Plan`'s ``promotion``): nested ``causal_layout`` sets
  (``promote_to="anchor"``, the causal fold) or every active step (``"exact"``: the exact
  gradient in expectation, from a causal or linear base).  pi_b may depend on anything,
  the advantage included: a random decision with known odds, undone by its weight, is the
  one kind the invariant below allows.

Bias and the group-fairness invariant
-------------------------------------
In GRPO g_{k,b} = A_b h_{k,b}: the advantage A_b scales every step of sample b.  With
unit advantages the exact gradient sum_k J_k^T h_k is a score function with mean 0, since
E[h_k | x_0..x_k] = 0 and J_k depends on x_k only.  The linear fold moves part of g_k onto
the LATER anchor q, whose x_q depends on step k's own SDE noise, so E[J_q^T h_k] != 0: the
linear fold has a mean error per sample, beta_b (``benchmarks/bias_probe.py``, digits
DiT, unit advantages, 4 uniform anchors of 10 steps, 24 batches: 1.58x the RMS of a
batch's exact gradient at the pretrained policy and 1.27x after 15 exact GRPO steps,
systematic share 0.96 / 0.94; causal fold 0.000 / 0.016, share -0.002 / +0.002, at the
floor).  It cancels in  sum_b A_b beta_b  only when the advantages have mean zero AND
nothing the estimator decides per sample depends on A.  Hence the invariant:

    **an estimator's anchor counts (and anything else it decides per sample) must not
    depend on the advantage — in practice every sample of a group gets the same count.**

The adaptive planner honours it: it depends on g only through which steps are zero and
through the shape of each sample's proxy curve, never its scale (scaling one sample's g
by any c > 0 changes no count and no position).  Its positions still depend on the
trajectory (v and the profile of ||g_k||, hence on the SDE noise), which leaves a small
selection bias: measured (same probe) systematic share +0.009 / +0.014 with GRPO
advantages (floor SD 0.005; the greedy split: +0.098 / +0.092), and with unit
advantages even the causal fold's adaptive positions give +0.018 / +0.030 where its
uniform anchors give -0.002 / +0.002.  Its former greedy split of the budget by
absolute proxy reduction gave samples with large |A| more anchors (Spearman 0.94 with
|A| on digits) and a bias of 1-2x the GRPO signal.  The causal fold has no noise-driven
mean error for any advantages (no zero-mean baseline needed) but is less accurate per
batch; the mean error it keeps is the held Jacobian's (shapes, groups of 16, anchors
{0, 3} of 5 steps: systematic share 3.4 floor SDs, the linear fold's 10.7; at the floor
with 3 anchors and at the adaptive planner's {0, 4}, though that fold stalls 14 % short
of exact over 250 steps: benchmarks/results/shapes/SHAPES.md).

:func:`choose_plan` is the one place that decides which of them a call runs, from the
parsed call (``jagg_autograd.call``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from jagg_autograd.layout import causal_layout
from jagg_autograd.mix import anchor_neighbours
from jagg_autograd.router import cosine_route

if TYPE_CHECKING:
    from jagg_autograd.call import JaggCall


@dataclass
class Plan:
    """One call's plan.

    anchor_mask: (T, B) bool, the pairs run with grad.
    w_cur, w_nxt: (T, B) float64 interpolation weights (see the module docstring).
    slots: (T, B) int64, the row of each anchor pair in the with-grad velocities (-1
        elsewhere): the rows of ``whole_steps`` first (step j of the list, sample b at
        j * B + b: one stacked call), then the remaining anchor pairs in step-major order.
    whole_steps: anchor steps run for every sample as whole-step calls (eager layout).
    pair_k, pair_b: (n,) the remaining anchor pairs, step-major, in row order.
    promotion: placement="stochastic" only: (src, inv_pi, fsrc, fdst, fw, finv) -- src
        (m,) int64 the rows of the promoted anchors and inv_pi (m,) float64 their samples'
        1 / pi_b; fsrc, fdst (e,) int64 a promoted row and a base anchor's row that the
        base layout's fold puts (part of) its segment onto, fw (e,) float64 that fold
        weight and finv (e,) float64 the sample's 1 / pi_b; applied to the folded rows by
        :func:`apply_promotion`.  None elsewhere.
    """

    anchor_mask: torch.Tensor
    w_cur: torch.Tensor
    w_nxt: torch.Tensor
    slots: torch.Tensor
    whole_steps: list[int]
    pair_k: torch.Tensor
    pair_b: torch.Tensor
    promotion: tuple[torch.Tensor, ...] | None = None

    @property
    def n_rows(self) -> int:
        """Number of with-grad (step, sample) evaluations."""
        return len(self.whole_steps) * self.anchor_mask.shape[1] + self.pair_k.numel()


FOLDS = ("linear", "causal")
"""How a step's upstream gradient folds onto its anchors (see the module docstring)."""


def check_fold(fold: object) -> str:
    """``fold`` itself if it is one of :data:`FOLDS`, else a ValueError naming the argument."""
    if not isinstance(fold, str) or fold not in FOLDS:
        raise ValueError(f"fold must be one of {FOLDS}, got {fold!r}")
    return fold


def interpolation_weights(
    anchor_mask: torch.Tensor, t64: torch.Tensor, fold: str = "linear"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_cur, w_nxt) float64 (T, B) for per-sample anchors ``anchor_mask`` at ``t64`` (T, B).

    fold="linear" (JAGG's t-linear fold): a step k between anchors p < k < q gets
    w_cur = 1 - alpha, w_nxt = alpha, alpha = (t_k - t_p) / (t_q - t_p); steps before the
    first or after the last anchor get 0, 0.  It is exact when J is affine in t on the
    anchors' points, but it is only *unbiased* for GRPO when the advantages have mean zero
    (group-normalised) AND nothing decided per sample (anchor counts, routing, subsets)
    depends on the advantage: the later anchor's x_q depends on step k's SDE noise, so
    E[J_q^T h_k] != 0 for a score-function upstream h_k, and only  sum_b A_b (...)  with
    zero-mean A and A-independent per-sample layouts cancels it (module docstring).

    fold="causal": every step folds onto the anchor at or before it only: w_cur = 1,
    w_nxt = 0 (steps before the first anchor 0, 0).  Unbiased for any advantages (J_p with
    p <= k does not depend on step k's noise); exact when J is constant in t on the
    sample's steps; less accurate per batch than the linear fold.
    """
    check_fold(fold)
    T, B = anchor_mask.shape
    prev, nxt = anchor_neighbours(anchor_mask)  # last anchor <= k, first anchor >= k
    if fold == "causal":
        w_cur = torch.where(prev >= 0, 1.0, 0.0).to(torch.float64)
        return w_cur, torch.zeros_like(w_cur)
    inside = (prev >= 0) & (nxt < T) & ~anchor_mask
    p = prev.clamp(0, T - 1)
    q = nxt.clamp(0, T - 1)
    tp, tq = t64.gather(0, p), t64.gather(0, q)
    alpha = torch.where(inside, (t64 - tp) / torch.where(inside, tq - tp, 1.0), 0.0)
    w_cur = torch.where(anchor_mask, 1.0, torch.where(inside, 1.0 - alpha, 0.0))
    w_nxt = torch.where(inside, alpha, 0.0)
    return w_cur.to(torch.float64), w_nxt.to(torch.float64)


def make_plan(
    anchor_mask: torch.Tensor,
    t64: torch.Tensor,
    whole_steps: list[int] | None = None,
    *,
    fold: str = "linear",
    promoted: StochasticChoice | None = None,
) -> Plan:
    """The plan of ``anchor_mask``; ``whole_steps`` (all True in the mask) get the first rows;
    ``fold``: the interpolation weights' fold (:func:`interpolation_weights`); ``promoted``:
    the stochastic planner's promotions (their pairs are anchors of the mask)."""
    T, B = anchor_mask.shape
    dev = anchor_mask.device
    whole = list(whole_steps or [])
    w_cur, w_nxt = interpolation_weights(anchor_mask, t64, fold)
    slots = torch.full((T, B), -1, dtype=torch.long, device=dev)
    if whole:
        idx = torch.tensor(whole, dtype=torch.long, device=dev)
        slots[idx] = torch.arange(len(whole) * B, device=dev).view(len(whole), B)
    rest = anchor_mask.clone()
    if whole:
        rest[idx] = False
    ks, bs = rest.nonzero(as_tuple=True)  # step-major
    slots[ks, bs] = len(whole) * B + torch.arange(ks.numel(), device=dev)
    promotion = None
    if promoted is not None and promoted.b.numel():
        src = slots[promoted.k, promoted.b]
        fsrc = slots[promoted.fold_k, promoted.fold_b]
        fdst = slots[promoted.fold_dst, promoted.fold_b]
        finv = 1.0 / promoted.pi[promoted.fold_b]
        promotion = (src, promoted.inv_pi, fsrc, fdst, promoted.fold_w, finv)
    return Plan(anchor_mask, w_cur, w_nxt, slots, whole, ks, bs, promotion)


# ------------------------------------------------------------------------------ uniform


def uniform_mask(
    T: int,
    B: int,
    anchors: list[int],
    windows: list[tuple[int, int]],
    routed: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """Shared anchor steps; routed (n_windows, B) pairs make their window's steps anchors."""
    mask = torch.zeros((T, B), dtype=torch.bool, device=device)
    mask[anchors] = True
    if routed is not None:
        for i, (lo, hi) in enumerate(windows):
            if hi - lo >= 2:
                mask[lo + 1 : hi] |= routed[i]
    return mask


def exact_mask(T: int, B: int, device: torch.device) -> torch.Tensor:
    """Every pair with grad: the exact gradient."""
    return torch.ones((T, B), dtype=torch.bool, device=device)


# ----------------------------------------------------------------------------- adaptive


def segment_costs(
    values: torch.Tensor, upstream: torch.Tensor, t64: torch.Tensor, fold: str = "linear"
) -> torch.Tensor:
    """C[b, p, q] = sum_{p<k<q} ||g_k|| ||v_k - (1-a_k) v_p - a_k v_q||, (B, T, T) float64.

    fold="causal": a_k = 0 (the reconstruction of v_k is v_p, the fold's zero-order hold),
    and only each sample's mean over steps is subtracted (the causal residual is invariant
    to constants, not to a slope in t).

    values, upstream: (T, B, N); t64: (T, B).  The residual norms come from each sample's
    Gram matrix of its velocities (one batched matmul) rather than from the (T^3, N)
    residuals themselves.  Each sample's affine-in-t fit is subtracted first: the residual
    of the t-linear interpolation is zero on anything affine in t, so this leaves it
    unchanged and keeps the Gram expansion free of cancellation between large norms.
    Entries with q <= p + 1 are 0.
    """
    T, B, _ = values.shape
    acc = torch.float64 if values.dtype == torch.float64 else torch.float32
    v = values.to(acc).transpose(0, 1)  # (B, T, N)
    # Remove each sample's least-squares affine fit in t: the residual annihilates
    # anything affine in t, and what is left is small, so the Gram expansion does not
    # cancel large norms (float32 velocities of a nearly linear trajectory).
    tt = t64.T.to(acc)  # (B, T)
    tc = tt - tt.mean(1, keepdim=True)
    v = v - v.mean(1, keepdim=True)
    if fold == "linear":
        slope = (tc[:, :, None] * v).sum(1, keepdim=True) / tc.square().sum(1)[:, None, None]
        v = v - tc[:, :, None] * slope
    gram = torch.bmm(v, v.transpose(1, 2)).to(torch.float64)  # (B, T, T)
    gnorm = upstream.to(acc).norm(dim=-1).to(torch.float64).T  # (B, T)
    t = t64.T  # (B, T)
    # Index order [b, p, k, q].
    tp, tk, tq = t[:, :, None, None], t[:, None, :, None], t[:, None, None, :]
    idx = torch.arange(T, device=values.device)
    between = (idx[:, None, None] < idx[None, :, None]) & (idx[None, :, None] < idx[None, None, :])
    den = torch.where(between, tq - tp, 1.0)
    a = torch.where(between, (tk - tp) / den, 0.0)
    if fold == "causal":
        a = torch.zeros_like(a)
    b1 = 1.0 - a
    diag = gram.diagonal(dim1=1, dim2=2)  # (B, T)
    m_kk = diag[:, None, :, None]
    m_pp = diag[:, :, None, None]
    m_qq = diag[:, None, None, :]
    m_kp = gram.transpose(1, 2)[:, :, :, None]  # [b, p, k] = M[k, p]
    m_kq = gram[:, None, :, :]  # [b, k, q]
    m_pq = gram[:, :, None, :]  # [b, p, q]
    sq = m_kk + b1 * b1 * m_pp + a * a * m_qq - 2 * b1 * m_kp - 2 * a * m_kq + 2 * a * b1 * m_pq
    res = sq.clamp_min(0).sqrt() * gnorm[:, None, :, None]
    return torch.where(between, res, 0.0).sum(2)


@dataclass
class AdaptiveChoice:
    """The adaptive planner's decision.

    mask: (T, B) bool anchors; counts: (B,) anchors per sample; cost: (B,) proxy of the
    chosen sets; curve: (B, T + 1) best proxy for each anchor count (inf: impossible);
    level: the count every sample with >= ``level`` active steps gets before the remainder
    (0 under the legacy greedy split).
    """

    mask: torch.Tensor
    counts: torch.Tensor
    cost: torch.Tensor
    curve: torch.Tensor
    level: int = 0


def _active_range(upstream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First and last step with a non-zero upstream gradient per sample, and their count."""
    T = upstream.shape[0]
    nz = upstream.flatten(2).ne(0).any(-1)  # (T, B)
    steps = torch.arange(T, device=upstream.device).unsqueeze(1)
    first = torch.where(nz, steps, T).amin(0)
    last = torch.where(nz, steps, -1).amax(0)
    n = (last - first + 1).clamp_min(0)
    return first, last, n


def _fair_counts(curve: torch.Tensor, n_act: torch.Tensor, total: int) -> tuple[torch.Tensor, int]:
    """Group-fair anchor counts (B,) on the host and the common level L.

    Samples with no active step get 0, one active step 1.  The others share the rest
    equally: the largest level L with sum_b min(L, n_b) <= the rest (n_b: the sample's
    active steps, so a sample capped at n_b hands its share to the others -- this depends
    on which steps of g are zero, not on g's scale).  The remainder r (fewer than the
    samples with n_b > L) gives one more anchor each to the r samples whose *normalised*
    gain (curve_b[L] - curve_b[L+1]) / curve_b[2] is largest (ties: lower index): dividing
    by the sample's own 2-anchor proxy removes the scale of its g, hence |A|.
    """
    B = n_act.shape[0]
    T = curve.shape[1] - 1
    counts = n_act.clamp(max=2).clone()
    elig = n_act >= 2
    if not bool(elig.any()):
        return counts, 0
    room = int(total) - int(counts[~elig].sum())
    cap = n_act[elig]
    level = 2
    for lv in range(3, T + 1):
        if int(cap.clamp(max=lv).sum()) > room:
            break
        level = lv
    counts[elig] = cap.clamp(max=level)
    rem = room - int(counts[elig].sum())
    cand = elig & (n_act > level)
    if rem > 0 and bool(cand.any()) and level < T:
        cols = torch.arange(B)
        c2 = curve[:, 2]
        drop = curve[cols, level] - curve[cols, level + 1]
        ok = cand & torch.isfinite(drop) & (c2 > 0)
        gain = torch.where(ok, drop / torch.where(ok, c2, 1.0), 0.0)
        gain = torch.where(cand, gain, -torch.inf)
        order = torch.sort(-gain, stable=True).indices
        take = order[: min(rem, int(cand.sum()))]
        counts[take] += 1
    return counts, level


def _greedy_counts(curve: torch.Tensor, n_act: torch.Tensor, total: int) -> torch.Tensor:
    """The former split (NOT group-fair; kept for the tests and the bias benchmark that
    show why it was replaced): after 2 each, anchors go one at a time to the sample whose
    proxy drops most, so samples with a large |A| (a large g) get more anchors."""
    B, T = curve.shape[0], curve.shape[1] - 1
    counts = n_act.clamp(max=2).clone()
    cols = torch.arange(B)
    remaining = int(total) - int(counts.sum())

    def gains(c: torch.Tensor) -> torch.Tensor:
        nxt = (c + 1).clamp(max=T)
        g_ = curve[cols, c] - curve[cols, nxt]
        return torch.where((c + 1 <= n_act) & (c >= 2), g_, -torch.inf)

    gain = gains(counts)
    for _ in range(max(remaining, 0)):
        b = int(torch.argmax(gain))
        if not bool(torch.isfinite(gain[b])):
            break
        counts[b] += 1
        gain[b] = gains(counts)[b]
    return counts


def adaptive_choice(
    values: torch.Tensor,
    upstream: torch.Tensor,
    t64: torch.Tensor,
    total: int,
    *,
    fold: str = "linear",
    _greedy: bool = False,
) -> AdaptiveChoice:
    """Per-sample anchor sets minimising the proxy with ``total`` anchors over the batch.

    values, upstream: (T, B, *S); t64: (T, B).  A sample's anchors span its first to
    last step with a non-zero upstream gradient (both are anchors; a sample whose g is
    zero everywhere gets none, one non-zero step gets one).

    Counts are group-fair (module docstring): every sample gets the same count L (the
    budget per sample, rounded down; a sample with fewer than L active steps gets them all
    and its share goes to the others), and the remainder -- fewer anchors than samples --
    one more each to the samples whose proxy curve, divided by its own 2-anchor value,
    drops most (:func:`_fair_counts`).  Nothing depends on the scale of a sample's g: the
    remainder uses scale-free curves, and the positions, each sample's optimal set for its
    count by dynamic programming, scale with g as a whole.  ``fold``: the proxy's
    reconstruction (:func:`segment_costs`).  ``total`` is honoured exactly unless the
    minimums exceed it or every sample already has all its steps as anchors.

    ``_greedy=True`` restores the former budget split by absolute proxy reduction, which
    correlates counts with |A| and biases GRPO's gradient; private, for the tests and the
    bias benchmark only.
    """
    check_fold(fold)
    T, B = values.shape[:2]
    dev = values.device
    v = values.reshape(T, B, -1)
    g = upstream.reshape(T, B, -1)
    first, last, n_act = _active_range(g)
    C = segment_costs(v, g, t64, fold)  # (B, T, T)
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=dev)
    steps = torch.arange(T, device=dev)
    # D[b, q]: best proxy of m anchors from first[b] with the m-th at q.
    D = torch.where(steps[None, :] == first[:, None], 0.0, inf).to(torch.float64)
    back = torch.zeros((T + 1, B, T), dtype=torch.long, device=dev)
    curve = torch.full((B, T + 1), float("inf"), dtype=torch.float64, device=dev)
    lastc = last.clamp(0, T - 1)
    curve[:, 0] = torch.where(n_act == 0, 0.0, inf)
    curve[:, 1] = torch.where(n_act == 1, 0.0, inf)
    for m in range(2, T + 1):
        # cand[b, p, q] = D[b, p] + C[b, p, q], allowed for p < q only.
        cand = D[:, :, None] + torch.where(steps[:, None] < steps[None, :], C, inf)
        D, back[m] = cand.min(1)
        curve[:, m] = torch.where(n_act >= 2, D.gather(1, lastc[:, None])[:, 0], inf)
    # The split of the budget runs on the host: the (B, T + 1) curve is tiny.
    n_host = n_act.cpu()
    curve_h = curve.cpu()
    if _greedy:
        counts_h, level = _greedy_counts(curve_h, n_host, total), 0
    else:
        counts_h, level = _fair_counts(curve_h, n_host, total)
    counts = counts_h.to(dev)
    mask = torch.zeros((T, B), dtype=torch.bool, device=dev)
    # Backtrack every sample's optimal set for its count (vectorised over samples).
    cols = torch.arange(B, device=dev)
    q = lastc.clone()
    for j in range(T, 1, -1):
        on = counts >= j
        mask[q, cols] = mask[q, cols] | on
        q = torch.where(on, back[j].gather(1, q[:, None])[:, 0], q)
    first_c = first.clamp(0, T - 1)
    mask[first_c, cols] = mask[first_c, cols] | (counts >= 1)
    cost = curve.gather(1, counts[:, None])[:, 0]
    return AdaptiveChoice(mask, counts, cost, curve, level)


def proxy_cost(
    values: torch.Tensor,
    upstream: torch.Tensor,
    t64: torch.Tensor,
    mask: torch.Tensor,
    fold: str = "linear",
) -> torch.Tensor:
    """(B,) proxy sum_k ||g_k|| ||v_k - v_hat_k|| of the anchor sets ``mask``, directly.

    The plain-residual evaluation the planner's Gram-matrix DP must agree with (tests)
    and what benchmarks report for any layout; v_hat_k is ``fold``'s reconstruction.
    """
    T, B = mask.shape
    w_cur, w_nxt = interpolation_weights(mask, t64, fold)
    v = values.reshape(T, B, -1).to(torch.float64)
    g = upstream.reshape(T, B, -1).to(torch.float64)
    prev, nxt = (x.clamp(0, T - 1) for x in anchor_neighbours(mask))
    cols = torch.arange(B, device=mask.device).unsqueeze(0).expand(T, B)
    vhat = w_cur[..., None] * v[prev, cols] + w_nxt[..., None] * v[nxt, cols]
    interp = (w_cur + w_nxt > 0) & ~mask
    res = (v - vhat).norm(dim=-1) * g.norm(dim=-1)
    return torch.where(interp, res, 0.0).sum(0)


# --------------------------------------------------------------------------- stochastic


@dataclass
class StochasticChoice:
    """The stochastic planner's decision.

    mask: (T, B) bool anchors, base and promoted; k, b: (m,) int64 the promoted pairs
    (k, b) and inv_pi: (m,) float64 their samples' 1 / pi_b; fold_k, fold_dst, fold_b,
    fold_w: (e,) the base layout's fold of the promoted pairs -- pair (fold_k, fold_b)'s
    segment goes onto base anchor (fold_dst, fold_b) with weight fold_w when it is not an
    anchor (causal: its last base anchor, weight 1; linear: the two base anchors around it,
    1 - alpha and alpha); pi: (B,) float64 every sample's promotion probability (0 for a
    sample with nothing to promote: an integer budget, a short or an empty span).
    """

    mask: torch.Tensor
    k: torch.Tensor
    b: torch.Tensor
    inv_pi: torch.Tensor
    fold_k: torch.Tensor
    fold_dst: torch.Tensor
    fold_b: torch.Tensor
    fold_w: torch.Tensor
    pi: torch.Tensor


PROMOTIONS = ("uniform", "proxy")
"""How the stochastic planner spreads its promotion probability over the samples
(:func:`promotion_probabilities`)."""

PROMOTE_TO = ("anchor", "exact")
"""What the stochastic planner promotes a sample to (:func:`stochastic_choice`): the next
nested anchor (the (L+1)-anchor causal fold in expectation) or every active step (the
exact gradient in expectation)."""

PROXY_FLOOR = 0.25
"""promotion="proxy": the share of the promotion budget spread evenly, so that every
promotable sample keeps pi_b >= PROXY_FLOOR * pi_even (frac with unit costs,
:func:`promotion_probabilities`) and its weight 1 / pi_b stays bounded where the proxy
underrates its error."""


def promotion_probabilities(
    weights: torch.Tensor,
    promotable: torch.Tensor,
    frac: float,
    costs: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B,) float64 promotion probabilities pi_b of the promotable samples, each in (0, 1],
    spending ``frac * n_p`` anchors in expectation (n_p = promotable.sum()): sum_b c_b pi_b
    = frac * n_p with c_b = ``costs`` (B,) >= 1, the anchors a promotion of b adds (None:
    1 each, and then sum pi_b = frac * n_p); 0 elsewhere.

    weights: (B,) >= 0 the proxy of each sample's promotion term; promotable: (B,) bool.
    pi = (1 - PROXY_FLOOR) pi_prop + PROXY_FLOOR pi_even: pi_even = frac n_p / sum c_b
    the same for every promotable sample (frac with unit costs), pi_prop proportional to
    weight_b / sqrt(c_b) and capped at 1 (water-filling: the capped samples' excess goes to
    the rest in proportion).  The variance of the re-weighted term, sum_b (1/pi_b - 1)
    ||D_b||^2, at a fixed expected cost sum_b c_b pi_b is smallest at pi_b ~ ||D_b|| /
    sqrt(c_b), so pi_prop is near that optimum when weight_b ~ ||D_b||, while no pi_b
    falls below PROXY_FLOOR * pi_even.  Equal weights (or all zero) give pi_even.
    """
    w = torch.where(promotable, weights.to(torch.float64).clamp_min(0.0), 0.0)
    c = torch.ones_like(w) if costs is None else costs.to(w)
    if not bool((c[promotable] >= 1.0).all()):
        raise ValueError("costs must be >= 1 for every promotable sample")
    c = torch.where(promotable, c, 0.0)
    n_p = int(promotable.sum())
    pi = torch.zeros_like(w)
    if n_p == 0 or frac <= 0.0:
        return pi
    total = frac * n_p
    csum = float(c.sum())
    # <= frac < 1 as every c_b >= 1; frac itself (not a rounded n_p frac / n_p) at unit costs
    even = frac if csum == n_p else total / csum
    wp = w[promotable]
    if not bool(torch.isfinite(wp).all()) or bool((wp == wp[0]).all()):
        # Equal (or unusable) weights: the same probability for all, the uniform promotion.
        return torch.where(promotable, torch.full_like(w, even), pi)
    r = w / torch.where(promotable, c, 1.0).sqrt()
    prop = torch.zeros_like(w)
    capped = torch.zeros_like(promotable)
    for _ in range(n_p):  # each pass caps at least one more sample or stops
        free = promotable & ~capped
        room = total - float(c[capped].sum())
        rs = float((c * r)[free].sum())
        if rs <= 0.0:  # only zero weights are left: they share the rest evenly
            prop = torch.where(free, room / max(float(c[free].sum()), 1.0), prop)
            break
        prop = torch.where(free, r * (room / rs), prop)
        over = free & (prop >= 1.0)
        if not bool(over.any()):
            break
        capped |= over
        prop = torch.where(capped, 1.0, prop)
    pi = (1.0 - PROXY_FLOOR) * prop.clamp(0.0, 1.0) + PROXY_FLOOR * even
    return torch.where(promotable, pi, 0.0)


def systematic_sample(pi: torch.Tensor, order: torch.Tensor, u: float) -> torch.Tensor:
    """(B,) bool: systematic sampling with inclusion probabilities ``pi`` (B,) in [0, 1].

    The samples are laid end to end in ``order`` (a permutation, here random), sample j
    covering [S_{j-1}, S_j) with S the running sum of pi; the points u, u + 1, u + 2, ...
    (u in [0, 1)) select the samples they fall in.  Every sample is selected with
    probability exactly pi_b over u, whatever the order; the number selected is
    floor(sum pi) or that + 1.  With equal pi = frac the selected set is uniformly random
    given its size (the order is).
    """
    s = pi[order].cumsum(0)
    hi = torch.ceil(s - u)
    lo = torch.ceil(torch.cat([s.new_zeros(1), s[:-1]]) - u)
    chosen = torch.zeros_like(pi, dtype=torch.bool)
    chosen[order] = hi > lo
    return chosen


def base_layout(n: int, L: int, fold: str) -> list[int]:
    """The L-anchor layout of n active steps that a sample keeps unpromoted with
    ``promote_to="exact"``: ``causal_layout(n, L)`` for the causal fold; for the linear
    fold the ends and L - 2 steps evenly between (every step inside [first, last] anchor,
    where the linear fold reaches it).  1 <= L <= n for the causal fold, 2 <= L <= n for
    the linear one (one anchor would drop every later step's g)."""
    if fold == "causal":
        return causal_layout(n, L)[0]
    if not 2 <= L <= n:
        raise ValueError(f"the linear fold's base layout needs 2 <= L <= n, got L={L}, n={n}")
    return sorted({round(i * (n - 1) / (L - 1)) for i in range(L)})


def stochastic_choice(
    upstream: torch.Tensor,
    budget: float,
    draw: torch.Tensor,
    *,
    promotion: str = "uniform",
    promote_to: str = "anchor",
    fold: str = "causal",
    values: torch.Tensor | None = None,
    t64: torch.Tensor | None = None,
) -> StochasticChoice:
    """Random promotion from a base layout: the expectation of a larger layout's fold (or of
    the exact gradient) at a mean cost of ``budget`` anchors per active sample.

    upstream: (T, B, *S) the loss's gradients w.r.t. the velocities; budget: mean anchors
    per sample, L = floor(budget), frac = budget - L; draw: (B + 1,) uniforms in [0, 1)
    from the caller's generator (drawn before the plan, independent of everything else):
    B to order the samples, one to offset the systematic sampling.

    Sample b's active steps are f_b..l_b (first to last non-zero g; none: no anchor, its
    gradient is exactly 0), n_b of them.  With n_b <= L every active step is an anchor (the
    exact gradient).  An integer budget (frac = 0) is the deterministic L-anchor layout
    (``f_b + causal_layout(n_b, L)``; with ``promote_to="exact"``, ``f_b +
    base_layout(n_b, L, fold)``, which the calls refuse below T:
    :func:`~jagg_autograd.checks.check_promoting_budget`).  Otherwise sample b has a
    *base* layout and a *full* one that contains it, and F, F_base are their folds of
    sample b's g:

    * ``promote_to="anchor"`` (causal fold only): the full layout is ``f_b +
      causal_layout(n_b, L+1)``, the base is it without its last anchor k_b (nested, hence
      not ``causal_layout(n_b, L)``: shapes, 5 steps, L = 2: {0, 2}, where
      ``causal_layout(5, 2)`` is {0, 3}); a promotion adds c_b = 1 anchor;
    * ``promote_to="exact"``: the full layout is every active step with a non-zero g (F is
      the exact gradient), the base ``f_b + base_layout(n_b, L, fold)``; a promotion adds
      the c_b <= n_b - L steps with a non-zero g outside the base (L >= 2 for the linear
      fold).  The expectation is the exact gradient for every batch, with
      either fold: whatever mean error the base fold has (the linear fold's noise-driven
      one included) is what the promoted samples' correction removes on average.

    Each promotable sample is promoted with probability pi_b
    (:func:`promotion_probabilities`: sum_b c_b pi_b = frac * n_p, so the mean cost is
    ``budget`` anchors per promotable sample), drawn by :func:`systematic_sample` (exact
    inclusion probabilities, also when their sum is < 1), and its composite rows are
    re-weighted (:func:`apply_promotion`): every promoted row G_k <- G_k / pi_b, and each
    base anchor p that the base fold puts G_k onto with weight w_kp gets
    G_p <- G_p + (1 - 1/pi_b) w_kp G_k.  The estimator is  F_base + (1[promoted] / pi_b)
    (F - F_base)  per sample, so its expectation over the draw is F *for every batch*:
    conditionally unbiased whatever pi_b is.  The price is variance,
    sum_b (1/pi_b - 1) ||D_b||^2 with D_b = F - F_base:

    * ``promotion="uniform"``: the same pi_b for every promotable sample (frac with
      ``promote_to="anchor"``);
    * ``promotion="proxy"``: pi_b grows with the planner's proxy of ||D_b||, the drop of
      sum_k ||g_k|| ||v_k - v_hat_k|| (:func:`proxy_cost`, the fold's) from the base to the
      full layout (needs ``values`` (T, B, *S) and ``t64`` (T, B)).  The proxy scales with
      |A_b|, so the samples with large advantages are promoted more often -- a choice that
      depends on the advantage, which the planners' invariant forbids for
      *deterministic* decisions because it biases the mean; here the decision is a coin
      with known odds and the weight 1/pi_b undoes it exactly, so the expectation is F for
      every batch all the same, and the variance falls where the proxy tracks ||D_b||
      (the Horvitz-Thompson estimator with probabilities ~ size).

    Shapes, 5 trained steps, budget 2.4: ``"anchor"`` gives the 3-anchor fold {0, 2, 4} in
    expectation ({0, 2} or {0, 2, 4} per sample, pi = 0.4); ``"exact"`` the exact gradient
    ({0, 3} or all 5 per sample, pi = 0.4 / 3).
    """
    T, B = upstream.shape[:2]
    dev = upstream.device
    if tuple(draw.shape) != (B + 1,):
        raise ValueError(f"draw must be ({B + 1},) uniforms, got {tuple(draw.shape)}")
    if promotion not in PROMOTIONS:
        raise ValueError(f"promotion must be one of {PROMOTIONS}, got {promotion!r}")
    if promote_to not in PROMOTE_TO:
        raise ValueError(f"promote_to must be one of {PROMOTE_TO}, got {promote_to!r}")
    check_fold(fold)
    if promote_to == "anchor" and fold != "causal":
        raise ValueError(
            f"promote_to='anchor' needs fold='causal' (its rows nest by segment), got "
            f"fold={fold!r}"
        )
    L = int(budget)
    frac = float(budget) - L
    if L < (1 if fold == "causal" else 2):
        raise ValueError(
            f"budget must be >= {1 if fold == 'causal' else 2} for fold={fold!r} (the "
            f"base layout's anchors per sample), got {budget!r}"
        )
    first, last, n_act = (x.cpu() for x in _active_range(upstream))
    mask = torch.zeros((T, B), dtype=torch.bool)
    extra = torch.zeros((T, B), dtype=torch.bool)  # the pairs a promotion adds
    for n in sorted(set(n_act.tolist()) - {0}):
        cols = (n_act == n).nonzero().flatten()
        f = first[cols]
        if n <= L:
            steps = f[None, :] + torch.arange(n)[:, None]
            mask[steps, cols[None, :].expand_as(steps)] = True
            continue
        if promote_to == "anchor":
            if frac == 0.0:
                base, added = causal_layout(n, L)[0], []
            else:
                full = causal_layout(n, L + 1)[0]
                base, added = full[:-1], full[-1:]
        else:
            base = base_layout(n, L, fold)
            added = [] if frac == 0.0 else sorted(set(range(n)) - set(base))
        for a in base:
            mask[f + a, cols] = True
        for a in added:
            extra[f + a, cols] = True
    if promote_to == "exact":
        # A step whose g is 0 (inside a span: e.g. clipped) has a zero row in either
        # layout: promoting it would cost a with-grad call and add nothing.
        extra &= upstream.flatten(2).ne(0).any(-1).cpu()
    promotable = extra.any(0)
    costs = extra.sum(0).to(torch.float64)
    weights = torch.ones(B, dtype=torch.float64)
    if promotion == "proxy" and bool(promotable.any()):
        if values is None or t64 is None:
            raise ValueError('promotion="proxy" needs the velocities (values) and t64')
        drop = proxy_cost(values, upstream, t64, mask.to(dev), fold) - proxy_cost(
            values, upstream, t64, (mask | extra).to(dev), fold
        )
        weights = drop.detach().cpu().to(torch.float64)
    pi = promotion_probabilities(weights, promotable, frac, costs)
    u = draw.detach().to("cpu", torch.float64)
    chosen = systematic_sample(pi, u[:B].argsort(), float(u[B])) & promotable
    ks, bs = (extra & chosen[None, :]).nonzero(as_tuple=True)  # step-major
    # The base fold of the promoted pairs: onto the base anchors around them.
    if fold == "linear":
        if t64 is None:
            raise ValueError("promote_to='exact' with fold='linear' needs t64")
        w_cur, w_nxt = interpolation_weights(mask, t64.detach().to("cpu", torch.float64), fold)
    else:
        w_cur = torch.ones((T, B), dtype=torch.float64)
        w_nxt = torch.zeros((T, B), dtype=torch.float64)
    prev, nxt = anchor_neighbours(mask)
    fk, fd, fb, fw = [], [], [], []
    for nb, w in ((prev, w_cur), (nxt, w_nxt)):
        keep = w[ks, bs] > 0
        fk.append(ks[keep])
        fd.append(nb[ks, bs][keep])
        fb.append(bs[keep])
        fw.append(w[ks, bs][keep])
    mask[ks, bs] = True
    return StochasticChoice(
        mask.to(dev),
        ks.to(dev),
        bs.to(dev),
        (1.0 / pi[bs]).to(dev),
        torch.cat(fk).to(dev),
        torch.cat(fd).to(dev),
        torch.cat(fb).to(dev),
        torch.cat(fw).to(dev),
        pi.to(dev),
    )


def apply_promotion(rows: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The stochastic estimator's composite rows from the fold's ``rows`` (n_rows, N) of
    ``plan``'s mask (:func:`stochastic_choice`); ``rows`` itself when the plan promotes
    nothing.  Returns a new tensor."""
    if plan.promotion is None:
        return rows
    src, inv_pi, fsrc, fdst, fw, finv = plan.promotion
    # bfloat16 / float16 rows are re-weighted in float32: 1/pi rounded to bfloat16 is off
    # by up to 2^-9, the same factor for every promotion of the call -- a bias of the
    # correction term, not noise that averages out.  float32 / float64 stay as they were.
    low = rows.dtype in (torch.float16, torch.bfloat16)
    work = rows.float() if low else rows
    dt = work.dtype
    # (1 - 1/pi) in the rows' dtype, then the fold weight: with weight 1 (the causal fold)
    # the coefficient is bit for bit what it was before the weights existed.
    coef = fw.to(dt) * (1.0 - finv.to(dt))
    # Several promoted steps may fold onto one base anchor: index_add sums them (on CUDA
    # in an unspecified order, so bit-reproducible there only with deterministic
    # algorithms on).
    out = work.index_add(0, fdst, work[fsrc] * coef.unsqueeze(1))
    out[src] = work[src] * inv_pi.to(dt).unsqueeze(1)
    return out.to(rows.dtype) if low else out


# ------------------------------------------------------------------------------ chooser


@dataclass(frozen=True, eq=False)
class PlanChoice:
    """What :func:`choose_plan` decided for a call.

    plan: the Plan the executor runs; None for placement="adaptive" before the backward
        (the deferred backward chooses it from the upstream gradients).
    scores: (n_windows, B) router scores of the uniform layout, when a router or the
        stats need them, else None.
    exact: (n_windows, B) bool: the (window, sample) pairs with the exact gradient.
    """

    plan: Plan | None
    scores: torch.Tensor | None
    exact: torch.Tensor


def choose_plan(
    call: JaggCall, values: torch.Tensor, upstream: torch.Tensor | None = None
) -> PlanChoice:
    """The call's Plan: exact, uniform (+ routed), or adaptive.

    values: (T, B, *S) the call's velocities (routing scores them; adaptive placement
    reads them); upstream: (T, B, *S) the gradients of the loss w.r.t. them (adaptive
    placement in the deferred backward only).

    * mode="exact": every pair, where a gradient exists (none under no_grad);
    * placement="uniform": the layout's anchors for every sample; a router's routed-out
      (window, sample) pairs make every step of their window an anchor.  The eager
      executor runs the anchor steps as whole-step calls first (``whole_steps``); without
      a gradient the plan is a preview of what a call with grad would run;
    * placement="adaptive" (deferred): per-sample anchors chosen from ``upstream``
      (:func:`adaptive_choice`, ``round(budget * B)`` anchors over the batch);
    * placement="stochastic" (deferred): a base layout per sample with random promotion
      (:func:`stochastic_choice`: to the next nested causal anchor or, with
      ``opts.promote_to="exact"``, to every active step; pi_b by ``opts.promotion``), the
      draw from ``opts.generator``.
    """
    T, B, dev = call.T, call.B, call.latents.device
    opts = call.opts
    n_w = len(call.windows)
    # Scores belong to the forward (routing, stats); the backward's adaptive choice skips them.
    wants_scores = upstream is None and (
        opts.return_stats or (opts.router is not None and call.executor != "direct")
    )
    scores = route_scores(call, values) if wants_scores else None
    none = torch.zeros((n_w, B), dtype=torch.bool, device=dev)
    whole = None
    if opts.mode == "exact":
        mask = exact_mask(T, B, dev) & call.needs_grad
        exact = torch.full((n_w, B), call.needs_grad, dtype=torch.bool, device=dev)
    elif opts.placement == "adaptive" and call.executor == "deferred":
        if upstream is None:
            return PlanChoice(None, scores, none)
        mask = adaptive_choice(
            values, upstream, call.t64, call.budget_total, fold=opts.fold
        ).mask
        exact = none
    elif opts.placement == "stochastic" and call.executor == "deferred":
        if upstream is None:
            return PlanChoice(None, scores, none)
        gen = opts.generator
        draw = torch.rand(
            call.B + 1, generator=gen, device=gen.device if gen is not None else "cpu"
        )
        choice = stochastic_choice(
            upstream, opts.budget, draw, promotion=opts.promotion,
            promote_to=opts.promote_to, fold=opts.fold, values=values, t64=call.t64,
        )  # fmt: skip
        plan = make_plan(choice.mask, call.t64, fold=opts.fold, promoted=choice)
        return PlanChoice(plan, scores, none)
    else:
        has_interior = torch.tensor([hi - lo >= 2 for lo, hi in call.windows], device=dev)
        exact = (
            opts.router.route(scores, has_interior)
            if opts.router is not None and scores is not None
            else none
        )
        mask = uniform_mask(T, B, list(call.anchors), list(call.windows), exact, dev)
        if call.executor == "eager":
            whole = list(call.anchors)
    return PlanChoice(make_plan(mask, call.t64, whole, fold=opts.fold), scores, exact)


def route_scores(call: JaggCall, values: torch.Tensor) -> torch.Tensor:
    """(n_windows, B) cosine router scores of ``values`` on the call's uniform layout."""
    T, B = call.T, call.B
    alpha = torch.zeros_like(call.t64)  # 0 at anchors, the t-coordinate inside windows
    for lo, hi in call.windows:
        if hi - lo >= 2:
            t = call.t64
            alpha[lo + 1 : hi] = (t[lo + 1 : hi] - t[lo]) / (t[hi] - t[lo])
    left = [w[0] for w in call.windows]
    right = [w[1] for w in call.windows]
    v = values.detach().reshape(T, B, -1)
    return cosine_route(v, alpha, left, right, backend=call.opts.backend)
