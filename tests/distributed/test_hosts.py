"""Hosts on one machine: network namespaces with their own addresses and links of their own rates.

Needs root and iproute2; elsewhere every test here skips, saying what is missing.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time

import psutil
import pytest
import torch

from lightning_dynamix.bench.hosts import Hosts, leftovers, parse_links
from lightning_dynamix.distributed import job_environment
from tests.cli.commands import dynamix_with_pid
from tests.distributed.conftest import JOBS

pytestmark = pytest.mark.distributed

SERVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 5000)); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); n = 0
while data := c.recv(1 << 16):
    n += len(data)
print(n, flush=True)
"""
CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5000)); start = time.perf_counter()
c.sendall(b"x" * int(sys.argv[2])); c.shutdown(socket.SHUT_WR); c.recv(1)
print(time.perf_counter() - start)
"""


def gone(pid: int) -> bool:
    """Whether ``pid`` ended (a zombie whose maker was killed counts: it runs nothing, and waits for init)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def send(hosts: Hosts, size: int) -> tuple[float, int]:
    """Host 1 sends ``size`` bytes to host 0 over TCP: the seconds it took, the bytes host 0 received."""
    server = hosts.popen(0, [sys.executable, "-c", SERVER, hosts.address(0)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    client = hosts.popen(
        1, [sys.executable, "-c", CLIENT, hosts.address(0), str(size)], stdout=subprocess.PIPE, text=True
    )
    seconds = float(client.communicate(timeout=60)[0])
    return seconds, int(server.stdout.readline())


def test_a_link_holds_its_rate_both_ways(hosts_available):
    # 8.4 Mbit through a 10 Mbit/s link: at least 0.84 s less the token bucket's 4 KiB passing at once (0.8 of it
    # asked). A lower bound the shaper sets: a slower or busier machine only adds to it, and none passes the link
    # faster
    size = 1 << 20
    with Hosts([None, 10]) as hosts:
        seconds, received = send(hosts, size)
        assert received == size
        assert seconds >= 0.8 * size * 8 / 10e6
        hosts.set_rate(1, None)
        hosts.set_rate(0, 10)  # now host 0's link, the receiving end: the rate holds into a host too
        seconds, received = send(hosts, size)
        assert received == size
        assert seconds >= 0.8 * size * 8 / 10e6


def test_hosts_reach_each_other_only_at_their_own_addresses(hosts_available):
    with Hosts([None, None]) as hosts:
        interfaces = subprocess.run(hosts.command(1, ["ip", "-brief", "addr"]), capture_output=True, text=True).stdout
        assert "198.18.0.2/24" in interfaces
        # the machine's own interfaces are not in a host's namespace: nothing it sends leaves through them
        assert set(line.split()[0].split("@")[0] for line in interfaces.splitlines()) == {"lo", "eth0"}


def test_nothing_is_left_after_close_ctrl_c_or_a_killed_maker(hosts_available, tmp_path):
    with Hosts([None]) as hosts:
        sleeper = hosts.popen(0, ["sleep", "300"])
        names = [*hosts.namespaces, hosts.switch]
    assert sleeper.poll() is not None
    assert not set(names) & set(leftovers())
    # Ctrl-C as a terminal delivers it: a process started in the background of a script inherits SIGINT ignored
    maker = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from lightning_dynamix.bench.hosts import Hosts
with Hosts([None, 5]) as hosts:
    sleeper = hosts.popen(1, ["sleep", "300"])
    print(" ".join([*hosts.namespaces, hosts.switch]), sleeper.pid, flush=True)
    time.sleep(300)
"""
    for how in (signal.SIGINT, signal.SIGKILL):  # Ctrl-C: the context manager's exit; killed: the reaper
        process = subprocess.Popen([sys.executable, "-c", maker], stdout=subprocess.PIPE, text=True)
        *names, pid = process.stdout.readline().split()
        assert set(names) <= set(leftovers())
        process.send_signal(how)
        process.wait(timeout=30)
        deadline = time.monotonic() + 30
        while set(names) & set(leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not set(names) & set(leftovers()), f"left after {how.name}"
        assert gone(int(pid))  # the process on the host too


def test_two_hosts_on_their_own_links_train_like_one_process(hosts_available, tmp_path, job_helpers):
    # each host a torchrun agent; the ranks meet at host 0's address through the bridge, rank 1 on a 50 Mbit/s link
    with Hosts([None, 50]) as hosts:
        agents = []
        for host in range(2):
            command = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.address(0)}:29400", "--rdzv-id", "hosts",
                "--rdzv-conf", f"is_host={'true' if host == 0 else 'false'}", "--local-addr", hosts.address(host),
                str(JOBS / "hosts_job.py"), str(tmp_path),
            ]  # fmt: skip
            env = dict(job_environment(), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0")
            log = open(tmp_path / f"agent{host}.log", "w")  # noqa: SIM115 - the test's folder holds it
            agents.append(hosts.popen(host, command, cwd=JOBS, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [agent.wait(timeout=240) for agent in agents]
        logs = "\n".join((tmp_path / f"agent{host}.log").read_text()[-3000:] for host in range(2))
        assert codes == [0, 0], logs
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert {rank["master"] for rank in ranks} == {"198.18.0.1"}
    assert {rank["interface"] for rank in ranks} == {"eth0"}
    expected, _ = job_helpers.reference_training([rank["steps"] for rank in ranks], 150, "sgd", 1)
    for rank in ranks:
        worst = max((rank["params"][k] - expected[k]).abs().max().item() for k in expected)
        assert worst <= 1e-6, f"max abs difference {worst}"


def test_the_strategy_s_server_listens_on_the_job_s_address_not_where_the_host_name_points(hosts_available, tmp_path):
    # on a host the machine's name resolves to the loopback; the job meets at the host's address on its link
    with Hosts([None]) as hosts:
        out = tmp_path / "listening.json"
        env = {**job_environment(), **hosts.env(0), "OMP_NUM_THREADS": "1"}
        job = hosts.popen(0, [sys.executable, str(JOBS / "offload_listen_job.py"), str(out)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        output = job.communicate(timeout=180)[0]
        assert job.returncode == 0, output[-4000:]
    seen = json.loads(out.read_text())
    assert seen["job"] == hosts.address(0)
    assert seen["servers"]  # its RPC agent listens
    assert {address.rpartition(":")[0] for address in seen["servers"]} == {hosts.address(0)}


def test_bench_elastic_on_hosts_loses_a_node_and_takes_it_back_with_no_step_lost(hosts_available, tmp_path):
    # `dynamix bench elastic` as a user runs it, every node on a host of its own behind a 20 Mbit/s link: the
    # survivors train on while the node starts again (43 steps an epoch, the last smaller; it leaves at step 10)
    out = tmp_path / "elastic.json"
    printed, pid = dynamix_with_pid(
        "bench", "elastic", "--scenarios", "preemption", "--links", "20,20,20", "--epochs", "2",
        "--preempt-at", "0.25", "--back-at", "0.5", "--hidden", "256", "--num-samples", "8192", "--batch-size", "64",
        "--val-checks", "1", "--target", "0.5", "--workdir", str(tmp_path / "work"), "--output", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    (run,) = json.loads(out.read_text())["runs"]["PreemptionCheckpoint"]
    assert [world for world, _ in run["launches"]] == [3, 2, 3]
    assert run["launches"][1][1] >= 10  # saved at or after the step of the notice
    assert run["steps_lost"] == 0
    assert run["steps"] == 2 * 43
    assert run["notice_to_training"] > 0
    assert run["notice_to_step_reached"] == run["notice_to_training"]  # nothing to train again
    assert not run["back_after_the_end"]
    assert run["back_to_training_on_all"] > 0
    assert "| PreemptionCheckpoint | 0 |" in printed
    (timeline,) = (tmp_path / "work").glob("*/timeline")
    starts = [json.loads(line) for line in timeline.read_text().splitlines()]
    masters = {event["master"] for event in starts if event["event"] == "start"}
    assert masters
    assert all(master.startswith("198.18.0.") for master in masters)  # not 127.0.0.1
    assert leftovers(prefix=f"dx{pid}n") == []  # its hosts are gone (another test's may live beside)


def test_bench_balance_on_a_slow_link_reads_a_balanced_job_as_link_bound(hosts_available, tmp_path):
    # two ranks of equal speed, the second host behind 20 Mbit/s: each step's all-reduce of the model's 307 KB
    # takes over 0.12 s on that link (its rate, whatever the machine), the compute of 32 samples a few ms. Equal
    # batches are balanced, so near their ideal; the all-reduce's share of that ideal step says why it is slow
    out = tmp_path / "link.json"
    dynamix_with_pid(
        "bench", "balance", "--controllers", "static", "--speeds", "1,1", "--links", "0,20", "--steps", "20",
        "--interval", "5", "--batch-size", "32", "--hidden", "256", "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    (intervals,) = result["runs"]["static"]
    for interval in intervals:
        step = 64 / interval["ideal_throughput"]  # the ideal step of the global batch
        assert interval["network_share"] == pytest.approx(min(interval["sync_wait"]) / step)
        assert interval["network_share"] > 0.5
    half = [i["network_share"] for i in intervals if i["step"] > 10]
    assert result["controllers"]["static"]["network_share_second_half"] == statistics.median(half)


@pytest.mark.parametrize(
    ("rates", "message"),
    [([], "1 to 250 hosts"), ([0], r"rates\[0\].*> 0.*got 0"), ([10, float("nan")], r"rates\[1\]"), (["5"], "'5'")],
)
def test_bad_rates_are_refused_naming_the_value(rates, message):
    with pytest.raises(ValueError, match=message):
        Hosts(rates)


def test_links_are_parsed_and_bad_values_named():
    assert parse_links("1000,1000,50") == [1000.0, 1000.0, 50.0]
    assert parse_links("0, -,20", hosts=3) == [None, None, 20.0]
    with pytest.raises(ValueError, match=r"`--links`.*'fast' in '100,fast'"):
        parse_links("100,fast")
    with pytest.raises(ValueError, match=r"`--links`.*'-5'"):
        parse_links("-5")
    with pytest.raises(ValueError, match="gives 2 hosts a rate, but the job has 3"):
        parse_links("10,20", hosts=3)
