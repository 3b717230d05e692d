"""bench.gpu_kernels' reading of an Nsight Compute report (the profile itself needs a GPU)."""

import pytest

from bench.gpu_kernels import by_kind, kernel_kind, kernel_seconds

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"')


def row(i: int, name: str, value: str, unit: str = "nsecond") -> str:
    return (f'"{i}","7","python3","127.0.0.1","{name}","1","13","(256, 1, 1)","(8, 1, 1)",'
            f'"0","9.0","Command line profiler metrics","gpu__time_duration.sum","{unit}",'
            f'"{value}"')


def test_durations_sum_by_kernel_and_kind():
    report = "\n".join([
        "==PROF== Connected to process 7", HEADER,
        row(0, "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "1,500"),
        row(1, "prefillq_flash_sm90_0a1b_d256", "2.5", "usecond"),
        row(2, "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "500"),
        row(3, "rms_norm", "100"),
        "==PROF== Disconnected from process 7"])
    kernels = kernel_seconds(report)
    assert kernels["nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT"] == (2, pytest.approx(2e-6))
    assert kernels["prefillq_flash_sm90_0a1b_d256"] == (1, pytest.approx(2.5e-6))
    kinds = by_kind(kernels)
    assert list(kinds) == ["attention", "matmul", "norm"]  # slowest first
    assert kinds["norm"] == (1, pytest.approx(1e-7))


def test_kinds_by_name():
    assert kernel_kind("prefillq_sparse_sm90_ab12_d512_n64") == "attention"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "matmul"
    assert kernel_kind("rope_single") == "rope"
    assert kernel_kind("copy_g_nd") == "copy"
    assert kernel_kind("custom_kernel_prefillq_gelu_gate_f59fd5a0_10240_2048") == "elementwise"
    assert kernel_kind("something_new") == "other"


def test_a_report_without_a_header_or_with_an_unknown_unit_is_refused():
    with pytest.raises(ValueError, match="header"):
        kernel_seconds("==PROF== nothing profiled")
    with pytest.raises(ValueError, match="unit"):
        kernel_seconds("\n".join([HEADER, row(0, "k", "1", "cycle")]))
