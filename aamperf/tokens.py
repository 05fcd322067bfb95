"""The token ids and lengths of the AAM workload, shared by the data pipeline and the model (no imports:
the model needs them without the data's biom and h5py)."""

PAD, A, C, G, T, START, MASK = range(7)  # PAD: padding and ambiguous letters; MASK: a hidden base
VOCAB_SIZE = 7
ASV_BP = 150  # longer sequences are truncated, shorter ones padded with PAD
TOKENS_PER_ASV = ASV_BP + 1  # START + 150 bp


def real_bases(tokens):
    """Bool tensor (or array) of the tokens that are real bases, A/C/G/T: START, PAD and MASK excluded."""
    return (tokens >= A) & (tokens <= T)
