// DeepSeek-V4's rotary embedding for MLX on CUDA: interleaved pairs of the last ROPE dims of
// every row rotated by its position's angles (reference inference/model.py
// `apply_rotary_emb`, on the tail as its Attention does), optionally after the weightless
// RMS norm of the row that its queries get first. One warp per row, fp32 arithmetic, one
// rounding to bf16; the MLX-ops form is model/archs/deepseek4/layers.py `rope`.
//
// The body of an `mx.fast.cuda_kernel` (model/kernels/rope.py builds it):
// inputs x bf16 (R, D) row-contiguous, row r at position index (r / HEADS) % P; cosines, sines
// float32 (P, ROPE / 2), the angles of each position (sin negated for the inverse
// rotation); eps float32 [1]. Output out bf16 (R, D).
// Template constants: D (a multiple of 64), ROPE (even, at most D), HEADS (rows per
// position), NORM (1: scale the row by rsqrt(mean(x^2) + eps) first).

constexpr int PAIRS = D / 2;                  // bf16 pairs per row
constexpr int PER_LANE = PAIRS / 32;          // lane j holds pairs j, j + 32, ...
constexpr int FIRST = (D - ROPE) / 2;         // the first rotated pair
constexpr int HALF_ROPE = ROPE / 2;

const int lane = threadIdx.x % 32;
const long row = static_cast<long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
const long R = x_shape[0];
const int P = cosines_shape[0];
if (row >= R) return;
const int pos = static_cast<int>((row / HEADS) % P);

const __nv_bfloat162* src = reinterpret_cast<const __nv_bfloat162*>(x) + row * PAIRS;
__nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out) + row * PAIRS;
float2 v[PER_LANE];
float squares = 0.f;
#pragma unroll
for (int j = 0; j < PER_LANE; ++j) {
  v[j] = __bfloat1622float2(src[lane + 32 * j]);
  squares += v[j].x * v[j].x + v[j].y * v[j].y;
}
float scale = 1.f;
if (NORM) {
#pragma unroll
  for (int o = 16; o; o >>= 1) squares += __shfl_xor_sync(0xffffffff, squares, o);
  scale = rsqrtf(squares / D + eps[0]);
}
#pragma unroll
for (int j = 0; j < PER_LANE; ++j) {
  const int p = lane + 32 * j;
  float a = v[j].x * scale, b = v[j].y * scale;
  if (p >= FIRST) {
    const float c = cosines[pos * HALF_ROPE + p - FIRST], s = sines[pos * HALF_ROPE + p - FIRST];
    const float rotated = a * c - b * s;
    b = a * s + b * c;
    a = rotated;
  }
  dst[p] = __floats2bfloat162_rn(a, b);
}
