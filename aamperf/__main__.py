"""`python -m aamperf`: the commands."""

COMMANDS = """aamperf: PyTorch training made fast, and the proof of it.

  python -m aamperf.train [overrides]       one run; --help lists the config groups and levels
  python -m aamperf.train -m [overrides]    a sweep (e.g. optim=baseline,ultra seed=0,1,2) and its report
  python -m aamperf.compare DIR [...]       the comparison report of runs (--help for its options)
  python -m aamperf.predict run=DIR [...]   a completed run's model applied to samples (embeddings, targets)
  python -m aamperf.launch ARGS             torchrun with aamperf's exit codes (torchrun's arguments)

The same as console scripts: aamperf-train, aamperf-compare, aamperf-predict,
aamperf-launch."""


def main() -> None:
    print(COMMANDS)


if __name__ == "__main__":
    main()
