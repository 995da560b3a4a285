"""Faults: a compiled program restarted by its launch.sh resumes from its last complete checkpoint.

A 2-rank data-parallel GPT with dropout 0.1 (a tiny one; gloo, one thread per rank) is compiled; its
``launch.sh`` runs it uninterrupted once (the reference losses). Then (the dropout masks after a resume are the
uninterrupted run's only because each checkpoint keeps every rank's random generators):

* one rank is SIGKILLed from outside in the middle of the run under ``launch.sh --max-restarts 1``: torchrun
  restarts the job, ``train.py`` resumes from its newest complete checkpoint by itself (``--auto-resume``), and
  every step's loss, before and after the restart, equals the uninterrupted run's;
* a rank is SIGKILLed while it writes the checkpoint of step 4 (the test hook ``AUTOPLAN_TEST_KILL_DURING_SAVE``
  of :mod:`executors.training.checkpoint`): ``step-4`` holds a shard but no DCP metadata and ``latest`` still
  names ``step-2``; launched again, the program resumes from ``step-2``, never the half-written one, and
  the losses again equal the uninterrupted run's;
* ``train.sbatch``, run as Slurm runs it (a copy of the script, ``srun`` and ``scontrol`` stood in for on
  ``PATH``), finds the program by ``SLURM_SUBMIT_DIR`` and trains to the same losses.

And the multi-node ``launch.sh`` of a two-node plan, started twice on loopback with one ``MASTER_ADDR``, trains.

The program's data loader is edited (as a user edits it) to take 0.3 s per batch, so the kill from outside
lands mid-run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cost_models.cluster import load_cluster
from executors.training.launch import free_port
from planner.api import plan_model_file
from planner.cli.main import main
from planner.plan import save_plan
from tests.conftest import EXAMPLES

pytestmark = [
    pytest.mark.slow,  # every test here launches processes
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the rank to kill in /proc"),
]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
RUN = ["--steps", str(STEPS), "--checkpoint-every", "2", "--timeout-s", "30"]
SLOW_LOADER = '''def make_dataloader(rank_info):
    """The stock synthetic batches, 0.3 s each (so a test can stop the run in the middle)."""
    for batch in runtime.synthetic_batches(PLAN, rank_info, model_file=MODEL_FILE):
        time.sleep(0.3)
        yield batch


def make_optimizer('''


def _env(**more: str) -> dict[str, str]:
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": python_path,
        "TORCHRUN": f"{sys.executable} -m torch.distributed.run",
        "PYTHON": sys.executable,  # launch.sh's --preflight
        **more,
    }


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    here = tmp_path_factory.mktemp("restart")
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    args = {"size": "tiny", "layers": 1, "vocab": 64, "seq": 8, "dropout": 0.1}
    plan = plan_model_file(EXAMPLES / "gpt.py", cluster, batch_size=8, method="data-parallel", model_args=args)
    save_plan(plan, here / "gpt.json")
    assert main(["compile", str(here / "gpt.json"), "--out", str(here / "program")]) == 0
    train = here / "program" / "train.py"
    text = train.read_text()
    loader = re.compile(r"def make_dataloader\(rank_info\):.*?\ndef make_optimizer\(", re.S)
    assert loader.search(text)
    train.write_text(loader.sub(lambda _: SLOW_LOADER, text).replace("import math\n", "import math\nimport time\n"))
    return here / "program"


@pytest.fixture(scope="module")
def reference(program: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The uninterrupted run's loss per step."""
    done = _launch(program, "--max-restarts", "0", checkpoints=tmp_path_factory.mktemp("straight"))
    assert done.returncode == 0, done.stderr[-3000:]
    losses = _losses(done.stdout)
    assert sorted(losses) == list(range(1, STEPS + 1)) and "resuming" not in done.stdout
    return {step: values[0] for step, values in losses.items()}


def _launch(program: Path, *launcher: str, checkpoints: Path, **env: str) -> subprocess.CompletedProcess:
    command = [str(program / "launch.sh"), *launcher, "--", *RUN, "--checkpoint-dir", str(checkpoints)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=_env(**env), cwd=program.parent)


def _losses(stdout: str) -> dict[int, list[float]]:
    """Every loss each step printed (a step run before and after a restart prints twice)."""
    losses: dict[int, list[float]] = {}
    for match in re.finditer(r"^step (\d+)  loss (\S+)", stdout, re.M):
        losses.setdefault(int(match.group(1)), []).append(float(match.group(2)))
    return losses


def _assert_same_losses(got: dict[int, list[float]], reference: dict[int, float]) -> None:
    assert sorted(got) == sorted(reference), got
    for step, values in got.items():
        for value in values:
            assert value == pytest.approx(reference[step], rel=1e-6, abs=1e-9), (step, values, reference[step])


def _rank_pid(agent: int, rank: int) -> int | None:
    """The pid of ``rank`` among the torchrun agent's worker processes (None: not started yet)."""
    for task in Path(f"/proc/{agent}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return int(child)
    return None


def test_a_rank_killed_mid_run_restarts_and_resumes_to_the_same_losses(
    program: Path, reference: dict[int, float], tmp_path: Path
) -> None:
    checkpoints = tmp_path / "checkpoints"
    command = [str(program / "launch.sh"), "--max-restarts", "1", "--", *RUN, "--checkpoint-dir", str(checkpoints)]
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr_file:
        agent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr_file, text=True, env=_env())
        lines, killed = [], None
        assert agent.stdout is not None
        for line in agent.stdout:  # launch.sh execs torchrun: agent.pid is the agent, the ranks are its children
            lines.append(line)
            if killed is None and line.startswith("step 3 "):
                killed = _rank_pid(agent.pid, rank=1)
                assert killed is not None
                os.kill(killed, signal.SIGKILL)
        agent.wait(timeout=600)
    stdout, stderr = "".join(lines), log.read_text()
    assert agent.returncode == 0, stderr[-3000:]
    assert f"exitcode: -9) local_rank: 1 (pid: {killed})" in stderr  # torchrun saw the rank die, and restarted
    resumed = re.search(r"^resuming from \S+step-(\d+) \(step (\d+) done\)", stdout, re.M)
    assert resumed is not None and int(resumed.group(1)) in (2, 4), stdout
    got = _losses(stdout)
    _assert_same_losses(got, reference)
    after = stdout[resumed.end() :]
    assert sorted(_losses(after)) == list(range(int(resumed.group(1)) + 1, STEPS + 1))  # no step skipped or repeated


def test_a_mistake_is_said_once_before_torchrun_starts(program: Path, tmp_path: Path) -> None:
    """launch.sh runs ``train.py --preflight`` first: a bad option or a refused edit of ``parallelize`` is one line and
    exit code 2 before torchrun starts, not one line per restart of ``--max-restarts 3``."""
    command = [str(program / "launch.sh"), "--max-restarts", "3", "--", "--steps", "0"]
    bad_option = subprocess.run(command, capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert bad_option.returncode == 2, bad_option.stderr[-2000:]
    assert bad_option.stderr.count("--steps must be at least 1") == 1 and "Traceback" not in bad_option.stderr
    assert "torch.distributed" not in bad_option.stderr + bad_option.stdout  # torchrun never started
    edited = tmp_path / "edited"
    shutil.copytree(program, edited)
    train = edited / "train.py"
    text = train.read_text()
    mesh = re.search(r"mesh=runtime\.mesh\(\[0, 1\], dp=2\)", text)
    assert mesh, "the data-parallel stage's mesh line"
    train.write_text(text.replace(mesh.group(0), "mesh=runtime.mesh([0, 1], tp=2)"))
    refused = subprocess.run(
        [str(edited / "launch.sh"), "--", "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=tmp_path,
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert refused.stderr.count("train.py line") == 1 and "torch.distributed" not in refused.stderr
    assert (
        subprocess.run(
            [sys.executable, str(program / "train.py"), "--preflight"],
            capture_output=True,
            text=True,
            timeout=300,
            env=_env(),
        ).returncode
        == 0
    )


def test_a_checkpoint_cut_short_is_never_loaded(program: Path, reference: dict[int, float], tmp_path: Path) -> None:
    killed = _launch(program, "--max-restarts", "0", checkpoints=tmp_path, AUTOPLAN_TEST_KILL_DURING_SAVE="4")
    assert killed.returncode != 0  # which rank torchrun reports first is a race: the files below tell what happened
    assert (tmp_path / "latest").read_text().strip() == "step-2"
    half = tmp_path / "step-4"
    assert any(half.glob("*.distcp")) and not (half / ".metadata").exists()  # a shard written, the save unfinished
    again = _launch(program, "--max-restarts", "0", checkpoints=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.search(r"^resuming from \S+step-2 \(step 2 done\)", again.stdout, re.M), again.stdout
    got = _losses(again.stdout)
    assert sorted(got) == list(range(3, STEPS + 1))
    _assert_same_losses({**_losses(killed.stdout), **got}, reference)
    assert (half / ".metadata").is_file() and (tmp_path / "latest").read_text().strip() == f"step-{STEPS}"


FAKE_SRUN = '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n'  # one task: this node
FAKE_SCONTROL = "#!/usr/bin/env bash\necho 127.0.0.1\n"  # `scontrol show hostnames`: the job's one node


def test_the_slurm_script_runs_under_srun_from_a_copy(
    program: Path, reference: dict[int, float], tmp_path: Path
) -> None:
    """Slurm runs a copy of the batch script: it finds the program by SLURM_SUBMIT_DIR, and srun's torchrun
    meets at the rendezvous on the job's first node (here a stand-in srun and scontrol on PATH)."""
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    copy = tmp_path / "spool" / "slurm_script"
    copy.parent.mkdir()
    shutil.copyfile(program / "train.sbatch", copy)
    slurm = {
        "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_ID": "4242",
        "SLURM_SUBMIT_DIR": str(program),
        "RDZV_PORT": str(free_port()),
    }
    command = ["bash", str(copy), "--max-restarts", "0", "--", *RUN, "--checkpoint-dir", str(tmp_path / "ck")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_env(**slurm), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same_losses(_losses(done.stdout), reference)


def test_the_multi_node_launch_script_meets_at_master_addr(tmp_path: Path) -> None:
    """A plan for two nodes of one process: launch.sh started twice (two "nodes" on loopback) with the same
    MASTER_ADDR meets at the c10d rendezvous and trains."""
    cluster = load_cluster("local-cpu", num_nodes=2, devices_per_node=1)
    plan = plan_model_file(
        EXAMPLES / "mlp.py", cluster, batch_size=8, method="data-parallel", model_args={"hidden": 16}
    )
    save_plan(plan, tmp_path / "two.json")
    assert main(["compile", str(tmp_path / "two.json"), "--out", str(tmp_path / "program")]) == 0
    nodes = _env(MASTER_ADDR="127.0.0.1", RDZV_PORT=str(free_port()), RDZV_ID="loopback")
    command = [str(tmp_path / "program" / "launch.sh"), "--max-restarts", "0", "--", "--steps", "2"]
    agents = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=nodes, cwd=tmp_path)
        for _ in range(2)
    ]
    outputs = [agent.communicate(timeout=600) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(err[-2000:] for _, err in outputs)
    assert sorted(_losses("".join(out for out, _ in outputs))) == [1, 2]
