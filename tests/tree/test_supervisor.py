"""The supervisor with real processes: restarts by strategy, intensity, signals, hangs, orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from fdcore.checkpoint import tiny
from fdcore.ipc import names
from tests.supervised import ROOT, Tree, make_model_dir

pytestmark = pytest.mark.tree

CHILDREN = ["cache", "worker0", "scheduler", "engine"]


@pytest.fixture
def tree_factory(tmp_path):
    trees: list[Tree] = []
    model = make_model_dir(tmp_path)

    def start(supervisor: str = "", model_path: str | None = None) -> Tree:
        path = tmp_path / f"fdcore-{len(trees)}.toml"
        path.write_text(
            f'[model]\npath = "{model_path or model}"\n\n[supervisor]\nshutdown_timeout = 2.0\n{supervisor}\n'
        )
        tree = Tree(str(path))
        trees.append(tree)
        return tree

    yield start
    for tree in trees:
        tree.destroy()
        assert not tree.alive_children(), "a child outlived its test"


def _ready(tree: Tree) -> dict:
    tree.wait("ready")
    return dict(tree.pids)


@pytest.mark.parametrize("victim", CHILDREN)
def test_one_for_one_restarts_only_the_killed_child(tree_factory, victim):
    tree = tree_factory()
    before = _ready(tree)
    tree.kill_child(victim)
    exited = tree.wait("exited", id=victim)
    assert exited["reason"] == "killed by SIGKILL"
    tree.wait("restarted", id=victim)
    assert tree.pids[victim] != before[victim]
    assert {c: p for c, p in tree.pids.items() if c != victim} == {c: p for c, p in before.items() if c != victim}
    assert all(psutil.pid_exists(pid) for pid in tree.pids.values())
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0


def test_rest_for_one_restarts_the_killed_child_and_those_started_after_it(tree_factory):
    tree = tree_factory('strategy = "rest_for_one"')
    before = _ready(tree)
    tree.kill_child("scheduler")
    tree.wait("exited", id="scheduler")
    tree.wait("child_stopped", id="engine")
    tree.wait("restarted", id="scheduler")
    tree.wait("restarted", id="engine")
    assert tree.pids["cache"] == before["cache"] and tree.pids["worker0"] == before["worker0"]
    assert tree.pids["scheduler"] != before["scheduler"] and tree.pids["engine"] != before["engine"]
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0


def test_one_for_all_restarts_every_child(tree_factory):
    tree = tree_factory('strategy = "one_for_all"')
    before = _ready(tree)
    tree.kill_child("worker0")
    for cid in CHILDREN:
        tree.wait("restarted", id=cid)
    assert all(tree.pids[c] != before[c] for c in CHILDREN)
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0


def test_restart_intensity_exceeded_stops_the_tree_with_a_reason(tree_factory):
    tree = tree_factory("max_restarts = 1\nperiod = 60.0")
    _ready(tree)
    tree.kill_child("engine")
    tree.wait("restarted", id="engine")
    tree.kill_child("engine")
    exceeded = tree.wait("intensity_exceeded", id="engine")
    assert "2 restarts within 60 s (at most 1 allowed)" in exceeded["reason"]
    assert tree.exit_code() == 1
    assert not tree.alive_children()
    assert not [e for e in names.list_entries() if e.instance_id == tree.instance]


def test_sigterm_stops_children_in_reverse_order_within_the_timeout(tree_factory):
    tree = tree_factory()
    _ready(tree)
    os.kill(tree.proc.pid, signal.SIGTERM)
    stopped = [tree.wait("child_stopped") for _ in CHILDREN]
    assert [s["id"] for s in stopped] == list(reversed(CHILDREN))
    assert all(s["by"] == "stop message" and float(s["seconds"]) < 2.0 for s in stopped)
    assert tree.exit_code() == 0
    assert not tree.alive_children()


def test_a_child_ignoring_stop_gets_sigterm_then_sigkill(tree_factory):
    tree = tree_factory()
    _ready(tree)
    tree.kill_child("worker0", signal.SIGSTOP)  # a stopped process neither reads Stop nor dies of SIGTERM
    os.kill(tree.proc.pid, signal.SIGINT)
    worker = tree.wait("child_stopped", id="worker0")
    assert worker["by"] == "SIGKILL" and float(worker["seconds"]) >= 4.0
    assert tree.exit_code() == 0


def _janitor(tree: Tree) -> psutil.Process:
    return next(p for p in psutil.Process(tree.proc.pid).children() if p.cmdline()[:1] == ["fdcore:janitor"])


def _gone_within(pids, seconds: float) -> list[int]:
    """Which of ``pids`` still live after ``seconds`` (dead means dead: a zombie, killed and waiting for
    init to reap it, which can lag on a busy machine, holds no memory and runs nothing)."""
    procs = [psutil.Process(pid) for pid in pids]
    deadline = time.monotonic() + seconds
    while (alive := [pid for pid in pids if names.pid_alive(pid)]) and time.monotonic() < deadline:
        psutil.wait_procs(procs, timeout=0.05)
    return alive


def test_sigkill_of_the_supervisor_leaves_nothing_within_seconds(tree_factory):
    """Its actors die with it, and its janitor removes the instance's shared memory and exits."""
    tree = tree_factory()
    pids = _ready(tree)
    instance, janitor = tree.instance, _janitor(tree)
    assert [e for e in names.list_entries() if e.instance_id == instance]
    os.kill(tree.proc.pid, signal.SIGKILL)
    assert not _gone_within(list(pids.values()), 2), "actors outlived the supervisor by 2 s"
    assert not _gone_within([janitor.pid], 5), "the janitor outlived the supervisor by 5 s"
    assert not [e.filename for e in names.list_entries() if e.instance_id == instance]


def test_the_next_start_sweeps_what_a_killed_supervisor_and_janitor_left(tree_factory):
    tree = tree_factory()
    pids = _ready(tree)
    instance, janitor = tree.instance, _janitor(tree)
    os.kill(janitor.pid, signal.SIGKILL)
    os.kill(tree.proc.pid, signal.SIGKILL)
    assert not _gone_within([*pids.values(), janitor.pid], 2)
    assert [e for e in names.list_entries() if e.instance_id == instance], "expected stale segments"
    second = tree_factory()
    swept = second.wait("swept")
    assert int(swept["objects"]) > 0
    second.wait("ready")
    assert not [e for e in names.list_entries() if e.instance_id == instance]
    os.kill(second.proc.pid, signal.SIGTERM)
    assert second.exit_code() == 0


@pytest.mark.skipif(os.getuid() != 0, reason="making another user's entry needs root")
def test_another_users_stale_entries_do_not_stop_a_start(tree_factory):
    """Another user's leftovers (owner gone, files not ours, record unreadable to them) are not
    touched by the start's sweep, and the start does not fail on them."""
    from fdcore.ipc import Ring

    stale = names.new_instance_id(os.getpid())
    record = os.path.join(names.SHM_DIR, names.object_name(stale, names.OWNER_LINK).lstrip("/"))
    with open(record, "w") as f:  # our pid, but another start time: its owner is verifiably gone
        f.write(f"{os.getpid()} 1 {names.pid_namespace()}\n")
    Ring.create(4096, name=names.object_name(stale, "left")).close()
    try:
        for entry in [e for e in names.list_entries() if e.instance_id == stale]:
            path = os.path.join(names.SHM_DIR, entry.filename)
            os.chown(path, 65534, 65534)
            os.chmod(path, 0)
        tree = tree_factory()
        _ready(tree)
        assert len([e for e in names.list_entries() if e.instance_id == stale]) == 4
        os.kill(tree.proc.pid, signal.SIGTERM)
        assert tree.exit_code() == 0
    finally:
        names.unlink_instance(stale)


def test_a_hung_actor_is_detected_killed_and_restarted(tree_factory):
    tree = tree_factory("heartbeat_interval = 0.1\nhang_timeout = 1.0")
    before = _ready(tree)
    tree.kill_child("scheduler", signal.SIGSTOP)  # alive, but its heartbeat stops
    hung = tree.wait("hung", id="scheduler", timeout=30)
    assert "no heartbeat" in hung["reason"]
    tree.wait("restarted", id="scheduler")
    assert tree.pids["scheduler"] != before["scheduler"]
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0


def test_a_crashing_standby_is_respawned_with_growing_pauses_and_counts_toward_intensity(tree_factory):
    """A spare that keeps dying is not respawned every 50 ms forever: each death waits twice as long
    as the last before the next spare, and each counts as a restart, so a worker that cannot even
    load its spare stops the tree with the reason."""
    tree = tree_factory("max_restarts = 2\nperiod = 60.0")
    delays = []  # the first spare is announced with the tree's start
    for _ in range(3):
        spare = int(tree.wait("standby", id="worker0")["pid"])
        os.kill(spare, signal.SIGKILL)
        exited = tree.wait("standby_exited", id="worker0", pid=spare)
        delays.append(float(exited["respawn_in"].rstrip("s")))
    assert delays == [0.1, 0.2, 0.4]
    exceeded = tree.wait("intensity_exceeded", id="worker0")
    assert "3 restarts within 60 s (at most 2 allowed)" in exceeded["reason"]
    assert tree.exit_code() == 1


def test_a_worker_loads_its_checkpoint_and_reports_progress(tree_factory):
    tree = tree_factory()
    tree.wait("loading", id="worker0", progress="100%")
    tree.wait("ready")
    assert "worker0: loading weights 1/2" in tree.log  # written before the worker was ready
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0


def _damage(path: str, damage: str) -> None:
    config_file = os.path.join(path, "config.json")
    config = json.load(open(config_file))
    shard = os.path.join(path, "model-00002-of-00002.safetensors")
    if damage == "no_config":
        os.remove(config_file)
    elif damage == "truncated":
        os.truncate(shard, os.path.getsize(shard) // 3)
    elif damage == "unsupported_value":
        json.dump({**config, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, open(config_file, "w"))
    elif damage == "wrong_shape":
        json.dump({**config, "intermediate_size": 512}, open(config_file, "w"))
    elif damage == "missing_tensor":
        from safetensors.numpy import load_file, save_file

        tensors = load_file(shard)
        del tensors[sorted(tensors)[0]]
        save_file(tensors, shard, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "damage, named",
    [
        ("no_config", "config.json: missing"),
        ("truncated", "model-00002-of-00002.safetensors: unreadable safetensors"),
        ("unsupported_value", "config.json: key 'rope_scaling.rope_type' = 'longrope' is not implemented"),
        ("wrong_shape", "config.json implies (512, 256)"),
        ("missing_tensor", "' is missing"),
    ],
)
def test_a_bad_checkpoint_is_reported_not_retried(tree_factory, tmp_path, damage, named):
    broken = tiny.make_tiny_model(str(tmp_path / "broken-model"), shards=2)
    _damage(broken, damage)
    tree = tree_factory(model_path=broken)
    failed = tree.wait("start_failed")
    assert "exited during start-up" in failed["reason"]
    assert tree.exit_code() == 1
    lines = [line for line in tree.log if named in line]
    assert lines, "the error, naming the file, reached the log:\n" + "\n".join(tree.log)
    assert lines[0].startswith("fdcore: ") and "cannot start: " in lines[0] and broken in lines[0]
    assert not any("Traceback" in line for line in tree.log), "one line, not a traceback"
    assert not any("event=restarted" in line for line in tree.log)


@pytest.mark.parametrize(
    "damage, named",
    [
        ("truncated", "model-00002-of-00002.safetensors: unreadable safetensors"),
        ("unsupported_value", "config.json: key 'rope_scaling.rope_type' = 'longrope' is not implemented"),
        ("wrong_shape", "config.json implies (512, 256)"),
        ("missing_tensor", "' is missing"),
    ],
)
def test_check_refuses_the_checkpoints_the_worker_would_refuse(tmp_path, damage, named):
    """``--check`` runs the worker's checks that need no tensor data (config keys, tensor headers),
    so a checkpoint that would stop the tree's start is named before it starts."""
    broken = tiny.make_tiny_model(str(tmp_path / "broken-model"), shards=2)
    _damage(broken, damage)
    result = _check(tmp_path, f'[model]\npath = "{broken}"\n')
    assert result.returncode == 2, result.stdout
    assert "fdcore: checkpoint error: " in result.stderr and named in result.stderr, result.stderr


def _check(tmp_path, text: str) -> subprocess.CompletedProcess:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "fdcore.supervisor", "--config", str(path), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("[cache]\nblock_sise = 16\n", "unknown key 'block_sise' in section [cache]"),
        ('[scheduler]\nmax_num_seqs = "many"\n', "key 'scheduler.max_num_seqs': Expected `int`, got `str`"),
        ('[model]\npath = "/nonexistent/model"\n', "key 'model.path': directory '/nonexistent/model' does not exist"),
        ('[supervisor]\nstrategy = "one_for_none"\n', "key 'supervisor.strategy': Invalid enum value 'one_for_none'"),
        ("[cache]\nblock_size = 0\n", "key 'cache.block_size' is 0, must be >= 1"),
        ("[workers]\nomp_threads = -1\n", "key 'workers.omp_threads' is -1, must be >= 0"),
        ("[workers]\ncount = 2\n", "key 'workers.count' is 2; this version runs exactly 1 worker"),
        ("[workers]\ntensor_parallel_size = 0\n", "key 'workers.tensor_parallel_size' is 0, must be >= 1"),
        ('[workers]\ncommunicator = "mpi"\n', "key 'workers.communicator': Invalid enum value 'mpi'"),
        (
            '[model]\ndtype = "float16"\n',
            "key 'model.dtype' is 'float16'; the CPU model computes in float32 or bfloat16",
        ),
        ('[model]\nbackend = "onnx"\n', "key 'model.backend': Invalid enum value 'onnx'"),
    ],
)
def test_bad_configs_are_rejected_naming_the_key_and_file(tmp_path, text, message):
    result = _check(tmp_path, text)
    assert result.returncode == 2
    assert message in result.stderr and "c.toml" in result.stderr


def test_a_workers_threads_are_the_configured_ones_else_the_pinned_ones_else_every_core():
    from fdcore.config import WorkersConfig, worker_threads

    cores = len(os.sched_getaffinity(0))
    assert worker_threads(WorkersConfig(omp_threads=3), {"OMP_NUM_THREADS": "1"}) == 3
    assert worker_threads(WorkersConfig(), {"OMP_NUM_THREADS": "2"}) == 2
    assert worker_threads(WorkersConfig(), {}) == cores
    assert worker_threads(WorkersConfig(tensor_parallel_size=2), {}) == max(1, cores // 2)  # shared by the ranks
    assert worker_threads(WorkersConfig(), {"OMP_NUM_THREADS": "many"}) == cores


def test_the_children_get_the_workers_thread_count_in_their_environment(monkeypatch):
    """OMP_NUM_THREADS in a child's environment is what Paddle's MKL and fdcore's OpenMP kernels
    follow (a child's /proc environ cannot show it: setproctitle reuses that memory)."""
    from fdcore.config import parse_config
    from fdcore.supervisor import Supervisor

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert (
        Supervisor(parse_config("[workers]\nomp_threads = 2\n", check_model=False), "x.toml")._child_env()[
            "OMP_NUM_THREADS"
        ]
        == "2"
    )
    assert Supervisor(parse_config("", check_model=False), "x.toml")._child_env()["OMP_NUM_THREADS"] == "1"
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert Supervisor(parse_config("", check_model=False), "x.toml")._child_env()["OMP_NUM_THREADS"] == str(
        len(os.sched_getaffinity(0))
    )


class _WriteForbidden:
    """A stderr that fails every write, as a BufferedWriter does when a signal handler writes inside a write."""

    def write(self, text):
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

    def flush(self):
        raise RuntimeError("reentrant call")


def test_a_signal_handler_only_records_and_the_waits_log_it(monkeypatch, capsys):
    """SIGTERM / SIGINT can land while the supervisor is inside log()'s write to stderr (a restart's events): the
    handler writing there too raised "reentrant call" and the supervisor exited 1 mid-shutdown (seen on the
    newcomer path's test run). It only records; the next wait logs, a second signal as "killing now"."""
    from fdcore.config import parse_config
    from fdcore.supervisor import Supervisor

    supervisor = Supervisor(parse_config("", check_model=False), "x.toml")
    monkeypatch.setattr(sys, "stderr", _WriteForbidden())
    supervisor._on_signal(signal.SIGTERM, None)
    supervisor._on_signal(signal.SIGINT, None)
    assert supervisor.stopping and supervisor._kill_now
    monkeypatch.undo()
    supervisor._install_signals()
    try:
        supervisor._wait_events(0)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        os.close(supervisor._wake_r)
        os.close(supervisor._wake_w)
    lines = [line for line in capsys.readouterr().err.splitlines() if "event=signal" in line]
    assert lines == [
        "fdcore.supervisor: event=signal name=SIGTERM action=stopping",
        'fdcore.supervisor: event=signal name=SIGINT action="killing now"',
    ]
    supervisor._log_signals()  # logged once
    assert "event=signal" not in capsys.readouterr().err


def test_check_prints_the_effective_configuration(tmp_path):
    model = make_model_dir(tmp_path)
    result = _check(tmp_path, f'[model]\npath = "{model}"\n[engine]\nmax_clients = 3\n')
    assert result.returncode == 0, result.stderr
    assert "[engine]\nmax_clients = 3" in result.stdout and "[server]\nenabled = false" in result.stdout
    assert "# LlamaForCausalLM: 4 layers, hidden 256" in result.stdout  # the checkpoint was inspected
    assert "# config keys read: " in result.stdout and "hidden_size" in result.stdout  # the three sets
    assert "# config keys known to change nothing: " in result.stdout and "fdcore_tiny_version" in result.stdout
    assert "# config keys no transformers model reads (warned, not used): none" in result.stdout


def test_the_readme_example_config_starts_the_tree_and_ctrl_c_stops_it(tmp_path):
    tree = Tree(os.path.join(ROOT, "examples", "fdcore.toml"), env={"FDCORE_HOME": str(tmp_path)})
    try:
        ready = tree.wait("ready", timeout=120)
        assert int(ready["children"]) == 4
        titles = sorted(psutil.Process(pid).cmdline()[0] for pid in tree.pids.values())
        assert titles == ["fdcore:cache", "fdcore:engine", "fdcore:scheduler", "fdcore:worker:0"]
        assert psutil.Process(tree.proc.pid).cmdline()[0] == "fdcore:supervisor"
        os.kill(tree.proc.pid, signal.SIGINT)
        stopped = tree.wait("stopped")
        assert stopped["exit_code"] == "0"
        assert tree.exit_code() == 0
        assert not tree.alive_children()
    finally:
        tree.destroy()
