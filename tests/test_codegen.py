"""Specs -> variants -> names -> generated/: validation messages, determinism, staleness checks (no GPU)."""
import itertools
import json
from pathlib import Path

import pytest

from codegen.errors import SpecError
from codegen.families import FAMILIES
from codegen.naming import MAX_NAME_LENGTH, kernel_name
from codegen.render import check_generated, render_all, variants_by_name, load_specs
from codegen.spec import KernelSpec, Variant, expand, load_spec
from conftest import copy_project, run_build_py

ROOT = Path(__file__).resolve().parents[1]
GOOD = "family: dequantize\naxes:\n  out_dtype: [bf16, fp32]\n  arch: [sm90a]\n"

SPEC_ERRORS = [
    ("family: dequantize\naxes: [\n", "", ["not valid YAML"]),
    ("- just\n- a list\n", "", ["must be a mapping"]),
    (GOOD + "tiles: [128]\n", "tiles", ["unknown key 'tiles'", "allowed keys: family, description, axes, exclude"]),
    ("axes:\n  out_dtype: [bf16]\n  arch: [sm90a]\n", "family", ["required key 'family' is missing"]),
    ("family: dequantise\naxes: {out_dtype: [bf16], arch: [sm90a]}\n", "family",
     ["'dequantise' is not a kernel family", "allowed: amax, amax_hadamard, dequantize, gemm_fused_dequant, gemm_fused_wgmma, gemm_grouped_sm100, gemm_grouped_tma, gemm_grouped_wgmma, gemm_packed_rs, gemm_sm100, gemm_sm90, quantize, quantize_grouped, quantize_options"]),
    ("family: dequantize\naxes: {out_dtype: [bf16], arch: [sm90a], tile: [1]}\n", "axes.tile", ["unknown key 'tile'"]),
    ("family: dequantize\naxes: {out_dtype: [bf16]}\n", "axes.arch", ["required key 'arch' is missing"]),
    ("family: dequantize\naxes: {out_dtype: [], arch: [sm90a]}\n", "axes.out_dtype", ["non-empty list"]),
    ("family: dequantize\naxes: {out_dtype: bf16, arch: [sm90a]}\n", "axes.out_dtype", ["non-empty list", "'bf16'"]),
    ("family: dequantize\naxes: {out_dtype: [bf16, int8], arch: [sm90a]}\n", "axes.out_dtype[1]",
     ["'int8' is not an allowed out_dtype", "allowed: bf16, fp16, fp32"]),
    ("family: dequantize\naxes: {out_dtype: [bf16], arch: [sm80]}\n", "axes.arch[0]",
     ["'sm80' is not an allowed arch", "sm90a, sm100a"]),
    ("family: dequantize\naxes: {out_dtype: [bf16, bf16], arch: [sm90a]}\n", "axes.out_dtype", ["bf16 more than once"]),
    (GOOD + "exclude:\n  - {arch: sm90a}\n", "axes", ["every combination of axes is excluded"]),
    ("family: quantize\naxes: {in_dtype: [bf16], direction: [both], scaling: [row], block: [16x16], arch: [sm90a]}\n",
     "axes", ["every combination", "shares one scale across 16 rows"]),
    (GOOD + "exclude:\n  - {arch: sm75}\n", "exclude[0].arch", ["'sm75' is not an allowed arch"]),
    (GOOD + "description: 3\n", "description", ["must be a string"]),
    ("family: gemm_sm90\naxes: {out_dtype: [bf16], tile: [100x128x64], schedule: [pingpong], arch: [sm90a]}\n",
     "axes.tile[0]", ["'100x128x64' is not an allowed tile", "M in 64, 128, 256"]),
    ("family: gemm_sm90\naxes: {out_dtype: [bf16], tile: [64x128x64], schedule: [cooperative], arch: [sm90a]}\n",
     "axes", ["every combination", "tile M must be >= 128"]),
]


@pytest.mark.parametrize("text,key_path,fragments", SPEC_ERRORS)
def test_spec_errors_name_file_key_value_and_rule(tmp_path, text, key_path, fragments):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path, "codegen/specs/bad.yaml")
    err = info.value
    assert err.file == "codegen/specs/bad.yaml" and err.key_path == key_path
    assert str(err).startswith("codegen/specs/bad.yaml")
    for fragment in fragments:
        assert fragment in str(err), f"{fragment!r} missing from: {err}"


def test_a_new_gemm_tile_is_a_yaml_edit(tmp_path):
    path = tmp_path / "tiles.yaml"
    path.write_text("family: gemm_sm90\naxes: {out_dtype: [bf16], tile: [128x128x64, 256x128x64],"
                    " schedule: [cooperative], arch: [sm90a]}\n")
    names = [kernel_name(v) for v in expand(load_spec(path))]
    assert names == ["gemm_nvfp4_bf16out_t128x128x64_coop_sm90a", "gemm_nvfp4_bf16out_t256x128x64_coop_sm90a"]


def test_an_axis_with_a_default_may_be_left_out_and_adds_no_name_token(tmp_path):
    # quantize's `hadamard` axis came after specs without it: they still load, with its default `none`
    plain, transformed = tmp_path / "plain.yaml", tmp_path / "rht.yaml"
    axes = "in_dtype: [bf16], direction: [columnwise], scaling: [row], block: [1x16], arch: [sm90a]"
    plain.write_text(f"family: quantize\naxes: {{{axes}}}\n")
    transformed.write_text(f"family: quantize\naxes: {{{axes}, hadamard: [none, rht16]}}\n")
    assert [kernel_name(v) for v in expand(load_spec(plain))] == ["quantize_nvfp4_bf16_col_rowscaled_b1x16_sm90a"]
    assert [dict(v.values)["hadamard"] for v in expand(load_spec(plain))] == ["none"]
    assert [kernel_name(v) for v in expand(load_spec(transformed))] == [
        "quantize_nvfp4_bf16_col_rowscaled_b1x16_sm90a", "quantize_nvfp4_bf16_col_rowscaled_b1x16_rht16_sm90a"]
    # the family still refuses what it cannot build: the transform is made by the columnwise-only kernel
    rowwise = tmp_path / "rowwise.yaml"
    rowwise.write_text(f"family: quantize\naxes: {{{axes.replace('columnwise', 'rowwise')}, hadamard: [rht16]}}\n")
    with pytest.raises(SpecError, match="the Hadamard transform in a kernel with a rowwise copy"):
        load_spec(rowwise)


def test_a_cluster_is_a_yaml_value_rendered_into_the_kernel(tmp_path):
    # gemm_sm90's `cluster` axis: left out it is 1x1 (no name token, the names from before the axis); a
    # declared cluster names the kernel and reaches CUTLASS's ClusterShape through the template arguments
    path = tmp_path / "clusters.yaml"
    path.write_text("family: gemm_sm90\naxes: {out_dtype: [bf16], tile: [128x256x64], schedule: [cooperative],"
                    " cluster: [1x1, 2x1, 1x2], arch: [sm90a]}\n")
    variants = expand(load_spec(path))
    assert [kernel_name(v) for v in variants] == [
        "gemm_nvfp4_bf16out_t128x256x64_coop_sm90a", "gemm_nvfp4_bf16out_t128x256x64_coop_cl2x1_sm90a",
        "gemm_nvfp4_bf16out_t128x256x64_coop_cl1x2_sm90a"]
    files = render_all(ROOT, specs_dir=tmp_path)
    for name, cluster in (("coop", "1, 1"), ("coop_cl2x1", "2, 1"), ("coop_cl1x2", "1, 2")):
        source = files[f"gemm_nvfp4_bf16out_t128x256x64_{name}_sm90a.cu"]
        assert f"128, 256, 64, false,\n{' ' * 36}{cluster}>;" in source, name


def test_packed_wgmma_tiles_state_how_many_ctas_share_a_multiprocessor():
    # split K aims at this many CTAs a multiprocessor (select.split_k): two 128x128 or 64x128 CTAs fit one
    # (the kernels' launch bound, checked against shared memory in gemm_fused_wgmma.cuh), a 128x256 one does not
    from codegen.tables import WGMMA_FUSED_GEMM_TILES
    ctas = {tile: WGMMA_FUSED_GEMM_TILES[tile]["split_ctas_per_multiprocessor"]
            for tile in ("64x128x64", "128x128x64", "128x256x64")}
    assert ctas == {"64x128x64": 2, "128x128x64": 2, "128x256x64": 1}


def test_two_specs_declaring_one_kernel_is_an_error(tmp_path):
    (tmp_path / "a.yaml").write_text(GOOD)
    (tmp_path / "b.yaml").write_text(GOOD.replace("[bf16, fp32]", "[fp32]"))
    with pytest.raises(SpecError, match="dequantize_nvfp4_to_fp32_sm90a.*already declares"):
        variants_by_name(load_specs(tmp_path, tmp_path))


def test_expansion_is_the_ordered_product_minus_excludes(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("family: dequantize\naxes:\n  arch: [sm100a, sm90a]\n  out_dtype: [fp32, bf16]\n"
                    "exclude:\n  - {out_dtype: bf16, arch: sm100a}\n")
    names = [kernel_name(v) for v in expand(load_spec(path))]
    # axes come in the family's order (out_dtype, then arch) whatever order the YAML lists them in
    assert names == ["dequantize_nvfp4_to_fp32_sm100a", "dequantize_nvfp4_to_fp32_sm90a",
                     "dequantize_nvfp4_to_bf16_sm90a"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_names_are_unique_over_every_allowed_combination(family):
    fam = FAMILIES[family]
    axes = tuple((axis, tuple(values)) for axis, values in fam.axes.items())
    spec = KernelSpec("x.yaml", fam, "", axes, ())
    names = [kernel_name(Variant(spec, tuple(zip(fam.axes, combo))))
             for combo in itertools.product(*(v for _, v in axes))]
    assert len(set(names)) == len(names)
    assert all(len(n) <= MAX_NAME_LENGTH and n.isidentifier() for n in names)


def test_render_is_deterministic_and_names_its_spec():
    first, second = render_all(ROOT), render_all(ROOT)
    assert first == second
    manifest = json.loads(first["manifest.json"])
    for name, entry in manifest["kernels"].items():
        source = first[f"{name}.cu"]
        assert source.startswith(f"// {name}: generated by fp4gen codegen") and entry["spec"] in source
        assert f"FP4GEN_EXPORT int {name}_run(" in source
        assert entry["symbols"]["run"] == f"{name}_run" and entry["source"] == f"generated/{name}.cu"


def test_a_variant_may_carry_constraints_of_its_own():
    # the row pass with the transform takes rows only as wide as its cluster holds; the other row passes, and
    # the rest of the quantize-side kernels, have no width limit
    kernels = json.loads(render_all(ROOT)["manifest.json"])["kernels"]
    for name, entry in kernels.items():
        limited = entry["family"] == "row_pass" and entry["values"]["hadamard"] == "rht16"
        assert ("cols_at_most" in entry["constraints"]) == limited, name
        assert "cols_multiple_of" in entry["constraints"], name  # the family's own, kept
    assert any(entry["constraints"].get("cols_at_most") == 16384 for entry in kernels.values())


def test_committed_generated_dir_is_in_sync():
    assert check_generated(ROOT / "generated", render_all(ROOT)) == []


def test_check_fails_when_a_spec_template_or_generated_file_changes(tmp_path):
    project = copy_project(tmp_path)
    assert run_build_py(project, "--check").returncode == 0
    spec = project / "codegen/specs/dequantize.yaml"
    spec.write_text(spec.read_text().replace("[bf16, fp16, fp32]", "[bf16, fp32]"))
    result = run_build_py(project, "--check")
    assert result.returncode == 1 and "not declared by any spec: generated/dequantize_nvfp4_to_fp16_sm90a.cu" in result.stdout
    assert run_build_py(project, "--render-only").returncode == 0
    assert run_build_py(project, "--check").returncode == 0
    template = project / "templates/kernel_abi.cu.j2"
    template.write_text(template.read_text() + "// changed\n")
    result = run_build_py(project, "--check")
    assert result.returncode == 1 and "differs: generated/dequantize_nvfp4_to_bf16_sm90a.cu" in result.stdout


def test_a_header_edit_makes_the_manifest_stale(tmp_path):
    project = copy_project(tmp_path)
    header = project / "templates/include/fp4gen/nvfp4.cuh"
    header.write_text(header.read_text() + "// changed\n")
    result = run_build_py(project, "--check")
    assert result.returncode == 1 and "differs: generated/manifest.json" in result.stdout


def test_a_header_edit_stales_only_the_kernels_that_include_it(tmp_path):
    project = copy_project(tmp_path)
    before = json.loads((project / "generated/manifest.json").read_text())["kernels"]
    # included by the GEMMs that read the packed operands only (the wgmma and grouped ones share its staging code;
    # the CUTLASS GEMMs over fp16 copies, dense and grouped, its fp16 dequantization, the grouped ones also the
    # grouped C ABI's rules)
    header = project / "templates/include/fp4gen/gemm_fused_dequant.cuh"
    header.write_text(header.read_text() + "// changed\n")
    assert run_build_py(project, "--render-only").returncode == 0
    after = json.loads((project / "generated/manifest.json").read_text())["kernels"]
    changed = {name for name in before if before[name]["headers_sha256"] != after[name]["headers_sha256"]}
    assert changed == {name for name, k in before.items() if k["family"] in ("gemm_fused_dequant", "gemm_fused_wgmma",
                                                                             "gemm_packed_rs", "gemm_grouped_wgmma",
                                                                             "gemm_grouped_tma", "gemm_grouped_sm100",
                                                                             "gemm_sm90")}
    shared = project / "templates/include/fp4gen/abi.h"  # included by every kernel, through other headers too
    shared.write_text(shared.read_text() + "// changed\n")
    assert run_build_py(project, "--render-only").returncode == 0
    final = json.loads((project / "generated/manifest.json").read_text())["kernels"]
    assert all(final[name]["headers_sha256"] != after[name]["headers_sha256"] for name in after)


def test_adding_a_variant_is_a_yaml_edit(tmp_path):
    project = copy_project(tmp_path)
    (project / "codegen/specs/dequantize_extra.yaml").write_text(
        "family: dequantize\naxes: {out_dtype: [fp32], arch: [sm90a]}\n")
    result = run_build_py(project, "--render-only")  # the new spec repeats a kernel: refused with the reason
    assert result.returncode == 2 and "already declares" in result.stderr and "Traceback" not in result.stderr
    declared = len(json.loads((project / "generated/manifest.json").read_text())["kernels"])
    spec = project / "codegen/specs/dequantize.yaml"
    spec.write_text(spec.read_text().replace("[bf16, fp16, fp32]", "[bf16, fp16]"))
    assert run_build_py(project, "--render-only").returncode == 0
    manifest = json.loads((project / "generated/manifest.json").read_text())["kernels"]
    assert "dequantize_nvfp4_to_fp32_sm90a" in manifest and "dequantize_nvfp4_to_fp32_sm100a" not in manifest
    assert manifest["dequantize_nvfp4_to_fp32_sm90a"]["spec"] == "codegen/specs/dequantize_extra.yaml"
    listing = run_build_py(project, "--list").stdout
    # fp32 output moved to the new spec for sm90a only: one kernel fewer in all
    assert "dequantize_nvfp4_to_fp32_sm90a" in listing and f"{declared - 1} kernels" in listing
