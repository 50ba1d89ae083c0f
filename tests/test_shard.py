"""Pipeline sharding (engine/runtime/shard.py): two ranks on localhost over MLX's ring backend
answer exactly as one process does, and a rank that dies or hangs ends the other one in
bounded time with a message saying so.

The ranks are started here as `mlx.launch` starts them (a ring hostfile, MLX_RANK), without
the launcher: it would kill the survivor itself, and the tests are about what the survivor
does. Each run is tests/shard_chat.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import shard_chat

import engine
from engine.runtime import shard
from renderer.variants import THINK_EMPTY

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("shard_chat.py")
WAIT = 240  # seconds a whole 2-rank run may take on a loaded 2-core machine
BUDGET = 2_000_000  # cache bytes: the scripted chat on tiny evicts snapshots under it


def _hostfile(tmp_path: Path, n: int = 2) -> Path:
    ports = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    return path


def _launch(tmp_path: Path, args: list[str], env: dict | None = None, models=None):
    """Start rank 0 and rank 1 of tests/shard_chat.py (rank 0's stdin is a pipe)."""
    hosts = _hostfile(tmp_path)
    procs = []
    for rank in (0, 1):
        model = (models or {}).get(rank, args[0])
        e = {**os.environ, "MLX_HOSTFILE": str(hosts), "MLX_RANK": str(rank),
             "PYTHONPATH": str(REPO), **(env or {}).get(rank, {})}  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, str(SCRIPT), model, *args[1:], "--shard"], env=e, text=True,
            stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        ))  # fmt: skip
    return procs


def _finish(procs) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=WAIT)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, stdout, stderr))
    return out


def _two_ranks(tmp_path: Path, model: str, *flags: str, out: str = "two"):
    """Run the scripted chat on 2 ranks, both of which must exit 0: (rows, logits)."""
    out = tmp_path / out
    results = _finish(_launch(tmp_path, [model, str(out), *flags]))
    for rank, (code, _, stderr) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{stderr[-3000:]}"
    logits = np.load(out.with_suffix(".npz"))
    return json.loads(out.with_suffix(".json").read_text()), [logits[k] for k in logits.files]


def _compare(ref, tmp_path: Path, model: str, *flags: str) -> None:
    """Run the scripted chat on 2 ranks; compare with `ref` (rows, logits) of one process."""
    rows, logits = _two_ranks(tmp_path, model, *flags)
    want_rows, want_logits = ref
    assert len(rows) == len(want_rows)
    for i, (got, want) in enumerate(zip(rows, want_rows)):
        assert set(got) == set(want)
        for key in set(want) - {"logprobs"}:
            assert got[key] == want[key], f"turn {i}: {key} {got[key]} != {want[key]}"
        assert np.allclose(got.get("logprobs", []), want.get("logprobs", []), atol=1e-4, rtol=0)
    assert len(logits) == len(want_logits)
    for i, (got, want) in enumerate(zip(logits, want_logits)):
        assert np.abs(got - want).max() <= 1e-4, f"fresh-prefill logits {i}"


def test_two_ranks_chat_exactly_as_one_process(tiny, tmp_path):
    # Plain turns, trimming, regenerate, edit, a failed turn, an interrupted one, warm-up, a
    # tool round, the stateless pool, speculative verify steps, evictions: greedy tokens,
    # reused/prefilled counts and cache bytes identical, logits within 1e-4. Rank 1 exits 0
    # only if it then holds exactly the states rank 0 still names (no release lost).
    # A fresh engine (its pool starts empty), with a budget that evicts snapshots.
    eng = engine.load("tiny", cache_bytes=BUDGET)
    ref = shard_chat.run(eng)
    assert eng.budget.evictions > 0
    rows = ref[0]
    assert rows[2]["reused"] < rows[1]["reused"] + rows[1]["prefilled"]  # the window trimmed
    assert any(r.get("tool_calls") for r in rows)
    spec = rows[-1]  # speculative decoding: verify steps, kept states, rollbacks
    assert spec["tokens"] == spec["plain"] and 0 < spec["accepted"] < spec["drafted"]
    _compare(ref, tmp_path, "tiny", "--budget", str(BUDGET))


def test_two_ranks_mixture_of_experts(tiny_moe, tmp_path):
    path = str(tiny_moe.path)
    ref = shard_chat.run(engine.load(path, chunked_delta=False), short=True)
    _compare(ref, tmp_path, path, "--sequential", "--short")


def test_a_request_branching_off_a_pooled_sequence_forks_it_on_every_rank(tiny, tmp_path):
    # A second conversation on the same system prompt (the common case of a server) branches
    # off the first one's pooled sequence: the pool copies the shared prefix's KV rows into
    # another slot. Rank 0 read them from the remote layers' caches, which hold none there
    # (TypeError: 'NoneType' object is not subscriptable): the request failed.
    ref = shard_chat.forks(engine.load("tiny"))
    assert ref[0][-1]["forks"] == 1 and ref[0][1]["reused"] > 0  # it did fork
    assert ref[0][2]["reused"] > ref[0][0]["prefilled"]  # the first one kept its slot
    _compare(ref, tmp_path, "tiny", "--forks")


def test_a_script_passing_cache_dir_on_every_rank_runs_on_one_machine(tiny, tmp_path):
    # A script started the same way on every rank passes the same cache_dir= everywhere.
    # Every rank took the folder's lock, though only rank 0 uses it: on one machine the
    # second rank failed with DiskCacheBusy and the group with it.
    disk = tmp_path / "disk"
    rows, _ = _two_ranks(tmp_path, "tiny", "--forks", "--cache-dir", str(disk))
    want, _ = shard_chat.forks(engine.load("tiny"))
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in want]
    assert list(disk.glob("*/*.safetensors"))  # rank 0 has it


def test_saved_session_and_disk_tier_resume_in_a_new_launch(tiny, tmp_path):
    # Two ranks chat in a persisted session with a disk tier and exit; a new 2-rank launch
    # resumes both. Rank 0 gathers every layer into the state files: they equal one
    # process's (same tensors, values within 1e-4), and a sharded save resumes exactly in one
    # process too. The resumed answers, reused/prefilled counts and cache bytes equal one
    # process resuming the same files, and each answer is what a fresh prefill decodes.
    import shutil

    from safetensors.numpy import load_file

    two, one = tmp_path / "two-home", tmp_path / "one-home"
    saved = _two_ranks(tmp_path, "tiny", "--save", str(two), out="save")
    want = shard_chat.persist(engine.load("tiny"), one, resume=False)
    _same_turns(saved, want)
    state = "sessions/saved/state.safetensors"
    got, ref = load_file(two / state), load_file(one / state)
    assert sorted(got) == sorted(ref) and any(k.startswith("snap.") for k in got)
    for name in ref:
        assert got[name].shape == ref[name].shape, name
        assert np.allclose(got[name], ref[name], atol=1e-4, rtol=0), name
    entries = sorted(p.name for p in (two / "disk").glob("*/*.safetensors"))
    assert entries and entries == sorted(p.name for p in (one / "disk").glob("*/*.safetensors"))

    shutil.copytree(two, tmp_path / "copy")  # the 2-rank save, for one process to resume
    resumed = _two_ranks(tmp_path, "tiny", "--resume", str(two), out="resume")
    want = shard_chat.persist(engine.load("tiny"), tmp_path / "copy", resume=True)
    _same_turns(resumed, want)
    rows = resumed[0]
    assert all(r["state_loaded"] and r["resumed"] == 2 and r["disk_reads"] == 1 for r in rows)
    assert rows[0]["reused"] > 0  # the stateless chat, in a fresh process: from the disk tier


def _same_turns(got, want) -> None:
    """Equal rows (tokens, counts, cache bytes), each answer a fresh prefill's, and the
    fresh-prefill logits within 1e-4."""
    (rows, logits), (want_rows, want_logits) = got, want
    assert rows == want_rows
    assert all(r["tokens"] == r["fresh"] for r in rows)
    assert len(logits) == len(want_logits)
    for a, b in zip(logits, want_logits):
        assert np.abs(a - b).max() <= 1e-4


def _answering(procs) -> None:
    """Wait until rank 0 is in the middle of an answer (it printed ANSWERING and waits)."""
    line = procs[0].stdout.readline()
    assert line.strip() == "ANSWERING", procs[0].communicate(timeout=WAIT)[1][-3000:]


def test_killed_follower_ends_rank_0_with_a_message(tiny, tmp_path):
    procs = _launch(tmp_path, ["tiny", str(tmp_path / "x"), "--pause"])
    _answering(procs)
    procs[1].kill()
    procs[0].stdin.write("go on\n")
    procs[0].stdin.flush()
    (code, stdout, stderr), _ = _finish(procs)
    assert code != 0 and "FINISHED" not in stdout
    assert "ShardError" in stderr and "a peer rank is gone" in stderr, stderr[-3000:]


def test_killed_rank_0_ends_the_follower_with_a_message(tiny, tmp_path):
    procs = _launch(tmp_path, ["tiny", str(tmp_path / "x"), "--pause"])
    _answering(procs)
    procs[0].kill()
    _, (code, _, stderr) = _finish(procs)
    assert code == shard.EXIT_LOST, stderr[-3000:]
    assert "chatml shard rank 1 of 2" in stderr and "a peer rank is gone" in stderr


def test_ctrl_c_reaches_the_follower_too_and_it_serves_on(tiny, tmp_path):
    # Under mlx.launch the ranks on this machine share the terminal's process group: Ctrl+C
    # (which `chatml chat` takes as "interrupt this answer", and `chatml serve` as "write the
    # pool and stop") reaches the followers too. A follower died of it (KeyboardInterrupt)
    # and took the group with it; rank 0 alone decides when the followers exit.
    procs = _launch(tmp_path, ["tiny", str(tmp_path / "x"), "--pause"])
    _answering(procs)
    procs[1].send_signal(signal.SIGINT)
    procs[0].stdin.write("go on\n")
    procs[0].stdin.flush()
    results = _finish(procs)
    for rank, (code, _, stderr) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{stderr[-3000:]}"
    assert "FINISHED" in results[0][1]


def test_hung_follower_ends_rank_0_after_the_timeout(tiny, tmp_path):
    # A stopped process keeps its sockets open: only the watchdog can tell.
    env = {0: {"CHATML_SHARD_TIMEOUT": "5"}}
    procs = _launch(tmp_path, ["tiny", str(tmp_path / "x"), "--pause"], env)
    _answering(procs)
    procs[1].send_signal(signal.SIGSTOP)
    try:
        procs[0].stdin.write("go on\n")
        procs[0].stdin.flush()
        code = procs[0].wait(timeout=WAIT)
        stderr = procs[0].stderr.read()
    finally:
        procs[1].kill()
        procs[1].wait(timeout=WAIT)
    assert code == shard.EXIT_LOST, stderr[-3000:]
    assert "waited 5 s" in stderr and "hangs or its machine is unreachable" in stderr


def _follower_outlives_rank_0(procs, seconds: float) -> None:
    """Rank 0 waits for a line on stdin: the follower must still be there after `seconds`,
    and both ranks exit 0 once rank 0 goes on."""
    try:
        code = procs[1].wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        code = None
    if code is not None:
        procs[0].kill()
        pytest.fail(f"the follower exited ({code}):\n{procs[1].stderr.read()[-3000:]}")
    procs[0].stdin.write("go on\n")
    procs[0].stdin.flush()
    for rank, (code, _, stderr) in enumerate(_finish(procs)):
        assert code == 0, f"rank {rank} failed:\n{stderr[-3000:]}"


def test_a_follower_with_a_shorter_timeout_outlives_an_idle_rank_0(tiny, tmp_path):
    # Each rank reads its own CHATML_SHARD_TIMEOUT. Rank 0 pinged at an eighth of its own
    # (5 s here), so a follower waiting at most 3 s took an idle pipeline for a dead one and
    # exited; rank 0 must ping within the shortest timeout of the group.
    env = {0: {"CHATML_SHARD_TIMEOUT": "40"}, 1: {"CHATML_SHARD_TIMEOUT": "3"}}
    procs = _launch(tmp_path, ["tiny", str(tmp_path / "x"), "--pause"], env)
    _answering(procs)
    _follower_outlives_rank_0(procs, 12)  # rank 0 idles: four follower timeouts


def test_followers_outlive_an_engine_dropped_while_the_process_lives_on(tiny, tmp_path):
    # The heartbeat pinged through the engine's model thread: once a Python caller let the
    # engine go (collected), rank 0 fell silent, and the followers took it for dead after
    # their timeout (exit 3; under mlx.launch that ends rank 0 too). They are told to stop
    # at rank 0's exit, as before.
    env = {rank: {"CHATML_SHARD_TIMEOUT": "3"} for rank in (0, 1)}
    procs = _launch(tmp_path, ["tiny", str(tmp_path / "x"), "--drop"], env)
    line = procs[0].stdout.readline()
    assert line.strip() == "DROPPED", line + procs[0].communicate(timeout=WAIT)[1][-3000:]
    _follower_outlives_rank_0(procs, 12)  # rank 0 lives on without its engine: 4 timeouts


def test_a_failed_draft_model_load_on_rank_0_stops_the_followers(tiny, tmp_path):
    # The draft model loaded before rank 0 attached (heartbeat, stop at exit): one that
    # failed (here: another tokenizer) ended rank 0 with its error, and the follower saw a
    # lost peer (exit 3: "[ring] Socket ... was closed by the peer"); a slow one went
    # unpinged. Rank 0 now attaches first: at its exit it tells the followers to stop.
    folder = tmp_path / "other-tokenizer"
    shutil.copytree(tiny.path, folder)
    with open(folder / "tokenizer.json", "a") as f:
        f.write(" ")
    procs = _launch(tmp_path, ["tiny", str(tmp_path / "x"), "--draft", str(folder)])
    (code0, _, stderr0), (code1, _, stderr1) = _finish(procs)
    assert code0 != 0 and "the draft model's tokenizer differs" in stderr0, stderr0[-3000:]
    assert code1 == 0, stderr1[-3000:]  # told to stop, not a lost peer


@pytest.mark.parametrize("raw", ["nan", "inf", "-1", "0", "soon"])
def test_a_shard_timeout_that_is_no_finite_positive_number_is_refused(monkeypatch, raw):
    # NaN disarmed the watchdog (no deadline compares as passed): a hung peer hung this rank
    # for ever; inf crashed the heartbeat thread (time.sleep(inf)).
    monkeypatch.setenv("CHATML_SHARD_TIMEOUT", raw)
    with pytest.raises(shard.ShardError, match="CHATML_SHARD_TIMEOUT must be"):
        shard.timeout()
    monkeypatch.setenv("CHATML_SHARD_TIMEOUT", "2.5")
    assert shard.timeout() == 2.5


def test_ranks_on_different_checkpoints_refuse(tiny, tiny_moe, tmp_path):
    procs = _launch(tmp_path, ["tiny", str(tmp_path / "x")], models={1: str(tiny_moe.path)})
    for code, _, stderr in _finish(procs):
        assert code != 0
        assert "the ranks disagree on the checkpoint" in stderr, stderr[-3000:]
        assert tiny.fingerprint in stderr and tiny_moe.fingerprint in stderr


def test_ranks_running_different_code_refuse(tiny, tmp_path):
    # Two checkouts of the same protocol with different layer code ran together and could
    # answer inexactly without an error: the handshake compares a digest of the code too.
    copy = tmp_path / "other"
    for name in ("engine", "kernels", "renderer"):
        shutil.copytree(REPO / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "models.yaml", copy)
    with open(copy / "engine" / "runtime" / "model.py", "a") as f:
        f.write("\n# another version of the layers\n")
    procs = _launch(tmp_path, ["tiny", str(tmp_path / "x")], env={1: {"PYTHONPATH": str(copy)}})
    for code, _, stderr in _finish(procs):
        assert code != 0
        assert "the ranks disagree on the load options" in stderr, stderr[-3000:]
        assert "or the engine's code" in stderr, stderr[-3000:]


def test_plan_splits_contiguous_ranges_last_layers_on_rank_0():
    assert shard.plan(8, 2) == [range(4, 8), range(0, 4)]
    assert shard.plan(24, 5) == [range(20, 24), range(15, 20), range(10, 15), range(5, 10),
                                 range(0, 5)]  # fmt: skip
    with pytest.raises(shard.ShardError, match="8 layers and cannot be split over 9 ranks"):
        shard.plan(8, 9)


def test_packed_arrays_come_back_whole():
    # How cache states travel (one buffer per transfer): dtypes, odd sizes (padding), a
    # strided slice (KV rows), against numpy copies; each unpacked array owns its memory.
    import mlx.core as mx

    kv = mx.random.normal((1, 2, 300, 8))[:, :, :37]
    arrays = [kv, mx.arange(7, dtype=mx.bfloat16).reshape(1, 7), mx.random.normal((3,)),
              mx.ones((1, 3, 5), dtype=mx.float16)]  # fmt: skip
    want = [np.array(a.astype(mx.float32)) for a in arrays]
    meta, buf = shard.pack(arrays)
    assert buf.nbytes == shard.packed_nbytes(meta) and buf.nbytes % shard.ALIGN == 0
    back = shard.unpack(meta, buf)
    del buf
    for a, b, w in zip(arrays, back, want):
        assert b.dtype == a.dtype and b.shape == a.shape
        assert np.array_equal(np.array(b.astype(mx.float32)), w)
    with pytest.raises(shard.ShardError, match="int32 array of shape"):
        shard.pack([mx.array([1])])


def test_a_process_alone_cannot_shard(tiny):
    with pytest.raises(shard.ShardError, match="this one is alone: start it with `mlx.launch"):
        engine.load("tiny", shard="pipeline")
    with pytest.raises(ValueError, match="shard must be 'pipeline' or None, got 'tensor'"):
        engine.load("tiny", shard="tensor")


def test_serve_alone_with_shard_says_so_without_a_traceback(tiny, tmp_path):
    # `chatml chat --shard pipeline` outside mlx.launch says what is wrong in one line (exit
    # 3); `chatml serve` printed a ShardError traceback (exit 1) for the same mistake, and for
    # ranks that disagree on the checkpoint or options.
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_HOSTFILE", "MLX_RANK")}
    env["PYTHONPATH"] = str(REPO)
    run = subprocess.run(
        [sys.executable, "-m", "engine.cli", "serve", "--model", "tiny", "--port", "0",
         "--no-disk-cache", "--shard", "pipeline"],
        capture_output=True, text=True, env=env, timeout=WAIT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert run.returncode == 3, run.stderr[-3000:]  # as chatml chat
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "chatml serve: shard='pipeline' runs in a launched group" in run.stderr


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_a_rank_started_by_hand_whose_peer_never_comes_says_so_and_exits(tiny, tmp_path,
                                                                          command):  # fmt: skip
    # MLX's ring backend waits for every rank of the hostfile forever, silently: a rank
    # started by hand (MLX_RANK, MLX_HOSTFILE) whose peer never started hung with no word.
    env = {**os.environ, "MLX_HOSTFILE": str(_hostfile(tmp_path)), "MLX_RANK": "0",
           "PYTHONPATH": str(REPO), "CHATML_SHARD_TIMEOUT": "0.6"}  # fmt: skip
    args = ["-p", "Hi"] if command == "chat" else ["--port", "0", "--no-disk-cache"]
    run = subprocess.run(
        [sys.executable, "-m", "engine.cli", command, "--model", "tiny", *args,
         "--shard", "pipeline"],
        capture_output=True, text=True, env=env, timeout=WAIT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    # MLX holds the GIL while it waits: a watch process says so and ends the rank.
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "chatml shard rank 0: waiting for the other ranks of the group to start" in run.stderr
    assert "chatml shard rank 0: the group did not form within 6 s" in run.stderr


def test_ctrl_c_ends_a_rank_still_waiting_for_its_group(tiny, tmp_path):
    # MLX's join holds the GIL: the rank's own SIGINT handler never runs, and a Ctrl+C did
    # nothing. The terminal sends it to the whole process group, the watch process included.
    env = {**os.environ, "MLX_HOSTFILE": str(_hostfile(tmp_path)), "MLX_RANK": "0",
           "PYTHONPATH": str(REPO), "CHATML_SHARD_TIMEOUT": "30"}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "chat", "--model", "tiny", "-p", "Hi",
         "--shard", "pipeline"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,  # its own process group, as a terminal gives it
    )  # fmt: skip
    try:
        line = proc.stderr.readline()  # after JOIN_NOTICE_S: both processes are up
        assert "waiting for the other ranks of the group to start" in line, line
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=WAIT)
    finally:
        proc.kill()
    # Two ways out, by a race: the watch ends the rank (it says so), or the signal breaks one
    # of MLX's socket calls first and the rank stops as at any Ctrl+C (exit 130). Either way
    # it ends now, not after the join's limit, and without a traceback.
    if proc.returncode == -signal.SIGKILL:
        assert "chatml shard rank 0: interrupted while waiting for the other ranks" in stderr
    else:
        assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]


def test_a_join_whose_watch_cannot_start_goes_on_unwatched(monkeypatch, capsys):
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)  # alone: init returns at once
    monkeypatch.delenv("MLX_RANK", raising=False)

    def refuse(*args, **kwargs):
        raise OSError(8, "Exec format error")

    monkeypatch.setattr(shard.subprocess, "Popen", refuse)
    shard.join_group.cache_clear()
    try:
        assert shard.join_group().size() == 1
    finally:
        shard.join_group.cache_clear()
    assert "joining without a time limit (the watch did not start" in capsys.readouterr().err


def test_each_rank_loads_only_its_tensors(tiny):
    from types import SimpleNamespace

    from engine.checkpoints.loader import load_weights, weights_nbytes
    from engine.runtime.follower import Stage
    from engine.runtime.model import ModelOptions

    ckpt, ranges = tiny.checkpoint, shard.plan(tiny.entry.arch.num_hidden_layers, 2)
    links = [SimpleNamespace(rank=r, ranges=ranges) for r in (0, 1)]
    sizes = [weights_nbytes(ckpt, 4, dequantize_quantized=False, select=shard.selector(x))
             for x in links]  # fmt: skip
    assert sum(sizes) == weights_nbytes(ckpt, 4, dequantize_quantized=False)
    embed = tiny.entry.arch.vocab_size * tiny.entry.arch.hidden_size * 4
    assert sizes[0] > embed > sizes[1] > 0  # the embedding (tied head) is rank 0's alone
    stage = Stage(tiny.entry.arch, ModelOptions(), links[1])
    load_weights(
        ckpt, stage, tiny.dtype, dequantize_quantized=False, select=shard.selector(links[1])
    )
    from mlx.utils import tree_flatten

    names = [k for k, _ in tree_flatten(stage.parameters())]
    assert names and all(int(k.split(".")[1]) in ranges[1] for k in names)


def test_chat_cli_under_mlx_launch_answers_as_one_process(tiny, tmp_path):
    # The documented entry point: `mlx.launch -n 2 --backend ring -- chatml chat --shard ...`.
    launcher = Path(sys.executable).with_name("mlx.launch")
    if not launcher.exists():
        pytest.skip("mlx.launch is not installed beside this interpreter")
    ask = ["chat", "-p", "Hello! My order number is 48213.", "--max-tokens", "6", "--stats",
           "--temperature", "0", "--presence-penalty", "0"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    one = subprocess.run([sys.executable, "-m", "engine.cli", *ask], capture_output=True,
                         text=True, env=env, timeout=WAIT)  # fmt: skip
    with socket.socket() as s:  # mlx.launch uses this port and the next
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = subprocess.run(
        [str(launcher), "-n", "2", "--backend", "ring", "--starting-port", str(port), "--",
         sys.executable, "-m", "engine.cli", *ask, "--shard", "pipeline"],
        capture_output=True, text=True, env=env, timeout=WAIT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    timings = re.compile(r"; ttft [^;]*; decode [^;]*;")  # counts kept, times dropped
    assert "reused 0, prefilled" in one.stdout
    assert timings.sub("", two.stdout) == timings.sub("", one.stdout)


def _serve(tmp_path: Path, name: str, launcher: list[str], *flags: str):
    """Start a server (its own process group; stderr to a file) and wait for its banner:
    (process, base URL)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CHATML_TEST_SERVER": str(tmp_path / name)}
    proc = subprocess.Popen(
        [*launcher, sys.executable, "-m", "engine.cli", "serve", "--model", "tiny", "--port", "0",
         "--cache-dir", str(tmp_path / name / "disk"), *flags],
        env=env, text=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=(tmp_path / f"{name}.err").open("w"), start_new_session=True,
    )  # fmt: skip
    for line in proc.stdout:  # the banner: printed once the model is loaded and the port listens
        if found := re.match(r"chatml serve: tiny on (http://\S+/v1)", line):
            return proc, found[1]
    proc.wait(timeout=WAIT)
    raise AssertionError(f"{name}: no banner\n{(tmp_path / f'{name}.err').read_text()[-3000:]}")


def _ask(url: str, messages: list[dict]) -> dict:
    from urllib.request import Request, urlopen

    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0,
            "presence_penalty": 0, "logprobs": True}  # fmt: skip
    request = Request(f"{url}/chat/completions", json.dumps(body).encode(),
                      {"Content-Type": "application/json"})  # fmt: skip
    with urlopen(request, timeout=WAIT) as r:
        return json.loads(r.read())


def _rank_0_of(marker: str) -> int:
    """The pid of rank 0 under an mlx.launch whose environment holds `marker`."""
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            names = set(env.read_bytes().split(b"\0"))
        except OSError:
            continue
        if f"CHATML_TEST_SERVER={marker}".encode() in names and b"MLX_RANK=0" in names:
            return int(env.parent.name)
    raise AssertionError("rank 0 of the sharded server not found")


def test_a_sharded_server_whose_follower_dies_exits_with_a_message(tiny, tmp_path):
    # Ranks started by hand (no mlx.launch to end the survivors): rank 0's server went on
    # with a broken link, failing every request. Its heartbeat now finds the peer gone, and
    # the server stops and exits 3 naming it, as `chatml chat` does.
    hosts = _hostfile(tmp_path)
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "MLX_HOSTFILE": str(hosts),
            "MLX_RANK": str(rank),
            "PYTHONPATH": str(REPO),
            "CHATML_SHARD_TIMEOUT": "16",
        }  # pings every 2 s
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "engine.cli", "serve", "--model", "tiny", "--port", "0",
             "--no-disk-cache", "--shard", "pipeline"],
            env=env, text=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=(tmp_path / f"rank{rank}.err").open("w"),
        ))  # fmt: skip
    try:
        for line in procs[0].stdout:  # the banner: loaded, listening
            if line.startswith("chatml serve: tiny on"):
                break
        else:
            raise AssertionError((tmp_path / "rank0.err").read_text()[-3000:])
        procs[1].kill()
        assert procs[0].wait(timeout=WAIT) == shard.EXIT_LOST
        stderr = (tmp_path / "rank0.err").read_text()
        assert "chatml serve: chatml shard rank 0 of 2" in stderr, stderr[-3000:]
        assert "a peer rank is gone" in stderr and "Traceback" not in stderr
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=WAIT)


def test_sharded_server_answers_as_one_process(tiny, tmp_path):
    # `mlx.launch -n 2 ... chatml serve --shard pipeline`: two requests, the second reusing the
    # first's prefix, answered as a 1-process server answers them (tokens, logprobs within
    # 1e-4, usage with cached tokens). SIGTERM to rank 0 stops the group cleanly (mlx.launch
    # warns of a rank that did not exit 0: rank 1 exits 0 only if it was told to stop and held
    # exactly the states rank 0 named), and the disk entries both servers wrote are equal.
    launcher = Path(sys.executable).with_name("mlx.launch")
    if not launcher.exists():
        pytest.skip("mlx.launch is not installed beside this interpreter")
    if not Path("/proc/self/environ").exists():
        pytest.skip("finds rank 0 under mlx.launch through /proc (Linux)")
    with socket.socket() as s:  # mlx.launch uses this port and the next
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ring = [str(launcher), "-n", "2", "--backend", "ring", "--starting-port", str(port), "--"]
    servers = []
    try:
        servers.append(_serve(tmp_path, "one", []))
        servers.append(_serve(tmp_path, "two", ring, "--shard", "pipeline"))
        first = [{"role": "user", "content": shard_chat.QUESTIONS[0]}]
        answers = []
        for _, url in servers:
            a = _ask(url, first)
            follow = [*first, a["choices"][0]["message"], {"role": "user", "content": "And?"}]
            answers.append([a, _ask(url, follow)])
        # Both write their pools to disk and exit (uvicorn ends by re-raising the signal).
        os.kill(servers[0][0].pid, signal.SIGTERM)
        os.kill(_rank_0_of(str(tmp_path / "two")), signal.SIGTERM)
        for proc, _ in servers:
            proc.wait(timeout=WAIT)
        err = (tmp_path / "two.err").read_text()
        assert "Application shutdown complete" in err and "Node with rank 1" not in err, err[-3000:]
    finally:
        for proc, _ in servers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=WAIT)
    (one_first, one_second), (two_first, two_second) = answers

    def cached(answer: dict) -> int:
        return answer["usage"].pop("prompt_tokens_details")["cached_tokens"]

    assert cached(one_first) == cached(two_first) == 0
    # How much of the second prompt is cached depends on whether the idle warm-up ran before it
    # came (a race). At least the first prompt less the empty think block its generation
    # prompt ended with (history re-renders the answer without it): the snapshot at the
    # answer's message start.
    shared = one_first["usage"]["prompt_tokens"] - len(tiny.tokenizer.encode(THINK_EMPTY))
    assert min(cached(one_second), cached(two_second)) >= shared > 0
    for want, got in ((one_first, two_first), (one_second, two_second)):
        assert got["usage"] == want["usage"]
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        pieces = [c["logprobs"]["content"] for c in (got["choices"][0], want["choices"][0])]
        assert [p["token"] for p in pieces[0]] == [p["token"] for p in pieces[1]]
        assert np.allclose([p["logprob"] for p in pieces[0]], [p["logprob"] for p in pieces[1]],
                           atol=1e-4, rtol=0)  # fmt: skip
    _same_entries(tmp_path / "one" / "disk", tmp_path / "two" / "disk")


def _same_entries(one: Path, two: Path) -> None:
    """The disk-tier entries both folders hold (each turn's resume points at least; what the
    pools' shutdown writes depends on the warm-up's progress) have the same tensors."""
    from safetensors.numpy import load_file

    names = [{p.relative_to(d) for p in d.glob("*/*.safetensors")} for d in (one, two)]
    common = names[0] & names[1]
    assert len(common) >= 2, names
    for name in common:
        a, b = load_file(one / name), load_file(two / name)
        assert sorted(a) == sorted(b)
        assert all(np.allclose(a[k], b[k], atol=1e-4, rtol=0) for k in a), name
