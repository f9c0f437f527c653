"""HistoryPredictor: route-ahead guesses from the routing already seen, with
no trained router (issue #60 item 4). Its own module, beside
prefetch/predictors.py, which is at the size limit (tools/check_sizes.py)."""
from __future__ import annotations

import math

import numpy as np

from prefetch.errors import InvalidArgumentError
from prefetch.predictors import RoutePredictor

__all__ = ["HistoryPredictor"]


class HistoryPredictor(RoutePredictor):
    """Nearest past tokens: the tokens that routed like this one so far
    predict where it goes next. No trained router, no hidden states; only
    routings seen before.

    Every finished token's routing (a layers x experts 0/1 row; a step of
    several tokens, a prefill, is one row of their union) is kept, the last
    `history` of them, across requests (`end_request` carries them over):
    the expert activation matrix of TracePredictor, kept per token rather
    than per request. While a token routes, each kept row gets a
    similarity: the overlap of its routing with this token's, layer by
    layer, each earlier layer weighted `decay` times less, over the two
    routings' sizes (a cosine; a prefill's wide union matches nothing
    closely). The `neighbours` rows of highest similarity (None: every
    row) vote, a row of similarity x with weight w = exp(sharpness * (x -
    1)) (1 for a row that routed as this token did on every layer so far).
    The score of expert e at a later layer t is their weighted share that
    routed to e at t, sum(w * row[t, e]) / (sum(w) + prior): an estimate of
    P(e at t), which `prior` pulls down while few rows are close. The guesses
    for t are the experts scoring at least `threshold`, at most
    `max_experts` of them (highest first; None: no cap), for t = layer + 1
    .. layer + `distance` within the step.

    It aims at the cache's misses: an expert that one of the last
    `skip_recent` tokens routed to at t is left out, since the cache almost
    always still holds it (the on-demand replays of the gemma-4 and gpt-oss
    traces at 10 and 25 % of the experts, bench/predictors.py: under 3 % of
    the misses were routed by the previous token at that layer). A guess
    names each expert once, sorted, within the model's experts
    (`distinct_guesses`).

    The defaults were fitted on the first halves of two real routing traces
    (gemma-4-26B-A4B and gpt-oss-120b, from BigMoeOnEdge's route traces;
    bench/predictors.py --fit: the most recall of the on-demand cyclic
    cache's misses at 25 % with precision >= 0.5, one layer ahead, pooled
    over the traces); their second halves are held out.

    Cost per routed layer: a gather of the routed experts over the kept
    rows, a partial sort of the rows by similarity, and one product of the
    near rows with the target layers (observe + predict: 78 us a layer at
    distance 1, 97 at 4, 512 rows of 30 x 128, on a 2-core VM)."""

    reads_routing = True  # the similarity takes in this layer's routing
    distinct_guesses = True  # sorted distinct int64 arrays within the model's experts

    def __init__(self, distance: int = 1, threshold: float = 0.25, decay: float = 0.7, sharpness: float = 9.0,
                 prior: float = 0.05, neighbours: int | None = 16, history: int = 512, max_experts: int | None = None,
                 skip_recent: int = 1):
        if distance < 1:
            raise InvalidArgumentError("distance must be >= 1")
        if not 0 < threshold <= 1:
            raise InvalidArgumentError(f"threshold must be in (0, 1] (a share of the near rows), got {threshold!r}")
        if not 0 < decay <= 1:
            raise InvalidArgumentError(f"decay must be in (0, 1] (weight of each earlier layer), got {decay!r}")
        if not 0 <= sharpness < math.inf:
            raise InvalidArgumentError(f"sharpness must be finite and >= 0, got {sharpness!r}")
        if not 0 <= prior < math.inf:
            raise InvalidArgumentError(f"prior must be finite and >= 0, got {prior!r}")
        if neighbours is not None and neighbours < 1:
            raise InvalidArgumentError(f"neighbours must be None (every row) or >= 1, got {neighbours!r}")
        if history < 1:
            raise InvalidArgumentError(f"history must be >= 1 (past tokens kept), got {history!r}")
        if max_experts is not None and max_experts < 1:
            raise InvalidArgumentError(f"max_experts must be None (no cap) or >= 1, got {max_experts!r}")
        if skip_recent < 0:
            raise InvalidArgumentError(f"skip_recent must be >= 0 (tokens), got {skip_recent!r}")
        self.distance = int(distance)
        self.threshold = float(threshold)
        self.decay = float(decay)
        self.sharpness = float(sharpness)
        self.prior = float(prior)
        self.neighbours = None if neighbours is None else int(neighbours)
        self.history = int(history)
        self.max_experts = max_experts
        self.skip_recent = int(skip_recent)
        self._shape = None  # (layers, experts) of the model seen
        self.kept = 0  # rows kept (at most history)

    def _reset(self, num_layers: int, num_experts: int) -> None:
        """Starts over for a model of this shape: no rows, no token."""
        self._shape = (num_layers, num_experts)
        # Rows last: a layer's experts' entries over every row are contiguous
        # (observe's gather), and a vote reads one column per near row.
        self._cols = np.zeros((num_layers, num_experts, self.history), dtype=np.float32)
        self._sizes = np.zeros((num_layers, self.history), dtype=np.float32)  # experts per row and layer
        self._next = 0  # ring position of the next row
        self.kept = 0
        self._recent: list = []  # ring positions of the last skip_recent rows, newest last
        self._token = None  # this token's routing so far (layers x experts), None before its first layer
        self._at = (-1, -1)  # (step, layer) of the last routing observed
        self._weighed = None  # what _weights made since the last observe

    def _commit(self) -> None:
        """Files the token in progress as a row."""
        if self._token is None or not self._token.any():
            self._token = None
            return
        pos = self._next
        self._cols[:, :, pos] = self._token
        self._sizes[:, pos] = self._token.sum(axis=1)
        self._next = (pos + 1) % self.history
        self.kept = min(self.kept + 1, self.history)
        if self.skip_recent:
            self._recent = (self._recent + [pos])[-self.skip_recent:]
        self._token = None

    def end_request(self) -> None:
        """The request ended: its last token becomes a row; the rows stay
        for later requests."""
        if self._shape is not None:
            self._commit()
            self._at = (-1, -1)

    def observe(self, ctx, step, layer, experts):
        """Takes in layer `layer`'s routing, as the controller gives it: a
        sorted int64 array of distinct experts within the model's."""
        num_layers, num_experts = ctx.num_layers, ctx.num_experts
        if self._shape != (num_layers, num_experts):
            self._reset(num_layers, num_experts)
        if not 0 <= layer < num_layers:
            return None
        if (step, layer) <= self._at or step != self._at[0]:  # a new token (or request)
            self._commit()
        if self._token is None:
            self._token = np.zeros((num_layers, num_experts), dtype=np.float32)
            self._acc = np.zeros((2, self.history), dtype=np.float32)  # per row: overlap, its own size
            self._norm = 0.0  # this token's own size
        else:  # a later layer of this token: the earlier ones fade by decay a layer
            fade = self.decay ** (layer - self._at[1])
            self._acc *= fade
            self._norm *= fade
        self._token[layer, experts] = 1.0
        if len(experts):
            self._acc[0] += self._cols[layer][experts].sum(axis=0)
        self._acc[1] += self._sizes[layer]
        self._norm += len(experts)
        self._at = (step, layer)
        self._weighed = None
        return None

    def _weights(self):
        """(near rows or None for every kept row, their weights, sum of the
        weights plus `prior`) for the token in progress, made once per
        routed layer; None with no rows or no routing yet."""
        if self._weighed is not None:
            return self._weighed
        if self._token is None or not self.kept or self._norm <= 0:
            return None
        n = self.kept
        cos = self._acc[0, :n] / np.sqrt(np.maximum(self._acc[1, :n], 1e-12) * self._norm)
        near = None
        if self.neighbours is not None and n > self.neighbours:
            near = np.argpartition(cos, n - self.neighbours)[n - self.neighbours:]
            cos = cos[near]
        w = np.exp(self.sharpness * (cos - 1.0))  # 1 for a row alike on every layer so far
        self._weighed = (near, w, float(w.sum()) + self.prior)
        return self._weighed

    def _votes(self, layer: int, last: int):
        """(votes of the near rows for every expert of layers layer + 1 ..
        last, one row per layer; their score times the total weight) or
        None; `layer` must be the last routing observed."""
        got = self._weights() if self._shape is not None and self._at[1] == layer else None
        if got is None or last <= layer:
            return None
        near, w, total = got
        block = self._cols[layer + 1 : last + 1]
        block = block[:, :, : self.kept] if near is None else block[:, :, near]
        return block @ w, total

    def scores(self, layer: int, target: int) -> np.ndarray | None:
        """Each expert's score at layer `target` for the token in progress
        after its routing at `layer` (the last observed): what `predict`
        thresholds (before it leaves out the last tokens' experts). None
        with no rows or no routing yet."""
        got = self._votes(layer, target) if self._shape is not None and layer < target < self._shape[0] else None
        if got is None:
            return None
        votes, total = got
        return votes[-1] / max(total, 1e-30)

    def predict(self, ctx, step, layer, hidden):
        if self._shape != (ctx.num_layers, ctx.num_experts) or self._at != (step, layer):
            return {}  # nothing observed for this routing (a predictor swapped in mid-step)
        last = min(layer + self.distance, ctx.num_layers - 1)
        got = self._votes(layer, last)
        if got is None:
            return {}
        votes, total = got
        for pos in self._recent:  # what the cache almost surely still holds
            votes[self._cols[layer + 1 : last + 1, :, pos] > 0] = 0.0
        hit = votes >= self.threshold * total
        rows, experts = np.nonzero(hit)
        experts = experts.astype(np.int64, copy=False)
        out, at = {}, 0
        for i, count in enumerate(hit.sum(axis=1).tolist()):
            if count:
                picked = experts[at : at + count]
                if self.max_experts is not None and count > self.max_experts:
                    top = np.argsort(-votes[i, picked], kind="stable")[: self.max_experts]
                    picked = np.sort(picked[top])
                out[layer + 1 + i] = picked
                at += count
        return out
