"""The ``plan`` command: the happy path, and every bad input as one line, exit 2, no file."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from planner.cli.main import main
from tests.conftest import EXAMPLES, ROOT

MLP = str(EXAMPLES / "mlp.py")
SMALL = ["--model-arg", "hidden=64", "--model-arg", "layers=2"]


def run(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plan_writes_json_and_prints_summary(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    code, stdout, _ = run([MLP, "--cluster", "dgx-a100", "--batch-size", "16", *SMALL, "--out", str(out)], capsys)
    assert code == 0
    assert "estimate: step" in stdout and f"wrote {out}" in stdout
    data = json.loads(out.read_text())
    assert data["method"] == "auto" and data["batch_size"] == 16
    assert sorted(device for stage in data["stages"] for device in stage["devices"]) == list(range(8))
    assert data["model"]["args"] == {"hidden": 64, "layers": 2}


def test_every_plan_option_is_a_search_option_with_the_same_default() -> None:
    from planner.cli.main import _plan_parser
    from planner.cli.options import available_cores, plan_options
    from planner.options import PlanOptions

    parsed = _plan_parser().parse_args([MLP, "--cluster", "dgx-a100", "--batch-size", "16"])
    # but --jobs: the command uses the machine's cores, the library one process (a library call forks only when asked)
    assert plan_options(parsed) == PlanOptions(jobs=available_cores())
    parsed = _plan_parser().parse_args([MLP, "--cluster", "dgx-a100", "--batch-size", "16", "--ilp-time-limit", "5"])
    assert plan_options(parsed, method="megatron").ilp_time_limit_s == 5.0


def test_json_flag_prints_the_plan(tmp_path: Path, capsys) -> None:
    out = tmp_path / "p.json"
    code, stdout, _ = run(
        [MLP, "--cluster", "p3.16xlarge", "--nodes", "2", "--batch-size", "32", *SMALL, "--out", str(out), "--json"],
        capsys,
    )
    assert code == 0
    printed = json.loads(stdout)
    assert printed == json.loads(out.read_text())
    assert printed["cluster"]["num_nodes"] == 2
    assert sorted(device for stage in printed["stages"] for device in stage["devices"]) == list(range(16))


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


BAD_CASES = {
    "missing file": (
        lambda t: ["nowhere.py", "--cluster", "local-cpu", "--batch-size", "2"],
        "nowhere.py does not exist",
    ),
    "python error": (
        lambda t: [write(t, "broken.py", "import torch\nx = 1 / 0\n"), "--cluster", "local-cpu", "--batch-size", "2"],
        r"failed to import: ZeroDivisionError: division by zero \(line 2\)",
    ),
    "syntax error": (
        lambda t: [write(t, "syntax.py", "def build_model(:\n"), "--cluster", "local-cpu", "--batch-size", "2"],
        r"failed to import: SyntaxError",
    ),
    "no build_model": (
        lambda t: [write(t, "empty.py", "X = 1\n"), "--cluster", "local-cpu", "--batch-size", "2"],
        "has no build_model or example_inputs function",
    ),
    "uncapturable": (
        lambda t: [
            write(
                t,
                "branchy.py",
                "import torch\n"
                "class M(torch.nn.Module):\n"
                "    def forward(self, x):\n"
                "        return x if x.sum().item() > 0 else -x\n"
                "def build_model():\n    return M()\n"
                "def example_inputs(batch_size):\n    return (torch.randn(batch_size, 4),)\n",
            ),
            "--cluster",
            "local-cpu",
            "--batch-size",
            "2",
        ],
        "could not capture the model",
    ),
    "unknown preset": (lambda t: [MLP, "--cluster", "tpu-v9", "--batch-size", "2"], "unknown cluster preset 'tpu-v9'"),
    "malformed cluster": (
        lambda t: [MLP, "--cluster", write(t, "c.toml", "num_nodes = [\n"), "--batch-size", "2"],
        "is not valid toml",
    ),
    "cluster field": (
        lambda t: [MLP, "--cluster", write(t, "c.json", json.dumps({"num_nodes": 1})), "--batch-size", "2"],
        r"missing section \[device\]",
    ),
    "batch split": (
        lambda t: [MLP, "--cluster", "dgx-a100", "--batch-size", "12", *SMALL, "--method", "data-parallel"],
        "batch size 12 cannot be split evenly over 8",
    ),
    "zero batch": (
        lambda t: [MLP, "--cluster", "dgx-a100", "--batch-size", "0", *SMALL],
        "--batch-size must be a positive",
    ),
    "zero nodes": (
        lambda t: [MLP, "--cluster", "dgx-a100", "--nodes", "0", "--batch-size", "8"],
        "--nodes must be a positive",
    ),
    "negative devices": (
        lambda t: [MLP, "--cluster", "dgx-a100", "--devices-per-node", "-2", "--batch-size", "8"],
        "--devices-per-node must be a positive",
    ),
    "bad model arg": (
        lambda t: [MLP, "--cluster", "dgx-a100", "--batch-size", "8", "--model-arg", "hidden"],
        "must look like key=value",
    ),
    "unknown kwarg": (
        lambda t: [MLP, "--cluster", "dgx-a100", "--batch-size", "8", "--model-arg", "colour=red"],
        r"--model-arg colour is not a parameter of build_model or example_inputs in .*mlp.py "
        r"\(they take: hidden, in_features, layers, out_features\)",
    ),
    "unknown method": (
        lambda t: [MLP, "--cluster", "dgx-a100", "--batch-size", "8", "--method", "magic"],
        "invalid choice: 'magic'",
    ),
    "unknown runtime": (
        lambda t: [MLP, "--cluster", "dgx-a100", "--batch-size", "8", "--runtime", "megatron-lm-2030"],
        r"--runtime: invalid choice: 'megatron-lm-2030' \(choose from 'autoplan', 'megatron-lm-2019'",
    ),
    "does not fit": (
        lambda t: [
            str(EXAMPLES / "gpt.py"),
            "--cluster",
            "p3.16xlarge",
            "--batch-size",
            "8",
            "--model-arg",
            "size=39b",
        ],
        # the state alone exceeds every device: only more devices help, and the message says how many
        r"alone need 73.6 GiB per device even split over all 8 devices, the budget is 13.7 GiB .*at least 43 devices",
    ),
    "does not fit (the batch)": (
        lambda t: [
            str(EXAMPLES / "gpt.py"),
            "--cluster",
            "p3.16xlarge",
            "--batch-size",
            "8192",
            "--model-arg",
            "size=2.6b",
        ],
        # 16 less 2.3; the state fits, the activations do not: a smaller batch or more devices, by the estimate (each
        # device holds its own rows of the logits, planner.plan.stage.loss_row_axes, so more replicas shrink them)
        r"does not fit in 13.7 GiB per device with any pipeline, sharding or recomputation: the smallest "
        r"data-parallel, Megatron or uniform-pipeline plan \(a [\w-]+ plan\) needs [\d.]+ GiB \(state [\d.]+ GiB \+ "
        r"activations [\d.]+ GiB\) .*: by its estimate it fits with --batch-size \d+ or less or about \d+ devices$",
    ),
    "does not fit (data parallel)": (
        lambda t: [
            str(EXAMPLES / "gpt.py"),
            "--cluster",
            "p3.16xlarge",
            "--batch-size",
            "8",
            "--model-arg",
            "size=2.6b",
            "--method",
            "data-parallel",
            "--zero",
            "0",
        ],
        r"does not fit: the smallest data-parallel plan with no ZeRO needs [\d.]+ GiB per device \(state [\d.]+ GiB "
        r"\+ activations [\d.]+ GiB(, [^)]*)?\), the budget is 13.7 GiB \(16.0 GiB less 2.3 GiB reserved for CUDA "
        r"context, NCCL buffers and allocator fragmentation\): by its estimate it fits with --zero \d "
        r"\(about [\d.]+ GiB\)$",
    ),
    "does not fit (megatron degrees)": (
        lambda t: [
            str(EXAMPLES / "gpt.py"),
            *("--cluster", "p3.16xlarge", "--batch-size", "8", "--model-arg", "size=2.6b"),
            *("--method", "megatron", "--degrees", "1,1,8", "--zero", "0"),
        ],
        # the state alone is three budgets: nothing this configuration can do fits (each device runs the loss on its
        # own rows of the logits, planner.plan.stage.loss_row_axes: no "whole on each device" clause)
        r"the smallest megatron plan with --degrees 1,1,8, no ZeRO needs [\d.]+ GiB per device \(state 41.5 GiB \+ "
        r"activations [\d.]+ GiB\), .*: no smaller batch, higher ZeRO level or more replicas fits this method's plans: "
        r"try other --degrees or --method auto$",
    ),
    "cannot be laid out (megatron)": (
        lambda t: [
            str(EXAMPLES / "gpt.py"),
            *("--cluster", "p3.16xlarge", "--batch-size", "32", "--method", "megatron", "--degrees", "2,4,1"),
            *("--schedule", "interleaved", "--microbatches", "8"),
        ],
        # the tiny GPT has too few layers for 4 stages x 2 virtual stages: memory is not the reason, so no "fits"
        r"cannot make a megatron plan with --degrees 2,4,1, 8 microbatches, schedule interleaved: by the layer-table "
        r"estimate its smallest configuration needs [\d.]+ GiB per device, within the budget of 13.7 GiB, but the "
        r"configurations priced exactly could not be laid out on this model",
    ),
    "does not fit (megatron state)": (
        lambda t: [
            str(EXAMPLES / "gpt.py"),
            *("--cluster", "p3.16xlarge", "--batch-size", "8", "--model-arg", "size=39b", "--method", "megatron"),
        ],
        # the hand-written methods say it too: the state alone exceeds every device, and how many would hold it
        r"alone need 73.6 GiB per device even split over all 8 devices, .*no batch, recomputation or ZeRO level "
        r"changes that; use at least 43 devices at this budget$",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_is_one_line_exit_2_no_file(case: str, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    make_args, pattern = BAD_CASES[case]
    args = make_args(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(args))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    lines = [line for line in err.splitlines() if not line.startswith("plan: warning:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    import re

    assert re.search(pattern, lines[0]), lines[0]
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.slow
def test_console_script_runs_without_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "planner", "nowhere.py", "--cluster", "local-cpu", "--batch-size", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "plan: error: model file nowhere.py does not exist"


def test_help_lists_subcommands(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "plan profile" in out and "plan calibrate" in out and "--cluster" in out


def test_profile_prints_a_table(capsys) -> None:
    code, stdout, _ = run(["profile", str(EXAMPLES / "gpt.py"), "--batch-size", "2", "--measure", "no"], capsys)
    assert code == 0
    assert "scaled_dot_product_attention" in stdout and "total" in stdout


def test_profile_json_measures_locally(capsys) -> None:
    code, stdout, _ = run(
        ["profile", MLP, "--batch-size", "4", *SMALL, "--json", "--repeats", "2", "--no-compressors"], capsys
    )
    assert code == 0
    rows = json.loads(stdout)
    linear = [r for r in rows if r["kind"] == "matmul"]
    assert linear and all(r["measured"] and r["fwd_s"] > 0 and r["bwd_s"] > 0 for r in linear)


def test_max_stages_one_explain_prints_each_node(tmp_path: Path, capsys) -> None:
    out = tmp_path / "p.json"
    args = [MLP, "--cluster", "dgx-a100", "--batch-size", "8", "--model-arg", "hidden=4096", "--model-arg", "layers=2"]
    code, stdout, _ = run(
        [*args, "--max-stages", "1", "--memory-fraction", "0.005", "--explain", "--out", str(out)], capsys
    )
    assert code == 0
    assert "split per mesh axis" in stdout and "linear_1" in stdout and "total" in stdout
    stage = json.loads(out.read_text())["stages"][0]
    assert stage["param_placements"]["blocks.0.fc1.weight"] != ["R"] * len(stage["mesh_shape"])
    assert {row["node"] for row in stage["explanation"]} == set(stage["strategies"])


def test_the_command_leaves_the_warning_handler_as_it_found_it(tmp_path: Path) -> None:
    before = warnings.showwarning
    assert main(["show", str(tmp_path / "missing.json")]) == 2
    assert warnings.showwarning is before


def test_a_warning_is_one_line_of_ours_shown_once(capsys: pytest.CaptureFixture) -> None:
    from planner.cli.options import one_line_warnings
    from planner.errors import AutoplanWarning, warn

    with one_line_warnings():
        warn("no sharding rule for aten.x: it is replicated")
        warn("no sharding rule for aten.x: it is replicated")  # a second stage problem: not repeated
        warn("could not run aten.y on meta tensors")
    assert capsys.readouterr().err == (
        "plan: warning: no sharding rule for aten.x: it is replicated\n"
        "plan: warning: could not run aten.y on meta tensors\n"
    )
    with pytest.warns(AutoplanWarning) as caught:  # from Python: our category, pointing at no line of autoplan
        warn("ignoring unreadable profile cache")
    assert caught[0].filename == "autoplan" and caught[0].category is AutoplanWarning


def test_a_warning_from_python_is_shown_once_under_the_default_filters() -> None:
    from planner.errors import AutoplanWarning, warn

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own action for a UserWarning: once per place
        warn("capture fell back to fx")
        warn("capture fell back to fx")
        warn("another message")
    assert [str(w.message) for w in caught] == ["capture fell back to fx", "another message"]
    assert all(w.category is AutoplanWarning for w in caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the user's filter wins: no filter of ours overrides it
        warn("capture fell back to fx")
        warn("capture fell back to fx")
    assert len(caught) == 2
