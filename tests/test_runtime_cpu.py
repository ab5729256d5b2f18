"""Runtime pieces that need no GPU: kernel selection, library loading errors, the ABI of built libraries."""
import json

import pytest
import torch

import fp4gen
from fp4gen.cuda import library
from fp4gen.cuda.manifest import MANIFEST_PATH, lib_dir, load_manifest
from fp4gen.cuda.select import Problem, select

MANIFEST = load_manifest()
NAME = "dequantize_nvfp4_to_bf16_sm90a"


def _problem(**kw):
    base = dict(op="dequantize", compute_capability=(9, 0), dtypes={"out_dtype": "bfloat16"}, cols=64,
                pointers={"data": 0x1000, "out": 0x2000})
    base.update(kw)
    return Problem(**base)


def test_select_matches_op_arch_and_dtype():
    assert select(_problem(), MANIFEST) == NAME
    assert select(_problem(compute_capability=(10, 0), dtypes={"out_dtype": "float32"}), MANIFEST) == \
        "dequantize_nvfp4_to_fp32_sm100a"


def test_select_without_a_declared_kernel_is_a_build_error():
    with pytest.raises(fp4gen.BuildError, match=r"dequantize on compute capability 8\.0.*codegen/specs.*build\.py"):
        select(_problem(compute_capability=(8, 0)), MANIFEST)
    with pytest.raises(fp4gen.BuildError, match=r"gemm on compute capability 8\.0"):
        select(_problem(op="gemm", compute_capability=(8, 0)), MANIFEST)  # no Ampere GEMM declared


def test_select_reports_the_rule_a_problem_breaks():
    with pytest.raises(ValueError, match=r"`data` 4-byte aligned, got address 0x1001"):
        select(_problem(pointers={"data": 0x1001, "out": 0x2000}), MANIFEST)
    with pytest.raises(ValueError, match=r"multiple of 16, got 40"):
        select(_problem(cols=40), MANIFEST)


def test_forced_kernel_replaces_the_rule_for_its_operation_only(monkeypatch):
    gemm = _problem(op="gemm", cols=4096, rows=4096, pointers={})
    by_rule = select(gemm, MANIFEST)
    other = next(name for name in _kernels("gemm") if name != by_rule and name.endswith("sm90a")
                 and MANIFEST["kernels"][name]["torch_dtypes"]["out_dtype"] == "bfloat16")
    monkeypatch.setenv("FP4GEN_KERNEL", f" {other} ,")
    assert select(gemm, MANIFEST) == other
    assert select(_problem(), MANIFEST) == NAME  # a dequantize problem: the forced GEMM does not apply
    monkeypatch.setenv("FP4GEN_KERNEL", NAME)
    with pytest.raises(ValueError, match=r"`data` 4-byte aligned, got address 0x1001"):  # its rules still hold
        select(_problem(pointers={"data": 0x1001, "out": 0x2000}), MANIFEST)
    monkeypatch.setenv("FP4GEN_KERNEL", "gemm_nvfp4_no_such_kernel")
    with pytest.raises(ValueError, match=r"FP4GEN_KERNEL names gemm_nvfp4_no_such_kernel.*build\.py --list"):
        select(gemm, MANIFEST)


def _fresh_load(monkeypatch, directory, name=NAME):
    monkeypatch.setenv("FP4GEN_LIB_DIR", str(directory))
    library.load_kernel.cache_clear()
    try:
        return library.load_kernel(name)
    finally:
        library.load_kernel.cache_clear()


def test_unbuilt_kernel_names_itself_and_the_build_command(monkeypatch, tmp_path):
    with pytest.raises(fp4gen.BuildError, match=rf"{NAME} is declared .* not built .*python build\.py --arch sm90a"):
        _fresh_load(monkeypatch, tmp_path)


def _index(entry, **overrides):
    record = {"source_sha256": entry["source_sha256"], "headers_sha256": entry["headers_sha256"]}
    record.update(overrides)
    return {entry["name"]: record}


def test_stale_library_is_a_build_error(monkeypatch, tmp_path):
    (tmp_path / f"{NAME}.so").write_bytes(b"\x7fELF")
    (tmp_path / "index.json").write_text(json.dumps(_index(MANIFEST["kernels"][NAME], source_sha256="0" * 64)))
    with pytest.raises(fp4gen.BuildError, match="stale"):
        _fresh_load(monkeypatch, tmp_path)


def test_corrupt_library_is_a_build_error_not_a_crash(monkeypatch, tmp_path):
    (tmp_path / f"{NAME}.so").write_bytes(b"not a shared object")
    (tmp_path / "index.json").write_text(json.dumps(_index(MANIFEST["kernels"][NAME])))
    with pytest.raises(fp4gen.BuildError, match="does not load"):
        _fresh_load(monkeypatch, tmp_path)


BUILT = (lib_dir() / "index.json").exists()


def _kernels(op, family=None):
    return sorted(name for name, k in MANIFEST["kernels"].items()
                  if k["op"] == op and (family is None or k["family"] == family))


needs_build = pytest.mark.skipif(not BUILT, reason="run `python build.py` first: checks the libraries it publishes")


# Libraries link the CUDA runtime statically, so they load (and can_implement runs) without a GPU.
@needs_build
@pytest.mark.parametrize("name", _kernels("dequantize"))
def test_built_dequantize_library_checks_problems(name):
    kernel = library.load_kernel(name)
    rows, cols = 4, 64
    ok = (0x1000, 0x2000, 0x3000, 0x4000, rows, cols, cols // 2, cols // 16, 1, cols, 1 / 2688)
    assert kernel.can_implement(*ok) == 0
    assert kernel.can_implement(*ok[:10], 1 / 1536) == 0  # a 4over6 operand's factor
    assert kernel.workspace_size(*ok) == 0
    assert kernel.can_implement(0x1002, *ok[1:]) == 2  # data not 4-byte aligned
    assert kernel.can_implement(*ok[:3], 0x4008, *ok[4:]) == 2  # out not 16-byte aligned
    assert kernel.can_implement(*ok[:5], 40, *ok[6:]) == 1  # cols not a multiple of 16
    assert kernel.can_implement(*ok[:8], 2, cols, ok[10]) == 1  # amax stride must be 0 or 1
    assert kernel.can_implement(*ok[:10], 0.0) == 1  # the decode factor must be positive


@needs_build
@pytest.mark.parametrize("name", _kernels("amax_hadamard"))
def test_built_amax_hadamard_library_checks_problems(name):
    kernel = library.load_kernel(name)
    # x, stride, rows, cols, row_amax, col_amax, row_tensor_amax, col_tensor_amax, col_sum, col_sum_in_x_dtype,
    # workspace
    ok = (0x1000, 64, 32, 64, 0x2000, 0x3000, None, 0x4000, None, 0, None)
    assert kernel.can_implement(*ok) == 0
    assert kernel.workspace_size(*ok) == 0  # no column sums, no workspace
    assert kernel.can_implement(0x1008, *ok[1:]) == 2  # x not 16-byte aligned
    assert kernel.can_implement(*ok[:2], 40, *ok[3:]) == 1  # rows not whole 16-row groups
    assert kernel.can_implement(*ok[:4], None, None, None, None, None, 0, None) == 1  # nothing to compute
    # column sums: with tensor amaxes only, one fp32 partial a column for each chain group of 16-row groups
    # (rows 32: one), in a workspace the call must pass
    sums = (0x1000, 64, 32, 64, None, None, 0x2000, 0x3000, 0x5000, 0, 0x6000)
    assert kernel.can_implement(*sums) == 0
    assert kernel.workspace_size(*sums) == 1 * 64 * 4
    assert kernel.can_implement(*sums[:10], None) == 1  # no workspace
    assert kernel.can_implement(*ok[:8], 0x5000, 0, 0x6000) == 1  # not with per-row or per-column amaxes
    _check_column_sum_arguments(kernel, sums)


def _check_column_sum_arguments(kernel, sums):
    """An amax kernel's checks of col_sum (sums[-3]) and col_sum_in_x_dtype (sums[-2]) on a valid call `sums`:
    fp32 sums need 4-byte alignment, sums in x's dtype its element size; the flag is 0 or 1; the partials'
    workspace is fp32 either way."""
    element = {"bf16": 2, "fp16": 2, "fp32": 4}[MANIFEST["kernels"][kernel.name]["values"]["in_dtype"]]
    at_2 = (*sums[:-3], 0x5002)
    assert kernel.can_implement(*at_2, 0, sums[-1]) == 2  # fp32 sums not 4-byte aligned
    assert kernel.can_implement(*at_2, 1, sums[-1]) == (0 if element == 2 else 2)
    assert kernel.can_implement(*sums[:-2], 1, sums[-1]) == 0
    assert kernel.can_implement(*sums[:-2], 2, sums[-1]) == 1  # the flag is 0 or 1
    assert kernel.workspace_size(*sums[:-2], 1, sums[-1]) == kernel.workspace_size(*sums)


@needs_build
@pytest.mark.parametrize("name", _kernels("quantize_options"))
def test_built_quantize_options_library_checks_problems(name):
    kernel = library.load_kernel(name)
    stochastic, hadamard = "_sr_" in name, "_rht16_" in name
    # x, stride, rows, cols, row_amax, col_amax, row_data, row_scale, col_data, col_scale, rng, vector, 2d, mse
    ok = (0x1000, 64, 32, 64, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000, 0x7000, 0x8000, 1, 0, 0)
    assert kernel.can_implement(*ok) == 0
    assert kernel.workspace_size(*ok) == 0
    assert kernel.can_implement(0x1008, *ok[1:]) == 2  # x not 16-byte aligned
    assert kernel.can_implement(*ok[:3], 40, *ok[4:]) == 1  # cols not a multiple of 16
    assert kernel.can_implement(*ok[:2], 24, *ok[3:]) == 1  # a columnwise copy needs rows % 16 == 0
    assert kernel.can_implement(*ok[:11], 2, 0, 0) == 1  # vector_amax is 0 or 1
    # 16x16 blocks: per tensor and without the transform
    assert kernel.can_implement(*ok[:11], 0, 1, 0) == (1 if hadamard else 0)
    assert kernel.can_implement(*ok[:11], 1, 1, 0) == 1
    # the transform is of the columnwise copy; stochastic rounding needs the state
    assert kernel.can_implement(*ok[:8], None, None, *ok[10:]) == (1 if hadamard else 0)
    assert kernel.can_implement(*ok[:10], None, *ok[11:]) == (1 if stochastic else 0)


@needs_build
@pytest.mark.parametrize("name", _kernels("quantize_grouped"))
def test_built_quantize_grouped_library_checks_problems(name):
    kernel = library.load_kernel(name)
    # x, stride, rows, cols, offsets, padded_ends, groups, capacity, row_amax, col_amax, row_data, row_scale,
    # col_data, col_scale, col_group_stride, col_row_stride, stacked, rng, vector, 2d, hadamard, 4over6, stochastic,
    # workspace
    ok = (0x1000, 64, 40, 64, 0x2000, 0x2100, 3, 96, 0x3000, 0x3100, 0x4000, 0x5000, 0x6000, 0x7000, 0, 48, 0,
          0x8000, 1, 0, 0, 0, 0, None)

    def with_(**changes):
        names = ("x stride rows cols offsets padded groups capacity row_amax col_amax row_data row_scale col_data "
                 "col_scale group_stride row_stride stacked rng vector block_2d hadamard four_over_six stochastic "
                 "workspace")
        args = dict(zip(names.split(), ok))
        args.update(changes)
        return tuple(args.values())

    assert kernel.can_implement(*ok) == 0
    assert kernel.workspace_size(*ok) == 0
    assert kernel.can_implement(*with_(hadamard=1, stochastic=1)) == 0
    assert kernel.can_implement(*with_(four_over_six=2)) == 0
    assert kernel.can_implement(*with_(x=0x1008)) == 2  # x not 16-byte aligned
    assert kernel.can_implement(*with_(cols=40)) == 1  # cols not a multiple of 16
    assert kernel.can_implement(*with_(capacity=40)) == 1  # the padded row space is whole 16-row blocks
    assert kernel.can_implement(*with_(groups=0)) == 1  # at least one group
    assert kernel.can_implement(*with_(offsets=None)) == 1
    assert kernel.can_implement(*with_(four_over_six=3)) == 1
    assert kernel.can_implement(*with_(four_over_six=1, stochastic=1)) == 1  # 4over6 rounds to nearest
    assert kernel.can_implement(*with_(stochastic=1, rng=None)) == 1  # stochastic rounding needs the state
    assert kernel.can_implement(*with_(block_2d=1)) == 1  # 16x16 blocks: stacked, per group
    stacked = {"block_2d": 1, "vector": 0, "stacked": 1, "workspace": 0x9000}
    assert kernel.can_implement(*with_(**stacked, rows=48)) == 0  # 3 experts of 16 rows
    assert kernel.can_implement(*with_(**stacked)) == 1  # 40 rows are not 3 experts' worth
    # stacked weights whose experts are whole 256-row units go to the one-grid launch, which takes counters (two,
    # and one an expert) in the workspace, 4-byte aligned; other stacked calls take none
    flat = {**stacked, "rows": 768, "capacity": 768}
    assert kernel.workspace_size(*with_(**flat)) == 4 * (3 + 2)
    assert kernel.can_implement(*with_(**flat)) == 0
    assert kernel.can_implement(*with_(**{**flat, "workspace": None})) == 1
    assert kernel.can_implement(*with_(**{**flat, "workspace": 0x9002})) == 2
    assert kernel.workspace_size(*with_(**{**flat, "hadamard": 1, "block_2d": 0})) == 0  # the amax pass's options
    assert kernel.workspace_size(*with_(**{**flat, "col_data": None})) == 0  # one copy: the amax pass
    assert kernel.workspace_size(*with_(**stacked, rows=48)) == 0  # 16 rows an expert: one grid row an expert
    # nothing to quantize (no padded rows): no launch, no workspace asked for or checked
    assert kernel.workspace_size(*with_(**{**flat, "capacity": 0})) == 0
    assert kernel.can_implement(*with_(**{**flat, "capacity": 0, "workspace": None})) == 0
    assert kernel.can_implement(*with_(**{**stacked, "workspace": None}, rows=48)) == 0
    assert kernel.can_implement(*with_(col_data=None, hadamard=1)) == 1  # the transform is of the columnwise copy
    assert kernel.can_implement(*with_(row_stride=44)) == 1  # scale rows are codes rows / 8


@needs_build
@pytest.mark.parametrize("name", _kernels("amax"))
def test_built_amax_library_checks_problems(name):
    kernel = library.load_kernel(name)
    # x, stride, rows, cols, row_amax, col_amax, tensor_amax, col_sum, col_sum_in_x_dtype, workspace
    ok = (0x1000, 64, 32, 64, 0x2000, 0x3000, None, None, 0, None)
    assert kernel.can_implement(*ok) == 0
    assert kernel.workspace_size(*ok) == 0  # no column sums, no workspace
    assert kernel.can_implement(0x1008, *ok[1:]) == 2  # x not 16-byte aligned
    assert kernel.can_implement(0x1000, 65, *ok[2:]) == 2  # row stride breaks 16-byte row starts
    assert kernel.can_implement(*ok[:3], 40, *ok[4:]) == 1  # cols not a multiple of 16
    assert kernel.can_implement(*ok[:4], None, None, None, None, 0, None) == 1  # nothing to compute
    # column sums: one fp32 partial a column for each 64-row slice, in a workspace the call must pass
    sums = (0x1000, 64, 32, 64, None, None, 0x2000, 0x5000, 0, 0x6000)
    assert kernel.can_implement(*sums) == 0
    assert kernel.can_implement(*sums[:9], None) == 1
    assert kernel.workspace_size(*sums) == 1 * 64 * 4
    assert kernel.workspace_size(0x1000, 64, 130, *sums[3:]) == 3 * 64 * 4
    _check_column_sum_arguments(kernel, sums)


@needs_build
@pytest.mark.parametrize("name", _kernels("quantize"))
def test_built_quantize_library_checks_problems(name):
    kernel = library.load_kernel(name)
    values = MANIFEST["kernels"][name]["values"]
    rowwise, colwise = values["direction"] in ("rowwise", "both"), values["direction"] in ("columnwise", "both")
    outs = (0x3000, 0x4000) if rowwise else (None, None)
    outs += (0x5000, 0x6000) if colwise else (None, None)
    stochastic = values["rounding"] == "stochastic"
    ok = (0x1000, 64, 32, 64, 0x2000, 0x2100) + outs + (0x7000 if stochastic else None,)
    assert kernel.can_implement(*ok) == 0
    assert kernel.can_implement(0x1004, *ok[1:]) == 2  # x not 16-byte aligned
    assert kernel.can_implement(*ok[:3], 24, *ok[4:]) == 1  # cols not a multiple of 16
    needs_rows_of_16 = colwise or values["block"] == "16x16"
    assert kernel.can_implement(*ok[:2], 24, *ok[3:]) == (1 if needs_rows_of_16 else 0)
    missing_output = ok[:6] + (None,) * 4 + ok[10:]
    assert kernel.can_implement(*missing_output) == 1
    # the random state: required with stochastic rounding, not read otherwise
    assert kernel.can_implement(*ok[:10], None) == (1 if stochastic else 0)


@needs_build
@pytest.mark.parametrize("name", [n for n in _kernels("row_pass") if MANIFEST["kernels"][n]["values"]["hadamard"] == "none"])
def test_built_row_pass_library_checks_problems(name):
    kernel = library.load_kernel(name)
    values = MANIFEST["kernels"][name]["values"]
    elem = {"bf16": 2, "fp16": 2, "fp32": 4}[values["in_dtype"]]
    stochastic = values["rounding"] == "stochastic"
    # rows need not be a multiple of 16
    ok = (0x1000, 64, 30, 64, 0x2000, 0x2100, 0x3000, 0x4000, 0x5000, 0x6000 if stochastic else None)
    assert kernel.can_implement(*ok) == 0
    assert kernel.can_implement(*ok[:9], None) == (1 if stochastic else 0)  # the random state
    assert kernel.can_implement(0x1004, *ok[1:]) == 2  # x not 16-byte aligned
    assert kernel.can_implement(*ok[:6], 0x3004, *ok[7:]) == 2  # codes not 8-byte aligned
    assert kernel.can_implement(*ok[:3], 24, *ok[4:]) == 1  # cols not a multiple of 16
    assert kernel.can_implement(*ok[:4], None, *ok[5:]) == 1  # no row amax
    assert kernel.can_implement(*ok[:6], None, *ok[7:]) == 1  # no codes
    # column maxima in shared memory: rows of more than 200 KB only without col_amax
    wide = 200 * 1024 // elem + 16
    assert kernel.can_implement(ok[0], wide, ok[2], wide, *ok[4:]) == 1
    assert kernel.can_implement(ok[0], wide, ok[2], wide, ok[4], None, *ok[6:]) == 0


@needs_build
@pytest.mark.parametrize("name", [n for n in _kernels("row_pass") if MANIFEST["kernels"][n]["values"]["hadamard"] == "rht16"])
def test_built_hadamard_row_pass_library_checks_problems(name):
    kernel = library.load_kernel(name)
    ok = (0x1000, 64, 32, 64, 0x2000, 0x2100, 0x3000, 0x4000, None, None)  # no workspace, no random state
    assert kernel.can_implement(*ok) == 0
    assert kernel.workspace_size(*ok) == 0
    assert kernel.can_implement(*ok[:2], 24, *ok[3:]) == 1  # 16-row panels: rows a multiple of 16
    assert kernel.can_implement(0x1004, *ok[1:]) == 2  # x not 16-byte aligned
    assert kernel.can_implement(*ok[:6], 0x3004, *ok[7:]) == 2  # codes not 8-byte aligned
    assert kernel.can_implement(*ok[:3], 24, *ok[4:]) == 1  # cols not a multiple of 16
    assert kernel.can_implement(*ok[:5], None, *ok[6:]) == 1  # the column amax is what the pass is for
    # a cluster of CTAs holds a panel: the kernel takes rows up to the manifest's cols_at_most and no wider
    widest = MANIFEST["kernels"][name]["constraints"]["cols_at_most"]
    assert kernel.can_implement(ok[0], widest, ok[2], widest, *ok[4:]) == 0
    assert kernel.can_implement(ok[0], widest + 16, ok[2], widest + 16, *ok[4:]) == 1


def test_gemm_tile_choice_follows_m():
    def chosen(rows, cols=256):
        return select(_problem(op="gemm", rows=rows, cols=cols, pointers={}), MANIFEST)
    # up to M = 256 the kernels that decode B into wgmma's registers: the smallest tile that covers M, M
    # counted as at least 64 above 16 (the tallest when none covers), the widest
    assert chosen(1).endswith("packedrs_bf16out_t16x128x64_sm90a")
    assert chosen(16).endswith("packedrs_bf16out_t16x128x64_sm90a")
    assert chosen(17).endswith("packedrs_bf16out_t64x128x64_sm90a")
    assert chosen(64).endswith("packedrs_bf16out_t64x128x64_sm90a")
    assert chosen(65).endswith("packedrs_bf16out_t128x128x64_sm90a")
    assert chosen(128).endswith("packedrs_bf16out_t128x128x64_sm90a")
    assert chosen(129).endswith("packedrs_bf16out_t128x128x64_sm90a")
    assert chosen(256).endswith("packedrs_bf16out_t128x128x64_sm90a")
    # the 256-row tile, faster at some shapes and slower at others, is left to the autotuner: the rule never
    # takes it while another gemm_packed_rs tile is declared, though it is a candidate wherever it can run
    from fp4gen.cuda.select import viable
    tall = "gemm_nvfp4_packedrs_bf16out_t256x128x64_sm90a"
    for rows in (1, 64, 129, 200, 256):
        candidates = viable(_problem(op="gemm", rows=rows, cols=256, pointers={}), MANIFEST)
        assert tall in candidates and candidates[0] != tall
    only_tall = {**MANIFEST, "kernels": {name: k for name, k in MANIFEST["kernels"].items()
                                         if k["family"] != "gemm_packed_rs" or name == tall}}
    assert select(_problem(op="gemm", rows=200, cols=256, pointers={}), only_tall) == tall
    # without them (a manifest that declares none), the packed wgmma kernels up to M = 256: the smallest tile
    # that covers M (the tallest when none does), then the narrowest
    without_rs = {**MANIFEST, "kernels": {name: k for name, k in MANIFEST["kernels"].items()
                                          if k["family"] != "gemm_packed_rs"}}
    assert select(_problem(op="gemm", rows=64, cols=256, pointers={}), without_rs).endswith(
        "packed_bf16out_t64x128x64_sm90a")
    assert select(_problem(op="gemm", rows=200, cols=256, pointers={}), without_rs).endswith(
        "packed_bf16out_t128x128x64_sm90a")
    # beyond, the wgmma tiles over scratch: the tallest no taller than M
    assert chosen(257).endswith("t128x256x64_coop_cl2x1_sm90a") and chosen(8192).endswith("t128x256x64_coop_cl2x1_sm90a")
    # the fused kernels take whole 64-element k-tiles; otherwise small M gets the 64-row wgmma tile
    assert chosen(16, cols=48).endswith("t64x128x64_pingpong_sm90a")
    assert chosen(200, cols=48).endswith("t128x256x64_coop_cl2x1_sm90a")


def test_autotuner_only_tile_leaves_the_rule_unchanged():
    """Declaring the 256-row gemm_packed_rs tile (an autotuner candidate) changes no choice of the rule, for any
    M, K, N, device size or output dtype."""
    without = {**MANIFEST, "kernels": {name: k for name, k in MANIFEST["kernels"].items()
                                       if not (k["family"] == "gemm_packed_rs" and k["facts"]["tile_m"] == 256)}}
    assert len(without["kernels"]) == len(MANIFEST["kernels"]) - 2  # bf16 and fp32 out
    for out_dtype in ("bfloat16", "float32"):
        for rows in [*range(1, 300, 3), 384, 1000, 4096, 16384]:
            for k in (64, 1024, 14336):
                for n, multiprocessors in ((0, 0), (64, 132), (4096, 132), (14336, 132)):
                    problem = Problem("gemm", (9, 0), {"out_dtype": out_dtype}, {}, k, rows, {}, n, multiprocessors)
                    assert select(problem, MANIFEST) == select(problem, without), problem


def test_gemm_scratch_tile_fills_the_device():
    """With N and the device's multiprocessors known, the scratch-path tiles that make at least half as many
    output tiles as there are multiprocessors come first (the tallest of them); if none does, the smallest."""
    def chosen(m, n, sms=132):
        return select(_problem(op="gemm", rows=m, cols=1024, pointers={}, n=n, multiprocessors=sms), MANIFEST)
    # 1024 x 1024: 32 tiles of 128x256 for 132 multiprocessors, 128 of 64x128
    assert chosen(1024, 1024).endswith("t64x128x64_pingpong_sm90a")
    assert chosen(512, 4096).endswith("t64x128x64_pingpong_sm90a")  # 64 tiles of 128x256
    # 128 tiles of 128x256 and more fill it
    assert chosen(1024, 4096).endswith("t128x256x64_coop_cl2x1_sm90a")
    assert chosen(4096, 1024).endswith("t128x256x64_coop_cl2x1_sm90a")
    assert chosen(8192, 8192).endswith("t128x256x64_coop_cl2x1_sm90a")
    # fewer multiprocessors: 32 tiles fill half of 64
    assert chosen(1024, 1024, sms=64).endswith("t128x256x64_coop_cl2x1_sm90a")
    # nothing fills: the smallest tile, the most CTAs
    assert chosen(300, 256).endswith("t64x128x64_pingpong_sm90a")
    # N unknown: the tallest, as before
    assert chosen(1024, 0).endswith("t128x256x64_coop_cl2x1_sm90a")


def test_split_k_fills_the_gpu_for_small_m_only():
    from fp4gen.cuda.select import split_k
    assert split_k(16, 64, 16, 8192, 128, 132, 3) == 3  # 128 tiles: three splits give three CTAs per SM
    assert split_k(128, 64, 128, 8192, 128, 132, 3) == 3
    assert split_k(128, 128, 128, 8192, 128, 132, 1) == 2  # 64 tiles, one CTA per SM: not a partial 2nd wave
    assert split_k(128, 128, 256, 8192, 128, 132, 1) == 1  # 128 tiles already fill the GPU once
    assert split_k(16, 64, 16, 64, 128, 132, 3) == 8  # one tile: capped at 8 splits
    assert split_k(16, 64, 16, 8192, 12, 132, 3) == 1  # 12 k-tiles: a split needs at least 8
    assert split_k(128, 64, 128, 65536, 128, 132, 3) == 1  # enough tiles already


def test_fused_gemm_alignment_rules_fall_back_to_the_wgmma_gemm():
    pointers = {"a_codes": 0x1008, "a_scale": 0x2000, "b_codes": 0x3000, "b_scale": 0x4000}
    name = select(_problem(op="gemm", rows=16, cols=256, pointers=pointers), MANIFEST)
    assert name.endswith("t64x128x64_pingpong_sm90a")


def test_blackwell_gemm_is_chosen_on_compute_capability_10():
    name = select(_problem(op="gemm", compute_capability=(10, 0), rows=4096, cols=256, pointers={}), MANIFEST)
    assert MANIFEST["kernels"][name]["family"] == "gemm_sm100"
    with pytest.raises(ValueError, match="multiple of 32, got 48"):  # packed rows must be 16-byte TMA rows
        select(_problem(op="gemm", compute_capability=(10, 0), rows=64, cols=48, pointers={}), MANIFEST)


def _gemm_args(name, **values):
    """A GEMM kernel's C arguments in its ABI's order (the manifest's params), from their names; the
    workspace (and any argument not given) is None."""
    return tuple(values.get(param, None) for param, _, _ in MANIFEST["kernels"][name]["params"])


_GEMM_EPILOGUE = dict(c=0x50000, d=0x50000, row_amax=0x60000, col_amax=0x70000, bias=None, alpha=1.0, beta=0.0,
                      row_is_vector=1, col_is_vector=0)


def test_grouped_gemm_families_by_arch_and_rule_values():
    from fp4gen.cuda import grouped
    grouped_problem = dict(op="grouped_gemm", cols=256, pointers={})
    family = (lambda **kw: MANIFEST["kernels"][select(_problem(**grouped_problem, **kw), MANIFEST)]["family"])
    for values in (grouped.TMA_COOPERATIVE, grouped.TMA_PINGPONG):
        assert family(values=values) == "gemm_grouped_tma"
    assert family(values={"packed_tile": "128x128x64"}) == "gemm_grouped_wgmma"
    assert family(compute_capability=(10, 0), values=grouped.BLACKWELL_TILE) == "gemm_grouped_sm100"
    with pytest.raises(ValueError, match="multiple of 64, got 96"):
        select(_problem(**{**grouped_problem, "cols": 96}, compute_capability=(10, 0), values=grouped.BLACKWELL_TILE),
               MANIFEST)


def test_grouped_tma_schedule_follows_the_groups_rows():
    """Along M the pingpong tile below TMA_PINGPONG_BELOW_ROWS rows a group, the cooperative one from there;
    along K always the cooperative one. Each choice names one declared kernel per output dtype."""
    from fp4gen.cuda import grouped
    below = grouped.TMA_PINGPONG_BELOW_ROWS
    assert grouped.tma_variant(512, False) == grouped.tma_variant(below - 1, False) == grouped.TMA_PINGPONG
    assert grouped.tma_variant(below, False) == grouped.tma_variant(2048, False) == grouped.TMA_COOPERATIVE
    assert grouped.tma_variant(512, True) == grouped.tma_variant(2048, True) == grouped.TMA_COOPERATIVE
    for values, token in ((grouped.TMA_PINGPONG, "_t128x128x64_pingpong_"),
                          (grouped.TMA_COOPERATIVE, "_t128x256x64_coop_cl2x1_")):
        for out_dtype in ("bfloat16", "float32"):
            problem = _problem(op="grouped_gemm", cols=256, pointers={}, dtypes={"out_dtype": out_dtype},
                               values=values)
            assert token in select(problem, MANIFEST)


def test_grouped_gemm_family_follows_the_groups_rows(monkeypatch):
    """On Hopper: the TMA family for every wgrad and for fprop/dgrad from TMA_MIN_ROWS_PER_GROUP rows a group
    (pingpong tiles below TMA_PINGPONG_BELOW_ROWS), else the packed family (its 64-row tile up to 64 rows); the
    packed family too when D's rows cannot be TMA-stored."""
    from fp4gen.cuda import grouped
    monkeypatch.setattr(grouped, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(grouped, "_kernel_for", lambda op, device, dtypes, k, pointers, values: values)
    minimum = grouped.TMA_MIN_ROWS_PER_GROUP["along M"]

    def pick(rows, along_k, tma_ok=True):
        return grouped._grouped_gemm_kernel(torch.device("cuda", 0), torch.bfloat16, 256, {}, rows, along_k, tma_ok)
    assert pick(64, False) == {"packed_tile": "64x128x64"}
    assert pick(minimum - 1, False) == {"packed_tile": "128x128x64"}
    assert pick(minimum, False) == grouped.TMA_PINGPONG
    assert pick(grouped.TMA_PINGPONG_BELOW_ROWS, False) == grouped.TMA_COOPERATIVE
    assert pick(16, True) == pick(4096, True) == grouped.TMA_COOPERATIVE
    assert pick(2048, False, tma_ok=False) == {"packed_tile": "128x128x64"}


_GROUPED_FAMILIES = ("gemm_grouped_wgmma", "gemm_grouped_tma", "gemm_grouped_sm100")


@needs_build
@pytest.mark.parametrize("name", [n for f in _GROUPED_FAMILIES for n in _kernels("grouped_gemm", f)])
def test_built_grouped_gemm_library_checks_problems(name):
    kernel = library.load_kernel(name)
    family = MANIFEST["kernels"][name]["family"]
    m, n, k, groups = 300, 128, 256, 4  # groups along M over stacked [4, 128, 256] weights
    ok = dict(_GEMM_EPILOGUE, a_codes=0x10000, a_scale=0x20000, b_codes=0x30000, b_scale=0x40000, m=m, n=n, k=k,
              lda=k // 2, lda_scale=k // 16, ldb=k // 2, ldb_scale=k // 16, ldc=n, ldd=n, offsets=0x48000,
              groups=groups, along_k=0, b_group_stride=n * k // 2, b_scale_group_stride=n * k // 16,
              c_group_stride=0, d_group_stride=0, row_amax_group_stride=0, col_amax_group_stride=1,
              bias_group_stride=n, workspace=0x90000)

    def check(**changes):
        return kernel.can_implement(*_gemm_args(name, **{**ok, **changes}))
    assert check() == 0
    assert check(along_k=1, c_group_stride=m * n, d_group_stride=m * n) == 0  # wgrad
    assert check(k=96) == 1  # K is whole 64-element k-tiles
    assert check(groups=0) == 1 and check(offsets=None) == 1
    assert check(along_k=1, bias=0x80000) == 1  # wgrad has no bias
    assert check(beta=1.0, c=None) == 1  # accumulating needs C
    assert check(a_codes=0x10008) == 2  # codes read in 16-byte pieces
    assert check(workspace=None) == 1  # the fp16 copies, or the swizzled scales, live in the workspace
    # TMA stores D's rows: the CUTLASS families need them 16-byte aligned, the packed kernel does not
    assert check(d=0x50004) == (0 if family == "gemm_grouped_wgmma" else 2)


@needs_build
@pytest.mark.parametrize("name", _kernels("gemm", "gemm_sm100"))
def test_built_blackwell_gemm_library_checks_problems(name):
    kernel = library.load_kernel(name)
    m, n, k = 256, 256, 512
    ok = dict(_GEMM_EPILOGUE, a=0x10000, b=0x20000, sfa=0x28000, sfb=0x2c000, m=m, n=n, k=k, ldc=n, ldd=n)
    assert kernel.can_implement(*_gemm_args(name, **ok)) == 0
    assert kernel.can_implement(*_gemm_args(name, **{**ok, "bias": 0x80000})) == 0
    assert kernel.can_implement(*_gemm_args(name, **{**ok, "d": 0x50008})) == 2  # d not 16-byte aligned
    assert kernel.can_implement(*_gemm_args(name, **{**ok, "bias": 0x80004})) == 2  # bias not 16-byte aligned
    assert kernel.can_implement(*_gemm_args(name, **{**ok, "k": 48})) == 1  # K not a multiple of 32
    assert kernel.can_implement(*_gemm_args(name, **{**ok, "sfa": None})) == 1  # no scales


@needs_build
@pytest.mark.parametrize("name", _kernels("gemm", "gemm_fused_dequant") + _kernels("gemm", "gemm_fused_wgmma")
                         + _kernels("gemm", "gemm_packed_rs"))
def test_built_fused_gemm_library_checks_problems(name):
    kernel = library.load_kernel(name)
    m, n, k = 100, 200, 128
    ok = dict(_GEMM_EPILOGUE, a_codes=0x10000, a_scale=0x20000, b_codes=0x30000, b_scale=0x40000, m=m, n=n, k=k,
              lda=k // 2, lda_scale=k // 16, ldb=k // 2, ldb_scale=k // 16, split_k=1, ldc=n, ldd=n)

    def check(**changes):
        args = _gemm_args(name, **{**ok, **changes})
        return kernel.can_implement(*args), kernel.workspace_size(*args)
    if MANIFEST["kernels"][name]["family"] in ("gemm_fused_wgmma", "gemm_packed_rs"):
        # A's fp16 copy (M x K x 2 bytes) in the workspace, after the partial sums at a 256-byte boundary
        ok["workspace"] = 0x90000
        assert check() == (0, m * k * 2) and check(bias=0x80004)[0] == 0
        assert check(split_k=2) == (0, -(-2 * m * n * 4 // 256) * 256 + m * k * 2)
        assert check(workspace=None)[0] == 1  # no workspace for A's copy
        assert check(workspace=None, m=0) == (0, 0)  # nothing to do, nothing needed
    else:
        assert check() == (0, 0) and check(bias=0x80004)[0] == 0  # the bias is read one float at a time
        assert check(split_k=2, workspace=0x90000) == (0, 2 * m * n * 4)
        assert check(split_k=2)[0] == 1  # split K without a workspace for the partial sums
    assert check(split_k=3)[0] == 1  # more splits than the 2 k-tiles
    assert check(a_codes=0x10008)[0] == 2  # codes not 16-byte aligned
    assert check(b_scale=0x40002)[0] == 2  # scales not 4-byte aligned
    assert check(ldb=72)[0] == 2  # code rows of 72 bytes break 16-byte chunks
    assert check(k=96)[0] == 1  # K not a multiple of 64
    assert check(row_amax=None)[0] == 1  # no row amax
    assert check(c=None, beta=1.0)[0] == 1  # accumulate without C


@needs_build
@pytest.mark.parametrize("name", _kernels("gemm", "gemm_sm90"))
def test_built_gemm_library_checks_problems(name):
    kernel = library.load_kernel(name)
    m, n, k = 128, 256, 64
    ok = dict(_GEMM_EPILOGUE, a_codes=0x10000, a_scale=0x18000, b_codes=0x20000, b_scale=0x28000, c=0x30000,
              d=0x30000, m=m, n=n, k=k, lda=k // 2, lda_scale=k // 16, ldb=k // 2, ldb_scale=k // 16, b_rows=n,
              ldc=n, ldd=n, workspace=0x90000)

    def check(**changes):
        args = _gemm_args(name, **{**ok, **changes})
        return kernel.can_implement(*args), kernel.workspace_size(*args)
    # both operands' bf16 copies in the workspace (M x K and N x K, 2 bytes each), then CUTLASS's
    status, workspace = check()
    assert status == 0 and workspace >= (m + n) * k * 2
    assert check(b_rows=n - 8) == (0, workspace)  # B's last rows as zeros: the same copies
    assert check(bias=0x80000)[0] == 0
    assert check(d=0x30008)[0] == 2  # d not 16-byte aligned
    assert check(bias=0x80004)[0] == 2  # bias not 16-byte aligned
    assert check(a_codes=0x10002)[0] == 2  # codes read a word at a time
    assert check(k=40)[0] == 1  # K not a multiple of 16
    assert check(row_amax=None)[0] == 1  # no row amax
    assert check(b_rows=n + 1)[0] == 1  # more rows of B than N
    assert check(workspace=None)[0] == 1  # no workspace for the copies
    assert check(workspace=None, m=0) == (0, 0)  # nothing to do, nothing needed


def test_quantize_of_cpu_tensor_with_backend_cuda_is_refused():
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        fp4gen.quantize(torch.zeros(16, 16), backend="cuda")


def test_manifest_is_the_checkouts_or_the_packaged_copy():
    from fp4gen.cuda.manifest import CHECKOUT, PACKAGE_DIR
    assert MANIFEST_PATH.exists() and MANIFEST_PATH.parent.name == "generated"
    assert MANIFEST_PATH.parent.parent == (CHECKOUT if CHECKOUT is not None else PACKAGE_DIR)


def test_row_pass_rule():
    # row scaling with a rowwise copy and 1x16 blocks takes the row pass while a row fits the limit: one for
    # calls with both copies, a wider one for the rowwise copy alone
    from fp4gen.cuda.ops import ROW_PASS_MAX_ROW_BYTES, ROW_PASS_ROWWISE_ONLY_MAX_ROW_BYTES, uses_row_pass
    assert ROW_PASS_ROWWISE_ONLY_MAX_ROW_BYTES > ROW_PASS_MAX_ROW_BYTES > 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        elem = torch.tensor([], dtype=dtype).element_size()
        x = torch.empty(3, ROW_PASS_MAX_ROW_BYTES // elem, dtype=dtype, device="meta")
        wider = torch.empty(3, ROW_PASS_MAX_ROW_BYTES // elem + 16, dtype=dtype, device="meta")
        widest = torch.empty(3, ROW_PASS_ROWWISE_ONLY_MAX_ROW_BYTES // elem, dtype=dtype, device="meta")
        assert uses_row_pass(x, "row", (1, 16), True, True)
        assert not uses_row_pass(wider, "row", (1, 16), True, True)
        assert uses_row_pass(wider, "row", (1, 16), True, False)
        assert uses_row_pass(widest, "row", (1, 16), True, False)
        assert not uses_row_pass(torch.empty(3, widest.shape[1] + 16, dtype=dtype, device="meta"), "row", (1, 16),
                                 True, False)
        assert not uses_row_pass(x, "tensor", (1, 16), True, True)
        assert not uses_row_pass(x, "tensor", (16, 16), True, True)
        assert not uses_row_pass(x, "row", (1, 16), False, True)  # columnwise only: the amax pass and its kernel


def test_plan_cache_selects_once_per_kind_of_problem(monkeypatch):
    """The dispatcher's plan cache: a repeated kind of problem is not selected again, while anything a rule
    or the arch depends on (alignment, device) is."""
    from fp4gen.cuda import ops

    chosen = []

    def counting_select(problem, manifest):
        chosen.append(problem)
        return select(problem, manifest)

    monkeypatch.setattr(ops, "_PLANS", {})
    monkeypatch.setattr(ops, "select", counting_select)
    monkeypatch.setattr(ops, "load_kernel", lambda name: name)  # the name stands for the loaded library
    monkeypatch.setattr(ops, "_capability", lambda index: (9, 0) if index == 0 else (10, 0))
    hopper, blackwell = torch.device("cuda", 0), torch.device("cuda", 1)
    out_dtype = {"out_dtype": torch.bfloat16}

    def kernel_for(device, cols=64, data=0x1000):
        return ops._kernel_for("dequantize", device, out_dtype, cols, {"data": data, "out": 0x2000})

    assert kernel_for(hopper) == NAME and len(chosen) == 1
    assert kernel_for(hopper) == NAME and kernel_for(hopper, cols=64 + 256) == NAME and len(chosen) == 1
    assert kernel_for(hopper, data=0x1004) == NAME and len(chosen) == 2  # another address residue
    with pytest.raises(ValueError, match=r"`data` 4-byte aligned, got address 0x1001"):
        kernel_for(hopper, data=0x1001)
    assert kernel_for(blackwell) == "dequantize_nvfp4_to_bf16_sm100a"
    assert [p.compute_capability for p in chosen] == [(9, 0), (9, 0), (9, 0), (10, 0)]


def test_plan_cache_tells_m_256_from_larger_m(monkeypatch):
    """A GEMM's plan depends on M up to the rule's largest bound (256): M = 256 after M = 8192 is selected
    again (the packed kernel, not the scratch path's plan), while two M beyond it share one plan."""
    from fp4gen.cuda import ops

    monkeypatch.setattr(ops, "_PLANS", {})
    monkeypatch.setattr(ops, "load_kernel", lambda name: name)
    monkeypatch.setattr(ops, "_capability", lambda index: (9, 0))
    device, out_dtype = torch.device("cuda", 0), {"out_dtype": torch.bfloat16}

    def kernel_for(rows):
        return ops._kernel_for("gemm", device, out_dtype, 8192, {}, rows=rows)

    assert kernel_for(8192).endswith("t128x256x64_coop_cl2x1_sm90a")
    assert kernel_for(256).endswith("packedrs_bf16out_t128x128x64_sm90a")
    assert kernel_for(257) == kernel_for(8192) and len(ops._PLANS) == 2


@pytest.mark.parametrize("scaling,block", [("row", (1, 16)), ("tensor", (1, 16)), ("tensor", (16, 16))])
@pytest.mark.parametrize("four_over_six", [None, "mse"])
@pytest.mark.parametrize("experts,rows,cols", [(3, 0, 64), (3, 32, 0), (None, 40, 0), (None, 0, 64)])
def test_cuda_backend_lays_out_grouped_tensors_without_elements_as_the_reference(monkeypatch, scaling, block,
                                                                                 four_over_six, experts, rows, cols):
    """Stacked experts (experts given) or tokens in three groups (experts None) without elements, no rows or no
    columns, launch no kernel on the CUDA backend (its outputs are allocated zeroed), so its layout code runs here:
    the same layouts, shapes and zero amaxes as the reference backend's."""
    from fp4gen import reference_grouped
    from fp4gen.cuda import grouped
    from fp4gen.options import QuantizeOptions
    if experts is None and block == (16, 16):
        pytest.skip("16x16 blocks are for stacked weights")
    monkeypatch.setattr(grouped, "_kernel_for", lambda *args, **kwargs: None)  # never launched: no elements
    x = torch.zeros((experts or 1) * rows, cols, dtype=torch.bfloat16)
    ends = torch.arange(1, experts + 1, dtype=torch.int64) * rows if experts else torch.tensor([0, rows // 2, rows])
    options = QuantizeOptions(four_over_six=four_over_six)
    got = grouped.quantize_grouped(x, ends, rows if experts else None, scaling, block, True, True, options)
    want = reference_grouped.quantize_grouped(x, ends, rows if experts else None, scaling, block, True, True, options)
    for a, b in zip(got, want):
        assert a.layout == b.layout and a.e4m3_max == b.e4m3_max
        for field in ("data", "scale", "amax"):
            assert getattr(a, field).shape == getattr(b, field).shape, field
            assert torch.equal(getattr(a, field).view(torch.uint8), getattr(b, field).view(torch.uint8)), field
