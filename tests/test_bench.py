"""The benchmark's pure parts, on the CPU: cases, traffic, rows, tables, files, the command line.

Nothing here launches a kernel; the measurements themselves run on the GPU only.
"""

from __future__ import annotations

import csv
import json
import math
import re
import sys
import types

import pytest

from cupy_merge.tools import bench, bench_flashinfer
from cupy_merge.tools.bench_cases import (
    FAMILIES,
    HOST,
    Case,
    all_cases,
    flashinfer_supports,
    host_cases,
    ragged_counts,
    ragged_indptr,
    select,
    traffic_bytes,
)
from cupy_merge.tools.bench_report import (
    COLUMNS,
    HOST_COLUMNS,
    _time,
    cuda_version_string,
    environment_line,
    finish_row,
    format_table,
    overhead_pct,
    plot,
    write_results,
)
from cupy_merge.tools.bench_runners import RUNNERS


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_the_case_list_covers_every_family_and_names_each_case_once(quick):
    cases = all_cases(quick=quick)
    assert {case.family for case in cases} == set(FAMILIES)
    keys = [(case.family, case.label) for case in cases]
    assert len(keys) == len(set(keys))
    assert host_cases(quick) and all(
        case.family == "two-way" and case.tokens <= 64 for case in host_cases(quick)
    )
    assert set(RUNNERS) == set(FAMILIES)


def test_quick_is_a_few_cases_and_the_full_list_has_the_new_ones():
    full, quick = all_cases(), all_cases(quick=True)
    assert len(quick) < len(full) / 2
    labels = {(case.family, case.label) for case in full}
    for tokens in (1, 2, 8):
        for states in (256, 1024, 4096):
            assert ("n-way", f"T={tokens} S={states} H=32 D=128 bf16") in labels
    assert ("n-way", "T=64 S=16 H=32 D=128 bf16") in labels and (
        "n-way",
        "T=64 S=64 H=32 D=128 bf16",
    ) in labels
    ragged = {(case.states, case.tokens) for case in full if case.family == "ragged"}
    assert {(100, 64), (100, 512), (200, 64), (200, 512), (8, 1024), (16, 4096)} <= ragged
    quick_labels = {case.label for case in quick if case.family == "n-way"}
    assert {"T=1 S=1024 H=32 D=128 bf16", "T=8 S=256 H=32 D=128 bf16"} <= quick_labels


def test_backward_cases_span_a_megabyte_to_hundreds():
    sizes = [traffic_bytes(case) / 1e6 for case in all_cases() if case.backward]
    assert min(sizes) < 2 and max(sizes) > 200
    for kind in ("two-way", "n-way", "ragged"):
        assert any(case.kind == kind and traffic_bytes(case) > 25e6 for case in all_cases() if case.backward)


def test_labels():
    assert Case("n-way", 1, states=1024).label == "T=1 S=1024 H=32 D=128 bf16"
    assert Case("two-way", 613, 16, 96, "float32").label == "T=613 H=16 D=96 fp32"
    assert Case("fp8-group", 4, 128, 128).label == "T=4 H=128 D=128 bf16 ->e4m3 g128"
    rows = int(ragged_counts(100, 64).sum())
    assert Case("ragged+sinks", 64, states=100).label == f"T=64 S~100 R={rows} H=32 D=128 bf16"
    with pytest.raises(ValueError, match="family"):
        Case("three-way", 1)


# Traffic by hand: one head of 8 bfloat16 values: a state is 8 * 2 + 4 = 20 bytes a token.
def test_two_way_traffic_by_hand():
    # read v_a, v_b (2 * 2 tokens * 16 bytes) and s_a, s_b (2 * 2 * 4); write v (32) and s (8)
    assert traffic_bytes(Case("two-way", 2, 1, 8)) == 64 + 16 + 32 + 8 == 120
    assert traffic_bytes(Case("two-way+sinks", 2, 1, 8)) == 120 + 4  # one float32 sink a head
    assert traffic_bytes(Case("two-way", 2, 1, 8, "float32")) == 3 * 2 * (8 * 4 + 4)


def test_n_way_traffic_by_hand():
    # 3 states of 2 tokens read (6 * 20), 2 tokens written (2 * 20)
    assert traffic_bytes(Case("n-way", 2, 1, 8, states=3)) == 160
    # the gradient: the states and grad of the result read (6 + 2), one gradient a state written (6)
    assert traffic_bytes(Case("n-way-bwd", 2, 1, 8, states=3)) == (6 + 2 + 6) * 20
    # two-way gradient: v_a, v_b, s_a, s_b, grad_v, grad_s read; grad_v_a, grad_v_b, grad_s_a, grad_s_b written
    assert traffic_bytes(Case("two-way-bwd", 2, 1, 8)) == (64 + 16 + 32 + 8) + (64 + 16) == 200


def test_ragged_traffic_and_offsets():
    case = Case("ragged", 5, 1, 8, states=3)
    counts = ragged_counts(3, 5)
    indptr = ragged_indptr(3, 5)
    assert counts.min() >= 0 and counts.max() <= 6 and len(counts) == 5
    assert indptr.dtype.name == "int32" and indptr[0] == 0 and list(indptr[1:] - indptr[:-1]) == list(counts)
    rows = int(counts.sum())
    assert case.rows == rows == indptr[-1]
    assert traffic_bytes(case) == (rows + 5) * 20 + 6 * 4  # and 6 int32 offsets
    assert traffic_bytes(Case("ragged-bwd", 5, 1, 8, states=3)) == (2 * rows + 5) * 20 + 6 * 4
    assert (ragged_counts(3, 5) == counts).all()  # a fixed seed


def test_fp8_traffic_by_hand():
    # 2 tokens, 1 head of 128: two bf16 inputs (2 * 256 * 2), s_a, s_b (16), the scale (4);
    # FP8 values (256) and the LSE (8) written; group scales: 256 / 128 float32 more.
    assert traffic_bytes(Case("fp8", 2, 1, 128)) == 1024 + 16 + 4 + 256 + 8 == 1308
    assert traffic_bytes(Case("fp8-group", 2, 1, 128)) == 1308 + 8


def test_flashinfer_takes_what_its_launchers_take():
    assert flashinfer_supports(Case("two-way", 4096))
    assert not flashinfer_supports(Case("two-way", 4096, 128, 128))  # 2048 threads a block
    assert not flashinfer_supports(Case("two-way", 613, 16, 96))  # head_size 96
    assert not flashinfer_supports(Case("two-way", 4096, dtype="float16"))
    assert flashinfer_supports(Case("two-way", 8192, 16, 512))
    assert flashinfer_supports(Case("n-way", 1, 128, 128, states=1024))  # its many-states kernel: 128 threads
    assert not flashinfer_supports(Case("n-way", 64, 128, 128, states=16))
    assert flashinfer_supports(Case("ragged", 64, states=200))
    for family in FAMILIES:
        if family not in ("two-way", "n-way", "ragged"):
            assert not flashinfer_supports(Case(family, 64, states=4))


def test_select_keeps_the_order():
    cases = all_cases(quick=True)
    picked = select(cases, ["ragged", "two-way"])
    assert picked == [case for case in cases if case.family in ("two-way", "ragged")]
    assert select(cases, None) == cases


def test_finish_row_derives_the_ratios():
    row = finish_row(
        {"family": "two-way", "case": "x", "mbytes": 10.0, "merge_us": 5.0, "copy_us": 4.0,
         "flashinfer_us": 6.0, "cm_fi_layout_us": 4.8}
    )  # fmt: skip
    assert row["pct_of_copy"] == pytest.approx(80.0)
    assert row["gbps"] == pytest.approx(10e6 / 5.0 / 1e3)  # 2000 GB/s
    assert row["fi_over_cm"] == pytest.approx(6.0 / 4.8)  # against the better of ours
    assert "overhead_pct" not in row
    sinks = finish_row({"mbytes": 1.0, "merge_us": 10.3, "copy_us": 9.0, "baseline_us": 10.0})
    assert sinks["overhead_pct"] == pytest.approx(3.0)
    assert "fi_over_cm" not in sinks
    failed = finish_row({"family": "n-way", "case": "y", "mbytes": 1.0})
    assert "pct_of_copy" not in failed and "gbps" not in failed


def test_overhead_pct():
    assert overhead_pct(103.0, 100.0) == pytest.approx(3.0)
    assert overhead_pct(99.0, 100.0) == pytest.approx(-1.0)


def test_the_table_has_a_header_one_line_a_row_and_dashes_for_what_is_missing():
    rows = [
        finish_row({"family": "two-way", "case": "T=1 H=32 D=128 bf16", "mbytes": 0.025,
                    "merge_us": 2.5, "copy_us": 2.4, "torch_us": 20.0}),
        finish_row({"family": "ragged-bwd", "case": "T=64 S~8 R=523 H=32 D=128 bf16", "mbytes": 9.2,
                    "merge_us": 4.0, "copy_us": 3.8, "compiled_us": math.nan}),
    ]  # fmt: skip
    lines = format_table(rows).splitlines()
    assert len(lines) == 1 + len(rows)
    header = lines[0].split()
    assert header == [name for name, _ in COLUMNS]
    for name in (
        "family",
        "case",
        "mbytes",
        "merge_us",
        "copy_us",
        "pct_of_copy",
        "gbps",
        "torch_us",
        "flashinfer_us",
        "fi_over_cm",
        "cm_fi_layout_us",
        "baseline_us",
        "overhead_pct",
        "maxdiff",
    ):
        assert name in header  # fmt: skip
    assert lines[1].startswith("two-way ") and "T=1 H=32 D=128 bf16" in lines[1]
    assert lines[2].startswith("ragged-bwd ")
    # every line has a cell for every column: the case's spaces aside, the same number of fields
    for line, row in zip(lines[1:], rows):
        fields = line.split()
        assert len(fields) == len(header) + row["case"].count(" ")
    assert lines[1].split()[-1] == "-" and "20.00" in lines[1]
    assert "nan" not in lines[2]  # a NaN (compile failure) prints as '-'


def test_the_columns_line_up():
    rows = [{"family": "n-way", "case": "a", "mbytes": 1.0, "merge_us": 1234.5},
            {"family": "two-way+sinks", "case": "longer case", "mbytes": 100.0, "merge_us": 1.0}]  # fmt: skip
    lines = format_table(rows, [("family", str), ("case", str), ("merge_us", _time)]).splitlines()
    assert {len(line) for line in lines} == {len(lines[0])}  # numbers right-aligned to the header's end
    assert lines[1].endswith("1234") and lines[2].endswith("1.00")


def test_the_host_table_is_its_own():
    lines = format_table(
        [{"case": "T=1 H=32 D=128 bf16", "host_cupy_us": 9.5}], HOST_COLUMNS
    ).splitlines()
    assert lines[0].split() == [name for name, _ in HOST_COLUMNS]
    assert lines[1].split()[4:6] == ["9.50", "-"]


def test_environment_line_and_versions():
    assert cuda_version_string(12080) == "12.8" and cuda_version_string(13000) == "13.0"
    env = {"date": "2026-12-02 10:00", "gpu": "NVIDIA H200 (sm_90)", "driver": "580.159.04 (CUDA 13.0)",
           "cuda_runtime": "13.0", "cupy": "14.2.0", "torch": "2.11.0", "cupy_merge": "0.4.0"}  # fmt: skip
    line = environment_line(env)
    assert "\n" not in line
    for value in env.values():
        assert value in line


def test_flashinfer_headers_are_built_through_our_shim_by_nvcc_for_the_device_arch():
    command = bench_flashinfer.nvcc_command("/fi/include", "/tmp/shim.cu", "90", "/tmp/x.so", "/usr/bin/nvcc")
    assert command[0] == "/usr/bin/nvcc" and "-gencode=arch=compute_90,code=sm_90" in command
    assert command[command.index("-I") + 1] == "/fi/include" and "/tmp/shim.cu" in command
    assert command[-2:] == ["-o", "/tmp/x.so"] and "-shared" in command


def test_the_shim_declares_the_three_functions_the_loader_binds():
    shim = bench_flashinfer.SHIM_SOURCE
    assert '#include "flashinfer/attention/cascade.cuh"' in shim and 'extern "C"' in shim
    for name, launcher, parameters in (
        ("cm_fi_merge_state", "MergeState<bf16, bf16>", 10),
        ("cm_fi_merge_states", "MergeStates<bf16, bf16>", 9),
        ("cm_fi_variable_length_merge_states", "VariableLengthMergeStates<bf16, bf16, int32_t>", 9),
    ):
        match = re.search(rf"int {name}\(([^)]*)\)", shim)
        assert match and len(match.group(1).split(",")) == parameters, name
        assert f"flashinfer::{launcher}(" in shim


def test_a_source_tree_is_recognised_by_its_cascade_header(tmp_path):
    assert not bench_flashinfer.is_source_tree(str(tmp_path))
    header = tmp_path / bench_flashinfer.CASCADE_HEADER
    header.parent.mkdir(parents=True)
    header.write_text("// stand-in")
    assert bench_flashinfer.is_source_tree(str(tmp_path))


class _StandIn:
    """A stand-in ``flashinfer`` package: each merge records its call and returns (values, lse)."""

    def __init__(self, ragged_under_triton: bool = True):
        self.calls: list[tuple] = []
        self.__version__ = "0.0-stand-in"
        self.merge_state = self._recorder("merge_state")
        self.merge_states = self._recorder("merge_states")
        ragged = self._recorder("variable_length_merge_states")
        if ragged_under_triton:
            self.triton = types.SimpleNamespace(
                cascade=types.SimpleNamespace(variable_length_merge_states=ragged)
            )
        else:
            self.variable_length_merge_states = ragged

    def _recorder(self, name):
        def merge(*args):
            self.calls.append((name, args))
            return (f"{name} values", f"{name} lse")

        return merge


@pytest.mark.parametrize("ragged_under_triton", [True, False], ids=["triton.cascade", "top-level"])
def test_the_installed_package_merges_are_found_and_called_in_flashinfer_layout(
    monkeypatch, ragged_under_triton
):
    stand_in = _StandIn(ragged_under_triton)
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in)
    fi = bench_flashinfer.from_package()
    assert fi is not None and fi.source == "flashinfer 0.0-stand-in (package)"
    assert fi.two_way("va", "sa", "vb", "sb")() == "merge_state values"
    assert fi.n_way("v", "s")() == "merge_states values"
    assert fi.ragged("v", "s", "indptr", 7)() == "variable_length_merge_states values"
    assert stand_in.calls == [
        ("merge_state", ("va", "sa", "vb", "sb")),
        ("merge_states", ("v", "s")),
        ("variable_length_merge_states", ("v", "s", "indptr")),
    ]


def test_a_package_without_a_merge_is_named(monkeypatch, capsys):
    stand_in = _StandIn()
    del stand_in.merge_states
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in)
    assert bench_flashinfer.from_package() is None
    assert "has no merge_states" in capsys.readouterr().err


def test_without_flashinfer_the_benchmark_says_how_to_get_it_before_any_gpu_work(
    monkeypatch, tmp_path, capsys
):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer raises ImportError
    assert bench.main(["--flashinfer"]) == 2
    err = capsys.readouterr().err
    assert "pip install flashinfer-python" in err and "--flashinfer DIR" in err
    assert bench.main(["--flashinfer", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cascade.cuh" in err and "git clone" in err


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m cupy_merge.bench")
    for option in ("--quick", "--no-compile", "--out", "--plot", "--distributed", "--flashinfer", "--only"):
        assert option in out
    assert "fi_over_cm" in out  # the docstring, which says what the columns are


def test_arguments():
    args = bench.parse_args(["--quick", "--flashinfer", "fi", "--only", "n-way, host", "--out", "x.json"])
    assert args.quick and args.flashinfer == "fi" and args.only == ["n-way", HOST] and args.out == "x.json"
    assert not args.no_compile and args.plot is None and not args.distributed
    assert bench.parse_args([]).only is None and bench.parse_args([]).flashinfer is None
    assert bench.parse_args(["--flashinfer"]).flashinfer == ""  # the installed package


def test_bad_arguments_exit_with_status_2(capsys):
    for argv in (["--only", "three-way"], ["--bogus"]):
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(argv)
        assert exit_.value.code == 2
    assert "three-way" in capsys.readouterr().err


def _rows():
    return [
        finish_row({"family": "two-way", "case": "T=1 H=32 D=128 bf16", "mbytes": 0.025,
                    "merge_us": 2.5, "copy_us": 2.4, "flashinfer_us": 2.7, "cm_fi_layout_us": 2.6}),
        finish_row({"family": "n-way+sinks", "case": "T=1 S=1024 H=32 D=128 bf16", "mbytes": 8.5,
                    "merge_us": 5.0, "copy_us": 4.5, "baseline_us": 4.9}),
    ]  # fmt: skip


def test_results_files(tmp_path):
    rows, host = _rows(), [{"case": "T=1 H=32 D=128 bf16", "host_cupy_us": 9.5}]
    env = {"gpu": "x"}
    write_results(rows, host, env, str(tmp_path / "r.json"))
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["environment"] == env and data["rows"] == rows and data["host"] == host
    write_results(rows, host, env, str(tmp_path / "r.csv"))
    with open(tmp_path / "r.csv") as f:
        read = list(csv.DictReader(f))
    assert [r["table"] for r in read] == ["merge", "merge", "host"]
    assert read[1]["family"] == "n-way+sinks" and float(read[1]["overhead_pct"]) == pytest.approx(
        100 * 0.1 / 4.9
    )
    assert read[2]["host_cupy_us"] == "9.5" and read[0]["host_cupy_us"] == ""


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    assert plot(_rows(), {"gpu": "x", "date": "today"}, str(path))
    assert path.stat().st_size > 0
