"""aamperf: make PyTorch training fast, and prove it, with AAM as the workload."""

__version__ = "0.1.0"
