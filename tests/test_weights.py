"""Weights in and out: `load_model` reads the model alone from a training
checkpoint, bit for bit and checked; `save_safetensors` / `load_safetensors` round
trip every dtype bit for bit, under the names and dtype tags other tools read."""

import importlib.util
import json
import pathlib
import shutil
import struct

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lowtrain

from .helpers import SGD, Mse, make_data, make_model, same_bits, snapshot

# The safetensors tests need the `safetensors` extra; `load_model` does not.
safetensors_extra = pytest.mark.skipif(
    importlib.util.find_spec("safetensors") is None,
    reason="the `safetensors` extra is not installed",
)

TRAIN_STATE_FIELDS = ("step", "model", "opt_state", "loss_scale", "key")


def _random_bits(key, shape, dtype):
    """An array of `dtype` whose bits are random: every pattern, NaNs included."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return jax.random.bernoulli(key, 0.5, shape)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}
    if dtype.itemsize == 8:  # no 64-bit arrays without x64: built on the host
        bits = np.asarray(jax.random.bits(key, (*shape, 2), jnp.uint32))
        return np.ascontiguousarray(bits).view(dtype).reshape(shape)
    bits = jax.random.bits(key, shape, unsigned[dtype.itemsize])
    return jax.lax.bitcast_convert_type(bits, dtype)


def _with_dtype(model, dtype, key):
    """`model` with each array leaf replaced by random bits of `dtype`."""
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    keys = iter(jax.random.split(key, len(leaves)))
    return jax.tree.map(
        lambda x: _random_bits(next(keys), x.shape, dtype) if eqx.is_array(x) else x,
        model,
    )


def snapshot_leaves(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def _header(path) -> dict:
    # The safetensors format: an 8-byte little-endian length, then a JSON header.
    data = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])


# -- safetensors ------------------------------------------------------------------


@safetensors_extra
@pytest.mark.parametrize(
    "dtype, tag",
    [
        (jnp.float32, "F32"),
        (jnp.bfloat16, "BF16"),
        (jnp.float16, "F16"),
        (jnp.float8_e4m3fn, "F8_E4M3"),
        (jnp.float8_e5m2, "F8_E5M2"),
        (jnp.int32, "I32"),
        (jnp.bool_, "BOOL"),
    ],
)
def test_safetensors_round_trip_is_bit_for_bit(tmp_path, dtype, tag):
    model = _with_dtype(make_model(), dtype, jax.random.key(1))
    path = lowtrain.save_safetensors(model, tmp_path / "model.safetensors")
    header = _header(path)
    assert sorted(header) == [
        "layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight"
    ]  # fmt: skip
    assert {entry["dtype"] for entry in header.values()} == {tag}
    assert header["layers.0.weight"]["shape"] == [16, 4]
    back = lowtrain.load_safetensors(
        path, _with_dtype(make_model(), dtype, jax.random.key(2))
    )
    assert same_bits(snapshot(back), snapshot(model))
    assert all(isinstance(x, jax.Array) for x in snapshot_leaves(back))
    assert back.activation is model.activation  # from `like`


@safetensors_extra
def test_safetensors_mixed_dtypes_numpy_leaves_and_keys(tmp_path):
    k = jax.random.split(jax.random.key(0), 6)
    model = {
        "w": _random_bits(k[0], (3, 5), jnp.float32),
        "h": _random_bits(k[1], (7,), jnp.bfloat16),
        "q": _random_bits(k[2], (2, 2), jnp.float8_e4m3fn),
        "f64": _random_bits(k[3], (3,), np.float64),  # a NumPy leaf stays NumPy
        "blocks": [_random_bits(k[4], (2,), jnp.float16), jnp.arange(3)],
        "scalar": _random_bits(k[5], (), jnp.float32),  # 0-d stays 0-d
        "key": jax.random.key(7),
        "name": "not an array",
    }
    path = lowtrain.save_safetensors(
        model, tmp_path / "m.safetensors", metadata={"step": "12", "by": "test"}
    )
    from safetensors import safe_open

    with safe_open(path, "np") as f:
        assert f.metadata() == {"step": "12", "by": "test"}
        assert sorted(f.keys()) == sorted(
            ["w", "h", "q", "f64", "blocks.0", "blocks.1", "scalar", "key"]
        )
    like = {
        "w": jnp.zeros((3, 5)),
        "h": jnp.zeros(7, jnp.bfloat16),
        "q": jnp.zeros((2, 2), jnp.float8_e4m3fn),
        "f64": np.zeros(3),
        "blocks": [jnp.zeros(2, jnp.float16), jnp.zeros(3, jnp.int32)],
        "scalar": jnp.float32(0),
        "key": jax.random.key(0),
        "name": "kept",
    }
    back = lowtrain.load_safetensors(path, like)
    assert back["name"] == "kept"
    assert isinstance(back["f64"], np.ndarray)
    assert jnp.issubdtype(back["key"].dtype, jax.dtypes.prng_key)
    assert same_bits(snapshot(back), snapshot(model))


@safetensors_extra
def test_safetensors_batchnorm_model_and_state(tmp_path, getkey):
    model, state = eqx.nn.make_with_state(eqx.nn.Sequential)(
        [eqx.nn.Linear(3, 4, key=getkey()), eqx.nn.BatchNorm(4, "batch", mode="ema")]
    )
    x = jax.random.normal(getkey(), (8, 3))
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    _, state = batched(x, state)  # running statistics that are not the initial ones
    lowtrain.save_safetensors(model, tmp_path / "model.safetensors")
    lowtrain.save_safetensors(state, tmp_path / "state.safetensors")
    like_model, like_state = eqx.nn.make_with_state(eqx.nn.Sequential)(
        [eqx.nn.Linear(3, 4, key=getkey()), eqx.nn.BatchNorm(4, "batch", mode="ema")]
    )
    back = lowtrain.load_safetensors(tmp_path / "model.safetensors", like_model)
    back_state = lowtrain.load_safetensors(tmp_path / "state.safetensors", like_state)
    assert same_bits(snapshot(back), snapshot(model))
    assert same_bits(snapshot(back_state), snapshot(state))
    y, _ = batched(x, state)
    y_back, _ = jax.vmap(
        back, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(x, back_state)
    assert same_bits(snapshot(y_back), snapshot(y))


@safetensors_extra
def test_load_safetensors_into_shapes_alone(tmp_path):
    model = make_model()
    path = lowtrain.save_safetensors(model, tmp_path / "m.safetensors")
    like = eqx.filter_eval_shape(make_model)
    assert isinstance(like.layers[0].weight, jax.ShapeDtypeStruct)
    back = lowtrain.load_safetensors(path, like)
    assert isinstance(back.layers[0].weight, jax.Array)
    assert same_bits(snapshot(back), snapshot(model))


@safetensors_extra
def test_load_safetensors_names_what_does_not_match(tmp_path):
    path = lowtrain.save_safetensors(make_model(), tmp_path / "m.safetensors")
    deeper = eqx.nn.MLP(4, 2, 16, 2, key=jax.random.key(0))
    with pytest.raises(
        ValueError, match=r"lacks \['layers\.2\.weight', 'layers\.2\.bias'\]"
    ):
        lowtrain.load_safetensors(path, deeper)
    shallow = eqx.nn.MLP(4, 2, 16, 0, key=jax.random.key(0))
    with pytest.raises(
        ValueError, match=r"has others, \['layers\.1\.bias', 'layers\.1\.weight'\] \(2 "
    ):
        lowtrain.load_safetensors(path, shallow)
    with pytest.raises(
        ValueError,
        match=r"Expected `layers\.0\.weight` in .* to be float32\[8, 4\] as in "
        r"`like_model`, got float32\[16, 4\] instead\. Build `like_model` with the",
    ):
        lowtrain.load_safetensors(path, make_model(width=8))
    bf16 = lowtrain.Policy(param_dtype="bfloat16").cast_to_param(make_model())
    with pytest.raises(
        ValueError,
        match=r"to be bfloat16\[16, 4\] as in `like_model`, got float32\[16, 4\] "
        r"instead\..*cast_to_param",
    ):
        lowtrain.load_safetensors(path, bf16)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="Expected a safetensors file at"):
        lowtrain.load_safetensors(tmp_path / "junk.safetensors", make_model())


@safetensors_extra
def test_save_safetensors_refuses_what_it_cannot_store(tmp_path):
    odd = {"x": jnp.zeros(3, ml_dtypes.float8_e4m3b11fnuz)}
    with pytest.raises(TypeError, match=r"got `x` of dtype float8_e4m3b11fnuz"):
        lowtrain.save_safetensors(odd, tmp_path / "odd.safetensors")
    with pytest.raises(TypeError, match="`metadata` to map strings to strings"):
        lowtrain.save_safetensors(make_model(), tmp_path / "m", metadata={"step": 1})
    with pytest.raises(ValueError, match="got two named `a.b`"):
        lowtrain.save_safetensors(
            {"a.b": jnp.ones(1), "a": {"b": jnp.ones(1)}}, tmp_path / "c"
        )
    assert not list(tmp_path.iterdir())  # nothing half written


# -- load_model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A short `Trainer.fit` with bfloat16 parameters and checkpoints at steps 2
    and 4 (shared: the tests that damage it damage a copy)."""
    folder = tmp_path_factory.mktemp("run") / "ckpt"
    trainer = Mse(make_model(), SGD(0.05), precision="params=bfloat16")
    # bfloat16 parameters meet the float32 batch: promoted as users run it.
    with jax.numpy_dtype_promotion("standard"):
        state = trainer.fit(
            trainer.init(key=jax.random.key(0)),
            make_data(),
            steps=4,
            checkpoint_dir=folder,
            checkpoint_every=2,
            progress=False,
        )
    return trainer, snapshot(state.model), folder


def test_load_model_from_fit_is_the_trained_model_bit_for_bit(run):
    trainer, trained, folder = run
    like = trainer.init(key=jax.random.key(5)).model  # bfloat16 parameters
    model = lowtrain.load_model(folder, like)  # the newest: step 4
    assert model.layers[0].weight.dtype == jnp.bfloat16
    assert same_bits(snapshot(model), trained)
    # One checkpoint by its path: as `load_checkpoint` reads the whole state.
    older = folder / "ckpt_00000002"
    whole = lowtrain.load_checkpoint(older, trainer.init(key=jax.random.key(5)))
    model = lowtrain.load_model(older, eqx.filter_eval_shape(lambda: like))
    assert same_bits(snapshot(model), snapshot(whole.model))
    assert not same_bits(snapshot(model), trained)
    # A float32 model to load into is named, with the fix.
    with pytest.raises(
        ValueError,
        match=r"does not match `like_model` at `\.layers\[0\]\.weight` "
        r"\(`\.model\.layers\[0\]\.weight` in the checkpoint\): expected "
        r"float32\[16, 4\], got bfloat16\[16, 4\] instead\. Build `like_model` as "
        r"the `TrainState` holds it",
    ):
        lowtrain.load_model(folder, make_model())


def test_load_model_refuses_another_model_or_checkpoint(run, tmp_path):
    folder = run[2]
    bf16 = lowtrain.Policy(param_dtype="bfloat16")
    no_bias = eqx.nn.MLP(4, 2, 16, 1, use_final_bias=False, key=jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"structure of `like_model`: at array 3 of `\.model` expected no more "
        r"arrays, got `\.layers\[1\]\.bias` bfloat16\[2\] instead \(3 arrays in "
        r"`like_model`, 4 under `\.model` in the checkpoint\)",
    ):
        lowtrain.load_model(folder, bf16.cast_to_param(no_bias))
    plain = lowtrain.save_checkpoint(tmp_path / "plain", {"w": jnp.ones(3)})
    with pytest.raises(ValueError, match=r"Expected arrays under `\.model` in"):
        lowtrain.load_model(plain, make_model())
    with pytest.raises(FileNotFoundError, match="which does not exist"):
        lowtrain.load_model(tmp_path / "typo", make_model())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="Expected a lowtrain checkpoint at"):
        lowtrain.load_model(tmp_path / "empty", make_model())


def _flip_a_bit(checkpoint: pathlib.Path) -> None:
    # In the largest file of array data (orbax's chunks under `d/` folders).
    files = [f for f in checkpoint.rglob("*") if f.is_file() and f.parent.name == "d"]
    file = max(files, key=lambda f: f.stat().st_size)
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 1
    file.write_bytes(bytes(data))


def test_load_model_finds_a_corrupt_checkpoint(run, tmp_path):
    trainer, _, folder = run
    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy)
    newest = lowtrain.latest_checkpoint(copy)
    _flip_a_bit(newest)  # found by the file digests: the file does not match
    with pytest.raises(
        lowtrain.CheckpointCorruptError,
        match=rf"{newest} is corrupt: its file .* does not match its CRC.*pass its "
        r"path: .*ckpt_00000002",
    ):
        lowtrain.load_model(copy, trainer.init(key=jax.random.key(5)).model)


def test_load_model_checks_the_bytes_of_the_model(tmp_path):
    # The file digests rewritten to match a flipped bit: the arrays' checksums (or
    # the reader) still find it. The model is the one large array, so the largest
    # file of array data holds it.
    model = {"w": jax.random.normal(jax.random.key(0), (256, 256))}
    state = lowtrain.TrainState(
        jnp.int32(1), model, {}, lowtrain.NoOpLossScale(), jax.random.key(0)
    )
    path = lowtrain.save_checkpoint(tmp_path / "c", state)
    _flip_a_bit(path)
    for record in path.glob("lowtrain_files.*"):
        record.unlink()
    lowtrain.train._checkpoint.write_file_digests(path)
    with pytest.raises(lowtrain.CheckpointCorruptError, match=str(path)):
        lowtrain.load_model(path, {"w": jnp.zeros((256, 256))})


def test_load_model_refuses_non_finite_weights(tmp_path):
    model = make_model()
    bad = eqx.tree_at(lambda m: m.layers[1].bias, model, jnp.array([0.0, jnp.nan]))
    state = lowtrain.TrainState(
        jnp.int32(3), bad, {}, lowtrain.NoOpLossScale(), jax.random.key(0)
    )
    path = lowtrain.save_checkpoint(tmp_path / "nan", state)
    with pytest.raises(
        lowtrain.CheckpointCorruptError,
        match=r"non-finite values in `\.model\.layers\[1\]\.bias`",
    ):
        lowtrain.load_model(path, model)


def test_load_model_with_model_state(tmp_path, getkey):
    make = eqx.nn.make_with_state(eqx.nn.Sequential)
    layers = lambda: [
        eqx.nn.Linear(3, 4, key=getkey()),
        eqx.nn.BatchNorm(4, "batch", mode="ema"),
    ]
    model, model_state = make(layers())
    x = jax.random.normal(getkey(), (8, 3))
    _, model_state = jax.vmap(
        model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(x, model_state)
    state = lowtrain.TrainState(
        jnp.int32(1),
        model,
        {"momentum": jnp.ones(4)},
        lowtrain.NoOpLossScale(),
        jax.random.key(0),
        model_state=model_state,
    )
    path = lowtrain.save_checkpoint(tmp_path / "c", state)
    like_model, like_state = make(layers())
    got_model, got_state = lowtrain.load_model(path, like_model, like_state)
    assert same_bits(snapshot(got_model), snapshot(model))
    assert same_bits(snapshot(got_state), snapshot(model_state))
    # `.model` alone is not `.model_state`.
    assert same_bits(snapshot(lowtrain.load_model(path, like_model)), snapshot(model))
    without = lowtrain.TrainState(*(getattr(state, f) for f in TRAIN_STATE_FIELDS))
    no_state = lowtrain.save_checkpoint(tmp_path / "d", without)
    with pytest.raises(ValueError, match=r"under `\.model_state`.*like_state=None"):
        lowtrain.load_model(no_state, like_model, like_state)


def test_a_missing_safetensors_is_named(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'lowtrain\[safetensors\]'"):
        lowtrain.save_safetensors(make_model(), tmp_path / "m.safetensors")
