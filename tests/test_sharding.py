"""`Trainer(sharding="fsdp")`: the state split over 8 CPU devices trains as the
replicated one does, in every precision; `array_spec`; `amp` keeps inner jits'
shardings."""

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lowtrain
from lowtrain.train import array_spec

from .helpers import SGD, Regression, eqns_of, make_model

ROOT = pathlib.Path(__file__).parent.parent
EIGHT = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
}

MLP_CHILD = """
import json, sys
import jax, numpy as np
sys.path.insert(0, ".")
from tests.helpers import SGD, Mse, batch_of, make_model

assert len(jax.devices()) == 8
# Tensor parallelism of the MLP: the hidden layer's units split over "tensor".
NAMES = {r"layers\\.0\\.weight$": ("mlp", "embed"), r"layers\\.0\\.bias$": ("mlp",),
         r"layers\\.1\\.weight$": ("embed", "mlp")}
out = {}
for name, options in [("replicated", {}), ("fsdp", {"sharding": "fsdp"}),
                      ("fsdp_accum", {"sharding": "fsdp", "grad_accum": 2}),
                      ("tp", {"mesh": {"data": 4, "tensor": 2}, "axis_names": NAMES}),
                      ("fsdp_tp", {"mesh": {"fsdp": -1, "tensor": 2},
                                   "axis_names": NAMES, "grad_accum": 2})]:
    trainer = Mse(make_model(512), SGD(1e-2), **options)
    state = trainer.init(key=jax.random.key(1))
    specs = [str(x.sharding.spec) for x in jax.tree.leaves(state.model)
             if isinstance(x, jax.Array)]
    losses = []
    for step in range(3):
        state, m = trainer.compiled_step(trainer.shard_batch(batch_of(32, step)), state)
        losses.append(float(m["loss"]))
    leaves = [x for x in jax.tree.leaves((state.model, state.opt_state))
              if isinstance(x, jax.Array)]
    out[name] = {
        "losses": losses, "specs": specs,
        "after": [str(x.sharding.spec) for x in jax.tree.leaves(state.model)
                  if isinstance(x, jax.Array)],
        "leaves": [np.asarray(x, np.float32).ravel().tolist() for x in leaves],
    }
errors = []
for options in [{"mesh": {"fsdp": 8}, "sharding": "replicated"},
                {"mesh": {"data": 4, "tensor": 2}}]:
    try:
        Mse(make_model(512), SGD(1e-2), **options)
    except ValueError as e:
        errors.append(str(e))
out["mesh_errors"] = errors
# `init` again after steps: the donated state never aliased the trainer's model.
try:
    Mse(make_model(512), SGD(1e-2), grad_accum=8).compiled_step(
        trainer.shard_batch(batch_of(32)), trainer.init(key=jax.random.key(1)))
except ValueError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


def _on_8_devices(*args) -> str:
    """`python *args` with 8 forced CPU devices: its output, once it succeeded."""
    done = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=EIGHT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def run_on_8_devices(*args):
    """`python *args` with 8 forced CPU devices: the JSON of its last line."""
    return json.loads(_on_8_devices(*args).strip().splitlines()[-1])


def run_memory_plan(tmp_path, *args):
    """`scripts/bench.py memory` (replicated, then FSDP, in one process): its rows."""
    out = tmp_path / "plan.json"
    _on_8_devices("scripts/bench.py", "memory", *args, "--json", str(out))
    return {row["layout"]: row for row in json.loads(out.read_text())}


def run_fsdp_cases(*cases):
    """`tests/_fsdp_child.py`: per case, the loss trajectories replicated and
    FSDP, and the per-device bytes of the state."""
    return run_on_8_devices("tests/_fsdp_child.py", "--steps", "10", *cases)


def test_fsdp_and_grad_accum_on_8_devices_match_replicated(tmp_path):
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(MLP_CHILD))
    out = run_on_8_devices(str(path))
    # MLP(4 -> 512 -> 2): the (512, 4) and (2, 512) weights split along 512, the
    # biases (512 and 2 elements) replicated; the step keeps that placement.
    split = ["P('data',)", "P()", "P(None, 'data')", "P()"]
    assert out["fsdp"]["specs"] == out["fsdp"]["after"] == split
    assert set(out["replicated"]["after"]) == {"P()"}
    # Tensor parallelism: the hidden units over "tensor" (the batch over the other
    # axis); with an "fsdp" axis (of 4) also "embed" where it divides: the (512, 4)
    # weight's 4, not the (2, 512) one's 2.
    tp = ["P('tensor',)", "P('tensor',)", "P(None, 'tensor')", "P()"]
    assert out["tp"]["specs"] == out["tp"]["after"] == tp
    fsdp_tp = ["P('tensor', 'fsdp')", *tp[1:]]
    assert out["fsdp_tp"]["specs"] == out["fsdp_tp"]["after"] == fsdp_tp
    assert [e.split(",")[0] for e in out["mesh_errors"]] == [
        "Expected `sharding='fsdp'` (or None) with a mesh axis 'fsdp' of 8 devices",
        "Expected `axis_names` for a mesh axis 'tensor' of 2 devices (the logical "
        "axes of the arrays it splits",
    ]
    rep = out["replicated"]
    for name in ("fsdp", "fsdp_accum", "tp", "fsdp_tp"):
        np.testing.assert_allclose(out[name]["losses"], rep["losses"], atol=1e-6)
        for a, b in zip(out[name]["leaves"], rep["leaves"]):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert out["error"].startswith(
        "Expected every batch array's leading axis to divide by grad_accum x "
        "devices (8 x 8), got shape (32, 4)"
    )


@pytest.mark.slow
def test_fsdp_gpt_fp32_matches_replicated_in_an_eighth_of_the_bytes():
    out = run_fsdp_cases("gpt_fp32")["gpt_fp32"]
    rep, fsdp = np.array(out["replicated"]["losses"]), np.array(out["fsdp"]["losses"])
    assert len(rep) == 10 and rep[-1] < rep[0]
    np.testing.assert_allclose(fsdp, rep, atol=1e-5, rtol=0)
    # Every device holds all of the replicated state, an eighth (plus the small
    # replicated arrays) of the FSDP one.
    assert out["replicated"]["device_bytes"] == out["replicated"]["total_bytes"]
    ratio = out["fsdp"]["device_bytes"] / out["replicated"]["device_bytes"]
    assert ratio <= 1 / 8 + 0.05, ratio
    assert (
        out["fsdp"]["sharded_arrays"] > 0 and out["replicated"]["sharded_arrays"] == 0
    )


@pytest.mark.slow
def test_fsdp_low_precisions_match_replicated():
    cases = ("gpt_bf16", "gpt_fp8", "gpt_scalify", "gpt_unit", "delayed_fp8")
    out = run_fsdp_cases(*cases)
    for case in cases:
        rep = np.array(out[case]["replicated"]["losses"])
        fsdp = np.array(out[case]["fsdp"]["losses"])
        assert np.all(np.isfinite(rep)) and rep[-1] < rep[0], case
        np.testing.assert_allclose(fsdp, rep, atol=1e-3, rtol=0, err_msg=case)
        assert out[case]["fsdp"]["sharded_arrays"] > 0, case
        ratio = out[case]["fsdp"]["device_bytes"] / out[case]["fsdp"]["total_bytes"]
        assert ratio <= 1 / 8 + 0.05, (case, ratio)
    # The delayed-scaling state (amax histories: small) is replicated and updated.
    assert out["delayed_fp8"]["fsdp"]["amax_history_max"] > 0


def test_array_spec_splits_the_largest_divisible_dimension():
    assert array_spec((64, 256), 8, "fsdp") == P(None, "data")
    assert array_spec((256, 64), 8, "fsdp") == P("data")
    assert array_spec((2, 64, 192), 8, "fsdp") == P(None, None, "data")
    assert array_spec((64, 64), 8, "fsdp") == P("data")  # a tie: the first
    assert array_spec((100, 48), 8, "fsdp") == P(None, "data")  # 100 % 8 != 0
    assert array_spec((100, 30), 8, "fsdp") == P()  # no dimension divides
    assert array_spec((1023,), 3, "fsdp") == P()  # under FSDP_MIN_SIZE
    assert array_spec((1024,), 8, "fsdp") == P("data")
    assert array_spec((), 8, "fsdp") == P()
    assert array_spec((64, 256), 1, "fsdp") == P()
    assert array_spec((64, 256), 8, "replicated") == P()


def test_layout_splits_by_logical_names():
    from jax.sharding import AbstractMesh

    from lowtrain.train import AXIS_RULES, Layout

    names = (
        (r"qkv\.kernel$", ("embed", "heads")),
        (r"norm$", ("embed",)),
        (r"twice$", ("heads", "mlp")),  # both over "tensor": the second whole
    )
    rules = tuple(AXIS_RULES.items())
    layout = Layout(AbstractMesh((2, 4), ("fsdp", "tensor")), "fsdp", names, rules)
    assert layout.fsdp_axis == "fsdp" and layout.batch_axes == ("fsdp",)
    path = "opt_state.0.mu.blocks.qkv.kernel"  # a moment: named as its parameter
    assert layout.spec(path, (8, 512, 1536)) == P(None, "fsdp", "tensor")
    assert layout.spec(path, (8, 512, 1536), gathered=True) == P(None, None, "tensor")
    assert layout.spec("qkv.kernel", (512, 1538)) == P("fsdp")  # 1538 % 4: whole
    assert layout.spec("ln.norm", (4096,)) == P("fsdp")
    assert layout.spec("ln.norm", (512,)) == P()  # under FSDP_MIN_SIZE
    assert layout.spec("twice", (64, 64)) == P("tensor")
    assert layout.spec("qkv.kernel.scale", ()) == P()  # fewer dimensions than names
    assert layout.spec("other", (6, 2048)) == P(None, "fsdp")  # unnamed: by shape
    assert layout.activation_spec(("batch", None, "heads"), (8, 3, 12)) == P(
        "fsdp", None, "tensor"
    )
    # One "data" axis under "fsdp": the FSDP axis is "data"; replicated: none.
    data = AbstractMesh((8,), ("data",))
    assert Layout(data, "fsdp", names, rules).spec(path, (512, 16)) == P("data")
    assert Layout(data, "replicated", names, rules).spec(path, (512, 16)) == P()
    # Rules over the defaults.
    _, mine = lowtrain.train._placement.make_layout(
        None, None, "fsdp", {"w$": ("embed", "mine")}, {"mine": "tensor"}
    )
    assert dict(mine.rules)["mine"] == ("tensor",)
    assert dict(mine.rules)["heads"] == ("tensor",)


def test_mesh_and_axis_names_errors():
    model = make_model()
    for options, message in [
        ({"mesh": {"model": 1}}, r"Expected mesh axes among \['data', 'fsdp'"),
        ({"mesh": {"fsdp": 2}}, "Expected the mesh's sizes {'fsdp': 2} to multiply"),
        ({"mesh": {"data": 0}}, "Expected the size of mesh axis 'data' a positive"),
        ({"mesh": {"data": -1, "fsdp": -1}}, "Expected at most one mesh axis of"),
        ({"mesh": [1]}, "Expected `mesh` a mapping of axis names"),
        ({"axis_names": {"(": ("embed",)}}, "Expected each pattern of `axis_names`"),
        ({"axis_names": {"w": ("model",)}}, r"got \['model'\] \(for 'w'\), which"),
        ({"axis_rules": {"embed": "model"}}, "Expected the rule of logical axis"),
    ]:
        error = TypeError if options.get("mesh") == [1] else ValueError
        with pytest.raises(error, match=message):
            Regression(model, SGD(1e-2), **options)
    # One device as {data: -1, fsdp: 1}: the default placement, over named axes.
    trainer = Regression(model, SGD(1e-2), mesh={"data": -1, "fsdp": 1})
    assert trainer.mesh.axis_names == ("data", "fsdp")
    assert trainer.sharding == "replicated"  # an "fsdp" axis of one device
    x = jnp.ones((4, 8))
    assert lowtrain.train.logical_constraint(x, ("batch", None)) is x
    with pytest.raises(ValueError, match=r"one logical axis name per dimension"):
        lowtrain.train.logical_constraint(x, ("batch",))


def test_fsdp_on_one_device_and_bad_sharding():
    trainer = Regression(make_model(512), SGD(1e-2), sharding="fsdp")
    state = trainer.init(key=jax.random.key(1))
    w = state.model.layers[0].weight
    assert w.sharding.spec == P()  # one device: nothing to split
    assert w.sharding.mesh.axis_names == ("data",)
    with pytest.raises(ValueError, match="Expected `sharding` 'replicated' or 'fsdp'"):
        Regression(make_model(), optax.sgd(0.1), sharding="zero3")
    with pytest.raises(ValueError, match=r"Expected `remat` one of \['dots', 'full'"):
        Regression(make_model(), optax.sgd(0.1), remat="everything")


@pytest.mark.slow
def test_remat_recomputes_without_changing_the_step():
    # The recipes' GPT runs its blocks under `remat_layer`: the Trainer's `remat`
    # changes what the backward pass keeps (XLA's temporaries of the compiled
    # step), not what the step computes.
    from lowtrain.recipes._config import GPTConfig
    from lowtrain.recipes.gpt import GPT, GptTrainer

    model = GPT(GPTConfig(4, 2, 64, 32, True), 16, key=jax.random.key(0))
    tokens = np.arange(8 * 33, dtype=np.int32).reshape(8, 33) % 16
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    losses, temps = {}, {}
    for name in ("none", "dots", "full"):
        trainer = GptTrainer(model, SGD(0.1), remat=name)
        state = trainer.init(key=jax.random.key(1))
        compiled = trainer.compiled_step.lower(batch, state).compile()
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
        for _ in range(2):
            state, metrics = trainer.compiled_step(batch, state)
        losses[name] = float(metrics["loss"])
    assert losses["dots"] == pytest.approx(losses["none"], rel=1e-6)
    assert losses["full"] == pytest.approx(losses["none"], rel=1e-6)
    assert temps["full"] < temps["dots"] < temps["none"], temps


def test_amp_keeps_the_shardings_of_an_inner_jit():
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    rows = NamedSharding(mesh, P("data"))
    cols = NamedSharding(mesh, P(None, "data"))
    inner = jax.jit(lambda x: jnp.sin(x) @ x.T, in_shardings=cols, out_shardings=rows)
    fn = lowtrain.amp(lambda x: inner(x) * 2.0, "bf16")
    x = jnp.ones((8, 4))
    constraints = eqns_of(fn, x, prim="sharding_constraint")
    assert [e.params["sharding"] for e in constraints] == [cols, rows]
    assert np.dtype(constraints[1].invars[0].aval.dtype) == np.dtype("bfloat16")
    # ... and in the lowered program.
    text = jax.jit(fn).lower(x).as_text()
    found = re.findall(r"sdy.sharding_constraint %\w+ <@mesh, (.*?)> : (\S+)", text)
    # (the inner jit's input is the float32 input: `sin` runs in its dtype)
    assert found == [
        ('[{}, {"data"}]', "tensor<8x4xf32>"),
        ('[{"data"}, {}]', "tensor<8x8xbf16>"),
    ]
    # An inner jit without shardings adds no constraint.
    plain = lowtrain.amp(lambda x: jax.jit(jnp.sin)(x) * 2.0, "bf16")
    assert not eqns_of(plain, x, prim="sharding_constraint")


def test_fsdp_gathers_a_layer_at_a_time_and_again_in_the_backward(tmp_path):
    # The recipes' GPT calls `gather_layer` in its scanned block: under
    # `remat="dots"` each parameter is all-gathered twice (forward, and again in
    # the backward instead of being kept), where gathering the whole model before
    # the loss moves each once. The replicated Trainer traced first in the same
    # process: its trace of the model must not be reused (no gathers in it).
    rows = run_memory_plan(
        tmp_path,
        "--models",
        "gpt_tiny",
        "--devices",
        "8",
        "--set",
        "trainer.remat=dots",
    )
    rep, fsdp = rows["replicated"], rows["fsdp"]
    assert rep["collectives"]["all-gather"] == 0
    # Gathering the whole model before the loss moves each split parameter once
    # (`split_parameter_bytes`; those under `FSDP_MIN_SIZE` stay replicated); a
    # layer at a time under `remat="dots"`, the blocks' twice (again in the
    # backward pass, inside the scan) and the arrays outside the blocks (the
    # embeddings, not under `remat_layer`) once: exactly, in the floats the
    # all-gathers move (an integer all-gather of the labels aside).
    assert rep["split_parameter_bytes"] == 0 and not rep["gathered_bytes_by_field"]
    assert fsdp["split_parameter_bytes"] > 0.9 * 4 * fsdp["parameters"]
    gathered = fsdp["gathered_bytes_by_field"]
    assert set(gathered) == {"blocks", "wte", "wpe"}
    assert sum(gathered.values()) == fsdp["split_parameter_bytes"]
    once = lambda row: sum(row["gathered_bytes_by_field"].values())
    twice = lambda row: once(row) + row["gathered_bytes_by_field"]["blocks"]
    assert fsdp["float_all_gather"] == twice(fsdp)
    assert fsdp["arguments"] < rep["arguments"] / 5  # the state: an eighth, mostly
    total = lambda row: row["arguments"] + row["temporaries"]
    assert total(fsdp) < 0.6 * total(rep)
    # FSDP x TP ({fsdp: 4, tensor: 2}): the state split 8 ways as well, but a
    # layer gathered over "fsdp" only, still split over "tensor" where its names
    # say (all but the position embedding): about half the bytes, exactly those.
    tp = rows["fsdp_tp"]
    assert tp["arguments"] <= fsdp["arguments"]
    assert tp["float_all_gather"] == twice(tp)
    assert 0.45 * twice(fsdp) < twice(tp) < 0.55 * twice(fsdp)


@pytest.mark.slow
def test_fsdp_per_layer_plan_of_the_wide_gpt(tmp_path):
    # 8 devices, the GPT at 8 layers, width 512, context 64, batch 32, bf16: FSDP
    # with `remat="dots"` holds at most a quarter of what replicated holds with the
    # default `remat="none"` (arguments + temporaries per device).
    # FSDP x TP (4 x 2) at most 0.3x.
    none = run_memory_plan(tmp_path, "--devices", "8")
    dots = run_memory_plan(
        tmp_path,
        "--devices",
        "8",
        "--layouts",
        "fsdp,fsdp_tp",
        "--set",
        "trainer.remat=dots",
    )
    total = lambda row: row["arguments"] + row["temporaries"]
    assert total(dots["fsdp"]) <= 0.25 * total(none["replicated"])
    assert total(dots["fsdp_tp"]) <= 0.3 * total(none["replicated"])
    assert total(none["fsdp"]) < total(none["replicated"])
    assert total(none["fsdp_tp"]) < total(none["replicated"])


@pytest.mark.slow
def test_fsdp_tp_gpt_trains_as_replicated():
    # The GPT on {fsdp: 4, tensor: 2} with its logical axis names: in float32 the
    # losses of replicated to rounding; in bf16 within bf16's (the row-parallel
    # matmuls' partial sums are rounded to bf16 before they are summed).
    out = run_on_8_devices(
        "tests/_fsdp_child.py", "--layouts", "fsdp_tp", "gpt_fp32", "gpt_bf16"
    )
    for case, rtol in (("gpt_fp32", 1e-5), ("gpt_bf16", 1e-3)):
        rep = np.array(out[case]["replicated"]["losses"])
        tp = np.array(out[case]["fsdp_tp"]["losses"])
        assert rep[-1] < rep[0]
        np.testing.assert_allclose(tp, rep, rtol=rtol, atol=0)
        most = [out[case][k]["device_bytes"] for k in ("fsdp_tp", "replicated")]
        assert most[0] <= (1 / 8 + 0.05) * most[1], most


@pytest.mark.slow
def test_fsdp_per_layer_wide_gpt_bf16_trains_as_replicated():
    # Ten steps of the wide GPT in bf16 under `remat="dots"`: the gradients are
    # replicated's bit for bit but the tied embedding's (its two uses' cotangents
    # summed in another order: a last-bit difference), which AdamW carries into
    # the losses at the 1e-5 level.
    out = run_fsdp_cases("gpt_wide_bf16")["gpt_wide_bf16"]
    rep, fsdp = np.array(out["replicated"]["losses"]), np.array(out["fsdp"]["losses"])
    assert rep[0] == fsdp[0]  # the first step's loss: the same forward pass
    np.testing.assert_allclose(fsdp, rep, rtol=5e-5, atol=0)
    assert out["fsdp"]["device_bytes"] / out["replicated"]["device_bytes"] < 0.13
