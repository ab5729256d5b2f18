"""GEMM selection by measurement (fp4gen.cuda.autotune) through the dispatcher, on CPU: launches and timings
are stubs, the manifest is rendered from specs, so a tile added in YAML takes part like any other."""
import json
from types import SimpleNamespace

import pytest
import torch

import fp4gen
from codegen.render import render_all
from conftest import copy_project
from fp4gen import NVFP4Data
from fp4gen.cuda import autotune, ops
from fp4gen.cuda.select import Problem, select, viable

NEW_TILE = "gemm_nvfp4_packed_bf16out_t128x192x64_sm90a"


@pytest.fixture(scope="module")
def manifest_with_new_tile(tmp_path_factory):
    project = copy_project(tmp_path_factory.mktemp("project"))
    spec = project / "codegen/specs/gemm_fused_wgmma.yaml"
    spec.write_text(spec.read_text().replace("128x128x64, 128x256x64]", "128x128x64, 128x192x64, 128x256x64]"))
    manifest = json.loads(render_all(project)["manifest.json"])
    assert NEW_TILE in manifest["kernels"]
    return manifest


def operands(m, n, k):
    """CPU stand-ins with the shapes and 16-byte-aligned rows of real operands (nothing is launched)."""
    a = NVFP4Data(torch.zeros(m, k // 2, dtype=torch.uint8), torch.zeros(m, k // 16, dtype=torch.uint8).view(torch.float8_e4m3fn),
                  torch.ones(m))
    b = NVFP4Data(torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 16, dtype=torch.uint8).view(torch.float8_e4m3fn),
                  torch.ones(1))
    return a, b


@pytest.fixture
def dispatcher(monkeypatch, tmp_path, manifest_with_new_tile):
    """ops.gemm_kernel on a pretend Hopper GPU: the rendered manifest, kernels that are their names, a timer
    that reads a table (and counts its calls), and an empty autotune cache under tmp_path."""
    timed = []
    table = {}

    def stub_time(kernel, a, b, out_dtype, accumulate):
        timed.append((kernel.name, a.shape[0]))
        return table.get((kernel.name, autotune.m_bucket(a.shape[0])), 1.0)

    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FP4GEN_AUTOTUNE", raising=False)
    monkeypatch.delenv("FP4GEN_KERNEL", raising=False)
    monkeypatch.setattr(ops, "load_manifest", lambda: manifest_with_new_tile)
    monkeypatch.setattr(ops, "load_kernel", lambda name: SimpleNamespace(name=name))
    monkeypatch.setattr(ops, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(ops, "_multiprocessors", lambda index: 132)
    monkeypatch.setattr(ops, "_time_gemm", stub_time)
    monkeypatch.setattr(ops, "_measuring_forbidden", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Pretend H200")
    monkeypatch.setattr(ops, "_PLANS", {})
    monkeypatch.setattr(ops, "_GEMM_PLANS", {})
    monkeypatch.setattr(ops, "_TUNING_CACHES", {})
    a_device = torch.device("cuda", 0)
    monkeypatch.setattr(NVFP4Data, "device", property(lambda self: a_device))

    def choose(m, n, k, measure=True):
        a, b = operands(m, n, k)
        return ops.gemm_kernel(a, b, torch.bfloat16, measure=measure).name

    return SimpleNamespace(choose=choose, timed=timed, table=table, tmp=tmp_path)


def rule(m, n, k, manifest):
    return select(Problem("gemm", (9, 0), {"out_dtype": "bfloat16"}, {}, k, m, {}, n, 132), manifest)


def test_a_tile_added_in_yaml_is_used_where_it_measures_fastest(dispatcher, manifest_with_new_tile):
    n, k = 4096, 1024
    dispatcher.table[(NEW_TILE, 256)] = 0.5  # fastest for M in (128, 256] only
    for m in (200, 256, 129):
        assert dispatcher.choose(m, n, k) == NEW_TILE
    for m in (64, 1000):  # elsewhere every candidate takes as long: the rule's choice stays
        assert dispatcher.choose(m, n, k) == rule(m, n, k, manifest_with_new_tile) != NEW_TILE
    # each shape class measured every candidate once: M 200, 256 and 129 share the class 256
    problem = Problem("gemm", (9, 0), {"out_dtype": "bfloat16"}, {}, k, 200)
    candidates = viable(problem, manifest_with_new_tile)
    assert NEW_TILE in candidates and len(candidates) > 3
    assert sorted(name for name, m in dispatcher.timed if m == 200) == sorted(candidates)
    assert not [name for name, m in dispatcher.timed if m in (129, 256)]


def test_measurements_persist_per_gpu_driver_and_kernel_set(dispatcher, monkeypatch, manifest_with_new_tile):
    dispatcher.table[(NEW_TILE, 512)] = 0.25
    assert dispatcher.choose(300, 2048, 512) == NEW_TILE
    files = list((dispatcher.tmp / "autotune").glob("*.json"))
    assert len(files) == 1 and "Pretend-H200" in files[0].name
    entry = next(iter(json.loads(files[0].read_text()).values()))
    assert entry["kernel"] == NEW_TILE and entry["ms"][NEW_TILE] == 0.25
    # a new process (empty in-memory state) takes the choice from disk without measuring
    monkeypatch.setattr(ops, "_GEMM_PLANS", {})
    monkeypatch.setattr(ops, "_TUNING_CACHES", {})
    dispatcher.timed.clear()
    assert dispatcher.choose(400, 2048, 512) == NEW_TILE and dispatcher.timed == []
    # another driver is another file: measured afresh
    monkeypatch.setattr(ops, "_GEMM_PLANS", {})
    monkeypatch.setattr(ops, "_TUNING_CACHES", {})
    monkeypatch.setattr(autotune, "driver_version", lambda: "999.1")
    assert dispatcher.choose(400, 2048, 512) == NEW_TILE and dispatcher.timed
    assert len(list((dispatcher.tmp / "autotune").glob("*.json"))) == 2


def test_no_measurement_means_the_rule(dispatcher, monkeypatch, manifest_with_new_tile):
    dispatcher.table[(NEW_TILE, 1024)] = 0.1
    # fp4gen.gemm_kernel without measure (a query), during graph capture, or with FP4GEN_AUTOTUNE=0
    assert dispatcher.choose(1000, 4096, 1024, measure=False) == rule(1000, 4096, 1024, manifest_with_new_tile)
    monkeypatch.setattr(ops, "_measuring_forbidden", lambda: True)
    assert dispatcher.choose(1000, 4096, 1024) == rule(1000, 4096, 1024, manifest_with_new_tile)
    assert dispatcher.timed == []
    monkeypatch.setattr(ops, "_measuring_forbidden", lambda: False)
    monkeypatch.setenv("FP4GEN_AUTOTUNE", "0")
    assert dispatcher.choose(1000, 4096, 1024) == rule(1000, 4096, 1024, manifest_with_new_tile)
    assert dispatcher.timed == []
    # the settings are read when a kind of problem is first planned: a fresh plan cache sees the change
    monkeypatch.delenv("FP4GEN_AUTOTUNE")
    assert dispatcher.choose(1000, 4096, 1024) != NEW_TILE  # still the plan made without measuring
    ops.clear_plans()
    assert dispatcher.choose(1000, 4096, 1024) == NEW_TILE  # the first eager call that may measure
    # FP4GEN_KERNEL beats a measurement
    ops.clear_plans()
    forced = "gemm_nvfp4_bf16out_t128x256x64_coop_cl2x1_sm90a"
    monkeypatch.setenv("FP4GEN_KERNEL", forced)
    assert dispatcher.choose(1000, 4096, 1024) == forced


def test_choose_keeps_the_rule_within_the_margin_and_skips_refusals():
    times = {"rule": 1.0, "close": 0.99, "broken": None}

    def time_ms(name):
        if times[name] is None:
            raise fp4gen.KernelError("refused")
        return times[name]
    assert autotune.choose(["rule", "close", "broken"], time_ms) == ("rule", times)
    times["close"] = 0.9
    assert autotune.choose(["rule", "close", "broken"], time_ms)[0] == "close"
    times["rule"] = None
    assert autotune.choose(["rule", "close"], time_ms)[0] == "close"

    def buggy(name):
        raise TypeError("a bug, not a refusal")
    with pytest.raises(TypeError, match="a bug"):  # only refusals and out-of-memory are left out
        autotune.choose(["rule"], buggy)


def test_shape_classes_round_m_up_to_a_power_of_two():
    assert [autotune.m_bucket(m) for m in (1, 16, 17, 100, 128, 129, 8192, 8193)] == \
        [16, 16, 32, 128, 128, 256, 8192, 16384]


def test_an_unreadable_cache_file_is_measured_again_and_replaced(tmp_path, capsys):
    cache = autotune.TuningCache(tmp_path, "GPU", "1.0", "abc")
    cache.path.write_text("{not json")
    again = autotune.TuningCache(tmp_path, "GPU", "1.0", "abc")
    assert again.get("k") is None and "ignoring the autotune cache" in capsys.readouterr().err
    again.put("k", "kernel", {"kernel": 1.0})
    assert autotune.TuningCache(tmp_path, "GPU", "1.0", "abc").get("k") == "kernel"
