"""README.md's fenced blocks as tests/test_readme.py reads them, and how each command of them is
covered there (``COMMANDS``; that file's docstring says the rules)."""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BIN = Path(sys.executable).parent
SHORT = (
    "--train-batches", "24", "--rows-per-table", "1000", "--eval-samples", "1024",
    "--batch-size", "128", "--no-progress",
)  # fmt: skip
THREADS = ("--launcher", "threads")


@dataclass(frozen=True)
class Block:
    language: str
    text: str
    line: int  # where it starts in README.md


def readme_blocks() -> list[Block]:
    blocks, language, start, lines = [], None, 0, []
    for number, line in enumerate(README.read_text().splitlines(), 1):
        if line.startswith("```"):
            if language is None:
                language, start, lines = line[3:].strip(), number, []
            else:
                blocks.append(Block(language, "\n".join(lines) + "\n", start))
                language = None
        elif language is not None:
            lines.append(line)
    assert language is None, "README.md: a code block is not closed"
    return blocks


def commands_of(block: Block) -> list[str]:
    """The commands of a shell block: continuations joined, comments and blank lines dropped."""
    commands = []
    for line in block.text.replace("\\\n", " ").splitlines():
        command = " ".join(shlex.split(line, comments=True))
        if command:
            commands.append(command)
    return commands


def blocks_of(language: str) -> list[Block]:
    return [b for b in readme_blocks() if b.language == language]


def python_block(holding: str) -> str:
    """The README's one Python block holding ``holding``: found by what it says, not by its
    place, so a block added elsewhere moves no test."""
    found = [b.text for b in blocks_of("python") if holding in b.text]
    assert len(found) == 1, f"{len(found)} Python blocks of the README hold {holding!r}"
    return found[0]


# How each README command is covered: extra flags appended to a `paramserver` command, or
# the name of the equivalent this file runs.
@dataclass(frozen=True)
class Run:
    extra: tuple[str, ...] = ()
    launcher_threads: bool = True
    equivalent: str | None = None  # for commands not run as written: what is run instead


COMMANDS: dict[str, Run] = {
    "make run": Run(equivalent="`make -n run` shows it runs `paramserver train`"),
    "make test": Run(equivalent="`make -n test` shows ruff, mypy and pytest (this suite)"),
    "paramserver train": Run(SHORT),
    "paramserver train --mode sync --trainers 3 --summary-json summary.json": Run(
        SHORT, launcher_threads=False
    ),
    "paramserver train --config job.toml --lr 0.1": Run(SHORT),
    "paramserver train --dataset criteo:day_0 --eval-data day_1": Run(
        ("--steps", "4", "--no-progress")
    ),
    "paramserver train --dataset criteo:day_0 --eval-fraction 0.1": Run(
        ("--steps", "4", "--no-progress")
    ),
    "paramserver train --dataset movielens --compare-single-process": Run(
        ("--steps", "4", "--no-progress")
    ),
    "paramserver train --help": Run(),
    "torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --rdzv-backend static --master-addr "
    "HOST_A --master-port 29500 -m paramserver train --servers 2 --trainers 2": Run(
        SHORT, equivalent="both hosts' commands at once on loopback"
    ),
    "torchrun --nnodes 2 --nproc-per-node 2 --node-rank 1 --rdzv-backend static --master-addr "
    "HOST_A --master-port 29500 -m paramserver train --servers 2 --trainers 2": Run(
        SHORT, equivalent="both hosts' commands at once on loopback"
    ),
    "paramserver train --checkpoint-dir ckpt": Run(SHORT),
    "paramserver train --checkpoint-dir ckpt --checkpoint-every 500": Run(
        (*SHORT, "--checkpoint-every", "4")
    ),
    "paramserver train --checkpoint-dir ckpt --resume": Run(SHORT),
    "paramserver train --checkpoint-dir ckpt --checkpoint-every 500 --resume --max-restarts 3": Run(
        (*SHORT, "--checkpoint-every", "4")
    ),
    # The resume rule, on SHORT's 24 batches (12 steps a trainer): 4 steps, 8, then a second
    # pass to 24, then nothing left.
    "paramserver train --checkpoint-dir done --steps 500": Run((*SHORT, "--steps", "4")),
    "paramserver train --checkpoint-dir done --steps 1000 --resume": Run((*SHORT, "--steps", "8")),
    "paramserver train --checkpoint-dir done --epochs 2 --resume": Run(SHORT),
    "paramserver train --checkpoint-dir done --resume": Run(SHORT),
    "paramserver check ckpt": Run(),
    "paramserver export ckpt model.pt": Run(),
    "paramserver train --run-dir runs/a --eval-every 100 --consistency-every 50 "
    "--profile-steps 5": Run(
        (*SHORT, "--eval-every", "4", "--consistency-every", "4", "--profile-start", "2")
    ),
    "paramserver report runs/a": Run(),
    "tensorboard --logdir runs/a/tensorboard": Run(
        equivalent="served on 127.0.0.1:FREE_PORT, asked for its runs over HTTP, stopped"
    ),
    "paramserver train --publish-dir log --publish-every 1 --checkpoint-dir ckpt "
    "--checkpoint-every 50": Run((*SHORT, "--publish-every", "0.05", "--checkpoint-every", "4")),
    "paramserver serve --follow log --http-port 8000 --grpc-port 8001": Run(
        equivalent="started as a process on free ports, stopped after the queries below"
    ),
    'curl -s localhost:8000/v2/models/embeddings.0.weight/infer -d {"inputs": [{"name": "ids", '
    '"shape": [3], "datatype": "INT64", "data": [1, 2, 3]}]}': Run(
        equivalent="run as written against the serving process's free HTTP port"
    ),
    "redis-server --port 6379 --save  --daemonize yes": Run(  # --save '': no snapshots
        equivalent="the tests' redis-server (tests/procs.py) on a free loopback port"
    ),
    "python -m paramserver.streams.produce redis://localhost:6379/events --records 0 "
    "--rate 5000 &": Run(equivalent="run as written against that port, stopped at the end"),
    "paramserver train --dataset stream:redis://localhost:6379/events --publish-dir live "
    "--checkpoint-dir live-ckpt --checkpoint-every 200 &": Run(
        equivalent="run as written against that port (in one process), then stopped by SIGTERM"
    ),
    "paramserver serve --follow live --http-port 8000 --grpc-port 8001 &": Run(
        equivalent="started as a process on free ports, stopped after the query"
    ),
    "paramserver train --dataset stream:redis://localhost:6379/events --publish-dir live "
    "--checkpoint-dir live-ckpt --checkpoint-every 200 --resume": Run(
        equivalent="run as written against that port, with --steps 2 more than it stopped at"
    ),
}
TEXT_BLOCKS = {"paramserver/": "the file map"}


def sh_commands(section: str) -> list[str]:
    """The commands of the shell blocks under the README heading ``## section``."""
    text = README.read_text()
    start = text.index(f"\n## {section}")
    end = text.find("\n## ", start + 1)
    first_line = text[:start].count("\n") + 2
    last_line = first_line + text[start:end].count("\n")
    return [
        command
        for block in blocks_of("sh")
        if first_line <= block.line <= last_line
        for command in commands_of(block)
    ]


def summary_keys_in_readme() -> tuple[set[str], set[str]]:
    """The keys the README's summary list gives: (always present, present in some jobs). A
    bullet's keys are the `names` before its first colon, outside parentheses."""
    text = README.read_text()
    part = text[text.index("**The summary.**") : text.index("Every figure covers this run")]
    always_part, some_part = part.split("and only in some jobs:")

    def keys(bullets: str) -> set[str]:
        found = set()
        for bullet in re.split(r"\n- ", bullets)[1:]:
            head = re.sub(r"\([^()]*\)", "", " ".join(bullet.split())).split(":")[0]
            found |= set(re.findall(r"`([a-z_]+)`", head))
        return found

    return keys(always_part), keys(some_part)
