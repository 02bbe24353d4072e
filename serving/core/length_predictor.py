"""Output-length prediction for tail-aware admission (StreamRL's skewness-aware dispatch): admit
the requests predicted to run longest first, so the tail starts early instead of last.

StreamRL ranks requests with a small model; this starts simpler: an online linear regression of
log output length on hashed prompt features (each token at its position from the start and
from the end, and each token bigram), trained on every request the engine finishes. Only the
ranking matters to the scheduler, so a rough fit is enough.
"""

from __future__ import annotations

import math
import threading
from typing import Sequence

import numpy as np


class LengthPredictor:
    def __init__(self, dim: int = 1 << 14, lr: float = 0.1, max_positions: int = 64):
        self.dim = dim
        self.lr = lr
        self.max_positions = max_positions
        self._w = np.zeros(dim, np.float64)
        self._bias = 0.0
        self._seen = 0
        self._lock = threading.Lock()

    def _features(self, prompt: Sequence[int]) -> np.ndarray:
        n = len(prompt)
        # Tuples of ints: their hash is the same in every process (a str's is not).
        keys = [(0, i, t) for i, t in enumerate(prompt[: self.max_positions])]
        keys += [(1, n - i, t) for i, t in enumerate(prompt) if n - i <= self.max_positions]
        keys += [(2, a, b) for a, b in zip(prompt, prompt[1:])]
        keys.append((3, min(n, 4096)))
        return np.unique(np.asarray([hash(k) % self.dim for k in keys]))

    def predict(self, prompt: Sequence[int]) -> float:
        """Expected output tokens (the mean seen so far until something is learned)."""
        x = self._features(prompt)
        with self._lock:
            return math.expm1(max(self._bias + self._w[x].sum() / math.sqrt(len(x)), 0.0))

    def update(self, prompt: Sequence[int], output_tokens: int) -> None:
        """One SGD step on the squared error of log(1 + tokens)."""
        x = self._features(prompt)
        scale = 1.0 / math.sqrt(len(x))
        with self._lock:
            error = math.log1p(output_tokens) - (self._bias + self._w[x].sum() * scale)
            self._seen += 1
            self._bias += error / self._seen if self._seen < 100 else self.lr * 0.1 * error
            self._w[x] += self.lr * error * scale
