"""The drafter's side of PFlash: read a prompt with a DraftReader, score its tokens, select the spans to keep."""

from __future__ import annotations

import time

from lucekv.kvflash.draft import DraftReader, token_scores
from lucekv.pflash import CompressionUsage
from lucekv.pflash.selection import Selection, select_spans

DEFAULT_THRESHOLD = 2048  # prompts (their part to compute) no longer than this are prefilled whole


class PromptCompressor:
    """Selects the spans of long prompts. One owner of its reader among others (the draft policy's scorers): a
    prompt that extends the one read last (a session's next turn) is read on from there."""

    def __init__(self, reader: DraftReader, threshold: int = DEFAULT_THRESHOLD):
        self.reader = reader
        self.threshold = threshold

    def wants(self, n_tokens: int) -> bool:
        """Whether a prompt part of n_tokens to compute is long enough to compress."""
        return n_tokens > self.threshold

    def compress(self, ids: list[int], start: int, keep: float) -> tuple[list[int], CompressionUsage]:
        """ids[:start] (reused: kept as they are) and the selected spans of the rest, with what was done."""
        t0 = time.perf_counter()
        selection = self.select(ids, start, keep)
        kept = ids[:start] + [ids[i] for i in selection.positions().tolist()]
        return kept, CompressionUsage(keep, len(ids) - start, selection.kept_tokens, time.perf_counter() - t0)

    def select(self, ids: list[int], start: int, keep: float) -> Selection:
        r = self.reader
        extends = r.owner is self and r.steps and len(ids) >= r.steps[-1] and ids[: len(r.tokens)] == r.tokens
        r.read(self, ids, ([*r.steps, len(ids)] if len(ids) > r.steps[-1] else r.steps) if extends else [len(ids)])
        return select_spans(token_scores(*r.inputs())[start:], ids, start, keep)
