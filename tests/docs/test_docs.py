"""The README and docs/ as a reader uses them: their commands run, their code parses, their links lead somewhere."""

from __future__ import annotations

import re

import pytest
import yaml

from lightning_dynamix import ClusterState, Decision, WorkerMetrics
from lightning_dynamix.control import BatchController
from tests.docs.run_commands import ROOT, all_commands, code_blocks, doc_files, long_reason, run_all

BLOCKS = [block for path in doc_files() for block in code_blocks(path)]


@pytest.mark.distributed
def test_every_command_in_the_docs_runs_as_written(tmp_path):
    # one working directory for all, in reading order: a report reads the logs of the run before it
    failures = run_all(tmp_path)
    assert not failures, "\n\n".join(failures)


def test_the_three_ways_to_use_the_package_are_run_not_only_parsed():
    run = {command for _, command in all_commands() if long_reason(command) is None}
    assert "python examples/lightning/callback.py" in run  # a callback added to a Trainer
    assert "python examples/lightning/train.py fit --config examples/lightning/dynamix.yaml" in run  # LightningCLI
    assert "accelerate launch --multi_gpu --num_processes 2 examples/accelerate/train.py --epochs 1" in run


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "python"], ids=lambda b: b.where)
def test_python_blocks_are_valid_python(block):
    compile(block.text, block.where, "exec")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "yaml"], ids=lambda b: b.where)
def test_yaml_blocks_parse(block):
    assert isinstance(yaml.safe_load(block.text), dict)


def _anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens; emphasis marks dropped,
    a code span's text kept as it is (``min_batch_size`` keeps its underscores)."""
    parts = re.split(r"(`[^`]*`)", heading.strip().lower())
    text = "".join(part[1:-1] if part.startswith("`") else re.sub(r"[*_]", "", part) for part in parts)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files_and_headings_that_exist(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue  # a web address
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        assert linked.exists(), f"{path.relative_to(ROOT)} links to {target}, which does not exist"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.MULTILINE)
            assert anchor in {_anchor(h) for h in headings}, f"{path.relative_to(ROOT)}: no heading #{anchor}"


def test_the_docs_own_controller_example_decides_within_the_bounds():
    (block,) = [b for b in BLOCKS if "class HalveTheSlowest" in b.text]
    namespace: dict = {}
    exec(compile(block.text, block.where, "exec"), namespace)
    controller = namespace["HalveTheSlowest"]()
    assert isinstance(controller, BatchController)
    workers = tuple(
        WorkerMetrics(rank=r, batch_size=b, compute_time=t, step_time=0.09) for r, (b, t) in enumerate([(64, 0.03),
                                                                                                       (64, 0.09)])
    )  # fmt: skip
    decision = controller.decide(ClusterState(workers=workers, min_batch_size=4))
    assert decision == Decision((80, 48))  # a quarter of the slow rank's 64 moved to the fast rank
