"""``dynamix report``: plots and a summary from the logs a DynamixCallback run wrote, CSV and TensorBoard."""

from __future__ import annotations

import json

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_dynamix.callbacks import DynamixCallback
from lightning_dynamix.cli.main import main
from lightning_dynamix.cli.report import find_logs, read_log, summarise
from lightning_dynamix.control import Decision
from lightning_dynamix.data.synthetic import DemoClassifier
from lightning_dynamix.strategies import HeterogeneousDDPStrategy

pytestmark = pytest.mark.usefixtures("isolated_process_group")

PNG = b"\x89PNG\r\n\x1a\n"


class Scripted:
    """Decides the given sizes in turn, then keeps the last."""

    def __init__(self, *sizes):
        self.sizes = list(sizes)

    def decide(self, state):
        return Decision(self.sizes.pop(0) if len(self.sizes) > 1 else self.sizes[0], lr_scale=1.0)

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


def logged_run(logger) -> DynamixCallback:
    dynamix = DynamixCallback(Scripted((24,), (8,), (8,)), interval=3, warmup_steps=2, lr_scaling="linear")
    Trainer(
        accelerator="cpu",
        devices=1,
        strategy=HeterogeneousDDPStrategy(),
        max_steps=14,
        callbacks=[dynamix],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    ).fit(DemoClassifier(num_samples=512, num_features=8, hidden=16, batch_size=16, sync_dist=False))
    return dynamix


@pytest.mark.parametrize("kind", ["csv", "tensorboard"])
def test_report_reads_back_what_the_callback_logged_and_plots_it(tmp_path, kind, capsys):
    logger = CSVLogger(tmp_path, name="run") if kind == "csv" else TensorBoardLogger(tmp_path, name="run")
    dynamix = logged_run(logger)
    (path,) = find_logs(tmp_path)
    summary = summarise(read_log(path))
    history = dynamix.history
    assert summary["ranks"] == 1
    assert summary["intervals"] == len(history)
    assert (summary["first_step"], summary["last_step"]) == (history[0].step, history[-1].step)
    assert summary["first_batch_sizes"] == [16]
    assert summary["last_batch_sizes"] == list(history[-1].state.batch_sizes) == [8]
    assert summary["size_changes"] == 2  # 16 -> 24 -> 8
    # the linear rule followed the global batch: 16 -> 24 -> 8 samples
    assert summary["first_lr"] == pytest.approx(0.05)
    assert summary["last_lr"] == pytest.approx(0.05 * 8 / 16)

    main(["report", str(tmp_path), "--json"])
    (printed,) = json.loads(capsys.readouterr().out)
    assert printed["last_batch_sizes"] == [8]
    assert (path.parent / "dynamix_report.png").read_bytes()[:8] == PNG


def test_report_writes_one_plot_per_run_into_an_output_dir(tmp_path, capsys):
    for name in ("static", "pid"):
        logged_run(CSVLogger(tmp_path / "logs", name=name, version=""))
    main(["report", str(tmp_path / "logs"), "--output-dir", str(tmp_path / "plots")])
    text = capsys.readouterr().out
    assert "batch sizes [16] -> [8] (2 changes)" in text
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert plots == ["pid_dynamix_report.png", "static_dynamix_report.png"]


def test_report_on_logs_without_dynamix_metrics_says_what_to_log(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,train_loss\n0,1.5\n")
    with pytest.raises(SystemExit, match=r"no dynamix/\.\.\. metrics under"):
        main(["report", str(tmp_path)])
    with pytest.raises(SystemExit, match="does not exist"):
        main(["report", str(tmp_path / "missing")])
