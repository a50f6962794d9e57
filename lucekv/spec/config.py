"""Speculative decoding settings: the server's default mode and the drafters it offers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lucekv.errors import ConfigError, InvalidRequestError

# off: plain decoding; auto: the gate decides, round by round, whether the suffix drafter pays; suffix / draft /
# dflash: always that drafter; suffix-tree / dflash-tree: that drafter's trees (several candidates per depth,
# lucekv.spec.tree)
MODES = ("off", "auto", "suffix", "suffix-tree", "draft", "dflash", "dflash-tree")
MAX_DRAFT = 16  # draft tokens a round verifies at most


@dataclass(frozen=True)
class SpecConfig:
    mode: str = "off"  # for requests that do not choose (the CLI and server default to auto)
    max_draft: int = MAX_DRAFT
    shared_outputs: bool = True  # the suffix drafter also matches the recent outputs of every session
    draft_model: Path | None = None  # a GGUF with the target's tokenizer, for mode "draft"
    dflash_drafter: Path | None = None  # a DFlash drafter GGUF made for the target (lucekv.spec.dflash), mode "dflash"
    tree_verify: bool = True  # the backend verifies draft trees (the engine sets it), mode "suffix-tree"

    def available(self) -> tuple[str, ...]:
        """The modes a request may ask for."""
        trees = self.tree_verify or None
        needs = {"draft": self.draft_model, "dflash": self.dflash_drafter, "suffix-tree": trees,
                 "dflash-tree": trees and self.dflash_drafter}
        return tuple(m for m in MODES if m not in needs or needs[m] is not None)

    def check(self) -> SpecConfig:
        if self.mode not in MODES:
            raise ConfigError(f"speculation mode {self.mode!r} is unknown (choose {', '.join(MODES)})")
        if self.mode not in self.available():
            raise ConfigError(f"speculation mode {self.mode!r} needs {_needs(self.mode)}")
        if not 1 <= self.max_draft <= 64:
            raise ConfigError(f"max draft length must be in [1, 64] (got {self.max_draft})")
        return self

    def resolve(self, mode: str | None) -> str:
        """A request's mode (None or "": the default), refused with InvalidRequestError when unavailable."""
        mode = mode or self.mode
        if mode not in MODES:
            raise InvalidRequestError("speculation", f"unknown mode {mode!r} (choose {', '.join(MODES)})")
        if mode not in self.available():
            raise InvalidRequestError("speculation", f"mode {mode!r} is not available on this server: it needs "
                                      f"{_needs(mode)}")
        return mode


def _needs(mode: str) -> str:
    return {"draft": "a draft model (--draft-model)",
            "dflash": "a DFlash drafter (--dflash-drafter)",
            "suffix-tree": "a backend that verifies draft trees",
            "dflash-tree": "a DFlash drafter (--dflash-drafter) and a backend that verifies draft trees"}[mode]
