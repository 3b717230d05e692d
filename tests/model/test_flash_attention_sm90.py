"""The Hopper attention kernel's host side on the CPU: NVRTC builds every variant for sm_90a
(no GPU needed to compile), the source needs sm_90a's instructions, the block fits a Hopper
multiprocessor's shared memory, and the CPU never takes the path. The kernel's results are
checked on the GPU: `python -m bench.gpu_attention --check`."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from model.kernels import flash_attention as fa
from model.kernels import flash_attention_sm90 as sm90
from model.kernels.nvrtc import NvrtcError, compile_cubin
from tests.model.sass import disassemble, hgmma_shapes, nvrtc_or_skip, spills

# Hopper's largest opt-in dynamic shared memory a block (H100/H200: 227 KB)
HOPPER_SHARED_BYTES = 227 * 1024


@pytest.mark.parametrize("block_n", [64, 32])
@pytest.mark.parametrize("warpgroups", [1, 2])
@pytest.mark.parametrize("variant", [sm90.ONE, sm90.SPLIT, sm90.PACKED])
def test_every_variant_compiles_for_sm_90a(variant, warpgroups, block_n):
    nvrtc_or_skip()
    build = (256, variant, block_n, warpgroups, sm90.STAGES)
    cubin = sm90._cubin(*build)
    assert cubin[:4] == b"\x7fELF"
    assert sm90.kernel_name(*build).encode() in cubin   # extern "C": MLX looks it up by name


@pytest.mark.parametrize("block_n, hgmma", [
    (64, {"64x64x16": 16 + 16}),                  # S and O += P V both n = 64
    (32, {"64x32x16": 16, "64x64x16": 4 * 2}),    # S n = 32; P V 4 regions x 2 k-steps
])
@pytest.mark.parametrize("warpgroups", [1, 2])   # both of the plan's blocks
@pytest.mark.parametrize("variant", [sm90.ONE, sm90.SPLIT, sm90.PACKED])
def test_the_products_run_on_warpgroup_mma_without_spills(variant, warpgroups, block_n, hgmma,
                                                          tmp_path):
    # a step's S = Q K^T is D / 16 = 16 wgmma (n = the step's keys) and its O += P V 4
    # regions x block_n / 16 k-steps of m64n64k16, each once in the loop's one copy; and
    # no register spills (local memory loads/stores), which would cost every step
    nvrtc_or_skip()
    sass = disassemble(sm90._cubin(256, variant, block_n, warpgroups, sm90.STAGES), tmp_path)
    assert hgmma_shapes(sass) == hgmma
    assert not spills(sass)


@pytest.mark.parametrize("variant", [sm90.ONE, sm90.SPLIT, sm90.PACKED])
def test_the_tma_build_has_a_producer_warpgroup_that_hands_its_registers_over(variant,
                                                                             tmp_path):
    # the producer's bulk tensor copies: Q's 2 warpgroups x 4 regions, then a step's K and
    # V 4 regions each (the loops unrolled); setmaxnreg takes the producer to 24 registers
    # and the consumers to 240, and the consumers' products still fit them without spills
    nvrtc_or_skip()
    build = (256, variant, sm90.BLOCK_N, 2, 2, sm90.PINGPONG, True)
    sass = disassemble(sm90._cubin(*build), tmp_path)
    assert len(re.findall(r"\bUTMALDG\.3D\b", sass)) == 2 * 4 + 4 + 4
    assert re.findall(r"USETMAXREG\.DEALLOC\.CTAPOOL (0x[0-9a-f]+)", sass) == ["0x18"]
    assert len(re.findall(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL", sass)) == 1
    assert max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)) < 240
    assert hgmma_shapes(sass) == {"64x64x16": 32}
    assert not spills(sass)
    # turns on two named barriers, one a warpgroup (no block-wide barrier in the loop)
    for barrier in ("0x1", "0x2"):
        turns = re.findall(rf"BAR\.(SYNC\S*|ARV) {barrier}, 0x100\b", sass)
        assert sorted(set(turns)) == ["ARV", "SYNC.DEFER_BLOCKING"]
    assert sm90.kernel_name(*build).endswith(f"_tma_{variant}")
    assert sm90.threads(2, tma=True) == 384 and sm90.threads(2, tma=False) == 256
    assert sm90.shared_bytes(256, tma=True) == sm90.shared_bytes(256, tma=False) + 512
    assert sm90.shared_bytes(256, tma=True) <= HOPPER_SHARED_BYTES


def test_without_tma_no_copy_engine_or_register_handover(tmp_path):
    nvrtc_or_skip()
    sass = disassemble(sm90._cubin(256, sm90.ONE, sm90.BLOCK_N, 2, 2, sm90.PINGPONG, False),
                       tmp_path)
    assert not re.search(r"UTMALDG|USETMAXREG", sass)


@pytest.mark.parametrize("warpgroups, pingpong, turns", [
    (2, True, True),     # the default: the second warpgroup waits for the first's S
    (2, False, False),
    (1, True, False),    # one warpgroup has no one to take turns with
])
def test_two_warpgroups_take_turns_on_a_named_barrier(warpgroups, pingpong, turns, tmp_path):
    # barrier 1 of both warpgroups' 256 threads: the first arrives once its S is issued, the
    # second syncs on it before issuing its own (barrier 0 is __syncthreads')
    nvrtc_or_skip()
    sass = disassemble(sm90._cubin(256, sm90.ONE, sm90.BLOCK_N, warpgroups, sm90.STAGES,
                                   pingpong), tmp_path)
    named = re.findall(r"BAR\.(SYNC\S*|ARV) 0x1, 0x100\b", sass)
    assert sorted(set(named)) == (["ARV", "SYNC.DEFER_BLOCKING"] if turns else [])
    assert sm90.PINGPONG   # on by default since it measured faster (docs/benchmarks.md)


def test_the_source_needs_the_architecture_specific_target():
    # wgmma is refused on plain sm_90 (MLX's own JIT target): why the kernel goes through
    # NVRTC for sm_90a at all
    nvrtc_or_skip()
    with pytest.raises(NvrtcError, match="wgmma"):
        compile_cubin(sm90.PRELUDE + sm90.HEADER + sm90.WGMMA + sm90.SOURCE, "plain.cu",
                      "sm_90",
                      ("-DKERNEL_NAME=plain", "-DD=256", "-DBLOCK_N=64", "-DWARPGROUPS=2"))


def test_a_compile_error_carries_nvrtc_log():
    nvrtc_or_skip()
    with pytest.raises(NvrtcError, match=r"(?s)broken.cu does not compile.*is undefined"):
        compile_cubin('extern "C" __global__ void k() { undefined_name(); }', "broken.cu",
                      "sm_90a")


def test_a_block_fits_a_hopper_multiprocessor():
    assert sm90.shared_bytes(256) <= HOPPER_SHARED_BYTES
    # one warpgroup's 32-key tiles: two blocks a multiprocessor (228 KB, 1 KB reserved each)
    assert 2 * (sm90.shared_bytes(256, 32, 1, 2) + 1024) <= 228 * 1024
    # Q (128 rows), two stages of K and V (64 rows each), 256 bf16 wide, and 1 KB of alignment
    assert sm90.shared_bytes(256) == (128 + 4 * 64) * 256 * 2 + 1024


def test_the_cpu_never_takes_the_hopper_path():
    assert sm90.compute_capability() is None and not sm90.available()
    assert not fa._hopper(None)
    # the mma.sync path's rows a block stay what its plan says; the sm_90a path plans with
    # two warpgroups' 128 rows
    assert fa.SM90_WARPS * fa.ROWS_PER_WARP == 64 * sm90.WARPGROUPS
    q = mx.zeros((1, 4, 8, 256), dtype=mx.bfloat16)
    assert not fa.applies(q, q[:, :1])


def test_kernel_names_change_with_their_source():
    # MLX caches compiled kernels on disk by name: an edited source must get a new one
    from model.kernels import source_tag

    name = sm90.kernel_name(256, sm90.ONE, sm90.BLOCK_N, sm90.WARPGROUPS, sm90.STAGES)
    texts = (sm90.HEADER, sm90.WGMMA, sm90.TMA_HEADER, sm90.SOURCE)
    assert source_tag(*texts) in name
    for i in range(len(texts)):   # every text the kernel is built from
        edited = texts[:i] + (texts[i] + "\n",) + texts[i + 1:]
        assert source_tag(*edited) != source_tag(*texts)


def test_the_sm_90a_plan_splits_keys_only_for_few_blocks_over_many_keys():
    # (query blocks, splits, warps); two warpgroups (128 queries) a block, 132 multiprocessors
    assert sm90.MULTIPROCESSORS == 132
    assert (fa.SM90_SPLIT_BELOW_BLOCKS, fa.SM90_SPLIT_ABOVE_KEYS) == (33, 32_768)
    # Gemma 3 4B's chunk (8 heads) and 270M's (4): 128 and 64 blocks, no split however long
    assert fa.plan(1, 8, 2048, 32_768, None, hopper=True) == (16, 1, 8)
    assert fa.plan(1, 8, 2048, 8192, 1024, hopper=True) == (16, 1, 8)
    assert fa.plan(1, 4, 2048, 131_072, None, hopper=True) == (16, 1, 8)
    assert fa.plan(1, 4, 8192, 8192, None, hopper=True) == (64, 1, 8)
    assert fa.plan(1, 1, 33 * 128, 200_000, None, hopper=True) == (33, 1, 8)
    # few blocks over up to 32K keys: no split either
    assert fa.plan(1, 4, 64, 16_448, None, hopper=True) == (1, 1, 8)
    assert fa.plan(1, 8, 512, 32_768, None, hopper=True) == (4, 1, 8)
    # few blocks over more: splits up to half the multiprocessors (66 blocks), each at
    # least MIN_KEY_BLOCKS_PER_SPLIT key blocks long
    assert fa.plan(1, 8, 512, 32_769, None, hopper=True) == (4, 2, 8)    # 32 blocks x 2
    assert fa.plan(1, 4, 512, 65_536, None, hopper=True) == (4, 4, 8)    # 16 blocks x 4
    assert fa.plan(1, 4, 64, 65_600, None, hopper=True) == (1, 16, 8)    # 4 blocks x 16
    assert fa.plan(1, 1, 1, 32_800, None, hopper=True) == (1, 16, 8)     # 513 key blocks // 32
    assert fa.plan(1, 4, 64, 16_448, 4096, hopper=True) == (1, 1, 8)     # a window's keys
    # the mma.sync plan is unchanged: 512 blocks already
    assert fa.plan(1, 4, 8192, 8192, None) == (128, 1, 4)
