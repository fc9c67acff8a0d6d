"""The native extension's FFI path: handlers, devices, lowering.

Runs wherever the extension is built: the emulated device everywhere, the Metal device only on a
Mac with a Metal GPU (those tests are skipped elsewhere). Numbers are checked against the float64
oracle (tests/helpers/oracle.py) with the tolerances of docs/testing.md#tolerances, or against exact
expected values.
"""

import contextlib
import re
import shutil
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
import tolerance
from api_helpers import HEAD_DIMS, check_against_oracle, make_inputs

ext = pytest.importorskip("jax_flash_metal._ext")
from jax_flash_metal import flash_attention
from jax_flash_metal.fused import ffi_lowering  # noqa: E402
from jax_flash_metal import reference_attention  # noqa: E402
from jax_flash_metal.core.contract import HOST_ONLY_PARAMS, OPERAND_FLAGS, StaticParams  # noqa: E402
from jax_flash_metal.lowering.dispatch import ENV_IMPLEMENTATION as ENV  # noqa: E402
from jax_flash_metal.lowering import dispatch
from ffi_targets import (BWD, FWD, attributes, bwd_call, forward_workspace,  # noqa: E402
                         fwd_call, submission_budget)

EMPTY_ROW_MAX = np.float32(8.50705917e37)  # JFM_EMPTY_ROW_MAX of shaders/attention_params.h

requires_metal = pytest.mark.skipif(not ext.metal_available(),
                                    reason="needs a Metal GPU: " + ext.metal_unavailable_reason())


def _normal(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)


@contextlib.contextmanager
def _emulator_fault(kernel):
    ext.testing.set_emulator_fault(kernel)
    try:
        yield
    finally:
        ext.testing.set_emulator_fault("")


@contextlib.contextmanager
def _emulator_schedule(name, seed=0):
    before = ext.emulator_schedule()
    ext.set_emulator_schedule(name, seed)
    try:
        yield
    finally:
        ext.set_emulator_schedule(*before)


# ------------------------------------------------------------------ build and registration

def test_build_has_emulator_targets_and_every_contract_kernel():
    assert {FWD, BWD} <= set(ext.ffi_targets())
    assert "emulator" in ffi_lowering.available_implementations()
    names = set(ext.kernel_names("emulator"))
    for t in ("f32", "f16", "bf16"):
        for d in HEAD_DIMS:
            for stage in ("fwd", *ext.bwd_stages(d)):
                assert f"flash_attention_{stage}_{t}_d{d}" in names
    assert ext.device_name("emulator")


def test_metal_reports_consistently():
    if ext.metal_available():
        assert ext.metal_unavailable_reason() == ""
        assert "metal" in ffi_lowering.available_implementations()
        assert ext.device_name("metal")
    else:
        assert ext.metal_unavailable_reason()
        assert "metal" not in ffi_lowering.available_implementations()
        with pytest.raises(ValueError, match="Metal|metal"):
            ext.kernel_names("metal")


def test_public_helpers_report_this_build():
    import jax_flash_metal

    assert jax_flash_metal.metal_available() == ext.metal_available()
    devices = jax_flash_metal.devices()
    assert list(devices) == ["xla", "emulator", "metal"]
    runnable = [n for n, d in devices.items() if not d.startswith("unavailable: ")]
    assert runnable == jax_flash_metal.implementations.available()
    assert devices["emulator"] == ext.device_name("emulator")
    if ext.metal_available():
        assert devices["metal"] == ext.device_name("metal")
    else:  # the reason Metal cannot run is shown, and is the one explicit requests raise with
        assert devices["metal"] == "unavailable: " + ext.metal_unavailable_reason()
        q = jnp.zeros((1, 4, 1, 16))
        with pytest.raises(NotImplementedError, match=re.escape(ext.metal_unavailable_reason())):
            jax.jit(lambda q: flash_attention(q, q, q, implementation="metal")).lower(q)


@pytest.mark.parametrize("traits, reason", [
    (("Apple M1", True, True, 32), ""),
    (("Apple M1", True, True, 0), ""),  # no pipeline built yet
    (("AMD Radeon Pro 5500M", False, False, 0), "'AMD Radeon Pro 5500M' is not in GPU family"),
    (("Intel UHD Graphics 630", False, True, 0), "not in GPU family Apple7"),
    (("Some GPU", True, False, 32), "has no unified memory"),
    (("Some GPU", True, True, 64), "runs 64-wide simdgroups; the kernels need 32"),
])
def test_metal_gate_accepts_only_apple_silicon_traits(traits, reason):
    """The gate the Metal device applies at creation (family, unified memory) and to every
    pipeline (threadExecutionWidth); plain C++, so it is checked here on every platform."""
    got = ext.testing.metal_gate(*traits)
    assert got == "" if not reason else reason in got


def test_embedded_shader_sources_inline_quoted_includes(request):
    shader_dir = request.config.rootpath / "shaders"
    sources = ext.shader_sources()
    assert sorted(sources) == sorted(p.name for p in shader_dir.glob("*.metal"))
    header_lines = (shader_dir / "attention_params.h").read_text().splitlines()
    for name, text in sources.items():
        assert '#include "' not in text, name
        embedded = set(text.splitlines())
        original = (shader_dir / name).read_text().splitlines()
        assert all(line in embedded for line in original if '#include "' not in line), name
        assert all(line in embedded for line in header_lines if '#include "' not in line), name


def test_embed_script_inlines_each_header_once_and_escapes_exactly(request, tmp_path):
    """ffi/embed_shaders.py (the build step): nested quoted includes inlined once per source,
    #line directives back to the original file, angle includes kept, bytes escaped losslessly
    (C and Python agree on the escapes used, so the literal can be decoded here)."""
    import ast
    import importlib.util

    path = request.config.rootpath / "ffi" / "embed_shaders.py"
    spec = importlib.util.spec_from_file_location("embed_shaders", path)
    embed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(embed)
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "leaf.h").write_text("int leaf;\n")
    (tmp_path / "mid.h").write_text('#include "inc/leaf.h"\nint mid;\n')
    (tmp_path / "k.metal").write_text(
        '#include <metal_stdlib>\n#include "mid.h"\n#include "inc/leaf.h"\n'
        '// caf\u00e9 "q" \\ \t end\nkernel void k() {}')
    text = embed.inline(str(tmp_path / "k.metal"), set())
    assert text == ('#line 1 "k.metal"\n#include <metal_stdlib>\n'
                    '#line 1 "mid.h"\n#line 1 "leaf.h"\nint leaf;\n#line 2 "mid.h"\nint mid;\n'
                    '#line 3 "k.metal"\n#line 4 "k.metal"\n'
                    '// caf\u00e9 "q" \\ \t end\nkernel void k() {}\n')
    literal = embed.c_literal(text)
    decoded = b"".join(ast.literal_eval("b" + piece.strip()) for piece in literal.split("\n"))
    assert decoded == text.encode("utf-8")


# ------------------------------------------------------------------ handler validation

_Q = jnp.zeros((1, 4, 2, 16), jnp.float32)
_K = jnp.zeros((1, 5, 1, 16), jnp.float32)
_PAGES = jnp.zeros((3, 16, 1, 16), jnp.float32)
_LENGTH = jnp.ones((1,), jnp.int32)


@pytest.mark.parametrize("args, kwargs, message", [
    ((_Q, _K, _K), dict(window_left=np.int32(-2)), "window_left/window_right must be >= 0"),
    ((_Q, _K, _K), dict(kernel_variant=np.int32(2)), r"kernel_variant must be in \[0, 2\)"),
    ((_Q, _K, _K), dict(bias_grad=True), "bias_grad and alibi_grad are the backward's"),
    ((_Q, _K, _K), dict(alibi_grad=True), "bias_grad and alibi_grad are the backward's"),
    ((_Q, _K, _K), dict(has_q_lengths=True),
     r"expected 1 optional operand\(s\) after the arrays \(q_lengths,"),
    ((_Q, _K, _K, jnp.zeros((1,), jnp.int32)), dict(), "expected 0 optional operand"),
    ((_Q, _K, _K, jnp.zeros((2,), jnp.int32)), dict(has_kv_lengths=True),
     r"kv_lengths must be int32 \[1\]"),
    ((_Q, _K, _K, jnp.zeros((1,), jnp.float32)), dict(has_q_lengths=True),
     r"q_lengths must be int32 \[1\]"),
    ((_Q, _K, _K), dict(lse_shape=(1, 2, 5)), r"output lse must be float32 \[1, 2, 4\]"),
    ((_Q, _K, _K), dict(residual_shape=(1, 4)), r"output row_max must be float32 \[1, 2, 4\]"),
    ((_Q, _K, _K), dict(workspace=jax.ShapeDtypeStruct((3,), jnp.float32)),
     r"workspace must be float32 \[144\]"),
    ((_Q[0], _K[0], _K[0]), dict(), "query must have rank 4"),
    ((_Q, _K.astype(jnp.float16), _K.astype(jnp.float16)), dict(), "share one dtype"),
    ((_Q.astype(jnp.int32), _K, _K), dict(), "float32, float16 or bfloat16"),
    ((_Q, _K, jnp.zeros((1, 6, 1, 16))), dict(), "value shape"),
    ((jnp.zeros((1, 4, 3, 16)), _K[:, :, :1].repeat(2, 2), _K[:, :, :1].repeat(2, 2)), dict(),
     "multiple of num_kv_heads"),
    ((jnp.zeros((1, 4, 2, 24)), jnp.zeros((1, 5, 1, 24)), jnp.zeros((1, 5, 1, 24))), dict(),
     "head_dim 24 with dtype f32 is not supported by the emulator device"),
    # A paged cache: pages [num_pages, page_size, HKV, D], kv_lengths, then the table.
    ((_Q, _PAGES, _PAGES, jnp.zeros((1, 2), jnp.int32)), dict(has_page_table=True),
     "page_table needs kv_lengths"),
    ((_Q, _PAGES[:, :12], _PAGES[:, :12], _LENGTH, jnp.zeros((1, 2), jnp.int32)),
     dict(has_kv_lengths=True, has_page_table=True), "page_size 12 is not a power of two >= 16"),
    ((_Q, _PAGES, _PAGES, _LENGTH, jnp.zeros((2, 2), jnp.int32)),
     dict(has_kv_lengths=True, has_page_table=True), r"page_table must be int32 \[1, max_pages\]"),
])
def test_handler_rejects_bad_operands_and_attributes(args, kwargs, message):
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        fwd_call(*args, **kwargs)


def test_backward_handler_refuses_a_paged_cache():
    row = jnp.zeros((1, 2, 4), jnp.float32)
    with pytest.raises(jax.errors.JaxRuntimeError, match="has no backward"):
        bwd_call(_Q, _K, _K, _Q, (row, row), _Q, row, has_page_table=True)


def test_handler_rejects_missing_and_mistyped_attributes():
    attrs = attributes()
    del attrs["bottom_right"]
    row = jax.ShapeDtypeStruct((1, 2, 4), jnp.float32)
    out = (jax.ShapeDtypeStruct(_Q.shape, _Q.dtype), row, row, row,
           forward_workspace(_Q, _K))
    with pytest.raises(jax.errors.JaxRuntimeError, match="attributes"):
        jax.block_until_ready(jax.ffi.ffi_call(FWD, out)(_Q, _K, _K, **attrs))
    # Attributes are typed: a float64 scale (what a Python float becomes under x64) is refused,
    # which is why the lowering coerces every attribute to its exact type.
    jax.config.update("jax_enable_x64", True)
    try:
        with pytest.raises(jax.errors.JaxRuntimeError, match="expected F32 but got F64"):
            fwd_call(_Q, _K, _K, scale=np.float64(0.25))
    finally:
        jax.config.update("jax_enable_x64", False)


def test_ffi_attributes_are_the_static_params():
    """One list of attributes: the handlers' (JFM_FFI_ATTRIBUTES, as the extension lists it) is
    the primitives' static params without the host-only ones, plus the backward's bias_grad and
    alibi_grad, so no static param is dropped or invented on the way to the kernels."""
    names = [name for name, _ in ext.ffi_attributes()]
    assert names == [*(f for f in StaticParams._fields if f not in HOST_ONLY_PARAMS), "bias_grad",
                     "alibi_grad"]
    assert set(attributes()) == set(names)  # the direct calls' helper (ffi_targets.attributes)


def test_ffi_optional_operands_are_the_contracts():
    """One list of optional operands: the handlers' (JFM_OPTIONAL_OPERANDS, as the extension
    lists it) is contract.Operands's, in the same order, each with the same flag."""
    assert ext.optional_operands() == list(OPERAND_FLAGS.items())
    assert set(OPERAND_FLAGS.values()) <= set(StaticParams._fields)


def test_lowering_types_attributes_exactly_under_x64():
    rng = np.random.default_rng(3)
    q, k, v = _normal(rng, (1, 5, 2, 16)), _normal(rng, (1, 6, 1, 16)), _normal(rng, (1, 6, 1, 16))
    expected = oracle.attention(q, k, v, scale=0.3, local_window_size=(2, 1))[0]
    jax.config.update("jax_enable_x64", True)
    try:
        out = flash_attention(q, k, v, scale=0.3, local_window_size=(2, 1),
                              implementation="emulator")
    finally:
        jax.config.update("jax_enable_x64", False)
    tolerance.assert_matches_oracle("o", out, expected)


def test_unsupported_head_dim_fails_at_trace_time():
    q = jax.ShapeDtypeStruct((1, 8, 2, 24), jnp.float16)
    fwd = jax.jit(lambda q, k, v: flash_attention(q, k, v, implementation="emulator"))
    with pytest.raises(ValueError, match=r"head_dim 24 .* not supported .*'emulator'.*\[8, 16, 32"):
        fwd.lower(q, q, q)
    grad = jax.jit(jax.grad(lambda q, k, v: flash_attention(
        q, k, v, implementation="emulator").astype(jnp.float32).sum()))
    with pytest.raises(ValueError, match="head_dim 24"):
        grad.lower(q, q, q)


def test_best_available_falls_back_to_xla_for_calls_the_kernels_lack(monkeypatch):
    """implementation=None without an environment override: a call the fused kernels cover
    lowers to the preferred fused implementation, one they lack (head_dim 24) to xla and matches
    the oracle; the fused implementation asked for explicitly (argument or environment) raises
    naming the reason. The emulator stands in for Metal as the preferred fused implementation,
    so the rule runs where Metal does not."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(dispatch, "_PREFERENCE", ("emulator",))
    covered = jax.ShapeDtypeStruct((1, 5, 2, 16), jnp.float32)
    lacking = jax.ShapeDtypeStruct((1, 5, 2, 24), jnp.float32)
    assert f"@{FWD}" in _loss(None).lower(covered, covered, covered).as_text()
    assert f"@{BWD}" in _loss(None).lower(covered, covered, covered).as_text()
    assert "jax_flash_metal_attention" not in _loss(None).lower(lacking, lacking, lacking).as_text()
    inputs = make_inputs(4, 1, 5, 7, 2, 1, 24, jnp.float32)
    check_against_oracle(*inputs, implementation=None, is_causal=True)
    reason = r"head_dim 24 with dtype float32 is not supported by the 'emulator' implementation"
    with pytest.raises(ValueError, match=reason) as raised:
        _loss("emulator").lower(lacking, lacking, lacking)
    # In user terms: the head dims that run, never the kernels' internal names.
    assert "head dims [8, 16, 32," in str(raised.value) and "flash_attention_" not in str(
        raised.value)
    monkeypatch.setenv(ENV, "emulator")
    with pytest.raises(ValueError, match=reason):
        _loss(None).lower(lacking, lacking, lacking)


def test_a_metal_build_without_its_gpu_warns_with_the_reason(monkeypatch):
    """implementation=None on a macOS build whose Metal device is unavailable falls back to xla
    with a warning that carries the device's reason (here a stand-in for that build)."""
    monkeypatch.delenv(ENV, raising=False)
    why = "MTLCopyAllDevices listed no GPU; MTLCreateSystemDefaultDevice returned no GPU"
    monkeypatch.setattr(ffi_lowering, "metal_build_unavailable_reason", lambda: why)
    with pytest.warns(RuntimeWarning, match=f"Metal device is unavailable \\({why}\\)"):
        assert dispatch.resolve(None, "cpu") == "xla"


def test_one_family_preprocessing_keeps_exactly_that_family(request):
    """The Metal device compiles one (dtype, head dim) family per library by defining
    JFM_ONE_FAMILY and JFM_FAMILY_<T>_<D>=JFM_SELECTED (JFM_IF_FAMILY in
    shaders/flash_attention_common.h). Preprocess each embedded source that way with clang and
    compare the instantiated host names with the full list."""
    clang = shutil.which("clang") or pytest.skip("needs clang")
    stdinc = request.config.rootpath / "emulator" / "shim" / "stdinc"
    all_names = set(ext.kernel_names("emulator"))

    def host_names(text, *defines):
        r = subprocess.run([clang, "-E", "-x", "c++", "-std=c++14", "-undef", "-nostdinc",
                            "-D__METAL_VERSION__=300", "-isystem", str(stdinc), *defines, "-"],
                           input=text, capture_output=True, text=True, check=True)
        return set(re.findall(r'host_name\("([a-z0-9_]+)"\)', r.stdout))

    found = set()
    for text in ext.shader_sources().values():
        every = host_names(text)
        if not every:  # no instantiations: compiled whole (the self-check's probe)
            continue
        found |= every
        for type_, suffix, d in (("half", "f16", 64), ("ushort", "bf16", 16),
                                 ("float", "f32", 256), ("half", "f16", "192_v128")):
            one = host_names(text, "-DJFM_ONE_FAMILY", f"-DJFM_FAMILY_{type_}_{d}=JFM_SELECTED")
            assert one and one == {n for n in every if n.endswith(f"_{suffix}_d{d}")}
        assert host_names(text, "-DJFM_ONE_FAMILY") == set()
    # The emulator also runs its own test kernels (tests/emulator/shaders); the product's are these.
    assert found == {n for n in all_names if n.startswith("flash_attention_")}


@pytest.mark.parametrize("kernel, q_len", [("flash_attention_fwd_f32_d16", 40),
                                           ("flash_attention_decode_combine_f32_d16", 6),
                                           ("flash_attention_bwd_dkdv_f32_d16", 6)])
def test_device_error_surfaces_as_jax_exception(kernel, q_len):
    rng = np.random.default_rng(0)
    q = _normal(rng, (1, q_len, 2, 16))  # q_len <= 16: the decode kernels run the forward
    f = jax.jit(jax.grad(lambda q: flash_attention(q, q, q, implementation="emulator").sum()))
    with _emulator_fault(kernel):
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=f"emulator device error: .*injected fault in kernel {kernel}"):
            jax.block_until_ready(f(q))
    assert np.isfinite(np.asarray(f(q))).all()  # the device works again once the fault is gone


def test_emulator_schedule_setting_and_environment_syntax():
    before = ext.emulator_schedule()
    with pytest.raises(ValueError, match="unknown emulator schedule 'sideways'"):
        ext.set_emulator_schedule("sideways")
    assert ext.emulator_schedule() == before
    try:
        ffi_lowering._schedule_from_env("random:5")
        assert ext.emulator_schedule() == ("random", 5)
        ffi_lowering._schedule_from_env(" reverse ")
        assert ext.emulator_schedule() == ("reverse", 0)
        with pytest.raises(ValueError, match="JAX_FLASH_METAL_EMULATOR_SCHEDULE='random:x'"):
            ffi_lowering._schedule_from_env("random:x")
    finally:
        ext.set_emulator_schedule(*before)


# ------------------------------------------------------------------ lowering and memory

def _loss(implementation):
    def loss(q, k, v):
        return flash_attention(q, k, v, is_causal=True,
                               implementation=implementation).astype(jnp.float32).sum()
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def test_backward_handler_checks_the_dbias_result():
    """bias_grad needs a bias operand, and the dbias result must be float32 [B, H, Tq, Tkv] with
    it ([0] without it); alibi_grad needs the slopes."""
    rng = np.random.default_rng(3)
    q = _normal(rng, (1, 4, 2, 16))
    o, lse, residuals = fwd_call(q, q, q)
    g = jnp.zeros(lse.shape, jnp.float32)
    with pytest.raises(jax.errors.JaxRuntimeError, match="bias_grad needs has_bias"):
        bwd_call(q, q, q, o, residuals, q, g, bias_grad=True)
    with pytest.raises(jax.errors.JaxRuntimeError, match="alibi_grad needs has_alibi"):
        bwd_call(q, q, q, o, residuals, q, g, alibi_grad=True)
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct(q.shape, q.dtype),) * 3 + (
        jax.ShapeDtypeStruct((1, 2, 4, 3), f32), jax.ShapeDtypeStruct((0,), f32),
        jax.ShapeDtypeStruct(lse.shape, f32))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"output dbias must be float32 \[1, 2, 4, 4\]"):
        jax.block_until_ready(jax.ffi.ffi_call(BWD, out)(
            q, q, q, o, *residuals, q, g, jnp.zeros((1, 1, 1, 4), jnp.float32),
            **attributes(has_bias=True, bias_grad=np.bool_(True))))


def test_compiled_hlo_has_custom_calls_only_on_the_fused_path():
    q = jax.ShapeDtypeStruct((1, 16, 2, 32), jnp.float32)
    fused = _loss("emulator").lower(q, q, q).compile().as_text()
    assert f'custom_call_target="{FWD}"' in fused
    assert f'custom_call_target="{BWD}"' in fused
    plain = _loss("xla").lower(q, q, q).compile().as_text()
    assert "custom_call_target" not in plain


def test_fused_memory_is_linear_in_sequence_length():
    """Compile only (never run) forward+backward at length 16384: the fused path keeps no
    B*H*T^2 temporary; the dense reference_attention at a quarter of the length shows what one
    looks like."""
    heads, head_dim = 2, 64

    def temp_bytes(implementation, length):
        q = jax.ShapeDtypeStruct((1, length, heads, head_dim), jnp.float32)
        analysis = _loss(implementation).lower(q, q, q).compile().memory_analysis()
        return analysis.temp_size_in_bytes

    long, short = 16384, 8192
    fused_long, fused_short = temp_bytes("emulator", long), temp_bytes("emulator", short)
    q_bytes = long * heads * head_dim * 4
    scores_bytes = heads * long * long * 4
    assert fused_long <= 4 * q_bytes, (fused_long, q_bytes)
    assert fused_long < scores_bytes / 100
    assert fused_long <= 2.05 * fused_short, (fused_long, fused_short)
    control = 4096
    dense = jax.jit(jax.value_and_grad(
        lambda q, k, v: reference_attention(q, k, v, is_causal=True).sum(), argnums=(0, 1, 2)))
    q = jax.ShapeDtypeStruct((1, control, heads, head_dim), jnp.float32)
    assert (dense.lower(q, q, q).compile().memory_analysis().temp_size_in_bytes
            >= heads * control * control * 4)


# ------------------------------------------------------------------ host-side semantics

def test_zero_length_problems_write_exact_outputs_without_dispatch():
    rng = np.random.default_rng(1)
    q, k0 = _normal(rng, (2, 3, 4, 16)), jnp.zeros((2, 0, 2, 16), jnp.float32)
    o, lse, (row_max, log_sum) = fwd_call(q, k0, k0)
    assert np.array_equal(np.asarray(o), np.zeros(q.shape))
    assert np.array_equal(np.asarray(lse), np.full((2, 4, 3), -np.inf))
    assert np.array_equal(np.asarray(row_max), np.full((2, 4, 3), EMPTY_ROW_MAX, np.float32))
    assert np.array_equal(np.asarray(log_sum), np.zeros((2, 4, 3)))
    g = jnp.ones((2, 4, 3), jnp.float32)
    dq, dk, dv, _, _ = bwd_call(q, k0, k0, q, (g, g), q, g)
    assert np.array_equal(np.asarray(dq), np.zeros(q.shape)) and dk.shape == dv.shape == k0.shape
    q0, k = jnp.zeros((2, 0, 4, 16), jnp.float32), _normal(rng, (2, 5, 2, 16))
    g0 = jnp.zeros((2, 4, 0), jnp.float32)
    dq, dk, dv, _, _ = bwd_call(q0, k, k, q0, (g0, g0), q0, g0)
    assert dq.shape == q0.shape
    assert np.array_equal(np.asarray(dk), np.zeros(k.shape))
    assert np.array_equal(np.asarray(dv), np.zeros(k.shape))


def test_out_of_range_lengths_are_clamped():
    rng = np.random.default_rng(2)
    q, k, v = _normal(rng, (2, 5, 2, 16)), _normal(rng, (2, 7, 2, 16)), _normal(rng, (2, 7, 2, 16))
    flags = dict(has_q_lengths=True, has_kv_lengths=True, bottom_right=True, is_causal=True)
    wild = fwd_call(q, k, v, jnp.array([99, -4], jnp.int32), jnp.array([-1, 1000], jnp.int32),
                     **flags)
    clamped = fwd_call(q, k, v, jnp.array([5, 0], jnp.int32), jnp.array([0, 7], jnp.int32),
                        **flags)
    for a, b in zip(wild, clamped):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------ end to end vs the oracle

CONFIGS = {
    "plain": dict(),
    "causal_bottom_right_lengths": dict(
        is_causal=True, causal_alignment="bottom_right",
        query_seq_lengths=np.array([7, 3], np.int32),
        key_value_seq_lengths=np.array([11, 5], np.int32)),
    "window_top_left": dict(local_window_size=(3, 1), scale=-0.7),
}


def _fwd_bwd(implementation, q, k, v, do, g_lse, config):
    config = dict(config)
    lengths = {n: jnp.asarray(config.pop(n)) for n in ("query_seq_lengths",
                                                       "key_value_seq_lengths") if n in config}

    def f(q, k, v):
        return flash_attention(q, k, v, return_lse=True, implementation=implementation,
                               **lengths, **config)

    (o, lse), vjp = jax.vjp(f, q, k, v)
    dq, dk, dv = vjp((do, g_lse))
    return dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv)


def _check_against_oracle(implementation, dtype, config_name, head_dim=16):
    config = CONFIGS[config_name]
    rng = np.random.default_rng(7)
    b, tq, tkv, h, hkv = 2, 7, 11, 4, 2
    q = _normal(rng, (b, tq, h, head_dim), dtype)
    k = _normal(rng, (b, tkv, hkv, head_dim), dtype)
    v = _normal(rng, (b, tkv, hkv, head_dim), dtype)
    do = _normal(rng, (b, tq, h, head_dim), dtype)
    g_lse = _normal(rng, (b, h, tq))
    got = _fwd_bwd(implementation, q, k, v, do, g_lse, config)
    o, lse = oracle.attention(q, k, v, **config)
    dq, dk, dv = oracle.attention_grads(q, k, v, do, g_lse, **config)
    expected = dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv)
    base = tolerance.baseline(q, k, v, do, g_lse, **config) if dtype != jnp.float32 else {}
    for name in expected:
        assert got[name].dtype == (jnp.float32 if name == "lse" else dtype)
        tolerance.assert_matches_oracle(name, got[name], expected[name], base.get(name))
    return got


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_emulator_matches_oracle(dtype, config_name):
    _check_against_oracle("emulator", dtype, config_name)


def test_split_submissions_and_schedules_are_bit_identical():
    """Splitting a call into one submission per threadgroup and resuming emulated threads in
    reverse or random order must not change a single bit. The schedules also reorder the
    dispatches between two memory barriers of one submission (the backward's dQ and dK/dV
    stages share one), so a missing barrier would show here."""
    reference = _check_against_oracle("emulator", jnp.float32, "causal_bottom_right_lengths", 32)
    variants = {"one threadgroup per submission": submission_budget(1e-12),
                "reverse schedule": _emulator_schedule("reverse"),
                "random schedule": _emulator_schedule("random", 1234)}
    for label, setting in variants.items():
        with setting:
            got = _check_against_oracle("emulator", jnp.float32, "causal_bottom_right_lengths", 32)
        for name in reference:
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(reference[name]),
                                          err_msg=f"{label}: {name}")


def test_debug_environment_variable_syntax():
    """$JAX_FLASH_METAL_DEBUG: the usual words for on and off, anything else a ValueError naming
    the variable; the native switch follows."""
    before = ext.metal_debug()
    try:
        for value, on in (("1", True), (" On ", True), ("yes", True), ("", False),
                          ("0", False), ("False", False), ("off", False)):
            ffi_lowering._debug_from_env(value)
            assert ext.metal_debug() is on, value
        with pytest.raises(ValueError, match=r"JAX_FLASH_METAL_DEBUG='2'"):
            ffi_lowering._debug_from_env("2")
    finally:
        ext.set_metal_debug(before)


def test_gpu_core_count_prefers_a_plausible_registry_value():
    """The Metal device's rule: the IORegistry's gpu-core-count when in 1..1024, else the name
    table (0 = the property could not be read)."""
    assert ext.testing.gpu_core_count(24, "Apple M2 Max") == 24
    assert ext.testing.gpu_core_count(0, "Apple M2 Max") == 38
    assert ext.testing.gpu_core_count(-3, "Apple M1") == 8
    assert ext.testing.gpu_core_count(5000, "Some future GPU") == 10


def test_gpu_seconds_total_is_metal_only():
    """The emulated device has no GPU clock (None); an unavailable device is a ValueError."""
    assert ext.gpu_seconds_total("emulator") is None
    with pytest.raises(ValueError, match="no device 'nope'"):
        ext.gpu_seconds_total("nope")
    if not ext.metal_available():
        with pytest.raises(ValueError, match="(?i)metal"):
            ext.gpu_seconds_total("metal")


# ------------------------------------------------------------------ macOS with a Metal GPU only

@requires_metal
@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_metal_matches_oracle(dtype, config_name):
    _check_against_oracle("metal", dtype, config_name)


@requires_metal
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_metal_agrees_with_emulator(dtype):
    """Same kernels, same inputs: masked structure (exact zeros, -inf LSE) is bit-identical and
    values agree to a few ulps (GPU exp2 and fused multiply-adds may round differently)."""
    rng = np.random.default_rng(11)
    q, k = _normal(rng, (2, 33, 4, 64), dtype), _normal(rng, (2, 40, 2, 64), dtype)
    v, do = _normal(rng, (2, 40, 2, 64), dtype), _normal(rng, (2, 33, 4, 64), dtype)
    g_lse = _normal(rng, (2, 4, 33))
    config = dict(is_causal=True, causal_alignment="bottom_right",
                  query_seq_lengths=np.array([33, 20], np.int32),
                  key_value_seq_lengths=np.array([17, 40], np.int32))
    metal = _fwd_bwd("metal", q, k, v, do, g_lse, config)
    emulated = _fwd_bwd("emulator", q, k, v, do, g_lse, config)
    rtol = 1e-5 if dtype == jnp.float32 else 2e-2
    for name in metal:
        a = np.asarray(metal[name], np.float64)
        e = np.asarray(emulated[name], np.float64)
        np.testing.assert_array_equal(a == 0, e == 0, err_msg=name)
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(e), err_msg=name)
        finite = np.isfinite(e)
        np.testing.assert_allclose(a[finite], e[finite], rtol=rtol,
                                   atol=rtol * np.abs(e[finite]).max(), err_msg=name)


@requires_metal
def test_metal_gate_and_compile_warnings_on_this_mac():
    """On a Mac that runs Metal: the GPU passed the gate, and still does after building the
    pipelines of a call (each checked for 32-wide simdgroups); compile warnings, if any, are
    kept and reported as text."""
    _check_against_oracle("metal", jnp.float16, "plain", 64)
    assert ext.metal_available() and ext.metal_unavailable_reason() == ""
    assert ext.testing.metal_gate(ext.device_name("metal"), True, True, 32) == ""
    assert isinstance(ext.library_warnings("metal"), str)
    assert ext.library_error("metal") == ""


@requires_metal
@pytest.mark.parametrize("kernel", ["flash_attention_fwd_f32_d16",
                                    "flash_attention_bwd_dq_f32_d16"])
@pytest.mark.parametrize("debug", [False, True])
def test_metal_command_buffer_error_surfaces_as_jax_exception(kernel, debug):
    """A failed command buffer (injected through the path a real GPU error takes) is a JAX
    exception naming the kernel and grid of its dispatches; in debug mode
    ($JAX_FLASH_METAL_DEBUG) also the faulted encoder's status. Later calls run normally."""
    rng = np.random.default_rng(0)
    q = _normal(rng, (1, 6, 2, 16))
    f = jax.jit(jax.grad(lambda q: flash_attention(q, q, q, implementation="metal").sum()))
    dispatch = rf"{kernel} groups \[\d+, \d+, \d+\]"
    expected = (rf"encoders: jax_flash_metal .*\[faulted\] \(dispatches: .*{dispatch}" if debug
                else rf"kernels in it: .*{dispatch}.*JAX_FLASH_METAL_DEBUG")
    before = ext.metal_debug()
    ext.set_metal_debug(debug)
    ext.testing.set_metal_fault(kernel)
    try:
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=rf"metal device error: command buffer failed: injected fault "
                                 rf".*{expected}"):
            jax.block_until_ready(f(q))
    finally:
        ext.testing.set_metal_fault("")
        ext.set_metal_debug(before)
    assert np.isfinite(np.asarray(f(q))).all()


@requires_metal
def test_metal_gpu_seconds_grow_by_less_than_the_wall_time_of_a_call():
    """The GPU time of a call's command buffers (GPUEndTime - GPUStartTime) is positive and,
    the command buffers running inside the call, below the call's wall time."""
    rng = np.random.default_rng(0)
    q = _normal(rng, (1, 256, 4, 64))
    f = jax.jit(lambda q: flash_attention(q, q, q, implementation="metal"))
    jax.block_until_ready(f(q))  # compiled, shader library built
    before = ext.gpu_seconds_total("metal")
    start = time.perf_counter()
    jax.block_until_ready(f(q))
    wall = time.perf_counter() - start
    gpu = ext.gpu_seconds_total("metal") - before
    assert 0 < gpu < wall
