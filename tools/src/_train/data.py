"""The embedded corpus (Shakespeare's tragedies, public domain) as character tokens."""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = Path(__file__).resolve().parents[2] / "data" / "shakespeare.txt"


class CharCorpus:
    """A text file as a tensor of character ids, with deterministic batches."""

    def __init__(self, path: Path = CORPUS) -> None:
        if not path.exists():
            raise FileNotFoundError(f"corpus {path} is missing (it ships in tools/data/)")
        text = path.read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.index[c] for c in text], dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        """Distinct characters."""
        return len(self.chars)

    def decode(self, ids: list[int]) -> str:
        """Token ids back to text."""
        return "".join(self.chars[i] for i in ids)

    def encode(self, text: str) -> list[int]:
        """Text to token ids (characters outside the corpus become spaces)."""
        space = self.index.get(" ", 0)
        return [self.index.get(c, space) for c in text]

    def batch(
        self, step: int, rank: int, world: int, batch: int, seq: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the global batch for ``step`` (inputs, next-char targets).

        The global batch (``world * batch`` windows) depends only on the seed and the
        step, so any world size sees the same global data.
        """
        if seq + 1 >= self.data.numel():
            raise ValueError(
                f"--seq-len {seq} is longer than the corpus ({self.data.numel()} chars)"
            )
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, self.data.numel() - seq - 1, (world * batch,), generator=g)
        mine = starts[rank * batch : (rank + 1) * batch]
        windows = torch.stack([self.data[s : s + seq + 1] for s in mine.tolist()])
        return windows[:, :-1], windows[:, 1:]
