// DeepSeek-V4's attention over per-query key lists on Hopper (sm_90a): what
// sparse_attention.cu computes (every query attends the rows its index list names, one
// shared KV head with K = V, a per-head sink in the softmax's denominator; the reference's
// inference/kernel.py `sparse_attn`), with the products on warpgroup MMA (wgmma.cuh).
//
// Compiled by NVRTC for sm_90a (model/kernels/sparse_attention.py; mma.cuh's and
// wgmma.cuh's primitives are prepended) and launched through MLX's
// `mx.fast.precompiled_cuda_kernel`: inputs (row-contiguous) q bf16 (1, H, L, D), kv bf16
// (N, D), idx int32 (L, K) (a query's key rows in kv; -1: no key), sinks float32 (H,),
// scale float32 [1]; output out bf16 (L, H, D); scalars H, L, K.
// Defines: KERNEL_NAME, D (head dim, 512), BLOCK_N (key slots a step: 64 or 32).
//
// A block takes one query and 64 of its heads, the rows of its Q tile (FlashMLA's layout),
// as sparse_attention.cu does. One warpgroup's O over all 512 dims would be 256 fp32
// registers a thread, so two warpgroups split the dims: each computes S = Q K^T over its
// half of them (m64nBLOCK_Nk16 from shared memory), the halves are summed through shared
// memory in one fixed order (so both warpgroups hold the same S and run the same online
// softmax), and each adds P V for its half of O (P from registers; V is the key tile read
// MN-major: K = V). Key tiles are gathered row by row by cp.async into two buffers, the
// next while the current one is used; every tile sits in wgmma's 128-byte swizzle.

constexpr int HEADS = 64;                    // heads per block: the Q tile's rows
constexpr int THREADS = 256;                 // two warpgroups
constexpr int HALF = D / 2;                  // dims a warpgroup: S's depth and O's width
constexpr int HALF_REGIONS = HALF / 64;      // its 64-column swizzle regions
constexpr int N_TILES = BLOCK_N / 8;         // S fragments of 8 keys
constexpr int O_TILES = HALF / 8;            // O fragments of 8 dims
constexpr int Q_BYTES = HEADS * D * 2, KV_BYTES = BLOCK_N * D * 2;
constexpr int S_FLOATS = 128 * N_TILES * 4;  // one warpgroup's S fragments, fp32
constexpr float LOG2E = 1.4426950408889634f;
static_assert(BLOCK_N == 64 || BLOCK_N == 32, "S's wgmma is m64n64k16 or m64n32k16");
static_assert(THREADS % (D / 8) == 0, "the copies give each thread whole rows' chunks");

extern "C" __global__ void __launch_bounds__(THREADS, 1) KERNEL_NAME(
    const uint16_t* __restrict__ q, const uint16_t* __restrict__ kv,
    const int* __restrict__ idx, const float* __restrict__ sinks,
    const float* __restrict__ scale, uint16_t* __restrict__ out, int H, int L, int K) {
  const float NEG_INF = __int_as_float(0xff800000);
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // 1,024-byte alignment for the swizzle atoms (the host asks for 1 KB more)
  const uint32_t smem0 = (smem_address(smem_raw) + 1023u) & ~1023u;
  const uint32_t q_smem = smem0;
  const uint32_t k_smem = q_smem + Q_BYTES;   // two key tiles
  unsigned char* smem = smem_raw + (smem0 - smem_address(smem_raw));
  float* s_halves = reinterpret_cast<float*>(smem + Q_BYTES + 2 * KV_BYTES);   // 2 x S_FLOATS
  int* slots = reinterpret_cast<int*>(s_halves + 2 * S_FLOATS);   // two tiles' key rows

  const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int l = blockIdx.x, h0 = blockIdx.y * HEADS;
  const float scale_log2 = scale[0] * LOG2E;

  // Every tile is copied 16 bytes a thread, a row's D / 8 chunks by consecutive threads
  constexpr int ROWS_PER_PASS = THREADS / (D / 8);
  const int copy_row = tid / (D / 8), copy_col = tid % (D / 8);

  // Q tile: 64 heads of query l, swizzled
#pragma unroll
  for (int i = 0; i < HEADS / ROWS_PER_PASS; ++i) {
    const int r = copy_row + i * ROWS_PER_PASS;
    cp_async16(q_smem + swizzled(r, copy_col, HEADS),
               q + ((size_t)(h0 + r) * L + l) * D + copy_col * 8, 16);
  }
  asm volatile("cp.async.commit_group;\n" ::);

  const int* row_idx = idx + (size_t)l * K;
  // key slots [s0, s0 + BLOCK_N) of this query -> buffer `buf`; a missing key is zeros
  auto load_tile = [&](int buf, int s0) {
#pragma unroll
    for (int i = 0; i < BLOCK_N / ROWS_PER_PASS; ++i) {
      const int r = copy_row + i * ROWS_PER_PASS;
      const int row = s0 + r < K ? row_idx[s0 + r] : -1;
      cp_async16(k_smem + buf * KV_BYTES + swizzled(r, copy_col, BLOCK_N),
                 kv + (size_t)(row < 0 ? 0 : row) * D + copy_col * 8, row < 0 ? 0 : 16);
    }
    if (tid < BLOCK_N) slots[buf * BLOCK_N + tid] = s0 + tid < K ? row_idx[s0 + tid] : -1;
    asm volatile("cp.async.commit_group;\n" ::);
  };

  float o[O_TILES][4];
#pragma unroll
  for (int j = 0; j < O_TILES; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.f, l_hi = 0.f;

  // this warpgroup's dims: its regions of the Q tile and of a key tile
  const uint32_t q_half = q_smem + wg * HALF_REGIONS * HEADS * 128;
  const int half_offset = wg * HALF_REGIONS * BLOCK_N * 128;
  float* s_mine = s_halves + wg * S_FLOATS + tid % 128;
  const float* s_pair = s_halves + (wg ^ 1) * S_FLOATS + tid % 128;

  const int steps = (K + BLOCK_N - 1) / BLOCK_N;
  if (steps > 0) load_tile(0, 0);
  for (int step = 0; step < steps; ++step) {
    const int buf = step % 2;
    async_tiles_ready();   // this tile (and Q); every thread done with the other buffer
    const uint32_t tile = k_smem + buf * KV_BYTES + half_offset;

    float s[N_TILES][4];
    wgmma_fence();
    issue_qk<HALF, HEADS>(s, q_half, tile);   // over this warpgroup's HALF dims
    wgmma_commit();
    // the next tile's gather while S computes: its row indices are global loads the copies
    // wait on, which would otherwise sit between the barrier and S
    if (step + 1 < steps) load_tile(buf ^ 1, (step + 1) * BLOCK_N);
    wgmma_wait_all();
    fence_registers(s);
    // the other half from the other warpgroup: its thread of the same rank holds the same
    // fragments
#pragma unroll
    for (int j = 0; j < N_TILES; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s_mine[(j * 4 + e) * 128] = s[j][e];
    __syncthreads();
#pragma unroll
    for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        // the first warpgroup's half plus the second's, in both (so their S agree)
        const float other = s_pair[(j * 4 + e) * 128];
        const float x = wg == 0 ? s[j][e] + other : other + s[j][e];
        const bool ok = slots[buf * BLOCK_N + j * 8 + t * 2 + (e & 1)] >= 0;
        s[j][e] = ok ? x * scale_log2 : NEG_INF;
      }
    }
    online_softmax<N_TILES, O_TILES, true>(s, o, m_lo, m_hi, l_lo, l_hi);

    uint32_t pa[N_TILES / 2][4];
    pack_a_operand(s, pa);
    fence_registers(o);   // O's rescale by the softmax happens here, before the fence
    wgmma_fence();
    issue_pv<HALF_REGIONS>(o, pa, tile);   // V's region r: dims 64 r.. of every key row
    wgmma_commit();
    wgmma_wait_all();
    fence_registers(o);
  }
  // Q's copies are awaited here too when the query has no key slot
  asm volatile("cp.async.wait_group 0;\n" ::);

  // row sums over the 4 threads of a row, then the sink joins the softmax's denominator
  l_lo = quad_sum(l_lo);
  l_hi = quad_sum(l_hi);
  const int h_lo = h0 + warp * 16 + g, h_hi = h_lo + 8;
  float inv_lo, inv_hi;
  sink_normalizers(m_lo, m_hi, l_lo, l_hi, sinks[h_lo] * LOG2E, sinks[h_hi] * LOG2E, inv_lo,
                   inv_hi);
  uint32_t* op = reinterpret_cast<uint32_t*>(out + (size_t)l * H * D);   // bf16 pairs
#pragma unroll
  for (int j = 0; j < O_TILES; ++j) {
    const int c = (wg * HALF + j * 8 + t * 2) / 2;
    op[((size_t)h_lo * D) / 2 + c] = pack_bf16(o[j][0] * inv_lo, o[j][1] * inv_lo);
    op[((size_t)h_hi * D) / 2 + c] = pack_bf16(o[j][2] * inv_hi, o[j][3] * inv_hi);
  }
}
