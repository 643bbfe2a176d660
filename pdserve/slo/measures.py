"""What the estimator learns online (``estimator.py`` turns it into estimates): moving
averages, the per-token time over a window of token gaps, a line fitted to prefill times, and
the output lengths of each class."""

from __future__ import annotations

import statistics
from collections import deque

OUTPUT_WINDOW = 256  # output lengths kept per class
EWMA_ALPHA = 0.2
PER_TOKEN_WINDOW_S = 10.0  # the per-token time is measured over the token gaps of the last seconds
FIT_DECAY = 0.98  # weight of older prefill observations (per new one)


class Ewma:
    __slots__ = ("alpha", "value")

    def __init__(self, alpha: float = EWMA_ALPHA, value: float | None = None):
        self.alpha, self.value = alpha, value

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


class WindowRate:
    """Seconds per token over the last ``window_s`` seconds of observations, weighted by tokens
    (sum of seconds / sum of tokens: a long gap and many short ones average as they should);
    the last value when nothing was observed for a while."""

    def __init__(self, window_s: float = PER_TOKEN_WINDOW_S):
        self.window_s = window_s
        self.events: deque[tuple[float, int, float]] = deque()  # (when, tokens, seconds)
        self.tokens, self.seconds = 0, 0.0
        self.last: float | None = None

    def add(self, now: float, tokens: int, seconds: float) -> None:
        self.events.append((now, tokens, seconds))
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        while self.events and self.events[0][0] < now - self.window_s:
            _, n, sec = self.events.popleft()
            self.tokens, self.seconds = self.tokens - n, self.seconds - sec
        if self.tokens > 0:
            self.last = max(0.0, self.seconds) / self.tokens

    @property
    def value(self) -> float | None:
        return self.last


class LineFit:
    """y = a + b x by exponentially decayed least squares (newer observations weigh more)."""

    __slots__ = ("decay", "n", "sx", "sy", "sxx", "sxy")

    def __init__(self, decay: float = FIT_DECAY):
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        k = self.decay
        self.n, self.sx, self.sy = self.n * k + 1, self.sx * k + x, self.sy * k + y
        self.sxx, self.sxy = self.sxx * k + x * x, self.sxy * k + x * y

    def predict(self, x: float) -> float | None:
        if self.n == 0:
            return None
        var = self.n * self.sxx - self.sx * self.sx
        if var <= 1e-9 * max(1.0, self.sxx * self.n):  # one distinct x so far: proportional to x
            return max(0.0, self.sy / self.sx * x) if self.sx > 0 else self.sy / self.n
        b = (self.n * self.sxy - self.sx * self.sy) / var
        a = (self.sy - b * self.sx) / self.n
        if b < 0:  # noise: no slope is better than a negative one
            return max(0.0, self.sy / self.n)
        return max(0.0, a + b * x)


class OutputLengths:
    """The recent output lengths of each class (a window of ``window`` per class), and whether
    each request ran to its max_tokens (a client that sets ``ignore_eos`` always does; one that
    stops at EOS rarely): a request runs to its own limit with the class's share of those, else
    it is as long as the ones that stopped on their own."""

    def __init__(self, window: int = OUTPUT_WINDOW):
        self.window = window
        self.by_class: dict[str, deque[tuple[int, bool]]] = {}
        self._cache: dict[tuple, float] = {}  # answers since the last add (plans ask the same again and again)

    def add(self, cls: str, n: int, hit_limit: bool = False) -> None:
        self.by_class.setdefault(cls, deque(maxlen=self.window)).append((n, hit_limit))
        self._cache.clear()

    def _samples(self, cls: str):
        own = self.by_class.get(cls)
        if own:
            return own
        return [x for d in self.by_class.values() for x in d]  # a class not seen yet: everybody's

    def _cached(self, key: tuple, compute) -> float:
        if key not in self._cache:
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = compute()
        return self._cache[key]

    def expected(self, cls: str, max_tokens: int, produced: int = 0) -> float:
        """E[min(O, max_tokens) - produced | O > produced]; unknown: what is left of max_tokens."""
        return self._cached(("e", cls, max_tokens, produced), lambda: self._expected(cls, max_tokens, produced))

    def _expected(self, cls: str, max_tokens: int, produced: int) -> float:
        left = max_tokens - produced
        samples = self._samples(cls)
        if not samples:
            return float(left) if produced == 0 else max(1.0, left / 2)
        early = [n for n, hit in samples if not hit]
        hit_share = 1 - len(early) / len(samples)
        longer = [min(n, max_tokens) for n in early if n > produced]
        # P(it runs to its limit | it made `produced` tokens) against P(it stops early later)
        w_limit, w_early = hit_share, (1 - hit_share) * (len(longer) / len(early) if early else 0.0)
        if w_limit + w_early == 0:
            return max(1.0, left / 2)
        early_left = sum(longer) / len(longer) - produced if longer else float(left)
        value = (w_limit * left + w_early * early_left) / (w_limit + w_early)
        return max(1.0, min(float(left), value))

    def spread(self, cls: str, max_tokens: int) -> float:
        """The standard deviation of min(O, max_tokens) (QLM's sigma_o)."""
        def compute() -> float:
            values = [max_tokens if hit else min(n, max_tokens) for n, hit in self._samples(cls)]
            return statistics.pstdev(values) if len(values) > 1 else 0.0
        return self._cached(("s", cls, max_tokens), compute)

    def count(self) -> int:
        return sum(len(d) for d in self.by_class.values())
