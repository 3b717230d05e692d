// Hopper's warpgroup MMA (`wgmma`, sm_90a) for the kernels compiled through NVRTC
// (flash_attention_sm90.cu, sparse_attention_sm90.cu; prepended after mma.cuh): the
// 128-byte swizzle of shared-memory tiles, their matrix descriptors, the asynchronous
// products and their fences (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-
// Accumulate Instructions").
//
// A tile of R rows x D columns (bf16) sits in shared memory as D/64 regions of R rows x 128
// bytes, 1,024-byte aligned, and the 16-byte chunk c of row r at chunk c ^ (r % 8) of its
// region ("Shared Memory Matrix Layout"). An accumulator fragment j of a 64-row product
// gives a thread rows 16 * (warp % 4) + lane / 4 (+ 8) and columns 8 j + 2 (lane % 4) (+ 1),
// as mma.sync's C fragment does.

// The byte offset of 16-byte chunk `c` (of D / 8) of row `r` in a swizzled tile of R rows.
__device__ __forceinline__ uint32_t swizzled(int r, int c, int R) {
  return (c >> 3) * R * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// A wgmma shared-memory descriptor (PTX ISA, "Matrix Descriptor Format"): start address,
// leading and stride byte offsets (16-byte units), 128-byte swizzle.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lead, uint32_t stride) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lead >> 4) << 16) |
         ((uint64_t)(stride >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait_all() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

// Keep the compiler from moving reads or writes of accumulators across an asynchronous
// wgmma: each register passes through an empty asm after the wait.
template <int TILES>
__device__ __forceinline__ void fence_registers(float (&x)[TILES][4]) {
#pragma unroll
  for (int j = 0; j < TILES; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(x[j][e]) :: "memory");
}

#define PREFILLQ_ACC32(a, base)                                                          \
  "+f"(a[base + 0][0]), "+f"(a[base + 0][1]), "+f"(a[base + 0][2]), "+f"(a[base + 0][3]), \
  "+f"(a[base + 1][0]), "+f"(a[base + 1][1]), "+f"(a[base + 1][2]), "+f"(a[base + 1][3]), \
  "+f"(a[base + 2][0]), "+f"(a[base + 2][1]), "+f"(a[base + 2][2]), "+f"(a[base + 2][3]), \
  "+f"(a[base + 3][0]), "+f"(a[base + 3][1]), "+f"(a[base + 3][2]), "+f"(a[base + 3][3]), \
  "+f"(a[base + 4][0]), "+f"(a[base + 4][1]), "+f"(a[base + 4][2]), "+f"(a[base + 4][3]), \
  "+f"(a[base + 5][0]), "+f"(a[base + 5][1]), "+f"(a[base + 5][2]), "+f"(a[base + 5][3]), \
  "+f"(a[base + 6][0]), "+f"(a[base + 6][1]), "+f"(a[base + 6][2]), "+f"(a[base + 6][3]), \
  "+f"(a[base + 7][0]), "+f"(a[base + 7][1]), "+f"(a[base + 7][2]), "+f"(a[base + 7][3])

#define PREFILLQ_ACC16(a)                                                                \
  "+f"(a[0][0]), "+f"(a[0][1]), "+f"(a[0][2]), "+f"(a[0][3]),                             \
  "+f"(a[1][0]), "+f"(a[1][1]), "+f"(a[1][2]), "+f"(a[1][3]),                             \
  "+f"(a[2][0]), "+f"(a[2][1]), "+f"(a[2][2]), "+f"(a[2][3]),                             \
  "+f"(a[3][0]), "+f"(a[3][1]), "+f"(a[3][2]), "+f"(a[3][3])

#define PREFILLQ_D32                                                                     \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define PREFILLQ_D16                                                                     \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"

// D (64 x 8 TILES, fp32: TILES fragments of 8 keys) (+)= A B with A and B in shared memory,
// both K-major (S = Q K^T: m64n64k16, or m64n32k16 for 32-key steps); `accumulate` 0
// overwrites D.
template <int TILES>
__device__ __forceinline__ void wgmma_ss(float (&d)[TILES][4], uint64_t a, uint64_t b,
                                         int accumulate) {
  static_assert(TILES == 8 || TILES == 4, "n = 64 or 32");
  if constexpr (TILES == 8) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " PREFILLQ_D32
        ", %32, %33, p, 1, 1, 0, 0;\n}\n"
        : PREFILLQ_ACC32(d, 0)
        : "l"(a), "l"(b), "r"(accumulate));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " PREFILLQ_D16
        ", %16, %17, p, 1, 1, 0, 0;\n}\n"
        : PREFILLQ_ACC16(d)
        : "l"(a), "l"(b), "r"(accumulate));
  }
}

// D (64 x 64 fp32: fragments BASE..BASE+7 of `d`) += A B with A (64 x 16 bf16) from
// registers and B from shared memory, MN-major (O += P V, V's rows are keys).
template <int BASE, int TILES>
__device__ __forceinline__ void wgmma_rs(float (&d)[TILES][4], uint32_t a0, uint32_t a1,
                                         uint32_t a2, uint32_t a3, uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " PREFILLQ_D32
      ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
      : PREFILLQ_ACC32(d, BASE)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
}

// P (S's accumulator fragments, fp32) as the bf16 pairs of O += P V's A operand from
// registers: its k-step of 16 keys i is fragments 2i and 2i + 1.
template <int N_TILES>
__device__ __forceinline__ void pack_a_operand(const float (&s)[N_TILES][4],
                                               uint32_t (&pa)[N_TILES / 2][4]) {
#pragma unroll
  for (int i = 0; i < N_TILES / 2; ++i) {
    pa[i][0] = pack_bf16(s[2 * i][0], s[2 * i][1]);
    pa[i][1] = pack_bf16(s[2 * i][2], s[2 * i][3]);
    pa[i][2] = pack_bf16(s[2 * i + 1][0], s[2 * i + 1][1]);
    pa[i][3] = pack_bf16(s[2 * i + 1][2], s[2 * i + 1][3]);
  }
}

// S (64 x 8 N_TILES, fp32) = Q K^T over DEPTH dims, issued, not awaited: Q's 64 rows at
// `q` in a swizzled tile of Q_ROWS rows, the N_TILES * 8 keys at `k` in their own swizzled
// tile (both K-major, a 128-byte region per 64 dims); DEPTH / 16 k-steps of 16 dims.
template <int DEPTH, int Q_ROWS, int N_TILES>
__device__ __forceinline__ void issue_qk(float (&s)[N_TILES][4], uint32_t q, uint32_t k) {
#pragma unroll
  for (int kk = 0; kk < DEPTH / 16; ++kk) {
    const uint32_t col = (kk % 4) * 32;   // 16 dims of a 64-dim region
    wgmma_ss(s, smem_desc(q + (kk / 4) * Q_ROWS * 128 + col, 16, 1024),
             smem_desc(k + (kk / 4) * N_TILES * 8 * 128 + col, 16, 1024), kk > 0);
  }
}

// O (64 x 64 REGIONS, fp32) += P V, issued, not awaited: P's k-step of 16 keys i is
// `pa[i]` (pack_a_operand), V the tile of K_STEPS * 16 keys at `v` read MN-major, its
// region r holding dims 64 r.. of every key row.
template <int REGIONS, int K_STEPS, int O_TILES>
__device__ __forceinline__ void issue_pv(float (&o)[O_TILES][4],
                                         const uint32_t (&pa)[K_STEPS][4], uint32_t v) {
  static_assert(REGIONS >= 1 && REGIONS <= 4 && O_TILES >= 8 * REGIONS,
                "O += P V covers one to four 64-dim regions of O");
  constexpr uint32_t TILE = K_STEPS * 16 * 128;   // one region of the key tile, bytes
#pragma unroll
  for (int i = 0; i < K_STEPS; ++i) {
    const uint32_t rows = v + i * 16 * 128;
    wgmma_rs<0>(o, pa[i][0], pa[i][1], pa[i][2], pa[i][3], smem_desc(rows, TILE, 1024));
    if constexpr (REGIONS > 1)
      wgmma_rs<8>(o, pa[i][0], pa[i][1], pa[i][2], pa[i][3],
                  smem_desc(rows + TILE, TILE, 1024));
    if constexpr (REGIONS > 2)
      wgmma_rs<16>(o, pa[i][0], pa[i][1], pa[i][2], pa[i][3],
                   smem_desc(rows + 2 * TILE, TILE, 1024));
    if constexpr (REGIONS > 3)
      wgmma_rs<24>(o, pa[i][0], pa[i][1], pa[i][2], pa[i][3],
                   smem_desc(rows + 3 * TILE, TILE, 1024));
  }
}

// Every thread's cp.async copies are in, made visible to the async proxy wgmma reads
// shared memory by, and every thread of the block is past the previous step.
__device__ __forceinline__ void async_tiles_ready() {
  asm volatile("cp.async.wait_group 0;\n" ::);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
}
