"""PFlash: long prompts prefilled in a fraction of the time (issue 27; lucebox §5, written anew).

A small drafter with the target's tokenizer (the one the draft policy reads with, lucekv.kvflash.draft) reads a long
prompt and scores each token by the attention its last queries give it; the target then prefills only the selected
spans (lucekv.pflash.selection): head, tail (the question), anchors around earlier occurrences of the question's
4-grams, and the best-scored spans, in their original order.

The kept tokens are renumbered compactly: the target sees a shorter prompt, positions 0..kept-1, as if the dropped
text had never been there (lucebox does the same: its daemon hands the target the kept ids as a new prompt).
Holes at the original positions were the alternative; they would have to be carried by every piece that assumes a
sequence is its tokens at positions 0..n-1: the pager's chunks are written prefixes (`filled`), a parked or restored
sequence's slot map is rebuilt from its token count, snapshot blobs hold `rows` contiguous positions per chunk, the
prefix cache matches token lists, and the draft scorer and speculators read the history as a list. Compact, all of
them stay as they are, and a compressed session is an ordinary one holding fewer tokens.

What the session holds then differs from what the client sent. A session remembers its latest compression as a
`PromptAlias`: a later prompt that begins with the client's compressed prompt is read as the kept tokens followed by
the rest, so a second turn (which resends the history) reuses the session's K/V instead of prefilling it again. A
snapshot holds the session's own tokens (the kept ones), their K/V and the alias (the blob header's optional
`prompt_alias`), so a restored or spilled and reloaded session goes on the same way. A turn that diverges from the
client's compressed prompt drops the alias: it reuses the common prefix (up to the first dropped span) and computes
the rest, compressed again if it is long.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptAlias:
    """A client prompt beginning with `client` stands for a session holding `held` (its compressed form)."""

    client: tuple[int, ...]
    held: tuple[int, ...]

    def rewrite(self, ids: list[int]) -> list[int]:
        n = len(self.client)
        return [*self.held, *ids[n:]] if len(ids) >= n and tuple(ids[:n]) == self.client else list(ids)


@dataclass(frozen=True)
class CompressionUsage:
    """What a request's prompt compression did (Usage.compression)."""

    keep_ratio: float  # asked
    scored_tokens: int  # the prompt's tokens the drafter chose among (those not reused from the session)
    kept_tokens: int  # of them, the ones the target prefilled
    score_s: float  # the drafter's reading and the selection
