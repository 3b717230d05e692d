// Hopper's bulk tensor copy engine (TMA) for the sm_90a kernels compiled through NVRTC
// (flash_attention_sm90.cu with TMA=1; prepended after wgmma.cuh): tensor maps built on the
// device, the copies, and the shared-memory barriers (mbarrier) their completion arrives on
// (PTX ISA, "Tensor copy", "tensormap.replace", "mbarrier").
//
// A tensor map is usually encoded on the host (cuTensorMapEncodeTiled) and passed as a
// __grid_constant__ parameter. `mx.fast.precompiled_cuda_kernel` passes array pointers and
// int/float scalars only, and an array's device address is known only once the graph runs,
// so each block builds its maps here: fields written one by one into zeroed shared memory
// (`tensormap.replace`, as Triton's device-side descriptors do), then copied with a release
// fence to this block's 128 bytes of a global scratch output, where the copy engine reads
// them (a map must sit in global, constant or parameter memory).

// A 3-D tile-mode map of a row-contiguous bf16 tensor (planes, rows, 64 x REGIONS columns)
// whose box is one 128-byte swizzle region: 64 columns x `box_rows` rows x 1 plane, which
// lands in shared memory exactly as wgmma.cuh's `swizzled` lays a region out. Rows and
// planes past the tensor's read as zeros. Every lane of one warp calls it; `staging` is 128
// bytes of shared memory (128-byte aligned), `map` 128 bytes of global memory (64-byte
// aligned), `base` the tensor's device address.
__device__ __forceinline__ void build_tensor_map(uint32_t staging, void* map, const void* base,
                                                 int columns, int rows, int planes,
                                                 int box_rows, int lane) {
  asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(staging + 4 * lane), "r"(0) : "memory");
  __syncwarp();
  if (lane == 0) {
    const uint64_t row_bytes = (uint64_t)columns * 2, plane_bytes = row_bytes * rows;
    asm volatile(
        "tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%0], %1;\n"
        "tensormap.replace.tile.rank.shared::cta.b1024.b32 [%0], 2;\n"   // rank - 1
        "tensormap.replace.tile.box_dim.shared::cta.b1024.b32 [%0], 0, 64;\n"
        "tensormap.replace.tile.box_dim.shared::cta.b1024.b32 [%0], 1, %2;\n"
        "tensormap.replace.tile.box_dim.shared::cta.b1024.b32 [%0], 2, 1;\n"
        "tensormap.replace.tile.global_dim.shared::cta.b1024.b32 [%0], 0, %3;\n"
        "tensormap.replace.tile.global_dim.shared::cta.b1024.b32 [%0], 1, %4;\n"
        "tensormap.replace.tile.global_dim.shared::cta.b1024.b32 [%0], 2, %5;\n"
        "tensormap.replace.tile.global_stride.shared::cta.b1024.b64 [%0], 0, %6;\n"
        "tensormap.replace.tile.global_stride.shared::cta.b1024.b64 [%0], 1, %7;\n"
        "tensormap.replace.tile.element_stride.shared::cta.b1024.b32 [%0], 0, 1;\n"
        "tensormap.replace.tile.element_stride.shared::cta.b1024.b32 [%0], 1, 1;\n"
        "tensormap.replace.tile.element_stride.shared::cta.b1024.b32 [%0], 2, 1;\n"
        "tensormap.replace.tile.elemtype.shared::cta.b1024.b32 [%0], 10;\n"   // .bf16
        "tensormap.replace.tile.interleave_layout.shared::cta.b1024.b32 [%0], 0;\n"
        "tensormap.replace.tile.swizzle_mode.shared::cta.b1024.b32 [%0], 3;\n"   // 128 B
        "tensormap.replace.tile.fill_mode.shared::cta.b1024.b32 [%0], 0;\n"   // zeros
        :: "r"(staging), "l"(base), "r"(box_rows), "r"(columns), "r"(rows), "r"(planes),
           "l"(row_bytes), "l"(plane_bytes)
        : "memory");
  }
  __syncwarp();
  asm volatile(
      "tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu.sync.aligned"
      " [%0], [%1], 128;\n" :: "l"(map), "r"(staging) : "memory");
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" :: "l"(map)
               : "memory");
}

// Copy the box at (column, row, plane) of `map` to shared memory at `dst` (1,024-byte
// aligned for the swizzle), its bytes counted on the barrier at `bar`.
__device__ __forceinline__ void tma_load(uint32_t dst, const void* map, uint32_t bar,
                                         int column, int row, int plane) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n"
      :: "r"(dst), "l"(map), "r"(bar), "r"(column), "r"(row), "r"(plane) : "memory");
}

__device__ __forceinline__ void mbarrier_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count)
               : "memory");
}

// Barriers initialized by one thread, visible to the block's threads and to the copy
// engine (then a __syncthreads).
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// This thread's arrival, announcing `bytes` the copy engine will add to the phase.
__device__ __forceinline__ void mbarrier_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar),
               "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}

// Wait until the barrier's phase of parity `parity` (0, 1, 0, ... for its uses) completes.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, int parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  }
}
