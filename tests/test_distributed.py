"""The multi-process harness: per-rank rows gathered into one run, torchrun, and runs whose rank
crashed or hung ending within the timeout with the rank named and nothing lost or left behind.
Each launch costs 6-12 s here, so every launch is shared by the tests that read it. The ranks
labkit starts listen on nothing beyond the machine: their listening TCP sockets are read from
/proc while they run."""
import ipaddress
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from conftest import FAST
from labkit.harness import ranks
from labkit.cli import main
from labkit.config import ConfigError
from labkit.harness.ranks import RankExit, RunFailed, root_cause
from labkit.harness.experiment import run_experiment
from labkit.results import RunRecord, load_results, load_runs

pytestmark = pytest.mark.multiprocess  # this module starts ranks (6-12 s a launch)

SIZES = [4096, 65536]
COLLECTIVES = {**FAST, "timed_steps": 2}
LINUX_PROC = os.path.isdir("/proc/self/net")
needs_nccl = pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                                reason="needs CUDA (>= 1 GPU) with NCCL; CPU ranks use gloo")


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6}'s local address: 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_addr)
    ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    return getattr(ip, "ipv4_mapped", None) or ip


def listening_sockets(pid: int) -> set[tuple[str, int, bool]]:
    """(address, port, is loopback) of every TCP socket process `pid` holds in state LISTEN."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since listed
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()  # sl, local, remote, state (0A: LISTEN), ..., inode (10th)
                if cols[3] == "0A" and cols[9] in inodes:
                    host, port = cols[1].split(":")
                    ip = _address(host)
                    found.add((str(ip), int(port, 16), ip.is_loopback))
    return found


class SocketWatch:
    """An `on_rows` callback: each time rows arrive, while the ranks run, the listening sockets
    of every child process (the ranks)."""

    def __init__(self, rows: list):
        self.rows, self.seen = rows, []

    def __call__(self, new_rows: list) -> None:
        self.rows.extend(new_rows)
        self.probe()

    def probe(self) -> None:
        """Also called from the launcher's wait loop: a run shorter than the part files' polling
        delivers its rows only after the ranks are gone."""
        for p in multiprocessing.active_children():
            try:
                self.seen.append((p.pid, listening_sockets(p.pid)))
            except FileNotFoundError:  # exited in between
                pass


def assert_only_loopback(watch: SocketWatch, nproc: int) -> None:
    ranks_seen = {pid for pid, socks in watch.seen if socks}
    assert len(ranks_seen) == nproc, watch.seen  # the probe saw every rank's (gloo's) listener
    beyond = {s for _, socks in watch.seen for s in socks if not s[2]}
    assert not beyond, f"listening beyond loopback: {beyond}"


def by(rows, variant, metric, rank, size=None):
    hits = [r for r in rows if r["variant"] == variant and r["metric"] == metric
            and r["rank"] == rank and (size is None or r["params"]["sweep"]["message_bytes"] == size)]
    assert len(hits) == 1, (variant, metric, rank, hits)
    return hits[0]


@pytest.fixture(scope="module")
def collectives(tmp_path_factory):
    runs, live = tmp_path_factory.mktemp("runs"), []
    watch = SocketWatch(live) if LINUX_PROC else live.extend
    folders = []
    mkdtemp = ranks.tempfile.mkdtemp

    def recording_mkdtemp(*args, **kwargs):  # the rendezvous folders (not multiprocessing's own)
        folder = mkdtemp(*args, **kwargs)
        if str(kwargs.get("prefix", "")).startswith("labkit-"):
            folders.append(folder)
        return folder

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ranks.tempfile, "mkdtemp", recording_mkdtemp)
        if LINUX_PROC:
            sleep = ranks.time.sleep
            mp.setattr(ranks.time, "sleep", lambda s: (watch.probe(), sleep(s)))
        result = run_experiment("collectives", overrides={**COLLECTIVES, "device": "cpu"},
                                sweep={"message_bytes": SIZES}, runs_dir=str(runs),
                                progress=False, on_rows=watch)
    return result, runs, live, watch, folders


def test_every_rank_reports_rows_into_one_stored_run(collectives):
    result, runs, *_ = collectives
    assert {r["rank"] for r in result.rows} == {0, 1}
    assert all(r["status"] == "ok" for r in result.rows)
    assert sorted(p.name for p in runs.iterdir()) == [f"{result.run_id}.json"]  # parts merged
    (record,) = load_runs(runs)
    assert record["status"] == "complete" and len(record["rows"]) == len(result.rows)
    assert result.rows[0]["params"]["nproc"] == 2


def test_live_rows_reach_the_caller_once_each_while_the_ranks_run(collectives):
    result, _, live, *_ = collectives
    key = lambda r: (r["rank"], r["variant"], r["metric"], str(r["params"]["sweep"]))  # noqa: E731
    assert sorted(map(key, live)) == sorted(map(key, result.rows))


def test_collectives_results_match_the_formula_and_bandwidths_follow_nccl_tests(collectives):
    rows = collectives[0].rows
    for variant in ("all_reduce", "all_gather", "reduce_scatter"):
        for rank in (0, 1):
            for size in SIZES:
                assert by(rows, variant, "max_abs_error", rank, size)["value"] == 0
                assert by(rows, variant, "message_bytes", rank, size)["value"] == size
                algbw = by(rows, variant, "algbw_gbps", rank, size)["value"]
                busbw = by(rows, variant, "busbw_gbps", rank, size)["value"]
                factor = 1.0 if variant == "all_reduce" else 0.5  # 2(n-1)/n and (n-1)/n, n = 2
                assert busbw == pytest.approx(algbw * factor)
                step_s = by(rows, variant, "step_ms", rank, size)["value"] / 1e3
                assert algbw == pytest.approx(size / 1e9 / step_s)


@pytest.mark.skipif(not LINUX_PROC, reason="reads the ranks' sockets from Linux's /proc")
def test_the_ranks_listen_only_on_loopback_and_rendezvous_in_a_private_folder(collectives):
    # Before the file store, rank 0's TCPStore listened on every interface ('::').
    *_, watch, folders = collectives
    assert_only_loopback(watch, 2)
    (folder,) = folders
    assert not os.path.exists(folder)  # removed once the ranks are gone


def test_local_ranks_use_loopback_unless_the_user_chose_an_interface(monkeypatch):
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    env = ranks.local_env(2, "/private/store")
    lo = ranks.loopback_interface()
    assert env == {"WORLD_SIZE": "2", ranks.STORE_VAR: "/private/store", "NCCL_SOCKET_IFNAME": lo}
    assert lo in {name for _, name in socket.if_nameindex()}


def test_a_corrupted_reduction_is_refused_where_the_experiment_has_none():
    with pytest.raises(ConfigError, match="fault=corrupt_reduction is not implemented by this "
                                          "experiment; valid here: none, crash, hang"):
        run_experiment("collectives", overrides={"fault": "corrupt_reduction", "device": "cpu"},
                       progress=False)


@needs_nccl
def test_nccl_ranks_listen_only_on_loopback_and_their_collectives_are_exact(tmp_path):
    live = []
    watch = SocketWatch(live) if LINUX_PROC else live.extend
    n = min(2, torch.cuda.device_count())
    result = run_experiment("collectives", overrides={**COLLECTIVES, "device": "cuda", "nproc": n},
                            sweep={"message_bytes": SIZES}, runs_dir=str(tmp_path),
                            progress=False, on_rows=watch)
    assert all(r["status"] == "ok" for r in result.rows)
    assert all(r["value"] == 0 for r in result.rows if r["metric"] == "max_abs_error")
    if LINUX_PROC:
        assert_only_loopback(watch, n)


def test_a_killed_rank_ends_the_run_with_its_name_and_keeps_the_rows(tmp_path, capsys):
    start = time.monotonic()
    code = main(["run", "collectives", "--device", "cpu", "--set", "fault=crash",
                 "--set", "timeout_s=30", "--set", "min_run_time_s=0", "--set", "timed_steps=1",
                 "--runs-dir", str(tmp_path)])
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("labkit: error: the run ended early: rank 1 was killed by SIGKILL")
    assert elapsed < 30 + 15  # the run's timeout, plus process start-up
    assert not multiprocessing.active_children()
    (record,) = load_runs(tmp_path)
    assert record["status"].startswith("error: rank 1 was killed")
    reference = [r for r in record["rows"] if r["variant"] == "all_reduce"]
    assert {r["rank"] for r in reference} == {0, 1}  # measured before the crash, not lost
    assert [p.name for p in tmp_path.iterdir()] == [f"{record['run_id']}.json"]


def test_a_hung_rank_ends_the_run_within_the_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(RunFailed) as failed:
        run_experiment("collectives", overrides={**COLLECTIVES, "device": "cpu", "fault": "hang",
                                                 "timeout_s": 5, "fault_rank": 1},
                       runs_dir=str(tmp_path), progress=False)
    elapsed = time.monotonic() - start
    assert "rank 1 hung: it did not reach the barrier within 5 s (reported by rank 0)" in str(failed.value)
    # timeout, grace, then start-up and stopping, which a loaded 2-core host stretches: the bound
    # tells ending at the timeout from hanging until pytest's own (600 s)
    assert elapsed < 5 + ranks.GRACE_S + 60
    assert not multiprocessing.active_children()
    rows = failed.value.result.rows
    assert {r["rank"] for r in rows if r["variant"] == "all_reduce"} == {0, 1}
    assert len(load_results(tmp_path)) == len(rows)


def test_torchrun_from_the_slurm_script_runs_the_experiment_and_rank_0_prints_every_rank(tmp_path):
    """The example batch script on one node: fake `srun` (runs the command) and `scontrol`
    (names this host); everything else is the real torchrun and c10d rendezvous. One torchrun
    launch (a fresh interpreter per rank and the agent: about 7 CPU-s here) for both: torchrun
    starts labkit's ranks, and the script's rendezvous works."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\nexec "$@"\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "1", "SLURM_JOB_ID": "4242",
           "LABKIT_NPROC_PER_NODE": "2", "LABKIT_RUNS_DIR": str(tmp_path / "runs"),
           "LABKIT_RDZV_PORT": str(ranks.free_port())}
    script = os.path.join(os.path.dirname(__file__), "..", "data", "slurm", "labkit.sbatch")
    out = subprocess.run(["bash", script, "collectives", "--device", "cpu", "--variant",
                          "reduce_scatter", "--set", "min_run_time_s=0", "--set", "timed_steps=1",
                          "--json"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]  # rank 0 prints every rank's
    assert {r["rank"] for r in rows} == {0, 1} and rows[0]["params"]["nproc"] == 2
    assert {r["variant"] for r in rows} == {"all_reduce", "reduce_scatter"}
    assert len({r["run_id"] for r in rows}) == 1
    assert len(list((tmp_path / "runs").iterdir())) == 1  # one run file, not one per rank


def test_root_cause_names_the_rank_behind_the_others_errors():
    exits = [RankExit(0, 1, False), RankExit(1, -9, False)]
    assert root_cause(exits, {0: "RuntimeError: Connection closed by peer"}, 60) == \
        "rank 1 was killed by SIGKILL"
    exits = [RankExit(0, 1, False), RankExit(1, 1, False)]
    errors = {0: "RuntimeError: Connection closed by peer", 1: "ValueError: bad shape"}
    assert root_cause(exits, errors, 60) == "rank 1 failed: ValueError: bad shape"
    exits = [RankExit(0, 1, False), RankExit(1, -15, True)]
    errors = {0: "RuntimeError: Timed out waiting 5000ms for recv operation to complete"}
    assert root_cause(exits, errors, 5).startswith("rank 1 hung: rank 0 timed out waiting for it")


def test_more_gpu_ranks_than_gpus_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setattr(ranks.torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="nproc=2 asks for 2 GPU ranks but 1 GPU"):
        ranks.check_nproc("cuda", 2)
    ranks.check_nproc("cuda", 1)
    ranks.check_nproc("cpu", 8)  # CPU ranks share the cores


def test_nproc_is_refused_for_single_process_experiments_and_cannot_be_swept(capsys):
    assert main(["run", "mixed_precision", "--nproc", "2"]) == 2
    assert "runs in one process; --nproc applies to: collectives" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="nproc cannot be swept"):
        run_experiment("collectives", sweep={"nproc": ["1", "2"]}, progress=False)


def test_part_files_of_an_unmerged_run_load_as_one_run(tmp_path):
    for rank, status in ((0, "complete"), (1, "error: RuntimeError: boom")):
        part = RunRecord("collectives", {}, {}, tmp_path, run_id="r1", part=rank)
        part.add([{"variant": "all_reduce", "metric": "step_ms", "value": 1.0, "rank": rank}])
        part.finish(status)
    (record,) = load_runs(tmp_path)
    assert record["status"] == "error: RuntimeError: boom"
    assert [r["rank"] for r in record["rows"]] == [0, 1]


def test_nccl_settings_are_gpu_knobs_recorded_per_point():
    from labkit.config import resolve
    from labkit.techniques import collectives

    cfg = resolve(collectives.Config, "tiny",
                  {"device": "cpu", "nccl_algo": "Ring", "nccl_channels": "4"})
    assert collectives.nccl_env(cfg) == {"NCCL_ALGO": "Ring", "NCCL_MIN_NCHANNELS": "4",
                                         "NCCL_MAX_NCHANNELS": "4"}
    with pytest.raises(ConfigError, match="NCCL settings: they apply on GPUs"):
        collectives.validate(cfg)
    assert collectives.make_group(cfg) is None  # CPU ranks: the default (gloo) group
