"""scripts/gpu_session.py: the GPU measurements as one call within a deadline. The
orchestration runs here on fake stages; the real stages' commands are checked
against the scripts they call (a typo would cost a GPU session). Slow: tests of a
tool (`pytest -m slow`)."""

import pathlib
import sys
import tarfile
import time

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def session(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_session

    return gpu_session


def _alive(pid: int, wait_s: float = 5.0) -> bool:
    """Whether `pid` still runs after `wait_s` (a SIGKILL is delivered, not waited
    for; a zombie waiting for its reaper does not run)."""
    status = pathlib.Path(f"/proc/{pid}/status")
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            if "State:\tZ" in status.read_text():
                return False
        except FileNotFoundError:
            return False
        time.sleep(0.05)
    return True


def test_stages_run_in_order_within_the_deadline(session, tmp_path):
    Stage = session.Stage
    pid_file = tmp_path / "grandchild.pid"
    # A stage whose own child outlives it unless the process group is killed.
    spawn = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    stages = [
        Stage("ok", ("python3", "-c", "print('hello from ok')"), 1, 1, "prints"),
        Stage("fails", ("python3", "-c", "import sys; sys.exit(3)"), 1, 1, "exits 3"),
        Stage("slow", ("python3", "-c", spawn), 1, 60, "outlives the deadline"),
        Stage("late", ("python3", "-c", "pass"), 1000, 1000, "needs more time"),
    ]
    out = tmp_path / "out"
    out.mkdir()
    deadline = session.RESERVE_S + 8
    t0 = time.monotonic()
    not_run, failed = session.run_stages(stages, out, deadline, tmp_path / "work")
    assert time.monotonic() - t0 < deadline  # the reserve is left for the archive
    assert not_run == ["slow", "late"] and failed == ["fails"]
    summary = (out / "summary.md").read_text()
    assert "## ok: exit 0" in summary and "hello from ok" in summary
    assert "## fails: exit 3" in summary
    assert "## slow: killed at the deadline" in summary
    assert "## late: not run" in summary
    assert "hello from ok" in (out / "session.log").read_text()
    # The stage's whole process group went at the deadline, its child too.
    assert not _alive(int(pid_file.read_text()))
    with tarfile.open(out / "gpu_session.tar.gz") as tar:
        names = tar.getnames()
    assert "gpu_session/ok" in names and "gpu_session/slow" in names


def test_a_stage_with_a_bench_table_reports_it(session, tmp_path):
    write = "import pathlib, sys; pathlib.Path(sys.argv[1], 'bench.md').write_text('T')"
    stage = session.Stage("b", ("python3", "-c", write, "{work}"), 1, 1, "a table")
    out = tmp_path / "out"
    out.mkdir()
    session.run_stages([stage], out, 60, tmp_path / "work")
    assert "## b: exit 0" in (out / "summary.md").read_text()
    assert (out / "summary.md").read_text().rstrip().endswith("T")


def test_the_real_stages_call_what_exists(session, monkeypatch):
    # Each bench stage's arguments parse as bench.py parses them (precision names,
    # overrides), twin_hlo's name precisions with a twin, the recipes exist.
    import bench
    from benchlib import throughput

    stages = session.BY_NAME
    # Priority order: bf16's MFU and where its time goes, launch time, the big models.
    assert list(stages)[:5] == ["env", "small_bf16", "profile_bf16", "launch", "big_1b"]
    for stage in session.STAGES:
        argv = [a.replace("{work}", "/tmp/x") for a in stage.argv]
        assert argv[0] == "python3"
        if argv[1] == "scripts/bench.py" and argv[2] in bench.COMMANDS:
            with pytest.raises(SystemExit) as done:  # its parser knows the options
                bench.COMMANDS[argv[2]].main([*argv[3:], "--help"])
            assert done.value.code == 0
        elif argv[1] == "scripts/bench.py":
            args = bench.parse_args(argv[2:])
            assert args.steps >= 20
        elif argv[1] == "scripts/profile_step.py":  # its CLI's choices
            model = argv[argv.index("--model") + 1]
            precision = argv[argv.index("--precision") + 1]
            assert model in throughput.SIZES and precision in throughput.RECIPES
        else:
            assert argv[1:3] in (["scripts/gpu_session.py", "--env"], ["-m", "pytest"])
    big = bench.parse_args(stages["big_1b"].argv[2:])
    assert big.models == ["gpt_1b"] and big.precisions == ["bf16", "fp8", "unit_fp8"]
    assert big.triton_gemm == "off"  # the CLI's default
    launch = stages["launch"].argv
    assert launch[2] == "launch" and "bf16,fp8" in launch
    triton = bench.parse_args(stages["small_fp8_triton"].argv[2:])
    assert triton.triton_gemm == "on" and triton.precisions == ["fp8"]
    fp8 = bench.parse_args(stages["small_fp8"].argv[2:])
    assert fp8.hand == "no" and fp8.save_hlo == "{work}"
    assert stages["gemm"].argv[2] in bench.COMMANDS
    scanned = bench.parse_args(stages["small_scanned"].argv[2:])
    assert scanned.set == ["model.scan_layers=true"]


def test_bad_arguments_say_what_was_expected(session, tmp_path, capsys):
    with pytest.raises(SystemExit):
        session.main(["--out", str(tmp_path), "--stages", "env,nope"])
    assert "Expected --stages from" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        session.main(["--stages", "env"])
    assert "Expected --out DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        session.main(["--out", str(tmp_path), "--deadline", "3"])
    assert "Expected --deadline above" in capsys.readouterr().err


def test_without_hydra_or_its_wheels_it_says_to_prepare(session, tmp_path, capsys):
    # The GPU machine has no Hydra: without the carried wheels, no stage could run.
    import importlib.util

    real = importlib.util.find_spec
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(session, "WHEELS", tmp_path / "no_wheels")
        patch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a: None if name == "hydra" else real(name, *a),
        )
        with pytest.raises(SystemExit):
            session.main(["--out", str(tmp_path / "out"), "--stages", "env"])
    assert "gpu_session.py --prepare" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing started


def test_env_stage_names_the_versions(session, capsys):
    import jax

    session.report_environment()
    printed = capsys.readouterr().out
    assert f"jax {jax.__version__}" in printed and "equinox" in printed
    assert sys.version.split()[0] in printed


def test_gpu_recipe_lines_are_tabled_against_fp32(session, tmp_path):
    # recipe_results --task gpt_gpu: fp32's val loss reported (no target: another
    # corpus than nanoGPT's), fp8 held to the char-GPT's 0.05 nats of fp32.
    import json

    import recipe_results

    def summary(precision, val_loss):
        folder = tmp_path / f"gpt_gpu_{precision}"
        folder.mkdir()
        record = {
            "final": {"val_loss": val_loss},
            "skipped_steps": 0,
            "final_loss_scale": 1.0,
            "seconds": 90.0,
        }
        (folder / "summary.json").write_text(json.dumps(record))

    summary("fp32", 1.2)
    summary("bf16", 1.21)
    summary("fp8", 1.3)
    lines = recipe_results.table(tmp_path, ["gpt_gpu"]).splitlines()[2:]
    assert [line.split(" | ")[1:5] for line in lines] == [
        ["fp32", "1.2000", "", "reported"],
        ["bf16", "1.2100", "+0.0100", "reported"],
        ["fp8", "1.3000", "+0.1000", "within 0.05: MISSED"],
    ]
    assert "`recipe=gpt_gpu_fp8`" in lines[2]
    assert ("gpt_gpu", "fp8_naive") not in recipe_results.RUNS
