// Causal flash attention for MLX on CUDA (FlashAttention-2's forward pass: Dao, 2023,
// "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning",
// Algorithm 1), bf16 in and fp32 accumulation on tensor cores (mma.sync m16n8k16).
//
// The body of an `mx.fast.cuda_kernel` (model/kernels/flash_attention.py builds it, with
// mma.cuh's primitives as its header):
// inputs q (B, H, L, D), k and v (B, KVH, N, D), each with strides (its last dimension
// contiguous, rows 16-byte aligned), params int32 [position, k_start, window, L, N,
// splits] and scale float32 [1]. Output: out bf16 (B, H, L, D); or, compiled with
// PREFILLQ_SPLIT (a split of the keys per grid z, for chunks too short to fill the GPU),
// out float32 (B, H, splits, L, D), each split's normalized output, and lse float32
// (B, H, splits, L), its log-sum-exp (natural log; -inf where a row saw no key), which
// flash_attention.py combines. Compiled with PREFILLQ_PACKED (never split), q holds several
// jobs' chunks one after another along L and k and v the keys each attends to, one job's
// after another, and an input blocks int32 (grid x, 6) gives each block its job's first
// query row, its query rows, the block's index within the job, its first key row, its keys
// and its chunk's first position (FlashAttention-2's varlen layout, with the per-block
// table of its cu_seqlens computed on the host); a job's first key is at position
// position - (keys - rows), as in the unpacked kernel.
// Template constants: D (head dim), BLOCK_N (keys per step), GROUP (query heads per KV
// head), PAD (shared-memory row padding, bf16 elements), WARPS (per block, 16 rows each).
//
// A block of WARPS warps takes 16 * WARPS consecutive queries of one head; each warp owns
// 16 rows.
// K and V tiles arrive by cp.async (V while S is computed, the next K during P V), and
// every mma operand comes from shared memory through ldmatrix (.trans for V).
// Per step of BLOCK_N keys: S = Q K^T (16 x BLOCK_N per warp, in registers), the online
// softmax (row max and sum across the 4 threads that share a row), O += P V with P reused
// from S's registers as the A operand (the m16n8k16 C layout equals its A layout).
// Key blocks wholly outside the causal range or the sliding window are never loaded.

// This prologue is per kernel, not in mma.cuh: it reads the template params (D, PAD,
// BLOCK_N), in scope only in the kernel body that mx.fast.cuda_kernel wraps this source in.
constexpr int BLOCK_M = 16 * WARPS;
constexpr int ROW = D + PAD;                 // shared row stride, bf16 elements
constexpr int N_TILES = BLOCK_N / 8;         // S tiles of 8 keys
constexpr int D_TILES = D / 8;               // O tiles of 8 dims
constexpr float LOG2E = 1.4426950408889634f;
const float NEG_INF = __int_as_float(0xff800000);

extern __shared__ __align__(16) unsigned char smem_raw[];
__nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
__nv_bfloat16* Ks = Qs + BLOCK_M * ROW;
__nv_bfloat16* Vs = Ks + BLOCK_N * ROW;

const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
const int g = lane / 4, t = lane % 4;         // the mma fragment's row group and column pair
const int h = blockIdx.y;
const int splits = params[5], b = blockIdx.z / splits, split = blockIdx.z % splits;
const int kvh = h / GROUP;
const int window = params[2];
#ifdef PREFILLQ_PACKED
// several jobs' chunks packed along L, each over its own keys (mma.cuh's PackedBlock)
const PackedBlock job = packed_block(blocks, blockIdx.x);
const int seq_row = job.seq_row, L = job.L, m_block = job.m_block;
const int kv_seq_row = job.kv_seq_row, N = job.N, position = job.position;
const int k_start = job.k_start;
#else
const int seq_row = 0, kv_seq_row = 0, L = params[3], N = params[4], m_block = blockIdx.x;
const int position = params[0], k_start = params[1];
#endif
const float scale_log2 = scale[0] * LOG2E;
const int H = q_shape[1], q_rows = q_shape[2];

const long q_row = q_strides[2], k_row = k_strides[2], v_row = v_strides[2];
const __nv_bfloat16* qp = q + b * q_strides[0] + h * q_strides[1] + seq_row * q_row;
const __nv_bfloat16* kp = k + b * k_strides[0] + kvh * k_strides[1] + kv_seq_row * k_row;
const __nv_bfloat16* vp = v + b * v_strides[0] + kvh * v_strides[1] + kv_seq_row * v_row;

// Q tile -> shared (rows past L are zero), 16 bytes a thread per copy
const int row0 = m_block * BLOCK_M;
for (int i = tid; i < BLOCK_M * D / 8; i += blockDim.x) {
  int r = i / (D / 8), c = (i % (D / 8)) * 8;
  uint4 val = make_uint4(0, 0, 0, 0);
  if (row0 + r < L) val = *reinterpret_cast<const uint4*>(qp + (row0 + r) * q_row + c);
  *reinterpret_cast<uint4*>(Qs + r * ROW + c) = val;
}

// the keys this block's queries may see, this split's share of them
const KeyRange range = key_range(position, k_start, N, L, window, row0, BLOCK_M, BLOCK_N,
                                 splits, split);
const int lo_block = range.lo_block, hi_block = range.hi_block;

// the two rows this thread holds in every C fragment, as absolute query positions
const int r_lo = warp * 16 + g, r_hi = r_lo + 8;
const int p_lo = position + row0 + r_lo, p_hi = position + row0 + r_hi;

float o[D_TILES][4];
#pragma unroll
for (int j = 0; j < D_TILES; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.f, l_hi = 0.f;

auto load_tile = [&](__nv_bfloat16* tile, const __nv_bfloat16* base, long row, int kb) {
  for (int i = tid; i < BLOCK_N * D / 8; i += blockDim.x) {
    int r = i / (D / 8), c = (i % (D / 8)) * 8;
    int key = kb + r - k_start;               // row in k or v; past N: zeros
    bool ok = key < N;
    cp_async16(smem_address(tile + r * ROW + c), base + (ok ? key : 0) * row + c, ok ? 16 : 0);
  }
  asm volatile("cp.async.commit_group;\n" ::);
};
// ldmatrix addresses: this lane's row and 8-column block of each 16 x 16 operand
const int lm_row = (lane % 8) + ((lane / 16) * 8), lm_col = ((lane / 8) % 2) * 8;
const uint32_t q_smem = smem_address(Qs + (warp * 16 + (lane % 16)) * ROW + (lane / 16) * 8);
const uint32_t k_smem = smem_address(Ks + lm_row * ROW + lm_col);
const uint32_t v_smem = smem_address(Vs + ((lane % 8) + ((lane / 8) % 2) * 8) * ROW +
                                     (lane / 16) * 8);

if (lo_block < hi_block) load_tile(Ks, kp, k_row, lo_block);
for (int kb = lo_block; kb < hi_block; kb += BLOCK_N) {
  // V loads while S is computed; the previous step's P V reads of V are done
  __syncthreads();
  load_tile(Vs, vp, v_row, kb);
  asm volatile("cp.async.wait_group 1;\n" ::);   // K (and, first time, Q's stores) ready
  __syncthreads();

  // S = Q K^T for this warp's 16 rows
  float s[N_TILES][4];
  qk_tiles<N_TILES, ROW>(s, q_smem, k_smem, D);

  // mask (causal, window, past N) and scale to log2 units, then the online softmax
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int key = kb + j * 8 + t * 2 + (e & 1);
      int p = e < 2 ? p_lo : p_hi;
      bool ok = key < k_start + N && key <= p && (window <= 0 || key > p - window);
      s[j][e] = ok ? s[j][e] * scale_log2 : NEG_INF;
    }
  }
  online_softmax<N_TILES, D_TILES>(s, o, m_lo, m_hi, l_lo, l_hi);

  asm volatile("cp.async.wait_group 0;\n" ::);   // V ready
  __syncthreads();                                 // and every warp is done with K
  if (kb + BLOCK_N < hi_block) load_tile(Ks, kp, k_row, kb + BLOCK_N);

  // O += P V: P's k-step of 16 keys is S tiles 2i and 2i + 1
  pv_tiles<N_TILES, D_TILES, ROW>(o, s, v_smem);
}

// O / l -> out
const int q_lo = row0 + r_lo, q_hi = row0 + r_hi;
#ifdef PREFILLQ_SPLIT
const size_t slab = (((size_t)b * H + h) * splits + split) * (size_t)L;
store_rows<true>(o, m_lo, m_hi, l_lo, l_hi, q_lo, q_hi, L, t, out + slab * D, lse + slab);
#else
store_rows<false>(o, m_lo, m_hi, l_lo, l_hi, q_lo, q_hi, L, t,
                  out + (((size_t)b * H + h) * (size_t)q_rows + seq_row) * D, nullptr);
#endif
