"""`Primitive`'s own API: construction, errors, the torch-guide analogues, multi-device."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicitdiff import (
    Primitive,
    instantiate_zeros,
    jvp_from_lin,
    linearize_from_jvp,
)


class Cube(Primitive):
    """The torch guide's MyCube: returns (x**3, 3x**2) and saves dx for the backward pass."""

    def expand(self, x):
        return x**3, 3 * x**2

    def vjp_fwd(self, nzs_in, x):
        out = self(x)
        return out, (x, out[1])

    def vjp_bwd_retval(self, res, g):
        x, dx = res
        g_out, g_dx = (instantiate_zeros(t) for t in g)
        return (g_out * dx + g_dx * 6 * x,)


def my_cube(x):
    return Cube.apply(x)[0]


def test_cube_second_derivative_is_6x():
    for x in [0.7, -1.3, 2.0]:
        np.testing.assert_allclose(jax.grad(my_cube)(x), 3 * x**2, rtol=1e-6)
        np.testing.assert_allclose(jax.grad(jax.grad(my_cube))(x), 6 * x, rtol=1e-6)


def test_automatic_vmap_rule_like_generate_vmap_rule():
    x = jnp.array([1.0, -2.0, 0.5])
    np.testing.assert_allclose(jax.vmap(my_cube)(x), x**3, rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(jax.grad(my_cube))(x), 3 * x**2, rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(jax.grad(jax.grad(my_cube)))(x), 6 * x, rtol=1e-6)


def test_out_aval_inferred_and_params_are_attributes():
    class Scale(Primitive):
        def expand(self, x):
            return self.k * x

    p = Scale(jax.typeof(jnp.ones(3)), k=2.0)
    assert p.k == 2.0 and p.params == {"k": 2.0}
    assert p.out_aval.shape == (3,)
    np.testing.assert_allclose(Scale.apply(jnp.ones(3), k=3.0), 3 * jnp.ones(3))
    assert Scale(jax.typeof(1.0), k=2.0) == Scale(jax.typeof(1.0), k=2.0)
    assert Scale(jax.typeof(1.0), k=2.0) != Scale(jax.typeof(1.0), k=3.0)


def test_tracer_in_static_param_is_an_error_naming_it():
    class Scale(Primitive):
        def expand(self, x):
            return self.k * x

    with pytest.raises(TypeError, match="static parameter 'k'.*pass it as an input"):
        jax.jit(lambda x, k: Scale.apply(x, k=k))(1.0, 2.0)
    with pytest.raises(TypeError, match="'k'.*not hashable"):
        Scale.apply(1.0, k=[1, 2])


def test_wrong_structure_and_outputs_are_errors():
    class Bad(Primitive):
        def __init__(self, a):
            self.in_avals = (a,)
            self.out_aval = a
            self.params = {}
            super().__init__()

        def expand(self, x):
            return (x, x)

    with pytest.raises(TypeError, match="expand returned a value of structure"):
        Bad(jax.typeof(1.0))(1.0)
    ok = Cube(jax.typeof(1.0))
    with pytest.raises(TypeError, match="structure"):
        ok(1.0, 2.0)


def test_missing_rules_raise_naming_them():
    class Plain(Primitive):
        def expand(self, x):
            return jnp.sin(x)

    with pytest.raises(NotImplementedError, match="vjp_fwd"):
        jax.grad(Plain.apply)(1.0)
    with pytest.raises(NotImplementedError, match="jvp"):
        jax.jvp(Plain.apply, (1.0,), (1.0,))
    with pytest.raises(NotImplementedError, match="lin"):
        jax.linearize(Plain.apply, 1.0)
    # evaluation, jit and vmap need no rule
    np.testing.assert_allclose(jax.jit(jax.vmap(Plain.apply))(jnp.ones(2)), jnp.sin(jnp.ones(2)))


def test_deriving_in_a_circle_is_an_error():
    with pytest.raises(TypeError, match="circle"):

        class Circle(Primitive):
            def expand(self, x):
                return x

            jvp = jvp_from_lin
            lin = linearize_from_jvp


def test_backward_rule_must_return_one_cotangent_per_input():
    class Short(Primitive):
        def expand(self, x, y):
            return x * y

        def vjp_fwd(self, nzs_in, x, y):
            return self(x, y), (x, y)

        def vjp_bwd_retval(self, res, g):
            return (g,)

    with pytest.raises(TypeError, match="one cotangent per input"):
        jax.grad(Short.apply)(1.0, 2.0)


def test_cotangent_shape_mismatch_names_the_input():
    class WrongShape(Primitive):
        def expand(self, x):
            return x

        def vjp_fwd(self, nzs_in, x):
            return self(x), None

        def vjp_bwd_retval(self, res, g):
            return (jnp.ones(5),)

    with pytest.raises(ValueError, match="cotangent of shape \\(5,\\)"):
        jax.grad(lambda x: WrongShape.apply(x).sum())(jnp.ones(3))


def test_integer_inputs_get_no_cotangent():
    class Power(Primitive):
        def expand(self, x, n):
            return x**n

        def vjp_fwd(self, nzs_in, x, n):
            assert nzs_in[1] is False
            return self(x, n), (x, n)

        def vjp_bwd_retval(self, res, g):
            x, n = res
            return (n * x ** (n - 1) * g, None)

    np.testing.assert_allclose(jax.grad(Power.apply)(2.0, 3), 12.0)
    np.testing.assert_allclose(
        jax.jacrev(Power.apply)(jnp.array([1.0, 2.0]), 2), jnp.diag(jnp.array([2.0, 4.0]))
    )


SHARDED = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from implicitdiff import Primitive

    class Log1pExp(Primitive):
        def expand(self, x):
            return jnp.log1p(jnp.exp(x))
        def vjp_fwd(self, nzs_in, x):
            return self(x), x
        def vjp_bwd_retval(self, x, g):
            return (jax.nn.sigmoid(x) * g,)

    assert len(jax.devices()) == 8
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    sh = NamedSharding(mesh, P("batch"))
    x = jax.device_put(jnp.linspace(-3.0, 3.0, 64), sh)
    f = jax.jit(lambda x: Log1pExp.apply(x) * 2)
    g = jax.jit(jax.grad(lambda x: Log1pExp.apply(x).sum()))
    out, gr = f(x), g(x)
    np.testing.assert_allclose(out, 2 * jnp.log1p(jnp.exp(jnp.linspace(-3.0, 3.0, 64))), rtol=1e-6)
    np.testing.assert_allclose(gr, jax.nn.sigmoid(jnp.linspace(-3.0, 3.0, 64)), rtol=1e-6)
    assert out.sharding.is_equivalent_to(sh, 1), out.sharding
    assert gr.sharding.is_equivalent_to(sh, 1), gr.sharding
    print("SHARDED-OK")
    """
)


def test_jit_with_sharded_inputs_on_eight_devices():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, "-c", SHARDED], capture_output=True, text=True, env=env, timeout=300
    )
    assert "SHARDED-OK" in r.stdout, r.stdout + r.stderr


def test_python_scalars_in_residuals_stay_static():
    class SumAxis(Primitive):
        def expand(self, x):
            return jnp.sum(x**2, axis=1)

        def vjp_fwd(self, nzs_in, x):
            return self(x), (x, 1, "note")  # an axis number and a string ride along

        def vjp_bwd_retval(self, res, g):
            x, axis, note = res
            assert isinstance(axis, int) and note == "note"
            return (2 * x * jnp.expand_dims(g, axis),)

    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(jax.grad(lambda x: SumAxis.apply(x).sum())(x), 2 * x)
    np.testing.assert_allclose(jax.jit(jax.grad(lambda x: SumAxis.apply(x).sum()))(x), 2 * x)


def test_transpose_rule_for_a_linear_primitive():
    class ScaleBy(Primitive):
        """y = a * x, linear in x; `a` is ordinary data."""

        def expand(self, a, x):
            return a * x

        def jvp(self, primals, tangents):
            (a, x), (da, dx) = primals, tangents
            return self(a, x), self(a, dx) + da * x

        def transpose(self, ct, a, x_acc):
            x_acc.accum(a * instantiate_zeros(ct))

    a, x = 3.0, jnp.array([1.0, 2.0])
    (ct_x,) = jax.linear_transpose(lambda x: ScaleBy.apply(a, x), x)(jnp.array([1.0, -1.0]))
    np.testing.assert_allclose(ct_x, [3.0, -3.0])
    # forward mode emits the primitive on tangents; transposing that is reverse mode
    np.testing.assert_allclose(jax.jvp(lambda x: ScaleBy.apply(a, x), (x,), (x,))[1], 3 * x)

    class NoTranspose(ScaleBy):
        transpose = Primitive.transpose

    with pytest.raises(NotImplementedError, match="transpose"):
        jax.linear_transpose(lambda x: NoTranspose.apply(a, x), x)(x)
