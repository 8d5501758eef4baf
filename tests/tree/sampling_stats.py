"""Exact laws and the chi-square judge of the sampling tests (tree and engine level).

* :func:`processed_np`: the processed target distribution of one logits row in float64, by
  sorting: an oracle independent of jspec's sort-free search, with the same definition
  (jspec.tree.sampling_probs).
* :func:`tree_step_law`: the exact law of what ONE sampled tree step emits, for a fixed tree:
  draw ``Y`` autoregressively from the target; the step must emit ``Y[:a]`` where ``a - 1`` is
  the longest prefix of ``Y`` that is a path of the tree (the walk takes the first sibling
  with a token; capped at the max depth).
* :func:`dyadic_rows`: rows of probabilities that are multiples of ``1 / grid`` (every partial
  sum exact in f32), for tests whose coins land on CDF breakpoints.
* :func:`judge`: Pearson chi-square of observed counts against an exact law (cells with an
  expected count below 5 pooled into one), the total variation distance, and a support check
  (a sequence of probability 0 observed is a failure outright, whatever the statistic says).
  A test fails at ``p < ALPHA``.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

import numpy as np
from scipy import stats

ALPHA = 1e-6
MIN_EXPECTED = 5.0


def dyadic_rows(rng, rows: int, v: int, support: int, grid: int) -> np.ndarray:
    """f32[rows, v]: each row ``support`` random tokens whose probabilities are distinct-cut
    multiples of ``1 / grid`` (every partial sum exact in f32), zeros elsewhere."""
    probs = np.zeros((rows, v), np.float32)
    for r in range(rows):
        tokens = rng.choice(v, support, replace=False)
        cuts = np.sort(rng.choice(np.arange(1, grid), support - 1, replace=False))
        probs[r, tokens] = np.diff(np.concatenate([[0], cuts, [grid]])) / grid
    return probs


def processed_np(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """f64[V]: temperature, top-k, min-p then top-p of one row, by sorting."""
    logits = np.asarray(logits, np.float64)
    v = logits.shape[-1]
    if temperature <= 0:
        return np.eye(v)[int(np.argmax(logits))]
    x = logits / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    desc = np.sort(p)[::-1]
    pre = 0.0
    if 0 < top_k < v:
        pre = desc[top_k - 1]
    pre = max(pre, min_p * desc[0])
    if top_p < 1:
        kept = desc[desc >= pre]
        cum = np.cumsum(kept)
        pre = max(pre, kept[int(np.argmax(cum >= top_p * kept.sum()))])
    q = np.where(p >= pre, p, 0.0)
    return q / q.sum()


def top_p_margin(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> float:
    """Distance of ``top_p`` from the cumulative masses of the pre-top-p row: a cut this close
    would be decided by rounding (f32 engine vs f64 oracle)."""
    if top_p >= 1 or temperature <= 0:
        return 1.0
    p = processed_np(logits, temperature, top_k, 1.0, min_p)
    cum = np.cumsum(np.sort(p[p > 0])[::-1])
    return float(np.min(np.abs(cum - top_p)))


def tree_step_law(parents, tokens, row_probs, max_depth: int) -> dict[tuple[int, ...], float]:
    """Exact law of one sampled tree step's emitted tokens (module docstring).

    Args:
      parents: parent node of each node (-1 for the root, node 0); children in node order.
      tokens: token of each node.
      row_probs: f64[N, V] the processed target law after each node.
      max_depth: deepest accepted depth (``num_spec_steps - 1``).
    """
    children = collections.defaultdict(list)
    for j, p in enumerate(parents):
        if p >= 0:
            children[p].append(j)
    depth = [0] * len(parents)
    for j, p in enumerate(parents):
        if p >= 0:
            depth[j] = depth[p] + 1
    law: dict[tuple[int, ...], float] = collections.defaultdict(float)

    def walk(node: int, prefix: tuple[int, ...], prob: float) -> None:
        for tok, q in enumerate(row_probs[node]):
            if q <= 0:
                continue
            nxt = next((c for c in children[node] if tokens[c] == tok), None)
            if nxt is not None and depth[nxt] <= max_depth:
                walk(nxt, prefix + (tok,), prob * q)
            else:
                law[prefix + (tok,)] += prob * q

    walk(0, (), 1.0)
    return dict(law)


@dataclasses.dataclass
class Verdict:
    label: str
    n: int
    chi2: float
    dof: int
    p_value: float
    tv: float
    outside_support: int

    @property
    def ok(self) -> bool:
        return self.outside_support == 0 and self.p_value >= ALPHA

    def __str__(self) -> str:
        return (
            f"{self.label}: n={self.n} chi2={self.chi2:.1f} dof={self.dof} "
            f"p={self.p_value:.3g} TV={self.tv:.4f} outside_support={self.outside_support}"
        )


def judge(samples: Iterable[tuple[int, ...]], law: dict, label: str = "") -> Verdict:
    """Chi-square / TV / support of ``samples`` (hashable outcomes) against ``law``."""
    counts = collections.Counter(samples)
    n = sum(counts.values())
    outside = sum(c for k, c in counts.items() if law.get(k, 0.0) <= 0)
    keys = sorted(k for k, p in law.items() if p > 0)
    obs = np.array([counts.get(k, 0) for k in keys], np.float64)
    exp = np.array([law[k] for k in keys], np.float64) * n
    big = exp >= MIN_EXPECTED
    obs_b, exp_b = list(obs[big]), list(exp[big])
    if (~big).any():
        obs_b.append(obs[~big].sum())
        exp_b.append(exp[~big].sum())
    obs_b, exp_b = np.array(obs_b), np.array(exp_b)
    chi2 = float(((obs_b - exp_b) ** 2 / exp_b).sum())
    dof = max(len(obs_b) - 1, 1)
    p_value = float(stats.chi2.sf(chi2, dof))
    emp = {k: c / n for k, c in counts.items()}
    tv = 0.5 * sum(abs(emp.get(k, 0.0) - law.get(k, 0.0)) for k in set(emp) | set(law))
    verdict = Verdict(label, n, chi2, dof, p_value, tv, outside)
    print(verdict)
    return verdict
