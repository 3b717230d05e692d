// Attention over per-query key lists with one shared KV head and an attention sink, for MLX
// on CUDA: DeepSeek-V4's attention (its reference inference/kernel.py `sparse_attn`: every
// query attends the rows its index list names, K = V, softmax with a per-head sink), as a
// FlashAttention-2 forward pass (Dao, 2023, Algorithm 1) on mma.sync m16n8k16 tensor cores,
// bf16 in, fp32 accumulation.
//
// The body of an `mx.fast.cuda_kernel` (model/kernels/sparse_attention.py builds it, with
// mma.cuh's primitives as its header):
// inputs q (1, H, L, D) with strides (last dimension contiguous), kv (N, D) row-contiguous,
// idx int32 (L, K) row-contiguous (a query's key rows in kv; -1: no key), sinks float32
// (H,), scale float32 [1]. Output out bf16 (L, H, D).
// Template constants: D (head dim, a multiple of 32), BLOCK_N (keys per step, 16 or 32),
// PAD (shared row padding, bf16 elements).
//
// With one KV head every query head attends the same keys, so a block takes one query and
// 64 of its heads: the heads are the rows of the Q tile (FlashMLA's layout). Eight warps:
// warp w owns heads 16 * (w % 4) .. +16 and dims D/2 * (w / 4) .. +D/2. Per step of BLOCK_N
// gathered keys, S = Q K^T is summed from the two dim halves through shared memory (so
// both warps of a row group hold the whole S and run the same online softmax), then each
// warp adds P V for its half of the dims (V is the K tile: K = V). Key tiles arrive by
// cp.async into two buffers, the next while the current one is used.

// This prologue is per kernel, not in mma.cuh: it reads the template params (D, PAD,
// BLOCK_N), in scope only in the kernel body that mx.fast.cuda_kernel wraps this source in.
constexpr int HEADS = 64;                    // heads per block (rows of the Q tile)
constexpr int HALF = D / 2;                  // dims per warp in P V
constexpr int ROW = D + PAD;                 // shared row stride, bf16 elements
constexpr int N_TILES = BLOCK_N / 8;         // S tiles of 8 keys
constexpr int O_TILES = HALF / 8;            // O tiles of 8 dims
constexpr float LOG2E = 1.4426950408889634f;
const float NEG_INF = __int_as_float(0xff800000);

extern __shared__ __align__(16) unsigned char smem_raw[];
__nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
__nv_bfloat16* Ks = Qs + HEADS * ROW;                       // two buffers of BLOCK_N rows
float* Sx = reinterpret_cast<float*>(Ks + 2 * BLOCK_N * ROW);  // 8 warps x 16 x BLOCK_N
int* Is = reinterpret_cast<int*>(Sx + 8 * 16 * BLOCK_N);     // two buffers of BLOCK_N

const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
const int g = lane / 4, t = lane % 4;
const int rg = warp % 4, dh = warp / 4;
const int l = blockIdx.x, h0 = blockIdx.y * HEADS;
const int L = q_shape[2], H = q_shape[1], K = idx_shape[1];
const float scale_log2 = scale[0] * LOG2E;

// Q tile: 64 heads of query l, 16 bytes a thread per copy
for (int i = tid; i < HEADS * D / 8; i += blockDim.x) {
  int r = i / (D / 8), c = (i % (D / 8)) * 8;
  *reinterpret_cast<uint4*>(Qs + r * ROW + c) =
      *reinterpret_cast<const uint4*>(q + (h0 + r) * q_strides[1] + l * q_strides[2] + c);
}

const int* row_idx = idx + (size_t)l * K;
// key slots [s0, s0 + BLOCK_N) of this query -> buffer `buf`; a missing key is zeros
auto load_tile = [&](int buf, int s0) {
  __nv_bfloat16* tile = Ks + buf * BLOCK_N * ROW;
  for (int i = tid; i < BLOCK_N * D / 8; i += blockDim.x) {
    int r = i / (D / 8), c = (i % (D / 8)) * 8;
    int row = s0 + r < K ? row_idx[s0 + r] : -1;
    cp_async16(smem_address(tile + r * ROW + c), kv + (size_t)(row < 0 ? 0 : row) * D + c,
               row < 0 ? 0 : 16);
  }
  if (tid < BLOCK_N) Is[buf * BLOCK_N + tid] = s0 + tid < K ? row_idx[s0 + tid] : -1;
  asm volatile("cp.async.commit_group;\n" ::);
};

const int lm_row = (lane % 8) + ((lane / 16) * 8), lm_col = ((lane / 8) % 2) * 8;
const uint32_t q_smem = smem_address(Qs + (rg * 16 + (lane % 16)) * ROW + (lane / 16) * 8 +
                                     dh * HALF);
const uint32_t k_smem = smem_address(Ks + lm_row * ROW + lm_col + dh * HALF);
const uint32_t v_smem = smem_address(Ks + ((lane % 8) + ((lane / 8) % 2) * 8) * ROW +
                                     (lane / 16) * 8 + dh * HALF);
constexpr uint32_t BUF_BYTES = BLOCK_N * ROW * 2;
float* sx_mine = Sx + warp * 16 * BLOCK_N;
const float* sx_pair = Sx + (warp ^ 4) * 16 * BLOCK_N;

float o[O_TILES][4];
#pragma unroll
for (int j = 0; j < O_TILES; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.f, l_hi = 0.f;

const int steps = (K + BLOCK_N - 1) / BLOCK_N;
if (steps > 0) load_tile(0, 0);
for (int step = 0; step < steps; ++step) {
  const int buf = step % 2;
  asm volatile("cp.async.wait_group 0;\n" ::);
  __syncthreads();  // this tile (and Q) in shared; every warp done with the other buffer
  if (step + 1 < steps) load_tile(buf ^ 1, (step + 1) * BLOCK_N);
  const uint32_t off = buf * BUF_BYTES;

  // this warp's half of S = Q K^T over its dims
  float s[N_TILES][4];
  qk_tiles<N_TILES, ROW>(s, q_smem, k_smem + off, HALF);
  // the other half from the paired warp: the same lane holds the same fragment there
#pragma unroll
  for (int j = 0; j < N_TILES; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) sx_mine[(j * 4 + e) * 32 + lane] = s[j][e];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      // a + b in both warps of the pair (the sum is commutative), so their S agree
      float x = dh == 0 ? s[j][e] + sx_pair[(j * 4 + e) * 32 + lane]
                        : sx_pair[(j * 4 + e) * 32 + lane] + s[j][e];
      bool ok = Is[buf * BLOCK_N + j * 8 + t * 2 + (e & 1)] >= 0;
      s[j][e] = ok ? x * scale_log2 : NEG_INF;
    }
  }
  online_softmax<N_TILES, O_TILES>(s, o, m_lo, m_hi, l_lo, l_hi);

  // O += P V for this warp's dims; V is the key tile
  pv_tiles<N_TILES, O_TILES, ROW>(o, s, v_smem + off);
}

// row sums over the 4 threads of a row, then the sink joins the softmax's denominator
l_lo = quad_sum(l_lo);
l_hi = quad_sum(l_hi);
const int h_lo = h0 + rg * 16 + g, h_hi = h_lo + 8;
float inv_lo, inv_hi;
sink_normalizers(m_lo, m_hi, l_lo, l_hi, sinks[h_lo] * LOG2E, sinks[h_hi] * LOG2E, inv_lo,
                 inv_hi);
__nv_bfloat16* op = out + (size_t)l * H * D;
#pragma unroll
for (int j = 0; j < O_TILES; ++j) {
  int c = dh * HALF + j * 8 + t * 2;
  *reinterpret_cast<__nv_bfloat162*>(op + (size_t)h_lo * D + c) =
      __floats2bfloat162_rn(o[j][0] * inv_lo, o[j][1] * inv_lo);
  *reinterpret_cast<__nv_bfloat162*>(op + (size_t)h_hi * D + c) =
      __floats2bfloat162_rn(o[j][2] * inv_hi, o[j][3] * inv_hi);
}
