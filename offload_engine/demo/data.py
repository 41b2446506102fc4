"""A synthetic language with structure to learn: token sequences from a fixed sparse
Markov chain (each token has a few likely successors). The loss starts near ln(vocab) and
falls towards the chain's entropy, so a falling curve is visible within a few dozen steps.

A batch is a pure function of (seed, batch id, rank). Which batch comes next is the
sampler's business (``ShuffledBatches``): each rank walks its own shuffled order of batch
ids with its own generator, a state that a checkpoint must carry for a resumed run to see
exactly the data an uninterrupted one would.
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

    def batch(self, batch_id: int, rank: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both [batch_size, seq_len] int64, for this batch id and rank."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + batch_id * 1009 + rank)
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=g)
        for t in range(self.seq_len):
            choice = torch.multinomial(self.probs[tokens[:, t]], 1, generator=g).squeeze(1)
            tokens[:, t + 1] = self.successors[tokens[:, t], choice]
        return tokens[:, :-1], tokens[:, 1:]


class ShuffledBatches:
    """Batch ids ``0 .. count-1`` in a new random order every epoch, per rank: a sampler
    with state (its generator, the current order and position), as a data loader's is.
    ``state_dict`` / ``load_state_dict`` carry it through a checkpoint."""

    def __init__(self, count: int, rank: int, seed: int = 0):
        self.count = count
        self.gen = torch.Generator().manual_seed(seed * 7919 + rank)
        self.epoch, self.pos = 0, 0
        self.order = torch.randperm(count, generator=self.gen)

    def next(self) -> int:
        """The next batch id (a new shuffle once an epoch is used up)."""
        if self.pos == self.count:
            self.epoch, self.pos = self.epoch + 1, 0
            self.order = torch.randperm(self.count, generator=self.gen)
        self.pos += 1
        return int(self.order[self.pos - 1])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "order": self.order.clone(),
                "generator": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self.order = state["order"].clone()
        self.gen.set_state(state["generator"])
