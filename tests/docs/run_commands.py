"""Run the shell commands of the README and docs/ as they are written.

    python -m tests.docs.run_commands          # the commands the test suite runs (the long ones are parsed)
    python -m tests.docs.run_commands --all    # every command, the benchmarks and the demo included

Every command in a ```bash block of README.md and docs/**/*.md is either run, from one working
directory shared by all of them (so a command sees what the commands before it wrote, as a reader
going through the pages would), or, for the long ones in :data:`LONG`, checked without running:
a ``dynamix`` command is parsed by the real argument parser, a ``make`` target must exist. A
command that appears on several pages runs once. :data:`CHECKS` asserts what some commands must
print.

A ``dynamix`` subcommand of :data:`IN_PROCESS` (one that starts no process) runs its entry point,
``main``, in this process with the command's arguments, in the same working directory: what the
``dynamix`` script runs, without the 5 s a new Python takes to import torch and Lightning. A ``python SCRIPT
ARGS``, ``dynamix ARGS``, ``torchrun ARGS`` or ``accelerate launch ARGS`` command that starts processes (a job's
other ranks, a launcher's workers) runs forked from a Python that has imported them (:mod:`tests.forkserver`; a
process of its own, as the command would be, its ranks forked too). Every other command runs with bash.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from lightning_dynamix.distributed import job_environment
from tests import forkserver

ROOT = Path(__file__).resolve().parents[2]

# commands (by their start) the test suite checks without running them, and why
LONG: dict[str, str] = {
    "make setup": "CI runs it before the suite",
    "pip install": "it installs into the reader's environment; the suite runs in the one `make setup` made",
    "make test": "it is the test suite itself",
    ".venv/bin/python -m pytest": "a part of the test suite, which runs it anyway",
    "make demo": "`dynamix demo`, below",
    "source .venv/bin/activate": "the suite runs inside the virtual environment",
    "dynamix demo": "about 90 s; tests/cli/test_balance.py runs a 1-epoch demo",
    "dynamix bench": "benchmarks run for minutes; tests/cli/ runs short ones",
    ".venv/bin/dynamix bench": "benchmarks run for minutes; tests/cli/ runs short ones",
    ".venv/bin/dynamix train-policy --preset default": "about 35 minutes; the docs train a tiny policy",
    ".venv/bin/dynamix simulate --nodes 4,8,16,32,64": "many held-out scenarios; the docs simulate a few",
    ".venv/bin/dynamix simulate --nodes 32 --scenarios 16": "16 held-out scenarios of 32 nodes, 35 s each; the docs"
    " simulate a few",
    ".venv/bin/dynamix simulate --nodes 32 --scenarios 64": "64 held-out scenarios of 32 nodes, about 2 minutes each;"
    " the docs simulate a few",
    "python -m lightning_dynamix.serve": "a server waits for trainers on other machines; tests/distributed runs it",
    ".venv/bin/python scripts/server_start.py": "a timing of rounds; tests/unit/test_server_launcher.py runs one",
    ".venv/bin/python scripts/arrivals_cost.py": "a timing; tests/distributed/test_fsdp2.py gathers arrivals",
    ".venv/bin/python scripts/chunks_opened.py": "writes a LitData dataset of 20,000 samples (12 s); tests/unit/"
    "test_chunks.py and test_streaming_litdata.py count chunks",
    ".venv/bin/python scripts/litdata_read_cost.py": "a timing (21 s); tests/unit/test_streaming_litdata.py reads the"
    " same kind of dataset",
    "dynamix report dynamix_runs/demo/logs": "it reads the demo's logs; tests/cli/test_balance.py reports a short one",
}

# ``dynamix`` subcommands that start no process: run in this process
IN_PROCESS = ("report", "simulate", "calibrate", "train-policy")


@dataclass(frozen=True)
class Block:
    """A fenced code block of a Markdown file."""

    path: Path
    line: int
    language: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    """The README, then getting started, then every other page, in a fixed order."""
    docs = sorted((ROOT / "docs").rglob("*.md"))
    first = ROOT / "docs" / "getting-started.md"
    return [ROOT / "README.md", first, *(p for p in docs if p != first)]


def code_blocks(path: Path) -> Iterator[Block]:
    """Every fenced block of ``path`` with its language (the word after the opening fence)."""
    language, start, lines = None, 0, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            if language is None:
                language, start, lines = line[3:].strip(), number, []
            else:
                yield Block(path, start, language, "\n".join(lines))
                language = None
        elif language is not None:
            lines.append(line)


def shell_commands(block: Block) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments and blank lines dropped."""
    commands, pending = [], ""
    for line in block.text.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line:
            commands.append(line)
    return commands


def all_commands() -> list[tuple[Block, str]]:
    """Every distinct shell command of the docs, in reading order, with the block it first appears in."""
    seen: set[str] = set()
    found = []
    for path in doc_files():
        for block in code_blocks(path):
            if block.language not in ("bash", "sh", "shell", "console"):
                continue
            for command in shell_commands(block):
                if command not in seen:
                    seen.add(command)
                    found.append((block, command))
    return found


def long_reason(command: str) -> str | None:
    """Why ``command`` is only checked, not run, by the test suite; ``None`` if it is run."""
    return next((why for start, why in LONG.items() if command == start or command.startswith(start + " ")), None)


def check_without_running(command: str) -> None:
    """Parse a long command the way it would run; raise AssertionError if it could not."""
    words = shlex.split(command)
    if words[0] in ("dynamix", ".venv/bin/dynamix"):
        from lightning_dynamix.cli.main import build_parser

        try:
            build_parser().parse_args(words[1:])
        except SystemExit as exit_:
            raise AssertionError(f"`{command}`: the dynamix command rejects these arguments") from exit_
    elif words[:3] == ["python", "-m", "lightning_dynamix.serve"]:
        from lightning_dynamix.serve import build_parser as serve_parser

        try:
            serve_parser().parse_args(words[3:])
        except SystemExit as exit_:
            raise AssertionError(f"`{command}`: the server rejects these arguments") from exit_
    elif words[0] == ".venv/bin/python" and words[1].startswith("scripts/") and words[1].endswith(".py"):
        script = runpy.run_path(str(ROOT / words[1]))  # its module, not run as __main__
        try:
            script["build_parser"]().parse_args(words[2:])
        except SystemExit as exit_:
            raise AssertionError(f"`{command}`: the script rejects these arguments") from exit_
    elif words[1:3] == ["-m", "pytest"]:
        paths = [word for word in words[3:] if not word.startswith("-")]
        missing = [path for path in paths if not (ROOT / path.split("::")[0]).exists()]
        assert paths, f"`{command}`: names no tests"
        assert not missing, f"`{command}`: no such test file {missing}"
    elif words[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.MULTILINE)
        assert all(w in targets for w in words[1:]), f"`{command}`: no such target in the Makefile ({targets})"
    elif words[:2] == ["pip", "install"]:
        extras = re.findall(r"\[([\w,]+)\]", command)
        section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
        declared = re.findall(r"^(\w+) = \[", section, flags=re.MULTILINE)
        unknown = [extra for group in extras for extra in group.split(",") if extra not in declared]
        assert not unknown, f"`{command}`: pyproject.toml declares no extra {unknown}"
    elif words[0] == "source":
        venv = re.search(r"^VENV=(\S+)$", (ROOT / "scripts" / "setup-venv.sh").read_text(), flags=re.MULTILINE)
        assert venv is not None, "scripts/setup-venv.sh sets no VENV"
        assert words[1] == f"{venv.group(1)}/bin/activate", f"`{command}`: the set-up makes no such venv"
    else:
        raise AssertionError(f"`{command}` is listed as long but there is no way to check it without running it")


def prepare_workdir(workdir: Path) -> None:
    """A working directory in which the docs' relative paths (examples/, scripts/, .venv/) resolve to the
    repository's."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("examples", "scripts", ".venv"):
        link = workdir / name
        if (ROOT / name).exists() and not link.exists():
            link.symlink_to(ROOT / name)


def environment() -> dict[str, str]:
    """The environment a reader with the virtual environment active has (its bin/ first on PATH)."""
    env = job_environment()  # no rank variables a Trainer run in this process left: every command launches its own
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _words(command: str) -> list[str]:
    """The words of ``command``, or none where the shell has work to do (pipes, variables, redirections)."""
    return [] if re.search(r"[|&;<>$`(){}*?\\]", command) else shlex.split(command)


def in_process(command: str) -> list[str] | None:
    """The arguments to run ``command`` with in this process (see :data:`IN_PROCESS`), or ``None``."""
    words = _words(command)
    return words[1:] if len(words) > 1 and words[0] == "dynamix" and words[1] in IN_PROCESS else None


# what the commands forked from a warm Python import first
PRELOAD = ("lightning_dynamix", "lightning_dynamix.cli.main")


def forkable(command: str) -> tuple[str, list[str], bool] | None:
    """``(target, args, script)`` to fork ``command`` as ``python SCRIPT ARGS`` (``script``) or ``python -m
    MODULE ARGS`` (``dynamix ARGS`` is ``python -m lightning_dynamix.cli.main ARGS``; ``.venv/bin/python`` is
    ``python``, a leading ``time`` dropped; a console script of the interpreter, such as ``torchrun``, is ``python
    SCRIPT``), or ``None`` where bash must run it."""
    words = _words(command)
    if words[:1] == ["time"]:  # bash's keyword: what it times runs as it would without it
        words = words[1:]
    if words[:1] == [".venv/bin/python"]:  # the suite's own interpreter, the one the fork server runs
        words = ["python", *words[1:]]
    if len(words) > 1 and words[0] == "python" and words[1].endswith(".py"):
        return words[1], words[2:], True
    if len(words) > 2 and words[0] == "python" and words[1] == "-m":
        return words[2], words[3:], False
    if len(words) > 1 and words[0] == "dynamix":
        return "lightning_dynamix.cli.main", words[1:], False
    if words and (script := forkserver.console_script(words[0], environment(), str(ROOT))) is not None:
        return script, words[1:], True  # torchrun, `accelerate launch`: the kernel runs it as `python SCRIPT ARGS`
    return None


def run_forked(target: str, args: list[str], script: bool, command: str, workdir: Path, timeout: float = 600) -> str:
    """``command`` forked (see :func:`forkable`) in ``workdir``; its output, or AssertionError with it."""
    run = forkserver.run_script if script else forkserver.run_module
    done = run(target, args, workdir, environment(), timeout, PRELOAD)
    if done.returncode != 0:
        raise AssertionError(f"`{command}` exited with {done.returncode}:\n{done.output[-6000:]}")
    return done.output


def run_here(args: list[str], command: str, workdir: Path) -> str:
    """``dynamix ARGS`` through its entry point in this process, in ``workdir``; its output (stdout and
    stderr), or AssertionError with it where it exits with an error."""
    from lightning_dynamix.cli.main import main

    out = io.StringIO()
    code: int | str | None = 0
    with contextlib.chdir(workdir), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main(args)
        except SystemExit as exit_:
            code = exit_.code
        except Exception as error:  # a crash: reported with the others, as a failed command's output is
            raise AssertionError(f"`{command}` raised:\n{traceback.format_exc()[-6000:]}") from error
    if code not in (0, None):
        raise AssertionError(f"`{command}` exited with {code!r}:\n{out.getvalue()[-6000:]}")
    return out.getvalue()


def run_command(command: str, workdir: Path, timeout: float = 600) -> str:
    """Run ``command`` with bash in ``workdir``; return its output, or raise AssertionError with it."""
    proc = subprocess.run(
        ["bash", "-c", command], cwd=workdir, env=environment(), capture_output=True, text=True, timeout=timeout
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"`{command}` exited with {proc.returncode}:\n{output[-6000:]}")
    return output


def _sizes(output: str, pattern: str) -> list[int]:
    found = re.findall(pattern, output)
    assert found, f"no match for {pattern!r} in:\n{output[-3000:]}"
    return [int(v) for v in re.split(r"[,\s]+", found[-1].strip()) if v]


def _rank_zero_got_no_fewer(pattern: str) -> Callable[[str], None]:
    # never the wrong way; how far (or whether a noisy, loaded machine kept the split) is the benches' figure,
    # and the tests on a virtual clock assert that the controllers move
    def check(output: str) -> None:
        sizes = _sizes(output, pattern)
        assert len(sizes) == 2, sizes
        assert sizes[0] >= sizes[1], f"rank 1 is slower but ended with {sizes}"

    return check


def _global_batch_kept(pattern: str, total: int) -> Callable[[str], None]:
    # two ranks and the global batch kept through whatever the controller decided; whether and which way it moves is
    # noise where the emulated slowdown is small beside the waits every rank shares (the offload example's server
    # lookups): tests/distributed/test_layer_offload.py asserts the direction on a virtual clock
    def check(output: str) -> None:
        sizes = _sizes(output, pattern)
        assert len(sizes) == 2, sizes
        assert sum(sizes) == total, sizes

    return check


def _contains(*texts: str, absent: tuple[str, ...] = ()) -> Callable[[str], None]:
    def check(output: str) -> None:
        for text in texts:
            assert text in output, f"{text!r} not in:\n{output[-3000:]}"
        for text in absent:
            assert text not in output, f"{text!r} in:\n{output[-3000:]}"

    return check


def _accelerate_report(output: str) -> None:
    _rank_zero_got_no_fewer(r"batch sizes \[\d+, \d+\] -> \[(\d+, \d+)\]")(output)
    _contains("2 ranks")(output)
    # both launches' intervals in one run (a resumed run's event files are merged); an epoch has 64 steps
    (last_step,) = _sizes(output, r"intervals logged \(steps \d+ to (\d+)\)")
    assert last_step > 64, output[-3000:]


# what some commands must print, beyond exiting with 0
CHECKS: dict[str, Callable[[str], None]] = {
    "python examples/lightning/callback.py": _rank_zero_got_no_fewer(r"final sizes \[(\d+, \d+)\]"),
    "python examples/lightning/train.py fit --config examples/lightning/dynamix.yaml": _rank_zero_got_no_fewer(
        r"per-rank batch sizes \((\d+, \d+)\)"
    ),
    "python examples/lightning/train.py fit --config examples/lightning/class_path.yaml": _contains(
        "trained with HeterogeneousDDPStrategy, per-rank batch sizes (16, 48)"
    ),
    "python examples/lightning/train.py fit --config examples/lightning/registered_name.yaml": _contains(
        "trained with HeterogeneousDDPStrategy, per-rank batch sizes (32, 32)"
    ),
    "accelerate launch --multi_gpu --num_processes 2 examples/accelerate/train.py --epochs 1": _contains(
        "epoch 0: validation accuracy"
    ),
    "torchrun --standalone --nproc_per_node 2 examples/accelerate/train.py --epochs 2 --resume": _contains(
        "epoch 1: validation accuracy",
        absent=("epoch 0:",),  # it continued after the saved epoch
    ),
    "torchrun --standalone --nproc_per_node 2 examples/ctr/dlrm.py fit --config examples/ctr/dlrm_offload.yaml"
    " --data.num_samples 8192": _contains("MEMBER: 2/2", "`max_epochs=1` reached"),
    "dynamix report dynamix_runs/accelerate": _accelerate_report,
    "dynamix report dynamix_runs/callback": _contains("2 ranks", "dynamix_report.png"),
    "dynamix report dynamix_runs/cli": _contains("2 ranks", "dynamix_report.png"),
    "dynamix report dynamix_runs/offload": _global_batch_kept(r"batch sizes \[\d+, \d+\] -> \[(\d+, \d+)\]", 256),
    "dynamix report dynamix_runs/demo/logs": _contains("logs/pid/metrics.csv", "logs/static/metrics.csv"),
    "dynamix simulate --nodes 8 --scenarios 2 --controllers static,pid,goodput,ppo": _contains(
        "8 nodes, 2 held-out scenarios", "goodput", "ppo", "simulate.png", "ppo / goodput per scenario: median"
    ),
    "dynamix calibrate dynamix_runs/cli --output dynamix_runs/cli/scenario.json": _contains(
        "calibrated on", "rank 1: compute", "replay at the run's own sizes", "scenario written to"
    ),
    "dynamix simulate --scenario dynamix_runs/cli/scenario.json --scenarios 2": _contains(
        "2 nodes, dynamix_runs/cli/scenario.json x 2 seeds", "pid"
    ),
    "dynamix train-policy --preset tiny --output dynamix_runs/policy/tiny.safetensors": _contains(
        "policy written to dynamix_runs/policy/tiny.safetensors", "held-out scenarios: 1"
    ),
}


def run_all(workdir: Path, run_long: bool = False, log: Callable[[str], None] = lambda _: None) -> list[str]:
    """Run (or check) every command of the docs in order in ``workdir``; returns the failures."""
    prepare_workdir(workdir)
    failures = []
    for block, command in all_commands():
        reason = long_reason(command)
        began = time.perf_counter()
        try:
            if reason is not None and not run_long:
                check_without_running(command)
                log(f"checked  {command}  ({block.where}; not run: {reason})")
                continue
            here = in_process(command)
            forked = forkable(command) if here is None else None
            if here is not None:
                output = run_here(here, command, workdir)
            elif forked is not None:
                output = run_forked(*forked, command, workdir)
            else:  # make's targets live in the repository's Makefile, whatever the working directory
                output = run_command(command, ROOT if command.startswith("make ") else workdir)
            if command in CHECKS:
                CHECKS[command](output)
            where = "in this process, " if here is not None else "forked, " if forked is not None else ""
            log(f"ran      {command}  ({where}{block.where}, {time.perf_counter() - began:.0f} s)")
        except (AssertionError, subprocess.TimeoutExpired) as error:
            failures.append(f"{block.where}: {error}")
            log(f"FAILED   {command}  ({block.where})")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also run the long commands (benchmarks, the demo)")
    parser.add_argument("--workdir", type=Path, default=ROOT, help="where to run them (default: the repository)")
    args = parser.parse_args()
    failures = run_all(args.workdir, run_long=args.all, log=print)
    for failure in failures:
        print(failure, file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
