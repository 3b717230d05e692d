// Causal flash attention on Hopper (sm_90a): FlashAttention-2's forward pass (Dao, 2023,
// Algorithm 1) with the matrix products on warpgroup MMA (`wgmma.mma_async`), the design of
// FlashAttention-3 (Shah et al., 2024, "FlashAttention-3: Fast and Accurate Attention with
// Asynchrony and Low-precision", sections 3.1-3.2). With TMA=1 a producer warpgroup has the
// bulk tensor copy engine (tma.cuh) bring Q and the K and V tiles, two stages deep, while
// the consumer warpgroups compute (FA3's warp specialization, section 3.1). With TMA=0 the
// consumers copy the tiles themselves by cp.async, two stages deep.
//
// Compiled by NVRTC for sm_90a (model/kernels/flash_attention_sm90.py; mma.cuh's
// header-free primitives, wgmma.cuh's and tma.cuh's are prepended) and launched through MLX's
// `mx.fast.precompiled_cuda_kernel`, which passes the inputs, then the outputs, then the
// scalars. Inputs (row-contiguous): q bf16 (B, H, Lq, D), k and v bf16 (B, KVH, N, D),
// params int32 [position, k_start, window, L, N, splits] and scale float32 [1] (as
// flash_attention.cu), and with PREFILLQ_PACKED the block table int32 (blocks, 6). Outputs:
// out bf16 (B, H, Lq, D), or with PREFILLQ_SPLIT out float32 (B, H, splits, L, D) and lse
// float32 (B, H, splits, L); with TMA, then maps uint8 (blocks x 384): each block's tensor
// maps of Q, K and V. Scalars: H, KVH, Lq (q's rows), N (k's rows).
// Defines: KERNEL_NAME, D (head dim, a multiple of 64), BLOCK_N (keys a step: 64, or 32
// for smaller K/V tiles), WARPGROUPS (64 query rows each), STAGES (1 or 2 K/V buffers),
// PINGPONG (1: two warpgroups take turns at the tensor cores within a step, below), TMA.
//
// Shared memory holds every tile in the 128-byte swizzle that wgmma reads (wgmma.cuh).
// S = Q K^T reads both from shared memory (K-major); O += P V takes P from registers (the
// accumulator layout of S is the A-fragment layout) and V from shared memory as an MN-major
// (transposed) operand.

#ifndef STAGES
#define STAGES 2
#endif
#ifndef PINGPONG
#define PINGPONG 0
#endif
#ifndef TMA
#define TMA 0
#endif

constexpr int BLOCK_M = 64 * WARPGROUPS;
constexpr int CONSUMERS = 128 * WARPGROUPS;              // the warpgroups that compute
constexpr int THREADS = CONSUMERS + (TMA ? 128 : 0);     // and with TMA the producer's
// Registers a thread: a block starts with 65,536 / THREADS (168 at 384) and with TMA the
// producer warpgroup hands its share to the consumers (`setmaxnreg`: 24 + 2 x 240 per
// multiprocessor quarter, one warp of each warpgroup in it, <= 512). A lone producer warp
// (288 threads) would leave every thread 168 too: each quarter's three warps split 16,384.
constexpr int PRODUCER_REGISTERS = 24, CONSUMER_REGISTERS = 240;
constexpr int MAP_BYTES = 3 * 128;   // a block's tensor maps of Q, K and V (the host's too)
constexpr int REGIONS = D / 64;              // 64-column, 128-byte-wide swizzle regions
constexpr int N_TILES = BLOCK_N / 8;         // S fragments of 8 keys
constexpr int D_TILES = D / 8;               // O fragments of 8 dims
constexpr int Q_BYTES = BLOCK_M * D * 2, KV_BYTES = BLOCK_N * D * 2;
constexpr float LOG2E = 1.4426950408889634f;
static_assert(BLOCK_N == 64 || BLOCK_N == 32, "S's wgmma is m64n64k16 or m64n32k16");
static_assert(D % 64 == 0 && D <= 256, "O += P V covers up to four 64-dim regions");
static_assert(CONSUMERS % (D / 8) == 0, "the copies give each thread whole rows' chunks");
static_assert(STAGES == 1 || STAGES == 2, "one or two K/V buffers");
static_assert(!TMA || STAGES == 2, "the producer fills one K/V buffer while the other is used");
static_assert(!TMA || WARPGROUPS == 2, "setmaxnreg's split is sized for two consumers");
// FlashAttention-3's ping-pong (section 3.1): the two warpgroups take turns issuing S = Q
// K^T, so the first's softmax runs while the tensor cores compute the second's S, and the
// second's while they compute the first's P V (in step, both would issue together and both
// wait out the softmax). With TMA each waits on its own named barrier before it issues and
// arrives on the other's after, so the turns alternate strictly with no block-wide barrier
// to keep the steps in phase (a one-way signal could be arrived at twice before it was
// awaited); without, the per-step __syncthreads does that and the second only waits for
// the first's signal
constexpr bool TAKE_TURNS = PINGPONG && WARPGROUPS == 2;
constexpr int TURN_BARRIER = 1;   // warpgroup w's is TURN_BARRIER + w (0 is __syncthreads')

// Wait at (SYNC) or arrive at warpgroup w's turn barrier, with the consumers' count
// (immediate ids: an id in a register holds one through the loop)
template <bool SYNC>
__device__ __forceinline__ void named_barrier(int w) {
  if (w == 0) {
    if (SYNC) asm volatile("bar.sync %0, %1;\n" :: "n"(TURN_BARRIER), "n"(CONSUMERS) : "memory");
    else asm volatile("bar.arrive %0, %1;\n" :: "n"(TURN_BARRIER), "n"(CONSUMERS) : "memory");
  } else {
    if (SYNC)
      asm volatile("bar.sync %0, %1;\n" :: "n"(TURN_BARRIER + 1), "n"(CONSUMERS) : "memory");
    else
      asm volatile("bar.arrive %0, %1;\n" :: "n"(TURN_BARRIER + 1), "n"(CONSUMERS) : "memory");
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) KERNEL_NAME(
    const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
    const uint16_t* __restrict__ v, const int* __restrict__ params,
    const float* __restrict__ scale,
#ifdef PREFILLQ_PACKED
    const int* __restrict__ blocks,
#endif
#ifdef PREFILLQ_SPLIT
    float* __restrict__ out, float* __restrict__ lse,
#else
    uint16_t* __restrict__ out,
#endif
#if TMA
    unsigned char* __restrict__ maps,
#endif
    int H, int KVH, int q_rows, int kv_rows) {
  const float NEG_INF = __int_as_float(0xff800000);
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // 1,024-byte alignment for the swizzle atoms (the host asks for 1 KB more)
  const uint32_t smem0 = (smem_address(smem_raw) + 1023u) & ~1023u;
  const uint32_t q_smem = smem0;
  const uint32_t k_smem = q_smem + Q_BYTES;             // STAGES K tiles
  const uint32_t v_smem = k_smem + STAGES * KV_BYTES;   // STAGES V tiles

  const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int h = blockIdx.y;
  const int splits = params[5], b = blockIdx.z / splits, split = blockIdx.z % splits;
  const int B = gridDim.z / splits;
  const int kvh = h / (H / KVH);
  const int window = params[2];
#ifdef PREFILLQ_PACKED
  // several jobs' chunks packed along L, each over its own keys (mma.cuh's PackedBlock)
  const PackedBlock job = packed_block(blocks, blockIdx.x);
  const int seq_row = job.seq_row, L = job.L, m_block = job.m_block;
  const int kv_seq_row = job.kv_seq_row, N = job.N, position = job.position;
  const int k_start = job.k_start;
#else
  // the longest rows first: a causal block's work grows with its index, and the last wave
  // then holds the short ones (FlashAttention-2's ordering)
  const int seq_row = 0, kv_seq_row = 0, L = params[3], N = params[4];
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int position = params[0], k_start = params[1];
#endif
  const float scale_log2 = scale[0] * LOG2E;

  // row-contiguous inputs: strides from the shapes
  const long q_row = D, k_row = D;
  const uint16_t* qp = q + (((long)b * H + h) * q_rows + seq_row) * D;
  const uint16_t* kp = k + (((long)b * KVH + kvh) * kv_rows + kv_seq_row) * D;
  const uint16_t* vp = v + (((long)b * KVH + kvh) * kv_rows + kv_seq_row) * D;

  // Without TMA every tile is copied 16 bytes a thread, a row's D / 8 chunks by consecutive
  // threads: this thread's chunk column and first row are fixed, its rows ROWS_PER_PASS apart
  constexpr int ROWS_PER_PASS = CONSUMERS / (D / 8);
  const int copy_row = tid / (D / 8), copy_col = tid % (D / 8);

  const int row0 = m_block * BLOCK_M;
#if !TMA
  // Q tile -> shared, swizzled (rows past L are zeros)
#pragma unroll
  for (int i = 0; i < BLOCK_M / ROWS_PER_PASS; ++i) {
    const int r = copy_row + i * ROWS_PER_PASS;
    bool ok = row0 + r < L;
    cp_async16(q_smem + swizzled(r, copy_col, BLOCK_M),
               qp + (long)(ok ? row0 + r : 0) * q_row + copy_col * 8, ok ? 16 : 0);
  }
  asm volatile("cp.async.commit_group;\n" ::);
#endif

  // the keys this block's queries may see, this split's share of them
  const KeyRange range = key_range(position, k_start, N, L, window, row0, BLOCK_M, BLOCK_N,
                                   splits, split);
  const int first_q = range.first_q, last_q = range.last_q;
  const int lo_block = range.lo_block, hi_block = range.hi_block;

  // the two rows this thread holds in every accumulator fragment
  const int r_lo = wg * 64 + warp * 16 + g, r_hi = r_lo + 8;
  const int p_lo = position + row0 + r_lo, p_hi = position + row0 + r_hi;

  float o[D_TILES][4];
#pragma unroll
  for (int j = 0; j < D_TILES; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.f, l_hi = 0.f;

  auto k_tile = [&](int stage) { return k_smem + stage * KV_BYTES; };
  auto v_tile = [&](int stage) { return v_smem + stage * KV_BYTES; };

  // mask (causal, window, past N) where key block kb may cross an edge; scale to log2 units
  auto mask_scale = [&](float (&s)[N_TILES][4], int kb) {
    const bool edge = kb + BLOCK_N - 1 > first_q || kb + BLOCK_N > k_start + N ||
                      (window > 0 && kb <= last_q - window);
#pragma unroll
    for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int key = kb + j * 8 + t * 2 + (e & 1);
        int p = e < 2 ? p_lo : p_hi;
        bool ok = !edge || (key < k_start + N && key <= p && (window <= 0 || key > p - window));
        s[j][e] = ok ? s[j][e] * scale_log2 : NEG_INF;
      }
    }
  };

  const int n_steps = lo_block < hi_block ? (hi_block - lo_block + BLOCK_N - 1) / BLOCK_N : 0;
#if TMA
  // Barriers after the K/V tiles: Q's, then per stage K's and V's arrival (the producer's
  // expected bytes) and its release (one arrival a consumer warp once its products are done)
  const uint32_t bars = v_smem + STAGES * KV_BYTES, staging = bars + 128;
  const uint32_t q_full = bars;
  auto k_full = [&](int stage) { return bars + 8 * (1 + stage); };
  auto v_full = [&](int stage) { return bars + 8 * (1 + STAGES + stage); };
  auto kv_free = [&](int stage) { return bars + 8 * (1 + 2 * STAGES + stage); };
  if (tid == 0) {
    mbarrier_init(q_full, 1);
    for (int stage = 0; stage < STAGES; ++stage) {
      mbarrier_init(k_full(stage), 1);
      mbarrier_init(v_full(stage), 1);
      mbarrier_init(kv_free(stage), CONSUMERS / 32);
    }
    mbarrier_init_fence();
  }
  __syncthreads();   // the last barrier every thread of the block takes
  if (tid >= CONSUMERS) {   // the producer warpgroup: its first warp issues every copy
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(PRODUCER_REGISTERS));
    if (n_steps == 0 || tid >= CONSUMERS + 32) return;
    unsigned char* my_maps = maps + MAP_BYTES * (blockIdx.x + gridDim.x * (blockIdx.y +
                                                (size_t)gridDim.y * blockIdx.z));
    build_tensor_map(staging, my_maps, q, D, q_rows, B * H, 64, lane);
    build_tensor_map(staging + 128, my_maps + 128, k, D, kv_rows, B * KVH, BLOCK_N, lane);
    build_tensor_map(staging + 256, my_maps + 256, v, D, kv_rows, B * KVH, BLOCK_N, lane);
    if (lane != 0) return;
    // a tile of `rows` rows from `row` of `plane`, one box per region, into its swizzled
    // place (the box's first row is a multiple of 8, so its chunks land unswizzled)
    auto load_tile = [&](uint32_t tile, int tile_rows, int first, const void* map,
                         uint32_t bar, int row, int plane) {
      for (int region = 0; region < REGIONS; ++region)
        tma_load(tile + swizzled(first, region * 8, tile_rows), map, bar, region * 64, row,
                 plane);
    };
    mbarrier_expect_bytes(q_full, Q_BYTES);
    for (int w = 0; w < WARPGROUPS; ++w)
      load_tile(q_smem, BLOCK_M, w * 64, my_maps, q_full, seq_row + row0 + w * 64, b * H + h);
    for (int step = 0; step < n_steps; ++step) {
      const int stage = step % STAGES, key = kv_seq_row + lo_block + step * BLOCK_N - k_start;
      if (step >= STAGES) mbarrier_wait(kv_free(stage), (step / STAGES - 1) & 1);
      mbarrier_expect_bytes(k_full(stage), KV_BYTES);
      load_tile(k_tile(stage), BLOCK_N, 0, my_maps + 128, k_full(stage), key, b * KVH + kvh);
      mbarrier_expect_bytes(v_full(stage), KV_BYTES);
      load_tile(v_tile(stage), BLOCK_N, 0, my_maps + 256, v_full(stage), key, b * KVH + kvh);
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(CONSUMER_REGISTERS));
  if (n_steps > 0) mbarrier_wait(q_full, 0);
#endif
  // each step: S, its softmax, then P V, while the next step's K and V load
  auto load_kv = [&](int stage, int kb) {   // K and V of a key block, one address each row
#pragma unroll
    for (int i = 0; i < BLOCK_N / ROWS_PER_PASS; ++i) {
      const int r = copy_row + i * ROWS_PER_PASS;
      const int key = kb + r - k_start;
      const bool ok = key < N;
      const uint32_t off = stage * KV_BYTES + swizzled(r, copy_col, BLOCK_N);
      const long src = (long)(ok ? key : 0) * k_row + copy_col * 8;
      cp_async16(k_smem + off, kp + src, ok ? 16 : 0);
      cp_async16(v_smem + off, vp + src, ok ? 16 : 0);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  if (!TMA && n_steps > 0) load_kv(0, lo_block);
  if (TAKE_TURNS && TMA && wg == 1) named_barrier<false>(0);   // the first turn: the first's
  for (int step = 0; step < n_steps; ++step) {
    const int kb = lo_block + step * BLOCK_N, stage = STAGES == 1 ? 0 : step % STAGES;
#if TMA
    mbarrier_wait(k_full(stage), (step / STAGES) & 1);
#else
    async_tiles_ready();   // this step's tiles (and Q); the next load while this step computes
    if (STAGES > 1 && step + 1 < n_steps) load_kv((step + 1) % STAGES, kb + BLOCK_N);
#endif

    float s[N_TILES][4];
    if (TAKE_TURNS && (TMA || wg == 1)) named_barrier<true>(TMA ? wg : 0);   // its turn
    wgmma_fence();
    // S = Q K^T over this warpgroup's 64 query rows (their address computed here: hoisted
    // out of the loop it costs ~20 more registers)
    issue_qk<D, BLOCK_M>(s, q_smem + wg * 64 * 128, k_tile(stage));
    wgmma_commit();
    if (TAKE_TURNS && (TMA || wg == 0)) named_barrier<false>(TMA ? 1 - wg : 0);   // theirs
    wgmma_wait_all();
    fence_registers(s);
    mask_scale(s, kb);
    online_softmax<N_TILES, D_TILES, true>(s, o, m_lo, m_hi, l_lo, l_hi);

    // (P is packed to bf16 before the fence: registers written between a warpgroup's
    // wgmmas make the compiler insert waits)
    uint32_t pa[N_TILES / 2][4];
    pack_a_operand(s, pa);
    fence_registers(o);   // O's rescale by the softmax happens here, before the fence
#if TMA
    mbarrier_wait(v_full(stage), (step / STAGES) & 1);
#endif
    wgmma_fence();
    issue_pv<REGIONS>(o, pa, v_tile(stage));
    wgmma_commit();
    wgmma_wait_all();
    fence_registers(o);
#if TMA
    if (lane == 0) mbarrier_arrive(kv_free(stage));   // this warp is done with the stage
#endif
    if (STAGES == 1 && step + 1 < n_steps) {   // one buffer: refilled once all are done
      __syncthreads();
      load_kv(0, kb + BLOCK_N);
    }
  }

  // Q's copies are awaited here too when no key block fell to this block (an empty split)
  if (!TMA) asm volatile("cp.async.wait_group 0;\n" ::);
  // O / l -> out
  const int q_lo = row0 + r_lo, q_hi = row0 + r_hi;
#ifdef PREFILLQ_SPLIT
  const size_t slab = (((size_t)b * H + h) * splits + split) * (size_t)L;
  store_rows<true>(o, m_lo, m_hi, l_lo, l_hi, q_lo, q_hi, L, t, out + slab * D, lse + slab);
#else
  store_rows<false>(o, m_lo, m_hi, l_lo, l_hi, q_lo, q_hi, L, t,
                    out + (((size_t)b * H + h) * (size_t)q_rows + seq_row) * D, nullptr);
#endif
}
