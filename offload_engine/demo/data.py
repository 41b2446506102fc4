"""A synthetic language with structure to learn: token sequences from a fixed sparse
Markov chain (each token has a few likely successors). The loss starts near ln(vocab) and
falls towards the chain's entropy, so a falling curve is visible within a few dozen steps.

Batches are a pure function of (seed, step, rank): a resumed run sees exactly the data an
uninterrupted one would.
"""

from __future__ import annotations

import torch


class MarkovText:
    """Sequences of ``seq_len + 1`` tokens; inputs are ``[:, :-1]``, targets ``[:, 1:]``."""

    def __init__(self, vocab_size: int, seq_len: int, branching: int = 4, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)
        weights = torch.rand(vocab_size, branching, generator=g) + 0.1
        self.probs = weights / weights.sum(dim=1, keepdim=True)
        self.seed = seed

    def batch(self, step: int, rank: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both [batch_size, seq_len] int64, for this step and rank."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + rank)
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=g)
        for t in range(self.seq_len):
            choice = torch.multinomial(self.probs[tokens[:, t]], 1, generator=g).squeeze(1)
            tokens[:, t + 1] = self.successors[tokens[:, t], choice]
        return tokens[:, :-1], tokens[:, 1:]
