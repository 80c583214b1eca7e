"""`Policy` and `get_policy`: presets, jmp-style strings, rule lookup, errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import lowtrain


@pytest.mark.parametrize(
    "name, dtypes",
    [
        ("fp32", ("float32", "float32", "float32")),
        ("bf16", ("float32", "bfloat16", "float32")),
        ("fp16", ("float32", "float16", "float32")),
        (
            "params=float32,compute=bfloat16,output=float32",
            ("float32", "bfloat16", "float32"),
        ),
        ("p=f32,c=f16,o=f16", ("float32", "float16", "float16")),
        ("p=f32,c=bf16", ("float32", "bfloat16", "float32")),
        ("params=bfloat16", ("bfloat16", "bfloat16", "bfloat16")),
    ],
)
def test_get_policy(name, dtypes):
    p = lowtrain.get_policy(name)
    assert (str(p.param_dtype), str(p.compute_dtype), str(p.output_dtype)) == dtypes


@pytest.mark.parametrize(
    "name, match",
    [
        ("fp17", "Unknown policy 'fp17'. Expected one of fp32, bf16, fp16"),
        ("p=f32,x=f16", "KEY one of params/p, compute/c, output/o"),
        ("p=int8", "Expected a floating dtype for `param_dtype`.*'int8'"),
        ("c=f33", "Expected a floating dtype for `compute_dtype`"),
    ],
)
def test_get_policy_errors(name, match):
    with pytest.raises(ValueError, match=match):
        lowtrain.get_policy(name)


def test_rule_lookup():
    p = lowtrain.get_policy("fp16")
    assert p.action("dot_general", ()) == "compute"
    assert p.action("exp", ()) == "float32"
    assert p.action("add", ()) == "widest"
    assert p.action("dot_general", ("outer", "lowtrain.amp_stop")) == "keep"
    p = p.with_scopes({"outer": "bf16", "eqx.nn.*": "float32"})
    assert p.action("exp", ("outer", "eqx.nn.Linear")) == "bfloat16"  # outermost wins
    assert p.action("exp", ("eqx.nn.Linear", "outer")) == "float32"
    assert p.with_rules(exp="compute").action("exp", ()) == "compute"


def test_bad_rules():
    with pytest.raises(ValueError, match="AMP action for `rules\\['exp'\\]`"):
        lowtrain.Policy(rules={"exp": "loud"})
    with pytest.raises(TypeError, match="Expected a mapping for `scopes`"):
        lowtrain.Policy(scopes=["head"])


def test_policy_is_static_and_hashable():
    p = lowtrain.get_policy("bf16").with_scopes({"head": "float32"})
    assert hash(p) == hash(lowtrain.get_policy("bf16").with_scopes({"head": "float32"}))
    assert jax.tree.leaves(p) == []
    assert eqx.filter_jit(lambda x, p: x.astype(p.compute_dtype))(
        jnp.ones(2), p
    ).dtype == (jnp.bfloat16)


def test_casts():
    p = lowtrain.get_policy("p=f32,c=bf16,o=f16")
    tree = {"w": jnp.ones(2, jnp.float16), "i": jnp.ones(2, jnp.int32), "s": "x"}
    assert p.cast_to_param(tree)["w"].dtype == jnp.float32
    assert p.cast_to_compute(tree)["w"].dtype == jnp.bfloat16
    assert p.cast_to_output(tree)["w"].dtype == jnp.float16
    assert p.cast_to_compute(tree)["i"].dtype == jnp.int32
    assert p.cast_to_compute(tree)["s"] == "x"
