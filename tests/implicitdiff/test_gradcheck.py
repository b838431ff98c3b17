"""Tests for `implicitdiff.gradcheck`: `check_grads`, `format_table` and the command line."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicitdiff import gradcheck
from implicitdiff.gradcheck import (
    GradCheckError,
    GradCheckRow,
    Problem,
    check_grads,
    format_table,
    main,
    register,
)

ORDER2_MODES = {"fwd", "rev", "fwd-over-fwd", "rev-over-fwd", "fwd-over-rev", "rev-over-rev"}


def _matrices(dtype=None):
    rng = np.random.default_rng(0)
    A = jnp.asarray(rng.standard_normal((3, 3)) + 3 * np.eye(3), dtype)
    B = jnp.asarray(rng.standard_normal((3, 2)), dtype)
    return A, B


def matrix_fn(A, B):
    return jnp.tanh(A) @ B + A @ A @ B, jnp.sum(jnp.sin(A))


def pytree_fn(params, x, n):
    # params: dict with a float matrix, a float scalar and an int array; n: a Python int
    h = jnp.tanh(params["W"] @ x) * params["s"]
    return {"h": h**n, "count": params["steps"] + n, "pair": (jnp.sum(h), x * 2)}


def _pytree_args():
    rng = np.random.default_rng(1)
    params = {
        "W": jnp.asarray(rng.standard_normal((2, 3))),
        "s": 1.5,
        "steps": jnp.arange(2),
    }
    return params, jnp.asarray(rng.standard_normal(3)), 2


@jax.custom_jvp
def sin_times(x, y):
    return jnp.sin(x) * y


@sin_times.defjvp
def _sin_times_jvp(primals, tangents):
    x, y = primals
    dx, dy = tangents
    # correct in x, off by a factor 2 in y
    return sin_times(x, y), jnp.cos(x) * y * dx + 2 * jnp.sin(x) * dy


@jax.custom_vjp
def scaled_exp(x, y):
    return jnp.exp(x) * y


def _scaled_exp_fwd(x, y):
    return scaled_exp(x, y), (x, y)


def _scaled_exp_bwd(res, g):
    x, y = res
    # wrong in x (missing the factor y), right in y
    return jnp.exp(x) * g, jnp.exp(x) * g


scaled_exp.defvjp(_scaled_exp_fwd, _scaled_exp_bwd)


def _xy(dtype=None):
    return jnp.array([0.3, 1.2, -0.7], dtype), jnp.array([2.0, -1.0, 0.5], dtype)


# ---------------------------------------------------------------------------
# check_grads on correct functions.


@pytest.mark.parametrize("order", [1, 2])
def test_passes_on_correct_functions(x64, order):
    nodes = 1 if order == 1 else 3  # f; then its jvp and vjp functions
    for f, args, nargs in [
        (jnp.sin, (jnp.linspace(-2.0, 2.0, 5),), 1),
        (pytree_fn, _pytree_args(), 2),  # n is not perturbed
    ]:
        rows = check_grads(f, args, order=order)
        assert all(r.passed for r in rows)
        assert len(rows) == nargs * nodes * 2
        assert {r.order for r in rows} == set(range(1, order + 1))


@pytest.mark.parametrize("modes", [("fwd",), ("rev",)])
def test_one_mode(x64, modes):
    rows = check_grads(jnp.sin, (jnp.linspace(-2.0, 2.0, 5),), order=2, modes=modes, jit=False)
    assert [r.mode for r in rows] == [modes[0], f"{modes[0]}-over-{modes[0]}"]
    assert all(r.passed for r in rows)


def test_matrix_function_rows(x64):
    rows = check_grads(matrix_fn, _matrices(), order=2)
    assert all(r.passed for r in rows)
    assert [r.argument for r in rows] == ["A"] * 6 + ["B"] * 6
    assert {r.mode for r in rows} == ORDER2_MODES
    for r in rows:
        assert r.against == ("finite differences" if r.mode.startswith("fwd") else "jvp")
        assert r.max_abs_err <= r.tol
        assert r.tol >= 1e-5 if r.against == "finite differences" else r.tol < 1e-5
    # rev only: the vjp is checked against finite differences
    rows = check_grads(jnp.sin, (jnp.arange(3.0),), order=1, modes=("rev",))
    assert [(r.mode, r.against) for r in rows] == [("rev", "finite differences")]


def test_order_three(x64):
    rows = check_grads(lambda x: jnp.exp(jnp.sin(x)), (0.5,), order=3)
    assert len(rows) == 2 + 4 + 8
    assert "rev-over-fwd-over-rev" in {r.mode for r in rows}
    assert all(r.passed for r in rows)


def test_non_float_leaves_are_not_perturbed(x64):
    rows = check_grads(pytree_fn, _pytree_args(), order=1)
    assert {r.argument for r in rows} == {"params", "x"}  # n (an int) gets no row
    with pytest.raises(TypeError, match=r"no argument has a floating-point leaf.*\bi\b.*\bj\b"):
        check_grads(lambda i, j: i * j, (jnp.arange(3), True))


def test_argument_names_without_signature(x64):
    rows = check_grads(lambda *a: a[0] * a[1], (1.0, 2.0), order=1, modes=("fwd",))
    assert [r.argument for r in rows] == ["args[0]", "args[1]"]


def test_complex_arguments(x64):
    z = jnp.array([0.3 + 1.0j, -0.5 + 0.2j])
    rows = check_grads(lambda z: jnp.sin(z) * jnp.conj(z), (z,), order=2)
    assert all(r.passed for r in rows)


def test_without_jit(x64):
    rows = check_grads(sin_times, _xy(), order=1, modes=("fwd",), jit=False, atol=10.0)
    assert [r.argument for r in rows] == ["x", "y"]


# ---------------------------------------------------------------------------
# check_grads on wrong derivatives.


def test_wrong_custom_jvp_names_the_argument(x64):
    with pytest.raises(AssertionError) as info:
        check_grads(sin_times, _xy(), order=2)
    err = info.value
    assert isinstance(err, GradCheckError)
    failed = [r for r in err.rows if not r.passed]
    assert failed and {r.argument for r in failed} == {"y"}
    assert {(r.mode, r.against) for r in failed} == {
        ("fwd", "finite differences"),
        ("fwd-over-fwd", "finite differences"),
    }
    assert all(r.passed for r in err.rows if r.argument == "x")
    # the message is the table: a header, then one line per row, failing ones marked
    message = str(err)
    assert message.startswith(f"check_grads: {len(failed)} of {len(err.rows)} checks failed")
    for column in ("argument", "mode", "order", "against", "max abs error", "tolerance", "status"):
        assert column in message
    marked = [line for line in message.splitlines() if line.startswith(">")]
    assert len(marked) == len(failed)
    assert all(line.split()[1] == "y" and line.endswith("FAIL") for line in marked)
    assert message == f"check_grads: {len(failed)} of {len(err.rows)} checks failed\n" + (
        format_table(err.rows)
    )


def test_wrong_custom_vjp_in_reverse_mode(x64):
    with pytest.raises(GradCheckError) as info:
        check_grads(scaled_exp, _xy(), order=1, modes=("rev",))
    failed = [r for r in info.value.rows if not r.passed]
    assert [(r.argument, r.mode, r.against) for r in failed] == [("x", "rev", "finite differences")]
    assert failed[0].max_rel_err > 0.1


def test_custom_vjp_has_no_forward_mode(x64):
    with pytest.raises(TypeError) as info:
        check_grads(scaled_exp, _xy(), order=1)
    assert any("with respect to x" in note for note in info.value.__notes__)


def test_nan_derivative_fails(x64):
    @jax.custom_jvp
    def f(x):
        return x**2

    f.defjvp(lambda p, t: (f(p[0]), jnp.nan * t[0]))
    with pytest.raises(GradCheckError) as info:
        check_grads(f, (jnp.arange(3.0),), order=1, modes=("fwd",))
    (row,) = info.value.rows
    assert np.isnan(row.max_abs_err) and not row.passed
    assert "nan" in str(info.value)


# ---------------------------------------------------------------------------
# References.


def test_reference_agrees(x64):
    def reference(x, y):  # the same function, computed differently
        return jnp.cos(x - jnp.pi / 2) * y

    rows = check_grads(lambda x, y: jnp.sin(x) * y, _xy(), order=2, reference=reference)
    assert all(r.passed for r in rows)
    value = rows[0]
    assert (value.argument, value.mode, value.order, value.against) == (
        "all",
        "value",
        0,
        "reference",
    )
    ref_rows = [r for r in rows if r.against == "reference"]
    assert len(ref_rows) == 1 + 2 * 6  # the value, then one per derivative and argument
    assert {r.mode for r in ref_rows} == ORDER2_MODES | {"value"}
    assert max(r.tol for r in ref_rows) < 1e-6  # tighter than finite differences


def test_reference_mismatch_is_detected(x64):
    x, y = _xy()
    # same values, derivative wrong in y: only the reference rows for y fail
    with pytest.raises(GradCheckError) as info:
        check_grads(lambda x, y: jnp.sin(x) * y, _xy(), order=1, reference=sin_times)
    failed = [r for r in info.value.rows if not r.passed]
    assert {(r.argument, r.against) for r in failed} == {("y", "reference")}
    assert {r.mode for r in failed} == {"fwd", "rev"}
    # different values: the value row fails
    with pytest.raises(GradCheckError) as info:
        check_grads(jnp.sin, (x,), order=1, reference=lambda x: jnp.sin(x) + 1e-6)
    failed = [r for r in info.value.rows if not r.passed]
    assert [(r.argument, r.mode, r.order) for r in failed] == [("all", "value", 0)]


def test_reference_with_other_shapes_is_an_error(x64):
    with pytest.raises(ValueError, match="reference"):
        check_grads(jnp.sin, (jnp.arange(3.0),), reference=lambda x: jnp.sin(x)[:2])


# ---------------------------------------------------------------------------
# Tolerances and dtypes.


def test_float32_default_tolerances():
    assert not jax.config.jax_enable_x64
    A, B = _matrices(jnp.float32)
    rows = check_grads(matrix_fn, (A, B), order=2)
    assert all(r.passed for r in rows)
    assert all(r.tol >= 1e-2 for r in rows if r.against == "finite differences")
    # a factor-2 error is still caught in float32
    with pytest.raises(GradCheckError, match="FAIL"):
        check_grads(sin_times, _xy(jnp.float32), order=1)


def test_tolerance_mapping_and_eps(x64):
    rows = check_grads(
        sin_times, _xy(), order=1, atol={"finite differences": 10.0}, rtol=0.0, eps=1e-6
    )
    assert all(r.passed for r in rows)  # the factor 2 hides under atol=10
    assert {r.tol for r in rows if r.against == "finite differences"} == {10.0}
    assert {r.tol for r in rows if r.against == "jvp"} == {1e-8}
    with pytest.raises(ValueError, match="unknown tolerance keys"):
        check_grads(jnp.sin, (1.0,), atol={"fd": 1.0})


def test_bad_order_and_modes():
    for kwargs in ({"order": 0}, {"order": 1.5}, {"modes": ()}, {"modes": ("lin",)}):
        with pytest.raises(ValueError):
            check_grads(jnp.sin, (1.0,), **kwargs)


# ---------------------------------------------------------------------------
# format_table.


def test_format_table():
    rows = [
        GradCheckRow("x", "fwd", 1, "finite differences", 1.5e-11, 2e-11, 1e-5, True),
        GradCheckRow("y", "rev", 1, "jvp", 0.25, float("inf"), float("nan"), False),
    ]
    plain = format_table(rows).splitlines()
    assert plain[0].split() == [
        "argument", "mode", "order", "against", "max", "abs", "error",
        "max", "rel", "error", "tolerance", "status",
    ]  # fmt: skip
    assert plain[2].split() == ["x", "fwd", "1", "finite", "differences", "1.50e-11",
                                "2.00e-11", "1.00e-05", "ok"]  # fmt: skip
    assert plain[3].split() == [">", "y", "rev", "1", "jvp", "2.50e-01", "inf", "nan", "FAIL"]
    md = format_table(rows, markdown=True, problems=["p1", "p2"]).splitlines()
    assert md[0].startswith("| problem | argument | mode |")
    assert md[1] == "|---|---|---|---:|---|---:|---:|---:|---|"
    assert md[3] == "| p2 | y | rev | 1 | jvp | 2.50e-01 | inf | nan | FAIL |"
    with pytest.raises(ValueError):
        format_table(rows, problems=["p1"])


# ---------------------------------------------------------------------------
# The command line.


@pytest.fixture
def registry(monkeypatch):
    """An empty registry of extra problems, and no entry points, for the test's duration."""
    monkeypatch.setattr(gradcheck._catalogue, "_REGISTERED", {})
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [])


BUILTINS = ["newton-sqrt", "root-y2-x3", "ridge-regression", "linear-system"]


def _problem(name, fn, args, reference=None, **kwargs):
    return Problem(name, lambda: (fn, args, reference), description=f"test {name}", **kwargs)


def test_cli_list(registry, capsys):
    assert main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == BUILTINS
    assert all(len(line.split()) > 1 for line in lines)  # with a description


def _detail(text):
    """The detailed table (and summary line) of the CLI's output, after the overview."""
    overview, detail = text.split("\n\n", 1)
    return detail


def test_cli_runs_the_linear_system(registry, capsys):
    old = jax.config.jax_enable_x64
    assert main(["-k", "linear"]) == 0
    assert jax.config.jax_enable_x64 == old  # restored
    captured = capsys.readouterr()
    overview = captured.out.split("\n\n")[0].splitlines()
    assert overview[0].split()[:3] == ["problem", "checks", "failed"]
    assert overview[2].split()[:3] == ["linear-system", "25", "0"]
    assert overview[2].endswith("ok")
    out = _detail(captured.out).splitlines()
    header = out[0].split()
    assert header[:3] == ["problem", "argument", "mode"] and header[-1] == "status"
    body = out[2:-1]
    assert len(body) == 1 + 2 * 2 * 6  # value, then (A, b) x (vs fd/jvp, vs reference) x 6
    assert all(line.split()[0] == "linear-system" and line.endswith("ok") for line in body)
    assert {line.split()[1] for line in body} == {"all", "A", "b"}
    assert out[-1] == f"1 problems, {len(body)} checks, 0 failed"
    assert "[1/1] linear-system ... ok" in captured.err


def test_cli_order_and_glob(registry, capsys):
    register(_problem("sine", jnp.sin, (0.5,), jnp.sin))
    register(_problem("cosine", jnp.cos, (0.5,)))
    assert main(["-k", "s*e", "--order", "1"]) == 0  # a glob: sine only
    out = _detail(capsys.readouterr().out).splitlines()
    assert {line.split()[0] for line in out[2:-1]} == {"sine"}
    assert out[-1] == "1 problems, 5 checks, 0 failed"
    assert main(["-k", "SINE", "-k", "cos"]) == 0  # substrings, any case; order 2
    assert capsys.readouterr().out.splitlines()[-1] == "2 problems, 19 checks, 0 failed"


def test_cli_registered_failing_problem(registry, capsys):
    register(_problem("bad-jvp", sin_times, _xy(), order=1))
    register(_problem("good", jnp.sin, (jnp.arange(3.0),), order=1))
    assert main(["-k", "bad-jvp", "-k", "good"]) == 1
    out = capsys.readouterr().out
    failing = [line for line in out.splitlines() if line.startswith(">")]
    assert failing and all(line.split()[1:3] == ["bad-jvp", "y"] for line in failing)
    assert all(line.endswith("FAIL") for line in failing)
    assert out.splitlines()[-1] == f"2 problems, 6 checks, {len(failing)} failed"


def test_cli_problem_that_raises(registry, capsys):
    def build():
        raise RuntimeError("cannot build")

    register(Problem("broken", build))
    register(_problem("fine", jnp.sin, (1.0,), order=1))
    assert main(["-k", "broken", "-k", "fine"]) == 1
    captured = capsys.readouterr()
    assert "ERROR broken: RuntimeError: cannot build" in captured.out
    assert captured.out.splitlines()[-1] == (
        "2 problems, 2 checks, 0 failed, 1 problems raised an error"
    )
    assert "broken ... ERROR" in captured.err


def test_cli_markdown_and_output(registry, capsys, tmp_path):
    register(_problem("sine", jnp.sin, (jnp.arange(3.0),), order=1))
    path = tmp_path / "table.md"
    assert main(["-k", "sine", "--markdown", "--output", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| problem | checks | failed | worst vs finite differences |")
    assert _detail(out).startswith("| problem | argument | mode | order | against |")
    assert "| sine | x | fwd | 1 | finite differences |" in out
    assert path.read_text() == out
    assert main(["-k", "sine", "--output", str(tmp_path / "no" / "such" / "dir")]) == 2


def test_cli_usage_errors(registry, capsys):
    assert main(["--no-such-option"]) == 2
    assert main(["--order", "zero"]) == 2
    assert main(["--order", "0"]) == 2
    assert main(["-k", "no-such-problem"]) == 2
    err = capsys.readouterr().err
    assert "no problem matches 'no-such-problem'" in err
    assert main(["--help"]) == 0


def test_register_rejects_duplicates(registry):
    register(_problem("sine", jnp.sin, (1.0,)))
    for name in ("sine", "newton-sqrt"):
        with pytest.raises(ValueError, match="already exists"):
            register(_problem(name, jnp.sin, (1.0,)))
    with pytest.raises(TypeError):
        register(("sine", jnp.sin))


class _EntryPoint:
    def __init__(self, name, load):
        self.name, self.value, self.load = name, f"pkg:{name}", load


def test_entry_point_problems(monkeypatch, capsys):
    monkeypatch.setattr(gradcheck._catalogue, "_REGISTERED", {})
    seen = {}

    def fake_entry_points(group):
        seen["group"] = group
        provider = lambda: [_problem("plugin-tanh", jnp.tanh, (jnp.arange(2.0),), order=1)]
        return [_EntryPoint("good", lambda: provider)]

    monkeypatch.setattr("importlib.metadata.entry_points", fake_entry_points)
    assert main(["--list"]) == 0
    assert seen["group"] == "implicitdiff.gradcheck"
    listed = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert listed[-1] == ["plugin-tanh", "test", "plugin-tanh"]
    assert main(["-k", "plugin"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "1 problems, 2 checks, 0 failed"

    def broken():
        raise ImportError("no module named solvers")

    monkeypatch.setattr(
        "importlib.metadata.entry_points", lambda group: [_EntryPoint("bad", broken)]
    )
    assert main(["--list"]) == 0  # listed with a warning
    assert "entry point 'bad' (pkg:bad): ImportError" in capsys.readouterr().err
    register(_problem("sine", jnp.sin, (1.0,), order=1))
    assert main(["-k", "sine"]) == 1  # a run with a broken catalogue fails


def test_module_entry_point_and_cheap_import():
    code = (
        "import sys, implicitdiff.gradcheck; "
        "assert 'solvers' not in sys.modules; "
        "sys.argv = ['implicitdiff.gradcheck', '--list']; "
        "import runpy; runpy.run_module('implicitdiff.gradcheck', run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "newton-sqrt" in proc.stdout


# ---------------------------------------------------------------------------
# Quick checks: every argument at once, one trace of the function per argument.


def test_all_arguments_at_once(x64):
    rows = check_grads(matrix_fn, _matrices(), order=2, per_argument=False)
    assert [r.argument for r in rows] == ["all"] * 6
    assert {r.mode for r in rows} == ORDER2_MODES
    assert all(r.passed for r in rows)
    # a wrong derivative in one argument is still caught, without naming it
    with pytest.raises(GradCheckError) as info:
        check_grads(sin_times, _xy(), order=1, per_argument=False)
    failed = [r for r in info.value.rows if not r.passed]
    assert [(r.argument, r.mode, r.against) for r in failed] == [
        ("all", "fwd", "finite differences")
    ]
    # with one argument the rows name it, as per argument
    rows = check_grads(jnp.sin, (jnp.arange(3.0),), order=1, per_argument=False)
    assert {r.argument for r in rows} == {"x"}


@pytest.mark.parametrize("per_argument", [True, False])
def test_function_traced_once_per_checked_argument(x64, per_argument):
    # Under jit the finite differences, jvp and vjp (and the next order) reuse one trace.
    calls = []

    def f(x, y):
        calls.append("f")
        return jnp.sin(x) * y

    def reference(x, y):
        calls.append("reference")
        return jnp.cos(x - jnp.pi / 2) * y

    check_grads(f, _xy(), order=2, reference=reference, per_argument=per_argument)
    groups = 2 if per_argument else 1
    assert calls.count("f") == 1 + groups  # the value row, then one trace per group
    assert calls.count("reference") == 1 + groups


def test_problem_rejects_bad_orders():
    with pytest.raises(ValueError, match="`quick_order` must be an integer >= 1"):
        Problem("p", lambda: (jnp.sin, (1.0,)), quick_order=0)
    with pytest.raises(ValueError, match="`order` must be an integer >= 1"):
        Problem("p", lambda: (jnp.sin, (1.0,)), order=1.5)


def test_cli_quick_run_and_full(registry, monkeypatch, capsys):
    monkeypatch.setattr(gradcheck._catalogue, "_builtin_problems", lambda: ())
    register(_problem("two-args", lambda x, y: jnp.sin(x) * y, _xy(), order=2, quick_order=1))
    register(_problem("heavy", jnp.cos, (0.5,), quick=False))
    # --list marks the problems that only --full (or -k) runs
    assert main(["--list"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "[--full]" in listed["heavy"] and "[--full]" not in listed["two-args"]

    # the default run: quick problems only, all arguments at once, to the quick order
    assert main([]) == 0
    out = capsys.readouterr().out
    detail = _detail(out).splitlines()
    ran = {line.split()[0] for line in detail[2:-1]}
    assert ran == {"two-args"}
    two = [line.split() for line in detail[2:-1] if line.split()[0] == "two-args"]
    assert [(r[1], r[2], r[3]) for r in two] == [("all", "fwd", "1"), ("all", "rev", "1")]
    assert detail[-1] == (
        "1 problems, 2 checks, 0 failed (quick run: arguments perturbed together, 1 problems"
        " to a lower order, 1 left out; --full checks them all)"
    )

    # --full: every problem, one argument at a time, to its full order
    assert main(["--full"]) == 0
    detail = _detail(capsys.readouterr().out).splitlines()
    assert {line.split()[0] for line in detail[2:-1]} == {"two-args", "heavy"}
    two = [line.split() for line in detail[2:-1] if line.split()[0] == "two-args"]
    assert {r[1] for r in two} == {"x", "y"} and {r[3] for r in two} == {"1", "2"}
    assert detail[-1] == f"2 problems, {len(detail) - 3} checks, 0 failed"

    # -k picks from the whole catalogue and checks in full
    assert main(["-k", "heavy"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "1 problems, 6 checks, 0 failed"


def test_quick_catalogue_covers_each_family():
    # the installed catalogue (with the solvers' entry point): one quick problem per family
    warnings = []
    catalogue = {p.name: p for p in gradcheck.problems(warnings=warnings)}
    assert not warnings
    quick = {name for name, p in catalogue.items() if p.quick}
    for family in ("newton-sqrt", "odeint-pendulum", "ridge-regression", "deq-"):
        assert any(name.startswith(family) for name in quick), family
    assert len(quick) < len(catalogue)  # the slow problems wait for --full
    assert not catalogue["minimize-ridge"].quick


@pytest.mark.slow
def test_cli_default_run_is_the_quick_catalogue(capsys):
    # the command with no arguments, on the installed catalogue: every check passes
    assert main([]) == 0
    overview = capsys.readouterr().out.split("\n\n")[0].splitlines()[2:]
    names = [line.split()[0] for line in overview]
    assert all(line.endswith("ok") for line in overview)
    for family in ("newton-sqrt", "odeint-pendulum", "ridge-regression", "deq-"):
        assert any(name.startswith(family) for name in names), family
