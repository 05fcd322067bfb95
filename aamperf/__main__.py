"""`python -m aamperf`: the commands."""

import sys

COMMANDS = """aamperf: PyTorch training made fast, and the proof of it.

  python -m aamperf.train [overrides]       one run; --help lists the config groups and levels
  python -m aamperf.train -m [overrides]    a sweep (e.g. optim=baseline,ultra seed=0,1,2) and its report
  python -m aamperf.compare DIR [...]       the comparison report of runs (--help for its options)
  python -m aamperf.predict run=DIR [...]   a completed run's model applied to samples (embeddings, targets)
  python -m aamperf.launch ARGS             torchrun with aamperf's exit codes (torchrun's arguments)

The same as console scripts: aamperf-train, aamperf-compare, aamperf-predict,
aamperf-launch."""


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] not in ("-h", "--help"):  # not a command itself: it names them
        print(COMMANDS, file=sys.stderr)
        print(f"error: {args[0]}: not a command; run one of the commands above", file=sys.stderr)
        sys.exit(2)
    print(COMMANDS)


if __name__ == "__main__":
    main()
