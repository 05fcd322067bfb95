"""Docs that cannot rot: each aamperf command in README.md and docs/ composes (or parses), and each relative
link in them and in the studies' READMEs resolves (tests/doc_text.py reads the Markdown).

A command is checked in this process, the way its program reads it: train and predict through Hydra's own
argument parser and compose API (`--cfg job` without running anything), compare through its argparse
parser. A `-m` sweep is composed at the first value of each sweep (`a,b`, `choice(...)`, `range(...)`).
"""

import argparse
import contextlib
import io
import re
import shlex
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest
from doc_text import ANGLED, Command, anchors, commands_in, links_in
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from aamperf import compare
from aamperf.config import CONF_DIR, register_configs
from aamperf.predict.config import register_predict_configs

REPO = Path(__file__).resolve().parents[1]
COMMAND_DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK_DOCS = [
    *COMMAND_DOCS,
    *sorted(REPO.glob("history.md")),
    *sorted((REPO / "experiments").rglob("README.md")),
    *sorted((REPO / "experiments").rglob("history.md")),
]
CONFIG_OF = {"train": "config", "predict": "predict"}

# Placeholders: where a doc writes a value the user (or the shell) chooses. A shell word that is only a
# placeholder, or an ellipsis, is dropped; an override whose value holds one is not composed (its type is
# unknown), but its key must be one the config has. Other made-up values compose as written
# (`data.table=t.biom`, `run=DIR` are strings). compare keeps placeholders as the paths they stand for.
PLACEHOLDER = "PLACEHOLDER"  # what each <...> (`<run dir>`, `<sweep dir>`, `<yours>`) becomes
ELLIPSES = ("...", "…")  # `trainer.max_steps=...`, `DIR [DIR ...]`
PLACEHOLDER_VALUES = {"N", "DIR"}  # `seed=N`
SHELL_VARIABLE = re.compile(r"\$[A-Za-z_]")  # `seed=$SLURM_ARRAY_TASK_ID` (not Hydra's `${now:...}`)


class DocError(AssertionError):
    """A command in a doc that its program would refuse: the doc, its line, and why."""


def shell_words(command: Command) -> list[str]:
    """The command's arguments as a shell splits them, to a `#` comment or the next command (`&&`, `;`,
    `|`); placeholders as PLACEHOLDER, ellipses dropped, and an optional argument's brackets (`[DIR ...]`)."""
    try:
        words = shlex.split(ANGLED.sub(PLACEHOLDER, command.words), comments=True)
    except ValueError as exc:  # an unclosed quote
        raise DocError(f"{where(command)}: a shell cannot split it ({exc})") from None
    kept, optional = [], False
    for word in words:
        if word in ("&&", "||", ";", "|", "&") or word.startswith((">", "2>")):
            break
        if word.startswith("["):  # an option written [key=value]: no Hydra override starts with [
            word, optional = word[1:], True
        if optional and word.endswith("]"):
            word, optional = word[:-1], False
        if word and word not in ELLIPSES and (word != PLACEHOLDER or command.module == "compare"):
            kept.append(word)
    return kept


def shown(doc: Path) -> Path:
    """A doc's path from the repository's root (a test's own doc elsewhere: as it is)."""
    return doc.relative_to(REPO) if doc.is_relative_to(REPO) else doc


def where(command: Command) -> str:
    return f"{shown(command.doc)}:{command.line}: `{command.code}`"


def is_placeholder(value: str) -> bool:
    return (
        PLACEHOLDER in value
        or value in PLACEHOLDER_VALUES
        or any(e in value for e in ELLIPSES)
        or SHELL_VARIABLE.search(value) is not None
    )


def hydra_overrides(command: Command, words: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """Hydra's reading of the command line: its flags, the overrides to compose (each sweep at its first
    value under -m), and the keys of those set aside (a placeholder's; a config group option in the
    command's own hydra.searchpath) that the composed config must still have."""
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            args = get_args_parser().parse_args(words)
        except SystemExit:
            why = err.getvalue().strip().splitlines()[-1].split("error: ")[-1]
            raise DocError(f"{where(command)}: Hydra's command line: {why}") from None
    if not (args.help or args.hydra_help):  # Hydra's own rule (hydra/_internal/utils.py)
        commands = args.run + (args.cfg is not None) + args.multirun + args.shell_completion
        if commands + (args.info is not None) > 1:
            raise DocError(f"{where(command)}: Hydra allows only one of --run, --multirun, --cfg, --info")
    searchpath = any(word.startswith("hydra.searchpath=") for word in args.overrides)
    overrides, keys, parser = [], [], OverridesParser.create()
    for word in args.overrides:
        key, is_set, value = word.partition("=")
        if is_set and is_placeholder(value):
            keys.append(key)
            continue
        try:
            override = parser.parse_override(word)
        except HydraException as exc:
            raise DocError(f"{where(command)}: {exc}") from None
        if args.multirun and override.is_sweep_override():
            try:
                ConfigLoaderImpl.validate_sweep_overrides_legal([override], RunMode.MULTIRUN, from_shell=True)
            except HydraException as exc:
                raise DocError(f"{where(command)}: {exc}") from None
            if override.is_interval_sweep():
                value = str(override.value().start)
            elif override.is_discrete_sweep():
                value = next(override.sweep_string_iterator())
            word = f"{override.get_key_element()}={value}"
        group = CONF_DIR / key.lstrip("+~")
        if searchpath and group.is_dir() and not (group / f"{value}.yaml").exists():
            keys.append(key)  # an option of the user's own config directory (`optim=fastest` of a search)
            continue
        overrides.append(word)
    return args, overrides, keys


def has_key(cfg: DictConfig, key: str) -> bool:
    """A plain key (`trainer.max_steps`) of the composed config, or a config group (`optim`,
    `hydra/launcher`) it chose; `+key` adds a key, so any is fine."""
    if key.startswith("+"):
        return True
    key = key.lstrip("~")
    if key in cfg.hydra.runtime.choices or (CONF_DIR / key).is_dir():
        return True
    node = OmegaConf.to_container(cfg, resolve=False)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


@cache
def composed(config_name: str, overrides: tuple[str, ...]) -> DictConfig | Exception:
    """The config Hydra composes (its hydra node kept), or Hydra's error: each set of overrides once (a
    compose takes 0.1-0.3 s, and the docs repeat commands)."""
    register_configs()
    register_predict_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return compose(config_name, list(overrides), return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as exc:
        return exc


def check_hydra_command(command: Command) -> None:
    """A train or predict command composes as `--cfg job` would compose it; a key set aside exists."""
    args, overrides, keys = hydra_overrides(command, shell_words(command))
    if args.experimental_rerun:  # the pickle of a run the user made: nothing to compose
        return
    cfg = composed(args.config_name or CONFIG_OF[command.module], tuple(overrides))
    if isinstance(cfg, Exception):
        why = f"{cfg} ({cfg.__cause__})" if cfg.__cause__ else str(cfg)
        raise DocError(f"{where(command)}: does not compose: {why}")
    unknown = [key for key in keys if not has_key(cfg, key)]
    if unknown:
        raise DocError(f"{where(command)}: no such key in the config: {', '.join(unknown)}")


def check_compare_command(command: Command) -> None:
    """compare's parser takes the command's arguments (a bare `python -m aamperf.compare`: its --help)."""
    words = shell_words(command) or ["--help"]
    with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()):
        try:
            compare.build_parser().parse_args(words)
        except SystemExit as exc:
            if exc.code != 0:  # 0: --help
                raise DocError(f"{where(command)}: {err.getvalue().strip().splitlines()[-1]}") from None


def check_command(command: Command) -> None:
    """Raises DocError where the command's program would refuse it."""
    if command.module == "compare":
        check_compare_command(command)
    else:
        check_hydra_command(command)


def broken_links(doc: Path) -> list[str]:
    """`doc:line: target: why` for each relative link of a doc that does not resolve (http(s) and other
    schemes are not checked)."""
    broken = []
    for line, target in links_in(doc):
        if ":" in target.split("/")[0]:  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        path = unquote(path.split("?")[0])
        file = doc if not path else (REPO / path.lstrip("/") if path.startswith("/") else doc.parent / path)
        file, root = file.resolve(), REPO if doc.is_relative_to(REPO) else doc.parent
        why = ""
        if not file.is_relative_to(root) or not file.exists():
            why = "no such file in the repository"
        elif anchor and file.suffix == ".md" and unquote(anchor) not in anchors(file):
            why = f"no heading with that anchor in {shown(file)}"
        if why:
            broken.append(f"{shown(doc)}:{line}: {target}: {why}")
    return broken


def command_ids(commands: list[Command]) -> list[str]:
    """doc:line of each command; the second on a line doc:line+1 (the third +2)."""
    ids: list[str] = []
    for command in commands:
        line = f"{shown(command.doc)}:{command.line}"
        before = sum(1 for i in ids if i == line or i.startswith(f"{line}+"))
        ids.append(f"{line}+{before}" if before else line)
    return ids


COMMANDS = [command for doc in COMMAND_DOCS if doc.exists() for command in commands_in(doc)]


@pytest.mark.parametrize("command", COMMANDS, ids=command_ids(COMMANDS))
def test_command_in_docs_composes(command: Command) -> None:
    check_command(command)


@pytest.mark.parametrize("doc", [d for d in LINK_DOCS if d.exists()], ids=lambda d: str(shown(d)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = broken_links(doc)
    assert not broken, "\n".join(broken)


def test_the_checks_catch_a_misspelled_key_flag_and_link(tmp_path: Path) -> None:
    doc = tmp_path / "guide.md"
    doc.write_text(
        "# A guide\n\n"
        "```bash\n"
        "python -m aamperf.train -m trainer.max_steps=5 seed=0,1 \\\n"
        "    optim=baseline,ultra                   # composes\n"
        "python -m aamperf.train trainer.max_stpes=5\n"
        "```\n\n"
        "Then `python -m aamperf.predict run=<run dir> pairwize=true` and\n"
        "`python -m aamperf.compare DIR --quality-tolerence 1%`; [the guide](#a-guide), [a](#a-gide),\n"
        "[this](guide.md), [that](guid.md).\n"
    )
    commands = commands_in(doc)
    assert [(c.line, c.module) for c in commands] == [
        (4, "train"),
        (6, "train"),
        (9, "predict"),
        (10, "compare"),
    ]
    check_command(commands[0])
    for command, misspelled in zip(commands[1:], ["max_stpes", "pairwize", "quality-tolerence"], strict=True):
        with pytest.raises(DocError, match=misspelled):
            check_command(command)
    broken = [line.split(": ")[:2] for line in broken_links(doc)]
    assert broken == [[f"{doc}:10", "#a-gide"], [f"{doc}:11", "guid.md"]]
