"""A benchmark runner with a deadline: the GPU measurements of docs/performance.md
as stages run one after another within a time budget (a rented or shared GPU for a
few minutes), each bounded by the time left, each stage's result written as soon as
it ends, so a run cut short keeps what it finished.

Once, where pip reaches PyPI (downloads the wheels a bare GPU machine lacks: Hydra,
OmegaConf, antlr4; copies the char data):

    python scripts/gpu_session.py --prepare

On the GPU machine (the wheels in `.whl`, the data in `.gpu_cache`):

    python3 scripts/gpu_session.py --out OUT --deadline 560
    python3 scripts/gpu_session.py --out OUT --deadline 250 --stages gemm,delayed

A stage starts only if the time left is at least its `min_s`, and is killed at the
deadline (the bench writes each row as it is measured, so a stage cut short keeps its
finished rows). What comes back under `--out`: `summary.md` (each stage's exit
status, time and table), `session.log` (everything printed) and
`gpu_session.tar.gz` (each stage's files: bench.json, bench.png, HLO, logs). The
last line names the stages not run, to pass as `--stages` to the next call. The
stages, in order (`--list` prints them with their time estimates on an H100):

- `env`: the GPU, the driver, JAX and the libraries' versions;
- `small_bf16`: gpt_small in bf16 at batch 32 (layers unrolled, the lean
  cross-entropy, cuBLAS GEMMs: the defaults): MFU and lowtrain / hand;
- `profile_bf16`: `scripts/profile_step.py` on gpt_small's bf16 step, its device
  ops by name (where the MFU goes);
- `launch`: `bench.py launch`, the first and second launch's compile of gpt_small
  in bf16 and fp8 (the persistent compilation cache);
- `big_1b`, `big_4k`: gpt_1b and gpt_4k in bf16, fp8 and unit_fp8 (FP8 against
  bf16 where the GEMMs are large);
- `small_fp8`: gpt_small in fp8 and unit_fp8 (their optimized HLO kept);
  `small_fp8_triton`: fp8 with XLA's Triton GEMMs, against it;
- `gemm`: `bench.py gemm`, one linear layer's GEMMs in bf16 and FP8 by width (the
  break-even width);
- `delayed`: fp8_delayed at gpt_small and gpt_1b (HLO kept: does any pass read a
  tensor only for its amax);
- `small_scanned`: gpt_small bf16 with its layers under `lax.scan`, against
  `small_bf16`;
- `gpu_tests`: `pytest -m gpu`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tarfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"  # hydra-core, omegaconf, antlr4: not on the GPU machine
CACHE = ROOT / ".gpu_cache"  # LOWTRAIN_CACHE there: the char data (no network)
# Pure-Python wheels, the versions the dev environment runs; antlr4's 4.9.3 (the one
# omegaconf 2.3 takes) is a source distribution only, so it is built into a wheel.
DOWNLOADED = ["hydra-core==1.3.8", "omegaconf==2.3.1"]
BUILT = ["antlr4-python3-runtime==4.9.3"]
RESERVE_S = 15  # left at the deadline for the summary and the archive
# The first call's stages, and its `timeout_s` above them for the wheels' install,
# the process's start and the transfer back.
DEADLINE_S, TIMEOUT_S = 560, 590


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    argv: tuple[str, ...]  # run in the repository root; {work} is the stage's folder
    min_s: int  # not started with less time left than this
    estimate_s: int  # the stage's time on an H100 where measured; else a guess
    what: str


def _bench(*args: str) -> tuple[str, ...]:
    return ("python3", "scripts/bench.py", "--steps", "20", "--out", "{work}", *args)


def _models(models: str, precisions: str, *extra: str) -> tuple[str, ...]:
    return _bench("--models", models, "--precisions", precisions, *extra)


STAGES = [
    Stage(
        "env",
        ("python3", "scripts/gpu_session.py", "--env"),
        5,
        5,
        "the GPU, the driver, JAX and the libraries",
    ),
    Stage(
        "small_bf16",
        _models("gpt_small", "bf16"),
        30,
        40,
        "gpt_small bf16 at batch 32, lean cross-entropy: MFU (40%), lowtrain / hand",
    ),
    Stage(
        "profile_bf16",
        (
            *("python3", "scripts/profile_step.py", "--model", "gpt_small"),
            # The trace stays on the machine: the ops' table is what comes back.
            *("--precision", "bf16", "--top", "30", "--out", "/tmp/profile_bf16"),
        ),
        60,
        70,
        "where gpt_small's bf16 step spends its time (the MFU target)",
    ),
    Stage(
        "launch",
        (
            *("python3", "scripts/bench.py", "launch", "--model", "gpt_small"),
            *("--precisions", "bf16,fp8", "--out", "{work}"),
        ),
        30,
        60,
        "first and second launch's compile, bf16 and fp8 gpt_small (15 s; 3x bf16)",
    ),
    Stage(
        "big_1b",
        _models("gpt_1b", "bf16,fp8,unit_fp8"),
        90,
        200,
        "gpt_1b (width 2048): best FP8 / bf16 (1.25x), bf16 MFU (50%)",
    ),
    Stage(
        "big_4k",
        _models("gpt_4k", "bf16,fp8,unit_fp8"),
        90,
        150,
        "gpt_4k (width 4096): best FP8 / bf16 (1.35x), unit_fp8's FP8 GEMMs",
    ),
    Stage(
        "small_fp8",
        _models("gpt_small", "fp8,unit_fp8", "--hand", "no", "--save-hlo", "{work}"),
        60,
        120,
        "gpt_small: best FP8 / bf16 (1.05x), unit_fp8's FP8 GEMMs",
    ),
    Stage(
        "small_fp8_triton",
        _models("gpt_small", "fp8", "--hand", "no", "--triton-gemm", "on"),
        60,
        150,
        "gpt_small fp8 with XLA's Triton GEMMs (its default) against small_fp8's row",
    ),
    Stage(
        "gemm",
        ("python3", "scripts/bench.py", "gemm", "--out", "{work}"),
        30,
        40,
        "one linear layer's GEMMs in bf16 and FP8 by width: FP8's break-even",
    ),
    Stage(
        "delayed",
        _models(
            *("gpt_small,gpt_1b", "fp8_delayed", "--hand", "no"),
            *("--save-hlo", "{work}"),
        ),
        60,
        150,
        "fp8_delayed at gpt_small and gpt_1b",
    ),
    Stage(
        "small_scanned",
        _models("gpt_small", "bf16", "--hand", "no", "--set", "model.scan_layers=true"),
        30,
        40,
        "gpt_small bf16 with its layers under lax.scan, against small_bf16's row",
    ),
    Stage(
        "gpu_tests",
        ("python3", "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"),
        40,
        45,
        "pytest -m gpu",
    ),
]
BY_NAME = {stage.name: stage for stage in STAGES}


def prepare() -> None:
    """Here: the wheels into `.whl`, the char data into `.gpu_cache`, both ignored by
    git; then print the `run` call."""
    py = sys.executable
    WHEELS.mkdir(exist_ok=True)
    pip = [py, "-m", "pip", "-q"]
    subprocess.run(
        [
            *(*pip, "download", "--no-deps", "--only-binary=:all:"),
            *("--python-version", "3.12", "--implementation", "cp"),
            *("--platform", "manylinux2014_x86_64", "-d", str(WHEELS), *DOWNLOADED),
        ],
        check=True,
    )
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(WHEELS), *BUILT], check=True)
    sys.path.insert(0, str(ROOT))
    from lowtrain.recipes.internal import shakespeare  # fetched once, then cached

    CACHE.mkdir(exist_ok=True)
    (CACHE / "shakespeare.txt").write_text(shakespeare(), encoding="utf-8")
    exclude = ROOT / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    known = exclude.read_text().splitlines() if exclude.is_file() else []
    with exclude.open("a") as f:
        for line in ("/.whl/", "/.gpu_cache/"):
            if line not in known:
                f.write(line + "\n")
    print(
        "Prepared .whl and .gpu_cache. The device call:\n"
        f'  run(command="python3 scripts/gpu_session.py --out $OUT --deadline '
        f'{DEADLINE_S}",\n      carry=[".whl", ".gpu_cache"], timeout_s={TIMEOUT_S})'
    )


def install_wheels() -> str | None:
    """There: the carried wheels into /tmp/site, if Hydra is missing (a warm
    machine's earlier install replaced whole); the folder for PYTHONPATH."""
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels or importlib.util.find_spec("hydra") is not None:
        return None
    site = "/tmp/site"
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "-q", "--no-index", "--upgrade"),
            *("--no-deps", "--no-compile", "--target", site, *map(str, wheels)),
        ],
        check=True,
    )
    return site


def environment() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT)]
    if site := install_wheels():
        paths.append(site)
    env["PYTHONPATH"] = os.pathsep.join(
        [*paths, *filter(None, [env.get("PYTHONPATH")])]
    )
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    # JAX's persistent cache, XLA's GEMM autotuning results with it: a GEMM shape
    # tuned in one stage's process is not tuned again in the next one's.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/gpu_session_jax_cache")
    if (CACHE / "shakespeare.txt").is_file():
        env.setdefault("LOWTRAIN_CACHE", str(CACHE))
    return env


def report_environment() -> None:
    """The `env` stage: what the numbers were measured on."""
    smi = shutil.which("nvidia-smi")
    if smi:
        query = "--query-gpu=name,driver_version,memory.total,clocks.max.sm"
        subprocess.run([smi, query, "--format=csv"], check=False)
    import jax

    print(f"python {sys.version.split()[0]}, jax {jax.__version__}")
    print("devices:", jax.devices())
    for name in (
        "jaxlib",
        "equinox",
        "optax",
        "hydra",
        "omegaconf",
        "orbax.checkpoint",
    ):
        try:
            module = __import__(name, fromlist=["__version__"])
            print(f"{name} {getattr(module, '__version__', '?')}")
        except ImportError as e:
            print(f"{name}: not importable ({e})")


def _result(work: pathlib.Path, output: str) -> str:
    """The part of a finished stage that goes into summary.md: its bench table, else
    the end of what it printed."""
    for name in ("bench.md", "launch.md", "gemm.md"):
        if (work / name).is_file():
            return (work / name).read_text()
    lines = output.strip().splitlines()
    return "```\n" + "\n".join(lines[-40:]) + "\n```"


def _run_stage(argv: list[str], env: dict[str, str], log, timeout: float) -> int | None:
    """Run one stage, its output appended to `log`; its process group killed at the
    timeout (the bench's child processes with it). Its exit status; None if killed."""
    child = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        return child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return None


def run_stages(
    stages: list[Stage],
    out: pathlib.Path,
    deadline: float,
    work_root: pathlib.Path = pathlib.Path("/tmp/gpu_session"),
) -> tuple[list[str], list[str]]:
    """Each stage in order while time is left, in `work_root/<stage>`: `(not run or
    cut short, failed)`."""
    start = time.monotonic()
    env = environment()
    work_root.mkdir(parents=True, exist_ok=True)
    summary, log_path = out / "summary.md", out / "session.log"
    not_run, failed = [], []
    for stage in stages:
        left = deadline - (time.monotonic() - start) - RESERVE_S
        if left < stage.min_s:
            not_run.append(stage.name)
            with summary.open("a") as f:
                f.write(f"\n## {stage.name}: not run ({left:.0f} s left)\n")
            continue
        work = work_root / stage.name
        work.mkdir(exist_ok=True)
        argv = [a.replace("{work}", str(work)) for a in stage.argv]
        argv[0] = sys.executable if argv[0] == "python3" else argv[0]
        header = f"\n===== {stage.name}: {' '.join(argv)} ({left:.0f} s left)\n"
        print(header, flush=True)
        with log_path.open("a") as log:  # written as it runs: a killed call keeps it
            log.write(header)
            log.flush()
            begin = log.tell()
            t0 = time.monotonic()
            code = _run_stage(argv, env, log, left)
            wall = time.monotonic() - t0
        with log_path.open(errors="replace") as log:
            log.seek(begin)
            output = log.read()
        if code is None:
            status = f"killed at the deadline after {left:.0f} s"
            not_run.append(stage.name)  # what it finished is in its table
        else:
            status = f"exit {code}"
            if code != 0:
                failed.append(stage.name)
        with summary.open("a") as f:
            f.write(f"\n## {stage.name}: {status}, {wall:.0f} s ({stage.what})\n\n")
            f.write(_result(work, output) + "\n")
        print(f"{stage.name}: {status}, {wall:.0f} s", flush=True)
    with tarfile.open(out / "gpu_session.tar.gz", "w:gz") as tar:
        tar.add(work_root, arcname="gpu_session")
    return not_run, failed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, help="where the results go")
    parser.add_argument(
        "--deadline", type=float, default=DEADLINE_S, help="seconds for all stages"
    )
    parser.add_argument(
        "--stages",
        default=",".join(s.name for s in STAGES),
        help="comma-separated, run in the order of --list",
    )
    parser.add_argument("--prepare", action="store_true", help="here, before the run")
    parser.add_argument("--list", action="store_true", help="the stages, estimates")
    parser.add_argument("--env", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prepare:
        return prepare()
    if args.env:
        return report_environment()
    if args.list:
        for s in STAGES:
            print(f"{s.name:<15} ~{s.estimate_s:>4} s (min {s.min_s:>3} s)  {s.what}")
        return
    chosen = args.stages.split(",")
    if unknown := [name for name in chosen if name not in BY_NAME]:
        parser.error(f"Expected --stages from {list(BY_NAME)}, got {unknown}.")
    if args.out is None:
        parser.error("Expected --out DIR (on the device machine: --out $OUT).")
    if args.deadline <= RESERVE_S:
        parser.error(f"Expected --deadline above {RESERVE_S} s, got {args.deadline}.")
    if importlib.util.find_spec("hydra") is None and not any(WHEELS.glob("*.whl")):
        parser.error(
            f"Expected Hydra importable or its wheels in {WHEELS}, found neither: run "
            "`python scripts/gpu_session.py --prepare` where pip reaches PyPI, and "
            'carry ".whl" in the device call.'
        )
    args.out.mkdir(parents=True, exist_ok=True)
    stages = [s for s in STAGES if s.name in chosen]
    not_run, failed = run_stages(stages, args.out, args.deadline)
    print((args.out / "summary.md").read_text())  # also in the call's output tail
    if not_run:
        print(f"Not run or cut short: --stages {','.join(not_run)}")
    if failed:
        sys.exit(f"Failed (see summary.md): {', '.join(failed)}")
    print("Done." if not not_run else "Done, but for those.")


if __name__ == "__main__":
    main()
