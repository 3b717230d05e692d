// Attention over per-query key lists with one shared KV head and an attention sink, for MLX
// on CUDA: DeepSeek-V4's attention (its reference inference/kernel.py `sparse_attn`: every
// query attends the rows its index list names, K = V, softmax with a per-head sink), as a
// FlashAttention-2 forward pass (Dao, 2023, Algorithm 1) on mma.sync m16n8k16 tensor cores,
// bf16 in, fp32 accumulation.
//
// The body of an `mx.fast.cuda_kernel` (model/kernels/sparse_attention.py builds it):
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

auto cp16 = [](uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(dst), "l"(src), "r"(bytes));
};
const int* row_idx = idx + (size_t)l * K;
// key slots [s0, s0 + BLOCK_N) of this query -> buffer `buf`; a missing key is zeros
auto load_tile = [&](int buf, int s0) {
  __nv_bfloat16* tile = Ks + buf * BLOCK_N * ROW;
  for (int i = tid; i < BLOCK_N * D / 8; i += blockDim.x) {
    int r = i / (D / 8), c = (i % (D / 8)) * 8;
    int row = s0 + r < K ? row_idx[s0 + r] : -1;
    cp16(static_cast<uint32_t>(__cvta_generic_to_shared(tile + r * ROW + c)),
         kv + (size_t)(row < 0 ? 0 : row) * D + c, row < 0 ? 0 : 16);
  }
  if (tid < BLOCK_N) Is[buf * BLOCK_N + tid] = s0 + tid < K ? row_idx[s0 + tid] : -1;
  asm volatile("cp.async.commit_group;\n" ::);
};

const int lm_row = (lane % 8) + ((lane / 16) * 8), lm_col = ((lane / 8) % 2) * 8;
const uint32_t q_smem = static_cast<uint32_t>(__cvta_generic_to_shared(
    Qs + (rg * 16 + (lane % 16)) * ROW + (lane / 16) * 8 + dh * HALF));
const uint32_t k_smem = static_cast<uint32_t>(__cvta_generic_to_shared(
    Ks + lm_row * ROW + lm_col + dh * HALF));
const uint32_t v_smem = static_cast<uint32_t>(__cvta_generic_to_shared(
    Ks + ((lane % 8) + ((lane / 8) % 2) * 8) * ROW + (lane / 16) * 8 + dh * HALF));
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
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll 4
  for (int kk = 0; kk < HALF; kk += 16) {
    uint32_t a0, a1, a2, a3;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "r"(q_smem + kk * 2));
#pragma unroll
    for (int j = 0; j < N_TILES; j += 2) {
      uint32_t b0, b1, b2, b3;
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                   : "r"(k_smem + off + (j * 8 * ROW + kk) * 2));
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
          "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(s[j][0]), "+f"(s[j][1]), "+f"(s[j][2]), "+f"(s[j][3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
          "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(s[j + 1][0]), "+f"(s[j + 1][1]), "+f"(s[j + 1][2]), "+f"(s[j + 1][3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b2), "r"(b3));
    }
  }
  // the other half from the paired warp: the same lane holds the same fragment there
#pragma unroll
  for (int j = 0; j < N_TILES; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) sx_mine[(j * 4 + e) * 32 + lane] = s[j][e];
  __syncthreads();
  float mx_lo = NEG_INF, mx_hi = NEG_INF;
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      // a + b in both warps of the pair (the sum is commutative), so their S agree
      float x = dh == 0 ? s[j][e] + sx_pair[(j * 4 + e) * 32 + lane]
                        : sx_pair[(j * 4 + e) * 32 + lane] + s[j][e];
      bool ok = Is[buf * BLOCK_N + j * 8 + t * 2 + (e & 1)] >= 0;
      x = ok ? x * scale_log2 : NEG_INF;
      s[j][e] = x;
      if (e < 2) mx_lo = fmaxf(mx_lo, x); else mx_hi = fmaxf(mx_hi, x);
    }
  }
  mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffff, mx_lo, 1));
  mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffff, mx_lo, 2));
  mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffff, mx_hi, 1));
  mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffff, mx_hi, 2));
  const float new_lo = fmaxf(m_lo, mx_lo), new_hi = fmaxf(m_hi, mx_hi);
  const float alpha_lo = new_lo == NEG_INF ? 1.f : exp2f(m_lo - new_lo);
  const float alpha_hi = new_hi == NEG_INF ? 1.f : exp2f(m_hi - new_hi);
  float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) {
    s[j][0] = new_lo == NEG_INF ? 0.f : exp2f(s[j][0] - new_lo);
    s[j][1] = new_lo == NEG_INF ? 0.f : exp2f(s[j][1] - new_lo);
    s[j][2] = new_hi == NEG_INF ? 0.f : exp2f(s[j][2] - new_hi);
    s[j][3] = new_hi == NEG_INF ? 0.f : exp2f(s[j][3] - new_hi);
    sum_lo += s[j][0] + s[j][1];
    sum_hi += s[j][2] + s[j][3];
  }
  l_lo = l_lo * alpha_lo + sum_lo;
  l_hi = l_hi * alpha_hi + sum_hi;
  m_lo = new_lo;
  m_hi = new_hi;
#pragma unroll
  for (int j = 0; j < O_TILES; ++j) {
    o[j][0] *= alpha_lo; o[j][1] *= alpha_lo;
    o[j][2] *= alpha_hi; o[j][3] *= alpha_hi;
  }

  // O += P V for this warp's dims; V is the key tile
#pragma unroll
  for (int i = 0; i < BLOCK_N / 16; ++i) {
    __nv_bfloat162 p0 = __floats2bfloat162_rn(s[2 * i][0], s[2 * i][1]);
    __nv_bfloat162 p1 = __floats2bfloat162_rn(s[2 * i][2], s[2 * i][3]);
    __nv_bfloat162 p2 = __floats2bfloat162_rn(s[2 * i + 1][0], s[2 * i + 1][1]);
    __nv_bfloat162 p3 = __floats2bfloat162_rn(s[2 * i + 1][2], s[2 * i + 1][3]);
    uint32_t a0 = *reinterpret_cast<uint32_t*>(&p0), a1 = *reinterpret_cast<uint32_t*>(&p1);
    uint32_t a2 = *reinterpret_cast<uint32_t*>(&p2), a3 = *reinterpret_cast<uint32_t*>(&p3);
#pragma unroll
    for (int j = 0; j < O_TILES; j += 2) {
      uint32_t b0, b1, b2, b3;
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                   : "r"(v_smem + off + (i * 16 * ROW + j * 8) * 2));
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
          "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(o[j][0]), "+f"(o[j][1]), "+f"(o[j][2]), "+f"(o[j][3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
          "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(o[j + 1][0]), "+f"(o[j + 1][1]), "+f"(o[j + 1][2]), "+f"(o[j + 1][3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b2), "r"(b3));
    }
  }
}

// row sums over the 4 threads of a row, then the sink joins the softmax's denominator:
// sum_j exp(x_j) + exp(sink), rescaled to the larger of the running max and the sink
l_lo += __shfl_xor_sync(0xffffffff, l_lo, 1);
l_lo += __shfl_xor_sync(0xffffffff, l_lo, 2);
l_hi += __shfl_xor_sync(0xffffffff, l_hi, 1);
l_hi += __shfl_xor_sync(0xffffffff, l_hi, 2);
const int h_lo = h0 + rg * 16 + g, h_hi = h_lo + 8;
const float sink_lo = sinks[h_lo] * LOG2E, sink_hi = sinks[h_hi] * LOG2E;
const float top_lo = fmaxf(m_lo, sink_lo), top_hi = fmaxf(m_hi, sink_hi);
const float f_lo = m_lo == NEG_INF ? 0.f : exp2f(m_lo - top_lo);
const float f_hi = m_hi == NEG_INF ? 0.f : exp2f(m_hi - top_hi);
const float inv_lo = f_lo / (l_lo * f_lo + exp2f(sink_lo - top_lo));
const float inv_hi = f_hi / (l_hi * f_hi + exp2f(sink_hi - top_hi));
__nv_bfloat16* op = out + (size_t)l * H * D;
#pragma unroll
for (int j = 0; j < O_TILES; ++j) {
  int c = dh * HALF + j * 8 + t * 2;
  *reinterpret_cast<__nv_bfloat162*>(op + (size_t)h_lo * D + c) =
      __floats2bfloat162_rn(o[j][0] * inv_lo, o[j][1] * inv_lo);
  *reinterpret_cast<__nv_bfloat162*>(op + (size_t)h_hi * D + c) =
      __floats2bfloat162_rn(o[j][2] * inv_hi, o[j][3] * inv_hi);
}
