"""The embedding server's step protocol, in one process: when lookups are answered and updates applied."""

from __future__ import annotations

import os
import re
import socket
import subprocess

import psutil
import pytest
import torch

from lightning_dynamix.offload import EmbeddingServer, RowAdagrad, RowSGD, TableSpec
from lightning_dynamix.offload.embedding_server import PUSH_REORDER_WINDOW, EmbeddingServerFailed
from lightning_dynamix.offload.server_process import server_command
from lightning_dynamix.serve import main as serve_main

ROWS, DIM = 6, 2


def server(num_trainers: int = 1, staleness: int = 0) -> EmbeddingServer:
    s = EmbeddingServer(0, 1, num_trainers, staleness)
    s.create_table(TableSpec("t", ROWS, DIM, RowSGD(lr=1.0)), torch.zeros(ROWS, DIM))
    return s


def push(s: EmbeddingServer, trainer: int, step: int, row: int = 0, value: float = 1.0, weight: float = 1.0) -> None:
    s.push(trainer, step, {"t": (torch.tensor([row]), torch.full((1, DIM), value))}, weight)


def looked_up(s: EmbeddingServer, step: int | None, row: int = 0):
    future = s.lookup("t", step, torch.tensor([row]))
    return float(future.value()[0, 0]) if future.done() else None


def test_synchronous_lookup_waits_for_every_trainers_push_and_sees_their_mean():
    s = server(num_trainers=2)
    assert looked_up(s, 0) == 0.0
    push(s, 0, 0, value=1.0, weight=0.5)  # DDP's mean: 1 / trainers
    waiting = s.lookup("t", 1, torch.tensor([0]))
    assert not waiting.done()  # trainer 1 has not pushed step 0 yet
    push(s, 1, 0, value=3.0, weight=0.5)
    assert waiting.done()
    assert float(waiting.value()[0, 0]) == -2.0  # minus the mean of 1 and 3, at lr 1


def test_trainers_gradients_are_summed_with_their_weights_and_a_step_without_rows_counts_as_pushed():
    # per-trainer batch sizes: each trainer's gradient carries its share, the server sums with the window's weight
    s = server(num_trainers=2, staleness=1)
    push(s, 0, 0, value=1.0, weight=1.0)
    push(s, 1, 0, value=3.0, weight=1.0)
    assert looked_up(s, 2) == -4.0
    push(s, 0, 1, value=1.0, weight=0.5)  # a window whose sizes changed: its correction
    push(s, 1, 1, value=3.0, weight=0.25)
    assert looked_up(s, 3) == -5.25
    push(s, 0, 2, value=2.0, weight=1.0)
    s.push(1, 2, {}, 1.0)  # trainer 1 sat step 2 out: no rows, but the step is pushed
    assert s.applied == 2
    assert looked_up(s, 4) == -7.25
    assert looked_up(s, 3) == -5.25  # rolled back over an update that did not touch every table
    s.push(0, 3, {}, 1.0)
    s.push(1, 3, {}, 1.0)  # a step that changed no table
    assert (s.applied, looked_up(s, 4), looked_up(s, 5)) == (3, -7.25, -7.25)


def test_staleness_one_answers_with_the_version_a_step_must_see_never_a_later_one():
    s = server(staleness=1)
    push(s, 0, 0)
    assert s.applied == 0  # applied as soon as every trainer pushed it
    assert looked_up(s, 1) == 0.0  # step 1 sees the tables after update -1: update 0 rolled back
    push(s, 0, 1)
    assert looked_up(s, 2) == -1.0  # after update 0: update 1 rolled back
    assert looked_up(s, 3) == -2.0  # a step read ahead, answered at once
    assert looked_up(s, 4) is None  # needs update 2, not pushed yet
    push(s, 0, 2, row=1)  # another row: row 0's value after update 2 is that after update 1
    assert looked_up(s, 4) == -2.0
    assert sorted(s._overwritten) == [2]  # only what a lookup of step 3 or later may still ask for


def test_one_trainers_rows_are_summed_whatever_their_order_and_a_table_lookup_waits_with_the_others():
    s = server(staleness=0)
    s.create_table(TableSpec("u", ROWS, DIM, RowAdagrad(lr=1.0)), torch.zeros(ROWS, DIM))
    waiting = s.lookup_many(1, {"t": torch.tensor([3, 1]), "u": torch.tensor([2])})
    assert not waiting.done()  # one answer for both tables, once update 0 is applied
    # rows in the order the trainer sends them (ascending, distinct), one out of order, and a duplicate
    grads = torch.ones(3, DIM)
    s.push(0, 0, {"t": (torch.tensor([1, 3, 5]), grads), "u": (torch.tensor([4, 2, 4]), grads * 2)}, 0.5)
    answer = waiting.value()
    assert answer["t"][:, 0].tolist() == [-0.5, -0.5]  # rows 3 and 1, once each, at weight 0.5
    assert answer["u"][:, 0].tolist() == [-1.0]  # Adagrad's first step: -lr * g / |g|
    assert looked_up(s, None, row=5) == -0.5
    # row 4 twice: one update from its summed gradient 2 (-1), not two of 1 (-2)
    assert s.lookup("u", None, torch.tensor([4])).value()[0, 0] == -1.0


def test_flush_applies_everything_pushed_and_evaluation_reads_it():
    s = server(staleness=1)
    push(s, 0, 0)
    push(s, 0, 1)
    flushed = s.flush(1)
    assert flushed.done()
    assert looked_up(s, None) == -2.0


def test_pushes_that_arrive_out_of_order_are_applied_in_step_order_and_tables_equal_one_process():
    # two trainers, Adagrad (an update depends on every earlier one), each trainer's pushes delayed and reordered
    def trained(arrivals: list[tuple[int, int]], staleness: int) -> tuple[EmbeddingServer, list[tuple]]:
        s = EmbeddingServer(0, 1, 2, staleness)
        s.create_table(TableSpec("t", ROWS, DIM, RowAdagrad(lr=0.5)), torch.zeros(ROWS, DIM))
        answers, history, latest = [], {-1: s.rows("t")}, [-1, -1]
        for trainer, step in arrivals:
            grads = torch.full((1, DIM), float(1 + step + 3 * trainer))
            s.push(trainer, step, {"t": (torch.tensor([step % 3]), grads)}, 0.5)
            history[s.applied] = s.rows("t")
            latest[trainer] = max(latest[trainer], step)
            if step == latest[trainer]:  # the trainer's next lookup (it looked up no later step before pushing it)
                answers.append((step + 1, step % 3, looked_up(s, step + 1, row=step % 3)))
        assert s.applied == 5
        return s, answers, history

    in_order = [(trainer, step) for step in range(6) for trainer in (0, 1)]
    _, _, after_update = trained(in_order, staleness=0)  # the tables after each update, applied in order
    generator = torch.Generator().manual_seed(0)
    for staleness in (0, 1):
        for _ in range(20):
            order = [in_order[i] for i in torch.randperm(len(in_order), generator=generator).tolist()]
            s, answers, _ = trained(order, staleness)
            torch.testing.assert_close(s.rows("t"), after_update[5], rtol=0, atol=0)
            # a lookup of step k answered at once sees the tables after update k - 1 - staleness, in order
            for step, row, value in answers:
                if value is not None:
                    assert value == float(after_update[step - 1 - staleness][row, 0])


def test_a_step_pushed_twice_or_past_the_reorder_window_is_an_error():
    s = server()
    push(s, 0, 1)  # waits for step 0
    with pytest.raises(RuntimeError, match="trainer 0 pushed step 1 twice"):
        push(s, 0, 1)
    s = server()
    with pytest.raises(RuntimeError, match=rf"more than {PUSH_REORDER_WINDOW} steps after its last push in order"):
        push(s, 0, PUSH_REORDER_WINDOW + 1)


def test_an_error_in_a_push_fails_every_waiting_and_later_request_with_it():
    s = server(num_trainers=2)
    waiting = s.lookup("t", 1, torch.tensor([0]))  # needs both trainers' step 0
    flushing = s.flush(0)
    with pytest.raises(KeyError, match="holds no table 'nope'"):
        s.push(0, 0, {"nope": (torch.tensor([0]), torch.ones(1, DIM))}, 1.0)
    for future in (waiting, flushing):  # answered at once with the error, not left to the RPC timeout
        assert future.done()
        with pytest.raises(EmbeddingServerFailed, match=r"server 0 stopped serving.*KeyError.*'nope'"):
            future.wait()
    with pytest.raises(EmbeddingServerFailed, match="KeyError"):
        push(s, 1, 0)  # the other trainer's next request
    with pytest.raises(EmbeddingServerFailed, match="KeyError"):
        s.lookup("t", None, torch.tensor([0]))


def test_save_and_load_into_another_server_count(tmp_path):
    s = server()
    push(s, 0, 0, row=3, value=2.0)
    s.flush(0)
    s.save(str(tmp_path / "server-0-of-1.pt"))
    halves = [EmbeddingServer(rank, 2, 1) for rank in range(2)]
    for half in halves:
        half.create_table(TableSpec("t", ROWS, DIM, RowSGD(lr=1.0)), torch.ones(ROWS // 2, DIM))
        half.load([str(tmp_path / "server-0-of-1.pt")])
    assert halves[1].rows("t")[1, 0] == -2.0  # row 3 is server 1's local row 1
    assert halves[0].rows("t").abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_a_table_keeps_its_dtype_on_the_server_in_lookups_updates_optimiser_state_and_checkpoints(dtype, tmp_path):
    # the server's default dtype is float32, as in a server process; the table's comes with its spec
    assert torch.get_default_dtype() == torch.float32
    s = EmbeddingServer(0, 1, num_trainers=2)
    given = torch.arange(ROWS * DIM, dtype=dtype).reshape(ROWS, DIM)
    adagrad = RowAdagrad(lr=1.0, eps=0.0)  # exactly -lr * g / |g| at its first step
    s.create_table(TableSpec("given", ROWS, DIM, adagrad, dtype=dtype), given.clone())
    s.create_table(TableSpec("initialised", ROWS, DIM, RowSGD(lr=1.0), dtype=dtype), None)  # a meta-device table
    assert s.rows("given").dtype == s.rows("initialised").dtype == dtype
    assert s.tables["given"].state["sum"].dtype == dtype
    answer = s.lookup_many(None, {"given": torch.tensor([1]), "initialised": torch.tensor([2])}).value()
    assert answer["given"].dtype == answer["initialised"].dtype == dtype
    for trainer in range(2):  # two trainers' gradients, weighted and summed in the table's dtype
        s.push(trainer, 0, {"given": (torch.tensor([1]), torch.full((1, DIM), 3.0, dtype=dtype))}, 0.5)
    trained = (given[1] - 1).tolist()
    assert s.rows("given")[1].tolist() == trained
    assert s.rows("given").dtype == s.tables["given"].state["sum"].dtype == dtype
    s.save(str(tmp_path / "server-0-of-1.pt"))
    halves = [EmbeddingServer(rank, 2, 1) for rank in range(2)]
    for half in halves:
        spec = TableSpec("given", ROWS, DIM, adagrad, dtype=dtype)
        half.create_table(spec, torch.zeros(ROWS // 2, DIM, dtype=dtype))
        half.create_table(TableSpec("initialised", ROWS, DIM, RowSGD(lr=1.0), dtype=dtype), None)
        half.load([str(tmp_path / "server-0-of-1.pt")])
        assert half.rows("given").dtype == half.tables["given"].state["sum"].dtype == dtype
    assert halves[1].rows("given")[0].tolist() == trained  # row 1 is server 1's local row 0


def test_a_table_refuses_rows_and_gradients_of_another_dtype_naming_it():
    s = EmbeddingServer(0, 1, 1)
    s.create_table(TableSpec("t", ROWS, DIM, RowSGD(lr=1.0), dtype=torch.float64), None)
    with pytest.raises(ValueError, match=r"trainer 0 pushed float32 gradients of table 't' \(step 0\), which is"
                       r" float64"):  # fmt: skip
        s.push(0, 0, {"t": (torch.tensor([0]), torch.ones(1, DIM))}, 1.0)
    assert s.applied == -1  # refused, not queued: the trainer may push its step again
    with pytest.raises(ValueError, match=r"table 'u' is bfloat16 \(its spec's `dtype`\), and the initial rows"
                       r" given for it are float32"):  # fmt: skip
        s.create_table(TableSpec("u", ROWS, DIM, RowSGD(lr=1.0), dtype=torch.bfloat16), torch.zeros(ROWS, DIM))
    with pytest.raises(ValueError, match=r"table 'v': `dtype` must be a floating-point torch.dtype .* got torch.int64"):
        TableSpec("v", ROWS, DIM, RowSGD(lr=1.0), dtype=torch.int64)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--server-rank", "2", "--num-servers", "2"], "`server_rank` must be in"),
        (["--server-rank", "0", "--num-servers", "0"], "`num_servers` must be"),
    ],
)
def test_serve_rejects_bad_arguments_before_joining(args, message, capsys):
    with pytest.raises(SystemExit):
        serve_main(["--address", "127.0.0.1:29999", "--num-trainers", "1", *args])
    assert message in capsys.readouterr().err


@pytest.mark.distributed
def test_a_launched_server_starts_as_the_serve_command_without_importing_lightning():
    # the strategy starts its servers with this command: the same arguments, the same checks, and no Lightning
    # nor torchmetrics (which imports matplotlib): a server starts in about half the time
    command = server_command("--address", "127.0.0.1:29999", "--num-trainers", "1", "--server-rank", "2",
                             "--num-servers", "2")  # fmt: skip
    timed = [command[0], "-X", "importtime", *command[1:]]  # every module imported, on stderr
    proc = subprocess.run(timed, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "python -m lightning_dynamix.serve: error: `server_rank` must be in [0, 2), got 2" in proc.stderr
    assert re.search(r"\|\s+torch$", proc.stderr, flags=re.MULTILINE)  # (the listing is there)
    assert "lightning.pytorch" not in proc.stderr
    assert not re.search(r"\|\s+(torchmetrics|matplotlib)$", proc.stderr, flags=re.MULTILINE)
    assert "lightning_dynamix.offload.embedding_server" in proc.stderr


@pytest.mark.e2e
def test_a_server_whose_trainers_never_come_gives_up_after_its_timeout_and_says_where_it_waited():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there
    command = server_command("--address", f"127.0.0.1:{port}", "--num-trainers", "1", "--server-rank", "0",
                             "--num-servers", "1", "--timeout", "1")  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60)  # not torch's 30 minutes
    assert proc.returncode == 1
    assert (
        f"embedding-server-0: the job's 1 trainer(s) and 1 server(s) did not all meet at 127.0.0.1:{port} within"
        " --timeout 1 s" in proc.stderr
    )


def test_serve_rejects_an_address_without_port(capsys):
    with pytest.raises(SystemExit):
        serve_main(["--address", "somehost", "--server-rank", "0", "--num-servers", "1", "--num-trainers", "1"])
    assert "--address" in capsys.readouterr().err


def test_an_rpc_agent_listens_toward_the_job_s_address_for_its_construction_only(monkeypatch):
    from lightning_dynamix.offload.embedding_server import interface_toward, listening_toward

    loopback = next(name for name, addresses in psutil.net_if_addrs().items() if any(
        a.address == "127.0.0.1" for a in addresses))  # fmt: skip
    assert interface_toward("127.0.0.1:29500") == loopback
    monkeypatch.delenv("TP_SOCKET_IFNAME", raising=False)
    with listening_toward("127.0.0.1:29500") as interface:
        assert os.environ["TP_SOCKET_IFNAME"] == interface == loopback
    assert "TP_SOCKET_IFNAME" not in os.environ  # a process started later picks its own
    monkeypatch.setenv("TP_SOCKET_IFNAME", "eth7")
    with listening_toward("127.0.0.1:29500") as interface:
        assert interface == "eth7"  # the user's choice wins
    assert os.environ["TP_SOCKET_IFNAME"] == "eth7"
