"""Use what was trained: a completed run's model applied to samples (`python -m aamperf.predict`).

Writes, into its own directory: `embeddings.tsv` (one row per sample: its id, then the sample
embedding), `targets.tsv` when the run learned a target (a regression's value, and each quantile's, in
the target's own units: its transform inverted; a classification's class and each class's probability;
the observed value or class where the metadata has one), `unifrac.npy` + `unifrac.ids.txt` (the predicted
UniFrac between every pair of samples) with `pairwise=true`, and a `summary.json` of its own.

The command: `__main__.py`; its work: `run.py` (the bases it hides: `masks.py`). This package imports
nothing itself, so that the command can start again with its allocator (aamperf/allocator.py) before torch
loads."""
