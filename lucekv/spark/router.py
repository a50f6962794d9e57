"""Routers for Spark's calibration models (DESIGN §7): routing that follows the text (k-means), or a known skew
(Zipf), where a random router would route every expert alike. Pure numpy.

k-means: the llama MoE router is logits = W h with no bias, h the layer's normalized FFN input. Nearest-centroid
routing in Euclidean space needs a bias (argmax c.h - |c|^2 / 2), and so does centring h; scaling each coordinate
does not. So each coordinate is divided by its spread over the corpus, z = h / sd (a few outlier coordinates of h
would otherwise decide the clusters; on smollm2 this raises the information a layer's clusters carry about code
versus chat from about 0.5-0.7 bits to about 0.9 of the 1 possible in the later layers), and z is clustered by
direction (spherical k-means, unit centroids c). The router rows are c / sd times one scale: a token's logits are
the scale times c.z, so its top-1 expert is exactly its cluster (|z| is the same for every expert) and its next
experts the next closest centroids in angle. The scale sets the softmax's temperature, i.e. the weights the top-k
experts are mixed with, and nothing of which experts are picked.

Zipf: for the speed model, whose inputs cannot be run on a CPU to fit anything. Router rows are random directions
with per-expert norms: with roughly isotropic inputs the logits are independent N(0, norm_e^2) draws, and a larger
norm wins the top-k more often, though never more than half the time (a zero-mean logit is below its peers half
the time). The norms are tuned on simulated isotropic logits until popularity follows Zipf's law, p(rank r) ~ 1 / r^s,
with the head held at MAX_PICK_RATE of the tokens, and the ranks are shuffled per layer so that popularity says
nothing of an id. A random model's FFN inputs are isotropic only roughly (after the first layer they share a
direction, which gives each expert a steady offset): measured on a random qwen3moe 1024 wide, 64 experts, top-8,
over 2048 tokens, the busiest expert takes 7.6% of layer 0's selections and 11-12% of later layers' against Zipf's 5%,
and the rarest none against 0.5%. So the popularity is Zipf-shaped and steeper than asked; a routing trace measures
it.
"""

from __future__ import annotations

import numpy as np

ROUTER_TEMPERATURE = 4.0  # k-means router logits are 4 x cos(h, centroid) for a token of median |h|
# A zero-mean logit is below its peers half the time however large its norm: no expert of a bias-free random router
# is in more than half the tokens' top-k. The Zipf head is held a little under that, where the norms stay finite.
MAX_PICK_RATE = 0.4


def spherical_kmeans(h: np.ndarray, k: int, seed: int = 0, restarts: int = 4, iterations: int = 25) -> np.ndarray:
    """Unit centroids float32 [k, width] of the directions of h [n, width]: of `restarts` runs (k-means++ seeding,
    then Lloyd steps on cosine similarity), the one whose points are closest to their centroids. A cluster left
    empty is reseeded with the point farthest from its centroid."""
    if len(h) < k:
        raise ValueError(f"{len(h)} points cannot make {k} clusters")
    u = _unit(np.asarray(h, np.float64))
    rng = np.random.default_rng(seed)
    runs = [_lloyd(u, _kmeans_plus_plus(u, k, rng), iterations) for _ in range(restarts)]
    best = max(runs, key=lambda c: np.max(u @ c.T, axis=1).sum())
    return best.astype(np.float32)


def _kmeans_plus_plus(u: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k seeds among the unit vectors u, each next one drawn with probability ~ its squared distance (2 - 2 cos)
    to the nearest seed so far."""
    seeds = [u[rng.integers(len(u))]]
    for _ in range(1, k):
        distance = np.maximum(1.0 - np.max(u @ np.array(seeds).T, axis=1), 0.0)
        seeds.append(u[rng.choice(len(u), p=distance / distance.sum() if distance.sum() > 0 else None)])
    return np.array(seeds)


def _lloyd(u: np.ndarray, c: np.ndarray, iterations: int) -> np.ndarray:
    for _ in range(iterations):
        similarity = u @ c.T
        labels = np.argmax(similarity, axis=1)
        new = np.zeros_like(c)
        np.add.at(new, labels, u)
        for j in np.flatnonzero(np.linalg.norm(new, axis=1) == 0):
            new[j] = u[np.argmin(similarity[np.arange(len(u)), labels])]
        new = _unit(new)
        if np.allclose(new, c):
            break
        c = new
    return c


def kmeans_router(h: np.ndarray, n_expert: int, seed: int = 0) -> np.ndarray:
    """F32 router rows [n_expert, width] routing each token of h [n, width] to its cluster first: spherical k-means on
    z = h / sd (sd: each coordinate's spread), rows c / sd scaled so that a token of median |z| gets logits
    ROUTER_TEMPERATURE x cos(z, c)."""
    h = np.asarray(h, np.float64)
    sd = h.std(axis=0)
    sd = np.where(sd > 0, sd, 1.0)
    z = h / sd
    centroids = spherical_kmeans(z, n_expert, seed).astype(np.float64)
    scale = ROUTER_TEMPERATURE / float(np.median(np.linalg.norm(z, axis=1)))
    return (centroids / sd * scale).astype(np.float32)


def zipf_row_norms(n_expert: int, top_k: int, s: float = 1.0, samples: int = 10_000, seed: int = 0,
                   steps: int = 300) -> np.ndarray:
    """Row norms float64 [n_expert], expert 0 the most popular, under which independent N(0, norm_e^2) logits pick
    the experts among their top_k with the shares of `zipf_popularity` (within the simulation's noise)."""
    target = zipf_popularity(n_expert, top_k, s)
    z = np.random.default_rng(seed).standard_normal((samples, n_expert))
    log_norm = np.zeros(n_expert)
    for _ in range(steps):
        picked = simulated_popularity(z * np.exp(log_norm), top_k)
        # small steps: the experts compete for the same k places, and larger ones oscillate
        log_norm += 0.1 * (np.log(target) - np.log(np.maximum(picked, 0.5 / samples)))
        log_norm = np.clip(log_norm - log_norm.mean(), -8.0, 8.0)
    return np.exp(log_norm)


def zipf_popularity(n_expert: int, top_k: int, s: float, cap: float = MAX_PICK_RATE) -> np.ndarray:
    """Each expert's share of the selections under Zipf's law (expert 0 first), summing to 1, with no expert picked
    by more than `cap` of the tokens: the most popular experts are held at the cap and the rest keep the Zipf
    ratios (water-filling)."""
    weights = 1.0 / np.arange(1, n_expert + 1) ** s
    rate = np.zeros(n_expert)  # tokens that pick each expert, per token: sums to top_k
    capped = 0
    while True:
        tail = weights[capped:]
        rate[:capped] = cap
        rate[capped:] = (top_k - cap * capped) * tail / tail.sum()
        if capped == n_expert or rate[capped] <= cap:
            return rate / top_k
        capped += 1


def simulated_popularity(logits: np.ndarray, top_k: int) -> np.ndarray:
    """Each expert's share of the top_k selections of logits [n, n_expert] (shares sum to 1)."""
    top = np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]
    return np.bincount(top.ravel(), minlength=logits.shape[1]) / top.size


def zipf_router(norms: np.ndarray, width: int, rng: np.random.Generator) -> np.ndarray:
    """F32 router rows [len(norms), width] for isotropic unit-variance inputs: random directions with the norms of
    `zipf_row_norms`, shuffled. Logits are O(1) like a random router's."""
    rows = _unit(rng.standard_normal((len(norms), width))) * rng.permutation(norms)[:, None]
    return (rows / np.sqrt(width)).astype(np.float32)


def mutual_information(counts: np.ndarray) -> float:
    """I(kind; expert) in bits of a contingency table counts [n_kind, n_expert] (selections of each expert by tokens
    of each kind of text): 0 when every kind routes alike, up to log2(n_kind) when each kind has experts of its own."""
    p = np.asarray(counts, np.float64)
    p = p / p.sum()
    outer = p.sum(axis=1, keepdims=True) * p.sum(axis=0, keepdims=True)
    nz = p > 0
    return float(np.sum(p[nz] * np.log2(p[nz] / outer[nz])))


def _unit(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(norm > 0, norm, 1.0)
