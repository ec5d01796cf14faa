"""The benchmarks' shared pieces: one table of commands, one interleaved-rounds runner, one statistics helper."""

from __future__ import annotations

import argparse
import math

import pytest

from lightning_dynamix import bench
from lightning_dynamix._stats import median_or, spread
from lightning_dynamix.bench.arguments import floats, positive_ints
from lightning_dynamix.bench.rounds import interleaved_rounds
from lightning_dynamix.cli.main import BENCHMARKS, COMMANDS, build_parser


def test_every_benchmark_is_the_module_named_for_its_command():
    for command in BENCHMARKS:
        module = command.run.__module__
        assert module == f"{bench.__name__}.{command.name.replace('-', '_')}", command.name
        assert (command.run.__name__, command.add_arguments.__name__) == ("run", "add_arguments")
    parser = build_parser()
    for argv in [[c.name] for c in COMMANDS] + [["bench", c.name] for c in BENCHMARKS]:
        with pytest.raises(SystemExit) as exited:  # each is registered, with its arguments
            parser.parse_args([*argv, "--help"])
        assert exited.value.code == 0, argv


def test_balance_and_tta_take_the_controllers_under_one_name_and_balance_still_reads_the_old_one():
    parser = build_parser()
    for benchmark in ("balance", "tta"):
        assert parser.parse_args(["bench", benchmark, "--controllers", "pid,ppo"]).controllers == "pid,ppo"
    assert parser.parse_args(["bench", "balance", "--controller", "static"]).controllers == "static"
    assert parser.parse_args(["bench", "balance"]).controllers == "pid"
    assert parser.parse_args(["bench", "tta"]).controllers == "static,pid,goodput,ppo"


def test_interleaved_rounds_start_each_round_one_further_along_and_keep_what_was_measured():
    order: list[tuple[str, int]] = []

    def measure(variant: str, index: int) -> float | None:
        order.append((variant, index))
        return None if variant == "c" else 10.0 * index + ord(variant)

    results = interleaved_rounds(["a", "b", "c"], 4, measure)
    assert [v for v, _ in order] == list("abcbcacababc")
    assert results == {"a": [97, 107, 117, 127], "b": [98, 108, 118, 128], "c": []}  # None: nothing kept
    two: list[str] = []
    interleaved_rounds(["ddp", "ours"], 4, lambda v, _: two.append(v))
    assert two == ["ddp", "ours", "ours", "ddp", "ddp", "ours", "ours", "ddp"]  # A B, B A: ABBA
    with pytest.raises(ValueError, match="`rounds` must be an int >= 1, got 0"):
        interleaved_rounds(["a"], 0, measure)
    with pytest.raises(ValueError, match="at least one"):
        interleaved_rounds([], 1, measure)


def test_medians_skip_what_was_not_measured_and_the_spread_is_median_min_max():
    assert median_or([3.0, None, math.nan, 1.0, 2.0]) == 2.0
    assert median_or([None, math.nan]) is None
    assert median_or([], default=math.inf) == math.inf
    assert spread([4.0, 1.0, None, 2.0]) == (2.0, 1.0, 4.0)
    assert spread([]) is None


def test_argument_types_say_what_they_expected():
    assert floats("1,3") == (1.0, 3.0)
    assert positive_ints("4,8") == [4, 8]
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated numbers"):
        floats("1,x")
    with pytest.raises(argparse.ArgumentTypeError, match="ints >= 1"):
        positive_ints("0,2")
