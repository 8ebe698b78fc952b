"""What a target forward costs, by batch rows and tokens per row: the table the draft policy decides on.

Measured on the machine that serves, because the answer (is a 7-token forward 1.2x or 3x a 1-token one?)
depends on the CPU, its threads and what else runs. The first version took the minimum of two timings per
shape, one shape after the other: on a busy 2-core machine a start took 15 s to over 3 minutes and the
table came out erratic (one row 40x slower than sixteen rows), so the policy decided on noise. Now:

- every shape is run once untimed first (oneDNN picks and caches kernels per shape on its first call);
- the repeats go round-robin over the shapes, so a burst of load spreads over many shapes instead of
  spoiling every sample of one; each shape's cost is the *median* of its samples;
- sanity: load only ever makes a forward slower, so a cost is replaced by the cheapest cost measured for a
  shape at least as large (more rows, more tokens): the table is monotone in both, and an inflated sample
  cannot make a small shape dearer than a big one;
- a time budget: `run(budget_s)` stops early (a start serves on what it has: the single-row table, or no
  table at all, which verifies every draft in full), and `step()` carries on later (the engine worker
  calls it while it has nothing else to do);
- the result is cached per model, machine and settings (`service.cost_cache`), so a warm start measures
  nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence

import torch
from transformers import DynamicCache

from service.executor.kv_cache import crop_cache, new_cache

# Bump when what is measured or how changes: cached tables of another version are measured again.
MEASUREMENT_VERSION = 3
CONTEXT = 128  # cached tokens per row before the timed forward: a typical early-generation context
REPEATS = 5
MIN_REPEATS = 3  # fewer samples than this per shape: the table is used, but not cached
_PREFILL_CHUNK = 32  # positions per prefill forward, so no single step blocks the worker for long


class ForwardCosts:
    """Seconds of a target forward by batch rows and tokens per row, interpolated between measured points.

    `by_rows[r]` holds the costs for r rows at 1..len tokens per row. A table with only r = 1 (a plain list
    of single-row costs) costs r rows of t tokens like one row of r * t tokens, which undercounts what a
    batch pays for its rows' own contexts; `measure_forward_costs` measures real batch shapes.
    """

    def __init__(self, by_rows: dict[int, Sequence[float]]) -> None:
        if not by_rows or 1 not in by_rows:
            raise ValueError("forward costs need at least the single-row table")
        self.by_rows = {r: list(c) for r, c in sorted(by_rows.items())}

    @classmethod
    def single_row(cls, costs: Sequence[float]) -> ForwardCosts:
        return cls({1: costs})

    def _row_cost(self, costs: list[float], tokens: int) -> float:
        if tokens <= len(costs):
            return costs[tokens - 1]
        # past the measured sizes a forward's cost grows about linearly in its tokens
        return costs[-1] * tokens / len(costs)

    def __call__(self, rows: int, tokens: int) -> float:
        if len(self.by_rows) == 1:
            return self._row_cost(self.by_rows[1], rows * tokens)
        measured = list(self.by_rows)
        if rows in self.by_rows:
            return self._row_cost(self.by_rows[rows], tokens)
        lower = max((r for r in measured if r < rows), default=measured[0])
        upper = min((r for r in measured if r > rows), default=None)
        if upper is None:  # beyond the largest measured batch: linear in rows
            return self._row_cost(self.by_rows[lower], tokens) * rows / lower
        lo, hi = self._row_cost(self.by_rows[lower], tokens), self._row_cost(self.by_rows[upper], tokens)
        return lo + (hi - lo) * (rows - lower) / (upper - lower)

    def describe(self, max_tokens: int) -> str:
        """'1x1: 12.0, 1x7: 20.1, ...' in milliseconds, for a log line."""
        return ", ".join(
            f"{rows}x{t}: {self(rows, t) * 1e3:.1f}" for rows in self.by_rows for t in sorted({1, max_tokens})
        )


def row_counts(max_rows: int) -> list[int]:
    """Doubling row counts up to max_rows: 1, 2, 4, ..., max_rows."""
    rows = [1]
    while rows[-1] < max_rows:
        rows.append(min(rows[-1] * 2, max_rows))
    return rows


def token_counts(rows: int, max_tokens: int) -> list[int]:
    """One row at every size (the policy's main case); batches at 1, 2, 4 and the most (interpolated)."""
    if rows == 1:
        return list(range(1, max_tokens + 1))
    return sorted({1, min(2, max_tokens), min(4, max_tokens), max_tokens})


def summarise(samples: dict[tuple[int, int], list[float]], max_tokens: int) -> ForwardCosts:
    """The cost table from timed samples per (rows, tokens): medians, interpolation between measured token
    counts, then the sanity pass (each cost at most the cheapest of any shape at least as large). Row counts
    without a sample at every planned size are left out (the table interpolates over rows)."""
    medians: dict[int, dict[int, float]] = {}
    for (rows, tokens), values in samples.items():
        if values:
            medians.setdefault(rows, {})[tokens] = statistics.median(values)
    table: dict[int, list[float]] = {}
    for rows, measured in sorted(medians.items()):
        if set(token_counts(rows, max_tokens)) - set(measured):
            continue
        costs: list[float] = []
        for n in range(1, max_tokens + 1):
            if n in measured:
                costs.append(measured[n])
                continue
            lo = max(m for m in measured if m < n)
            hi = min(m for m in measured if m > n)
            costs.append(measured[lo] + (measured[hi] - measured[lo]) * (n - lo) / (hi - lo))
        table[rows] = costs
    # Load inflates timings, never deflates them: trust the cheaper of a shape and any larger one.
    ordered = sorted(table)
    for i in reversed(range(len(ordered))):
        costs = table[ordered[i]]
        above = table[ordered[i + 1]] if i + 1 < len(ordered) else None
        for t in reversed(range(max_tokens)):
            if t + 1 < max_tokens:
                costs[t] = min(costs[t], costs[t + 1])
            if above is not None:
                costs[t] = min(costs[t], above[t])
    return ForwardCosts(table)


class CostMeasurement:
    """A measurement that can be run in slices: `step()` does one forward (False once all is measured),
    `run(budget_s)` steps until done or out of time. `table()` is usable once the single row is measured
    (`single_row_measured`): what one request needs; batches follow."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_tokens: int,
        max_rows: int = 1,
        context: int = CONTEXT,
        repeats: int = REPEATS,
    ) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.max_rows = max_rows
        self.context = context
        self.repeats = repeats
        self.samples: dict[tuple[int, int], list[float]] = {
            (rows, t): [] for rows in row_counts(max_rows) for t in token_counts(rows, max_tokens)
        }
        self.forwards = 0  # forwards run so far, timed or not
        self.order: list[tuple[int, int]] = []  # (rows, tokens) of each timed sample, in the order taken
        self.done = False
        self._forwards = self._plan()

    def measure_next(self) -> bool:
        """One forward of the measurement; False when nothing is left to measure."""
        if self.done:
            return False
        if not next(self._forwards, False):
            self.done = True
        return not self.done

    def run(self, budget_s: float | None = None) -> CostMeasurement:
        started = time.monotonic()
        while self.measure_next():
            if budget_s is not None and time.monotonic() - started > budget_s:
                break
        return self

    @property
    def single_row_measured(self) -> bool:
        return all(self.samples[(1, t)] for t in token_counts(1, self.max_tokens))

    @property
    def complete(self) -> bool:
        """Every shape has enough samples for its median to be worth caching."""
        return all(len(v) >= min(MIN_REPEATS, self.repeats) for v in self.samples.values())

    def table(self) -> ForwardCosts:
        return summarise(self.samples, self.max_tokens)

    def _plan(self) -> Iterator[bool]:
        """Yields after every forward: per row count a chunked prefill, one untimed forward per shape,
        then `repeats` timed rounds over all its shapes."""
        model = self.model
        device = next(model.parameters()).device
        vocab = model.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        for rows in row_counts(self.max_rows):
            sizes = token_counts(rows, self.max_tokens)
            prefix = torch.randint(0, vocab, (rows, self.context), generator=generator).to(device)
            inputs = {n: torch.randint(0, vocab, (rows, n), generator=generator).to(device) for n in sizes}
            cache = new_cache(model.config)
            for start in range(0, self.context, _PREFILL_CHUNK):
                with torch.inference_mode():
                    model(input_ids=prefix[:, start : start + _PREFILL_CHUNK], cache=cache, logits_to_keep=1)
                self.forwards += 1
                yield True
            for n in sizes:  # warm-up: the first call of a shape pays for kernel selection
                self._forward(inputs[n], cache)
                yield True
            for _ in range(self.repeats):
                for n in sizes:
                    self.samples[(rows, n)].append(self._forward(inputs[n], cache))
                    self.order.append((rows, n))
                    yield True

    def _forward(self, ids: torch.Tensor, cache: DynamicCache) -> float:
        """Seconds of one forward of `ids` ([rows, n]) after the cached context; the cache is cropped back."""
        device = ids.device
        with torch.inference_mode():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            self.model(input_ids=ids, cache=cache)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - started
            crop_cache(cache, self.context)
        self.forwards += 1
        return elapsed


def measure_forward_costs(
    model: torch.nn.Module,
    max_tokens: int,
    context: int = CONTEXT,
    repeats: int = REPEATS,
    max_rows: int = 1,
    budget_s: float | None = None,
) -> ForwardCosts:
    """Seconds of a target forward over `rows` rows of t = 1..max_tokens new tokens after `context` cached
    ones each. One row is measured at every t; batches at doubling row counts up to `max_rows`, at
    t = 1, 2, 4 and max_tokens (interpolated between). Real batch shapes, so the cost of each row's own
    context (attention, cache growth) is in the table. Runs to the end unless `budget_s` is given."""
    return CostMeasurement(model, max_tokens, max_rows, context, repeats).run(budget_s).table()
