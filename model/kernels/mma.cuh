// Tensor-core and copy primitives shared by the attention kernels (flash_attention.cu,
// sparse_attention.cu), given to `mx.fast.cuda_kernel` as its header. PTX ISA: mma.sync
// m16n8k16 (bf16 in, fp32 accumulate), ldmatrix .x4 (and .trans), cp.async.cg 16 bytes.

// C += A B for one m16n8k16 tile: A 16 x 16 (4 registers of bf16 pairs, row-major), B
// 16 x 8 (2 registers, column-major), C 16 x 8 fp32 (4 per thread).
__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1,
                                          uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four 8 x 8 bf16 matrices from shared memory (each lane names one row's address).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// The same, each matrix transposed (V as the B operand of P V).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// One 16-byte asynchronous copy global -> shared; `bytes` 0 writes zeros instead.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Two floats as a bf16 pair rounded to nearest even, `lo` in the low half: the register
// layout of an mma A operand.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  uint32_t v;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(v) : "f"(hi), "f"(lo));
  return v;
}

// The max and the sum over the 4 lanes that hold one row of an mma C fragment.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// S = Q K^T for one warp's 16 rows over N_TILES tiles of 8 keys and `depth` dims:
// `q_addr` is this lane's ldmatrix address in the Q tile, `k_addr` in the K tile (rows
// ROW bf16 elements apart), both at dim 0 of the range.
template <int N_TILES, int ROW>
__device__ __forceinline__ void qk_tiles(float (&s)[N_TILES][4], uint32_t q_addr,
                                         uint32_t k_addr, int depth) {
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll 4
  for (int kk = 0; kk < depth; kk += 16) {
    uint32_t a[4];
    ldmatrix_x4(a, q_addr + kk * 2);
#pragma unroll
    for (int j = 0; j < N_TILES; j += 2) {
      uint32_t b[4];  // keys j*8.. and (j+1)*8.., dims kk.. and kk+8..
      ldmatrix_x4(b, k_addr + (j * 8 * ROW + kk) * 2);
      mma_16816(s[j], a[0], a[1], a[2], a[3], b[0], b[1]);
      mma_16816(s[j + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
    }
  }
}

// O += P V: P is S's registers (the m16n8k16 C layout equals its A layout), 16 keys a
// k-step; `v_addr` is this lane's ldmatrix.trans address in the V tile at dim 0 of this
// warp's O_TILES x 8 dims.
template <int N_TILES, int O_TILES, int ROW>
__device__ __forceinline__ void pv_tiles(float (&o)[O_TILES][4], const float (&p)[N_TILES][4],
                                         uint32_t v_addr) {
#pragma unroll
  for (int i = 0; i < N_TILES / 2; ++i) {
    uint32_t a0 = pack_bf16(p[2 * i][0], p[2 * i][1]), a1 = pack_bf16(p[2 * i][2], p[2 * i][3]);
    uint32_t a2 = pack_bf16(p[2 * i + 1][0], p[2 * i + 1][1]);
    uint32_t a3 = pack_bf16(p[2 * i + 1][2], p[2 * i + 1][3]);
#pragma unroll
    for (int j = 0; j < O_TILES; j += 2) {
      uint32_t b[4];  // keys i*16.., dims j*8.. and (j+1)*8.., transposed
      ldmatrix_x4_trans(b, v_addr + (i * 16 * ROW + j * 8) * 2);
      mma_16816(o[j], a0, a1, a2, a3, b[0], b[1]);
      mma_16816(o[j + 1], a0, a1, a2, a3, b[2], b[3]);
    }
  }
}

// One step of the online softmax (FlashAttention-2, Algorithm 1) for the two rows this
// thread holds (C fragment rows g and g + 8): `s` holds the step's scores in log2 units,
// NEG_INF where masked; on return it holds P = exp2(s - m_new), the running maxima `m_*`
// and partial row sums `l_*` (this thread's columns; quad_sum them at the end) are
// updated, and O is rescaled by exp2(m_old - m_new). A row that has seen no key yet keeps
// m = NEG_INF and P = 0 (never exp2(NEG_INF - NEG_INF)). With SKIP_UNMOVED, a warp whose
// rows' maxima all stayed skips O's rescale (the factor is exactly 1.0 there, so no bit
// changes; after the first key blocks most steps skip).
template <int N_TILES, int O_TILES, bool SKIP_UNMOVED = false>
__device__ __forceinline__ void online_softmax(float (&s)[N_TILES][4], float (&o)[O_TILES][4],
                                               float& m_lo, float& m_hi, float& l_lo,
                                               float& l_hi) {
  const float NEG_INF = __int_as_float(0xff800000);
  float mx_lo = NEG_INF, mx_hi = NEG_INF;
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) {
    mx_lo = fmaxf(mx_lo, fmaxf(s[j][0], s[j][1]));
    mx_hi = fmaxf(mx_hi, fmaxf(s[j][2], s[j][3]));
  }
  const float new_lo = fmaxf(m_lo, quad_max(mx_lo)), new_hi = fmaxf(m_hi, quad_max(mx_hi));
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
  const bool moved = !SKIP_UNMOVED || __any_sync(0xffffffff, new_lo != m_lo || new_hi != m_hi);
  m_lo = new_lo;
  m_hi = new_hi;
  if (moved) {
#pragma unroll
    for (int j = 0; j < O_TILES; ++j) {
      o[j][0] *= alpha_lo; o[j][1] *= alpha_lo;
      o[j][2] *= alpha_hi; o[j][3] *= alpha_hi;
    }
  }
}

// A block of the packed variant (several jobs' chunks along L, each over its own keys): the
// launch's table holds six ints a block, its job's first query row, query rows, this
// block's index among the job's, first key row, keys, and the chunk's position; its keys
// start at position - (keys - rows) (flash_attention.py, `query_blocks`).
struct PackedBlock {
  int seq_row, L, m_block, kv_seq_row, N, position, k_start;
};

__device__ __forceinline__ PackedBlock packed_block(const int* blocks, unsigned block) {
  const int* job = blocks + 6 * block;
  const PackedBlock b = {job[0], job[1], job[2], job[3], job[4], job[5],
                         job[5] - (job[4] - job[1])};
  return b;
}

// With an attention sink (DeepSeek-V4: a per-head logit, log2 units, that joins the
// softmax's denominator and no output), the factors that turn the two rows' O (running
// maxima m_*, whole sums l_* after quad_sum) into their outputs: 1 / (sum_j exp(x_j) +
// exp(sink)), both terms rescaled to the larger of the running max and the sink; a row that
// saw no key (m = NEG_INF) gets 0.
__device__ __forceinline__ void sink_normalizers(float m_lo, float m_hi, float l_lo, float l_hi,
                                                 float sink_lo, float sink_hi, float& inv_lo,
                                                 float& inv_hi) {
  const float NEG_INF = __int_as_float(0xff800000);
  const float top_lo = fmaxf(m_lo, sink_lo), top_hi = fmaxf(m_hi, sink_hi);
  const float f_lo = m_lo == NEG_INF ? 0.f : exp2f(m_lo - top_lo);
  const float f_hi = m_hi == NEG_INF ? 0.f : exp2f(m_hi - top_hi);
  inv_lo = f_lo / (l_lo * f_lo + exp2f(sink_lo - top_lo));
  inv_hi = f_hi / (l_hi * f_hi + exp2f(sink_hi - top_hi));
}

// The keys a block of queries may see: its rows [row0, row0 + block_m) of L at positions
// from `position`, over keys at positions [k_start, k_start + N), causal and (window > 0)
// within the sliding window. `first_q`/`last_q` are its first and last query positions;
// [lo_block, hi_block) starts on a block_n boundary from k_start and, over several
// splits, is this split's share of whole key blocks (possibly empty).
struct KeyRange {
  int first_q, last_q, lo_block, hi_block;
};

__device__ __forceinline__ KeyRange key_range(int position, int k_start, int N, int L,
                                              int window, int row0, int block_m, int block_n,
                                              int splits, int split) {
  KeyRange r;
  r.first_q = position + row0;
  r.last_q = position + min(row0 + block_m, L) - 1;
  int lo = k_start;
  if (window > 0) lo = max(lo, r.first_q - window + 1);
  const int hi = min(k_start + N, r.last_q + 1);   // exclusive
  r.lo_block = k_start + ((lo - k_start) / block_n) * block_n;
  r.hi_block = hi;
  if (splits > 1) {  // this split's share of the key blocks, whole blocks each
    const int n_blocks = (hi - r.lo_block + block_n - 1) / block_n;
    const int per = (n_blocks + splits - 1) / splits;
    const int first = r.lo_block + split * per * block_n;
    r.hi_block = min(hi, first + per * block_n);
    r.lo_block = first;
  }
  return r;
}

// The end of a block: O / l for the two rows this thread holds (q_lo, q_hi of L, in the
// m16n8 accumulator layout, 4 threads a row, `t` this thread's column pair), after the row
// sums across those threads. `out` points at row 0 of a (L, D_TILES * 8) slab: written as
// bf16 pairs, or with PARTIAL as fp32 (one split's normalized output) and the rows'
// log-sum-exp in natural-log units (-inf where a row saw no key) at lse[q].
template <bool PARTIAL, int D_TILES>
__device__ __forceinline__ void store_rows(const float (&o)[D_TILES][4], float m_lo, float m_hi,
                                           float l_lo, float l_hi, int q_lo, int q_hi, int L,
                                           int t, void* out, float* lse) {
  constexpr int WIDTH = D_TILES * 8;   // a row's elements (the head dim)
  const float NEG_INF = __int_as_float(0xff800000);
  l_lo = quad_sum(l_lo);
  l_hi = quad_sum(l_hi);
  const float inv_lo = l_lo > 0.f ? 1.f / l_lo : 0.f, inv_hi = l_hi > 0.f ? 1.f / l_hi : 0.f;
  if (PARTIAL) {
    float* op = static_cast<float*>(out);
    if (t == 0) {  // one thread of the four that share a row writes its log-sum-exp
      constexpr float LN2 = 0.6931471805599453f;
      if (q_lo < L) lse[q_lo] = l_lo > 0.f ? m_lo * LN2 + logf(l_lo) : NEG_INF;
      if (q_hi < L) lse[q_hi] = l_hi > 0.f ? m_hi * LN2 + logf(l_hi) : NEG_INF;
    }
#pragma unroll
    for (int j = 0; j < D_TILES; ++j) {
      const int c = j * 8 + t * 2;
      if (q_lo < L)
        *reinterpret_cast<float2*>(op + (size_t)q_lo * WIDTH + c) =
            make_float2(o[j][0] * inv_lo, o[j][1] * inv_lo);
      if (q_hi < L)
        *reinterpret_cast<float2*>(op + (size_t)q_hi * WIDTH + c) =
            make_float2(o[j][2] * inv_hi, o[j][3] * inv_hi);
    }
  } else {
    uint32_t* op = static_cast<uint32_t*>(out);   // bf16 pairs: WIDTH / 2 a row
#pragma unroll
    for (int j = 0; j < D_TILES; ++j) {
      const int c = (j * 8 + t * 2) / 2;
      if (q_lo < L)
        op[(size_t)q_lo * (WIDTH / 2) + c] = pack_bf16(o[j][0] * inv_lo, o[j][1] * inv_lo);
      if (q_hi < L)
        op[(size_t)q_hi * (WIDTH / 2) + c] = pack_bf16(o[j][2] * inv_hi, o[j][3] * inv_hi);
    }
  }
}
