"""Sequences to tokens (the ids: aamperf/tokens.py): START, then up to 150 bases, then PAD."""

import re

import numpy as np
import torch

from aamperf.tokens import ASV_BP, PAD, START, TOKENS_PER_ASV, A, C, G, T, real_bases

# Ambiguous IUPAC letters (N, R, Y, ...) become PAD: the model has no token for them, and PAD keeps
# them out of the masked-nucleotide loss and out of `n_tokens`. Any other character is an error.
IUPAC_AMBIGUOUS = "NRYSWKMBDHV"
_NUCLEOTIDE = re.compile(rf"[ACGT{IUPAC_AMBIGUOUS}]*", re.IGNORECASE)

_LOOKUP = np.full(256, -1, dtype=np.int16)  # byte -> token; -1 marks an invalid character
for _letter, _token in zip("ACGT", (A, C, G, T), strict=True):
    _LOOKUP[ord(_letter)] = _LOOKUP[ord(_letter.lower())] = _token
for _letter in IUPAC_AMBIGUOUS:
    _LOOKUP[ord(_letter)] = _LOOKUP[ord(_letter.lower())] = PAD


def looks_like_sequence(text: str) -> bool:
    """True when an observation id is itself a DNA sequence: the rule of FASTA records (A/C/G/T and the
    ambiguous IUPAC letters, any case), not empty."""
    return bool(text) and is_nucleotide_sequence(text)


def is_nucleotide_sequence(text: str) -> bool:
    """True when every character is A/C/G/T or an ambiguous IUPAC letter (any case)."""
    return _NUCLEOTIDE.fullmatch(text) is not None


def tokenize_sequences(sequences: list[str]) -> torch.Tensor:
    """Tokens [n, 151] (uint8): START, then up to 150 bases, then PAD.

    uint8 keeps the table small (it is gathered for every batch); collate widens it to int64.
    Raises ValueError naming the first sequence with a character outside A/C/G/T/IUPAC.
    """
    tokens = np.zeros((len(sequences), TOKENS_PER_ASV), dtype=np.uint8)
    tokens[:, 0] = START
    for row, sequence in enumerate(sequences):
        raw = np.frombuffer(sequence[:ASV_BP].encode("ascii", errors="replace"), dtype=np.uint8)
        coded = _LOOKUP[raw]
        if (coded < 0).any():
            bad = sequence[int(np.argmax(coded < 0))]
            raise ValueError(f"sequence {row} has the character {bad!r}, not a nucleotide letter")
        tokens[row, 1 : 1 + len(coded)] = coded
    return torch.from_numpy(tokens)


def count_real_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """Real nucleotides (A/C/G/T: tokens 1-4) per row; START, PAD and ambiguous letters excluded."""
    return real_bases(tokens).sum(dim=-1)
