"""Data for the AAM workload: simulated or the user's BIOM table, rarefied, tokenized, with UniFrac."""

from aamperf.data.dataset import Data, build_data, rebatch

__all__ = ["Data", "build_data", "rebatch"]
